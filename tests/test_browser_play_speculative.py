"""Play on the Speculative page in headless Chromium: five ticks of Play are five presses of Next round, and Pause
stops it.

The page opens on round 1 of its example; one tab plays five rounds and pauses, another presses Next round five
times: both show round 6 and the same sequence. γ = 1 (at most two tokens a round) and a prompt that small answers
at length keep the run going that long."""

import re

import pytest
from conftest import wait_idle

from model.texts import text

pytestmark = pytest.mark.browser
HEADING = "[data-testid='stHeading']"
PROMPT = "ở in"  # small answers it in 8 rounds of γ = 1 (its examples end in 2 to 4)


def round_shown(page) -> str:
    return page.locator(".st-key-key-figure " + HEADING).first.inner_text()


def open_speculative(page, server: str) -> str:
    page.goto(f"{server}/speculative?lang=en")
    page.locator(".st-key-key-figure").first.wait_for(timeout=90_000)
    wait_idle(page)
    page.locator(".st-key-speculative_settings summary").click()
    prompt = page.locator(".st-key-prompt_text input")
    prompt.fill(PROMPT)
    prompt.press("Enter")
    wait_idle(page)
    page.locator(".st-key-spec_gamma input[type='range']").focus()
    for _ in range(3):  # 4 -> 1
        page.keyboard.press("ArrowLeft")
    wait_idle(page)
    page.locator(".st-key-spec_start button").click()
    wait_idle(page)
    return round_shown(page)


def rounds_shown(page) -> int:
    return int(re.match(r"Round (\d+):", round_shown(page))[1])


def test_five_ticks_of_play_are_five_rounds_of_next_round(app_server, browser_page):
    """Pause comes as round 6 shows; on a loaded machine a tick can beat the click by a round, so the other tab
    presses Next round as many times as Play ticked (five, or six)."""
    played = browser_page
    assert open_speculative(played, app_server).startswith("Round 1: small-draft proposes 1 token")
    played.locator(".st-key-speculative_speed button").filter(has_text="0.5").click()  # a tick every 2 s
    wait_idle(played)
    played.locator(".st-key-speculative_play button").click()
    played.locator(".st-key-key-figure " + HEADING).filter(has_text="Round 6:").wait_for(timeout=60_000)
    played.locator(".st-key-speculative_play button").click()  # Pause
    wait_idle(played)
    assert played.locator(".st-key-speculative_play button").inner_text().strip().endswith(
        text("action.play", "en"))
    ticks = rounds_shown(played) - 1
    assert ticks in (5, 6)
    played.wait_for_timeout(3_000)  # a tick would have come by now
    assert rounds_shown(played) == ticks + 1

    pressed = played.context.new_page()
    open_speculative(pressed, app_server)
    for _ in range(ticks):
        pressed.locator(".st-key-spec_next button").click()
        wait_idle(pressed)
    assert round_shown(pressed) == round_shown(played)
    assert pressed.locator(".tok").all_inner_texts() == played.locator(".tok").all_inner_texts()
    for page in (played, pressed):
        assert page.locator("[data-testid='stException']").count() == 0
