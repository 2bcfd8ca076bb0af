"""Play on the Paged KV and Tiers pages in headless Chromium: five ticks of Play are five presses of Next, and Pause
stops it.

Each page opens on a run already started (small, the default queue, its first step made); one tab plays five steps
and pauses, another presses Next five times: both show the same step count and the same pool."""

import pytest
from conftest import wait_idle

from model.texts import text

pytestmark = pytest.mark.browser


def steps_shown(page) -> int:
    metric = page.locator("[data-testid='stMetric']").filter(has_text=text("serving.steps", "en")).first
    return int(metric.locator("[data-testid='stMetricValue']").inner_text())


def pool(page) -> str:
    return page.locator(".st-key-key-figure img.dl-chart").first.get_attribute("src")


def open_page(page, server: str, url: str) -> int:
    page.set_viewport_size({"width": 1280, "height": 720})
    page.goto(f"{server}/{url}?lang=en")
    page.locator(".st-key-key-figure img.dl-chart").first.wait_for(timeout=90_000)
    wait_idle(page)
    return steps_shown(page)


@pytest.mark.parametrize("url", ["paged", "tiers"])
def test_five_ticks_of_play_are_five_presses_of_next(app_server, browser_page, url):
    played = browser_page
    first = open_page(played, app_server, url)
    assert first == 1  # the run the page opened on
    played.locator(f".st-key-{url}_speed button").filter(has_text="0.5").click()  # a tick every 2 s
    wait_idle(played)
    played.locator(f".st-key-{url}_play button").click()
    played.wait_for_function(
        """([label, wanted]) => [...document.querySelectorAll("[data-testid='stMetric']")]
             .some(m => m.innerText.startsWith(label) && m.querySelector("[data-testid='stMetricValue']")
                    .innerText.trim() === String(wanted))""",
        arg=[text("serving.steps", "en"), first + 5], timeout=60_000)
    played.locator(f".st-key-{url}_play button").click()  # Pause
    wait_idle(played)
    assert played.locator(f".st-key-{url}_play button").inner_text().strip().endswith(text("action.play", "en"))
    played.wait_for_timeout(3_000)  # a tick would have come by now
    assert steps_shown(played) == first + 5

    pressed = played.context.new_page()
    assert open_page(pressed, app_server, url) == first
    for _ in range(5):
        pressed.locator(f".st-key-{url}_next button").click()
        wait_idle(pressed)
    assert steps_shown(pressed) == first + 5
    assert pool(pressed) == pool(played)
    for page in (played, pressed):
        assert page.locator("[data-testid='stException']").count() == 0
