"""The Serving page's long work, run in the page's own script where a click reaches it: its steps, its sweep and
its profile. Streamlit stops a script only where it draws, so the work redraws a bar as it goes (after a layer of a
pass, or between two timed steps; at most every RUN_REDRAW_S): a click on Stop, or on anything else, ends it there.
A stopped step keeps what it had done (batch.Server.step); a stopped measurement is dropped. Work run from a
button's callback could not be stopped and would show nothing until it ended."""

from __future__ import annotations

import time

import streamlit as st

from model.engine.batch import Server, StepProgress
from ui.i18n import t
from ui.session import RUN_REDRAW_S, attempt


class StopBar:
    """A Stop button and a progress bar, redrawn at most every RUN_REDRAW_S; `clear()` takes both away."""

    def __init__(self, key: str, text: str):
        self.stop = st.empty()
        self.stop.button(t("decode.stop"), key=key, type="primary", icon=":material/stop:")
        self.bar = st.progress(0.0, text=text)
        self.last_drawn = time.monotonic()

    def draw(self, done: float, text: str) -> None:
        if time.monotonic() - self.last_drawn >= RUN_REDRAW_S:
            self.bar.progress(min(1.0, done), text=text)
            self.last_drawn = time.monotonic()

    def clear(self) -> None:
        self.stop.empty()
        self.bar.empty()


class StepBar:
    """How far the step under way is, and in a run to the end how many requests are served."""

    def __init__(self, server: Server, to_end: bool):
        self.server, self.to_end = server, to_end
        self.stop_bar = StopBar("serving_stop", t("serving.running"))

    def show(self, progress: StepProgress) -> None:
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
        self.stop_bar.draw(done, text)


def run_steps(server: Server, to_end: bool) -> str | None:
    """One step, or steps until every request is served, under a StepBar; the sentence saying why a step failed,
    or None."""
    bar = StepBar(server, to_end)
    error = None
    while not server.finished and error is None:
        _, error = attempt(lambda: server.step(bar.show))
        if not to_end:
            break
    bar.stop_bar.clear()
    return error
