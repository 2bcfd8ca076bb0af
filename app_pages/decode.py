"""Decode: one token per step over a KV cache that grows by one position; sampling; the recompute check.

Everything a step changes sits in one fragment: Next, Back, the sampling controls and the layer and head rerun it
alone, not the sidebar, the title or the controls. The browser's work per click grows with the number of elements
it redraws, hardly with their size, so the fragment is the four buttons and one piece of HTML: the strip, the
attention, the probabilities, the cache (two SVG charts among them), the check and the answer. Run to end is a
whole-page run instead, so that its Stop button can interrupt it.
"""

from functools import partial
from html import escape

import streamlit as st

from model.engine import generate
from model.engine.counting import cache_bytes_formula
from model.engine.generate import CHECK_TOLERANCE
from model.engine.sampling import most_probable
from model.engine.tokenizer import joined_characters
from ui import svg
from ui.controls import cache_by_layer_kind, layer_head_selectors, prompt_form, sampling_controls
from ui.errors import callback_error_here
from ui.i18n import number, t
from ui.models import page_start
from ui.pages import page
from ui.predict import guess_inputs, on_next_with_guess, reveal_html
from ui.probes import probe_controls, probes_html
from ui.process import CHECKS
from ui.reruns import redraw_only, rerun_whole_page
from ui.run import (
    generation,
    mark_cancelled_run,
    on_back,
    request_run_to_end,
    reset,
    run_as_trace_json,
    run_to_end,
    strip_tokens,
)
from ui.step_keys import clicks_marker, count_click, queue_step_keys
from ui.widgets import (
    BACK_KEY,
    NEXT_KEY,
    attention_row_html,
    box_html,
    heading_html,
    md_escape,
    paragraph_html,
    probability_bars_html,
    shown,
    table_html,
    token_strip_html,
    window_of,
)

TOP_BARS = 12
# a long context's strip and attention row show the start, the latest positions (and the row its heaviest keys),
# each run of the others folded into one chip: a Next then redraws about 50 chips, not 2 per position
# (benchmarks/click_latency.py: a 245-position step view was 1,514 elements and 131 KB)
STRIP_HEAD, STRIP_TAIL = 4, 40
ROW_HEAD, ROW_TOP, ROW_TAIL = 4, 12, 32
TABLE_ROWS = 6  # the cache table shows the latest steps; the chart shows them all
STEP_VIEW = "decode_step"  # the fragment that draws the current step
CHECK_POLL_S = 0.15  # how often the page asks whether the step's background check is done
CHECK_INLINE_S = 0.03  # a check done this soon is drawn with its step (small's take a few ms): no poll, no rerun
CHECK_DEFER_S = 0.1  # a slower check starts this long after its step, at the poller's first tick: the token first

model = page_start("decode")
info, tok = model.info, model.tokenizer
mark_cancelled_run()
if generation(model) is None:  # the page of a run has no prompt form: Run prefill's callback starts the run first
    prompt_form(model)
    st.info(t("decode.press_prefill"))
    st.stop()

# The controls stay outside the step view: a Next click does not redraw them, and a change of them reruns only
# the step view (redraw_only), not the sidebar and the title. Flex rows, not st.columns: with columns on the page,
# every click of the step view costs the browser more (benchmarks/click_latency.py).
with st.container(border=True, horizontal=True, vertical_alignment="bottom"):
    layer_head_selectors(info, redraw=STEP_VIEW)
    sampling_controls(redraw=STEP_VIEW)
    st.toggle(t("decode.check_each_step"), key="check_each_step", help=t("decode.check_help"),
              on_change=redraw_only, args=(STEP_VIEW,))
    probe_controls(info, redraw=STEP_VIEW)
    st.toggle(t("predict.toggle"), key="predict_on",  # the whole page: the guesses appear
              help=t("predict.help", next=t("decode.next")))
if st.session_state.predict_on:
    guess_inputs(model, generation(model))
queue_step_keys()  # → and ← press Next and Back in the order pressed


if st.session_state.run_to_end_requested:
    # Run to end runs in a whole-page run, with a Stop button outside any fragment: Streamlit 1.67 lets a click
    # inside a fragment wait until the running script ends, while a click outside one stops it between two steps
    # (mark_cancelled_run above then records the cancel).
    st.session_state.run_to_end_requested = False
    st.button(t("decode.stop"), key="stop_run", type="primary", icon=":material/stop:")
    run_to_end(model, generation(model))
    st.rerun()


@st.fragment(key=STEP_VIEW)
def step_view() -> None:
    mark_cancelled_run()
    gen = generation(model)
    if gen is None:  # Reset inside the fragment: the whole page draws the prompt form again
        rerun_whole_page()
    # callbacks run before the fragment is drawn, so the buttons below already show the new state
    with st.container(horizontal=True):
        st.button(t("decode.next"), key="next", type="primary", icon=":material/skip_next:", disabled=gen.finished,
                  on_click=count_click(on_next_with_guess), shortcut=NEXT_KEY)
        st.button(t("decode.back"), key="back", icon=":material/undo:", disabled=len(gen.steps) < 2,
                  on_click=count_click(on_back), shortcut=BACK_KEY)
        st.button(t("decode.run_to_end"), key="run_to_end", icon=":material/fast_forward:", disabled=gen.finished,
                  on_click=request_run_to_end)
        st.button(t("decode.reset"), key="reset", icon=":material/restart_alt:", on_click=reset)
    callback_error_here()  # why Next, Back or a sampling change failed, under the buttons
    st.html(step_html(gen, st.session_state.layer, st.session_state.head) + clicks_marker())
    if st.session_state.check_each_step and len(gen.steps) - 1 not in gen.checks:
        wait_for_check(len(gen.steps) - 1)


@st.fragment(run_every=CHECK_POLL_S)
def wait_for_check(index: int) -> None:
    """Every CHECK_POLL_S: starts this step's check in the background once the step is CHECK_DEFER_S old (the page
    has drawn it by then), and asks whether it is done; then one whole-page run draws the verdict in place, and no
    longer draws this poller (Streamlit then stops its timer). Between two polls nothing runs, so a Next is never
    kept waiting by a check."""
    gen = st.session_state.generation
    if gen is None or len(gen.steps) - 1 != index:  # the run moved on
        rerun_whole_page()
    if generate.check_last_step_in_background(model, gen, CHECKS, defer_s=CHECK_DEFER_S) is not None:
        rerun_whole_page()


def step_list(runs: list[generate.AttentionRun]) -> str:
    return ", ".join(str(r.first) if r.first == r.last else f"{r.first}–{r.last}" for r in runs)


def attention_kept_html(gen: generate.Generation, layer: int, head: int) -> str:
    """What the budget dropped of the decode steps' attention rows and what stays, for the triangle drawn
    (layer, head): nothing when every step keeps every row."""
    runs = generate.attention_runs(gen)
    if all(r.kept == "every" for r in runs):
        return ""
    mb = f"{gen.budget_bytes / 2**20:g}"
    notes = []
    dropped = [r for r in runs if r.kept == "none"]
    if dropped:
        notes.append(t("decode.attention_dropped", mb=mb, steps=step_list(dropped)))
    for view in dict.fromkeys(r.view for r in runs if r.kept == "one"):
        thinned = step_list([r for r in runs if r.view == view])
        key = "decode.attention_thinned_shown" if view == (layer, head) else "decode.attention_thinned_blank"
        notes.append(t(key, mb=mb, steps=thinned, layer=view[0], head=view[1]))
    notes.append(t("decode.attention_kept", steps=step_list([r for r in runs if r.kept == "every"]),
                   back=t("decode.back")))
    return "".join(paragraph_html(note, "dl-caption") for note in notes)


def memory_budget_html(gen: generate.Generation) -> str:
    """Why the run stopped at the budget: the bytes that are left when nothing older can be dropped."""
    prefill = gen.steps[0].nbytes
    return paragraph_html(t("decode.memory_budget_stop", mb=f"{gen.budget_bytes / 2**20:g}",
                            prefill=f"{prefill / 2**20:.1f}", steps=f"{(gen.nbytes - prefill) / 2**20:.1f}",
                            cache=f"{gen.cache.nbytes_reserved() / 2**20:.1f}", back=t("decode.back"),
                            reset=t("decode.reset")), "dl-caption")


def step_html(gen: generate.Generation, layer: int, head: int) -> str:
    """Everything the current step shows, as one piece of HTML."""
    gen.view = (layer, head)  # what older steps keep of their attention once the session reaches its budget
    trace, drawn = gen.steps[-1], gen.samples[-1]
    tokens, ids, kinds = strip_tokens(model, gen)
    summary = paragraph_html(t(
        "decode.step_summary", step=len(gen.steps) - 1, phase=t("phase." + trace.phase),
        fed=md_escape(", ".join(tok.token(i) for i in trace.input_ids)), pos=trace.positions[0],
        cache=trace.cache_len, ms=f"{trace.ms:.2f}", device=info.device, dtype=info.dtype))

    cached = tokens[: trace.cache_len]
    row = trace.weights(layer, head)[-1]  # (cache_len,): the newest query
    row_keep = window_of(len(row), ROW_HEAD, ROW_TAIL, most_probable(row, ROW_TOP).tolist())
    row_folded = "" if row_keep is None else paragraph_html(t(
        "decode.attention_folded", head=ROW_HEAD, top=ROW_TOP, tail=ROW_TAIL, folded=len(row) - len(row_keep),
        w=f"{float(row.sum() - row[sorted(row_keep)].sum()):.2f}"), "dl-caption")
    window = info.layer_windows[layer] if info.layer_windows else None
    window_edge = (paragraph_html(t("decode.window_edge", layer=layer, window=window,
                                    edge=trace.cache_len - window), "dl-caption")
                   if window is not None and trace.cache_len > window else "")
    attention = (
        heading_html(t("decode.attention"))
        + paragraph_html(t("decode.attention_row", token=md_escape(tok.token(trace.input_ids[-1])),
                           n=trace.cache_len), "dl-caption")
        + row_folded + attention_row_html(cached, row, row_keep)
        + window_edge
        + paragraph_html(t("decode.attention_history"), "dl-caption") + attention_kept_html(gen, layer, head)
        + svg.heatmap_html(generate.attention_history(gen, layer, head),
                           [f"{p}:{shown(w)}" for p, w in enumerate(cached)], t("decode.attention"),
                           generate.attention_rows_kept(gen, layer, head), t("decode.row_not_kept")))

    names = {k: t("sampling." + k) for k in ("chosen", "kept", "cut_k", "cut_p", "other")}
    chosen_token = md_escape(tok.token(drawn.chosen_id))
    if drawn.greedy:
        choice = t("sampling.summary_greedy", token=chosen_token, id=drawn.chosen_id, p=f"{drawn.chosen_prob:.3f}")
    else:
        choice = t("sampling.summary", token=chosen_token, id=drawn.chosen_id, p=f"{drawn.chosen_final_prob:.3f}",
                   mode=t("sampling.sampled", seed=gen.settings.seed), k=drawn.n_kept_top_k,
                   p_kept=drawn.n_kept_top_p, vocab=info.vocab_size)
    sampling = (heading_html(t("decode.sampling"))
                + probability_bars_html([tok.token(int(i)) for i in drawn.top_ids[:TOP_BARS]],
                                        drawn.top_probs[:TOP_BARS], list(drawn.top_status[:TOP_BARS]), names)
                + paragraph_html(choice))

    latest = list(enumerate(gen.steps))[-TABLE_ROWS:]
    per_position = cache_bytes_formula(info.n_layers, info.n_kv_heads, 1, info.d_head, info.bytes_per_element)
    cache = (
        heading_html(t("decode.cache"))
        + svg.line_chart_svg(list(range(len(gen.steps))),
                             {t("decode.measured"): [s.cache_bytes for s in gen.steps],
                              t("decode.reserved"): [s.cache_bytes_reserved for s in gen.steps]},
                             t("decode.step_axis"), t("decode.bytes_axis"), t("decode.cache"),
                             dashed=(t("decode.reserved"),), number=number)
        + table_html([t("decode.step_axis"), t("decode.cache_len"), t("decode.measured"), t("decode.formula"),
                      t("decode.reserved")],
                     [[i, s.cache_len, number(s.cache_bytes), number(s.cache_bytes_formula),
                       number(s.cache_bytes_reserved)] for i, s in latest])
        + paragraph_html(cache_by_layer_kind(info.cache_shape, trace.cache_len, trace.cache_bytes) or t(
            "decode.formula_text", layers=info.n_layers, kv=info.n_kv_heads, d=info.d_head,
            b=info.bytes_per_element, per_position=number(per_position), positions=number(trace.cache_len),
            total=number(trace.cache_bytes_formula)), "dl-caption"))

    check = (generate.check_last_step_in_background(model, gen, CHECKS, CHECK_INLINE_S, CHECK_DEFER_S)
             if st.session_state.check_each_step else None)
    if check is not None:
        passed = check.max_abs_diff <= CHECK_TOLERANCE
        verdict = t("decode.check_result_pass" if passed else "decode.check_result_fail", tol=CHECK_TOLERANCE,
                    n=trace.cache_len)
        check_html = (f'<div class="dl-metric">{escape(t("decode.check_metric"))}<b>{check.max_abs_diff:.2e}</b></div>'
                      + paragraph_html(t("decode.check_help"), "dl-caption")
                      + box_html(verdict, "pass" if passed else "fail")
                      + paragraph_html(t("decode.check_timing", n=trace.cache_len, ms=f"{check.ms:.1f}",
                                         step_ms=f"{trace.ms:.1f}"), "dl-caption"))
    elif st.session_state.check_each_step:
        check_html = box_html(t("decode.checking", n=trace.cache_len), "note")
    else:
        check_html = paragraph_html(t("decode.check_off"), "dl-caption")
    stop = (box_html(t("decode.stopped", reason=t("stop." + gen.stop_reason)), "note") if gen.stop_reason
            else paragraph_html(t("decode.not_stopped"), "dl-caption"))
    if gen.stop_reason == "memory_budget":
        stop += memory_budget_html(gen)
    check_and_answer = (
        heading_html(t("decode.check")) + check_html
        + heading_html(t("decode.answer"))
        + paragraph_html(t("decode.answer_text", text=md_escape(tok.decode(gen.new_ids)) or "∅", n=len(gen.new_ids)))
        + stop)
    joined = joined_characters(tok, ids)
    strip_keep = window_of(len(ids), STRIP_HEAD, STRIP_TAIL)
    shown_joined = joined if strip_keep is None else [c for i, c in enumerate(joined) if i in strip_keep]
    legend = (paragraph_html(t("tokens.byte_legend"), "dl-caption") if any(c is not None for c in shown_joined)
              else "")
    if strip_keep is not None:
        legend += paragraph_html(t("decode.strip_folded", n=len(ids), head=STRIP_HEAD, tail=STRIP_TAIL,
                                   folded=len(ids) - len(strip_keep)), "dl-caption")
    predicted = reveal_html(model, gen) if st.session_state.predict_on else ""
    return (token_strip_html(tokens, ids, kinds, joined, strip_keep, tok.decode) + legend + summary + predicted
            + f'<div class="dl-grid"><div>{attention}</div><div>{sampling}</div><div>{cache}</div>'
            f"<div>{check_and_answer}</div></div>"
            + probes_html(model, gen, len(gen.steps) - 1, lens=st.session_state.logit_lens))


step_view()
# the file is made when it is asked for (no work on a Next), from the run as it is then
st.download_button(t("decode.download"), key="download_run", icon=":material/download:", on_click="ignore",
                   file_name="decode-lab-run.json", mime="application/json",
                   data=partial(run_as_trace_json, model, generation(model), st.session_state.prompt_of_run,
                                st.session_state.prompt_unknown), help=t("decode.download_help"))
st.page_link(page("replay").path, label=t("replay.open"), icon=page("replay").icon)
