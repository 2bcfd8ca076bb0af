"""What makes a page a projector's page: its key figure first, its settings folded, presenter mode, and Play.

Every page puts its one key picture inside key_figure() on the first 1280 × 720 screen (the browser tests find it by
its key), folds its settings into settings() and its explanations into why(). Presenter mode (the sidebar's toggle
or ?present=1) enlarges every text and hides the explanations behind one "Why?" toggle above the page. The stepping
pages (Decode, Serving, Paged KV, Tiers, Speculative) draw play_row(): Play presses their own Next at a watchable
pace until Pause or the end of the run, so the state after n ticks is the state after n Next presses.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import streamlit as st

from ui.i18n import lang, number, t

KEY_FIGURE = "key-figure"
PLAY_SPEEDS = (0.5, 1.0, 2.0)  # steps per second the speed control offers; one a second by default
PLAY_DEFAULT_SPEED = 1.0

# Presenter mode: Streamlit sizes its text in rem, so a 20 px root makes body text 20 px and its 0.875-rem labels
# and captions 17.5 px; the app's own pieces are sized in rem too (ui/widgets.CSS). The sidebar is folded away (its
# toggle brings it back), and what only explains hides until the "Why?" toggle is on.
PRESENT_CSS = """
<style>
html{font-size:20px}
code{font-size:.8em !important}
[data-testid='stSidebar'][aria-expanded='true']{min-width:300px}
</style>
"""
HIDE_WHY_CSS = """
<style>
[data-testid='stCaptionContainer'],.dl-caption,[class*='st-key-why-']{display:none}
</style>
"""


def init_presenter() -> None:
    """First run of a session: ?present=1 in the URL turns presenter mode on; afterwards the toggle's value is
    the session's own (kept across pages and language switches) and written back into the URL."""
    if "present" not in st.session_state:
        st.session_state.present = st.query_params.get("present") == "1"
    if "why" not in st.session_state:
        st.session_state.why = False
    st.session_state.present = st.session_state.present
    st.session_state.why = st.session_state.why
    if st.session_state.present:
        st.query_params["present"] = "1"
    elif "present" in st.query_params:
        del st.query_params["present"]


def presenter() -> bool:
    return bool(st.session_state.get("present", False))


def presenter_toggle() -> None:
    """The sidebar's switch (drawn by app.py)."""
    st.toggle(t("classroom.present"), key="present", help=t("classroom.present_help"))


def presenter_style() -> None:
    """Presenter mode's style sheet and its "Why?" toggle, above every page (drawn by app.py once per whole-page
    run: a style element inside a fragment would be drawn again with every click)."""
    if not presenter():
        return
    st.html(PRESENT_CSS)
    st.toggle(t("classroom.why"), key="why", help=t("classroom.why_help"))
    if not st.session_state.why:
        st.html(HIDE_WHY_CSS)


def key_figure():
    """The container of the page's key picture: on the first screen, as wide as the main column."""
    return st.container(key=KEY_FIGURE)


def settings(page: str, expanded: bool = False):
    """The page's settings, folded into one row that opens on a click."""
    return st.expander(t("classroom.settings"), expanded=expanded, icon=":material/tune:", key=f"{page}_settings")


def why(name: str):
    """A container of explanations: shown outside presenter mode, and in it only while "Why?" is on."""
    return st.container(key=f"why-{name}")


def localised(figure: dict) -> dict:
    """A plotly figure (ui/charts) in the session's number format (Vietnamese 1.024,5; English 1,024.5: plotly's
    `separators`, decimal mark first) and, in presenter mode, with its text at 18 px and more.

    Presenter mode names every size: Streamlit's theme gives the legend and the axis titles their own px sizes,
    which CI once measured at 14 px on a presenter-mode chart (17.5 px on another machine)."""
    layout = dict(figure["layout"], separators=",." if lang() == "vi" else ".,")
    if presenter():
        big = dict(size=20, color="#212529")
        layout["font"] = big
        layout["legend"] = dict(layout.get("legend", {}), font=big)
        for axis in [k for k in layout if k.startswith(("xaxis", "yaxis"))]:
            layout[axis] = dict(layout[axis], tickfont=dict(size=18, color="#212529"),
                                title=dict(layout[axis].get("title", {}), font=big))
    return dict(figure, layout=layout)


def play_row(prefix: str, finished: Callable[[], bool], step: Callable[[], None], disabled: bool = False) -> None:
    """Play / Pause and the pace, drawn outside the page's fragments (so a click reruns the whole page and starts or
    stops the ticker). While playing, a ticker calls `step` — the page's own Next callback — every 1 / pace
    seconds, then reruns the whole page; it stops itself at the end of the run."""
    playing_key, speed_key, tick_key = prefix + "_playing", prefix + "_speed", prefix + "_tick_at"
    if playing_key not in st.session_state:
        st.session_state[playing_key] = False
    if speed_key not in st.session_state:
        st.session_state[speed_key] = PLAY_DEFAULT_SPEED
    st.session_state[speed_key] = st.session_state[speed_key]  # kept when another page's run does not draw it
    playing = st.session_state[playing_key] and not finished() and not disabled
    st.session_state[playing_key] = playing

    def toggle() -> None:
        st.session_state[playing_key] = not st.session_state[playing_key]
        st.session_state[tick_key] = time.monotonic()  # the first step comes one interval after the click

    with st.container(horizontal=True, vertical_alignment="center", key=prefix + "_play_row"):
        st.button(t("action.pause") if playing else t("action.play"), key=prefix + "_play",
                  icon=":material/pause:" if playing else ":material/play_circle:", on_click=toggle,
                  disabled=disabled or (finished() and not playing))
        paces = {s: t("classroom.pace_one" if s == 1 else "classroom.pace_option", pace=number(s, "g"))
                 for s in PLAY_SPEEDS}  # labels made now: AppTest calls format_func outside the script run
        st.segmented_control(t("classroom.pace"), PLAY_SPEEDS, key=speed_key, required=True, format_func=paces.get,
                             label_visibility="collapsed")
    if playing:
        interval = 1.0 / float(st.session_state[speed_key])
        st.fragment(_tick, run_every=interval, key=prefix + "_ticker")(tick_key, interval, finished, step)


def _tick(tick_key: str, interval: float, finished: Callable[[], bool], step: Callable[[], None]) -> None:
    """One beat of Play: a step when one interval has passed since the last (the ticker's own first run, inside the
    whole-page run that drew it, does nothing), then the whole page drawn again with the step."""
    now = time.monotonic()
    if now - st.session_state.get(tick_key, 0.0) < 0.8 * interval:
        return
    st.session_state[tick_key] = now
    if not finished():
        step()
    st.rerun()
