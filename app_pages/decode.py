"""Decode: one token per step over a KV cache that grows by one position; sampling; the recompute check."""

import numpy as np
import streamlit as st

from model import generate
from ui import charts
from ui.i18n import t
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
)
from ui.widgets import md_escape, token_strip

CHECK_TOLERANCE = 1e-4
TOP_BARS = 12

model = page_start("decode")
info, tok = model.info, model.tokenizer
mark_cancelled_run()
gen = generation(model)
if gen is None:
    prompt_form(model)
    gen = generation(model)  # the prefill button may just have started one
if gen is None:
    st.info(t("decode.press_prefill"))
    st.stop()

finished = gen.stop_reason not in (None, "cancelled")
b1, b2, b3, b4, _ = st.columns([1, 1, 1.3, 1, 1])
# callbacks run before the page is drawn, so the buttons below already show the new state
b1.button(t("decode.next"), key="next", type="primary", icon=":material/skip_next:", disabled=finished,
          width="stretch", on_click=on_next)
b2.button(t("decode.back"), key="back", icon=":material/undo:", disabled=len(gen.steps) < 2,
          width="stretch", on_click=on_back)
if b3.button(t("decode.run_to_end"), key="run_to_end", icon=":material/fast_forward:", disabled=finished,
             width="stretch"):
    run_to_end(model, gen)
    st.rerun()
b4.button(t("decode.reset"), key="reset", icon=":material/restart_alt:", width="stretch", on_click=reset)

trace, drawn = gen.steps[-1], gen.samples[-1]
ids = gen.ids
kinds = ["" for _ in gen.prompt_ids] + ["new"] * len(gen.new_ids)
kinds[-1] = "current"
token_strip([tok.token(i) for i in ids], ids, kinds)
st.markdown(t("decode.step_summary", step=len(gen.steps) - 1, phase=t("phase." + trace.phase),
              fed=md_escape(", ".join(tok.token(i) for i in trace.input_ids)), pos=trace.positions[0],
              cache=trace.cache_len, ms=f"{trace.ms:.2f}", device=info.device, dtype=info.dtype))

left, right = st.columns([4, 3])
with left:
    st.subheader(t("decode.attention"))
    layer, head = layer_head_selectors(info)
    labels = [f"{p}:{tok.token(i)}" for p, i in enumerate(ids[: trace.cache_len])]
    row = trace.attention[layer, head, -1:]  # (1, cache_len): the newest query over the whole cache
    st.plotly_chart(charts.attention_heatmap(row, [t("decode.new_query")], labels, height=170),
                    key="decode_row")
    st.caption(t("decode.attention_history"))
    history = generate.attention_history(gen, layer, head)
    st.plotly_chart(charts.attention_heatmap(history, labels, labels,
                                             height=max(300, min(560, 60 + 26 * len(labels)))),
                    key="decode_history")
with right:
    st.subheader(t("decode.cache"))
    st.plotly_chart(charts.lines(
        list(range(len(gen.steps))),
        {t("decode.measured"): [s.cache_bytes for s in gen.steps],
         t("decode.formula"): [s.cache_bytes_formula for s in gen.steps]},
        t("decode.step_axis"), t("decode.bytes_axis"), height=300, dashed=(t("decode.formula"),)),
        key="decode_cache")
    st.dataframe([{t("decode.step_axis"): i, t("decode.cache_len"): s.cache_len,
                   t("decode.measured"): s.cache_bytes, t("decode.formula"): s.cache_bytes_formula}
                  for i, s in enumerate(gen.steps)], hide_index=True)
    st.caption(t("decode.formula_text", layers=info.n_layers, kv=info.n_kv_heads, d=info.d_head,
                 b=info.bytes_per_element, per_position=2 * info.n_layers * info.n_kv_heads * info.d_head
                 * info.bytes_per_element))

st.subheader(t("decode.sampling"))
sampling_controls()
top = np.argsort(-drawn.probs, kind="stable")[:TOP_BARS]
kept_k, kept_p = set(drawn.kept_by_top_k.tolist()), set(drawn.kept_by_top_p.tolist())
if drawn.greedy:  # nothing is filtered: the highest logit wins
    status = ["chosen" if i == drawn.chosen_id else "other" for i in top]
else:
    status = ["chosen" if i == drawn.chosen_id else "kept" if i in kept_p else "cut_p" if i in kept_k else "cut_k"
              for i in top]
names = {k: t("sampling." + k) for k in ("chosen", "kept", "cut_k", "cut_p", "other")}
st.plotly_chart(charts.probability_bars([tok.token(int(i)) for i in top], drawn.probs[top], status, names),
                key="decode_probs")
chosen_token = md_escape(tok.token(drawn.chosen_id))
if drawn.greedy:
    st.markdown(t("sampling.summary_greedy", token=chosen_token, id=drawn.chosen_id,
                  p=f"{drawn.probs[drawn.chosen_id]:.3f}"))
else:
    st.markdown(t("sampling.summary", token=chosen_token, id=drawn.chosen_id,
                  p=f"{drawn.final_probs[drawn.chosen_id]:.3f}", mode=t("sampling.sampled", seed=gen.settings.seed),
                  k=len(kept_k), p_kept=len(kept_p), vocab=info.vocab_size))

c1, c2 = st.columns(2)
with c1:
    st.subheader(t("decode.check"))
    diff = generate.check_last_step(model, gen)
    verdict = t("decode.check_pass") if diff <= CHECK_TOLERANCE else t("decode.check_fail")
    st.metric(t("decode.check_metric"), f"{diff:.2e}", help=t("decode.check_help"))
    (st.success if diff <= CHECK_TOLERANCE else st.error)(t("decode.check_result", tol=CHECK_TOLERANCE,
                                                             verdict=verdict, n=trace.cache_len))
with c2:
    st.subheader(t("decode.answer"))
    st.markdown(t("decode.answer_text", text=md_escape(tok.decode(gen.new_ids)) or "∅", n=len(gen.new_ids)))
    if gen.stop_reason:
        st.info(t("decode.stopped", reason=t("stop." + gen.stop_reason)))
    else:
        st.caption(t("decode.not_stopped"))
