"""Session defaults for every key, without importing torch (the map page must paint at once)."""

from __future__ import annotations

import streamlit as st

from ui.i18n import lang

# A model's example prompt. smollm2 speaks English only: its example stays English in the Vietnamese UI.
DEFAULT_PROMPTS = {"small": {"vi": "con mèo", "en": "the dog"}, "micro": {"vi": "ăn", "en": "ăn"},
                   "smollm2": {"vi": "What is the capital of France?", "en": "What is the capital of France?"},
                   # a base model, which continues a text; it writes Vietnamese, so its example is Vietnamese in both
                   "gemma3": {"vi": "Thủ đô của Việt Nam là", "en": "Thủ đô của Việt Nam là"},
                   "other": {"vi": "Thủ đô của Việt Nam là", "en": "The capital of France is"}}
# the Speculative page's own example, where the model's would show nothing (small's draft disagrees with "con mèo"
# and "the dog" at once): one whose round 1 keeps some proposals and rejects one; a model change replaces it too
SPECULATIVE_PROMPTS = {"small": {"vi": "mẹ nấu", "en": "my mother cooks"}}
PROMPT_MODES = {"micro": "ids", "smollm2": "chat"}  # the mode a model starts in; "text" otherwise
DEFAULTS = {
    "model_name": "small", "device": "auto", "model_path": "", "allow_download": False,
    "generation": None, "generation_for": None,
    "prompt_mode": "text", "prompt_ids_text": "1, 3", "system_text": "", "callback_error": None,
    "temperature": 0.0, "top_k_on": False, "top_k": 10, "top_p": 1.0, "seed": 0, "max_new_tokens": 20,
    "stop_text": "", "layer": 0, "head": 0, "prompt_unknown": [], "prompt_of_run": "", "check_each_step": True,
    "run_to_end_requested": False, "step_clicks": 0, "logit_lens": False, "heads_off": [],
    "tax_shown": False, "tax_twin": 0, "tax_vi": "", "tax_en": "",
    "count_n": 13, "count_t": 5, "bench_result": None,
    # predict, then reveal (ui/predict.py): the score is a tuple (right, wrong), replaced whole
    "predict_on": False, "guess_len": 0, "guess_bytes": 0, "guess_token": None, "predict_reveal": None,
    "predict_score": (0, 0), "cache_guess_with": 0, "cache_guess_without": 0, "cache_reveal": None,
    "flash_step": 0, "flash_block": 1, "flash_for": None, "flash_custom_n": 32768, "flash_custom_d": 128,
    "flash_custom_block": 128, "flash_walk": None, "flash_walk_for": None,
}


def default_prompt(model_name: str) -> str:
    return DEFAULT_PROMPTS.get(model_name, DEFAULT_PROMPTS["other"])[lang()]


def trained_from(model_name: str) -> str:
    """The bundled model a Train checkpoint of this session was trained from (its tokenizer), else the name."""
    return st.session_state.get("checkpoint_bases", {}).get(model_name, model_name)


def on_model_change() -> None:
    """A new model starts from its own example prompt and mode, unless the user typed a prompt of their own."""
    s = st.session_state
    examples = {p for prompts in [*DEFAULT_PROMPTS.values(), *SPECULATIVE_PROMPTS.values()] for p in prompts.values()}
    if not s.prompt_text.strip() or s.prompt_text in examples:
        s.prompt_text = default_prompt(trained_from(s.model_name))
    s.prompt_mode = PROMPT_MODES.get(trained_from(s.model_name), "text")


def keep_across_pages(page_defaults: dict) -> None:
    """A page's own keys: their defaults the first time, then kept by init_state in every run of every page."""
    for key, value in page_defaults.items():
        if key not in st.session_state:
            st.session_state[key] = value
    st.session_state.kept_keys = st.session_state.get("kept_keys", frozenset()) | page_defaults.keys()


def init_state() -> None:
    for key, value in DEFAULTS.items():
        if key not in st.session_state:
            st.session_state[key] = value
    # Streamlit forgets a widget's value at the end of a run that did not draw the widget (another page's run);
    # re-assigning it in every run makes the value the session's own, so it survives page changes.
    for key in DEFAULTS.keys() | st.session_state.get("kept_keys", frozenset()):
        if key in st.session_state:
            st.session_state[key] = st.session_state[key]
    if "prompt_text" not in st.session_state:
        st.session_state.prompt_text = default_prompt(st.session_state.model_name)
    else:
        st.session_state.prompt_text = st.session_state.prompt_text
