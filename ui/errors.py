"""Engine actions run from the pages: bad input becomes a sentence in the user's language, never a traceback.
attempt returns the sentence, guarded draws it where it is called, guarded_in_callback keeps it for
callback_error_here (a callback's elements would land above the page's title)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import streamlit as st

from model.errors import InputError
from ui.i18n import lang, t
from ui.widgets import md_escape

log = logging.getLogger(__name__)


def error_sentence(bad: InputError) -> str:
    """The error in the user's language, with whatever the user typed escaped for markdown."""
    return t("error." + bad.code, **{k: md_escape(str(v)) for k, v in bad.details_in(lang()).items()})


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
