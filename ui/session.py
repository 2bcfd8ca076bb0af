"""The shared model (loaded once per process) and this session's generation, in st.session_state."""

from __future__ import annotations

import logging
from collections.abc import Callable

import streamlit as st

from model import generate
from model.errors import InputError
from model.runtime import LoadedModel, load_model
from model.sampling import SamplingSettings
from ui.i18n import labels, lang, t

log = logging.getLogger(__name__)


@st.cache_resource(show_spinner=False, max_entries=4)
def shared_model(name: str, device: str, allow_download: bool = False) -> LoadedModel:
    return load_model(name, device, allow_download)


def chosen_model() -> tuple[str, str, bool]:
    """(name or path, device, downloads allowed) as the sidebar says."""
    s = st.session_state
    if s.model_name == "custom":
        return s.model_path.strip(), s.device, bool(s.allow_download)
    return s.model_name, s.device, False


def page_start(page: str) -> LoadedModel:
    """A live page's title and intro, then the sidebar's model; the page stops, with the reason, without one."""
    st.title(t(page + ".title"))
    st.caption(t(page + ".intro"))
    model = current_model()
    if model is None:
        st.stop()
    return model


def current_model() -> LoadedModel | None:
    """The sidebar's model on the sidebar's device, or None after saying why it cannot load."""
    try:
        with st.spinner(t("state.loading_model")):
            return shared_model(*chosen_model())
    except InputError as bad:
        st.error(bad.message(lang()))
        return None


def generation(model: LoadedModel) -> generate.Generation | None:
    """This session's run, dropped when the sidebar switched to another model or device."""
    if st.session_state.generation_for != (model.info.name, model.info.device):
        st.session_state.generation = None
    return st.session_state.generation


def sampling_settings() -> SamplingSettings:
    s = st.session_state
    return SamplingSettings(temperature=float(s.temperature), top_k=int(s.top_k) if s.top_k_on else None,
                            top_p=float(s.top_p), seed=int(s.seed))


def guarded(action: Callable[[], object]) -> object | None:
    """Run an engine action; bad input becomes a sentence in the user's language, never a traceback."""
    try:
        return action()
    except InputError as bad:
        st.error(bad.message(lang()))
    except Exception:
        log.exception("engine action failed")
        st.error(t("error.unexpected"))
    return None


def start_generation(model: LoadedModel, prompt_ids: list[int], unknown: list[str]) -> None:
    stops = tuple(s for s in st.session_state.stop_text.split("|") if s)
    gen = guarded(lambda: generate.start(model, prompt_ids, sampling_settings(),
                                         int(st.session_state.max_new_tokens), stops))
    if gen is not None:  # a refused request leaves the previous run in place
        st.session_state.generation = gen
        st.session_state.generation_for = (model.info.name, model.info.device)
        st.session_state.prompt_unknown = unknown


def reset() -> None:
    st.session_state.generation = None


def prompt_form(model: LoadedModel) -> None:
    """The prompt (text, or ids for the micro example) and the button that runs prefill."""
    left, right = st.columns([4, 1], vertical_alignment="bottom")
    with right:
        st.segmented_control(t("prompt.mode"), ["text", "ids"], key="prompt_mode",
                             format_func=labels("prompt.mode_", ["text", "ids"]).get)
    with left:
        if st.session_state.prompt_mode == "ids":
            st.text_input(t("prompt.ids_label"), key="prompt_ids_text", help=t("prompt.ids_help"))
        else:
            st.text_input(t("prompt.label"), key="prompt_text", max_chars=2000, help=t("prompt.help"))
    c1, c2, _ = st.columns([1, 1, 3], vertical_alignment="bottom")
    # the shortest prompt (<bos> and one word) leaves context − 1 new tokens; a value above the widget's
    # maximum would be replaced by its minimum, so keep it inside for small contexts
    most = model.info.context_length - 1
    st.session_state.max_new_tokens = min(int(st.session_state.max_new_tokens), most)
    c1.number_input(t("prompt.max_new_tokens"), min_value=1, max_value=most,
                    key="max_new_tokens")
    c2.text_input(t("prompt.stop"), key="stop_text", help=t("prompt.stop_help"))
    if st.button(t("prompt.run_prefill"), key="run_prefill", type="primary", icon=":material/play_arrow:"):
        if st.session_state.prompt_mode == "ids":
            ids = guarded(lambda: generate.parse_prompt_ids(model, st.session_state.prompt_ids_text))
            unknown = []
        else:
            encoded = guarded(lambda: generate.encode_prompt(model, st.session_state.prompt_text))
            ids, unknown = (encoded.ids, encoded.unknown) if encoded is not None else (None, [])
        if ids is not None:
            start_generation(model, ids, unknown)


def _with_generation(action: Callable[[LoadedModel, generate.Generation], object]) -> None:
    gen = st.session_state.generation
    if gen is not None:
        model = shared_model(*chosen_model())
        guarded(lambda: action(model, gen))


def on_sampling_change() -> None:
    """New sampling controls re-draw the current step from its stored logits; the model does not run."""
    _with_generation(lambda model, gen: generate.resample(model, gen, sampling_settings()))


def on_next() -> None:
    _with_generation(generate.step)


def on_back() -> None:
    _with_generation(generate.back)


def layer_head_selectors(info) -> tuple[int, int]:
    """Layer and query head to show; each head's label names the KV head it reads (GQA)."""
    c1, c2 = st.columns(2)
    layer = c1.selectbox(t("common.layer"), range(info.n_layers), key="layer")
    head_labels = {h: t("common.head_kv", h=h, kv=info.kv_head(h)) for h in range(info.n_heads)}
    head = c2.selectbox(t("common.head"), range(info.n_heads), key="head", format_func=head_labels.get)
    return layer, head


def sampling_controls() -> None:
    c1, c2, c3, c4 = st.columns(4)
    c1.slider(t("sampling.temperature"), 0.0, 2.0, step=0.05, key="temperature", on_change=on_sampling_change,
              help=t("sampling.temperature_help"))
    with c2:
        st.toggle(t("sampling.top_k_on"), key="top_k_on", on_change=on_sampling_change)
        st.number_input(t("sampling.top_k"), min_value=1, max_value=1000, key="top_k",
                        on_change=on_sampling_change, disabled=not st.session_state.top_k_on)
    c3.slider(t("sampling.top_p"), 0.01, 1.0, step=0.01, key="top_p", on_change=on_sampling_change,
              help=t("sampling.top_p_help"))
    c4.number_input(t("sampling.seed"), min_value=0, max_value=2**31 - 1, key="seed", on_change=on_sampling_change)


def mark_cancelled_run() -> None:
    """A Run-to-end interrupted by a click (Streamlit stops the script between two steps) counts as cancel."""
    gen = st.session_state.generation
    if st.session_state.get("running") and gen is not None:
        gen.stop_reason = gen.stop_reason or "cancelled"
    st.session_state.running = False


def run_to_end(model: LoadedModel, gen: generate.Generation) -> None:
    st.session_state.running = True
    bar = st.progress(0.0, text=t("decode.running"))
    while gen.stop_reason in (None, "cancelled"):
        if guarded(lambda: generate.step(model, gen)) is None:
            break
        bar.progress(min(1.0, len(gen.samples) / gen.max_new_tokens), text=t("decode.running"))
    bar.empty()
    st.session_state.running = False
