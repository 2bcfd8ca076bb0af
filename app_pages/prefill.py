"""Prefill: the prompt -> tokens -> one pass over all N positions -> causal attention, KV cache, logits."""

import numpy as np
import streamlit as st

from model.counting import cache_bytes_formula
from ui import charts
from ui.i18n import t
from ui.session import generation, layer_head_selectors, page_start, prompt_form
from ui.widgets import md_escape, token_strip

model = page_start("prefill")
info, tok = model.info, model.tokenizer
prompt_form(model)
gen = generation(model)
if gen is None:
    st.info(t("prefill.press_run"))
    st.stop()

trace = gen.steps[0]
prompt_tokens = [tok.token(i) for i in gen.prompt_ids]
n = len(gen.prompt_ids)

st.subheader(t("prefill.tokens"))
unknown = st.session_state.prompt_unknown
kinds = ["unknown" if i == tok.unk_id else "" for i in gen.prompt_ids]
token_strip(prompt_tokens, gen.prompt_ids, kinds)
if unknown:
    st.warning(t("prefill.unknown", words=md_escape(", ".join(unknown))))
st.markdown(t("prefill.one_pass", n=n, ms=f"{trace.ms:.1f}", device=info.device, dtype=info.dtype))

st.subheader(t("prefill.attention"))
layer, head = layer_head_selectors(info)
labels = [f"{p}:{w}" for p, w in enumerate(prompt_tokens)]
weights = trace.attention[layer, head]  # (N, N)
st.plotly_chart(charts.attention_heatmap(weights, labels, labels, height=max(320, min(640, 60 + 34 * n))),
                key="prefill_heatmap")
st.caption(t("prefill.attention_read", n=n, masked=n * (n - 1) // 2))
with st.expander(t("prefill.all_heads", layer=layer)):
    st.plotly_chart(charts.heads_grid(trace.attention[layer], t("common.head_n")), key="prefill_heads")

st.subheader(t("prefill.cache"))
per_layer_formula = cache_bytes_formula(1, info.n_kv_heads, trace.cache_len, info.d_head, info.bytes_per_element)
st.dataframe([{t("common.layer"): i, t("prefill.cache_shape"): " × ".join(map(str, shape)),
               t("prefill.cache_measured"): measured, t("prefill.cache_formula"): per_layer_formula}
              for i, (shape, measured) in enumerate(zip(trace.layer_shapes, trace.layer_bytes))], hide_index=True)
st.markdown(t("prefill.cache_total", layers=info.n_layers, kv=info.n_kv_heads, n=trace.cache_len, d=info.d_head,
              b=info.bytes_per_element, formula=trace.cache_bytes_formula, measured=trace.cache_bytes))

st.subheader(t("prefill.logits"))
drawn = gen.samples[0]
top = np.argsort(-drawn.probs, kind="stable")[:10]
status = ["chosen" if i == drawn.chosen_id else "other" for i in top]
names = {"chosen": t("sampling.chosen"), "other": t("sampling.other")}
st.plotly_chart(charts.probability_bars([tok.token(int(i)) for i in top], drawn.probs[top], status, names),
                key="prefill_probs")
st.markdown(t("prefill.first_token", token=md_escape(tok.token(drawn.chosen_id)), id=drawn.chosen_id))
st.page_link("app_pages/decode.py", label=t("prefill.go_decode"), icon=":material/replay:")
