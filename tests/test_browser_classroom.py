"""Every page as a projector shows it: its key figure on the first screen and wide, presenter mode's type large,
and the Vietnamese view in one number format.

Each page puts its key picture in the container keyed `key-figure` (ui/classroom.key_figure). At 1280 × 720 and
1366 × 768, in vi and en, its top edge must be inside the first screen and its width at least 60 % of the main
column, and no select box may cut its value; in presenter mode no visible text may be under 16 px (an SVG's text
measured as drawn, after its scale), and no select box may cut its value either.
"""

import pytest
from conftest import wait_for_charts, wait_idle

from ui.pages import PAGES

pytestmark = pytest.mark.browser

SIZES = [(1280, 720), (1366, 768)]
PAGE_URLS = [p.url for p in PAGES]

# the key figure's top edge and width, the main column's width (the block container the pages draw in)
MEASURE_FIGURE = """() => {
  const fig = document.querySelector('.st-key-key-figure');
  const main = document.querySelector("[data-testid='stMainBlockContainer']");
  if (!fig || !main) return null;
  const f = fig.getBoundingClientRect(), m = main.getBoundingClientRect();
  const style = getComputedStyle(main);
  const inner = m.width - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  return {top: f.top, height: f.height, width: f.width, main: inner};
}"""

# every visible piece of text under 16 px as the screen shows it: an element's own text nodes at its computed size,
# an SVG's text at its font size times the SVG's scale on the screen
SMALL_TEXT = """() => {
  const small = [];
  const visible = el => {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.height === 0) return false;
    const s = getComputedStyle(el);
    return s.visibility !== 'hidden' && s.display !== 'none' && s.opacity !== '0';
  };
  const main = document.querySelector("[data-testid='stMain']");
  for (const el of main.querySelectorAll('*')) {
    // zero-width spaces draw nothing (KaTeX's struts hold one at 1 px in every formula)
    const own = [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.replace(/\u200b/g, '').trim());
    if (!own || !visible(el)) continue;
    let size = parseFloat(getComputedStyle(el).fontSize);
    if (el instanceof SVGElement && el.ownerSVGElement) {
      const ctm = el.getScreenCTM();
      if (ctm) size = size * Math.hypot(ctm.a, ctm.b);
    }
    if (size < 15.5) small.push(`${el.tagName}:${size.toFixed(1)}:${el.textContent.trim().slice(0, 30)}`);
  }
  return small;
}"""


# every drawn select box whose chosen value is wider than the box (cut: "head 0 (reads KV head" in presenter mode)
CUT_SELECTS = """() => [...document.querySelectorAll("[data-testid='stMain'] [data-testid='stSelectbox'] input")]
  .filter(i => i.getBoundingClientRect().width > 0 && i.scrollWidth > i.clientWidth + 1)
  .map(i => `${i.value}: ${i.scrollWidth} > ${i.clientWidth} px`)"""


def open_page(page, server: str, url: str, lang: str, size: tuple[int, int], present: bool = False) -> None:
    page.set_viewport_size({"width": size[0], "height": size[1]})
    query = f"lang={lang}" + ("&present=1" if present else "")
    page.goto(f"{server}/{'' if url == 'map' else url}?{query}")
    wait_idle(page)
    try:  # a page that has no key figure fails the test's assertion, not a time-out
        page.locator(".st-key-key-figure").first.wait_for(timeout=30_000)
    except Exception:
        pass
    wait_idle(page)
    if url != "map":  # the map is HTML, with no chart to wait for
        wait_for_charts(page)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("lang", ["vi", "en"])
@pytest.mark.parametrize("url", PAGE_URLS)
def test_the_key_figure_is_on_the_first_screen_and_wide(app_server, browser_page, artifacts, url, lang, size):
    page = browser_page
    open_page(page, app_server, url, lang, size)
    box = page.evaluate(MEASURE_FIGURE)
    page.screenshot(path=str(artifacts / f"classroom-{url}-{lang}-{size[0]}x{size[1]}.png"))
    assert box is not None, f"{url}: no key-figure container"
    assert 0 <= box["top"] < size[1] - 80, f"{url}: the key figure starts at y = {box['top']:.0f}"
    assert box["width"] >= 0.6 * box["main"], f"{url}: the key figure is {box['width']:.0f} of {box['main']:.0f} px"
    assert page.evaluate(CUT_SELECTS) == [], url
    assert page.locator("[data-testid='stException']").count() == 0


@pytest.mark.parametrize("url", PAGE_URLS)
def test_presenter_mode_has_no_text_under_16_px(app_server, browser_page, artifacts, url):
    page = browser_page
    open_page(page, app_server, url, "vi", (1280, 720), present=True)
    page.screenshot(path=str(artifacts / f"classroom-present-{url}.png"))
    small = page.evaluate(SMALL_TEXT)
    assert small == [], f"{url}: {len(small)} pieces of text under 16 px, e.g. {small[:8]}"
    assert page.evaluate(CUT_SELECTS) == [], url


# numbers the English way in the Vietnamese view: a decimal point before one, two or four-plus digits ("0.65",
# "12.5", "2.7733"; three digits after a dot is Vietnamese grouping, "1.024"), or a comma grouping thousands twice
ENGLISH_NUMBERS = r"(?<![\w.,])\d+\.(\d{1,2}|\d{4,})(?![\w.,])|\d{1,3},\d{3},\d{3}"
VISIBLE_TEXT = """() => [...document.querySelectorAll("[data-testid='stMain'] *")]
  .filter(el => !el.closest('code, pre, .stCode, [data-testid="stCode"], style, script'))
  .flatMap(el => [...el.childNodes].filter(n => n.nodeType === 3).map(n => n.textContent))
  .join('\\n')"""


@pytest.mark.parametrize("url", PAGE_URLS)
def test_the_vietnamese_view_writes_numbers_the_vietnamese_way(app_server, browser_page, url):
    import re
    page = browser_page
    open_page(page, app_server, url, "vi", (1280, 720))
    found = [m.group(0) for m in re.finditer(ENGLISH_NUMBERS, page.evaluate(VISIBLE_TEXT))]
    assert found == [], f"{url}: numbers in the English format in the vi view: {found[:10]}"
