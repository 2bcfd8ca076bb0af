"""Decode: one token per step over a KV cache that grows by one position; sampling; the recompute check.

Everything a step changes sits in one fragment: Next, Back and the sampling controls rerun it alone, not the
sidebar or the prompt form. The attention row, the probabilities and the cache table are plain HTML; only the
growing attention triangle and the bytes per step are plotly charts.
"""

import streamlit as st

from model import generate
from model.counting import cache_bytes_formula
from ui import charts
from ui.i18n import number, t
from ui.session import (
    generation,
    layer_head_selectors,
    mark_cancelled_run,
    on_back,
    on_next,
    page_start,
    prompt_form,
    reset,
    run_to_end,
    sampling_controls,
    strip_tokens,
)
from ui.widgets import attention_row_html, md_escape, probability_bars_html, shown, table_html, token_strip

CHECK_TOLERANCE = 1e-4
TOP_BARS = 12
TABLE_ROWS = 6  # the cache table shows the latest steps; the chart shows them all

model = page_start("decode")
info, tok = model.info, model.tokenizer
mark_cancelled_run()
if generation(model) is None and prompt_form(model):
    st.rerun()  # the page of a run has no prompt form
if generation(model) is None:
    st.info(t("decode.press_prefill"))
    st.stop()


@st.fragment
def step_view() -> None:
    mark_cancelled_run()
    gen = generation(model)
    if gen is None:  # Reset inside the fragment: the whole page draws the prompt form again
        st.rerun()
    b1, b2, b3, b4, _ = st.columns([1, 1, 1.3, 1, 1])
    # callbacks run before the fragment is drawn, so the buttons below already show the new state
    b1.button(t("decode.next"), key="next", type="primary", icon=":material/skip_next:", disabled=gen.finished,
              width="stretch", on_click=on_next)
    b2.button(t("decode.back"), key="back", icon=":material/undo:", disabled=len(gen.steps) < 2,
              width="stretch", on_click=on_back)
    if b3.button(t("decode.run_to_end"), key="run_to_end", icon=":material/fast_forward:", disabled=gen.finished,
                 width="stretch"):
        run_to_end(model, gen)
        st.rerun(scope="fragment")
    b4.button(t("decode.reset"), key="reset", icon=":material/restart_alt:", width="stretch", on_click=reset)

    trace, drawn = gen.steps[-1], gen.samples[-1]
    tokens, ids, kinds = strip_tokens(model, gen)
    token_strip(tokens, ids, kinds)
    st.markdown(t("decode.step_summary", step=len(gen.steps) - 1, phase=t("phase." + trace.phase),
                  fed=md_escape(", ".join(tok.token(i) for i in trace.input_ids)), pos=trace.positions[0],
                  cache=trace.cache_len, ms=f"{trace.ms:.2f}", device=info.device, dtype=info.dtype))

    left, right = st.columns([4, 3])
    with left:
        st.subheader(t("decode.attention"))
        layer, head = layer_head_selectors(info)
        cached = tokens[: trace.cache_len]
        st.caption(t("decode.attention_row", token=md_escape(tok.token(trace.input_ids[-1])), n=trace.cache_len))
        st.html(attention_row_html(cached, trace.attention[layer, head, -1]))  # (cache_len,): the newest query
        st.caption(t("decode.attention_history"))
        if gen.attention_dropped:
            st.caption(t("decode.attention_dropped", n=gen.attention_dropped,
                         mb=round(gen.budget_bytes / 2**20)))
        labels = [f"{p}:{shown(w)}" for p, w in enumerate(cached)]
        st.plotly_chart(charts.attention_heatmap(generate.attention_history(gen, layer, head), labels, labels,
                                                 height=max(300, min(560, 60 + 26 * len(labels)))),
                        key="decode_history")
    with right:
        st.subheader(t("decode.cache"))
        steps = list(range(len(gen.steps)))
        st.plotly_chart(charts.lines(
            steps, {t("decode.measured"): [s.cache_bytes for s in gen.steps],
                    t("decode.reserved"): [s.cache_bytes_reserved for s in gen.steps]},
            t("decode.step_axis"), t("decode.bytes_axis"), height=260, dashed=(t("decode.reserved"),)),
            key="decode_cache")
        latest = list(enumerate(gen.steps))[-TABLE_ROWS:]
        st.html(table_html(
            [t("decode.step_axis"), t("decode.cache_len"), t("decode.measured"), t("decode.formula"),
             t("decode.reserved")],
            [[i, s.cache_len, number(s.cache_bytes), number(s.cache_bytes_formula), number(s.cache_bytes_reserved)]
             for i, s in latest]))
        st.caption(t("decode.formula_text", layers=info.n_layers, kv=info.n_kv_heads, d=info.d_head,
                     b=info.bytes_per_element,
                     per_position=cache_bytes_formula(info.n_layers, info.n_kv_heads, 1, info.d_head,
                                                      info.bytes_per_element)))

    st.subheader(t("decode.sampling"))
    sampling_controls()
    names = {k: t("sampling." + k) for k in ("chosen", "kept", "cut_k", "cut_p", "other")}
    st.html(probability_bars_html([tok.token(int(i)) for i in drawn.top_ids[:TOP_BARS]],
                                  drawn.top_probs[:TOP_BARS], list(drawn.top_status[:TOP_BARS]), names))
    chosen_token = md_escape(tok.token(drawn.chosen_id))
    if drawn.greedy:
        st.markdown(t("sampling.summary_greedy", token=chosen_token, id=drawn.chosen_id, p=f"{drawn.chosen_prob:.3f}"))
    else:
        st.markdown(t("sampling.summary", token=chosen_token, id=drawn.chosen_id, p=f"{drawn.chosen_final_prob:.3f}",
                      mode=t("sampling.sampled", seed=gen.settings.seed), k=drawn.n_kept_top_k,
                      p_kept=drawn.n_kept_top_p, vocab=info.vocab_size))

    c1, c2 = st.columns(2)
    with c1:
        st.subheader(t("decode.check"))
        diff = generate.check_last_step(model, gen)
        passed = diff <= CHECK_TOLERANCE
        st.metric(t("decode.check_metric"), f"{diff:.2e}", help=t("decode.check_help"))
        (st.success if passed else st.error)(
            t("decode.check_result_pass" if passed else "decode.check_result_fail", tol=CHECK_TOLERANCE,
              n=trace.cache_len))
    with c2:
        st.subheader(t("decode.answer"))
        st.markdown(t("decode.answer_text", text=md_escape(tok.decode(gen.new_ids)) or "∅", n=len(gen.new_ids)))
        if gen.stop_reason:
            st.info(t("decode.stopped", reason=t("stop." + gen.stop_reason)))
        else:
            st.caption(t("decode.not_stopped"))


step_view()
