"""t(key): every user-facing sentence of the app, in the session's language, from assets/strings/*.json."""

from __future__ import annotations

import streamlit as st

from model.texts import LANGUAGES, text

DEFAULT_LANG = "vi"


def lang() -> str:
    return st.session_state.get("lang", DEFAULT_LANG)


def t(key: str, **details) -> str:
    sentence = text(key, lang())
    return sentence.format(**details) if details else sentence


def init_language() -> None:
    """First run of a session: ?lang=en in the URL chooses English, otherwise Vietnamese."""
    if "lang" not in st.session_state:
        wanted = st.query_params.get("lang", DEFAULT_LANG)
        st.session_state.lang = wanted if wanted in LANGUAGES else DEFAULT_LANG


def labels(prefix: str, options) -> dict:
    """Option -> label, computed now: AppTest calls format_func outside the script run, where the
    session's language cannot be read."""
    return {o: t(prefix + str(o)) for o in options}


def number(value: int) -> str:
    """A whole number as the session's language writes it: 6,144 in English, 6.144 in Vietnamese."""
    written = f"{value:,}"
    return written.replace(",", ".") if lang() == "vi" else written


def decimal(value: float, places: int = 1) -> str:
    """A number with `places` decimals as the session's language writes it: 1,234.5 in English, 1.234,5 in
    Vietnamese."""
    written = f"{value:,.{places}f}"
    return written.translate(str.maketrans(",.", ".,")) if lang() == "vi" else written
