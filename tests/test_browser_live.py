"""The Live server page in a real browser at 1280 × 720: the pool on the first screen, drawn from a stand-in server
(tests/live_fake.py) and from the real one (`python -m model serve --model small`), a prompt sent from the page and
its answer. The page polls twice a second, so these tests wait for what they look for, never for an idle page."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import _free_port, served
from live_fake import FakeServer

from model.texts import text

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parent.parent
SERVER_START_S = 120


def point_the_page_at(page, app_server: str, url: str, lang: str) -> None:
    """Opens the page at 1280 × 720 and gives it the server's address in its folded settings, folded again after."""
    page.set_viewport_size({"width": 1280, "height": 720})
    page.goto(f"{app_server}/live?lang={lang}")
    page.locator(".st-key-key-figure").first.wait_for(timeout=60_000)
    summary = page.locator(".st-key-live_settings summary")
    summary.click()
    box = page.locator(".st-key-live_url input")
    box.fill(url)
    box.press("Enter")
    summary.click()


def pool_picture(page, lang: str, blocks: int):
    """The pool's grid in the key figure (its alt text names its blocks)."""
    alt = text("paged.pool_alt", lang).split("{blocks}")[0] + str(blocks)
    picture = page.locator(f".st-key-key-figure img.dl-chart[alt^='{alt}']").first
    picture.wait_for(timeout=60_000)
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=picture.element_handle())
    return picture


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_the_pool_of_a_busy_server_is_on_the_first_screen(app_server, browser_page, artifacts, lang):
    page = browser_page
    with FakeServer() as fake:
        point_the_page_at(page, app_server, fake.url, lang)
        box = pool_picture(page, lang, 20).bounding_box()
        assert box["y"] >= 0 and box["y"] + box["height"] <= 720, box
        assert box["width"] >= 600, box
        page.get_by_text(text("live.event_preempted", lang).format(step=104, request=4)).first.wait_for()
        page.screenshot(path=str(artifacts / f"live-fake-1280x720-{lang}.png"))
        assert page.locator("[data-testid='stException']").count() == 0


@pytest.fixture(scope="module")
def real_server():
    """`python -m model serve --model small` on a free port, with a pool of 1 MiB (32 blocks: drawn block by
    block)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with served([sys.executable, "-m", "model", "serve", "--model", "small", "--port", str(port), "--budget-mb", "1"],
                url + "/health", SERVER_START_S, "the server"):
        yield url


def test_the_real_server_answers_a_prompt_sent_from_the_page(app_server, browser_page, artifacts, real_server):
    page = browser_page
    point_the_page_at(page, app_server, real_server, "en")
    box = pool_picture(page, "en", 32).bounding_box()
    assert box["y"] >= 0 and box["y"] + box["height"] <= 720, box
    prompt = page.locator(".st-key-live_prompt input")
    prompt.fill("the dog")
    prompt.press("Enter")
    page.locator(".st-key-live_send button").click()
    # small answers in milliseconds: its answer, its usage and the latency tables
    page.get_by_text("Done (").first.wait_for(timeout=60_000)
    page.get_by_text(text("live.by_concurrent", "en")).first.wait_for(timeout=30_000)
    answer = page.locator("[data-testid='stCode']").first.inner_text()
    assert answer.strip() and answer.strip() != "…"
    page.screenshot(path=str(artifacts / "live-real-1280x720-en.png"))
    assert page.locator("[data-testid='stException']").count() == 0
