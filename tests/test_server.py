"""The classroom server as visitors reach it: Streamlit's websocket protocol (loadtest/ws_client.py), and browsers.

A first burst on a fresh server, session isolation, the clear-cache message, three language switches, error
details, and no request leaving the machine. The acceptance tests of issue 13 (items 1, 2, 3, 5, 8).
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import pytest
from conftest import wait_for_charts, wait_idle
from playwright.sync_api import expect

from loadtest.ws_client import Session, StreamlitServer, run_async
from model.engine import generate
from model.engine.loading import load_model
from model.engine.sampling import SamplingSettings
from model.texts import text

pytestmark = pytest.mark.slow  # each test starts Streamlit servers of its own
BURST_SESSIONS = 12
BURST_SPREAD_S = 0.5
ISOLATION_PROMPTS = ["the dog", "my mother", "con mèo", "the cat eats"]
NEXT_CLICKS = 3
GREEDY = SamplingSettings(temperature=0.0, top_k=None, top_p=1.0, seed=0)  # the page's defaults
PAGE_NEW_TOKENS = 20  # the page's default "max new tokens"


def ws_url(http_url: str) -> str:
    return http_url.replace("http://", "ws://") + "/_stcore/stream"


async def open_sessions(url: str, count: int) -> list[Session]:
    """`count` sessions on the decode page in English, each past its first run (so its widgets are known)."""
    sessions = [Session(url, page="decode", query="lang=en") for _ in range(count)]
    await asyncio.gather(*(s.connect() for s in sessions))
    await asyncio.gather(*(s.run() for s in sessions))  # the first page loads, all at once
    return sessions


async def close_all(sessions: list[Session]) -> None:
    await asyncio.gather(*(s.close() for s in sessions))


def test_a_first_burst_of_prefills_on_a_fresh_server_shows_no_exception():
    """Issue 13.1: twelve students open the decode page and press Run prefill within half a second on a just-started
    server. Spread over the half second, not all at once: a late thread then reaches plotly's serialisation
    while an earlier one is inside the first import of pandas (the race seen in class)."""
    async def press_prefill(session: Session, after_s: float) -> None:
        await asyncio.sleep(after_s)
        await session.run("run_prefill")

    async def burst(server: StreamlitServer) -> list[Session]:
        sessions = await open_sessions(server.ws_url, BURST_SESSIONS)
        await asyncio.gather(*(press_prefill(s, i * BURST_SPREAD_S / BURST_SESSIONS) for i, s in enumerate(sessions)))
        await close_all(sessions)
        return sessions

    with StreamlitServer("app.py") as server:
        sessions = run_async(burst(server))
    failed = [s.exceptions[0] for s in sessions if s.exceptions]
    assert failed == [], f"{len(failed)} of {BURST_SESSIONS} sessions saw an exception, e.g.:\n{failed[0]}"
    assert [s.cache_len() for s in sessions] == [3] * BURST_SESSIONS  # "<bos> the dog": the run is shown


def solo_ids(model, prompt: str, nexts: int) -> list[int]:
    gen = generate.start(model, generate.encode_prompt(model, prompt).ids, GREEDY, PAGE_NEW_TOKENS, ())
    for _ in range(nexts):
        generate.step(model, gen)
    return gen.ids


def test_sessions_clicking_together_each_see_exactly_their_solo_run(app_server):
    async def together() -> list[list[int] | None]:
        sessions = await open_sessions(ws_url(app_server), len(ISOLATION_PROMPTS))
        for s, prompt in zip(sessions, ISOLATION_PROMPTS):
            s.set_value("prompt_text", prompt)
        await asyncio.gather(*(s.run("run_prefill") for s in sessions))
        for _ in range(NEXT_CLICKS):
            await asyncio.gather(*(s.run("next") for s in sessions))
        shown = [s.strip_ids() for s in sessions]
        await close_all(sessions)
        return shown

    shown = run_async(together())
    model = load_model("small", "cpu")
    assert shown == [solo_ids(model, p, NEXT_CLICKS) for p in ISOLATION_PROMPTS]


def test_a_click_on_the_decode_page_redraws_only_the_step_view(app_server):
    """Issue 12: the browser's work per click grows with the number of elements redrawn. Next, Back, a sampling
    change and a head change send the step view's four buttons and its one piece of HTML; nothing of the sidebar,
    the title or the controls. Run prefill is one script run: the page, its folded prompt form among it, is drawn
    once, with the new run's step view."""
    step_view = ["button"] * 4 + ["html"]

    async def clicks() -> list[list[str]]:
        [s] = await open_sessions(ws_url(app_server), 1)
        await s.run("run_prefill")
        sent = [s.drawn]
        for action in ("next", "next", "back"):
            await s.run(action)
            sent.append(s.drawn)
        s.set_value("temperature", "0.50")  # a select slider: the option as the page writes it
        await s.run()
        sent.append(s.drawn)
        s.set_value("head.en", "head 1 (reads KV head 0)")  # a select box sends the label it shows
        await s.run()
        sent.append(s.drawn)
        await close_all([s])
        return sent

    prefill, *step_clicks = run_async(clicks())
    # the form's two text boxes (prompt, stop) and the step view's four buttons beside the form's, Play's and the
    # sampling lesson's, each once
    assert prefill.count("text_input") == 2 and prefill.count("button") == 4 + 3 and prefill.count("html") >= 1
    assert step_clicks == [step_view] * 5


def test_a_visitors_clear_cache_message_does_not_unload_the_model():
    """Issue 13.5: Streamlit's "Clear cache" (any websocket can send it) must not make anyone reload a model.
    Every safetensors read of the server process is logged, so a reload shows whatever the caching looks like."""
    async def clear_then_use(server: StreamlitServer) -> tuple[int, int]:
        visitor, student = await open_sessions(server.ws_url, 2)
        await visitor.run("run_prefill")
        reads_before = len(server.weight_reads())
        await visitor.send_clear_cache()
        await visitor.run()  # the same connection: handled after the clear
        await student.run("run_prefill")
        await student.run("next")
        await close_all([visitor, student])
        assert not visitor.exceptions and not student.exceptions
        return reads_before, len(server.weight_reads())

    with StreamlitServer("app.py", count_weight_reads=True) as server:
        before, after = run_async(clear_then_use(server))
    assert before >= 1  # the model was read from disk once: the counting works
    assert after == before, f"the clear-cache message made the server read the weights again ({after - before}×)"


def test_streamlits_error_details_are_not_sent_to_visitors():
    """Issue 13.3: an uncaught exception shows no message, no traceback, no server path (the project's config)."""
    secret = "secret-detail-4711"
    script = Path(tempfile.mkdtemp(prefix="raises-")) / "raises.py"
    script.write_text(f"raise RuntimeError('{secret} in /srv/private/model.safetensors')\n")

    async def visit(server: StreamlitServer) -> list[str]:
        session = Session(server.ws_url, page="", query="")
        await session.connect()
        await session.run()
        await session.close()
        return session.exceptions

    with StreamlitServer(script) as server:  # run from the project root: its .streamlit/config.toml applies
        exceptions = run_async(visit(server))
    assert len(exceptions) == 1  # the script did fail, and the visitor was told so
    assert secret not in exceptions[0] and str(script) not in exceptions[0] and "Traceback" not in exceptions[0]
    assert "raises.py" not in exceptions[0]


# -- in a real browser -----------------------------------------------------------------------------------------

def cache_pattern(lang: str, positions: int) -> re.Pattern:
    return re.compile(rf"cache: {positions} positions" if lang == "en" else rf"cache: {positions} vị trí")


def slider_value(page, key: str) -> float:
    """A select slider's value as it writes it (the range input holds the option's index), read in either
    language's format."""
    written = page.locator(f".st-key-{key} [data-testid='stSliderThumbValue']").first.inner_text()
    return float(written.replace(".", "").replace(",", ".") if "," in written else written)


@pytest.mark.browser
def test_three_language_switches_keep_the_model_the_run_and_the_sampling_values(app_server, browser_page):
    """Issue 13.2: prefill and two Next clicks in Vietnamese, temperature 0.15 and top-p 0.98, then vi → en → vi
    → en: every time the model, the cache length and both sliders are still the same, and no error is shown."""
    page = browser_page
    page.goto(f"{app_server}/decode?lang=vi")
    page.locator(".st-key-decode_settings summary").click()  # the page opens on a run, its form folded
    page.locator(".st-key-run_prefill button").click()
    page.get_by_text(cache_pattern("vi", 3)).first.wait_for()  # "<bos> con mèo"
    for positions in (4, 5):
        page.locator(".st-key-next button").click()
        page.get_by_text(cache_pattern("vi", positions)).first.wait_for()
    for key, press, times in (("temperature", "ArrowRight", 3), ("top_p", "ArrowLeft", 2)):
        for _ in range(times):  # one press a rerun: the slider drawn again may have lost the focus
            page.locator(f".st-key-{key} input[type='range']").first.focus()
            page.keyboard.press(press)
            wait_idle(page)
    page.get_by_text(re.compile(r"xác suất sau lọc")).first.wait_for()  # the server drew with temperature > 0
    wait_idle(page)
    for lang, name in (("en", "English"), ("vi", "Tiếng Việt"), ("en", "English")):
        page.locator("[class*='st-key-lang']").get_by_text(name, exact=True).click()
        page.get_by_text(cache_pattern(lang, 5)).first.wait_for()
        wait_idle(page)
        model_box = page.locator("[class*='st-key-model_name'] input").first  # shows the chosen label
        expect(model_box).to_have_value(text("model.small", lang), timeout=60_000)  # redrawn in the new language
        assert (round(slider_value(page, "temperature"), 2), round(slider_value(page, "top_p"), 2)) == (0.15, 0.98)
        assert page.locator("[data-testid='stException'], [data-testid='stAlertContentError']").count() == 0, lang


@pytest.mark.browser
def test_every_request_stays_on_the_server(app_server, browser_page):
    """Issue 13.8: a classroom may be offline: no favicon, font or script from an outside host."""
    page = browser_page
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(f"{app_server}/?lang=en")
    wait_idle(page)
    page.goto(f"{app_server}/decode?lang=en")
    page.locator(".st-key-decode_settings summary").click()  # the page opens on a run, its form folded
    page.locator(".st-key-run_prefill button").click()
    page.get_by_text(cache_pattern("en", 3)).first.wait_for()
    page.get_by_role("link", name="Prefill").first.click()  # the same session's run, drawn by plotly
    wait_for_charts(page)
    linked = page.evaluate("""() => [...document.querySelectorAll('link[href], script[src], img[src]')]
        .map(e => e.href || e.src)""")
    outside = sorted({u for u in requested + linked
                      if urlparse(u).scheme in ("http", "https", "ws", "wss") and urlparse(u).hostname != "127.0.0.1"})
    assert outside == []
