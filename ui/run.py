"""The Decode run of this session (Prefill, Decode, Cache and Flash show it): its start from the prompt form, Next,
Back, a new draw on new sampling settings, Run to end with its live strip, and its file."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import streamlit as st

from model.engine import generate
from model.engine.runtime import LoadedModel
from model.engine.sampling import SamplingSettings
from model.engine.tokenizer import encode_chat
from model.recording.trace import trace_report
from ui.errors import guarded, guarded_in_callback
from ui.i18n import t
from ui.models import sidebar_model
from ui.reruns import redraw_only
from ui.widgets import token_strip

RUN_REDRAW_S = 0.15  # Run to end redraws the strip after a step once this long has passed since the last redraw


def generation(model: LoadedModel) -> generate.Generation | None:
    """This session's run, dropped when the sidebar switched to another model or device."""
    if st.session_state.generation_for != (model.info.name, model.info.device):
        st.session_state.generation = None
    return st.session_state.generation


def sampling_settings() -> SamplingSettings:
    s = st.session_state
    return SamplingSettings(temperature=float(s.temperature), top_k=int(s.top_k) if s.top_k_on else None,
                            top_p=float(s.top_p), seed=int(s.seed))


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


def _with_generation(action: Callable[[LoadedModel, generate.Generation], object]) -> bool:
    """From a callback, an engine action on this session's run; False when there is none or the action failed
    (the page says why: callback_error_here)."""
    gen = st.session_state.generation
    if gen is None:
        return False
    done = guarded_in_callback(lambda: action(sidebar_model(), gen) or True)
    return done is not None


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
