"""t(key): every user-facing sentence of the app, in the session's language, from assets/strings/*.json."""

from __future__ import annotations

import streamlit as st

from model.texts import LANGUAGES, number_in, text

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


def number(value: float, spec: str | None = None) -> str:
    """A number as the session's language writes it (texts.number_in): 6,144 and 6.5625 in English, 6.144 and
    6,5625 in Vietnamese."""
    return number_in(value, lang(), spec)


def decimal(value: float, places: int = 1) -> str:
    """number() with `places` decimals: 1,234.5 in English, 1.234,5 in Vietnamese."""
    return number(value, f",.{places}f")


SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def scientific(value: float) -> str:
    """A tiny or huge number as a class reads it, in the session's format: 0; 7,75 × 10⁻⁷ in Vietnamese and
    7.75 × 10⁻⁷ in English; 10⁻⁴; a number between 0,001 and 1.000 as number() writes it (3 digits)."""
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.2e}".split("e")
    power = int(exponent)
    if -3 <= power < 3:
        return number(float(f"{value:.3g}"))
    ten = "10" + str(power).translate(SUPERSCRIPT)
    return ten if float(mantissa) == 1 else f"{number(float(mantissa))} × {ten}"
