"""The controls several pages share: the prompt form, the layer and head selectors, the sampling controls; and the
sentence on where a cache's bytes go by layer kind."""

from __future__ import annotations

import math

import streamlit as st

from model.engine import generate
from model.engine.counting import CacheShape
from model.engine.runtime import LoadedModel
from ui.charts import ATTENTION_SCALES
from ui.classroom import presenter
from ui.i18n import decimal, labels, number, t
from ui.reruns import redraw_only
from ui.run import generation, on_sampling_change, prefill, prompt_modes
from ui.widgets import choice, warn_before_leaving


def prompt_form(model: LoadedModel) -> None:
    """The prompt (text, chat, or ids for the micro example) and the button that runs prefill. Flex rows, not
    st.columns: the mode's control keeps the width its labels need ("văn bản | ID | Chat" whole), and columns on a
    page make every later click of its fragments cost the browser more."""
    modes = prompt_modes(model)
    if model.info.language == "en":
        st.caption(t("prompt.english_only"))
    with st.container(horizontal=True, vertical_alignment="bottom"):
        mode = choice(st.segmented_control, t("prompt.mode"), modes, key="prompt_mode", width="content",
                      format_func=labels("prompt.mode_", modes).get, required=True)
        if mode == "ids":
            st.text_input(t("prompt.ids_label"), key="prompt_ids_text", help=t("prompt.ids_help"))
        else:
            st.text_input(t("prompt.chat_label" if mode == "chat" else "prompt.label"), key="prompt_text",
                          help=t("prompt.help", most=generate.MAX_PROMPT_CHARS))
    if mode == "chat":
        st.text_input(t("prompt.system_label"), key="system_text", help=t("prompt.system_help"))
    most = fit_max_new_tokens(model)
    with st.container(horizontal=True, vertical_alignment="bottom"):
        st.number_input(t("prompt.max_new_tokens"), min_value=1, max_value=most, key="max_new_tokens", width=180)
        st.text_input(t("prompt.stop"), key="stop_text", help=t("prompt.stop_help"), width=180)
        st.button(t("prompt.run_prefill"), key="run_prefill", type="primary", icon=":material/play_arrow:",
                  on_click=run_prefill, args=(model, mode))
    if st.session_state.get("prefill_error") is not None:  # said once, under the button
        st.error(st.session_state.prefill_error)
        st.session_state.prefill_error = None


def run_prefill(model: LoadedModel, mode: str) -> None:
    """Run prefill's callback (ui/run.prefill): a refused prompt is kept for the form, which says it under its
    button; a Next or a sampling change that failed is said under the page's own buttons (callback_error_here)."""
    prefill(model, mode)
    st.session_state.prefill_error, st.session_state.callback_error = st.session_state.callback_error, None


def fit_max_new_tokens(model: LoadedModel) -> int:
    """The most new tokens the model's context allows, the form's value kept within it: the shortest prompt (<bos>
    and one word) leaves context − 1; a value above the widget's maximum would be replaced by its minimum."""
    most = model.info.context_length - 1
    st.session_state.max_new_tokens = min(int(st.session_state.max_new_tokens), most)
    return most


def first_run(model: LoadedModel) -> generate.Generation | None:
    """The run the page draws: a page of the run opens on one. The first time a model is shown in this session
    (the session's first page of the run, or after the sidebar switched model), the form's prompt is prefilled
    at once; after Reset there is none until the form's button is pressed. A refused prompt is a sentence under
    that button."""
    made = (model.info.name, model.info.device)
    if generation(model) is None and st.session_state.get("first_run_for") != made:
        st.session_state.first_run_for = made
        fit_max_new_tokens(model)
        modes = prompt_modes(model)
        run_prefill(model, st.session_state.prompt_mode if st.session_state.prompt_mode in modes else modes[0])
        # app.py, drawn before this page, said no run was held: say it again here. Not st.rerun(): a run cut
        # short before the browser drew it drops the widget values it set (the sidebar's language among them)
        warn_before_leaving(generation(model) is not None)
    return generation(model)


def layer_head_selectors(info, redraw: str | None = None) -> tuple[int, int]:
    """Layer and query head to show; each head's label names the KV head it reads (GQA). Drawn into the caller's
    container, a row (st.container(horizontal=True)): st.columns on a page cost each later click more.
    `redraw` names the fragment that draws the attention, when only it should rerun on a change."""
    head_labels = {h: t("common.head_kv", h=h, kv=info.kv_head(h)) for h in range(info.n_heads)}
    layer = st.selectbox(t("common.layer"), range(info.n_layers), key="layer", width=90,  # numbers only
                         on_change=redraw_only, args=(redraw,))
    # presenter mode's larger text needs the wider box: "head 0 (reads KV head 0)" is 198 px at 20 px
    head = choice(st.selectbox, t("common.head"), list(range(info.n_heads)), key="head",
                  width=280 if presenter() else 220, format_func=head_labels.get,
                  on_change=lambda: redraw_only(redraw))
    return layer, head


def sampling_controls(redraw: str | None = None) -> None:
    """Temperature, top-k, top-p and seed, drawn into the caller's container, a row. `redraw` names the fragment
    that shows the current step, when only it should rerun on a change."""
    change = dict(on_change=on_sampling_change, args=(redraw,))
    decimal_slider(t("sampling.temperature"), 0.0, 2.0, 0.05, key="temperature", width=200,
                   help=t("sampling.temperature_help"), **change)
    # the whole page reruns: the top-k box beside the toggle, outside the fragment, turns on or off with it
    st.toggle(t("sampling.top_k_on"), key="top_k_on", on_change=on_sampling_change)
    st.number_input(t("sampling.top_k"), min_value=1, max_value=1000, key="top_k", width=110,
                    disabled=not st.session_state.top_k_on, **change)
    decimal_slider(t("sampling.top_p"), 0.01, 1.0, 0.01, key="top_p", width=200, help=t("sampling.top_p_help"),
                   **change)
    st.number_input(t("sampling.seed"), min_value=0, max_value=2**31 - 1, key="seed", width=130, **change)


def decimal_slider(label: str, lowest: float, highest: float, step: float, key: str, **options) -> None:
    """A slider from lowest to highest by step whose values are written as the session's language writes numbers
    (st.slider's format is printf's, with a decimal point in Vietnamese too): a select slider over the steps."""
    places = max(0, -math.floor(math.log10(step) + 1e-9))
    steps = [round(lowest + i * step, places) for i in range(round((highest - lowest) / step) + 1)]
    st.session_state[key] = min(steps, key=lambda v: abs(v - float(st.session_state[key])))
    written = {v: decimal(v, places) for v in steps}  # not a lambda: AppTest formats outside the script run
    st.select_slider(label, steps, key=key, format_func=written.get, **options)


def attention_scale(redraw: str | None = None) -> str:
    """What an attention picture's colour says (ui/charts.ATTENTION_SCALES), chosen on the page beside it; one
    choice for Prefill and Decode. `redraw` names the fragment that draws the attention, when only it should rerun."""
    return choice(st.segmented_control, t("attention.scale"), list(ATTENTION_SCALES), key="attention_scale",
                  format_func=labels("attention.scale_", ATTENTION_SCALES).get, required=True,
                  help=t("attention.scale_help"), on_change=lambda: redraw_only(redraw))


def attention_scale_title(scale: str) -> str:
    return t("attention.colour_" + scale)


def cache_by_layer_kind(shape: CacheShape, n: int, measured: int) -> str | None:
    """Where the cache's bytes go on a model with sliding-window layers (Gemma 3), as a sentence; None on a model
    whose layers all keep every position."""
    if shape.window is None:
        return None
    full_bytes, sliding_bytes = shape.bytes_by_kind(n)
    return t("cache.by_layer_kind", full=shape.n_layers - shape.sliding_layers, sliding=shape.sliding_layers, n=n,
             window=shape.window, held=shape.held(n), kv=shape.n_kv_heads, d=shape.d_head, b=shape.bytes_per_element,
             full_bytes=number(full_bytes), sliding_bytes=number(sliding_bytes),
             total=number(full_bytes + sliding_bytes), measured=number(measured))
