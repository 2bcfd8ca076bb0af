"""A Run of N training steps inside a page's script run, where a click reaches it (Train, Fine-tune), and what the
page says on its next run when a click stopped it."""

from __future__ import annotations

import time
from collections.abc import Callable

import streamlit as st

from model.training.train import CheckpointStore, limits
from ui.errors import guarded

LIVE_REDRAW_S = 0.5


def run_steps(mark: str, trainer, count: Callable[[], int], step: Callable[[], object], n: int, stop_label: str,
              stop_key: str, progress: Callable[[int], str], figure: Callable[[], dict], chart_key: str) -> None:
    """n calls of `step` under a Stop button, a progress bar and a live chart (redrawn at most every LIVE_REDRAW_S).
    Any click, on Stop or on any other widget, ends this script run and the loop with it: session_state[mark] then
    still holds the run, for interrupted_run. After the n-th step the page runs again, so that every part of it
    shows the last step and the live chart is gone; after a failed step its sentence stays on screen."""
    st.session_state[mark] = (trainer, count, count(), n)
    st.button(stop_label, key=stop_key, icon=":material/stop:")  # a click stops the loop below
    bar, live, drawn = st.progress(0.0), st.empty(), 0.0
    for i in range(n):
        if guarded(step) is None:
            st.session_state[mark] = None
            return
        bar.progress((i + 1) / n, text=progress(i + 1))
        if time.perf_counter() - drawn > LIVE_REDRAW_S:
            live.plotly_chart(figure(), key=f"{chart_key}_{i}")
            drawn = time.perf_counter()
    st.session_state[mark] = None
    st.rerun()


def save_checkpoint(trainer):
    """The trainer's model saved into this session's checkpoint store (Train's Save, Fine-tune's "Use this model"):
    (its name, its files) and listed in the sidebar from the next run, or None with the sentence drawn."""
    if st.session_state.train_store is None:
        st.session_state.train_store = CheckpointStore(limits().max_checkpoints)
    store = st.session_state.train_store
    saved = guarded(lambda: store.save(trainer, in_use=st.session_state.model_name))
    if saved is not None:
        st.session_state.session_checkpoints = {name: str(path) for name, path in store.saved.items()}
        st.session_state.checkpoint_bases = {name: store.bases[name] for name in store.saved}
    return saved


def interrupted_run(mark: str) -> tuple[object, int, int] | None:
    """The Run that a click stopped during the previous script run, once: (the trainer it ran on, the steps it
    made, the steps asked). The page compares that trainer with its own: another one means Reset came between."""
    held = st.session_state.get(mark)
    if held is None:
        return None
    st.session_state[mark] = None
    trainer, count, first, asked = held
    return trainer, count() - first, asked
