"""Prefill: the prompt -> tokens -> one pass over all N positions -> causal attention, KV cache, logits.

The key figure, on the first screen: the tokens, the N × N causal triangle beside the KV cache it wrote. The prompt
form is folded into the settings; the page opens on the form's prompt already prefilled (controls.first_run)."""

import streamlit as st

from model.engine.counting import cache_bytes_formula
from model.engine.runtime import Quantization, Rounding
from model.engine.tokenizer import joined_characters
from ui import charts
from ui.classroom import key_figure, localised, settings, why
from ui.controls import (
    attention_scale,
    attention_scale_title,
    cache_by_layer_kind,
    first_run,
    layer_head_selectors,
    prompt_form,
)
from ui.i18n import decimal, number, t
from ui.models import page_start
from ui.probes import probe_controls, probes_html
from ui.token_tax import token_tax_section
from ui.widgets import md_escape, probability_bars_html, shown, table_html, token_strip

TOP_BARS = 10


def megabytes(nbytes: int) -> str:
    return number(round(nbytes / 1e6, 1))


def quantization_text(q: Quantization) -> str:
    """Each type the GGUF's matrices were rounded to, with its bits a weight and how many matrices have it."""
    def typed(r: Rounding) -> str:
        return t("load.quantization_type", type=r.type, bits=number(r.bits))

    layers = ", ".join(t("load.quantization_count", n=number(r.matrices), type=typed(r)) for r in q.layers)
    return t("load.quantization_value", name=q.name, matrices=number(sum(r.matrices for r in q.layers)),
             layers=layers, embedding=typed(q.embedding))


model = page_start("prefill", intro=False)
info, tok = model.info, model.tokenizer
gen = first_run(model)
with settings("prefill", expanded=gen is None):
    prompt_form(model)
if gen is None:
    st.info(t("prefill.press_run"))
    token_tax_section()
    st.stop()

trace = gen.steps[0]
prompt_tokens = [tok.token(i) for i in gen.prompt_ids]
n = len(gen.prompt_ids)
unknown = st.session_state.prompt_unknown
kinds = ["unknown" if i == tok.unk_id else "" for i in gen.prompt_ids]
joined = joined_characters(tok, gen.prompt_ids)
layer_formulas = [cache_bytes_formula(1, info.n_kv_heads, info.held_positions(i, trace.cache_len), info.d_head,
                                      info.bytes_per_element) for i in range(info.n_layers)]  # sliding: the window

with key_figure():
    token_strip(prompt_tokens, gen.prompt_ids, kinds, joined)
    with st.container(horizontal=True, vertical_alignment="bottom"):
        layer, head = layer_head_selectors(info)
        scale = attention_scale()
    attention, cache = st.columns([3, 2])
    with attention:
        st.markdown(f"**{t('prefill.attention')}**")
        labels = [f"{p}:{shown(w)}" for p, w in enumerate(prompt_tokens)]
        weights = trace.weights(layer, head)  # (N, N)
        st.plotly_chart(localised(charts.attention_heatmap(
            weights, labels, labels, height=max(280, min(560, 100 + 40 * n)), scale=scale,
            scale_title=attention_scale_title(scale), number=lambda w: decimal(w, 2))), key="prefill_heatmap")
    with cache:
        st.markdown(f"**{t('prefill.cache')}**")
        st.markdown(cache_by_layer_kind(info.cache_shape, trace.cache_len, trace.cache_bytes) or t(
            "prefill.cache_total", layers=info.n_layers, kv=info.n_kv_heads, n=trace.cache_len, d=info.d_head,
            b=info.bytes_per_element, formula=number(trace.cache_bytes_formula),
            measured=number(trace.cache_bytes)))
        with st.container(height=260 if info.n_layers > 6 else "content", border=False):
            st.html(table_html([t("common.layer"), t("prefill.cache_measured"), t("prefill.cache_formula")],
                               [[i, number(held), number(formula)] for i, (held, formula)
                                in enumerate(zip(trace.layer_bytes, layer_formulas))]))
with st.expander(t("prefill.cache_layers")):
    st.html(table_html(
        [t("common.layer"), t("prefill.cache_shape"), t("prefill.cache_measured"), t("prefill.cache_formula"),
         t("prefill.cache_reserved")],
        [[i, " × ".join(map(str, shape)), number(held), number(formula), number(reserved)]
         for i, (shape, held, formula, reserved) in enumerate(zip(trace.layer_shapes, trace.layer_bytes,
                                                                   layer_formulas, trace.layer_bytes_reserved))]))

with why("prefill"):
    st.caption(t("prefill.intro"))
    if any(c is not None for c in joined):
        st.caption(t("tokens.byte_legend"))
    st.caption(t("prefill.attention_read", n=n, masked=n * (n - 1) // 2))
    if info.layer_windows and info.layer_windows[layer] is not None:
        st.caption(t("prefill.window_edge", layer=layer, window=info.layer_windows[layer]))
    st.caption(t("prefill.cache_reserved_total", reserved=number(trace.cache_bytes_reserved)))
if unknown:
    st.warning(t("prefill.unknown", words=md_escape(", ".join(unknown))))
st.markdown(t("prefill.one_pass", n=n, ms=decimal(trace.ms), device=info.device, dtype=info.dtype))
with st.expander(t("prefill.all_heads", layer=layer)):
    st.plotly_chart(localised(charts.heads_grid(trace.heads(layer), t("common.head_n"))), key="prefill_heads")

st.subheader(t("prefill.logits"))
drawn = gen.samples[0]
names = {k: t("sampling." + k) for k in ("chosen", "kept", "cut_k", "cut_p", "other")}
st.html(probability_bars_html([tok.token(int(i)) for i in drawn.top_ids[:TOP_BARS]], drawn.top_probs[:TOP_BARS],
                              list(drawn.top_status[:TOP_BARS]), names))
st.markdown(t("prefill.first_token", token=md_escape(tok.token(drawn.chosen_id)), id=drawn.chosen_id))
with st.container(horizontal=True):
    probe_controls(info, lens=False)
if st.session_state.heads_off:
    st.caption(t("ablation.prefill_step"))
    st.html(probes_html(model, gen, 0, lens=False))
st.page_link("app_pages/decode.py", label=t("prefill.go_decode"), icon=":material/replay:")
if model.facts is not None:  # cell 5A, "load weights": how this model got into memory
    facts = model.facts
    with st.expander(t("load.title")):
        st.html(table_html([t("load.fact"), t("load.value")], [
            [t("load.file"), facts.file], [t("load.source"), facts.source],
            *([[t("load.quantization"), quantization_text(facts.quantization)]] if facts.quantization else []),
            [t("load.parameters"), number(facts.parameters)],
            [t("load.file_bytes"), f"{megabytes(facts.file_bytes)} MB"],
            [t("load.memory_bytes"), f"{megabytes(facts.memory_bytes)} MB"],
            *([[t("load.packed_bytes"), t("load.packed_value", mb=megabytes(facts.packed_bytes),
                                          total=megabytes(facts.held_bytes))]]
              if facts.packed_bytes is not None else []),
            [t("load.dtype"), f"{facts.dtype} · {facts.device}"],
            [t("load.time"), f"{decimal(facts.load_s)} s"]]))
token_tax_section()
