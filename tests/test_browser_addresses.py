"""Typed addresses in a real browser: /map opens the map, and an address the app does not have opens the map with a
sentence in the session's language, never Streamlit's own English "Page not found" dialog."""

import pytest
from conftest import wait_idle

from model.texts import text

pytestmark = pytest.mark.browser


def map_cells(page) -> int:
    page.locator(".dlm-cell").first.wait_for(timeout=30_000)
    return page.locator(".dlm-cell").count()


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_slash_map_opens_the_map(app_server, browser_page, lang):
    page = browser_page
    page.goto(f"{app_server}/map?lang={lang}")
    wait_idle(page)
    assert map_cells(page) == 22
    assert page.get_by_text(text("map.map_title", lang)).count() == 1
    assert page.get_by_text("Page not found").count() == 0
    assert page.get_by_text(text("nav.not_found", lang).split("{")[0].strip()).count() == 0


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_an_unknown_address_opens_the_map_and_says_so_in_the_session_language(app_server, browser_page, lang):
    page = browser_page
    page.goto(f"{app_server}/nope?lang={lang}")
    wait_idle(page)
    assert map_cells(page) == 22
    assert page.get_by_text("Page not found").count() == 0
    assert page.get_by_text("does not seem to exist").count() == 0
    said = text("nav.not_found", lang).replace("{path}", "/nope")
    assert page.get_by_text(said).count() == 1
    # a click on the map (a rerun) keeps the page and its language, and brings no dialog either
    page.locator(".dlm-cell").first.click()
    wait_idle(page)
    assert page.get_by_text("Page not found").count() == 0
    assert map_cells(page) == 22
