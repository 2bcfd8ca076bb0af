"""What a widget's click reruns: only the fragment that shows what changed, or the whole page."""

from __future__ import annotations

import streamlit as st


def redraw_only(fragment: str | None) -> None:
    """From a widget callback: rerun only the named fragment instead of the whole page (None: the whole page).
    A click that interrupted Run to end reruns the whole page, which clears the run's progress bar; so does one
    that came while a whole-page run a fragment asked for (rerun_whole_page) had not yet run to its end."""
    if fragment is not None and not st.session_state.get("running") and not st.session_state.get("whole_page_due"):
        st.rerun(fragment)


def rerun_whole_page() -> None:
    """From a fragment: rerun the whole page. A click's run interrupts a run in progress; were it narrowed to a
    fragment, what only the whole-page run draws (the Decode page's verdict) would stay as it was. So until a
    whole-page run has reached the page's end (app.py clears the mark), clicks rerun the whole page. A page that
    ends in st.stop() (Decode before its prefill) leaves the mark: clicks then redraw whole pages until one runs to
    its end, which is slower, never stale."""
    st.session_state.whole_page_due = True
    st.rerun()
