"""The live pages in a real browser: prefill, three Next clicks, Back; screenshots of every page."""

import re

import pytest
from conftest import wait_for_charts, wait_idle

from model.texts import text

pytestmark = pytest.mark.browser

# the buttons as the app labels them; the step summary's cache length as decode.step_summary writes it
LABELS = {lang: {"prefill": text("prompt.run_prefill", lang), "next": text("action.next", lang),
                 "back": text("action.back", lang), "measure": text("cache.measure", lang),
                 "cache": {"vi": r"cache: (\d+) vị trí", "en": r"cache: (\d+) positions"}[lang]}
          for lang in ("vi", "en")}


def cache_positions(page, lang: str) -> int:
    summary = page.get_by_text(re.compile(LABELS[lang]["cache"])).first
    return int(re.search(LABELS[lang]["cache"], summary.inner_text()).group(1))


def wait_for_cache(page, lang: str, positions: int) -> None:
    """The step summary is redrawn after the script run; wait until it shows the expected cache length."""
    pattern = LABELS[lang]["cache"].replace(r"(\d+)", str(positions))
    page.get_by_text(re.compile(pattern)).first.wait_for(timeout=60_000)


def open_settings(page) -> None:
    """The page opens on a run, its prompt form folded into its settings: open them (they stay open)."""
    # the folded form's button comes first in the page and is hidden: wait for whichever is shown
    page.locator(".st-key-key-figure, .st-key-run_prefill button").filter(visible=True).first.wait_for(timeout=60_000)
    if not page.locator(".st-key-run_prefill button").first.is_visible():
        page.locator(".st-key-decode_settings summary, .st-key-prefill_settings summary").first.click()


def click(page, name: str):
    if name in (LABELS["vi"]["prefill"], LABELS["en"]["prefill"]):
        open_settings(page)
    page.get_by_role("button", name=name, exact=False).first.click()
    wait_idle(page)


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_prefill_then_three_next_clicks_grow_the_cache_by_three(app_server, browser_page, artifacts, lang):
    page, words = browser_page, LABELS[lang]
    page.goto(f"{app_server}/decode?lang={lang}")
    click(page, words["prefill"])
    page.get_by_text(re.compile(words["cache"])).first.wait_for(timeout=60_000)
    after_prefill = cache_positions(page, lang)
    for k in range(1, 4):
        click(page, words["next"])
        wait_for_cache(page, lang, after_prefill + k)
    assert cache_positions(page, lang) == after_prefill + 3
    wait_for_charts(page)
    page.screenshot(path=str(artifacts / f"decode-1440x900-{lang}.png"))
    click(page, words["back"])
    wait_for_cache(page, lang, after_prefill + 2)
    assert cache_positions(page, lang) == after_prefill + 2
    page.set_viewport_size({"width": 1280, "height": 720})
    wait_for_charts(page)
    page.screenshot(path=str(artifacts / f"decode-1280x720-{lang}.png"))


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_prefill_and_cache_pages_render(app_server, browser_page, artifacts, lang):
    page, words = browser_page, LABELS[lang]
    page.goto(f"{app_server}/prefill?lang={lang}")
    click(page, words["prefill"])
    page.get_by_text("<bos>").first.wait_for()
    assert page.locator("[data-testid='stException']").count() == 0
    page.set_viewport_size({"width": 1440, "height": 2400})  # the app scrolls inside: a tall window shows it all
    wait_for_charts(page)
    page.screenshot(path=str(artifacts / f"prefill-1440-tall-{lang}.png"))
    page.goto(f"{app_server}/cache?lang={lang}")
    wait_idle(page)
    page.get_by_text("17").first.wait_for()
    assert page.locator("[data-testid='stException']").count() == 0
    wait_for_charts(page)
    page.screenshot(path=str(artifacts / f"cache-1440-tall-{lang}.png"))


def test_script_in_the_prompt_is_shown_as_text(app_server, browser_page):
    """What the user sees: the strip's chips read <unk> (HTML taken as markup would leave them blank) and the
    warning lists the typed pieces of HTML literally."""
    page = browser_page
    page.goto(f"{app_server}/prefill?lang=en")
    wait_idle(page)
    open_settings(page)
    box = page.get_by_label("Prompt", exact=True)
    box.fill("<script>alert(1)</script> <b>the</b> dog")
    box.press("Enter")
    wait_idle(page)
    click(page, LABELS["en"]["prefill"])
    page.locator(".tok").last.wait_for(timeout=60_000)
    words = [chip.split("\n")[0] for chip in page.locator(".tok").all_inner_texts()]
    assert words == ["<bos>", *["<unk>"] * 12, "the", *["<unk>"] * 3, "dog"]
    warning = page.get_by_text("were replaced by <unk>:")
    assert warning.inner_text().endswith("<, script, >, alert, (, 1, )</, script, >, <, b, >, </, b, >")
    assert page.locator("[data-testid='stException']").count() == 0


def test_rapid_sampling_changes_only_redraw_the_current_step(app_server, browser_page):
    """Many reruns in a row (a slider dragged with the keyboard) must not touch earlier steps' tokens."""
    page, words = browser_page, LABELS["en"]
    page.goto(f"{app_server}/decode?lang=en")
    click(page, words["prefill"])
    click(page, words["next"])
    page.get_by_text("Step 1 (decode)").first.wait_for(timeout=60_000)
    fed_before = page.get_by_text(re.compile(r"fed .* at position \d+")).first.inner_text()
    slider = page.get_by_role("slider").first
    slider.focus()
    for _ in range(20):
        slider.press("ArrowRight")
    wait_idle(page)  # a redraw the slider started keeps the script running: idle means it is done
    summary = page.get_by_text(re.compile(r"fed .* at position \d+")).first.inner_text()
    assert summary.split(" at position")[0] == fed_before.split(" at position")[0]
    fed, position = re.search(r"fed (.+) at position (\d+)", summary).groups()
    chip = page.locator(".tok").nth(int(position)).inner_text()
    assert chip.split("\n")[0] == fed  # the strip shows the token that was really fed at that position


def test_arrow_keys_step_and_go_back_but_not_while_typing(app_server, browser_page):
    """Issue 25: → is Next and ← is Back on Decode; in a text box (the sampling seed) the arrows only move the
    caret."""
    page, words = browser_page, LABELS["en"]
    page.goto(f"{app_server}/decode?lang=en")
    click(page, words["prefill"])
    page.get_by_text(re.compile(words["cache"])).first.wait_for(timeout=60_000)
    start = cache_positions(page, "en")
    page.locator("h1").first.click()  # the focus off any box, as after reading the page
    page.keyboard.press("ArrowRight")
    wait_for_cache(page, "en", start + 1)
    page.keyboard.press("ArrowRight")
    wait_for_cache(page, "en", start + 2)
    page.keyboard.press("ArrowLeft")
    wait_for_cache(page, "en", start + 1)
    box = page.locator(".st-key-seed input")
    box.click()
    for key in ("ArrowLeft", "ArrowRight", "ArrowRight"):
        box.press(key)
    wait_idle(page)  # a step, had one started, would keep the script running
    assert cache_positions(page, "en") == start + 1
    assert page.locator("[data-testid='stException']").count() == 0


def test_arrow_keys_pressed_at_once_are_taken_in_order(app_server, browser_page):
    """Issue 41: → then ← pressed before the page has redrawn step 1 (Back still disabled then) are both taken, in
    the order pressed: back at step 0, as after the same two keys pressed slowly (Streamlit's shortcut dropped the
    ←: step 1). Then six at once, with a ← at step 0 that has nothing to undo: + 1 + 1 − 1 − 1 − 0 + 1."""
    page, words = browser_page, LABELS["en"]
    page.goto(f"{app_server}/decode?lang=en")
    click(page, words["prefill"])
    page.get_by_text(re.compile(words["cache"])).first.wait_for(timeout=60_000)
    start = cache_positions(page, "en")
    page.locator("h1").first.click()
    arrows = {"→": "ArrowRight", "←": "ArrowLeft"}
    for keys, ends_at in (("→←", start), ("→→←←←→", start + 1)):
        for key in keys:
            page.keyboard.press(arrows[key])
        wait_for_cache(page, "en", ends_at)
        wait_idle(page)  # the queue has nothing left to press: the strip stays where it ended
        assert cache_positions(page, "en") == ends_at, keys
    assert page.locator("[data-testid='stException']").count() == 0
