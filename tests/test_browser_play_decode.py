"""Decode's Play in the real app: five ticks are five Next presses (ui/classroom.play_row steps with the Next
button's own callback), and Pause stops it there."""

import re

import pytest
from conftest import wait_idle

pytestmark = pytest.mark.browser

PROMPT = "my mother"  # small draws six tokens from it greedily before <eos>: five steps leave the run going


def figure_text(page) -> str:
    return page.locator(".st-key-key-figure").first.text_content()


def cache_positions(page) -> int:
    return int(re.search(r"cache: (\d+) positions", figure_text(page)).group(1))


def strip(page) -> str:
    return page.locator(".st-key-key-figure .tok-strip").first.text_content()


def wait_for_cache(page, n: int) -> None:
    page.wait_for_function("n => document.querySelector('.st-key-key-figure').textContent"
                           ".includes(`cache: ${n} positions`)", arg=n, timeout=60_000)


def prefill(page) -> None:
    """The prompt typed into the folded settings' form, then Run prefill."""
    if not page.locator(".st-key-run_prefill button").first.is_visible():
        page.locator(".st-key-decode_settings summary").first.click()
    box = page.locator(".st-key-prompt_text input").first
    box.fill(PROMPT)
    box.press("Enter")
    wait_idle(page)
    page.locator(".st-key-run_prefill button").first.click()
    wait_idle(page)


def test_five_ticks_of_play_are_five_next_presses(app_server, browser_page):
    page = browser_page
    page.set_viewport_size({"width": 1280, "height": 720})
    page.goto(f"{app_server}/decode?lang=en")
    page.locator(".st-key-next button").first.wait_for()  # the page opens on a run
    wait_idle(page)
    prefill(page)
    start = cache_positions(page)

    # the slowest pace: a Pause clicked as the fifth step shows lands well before a sixth beat
    page.locator(".st-key-decode_speed button", has_text="0.5 steps/s").first.click()
    wait_idle(page)
    play = page.locator(".st-key-decode_play button").first
    assert "Play" in play.text_content()
    play.click()
    wait_for_cache(page, start + 5)
    play.click()  # Pause
    wait_idle(page)
    page.wait_for_timeout(2500)  # past the next beat: a ticker still running would step again
    assert "Play" in play.text_content()
    assert cache_positions(page) == start + 5
    played = strip(page)

    page.locator(".st-key-reset button").first.click()
    wait_idle(page)
    prefill(page)
    assert cache_positions(page) == start
    for k in range(1, 6):
        page.locator(".st-key-next button").first.click()
        wait_for_cache(page, start + k)
    wait_idle(page)
    assert strip(page) == played
