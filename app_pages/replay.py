"""Replay: a recorded Decode run (trace JSON) step by step, or a speculative run (speculate JSON) round by round,
without loading its model; re-run it for real on demand.

Nothing here calls the model loader until "Re-run for real" is pressed: a class can open SmolLM2's recording on a
machine that has not loaded SmolLM2 (tests/test_replay.py replaces the loader with one that fails).
"""

import streamlit as st

from model.engine.counting import CacheShape
from model.engine.generate import CHECK_TOLERANCE
from model.engine.tokenizer import joined_characters
from model.recording.replay import (
    DECODE,
    MAX_RECORDING_BYTES,
    PROB_TOLERANCE,
    SHIPPED,
    TRACE_V1,
    RecordedTokens,
    read_recording,
    recording_kind,
    replayed_run,
    rerun,
    shipped_recording,
)
from model.weights.catalog import FETCHED, list_models, settings
from ui import svg
from ui.controls import cache_by_layer_kind
from ui.errors import attempt, callback_error_here, guarded_in_callback
from ui.i18n import labels, number, t
from ui.models import shared_model
from ui.speculative_round import draw_counts, draw_round, draw_sequence
from ui.state import keep_across_pages
from ui.widgets import (
    BACK_KEY,
    NEXT_KEY,
    box_html,
    choice,
    heading_html,
    md_escape,
    paragraph_html,
    probability_bars_html,
    table_html,
    token_strip_html,
)

TABLE_ROWS = 6  # as on Decode: the table shows the latest steps, the chart all of them
SOURCES = [*SHIPPED, "upload"]
# the browser's uploader refuses a larger file on its own, without a word to the page, which goes on replaying the
# previous one; up to here the file reaches on_upload, which refuses one over MAX_RECORDING_BYTES with a sentence
UPLOAD_BOX_MB = 8

keep_across_pages({"replay_source": SHIPPED[0], "replay_step": 0, "replay_uploaded": None,
                   "replay_uploaded_name": None, "replay_rerun": None})
st.title(t("replay.title"))
st.caption(t("replay.intro"))


def on_source_change() -> None:
    st.session_state.replay_step = 0
    st.session_state.replay_rerun = None


def on_upload() -> None:
    """The chosen file, read once: the parsed run stays in the session (the uploader forgets its file on another
    page); a bad file says why and leaves no run."""
    on_source_change()
    file = st.session_state.replay_file
    st.session_state.replay_uploaded, st.session_state.replay_uploaded_name = None, None
    if file is not None:
        st.session_state.replay_uploaded = guarded_in_callback(lambda: read_recording(file.getvalue()))
        st.session_state.replay_uploaded_name = file.name


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
callback_error_here()
if source == "upload":
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
with st.container(horizontal=True, vertical_alignment="center"):
    st.button(t("decode.next"), key="replay_next", type="primary", icon=":material/skip_next:",
              disabled=index == last, on_click=on_step, args=(1,), shortcut=NEXT_KEY)
    st.button(t("decode.back"), key="replay_back", icon=":material/undo:", disabled=index == 0, on_click=on_step,
              args=(-1,), shortcut=BACK_KEY)
    st.markdown("**" + (t("replay.step_of", step=index, last=last) if kind == DECODE
                        else t("replay.round_of", round=index + 1, rounds=last + 1)) + "**")


def stop_html(run: dict, at_end: bool) -> str:
    """Where the recorded run stopped, once the replay reaches its last step or round."""
    reason = run["output"]["stop_reason"]
    if not at_end:
        return paragraph_html(t("replay.not_stopped"), "dl-caption")
    if reason is None:
        return box_html(t("replay.saved_before_stop"), "note")
    if reason == "cancelled":
        return box_html(t("replay.stop_cancelled"), "note")
    return box_html(t("decode.stopped", reason=t("stop." + reason)), "note")


def chosen_text(run: dict, step: dict) -> str:
    """The chosen token and the settings it was drawn with: the step's own; a trace/1 file kept only the run's last
    ones, which the sentence says, without calling the step greedy or sampled."""
    if run["schema"] == TRACE_V1:
        key, s = "replay.chosen_last_settings", run["settings"]
    else:
        s = step["settings"]
        key = "replay.chosen_greedy" if s["temperature"] == 0 else "replay.chosen"
    return t(key, token=md_escape(step["chosen_token"]), id=step["chosen_id"], p=f"{step['chosen_prob']:.3f}",
             temperature=s["temperature"], top_k=s["top_k"] if s["top_k"] is not None else t("replay.top_k_off"),
             top_p=s["top_p"], seed=s["seed"], n=len(step["top"]), schema=run["schema"])


def step_html(run: dict, index: int) -> str:
    """What the recording holds about one step, drawn as Decode draws it."""
    step, m = run["steps"][index], run["model"]
    prompt = run["prompt"]
    tokens = prompt["tokens"] + [x["chosen_token"] for x in run["steps"][: index + 1]]
    ids = prompt["ids"] + [x["chosen_id"] for x in run["steps"][: index + 1]]
    kinds = [""] * len(prompt["ids"]) + ["new"] * (index + 1)
    kinds[-1] = "current"
    joined = joined_characters(RecordedTokens(run), ids)
    legend = paragraph_html(t("tokens.byte_legend"), "dl-caption") if any(c is not None for c in joined) else ""
    fed = dict(zip(prompt["ids"], prompt["tokens"])) | {x["chosen_id"]: x["chosen_token"] for x in run["steps"]}
    summary = paragraph_html(t(
        "decode.step_summary", step=index, phase=t("phase." + step["phase"]),
        fed=md_escape(", ".join(fed.get(i, str(i)) for i in step["input_ids"])), pos=step["positions"][0],
        cache=step["cache_len"], ms=f"{step['ms']:.2f}", device=m["device"], dtype=m["dtype"]))

    attention = heading_html(t("decode.attention")) + box_html(t(
        "replay.attention_absent", layers=m["n_layers"], heads=m["n_heads"], queries=len(step["input_ids"]),
        keys=step["cache_len"]), "note")

    names = {k: t("sampling." + k) for k in ("chosen", "other")}
    top = step["top"]
    sampling = (heading_html(t("decode.sampling"))
                + probability_bars_html([row["token"] for row in top], [row["prob"] for row in top],
                                        ["chosen" if row["id"] == step["chosen_id"] else "other" for row in top],
                                        names)
                + paragraph_html(chosen_text(run, step)))

    shown = run["steps"][: index + 1]
    shape = CacheShape(m["n_layers"], m["n_kv_heads"], m["d_head"], m["bytes_per_element"],
                       len(m["sliding_layers"]), m["sliding_window"])
    per_position = shape.bytes(1)
    cache = (
        heading_html(t("decode.cache"))
        + svg.line_chart_svg(list(range(len(shown))),
                             {t("decode.measured"): [x["cache_bytes"] for x in shown],
                              t("decode.formula"): [x["cache_bytes_formula"] for x in shown]},
                             t("decode.step_axis"), t("decode.bytes_axis"), t("decode.cache"),
                             dashed=(t("decode.formula"),), number=number)
        + table_html([t("decode.step_axis"), t("decode.cache_len"), t("decode.measured"), t("decode.formula")],
                     [[x["index"], x["cache_len"], number(x["cache_bytes"]), number(x["cache_bytes_formula"])]
                      for x in shown[-TABLE_ROWS:]])
        + paragraph_html(cache_by_layer_kind(shape, step["cache_len"], step["cache_bytes"]) or t(
            "decode.formula_text", layers=m["n_layers"], kv=m["n_kv_heads"], d=m["d_head"],
            b=m["bytes_per_element"], per_position=number(per_position), positions=number(step["cache_len"]),
            total=number(step["cache_bytes_formula"])), "dl-caption"))

    if "max_abs_logit_diff" in step:
        diff = step["max_abs_logit_diff"]
        passed = diff <= CHECK_TOLERANCE
        check = (f'<div class="dl-metric">{t("decode.check_metric")}<b>{diff:.2e}</b></div>'
                 + box_html(t("decode.check_result_pass" if passed else "decode.check_result_fail",
                              tol=CHECK_TOLERANCE, n=step["cache_len"]), "pass" if passed else "fail"))
    else:
        check = paragraph_html(t("replay.check_absent"), "dl-caption")
    answer = (heading_html(t("decode.check")) + check + heading_html(t("decode.answer"))
              + paragraph_html(t("decode.answer_text", text=md_escape(step["answer"]) or "∅", n=index + 1))
              + stop_html(run, index == len(run["steps"]) - 1))
    return (token_strip_html(tokens, ids, kinds, joined) + legend + summary
            + f'<div class="dl-grid"><div>{attention}</div><div>{sampling}</div><div>{cache}</div>'
            f"<div>{answer}</div></div>")


if kind == DECODE:
    st.html(step_html(run, index))
else:  # drawn by the Speculative page's own code, from a run with no model behind it
    replayed, token = replayed_run(run, index + 1), RecordedTokens(run).token
    draw_sequence(replayed, token)
    draw_round(replayed, token, replayed.rounds[-1].settings.greedy)
    draw_counts(replayed, token)
    st.subheader(t("speculative.answer"))
    st.markdown(t("speculative.answer_text", text=md_escape(run["rounds"][index]["answer"]) or "∅",
                  n=len(replayed.new_ids)))
    st.html(stop_html(run, index == last))

st.subheader(t("replay.rerun"))
name = m["name"]
if name in list_models(settings().models_dir):
    st.caption(t("replay.rerun_help", model=name, tol=PROB_TOLERANCE) if kind == DECODE
               else t("replay.rerun_help_rounds", model=name, draft=md_escape(run["draft"]), tol=PROB_TOLERANCE))
    st.button(t("replay.rerun"), key="replay_rerun_button", icon=":material/play_arrow:", on_click=on_rerun,
              args=(run,))
    done = st.session_state.replay_rerun
    if isinstance(done, str):
        st.error(done)
    elif done is not None:
        found = {"device": done.device, "dtype": done.dtype}
        if done.matches and kind == DECODE:
            st.success(t("replay.rerun_match", model=name, n=done.steps, tol=PROB_TOLERANCE,
                         gap=f"{done.max_prob_diff:.1e}", **found))
        elif done.matches:
            st.success(t("replay.rerun_match_rounds", model=name, draft=md_escape(run["draft"]), n=done.steps,
                         tol=PROB_TOLERANCE, gap=f"{done.max_prob_diff:.1e}", **found))
        else:
            d = done.difference
            found |= {"what": t("replay.what_" + d.what, tol=PROB_TOLERANCE), "recorded": md_escape(d.recorded),
                      "now": md_escape(d.now)}
            st.error(t("replay.rerun_differs", step=d.step, **found) if kind == DECODE
                     else t("replay.rerun_differs_round", round=d.step + 1, **found))
elif name in FETCHED:
    st.info(t("replay.model_absent", model=name))
else:
    st.info(t("replay.model_unknown", model=md_escape(name)))
