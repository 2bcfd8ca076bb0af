"""The shared models (loaded once per process) and this session's generation, in st.session_state."""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import streamlit as st
import torch

import ui.process  # noqa: F401  (the process set-up, before the first model runs: torch's threads)
from model.engine import generate
from model.engine.counting import cache_bytes_formula
from model.engine.loading import load_model, load_session_checkpoint, model_key
from model.engine.lowbit import with_weights
from model.engine.runtime import LoadedModel
from model.engine.sampling import SamplingSettings
from model.engine.tokenizer import encode_chat
from model.errors import InputError
from model.tools import serve_bench
from model.tools.replay import trace_report
from ui.i18n import labels, lang, number, t
from ui.widgets import choice, md_escape, token_strip

log = logging.getLogger(__name__)

MAX_SHARED_MODELS = 4
RUN_REDRAW_S = 0.15  # Run to end redraws the strip after a step once this long has passed since the last redraw

# The shared models live here, not in st.cache_resource: any visitor's websocket can send Streamlit's
# clear-cache message, which would unload every model for every session.
_models: OrderedDict[tuple[str, str], LoadedModel] = OrderedDict()
_models_lock = threading.Lock()
_loading_locks: dict[tuple[str, str], threading.Lock] = {}


def shared_model(name: str, device: str, allow_download: bool = False) -> LoadedModel:
    """The model, loaded by the first session that asks; the others wait for it instead of loading it again."""
    key = model_key(name, device)
    with _models_lock:
        lock = _loading_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in _models:
            loaded = load_model(name, device, allow_download)
            with _models_lock:
                _models[key] = loaded
                while len(_models) > MAX_SHARED_MODELS:
                    _models.popitem(last=False)  # sessions running it keep their reference until they switch
        with _models_lock:
            _models.move_to_end(key)
        return _models[key]


_converted: OrderedDict[tuple[str, str, str], LoadedModel] = OrderedDict()


def shared_model_in(model: LoadedModel, dtype: str) -> LoadedModel:
    """The shared model with its weights in `dtype` (model/engine/lowbit.py), converted once per process and kept
    beside the shared models, at most MAX_SHARED_MODELS of them; float32 is the model itself."""
    key = (model.info.name, model.info.device, dtype)
    with _models_lock:
        if key not in _converted:
            _converted[key] = with_weights(model, dtype)
            while len(_converted) > MAX_SHARED_MODELS:
                _converted.popitem(last=False)
        _converted.move_to_end(key)
        return _converted[key]


def chosen_model() -> tuple[str, str, bool]:
    """(name or path, device, downloads allowed) as the sidebar says."""
    s = st.session_state
    if s.model_name == "custom":
        return s.model_path.strip(), s.device, bool(s.allow_download)
    return s.model_name, s.device, False


def session_checkpoint_model(name: str, device: str) -> LoadedModel:
    """A checkpoint this session saved on the Train page, loaded once for this session only: no other session
    can choose it, so it does not take a place among the shared models."""
    folder = st.session_state.session_checkpoints[name]
    held = st.session_state.get("checkpoint_model")
    if held is None or held[:2] != (folder, device):
        st.session_state.checkpoint_model = (folder, device, load_session_checkpoint(name, folder, device))
    return st.session_state.checkpoint_model[2]


def sidebar_model() -> LoadedModel:
    """The sidebar's model on the sidebar's device; InputError says why it cannot load."""
    name, device, allow_download = chosen_model()
    if name in st.session_state.get("session_checkpoints", {}):
        return session_checkpoint_model(name, device)
    return shared_model(name, device, allow_download)


def error_sentence(bad: InputError) -> str:
    """The error in the user's language, with whatever the user typed escaped for markdown."""
    return t("error." + bad.code, **{k: md_escape(str(v)) for k, v in bad.details_in(lang()).items()})


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
            return sidebar_model()
    except InputError as bad:
        st.error(error_sentence(bad))
    except Exception:
        log.exception("loading %r failed", chosen_model())
        st.error(t("error.model_unexpected"))
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


def attempt(action: Callable[[], object]) -> tuple[object | None, str | None]:
    """Run an engine action: (its result, None), or (None, why it failed as a sentence in the user's language)."""
    try:
        return action(), None
    except InputError as bad:
        return None, error_sentence(bad)
    except Exception:
        log.exception("engine action failed")
        return None, t("error.unexpected")


def guarded(action: Callable[[], object]) -> object | None:
    """Run an engine action; bad input becomes a sentence in the user's language, never a traceback."""
    result, error = attempt(action)
    if error is not None:
        st.error(error)
    return result


def guarded_in_callback(action: Callable[[], object]) -> object | None:
    """guarded() for a widget callback: an element drawn there would land above the page's title, so the sentence
    waits in session state until the page says it beside the control that was used (callback_error_here)."""
    result, error = attempt(action)
    if error is not None:
        st.session_state.callback_error = error
    return result


def callback_error_here() -> None:
    """Say here, once, why the last callback's engine action failed."""
    if st.session_state.callback_error is not None:
        st.error(st.session_state.callback_error)
        st.session_state.callback_error = None


def start_generation(model: LoadedModel, prompt_ids: list[int], unknown: list[str], prompt_text: str = "") -> None:
    """Prefill the prompt as this session's new run; InputError leaves the previous run in place."""
    stops = tuple(s for s in st.session_state.stop_text.split("|") if s)
    gen = generate.start(model, prompt_ids, sampling_settings(), int(st.session_state.max_new_tokens), stops)
    st.session_state.generation = gen
    st.session_state.generation_for = (model.info.name, model.info.device)
    st.session_state.prompt_unknown = unknown
    st.session_state.prompt_of_run = prompt_text or model.tokenizer.decode(prompt_ids)  # as `trace` reports it


def reset() -> None:
    st.session_state.generation = None


def run_as_trace_json(model: LoadedModel, gen: generate.Generation, prompt_text: str, unknown: list[str]) -> str:
    """The run as `python -m model trace --json` prints it: the same schema and numbers."""
    return json.dumps(trace_report(model, gen, prompt_text, unknown), ensure_ascii=False)


def prompt_modes(model: LoadedModel) -> list[str]:
    return ["text", "ids"] + (["chat"] if model.tokenizer.chat_template is not None else [])


def encoded_prompt(model: LoadedModel, mode: str) -> tuple[list[int], list[str]]:
    """(ids, unknown words) of the prompt as the form holds it; InputError says what is wrong."""
    s = st.session_state
    if mode == "ids":
        return generate.parse_prompt_ids(model, s.prompt_ids_text), []
    if mode == "chat":
        encoded = encode_chat(model, generate.check_prompt_text(s.prompt_text), s.system_text)
    else:
        encoded = generate.encode_prompt(model, s.prompt_text)
    return encoded.ids, encoded.unknown


def prefill(model: LoadedModel, mode: str) -> None:
    """The Run prefill button's callback: the run starts before the page script, so the page draws it in the same
    script run (the Decode page shows its step view at once, not the form and then a second run). A refused prompt
    keeps the previous run; the form says why, under its button."""
    text = "" if mode == "ids" else st.session_state.prompt_text
    guarded_in_callback(lambda: start_generation(model, *encoded_prompt(model, mode), text))


def prompt_form(model: LoadedModel) -> None:
    """The prompt (text, chat, or ids for the micro example) and the button that runs prefill."""
    modes = prompt_modes(model)
    if model.info.language == "en":
        st.caption(t("prompt.english_only"))
    left, right = st.columns([4, 1], vertical_alignment="bottom")
    with right:
        mode = choice(st.segmented_control, t("prompt.mode"), modes, key="prompt_mode",
                      format_func=labels("prompt.mode_", modes).get, required=True)
    with left:
        if mode == "ids":
            st.text_input(t("prompt.ids_label"), key="prompt_ids_text", help=t("prompt.ids_help"))
        else:
            st.text_input(t("prompt.chat_label" if mode == "chat" else "prompt.label"), key="prompt_text",
                          help=t("prompt.help", most=generate.MAX_PROMPT_CHARS))
    if mode == "chat":
        st.text_input(t("prompt.system_label"), key="system_text", help=t("prompt.system_help"))
    c1, c2, _ = st.columns([1, 1, 3], vertical_alignment="bottom")
    # the shortest prompt (<bos> and one word) leaves context − 1 new tokens; a value above the widget's
    # maximum would be replaced by its minimum, so keep it inside for small contexts
    most = model.info.context_length - 1
    st.session_state.max_new_tokens = min(int(st.session_state.max_new_tokens), most)
    c1.number_input(t("prompt.max_new_tokens"), min_value=1, max_value=most, key="max_new_tokens")
    c2.text_input(t("prompt.stop"), key="stop_text", help=t("prompt.stop_help"))
    st.button(t("prompt.run_prefill"), key="run_prefill", type="primary", icon=":material/play_arrow:",
              on_click=prefill, args=(model, mode))
    callback_error_here()


def _with_generation(action: Callable[[LoadedModel, generate.Generation], object]) -> bool:
    """From a callback, an engine action on this session's run; False when there is none or the action failed
    (the page says why: callback_error_here)."""
    gen = st.session_state.generation
    if gen is None:
        return False
    done = guarded_in_callback(lambda: action(sidebar_model(), gen) or True)
    return done is not None


def redraw_only(fragment: str | None) -> None:
    """From a widget callback: rerun only the named fragment instead of the whole page (None: the whole page).
    A click that interrupted Run to end reruns the whole page, which clears the run's progress bar; so does one
    that came while a whole-page run a fragment asked for (rerun_whole_page) had not yet run to its end."""
    if fragment is not None and not st.session_state.get("running") and not st.session_state.get("whole_page_due"):
        st.rerun(fragment)


def rerun_whole_page() -> None:
    """From a fragment: rerun the whole page. A click's run interrupts a run in progress; were it narrowed to a
    fragment, what only the whole-page run draws (the Decode page's verdict) would stay as it was. So until a
    whole-page run has reached the page's end (app.py clears the mark), clicks rerun the whole page. A page that
    ends in st.stop() (Decode before its prefill) leaves the mark: clicks then redraw whole pages until one runs to
    its end, which is slower, never stale."""
    st.session_state.whole_page_due = True
    st.rerun()


def on_sampling_change(redraw: str | None = None) -> None:
    """New sampling controls re-draw the current step from its stored logits; the model does not run."""
    if _with_generation(lambda model, gen: generate.resample(model, gen, sampling_settings())):
        redraw_only(redraw)


def request_run_to_end() -> None:
    """Run to end happens in a whole-page run, where a click on its Stop button can interrupt it."""
    st.session_state.run_to_end_requested = True
    st.rerun()


def on_next() -> None:
    _with_generation(generate.step)


def on_back() -> None:
    _with_generation(generate.back)


def cache_by_layer_kind(info, n: int, measured: int) -> str | None:
    """Where the cache's bytes go on a model with sliding-window layers (Gemma 3), as a sentence; None on a model
    whose layers all keep every position."""
    if info.window is None:
        return None
    sliding = len(info.sliding_layers)
    full = info.n_layers - sliding
    held = min(n, info.window)
    full_bytes = cache_bytes_formula(full, info.n_kv_heads, n, info.d_head, info.bytes_per_element)
    sliding_bytes = cache_bytes_formula(sliding, info.n_kv_heads, held, info.d_head, info.bytes_per_element)
    return t("cache.by_layer_kind", full=full, sliding=sliding, n=n, window=info.window, held=held,
             kv=info.n_kv_heads, d=info.d_head, b=info.bytes_per_element, full_bytes=number(full_bytes),
             sliding_bytes=number(sliding_bytes), total=number(full_bytes + sliding_bytes), measured=number(measured))


def layer_head_selectors(info, redraw: str | None = None) -> tuple[int, int]:
    """Layer and query head to show; each head's label names the KV head it reads (GQA). Drawn into the caller's
    container, a row (st.container(horizontal=True)): st.columns on a page cost each later click more.
    `redraw` names the fragment that draws the attention, when only it should rerun on a change."""
    head_labels = {h: t("common.head_kv", h=h, kv=info.kv_head(h)) for h in range(info.n_heads)}
    layer = st.selectbox(t("common.layer"), range(info.n_layers), key="layer", width=90,  # numbers only
                         on_change=redraw_only, args=(redraw,))
    head = choice(st.selectbox, t("common.head"), list(range(info.n_heads)), key="head", width=220,
                  format_func=head_labels.get, on_change=lambda: redraw_only(redraw))
    return layer, head


def sampling_controls(redraw: str | None = None) -> None:
    """Temperature, top-k, top-p and seed, drawn into the caller's container, a row. `redraw` names the fragment
    that shows the current step, when only it should rerun on a change."""
    change = dict(on_change=on_sampling_change, args=(redraw,))
    st.slider(t("sampling.temperature"), 0.0, 2.0, step=0.05, key="temperature", width=200,
              help=t("sampling.temperature_help"), **change)
    # the whole page reruns: the top-k box beside the toggle, outside the fragment, turns on or off with it
    st.toggle(t("sampling.top_k_on"), key="top_k_on", on_change=on_sampling_change)
    st.number_input(t("sampling.top_k"), min_value=1, max_value=1000, key="top_k", width=110,
                    disabled=not st.session_state.top_k_on, **change)
    st.slider(t("sampling.top_p"), 0.01, 1.0, step=0.01, key="top_p", width=200, help=t("sampling.top_p_help"),
              **change)
    st.number_input(t("sampling.seed"), min_value=0, max_value=2**31 - 1, key="seed", width=130, **change)


def mark_cancelled_run() -> None:
    """A Run-to-end interrupted by a click (Streamlit stops the script between two steps) counts as cancel."""
    gen = st.session_state.generation
    if st.session_state.get("running") and gen is not None and not gen.finished:
        gen.stop_reason = "cancelled"
    st.session_state.running = False


def strip_tokens(model: LoadedModel, gen: generate.Generation) -> tuple[list[str], list[int], list[str]]:
    """Tokens, ids and chip kinds of the run's sequence: prompt, new tokens, the newest marked current."""
    ids = gen.ids
    kinds = ["" for _ in gen.prompt_ids] + ["new"] * len(gen.new_ids)
    kinds[-1] = "current"
    return [model.tokenizer.token(i) for i in ids], ids, kinds


class LiveStrip:
    """The token strip and a progress bar of a whole-page run that steps to the end, redrawn at most every
    RUN_REDRAW_S: in such a run a click on a widget outside any fragment stops the script between two steps."""

    def __init__(self, text: str):
        self.text, self.last_drawn = text, 0.0
        self.strip, self.bar = st.empty(), st.progress(0.0, text=text)

    def show(self, tokens: list[str], ids: list[int], kinds: list[str], done: float, last: bool = False) -> None:
        if last or time.monotonic() - self.last_drawn >= RUN_REDRAW_S:
            with self.strip.container():
                token_strip(tokens, ids, kinds)
            self.bar.progress(min(1.0, done), text=self.text)
            self.last_drawn = time.monotonic()

    def clear(self) -> None:
        self.strip.empty()
        self.bar.empty()


def run_to_end(model: LoadedModel, gen: generate.Generation) -> None:
    """Step to a stop condition, redrawing the growing strip; a click that stops the script between two steps is
    recorded as a cancel by mark_cancelled_run."""
    st.session_state.running = True
    live = LiveStrip(t("decode.running"))
    guarded(lambda: generate.run_to_end(model, gen, on_step=lambda g: live.show(
        *strip_tokens(model, g), done=len(g.samples) / g.max_new_tokens, last=g.finished)))
    live.clear()
    st.session_state.running = False


@functools.cache
def machine(device: str, dtype: str = "float32") -> serve_bench.Machine:
    """This machine's copy bandwidth and the matmul peak of `dtype`'s kernel, each measured once per process, the
    first time a Serving run needs it (the bandwidth once for every dtype)."""
    if dtype == "float32":
        return serve_bench.measure_machine(torch.device(device))
    return serve_bench.with_matmul_peak(machine(device), dtype)


_pass_costs: dict[tuple[str, str, str], serve_bench.PassCosts] = {}


def pass_costs(model: LoadedModel) -> serve_bench.PassCosts:
    """serve_bench.pass_costs of the model in its weights' dtype, timed once per process (kept by name, device and
    dtype: not the model, which the shared models may drop)."""
    key = (model.info.name, model.info.device, model.info.dtype)
    if key not in _pass_costs:
        _pass_costs[key] = serve_bench.pass_costs(model)
    return _pass_costs[key]
