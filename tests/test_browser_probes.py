"""Issue 26 in a real browser, both languages: the logit lens and switched-off heads (Decode), predict then reveal
(Decode, Cache)."""

import pytest
from conftest import retried, wait_idle

from model.texts import text

pytestmark = pytest.mark.browser


def decode_prefilled(page, app_server: str, lang: str) -> None:
    """The Decode page in `lang` with its default prompt prefilled (it opens on that run), its settings open."""
    page.goto(f"{app_server}/decode?lang={lang}")
    page.locator(".st-key-decode_settings summary").first.click()
    page.get_by_role("button", name=text("prompt.run_prefill", lang)).first.click()
    wait_idle(page)


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_the_lens_and_a_head_off_in_the_step_view(app_server, browser_page, artifacts, lang):
    page = browser_page
    decode_prefilled(page, app_server, lang)
    page.get_by_role("button", name=text("action.next", lang)).first.click()
    wait_idle(page)
    page.get_by_text(text("lens.toggle", lang), exact=True).first.click()
    wait_idle(page)
    page.get_by_text(text("lens.title", lang)).first.wait_for(timeout=60_000)
    page.set_viewport_size({"width": 1440, "height": 2600})  # room below the box for its drop-down
    def choose_head() -> None:  # under load an option's click can be lost while the drop-down opens
        page.locator(".st-key-heads_off").first.click()
        page.get_by_role("option", name="1.2", exact=True).click()
        wait_idle(page)
        page.keyboard.press("Escape")

    retried(choose_head, lambda: page.locator(".st-key-heads_off [data-tag]").count() > 0, "heads off 1.2 chosen")
    page.get_by_text(text("ablation.title", lang).format(heads="1.2")).first.wait_for(timeout=60_000)
    # small has 4 layers: one row each in the lens table, after the header
    rows = page.locator("table.mini-table").filter(has_text=text("lens.layer", lang)).locator("tbody tr")
    rows.nth(3).wait_for(timeout=60_000)  # the step's check may still redraw the page once (its verdict)
    wait_idle(page)
    assert rows.count() == 4
    page.get_by_text("KL(").first.wait_for()
    page.screenshot(path=str(artifacts / f"decode-lens-heads-off-{lang}.png"), full_page=True)
    assert not page.locator('[data-testid="stException"]').count()


def guess_table_cells(page, lang: str) -> list[list[str]]:
    table = page.locator("table.mini-table").filter(has_text=text("predict.col_guess", lang))
    return [[c.inner_text() for c in row.locator("td").all()] for row in table.locator("tbody tr").all()]


def whole_number(written: str) -> int:
    return int("".join(c for c in written if c.isdigit()))  # 6,144 in English, 6.144 in Vietnamese


def type_number(page, key: str, value: int) -> None:
    box = page.locator(f".st-key-{key} input")

    def type_it() -> None:  # the rerun of the box typed before can redraw this one over what was just typed
        box.fill(str(value))
        box.press("Enter")
        wait_idle(page)

    retried(type_it, lambda: box.input_value() == str(value), f"{value} typed into {key}")


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_predict_then_reveal_on_the_decode_page(app_server, browser_page, artifacts, lang):
    """Two wrong guesses, then two right ones worked out from the first reveal: the verdicts and the score follow."""
    page = browser_page
    decode_prefilled(page, app_server, lang)
    page.get_by_text(text("predict.toggle", lang), exact=True).first.click()
    wait_idle(page)
    page.get_by_text(text("predict.waiting", lang).format(next=text("action.next", lang))).first.wait_for(
        timeout=60_000)
    type_number(page, "guess_len", 0)
    type_number(page, "guess_bytes", 0)
    page.get_by_role("button", name=text("action.next", lang)).first.click()
    wait_idle(page)
    page.get_by_text(text("predict.score", lang).format(right=0, wrong=2)).first.wait_for(timeout=60_000)
    (_, _, real_len, verdict_len), (_, _, real_bytes, verdict_bytes) = guess_table_cells(page, lang)[:2]
    assert verdict_len == verdict_bytes == text("predict.wrong", lang)
    length, size = whole_number(real_len), whole_number(real_bytes)
    # one more position, and small's every layer holds the same bytes per position
    type_number(page, "guess_len", length + 1)
    type_number(page, "guess_bytes", size + size // length)
    page.get_by_role("button", name=text("action.next", lang)).first.click()
    wait_idle(page)
    page.get_by_text(text("predict.score", lang).format(right=2, wrong=2)).first.wait_for(timeout=60_000)
    rows = guess_table_cells(page, lang)
    assert [r[3] for r in rows[:2]] == [text("predict.right", lang)] * 2
    assert whole_number(rows[0][2]) == length + 1 and whole_number(rows[1][2]) == size + size // length
    page.screenshot(path=str(artifacts / f"decode-predict-{lang}.png"), full_page=True)
    assert not page.locator('[data-testid="stException"]').count()


def test_a_guess_typed_then_next_is_the_guess_revealed(app_server, browser_page):
    """Issue 41: −4 typed, then Next at once (no Enter): the reveal shows −4 as the guess and the box still does (a
    box bounded at 0 kept showing −4 while 0, its last valid value, was recorded)."""
    page = browser_page
    decode_prefilled(page, app_server, "en")
    page.get_by_text(text("predict.toggle", "en"), exact=True).first.click()
    wait_idle(page)
    box = page.locator(".st-key-guess_len input")
    box.fill("-4")
    page.get_by_role("button", name=text("action.next", "en")).first.click()
    wait_idle(page)
    page.get_by_text(text("predict.score", "en").format(right=0, wrong=2)).first.wait_for(timeout=60_000)
    assert guess_table_cells(page, "en")[0][1] == "-4" and box.input_value() == "-4"
    assert not page.locator('[data-testid="stException"]').count()


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_predict_then_reveal_on_the_cache_page(app_server, browser_page, artifacts, lang):
    """The course's 13/5: 17 positions with the cache, 75 without; one right guess, one wrong."""
    page = browser_page
    page.goto(f"{app_server}/cache?lang={lang}")
    page.get_by_role("button", name=text("cache.preset", lang).format(n=13, t=5)).first.click()
    wait_idle(page)
    page.get_by_text(text("predict.toggle", lang), exact=True).first.click()
    wait_idle(page)
    type_number(page, "cache_guess_with", 17)
    type_number(page, "cache_guess_without", 70)
    page.get_by_role("button", name=text("cache.reveal", lang), exact=True).first.click()
    wait_idle(page)
    page.get_by_text(text("predict.score", lang).format(right=1, wrong=1)).first.wait_for(timeout=60_000)
    rows = guess_table_cells(page, lang)
    assert [r[1:] for r in rows] == [["17", "17", text("predict.right", lang)],
                                     ["70", "75", text("predict.wrong", lang)]]
    page.screenshot(path=str(artifacts / f"cache-predict-{lang}.png"), full_page=True)
    assert not page.locator('[data-testid="stException"]').count()
