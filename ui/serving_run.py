"""The Serving page's steps, run in the page's own script where a click reaches them. Streamlit stops a script only
where it draws, so a step redraws its bar as it goes, after a layer of one of its passes (at most every
RUN_REDRAW_S): a click on Stop, or on anything else, ends the run there, and the server keeps what the step had
done (batch.Server.step). A step run from a button's callback could not be stopped and would show nothing until
it ended."""

from __future__ import annotations

import time

import streamlit as st

from model.engine.batch import Server, StepProgress
from ui.i18n import t
from ui.session import RUN_REDRAW_S, attempt


class StepBar:
    """Stop and a progress bar: how far the step under way is, and in a run to the end how many requests are
    served."""

    def __init__(self, server: Server, to_end: bool):
        self.server, self.to_end = server, to_end
        self.stop = st.empty()
        self.stop.button(t("decode.stop"), key="serving_stop", type="primary", icon=":material/stop:")
        self.bar = st.progress(0.0, text=t("serving.running"))
        self.last_drawn = time.monotonic()

    def show(self, progress: StepProgress) -> None:
        if time.monotonic() - self.last_drawn < RUN_REDRAW_S:
            return
        if progress.prefilled < progress.prefills:
            text = t("serving.progress_prefill", step=progress.step, k=progress.prefilled + 1, n=progress.prefills,
                     layer=progress.layer, layers=progress.layers)
        else:
            text = t("serving.progress_decode", step=progress.step, rows=progress.rows, layer=progress.layer,
                     layers=progress.layers)
        done = progress.done
        if self.to_end:
            served = sum(r.left_step is not None for r in self.server.requests.values())
            total = len(self.server.requests)
            text = t("serving.progress_served", served=served, total=total) + " · " + text
            done = served / total
        self.bar.progress(done, text=text)
        self.last_drawn = time.monotonic()

    def clear(self) -> None:
        self.stop.empty()
        self.bar.empty()


def run_steps(server: Server, to_end: bool) -> str | None:
    """One step, or steps until every request is served, under a StepBar; the sentence saying why a step failed,
    or None."""
    bar = StepBar(server, to_end)
    error = None
    while not server.finished and error is None:
        _, error = attempt(lambda: server.step(bar.show))
        if not to_end:
            break
    bar.clear()
    return error
