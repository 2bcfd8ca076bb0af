"""The app under streamlit.testing.v1.AppTest: open one of its pages with some session state set, click a button.

Through app.py, as a visitor would: its sidebar and session defaults run before the page.
"""

from pathlib import Path

from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parent.parent / "app.py")


def open_app(page: str, timeout: int = 60, **state) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=timeout)
    for key, value in state.items():
        at.session_state[key] = value
    at.run()
    at.switch_page(page)
    at.run()
    assert not at.exception, at.exception
    return at


def click(at: AppTest, key: str) -> AppTest:
    at.button(key=key).click().run()
    assert not at.exception, at.exception
    return at


def element_order(at: AppTest) -> list[str]:
    """The main area's elements top to bottom: a widget's key, or the element's kind ("Title", "Error", ...)."""
    return [getattr(node, "key", None) or type(node).__name__ for node in at.main]
