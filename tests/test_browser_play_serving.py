"""Play on the Serving page in headless Chromium: five ticks of Play are five presses of Next, and Pause stops it.

The page opens on a run of the default queue, its first step made; one tab plays five steps and pauses, another
presses Next as many times as Play ticked (five, or six where a tick beat the click on Pause on a loaded machine):
both show the same step count and the same lanes."""

import pytest
from conftest import wait_idle

from model.texts import text

pytestmark = pytest.mark.browser


def steps_shown(page) -> int:
    metric = page.locator("[data-testid='stMetric']").filter(has_text=text("serving.steps", "en")).first
    return int(metric.locator("[data-testid='stMetricValue']").inner_text())


def lanes(page) -> str:
    return page.locator(".st-key-key-figure img.dl-chart").first.get_attribute("src")


def open_serving(page, server: str) -> int:
    page.goto(f"{server}/serving?lang=en")
    page.locator(".st-key-key-figure img.dl-chart").first.wait_for(timeout=90_000)
    wait_idle(page)
    return steps_shown(page)


def test_five_ticks_of_play_are_five_presses_of_next(app_server, browser_page):
    played = browser_page
    first = open_serving(played, app_server)
    played.locator(".st-key-serving_speed button").filter(has_text="0.5").click()  # a tick every 2 s
    wait_idle(played)
    played.locator(".st-key-serving_play button").click()
    played.wait_for_function(
        """([label, wanted]) => [...document.querySelectorAll("[data-testid='stMetric']")]
             .some(m => m.innerText.startsWith(label) && m.querySelector("[data-testid='stMetricValue']")
                    .innerText.trim() === String(wanted))""",
        arg=[text("serving.steps", "en"), first + 5], timeout=60_000)
    played.locator(".st-key-serving_play button").click()  # Pause
    wait_idle(played)
    assert played.locator(".st-key-serving_play button").inner_text().strip().endswith(text("action.play", "en"))
    ticks = steps_shown(played) - first  # five, or six where a tick beat the click on a loaded machine
    assert ticks in (5, 6)
    played.wait_for_timeout(3_000)  # a tick would have come by now
    assert steps_shown(played) == first + ticks

    pressed = played.context.new_page()
    assert open_serving(pressed, app_server) == first
    for _ in range(ticks):
        pressed.locator(".st-key-serving_next button").click()
        wait_idle(pressed)
    assert steps_shown(pressed) == first + ticks
    assert lanes(pressed) == lanes(played)
    for page in (played, pressed):
        assert page.locator("[data-testid='stException']").count() == 0
