"""Issue 26 in a real browser, both languages: the logit lens and a switched-off head on the Decode page."""

import pytest
from conftest import wait_idle

from model.texts import text

pytestmark = pytest.mark.browser


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_the_lens_and_a_head_off_in_the_step_view(app_server, browser_page, artifacts, lang):
    page = browser_page
    page.goto(f"{app_server}/decode?lang={lang}")
    page.get_by_role("button", name=text("prompt.run_prefill", lang)).first.click()
    wait_idle(page)
    page.get_by_role("button", name=text("decode.next", lang)).first.click()
    wait_idle(page)
    page.get_by_text(text("lens.toggle", lang), exact=True).first.click()
    wait_idle(page)
    page.get_by_text(text("lens.title", lang)).first.wait_for(timeout=60_000)
    page.locator(".st-key-heads_off").first.click()
    page.get_by_role("option", name="1.2", exact=True).click()
    wait_idle(page)
    page.keyboard.press("Escape")
    page.get_by_text(text("ablation.title", lang).format(heads="1.2")).first.wait_for(timeout=60_000)
    # small has 4 layers: one row each in the lens table, after the header
    rows = page.locator("table.mini-table").filter(has_text=text("lens.layer", lang)).locator("tbody tr")
    rows.nth(3).wait_for(timeout=60_000)  # the step's check may still redraw the page once (its verdict)
    wait_idle(page)
    assert rows.count() == 4
    page.get_by_text("KL(").first.wait_for()
    page.screenshot(path=str(artifacts / f"decode-lens-heads-off-{lang}.png"), full_page=True)
    assert not page.locator('[data-testid="stException"]').count()
