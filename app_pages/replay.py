"""Replay: a recorded Decode run (trace JSON) step by step, or a speculative run (speculate JSON) round by round,
without loading its model; re-run it for real on demand.

Nothing here calls the model loader until "Re-run for real" is pressed: a class can open SmolLM2's recording on a
machine that has not loaded SmolLM2 (tests/test_replay.py replaces the loader with one that fails).
"""

import streamlit as st

from model.errors import InputError
from model.recording.replay import (
    DECODE,
    MAX_RECORDING_BYTES,
    PROB_TOLERANCE,
    SHIPPED,
    RecordedTokens,
    read_recording,
    recording_kind,
    replayed_run,
    rerun,
    shipped_recording,
)
from model.weights.catalog import FETCHED, list_models, settings
from ui.classroom import key_figure, why
from ui.errors import attempt, error_sentence
from ui.i18n import labels, scientific, t
from ui.models import shared_model
from ui.speculative_round import draw_counts, draw_round, draw_sequence
from ui.state import keep_across_pages
from ui.step_view import recorded_step, recorded_stop_html, step_view_html
from ui.widgets import (
    BACK_KEY,
    NEXT_KEY,
    box_html,
    choice,
    md_escape,
)

TABLE_ROWS = 6  # as on Decode: the table shows the latest steps, the chart all of them
SOURCES = [*SHIPPED, "upload"]
# the browser's uploader refuses a larger file on its own, without a word to the page, which goes on replaying the
# previous one; up to here the file reaches on_upload, which refuses one over MAX_RECORDING_BYTES with a sentence
UPLOAD_BOX_MB = 8

keep_across_pages({"replay_source": SHIPPED[0], "replay_step": 0, "replay_uploaded": None,
                   "replay_uploaded_name": None, "replay_refusal": None, "replay_rerun": None})
st.title(t("replay.title"))


def on_source_change() -> None:
    """Another recording: its first step, no verdict, and no refusal (the box that held a refused file is gone)."""
    st.session_state.replay_step, st.session_state.replay_rerun, st.session_state.replay_refusal = 0, None, None


def on_upload() -> None:
    """The chosen file, read once: the parsed run stays in the session (the uploader forgets its file on another
    page); a bad file leaves no run and its refusal, said under the box until another file is chosen (not once:
    a rerun or a language switch must not leave the refused file in the box with no word of why)."""
    on_source_change()
    file, state = st.session_state.replay_file, st.session_state
    state.replay_uploaded, state.replay_uploaded_name = None, None
    if file is not None:
        try:
            state.replay_uploaded, state.replay_uploaded_name = read_recording(file.getvalue()), file.name
        except InputError as refused:
            state.replay_refusal = refused


def on_step(delta: int) -> None:
    st.session_state.replay_step += delta


def on_rerun(run: dict) -> None:
    """The verdict, or why the model could not run the recording, as a sentence: either is drawn under the button."""
    result, error = attempt(lambda: rerun(shared_model(run["model"]["name"], st.session_state.device), run))
    st.session_state.replay_rerun = result if error is None else error


with st.container(horizontal=True, vertical_alignment="bottom"):
    source = choice(st.selectbox, t("replay.source"), SOURCES, key="replay_source", width=360,
                    format_func=labels("replay.source_", SOURCES).get, on_change=on_source_change)
    if source == "upload":
        st.file_uploader(t("replay.upload"), type=["json"], key="replay_file", on_change=on_upload,
                         max_upload_size=UPLOAD_BOX_MB,
                         help=t("replay.upload_help", mb=MAX_RECORDING_BYTES // 2**20))
if source == "upload":
    if st.session_state.replay_refusal is not None:
        st.error(error_sentence(st.session_state.replay_refusal))
    run = st.session_state.replay_uploaded
    if run is None:
        st.info(t("replay.upload_first"))
        st.stop()
    st.caption(t("replay.replaying", name=md_escape(st.session_state.replay_uploaded_name), box=UPLOAD_BOX_MB))
else:
    run = shipped_recording(source)

kind, m = recording_kind(run), run["model"]
entries = run["steps"] if kind == DECODE else run["rounds"]  # what Next and Back move over
last = len(entries) - 1
index = st.session_state.replay_step = min(max(int(st.session_state.replay_step), 0), last)
recorded = {"model": md_escape(m["name"]), "device": md_escape(m["device"]), "dtype": md_escape(m["dtype"]),
            "date": md_escape(run["recorded_at"]), "n": len(entries)}
if kind == DECODE:
    st.html(box_html(t("replay.banner", **recorded), "note"))
else:
    st.html(box_html(t("replay.banner_rounds", draft=md_escape(run["draft"]), gamma=run["gamma"], **recorded),
                     "note"))
figure = key_figure()
with figure, st.container(horizontal=True, vertical_alignment="center"):
    st.button(t("action.next"), key="replay_next", type="primary", icon=":material/skip_next:",
              disabled=index == last, on_click=on_step, args=(1,), shortcut=NEXT_KEY)
    st.button(t("action.back"), key="replay_back", icon=":material/undo:", disabled=index == 0, on_click=on_step,
              args=(-1,), shortcut=BACK_KEY)
    st.markdown("**" + (t("replay.step_of", step=index, last=last) if kind == DECODE
                        else t("replay.round_of", round=index + 1, rounds=last + 1)) + "**")


with figure:
    if kind == DECODE:
        st.html(step_view_html(recorded_step(run, index)))
    else:  # drawn by the Speculative page's own code, from a run with no model behind it
        replayed, token = replayed_run(run, index + 1), RecordedTokens(run).token
        draw_sequence(replayed, token)
        draw_round(replayed, token, replayed.rounds[-1].settings.greedy)
        draw_counts(replayed, token)
        st.subheader(t("speculative.answer"))
        st.markdown(t("speculative.answer_text", text=md_escape(run["rounds"][index]["answer"]) or "∅",
                      n=len(replayed.new_ids)))
        st.html(recorded_stop_html(run, index == last))
with why("replay"):
    st.caption(t("replay.intro"))

st.subheader(t("replay.rerun"))
name = m["name"]
tol = scientific(PROB_TOLERANCE)  # as the session writes numbers: 10⁻⁴
if name in list_models(settings().models_dir):
    st.caption(t("replay.rerun_help", model=name, tol=tol) if kind == DECODE
               else t("replay.rerun_help_rounds", model=name, draft=md_escape(run["draft"]), tol=tol))
    st.button(t("replay.rerun"), key="replay_rerun_button", icon=":material/play_arrow:", on_click=on_rerun,
              args=(run,))
    done = st.session_state.replay_rerun
    if isinstance(done, str):
        st.error(done)
    elif done is not None:
        found = {"device": done.device, "dtype": done.dtype}
        if done.matches and kind == DECODE:
            st.success(t("replay.rerun_match", model=name, n=done.steps, tol=tol,
                         gap=scientific(done.max_prob_diff), **found))
        elif done.matches:
            st.success(t("replay.rerun_match_rounds", model=name, draft=md_escape(run["draft"]), n=done.steps,
                         tol=tol, gap=scientific(done.max_prob_diff), **found))
        else:
            d = done.difference
            found |= {"what": t("replay.what_" + d.what, tol=tol), "recorded": md_escape(d.recorded),
                      "now": md_escape(d.now)}
            st.error(t("replay.rerun_differs", step=d.step, **found) if kind == DECODE
                     else t("replay.rerun_differs_round", round=d.step + 1, **found))
elif name in FETCHED:
    st.info(t("replay.model_absent", model=name))
else:
    st.info(t("replay.model_unknown", model=md_escape(name)))
