"""The 22-cell map (home page): the HTML builder, the page under AppTest, no torch, the real app in Chromium."""

from __future__ import annotations

import copy
import itertools
import json
import re
import subprocess
import sys
import textwrap
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import settled
from streamlit.testing.v1 import AppTest

from model.texts import text
from ui.map_view import (
    BAND_CHOICES,
    CSS,
    PARTS,
    SCRIPT,
    band_choice_label,
    load_cells,
    map_html,
    map_labels,
)
from ui.pages import PAGES, live_views, tab_of

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")
TIMEOUT = 60
IDS = [f"{band}{letter}" for band, letters in zip("12345", ["ABC", "ABCD", "ABCDE", "ABCDEFG", "ABC"], strict=True)
       for letter in letters]  # fmt: skip


def labels(lang: str = "vi") -> dict[str, str]:
    return map_labels(lambda key: text(key, lang))


def build(lang="vi", band="all", hide_overlay=False, cells=None, custom_labels=None) -> str:
    return map_html(cells or load_cells(), lang, band, hide_overlay, custom_labels or labels(lang))


class Tags(HTMLParser):
    """Every start tag with its attributes, and the text of the whole document."""

    def __init__(self, html: str):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data):
        self.text.append(data)

    def find(self, tag: str, cls: str) -> list[dict[str, str]]:
        return [a for t, a in self.tags if t == tag and cls in a.get("class", "").split()]


def spec_of(html: str) -> dict:
    """The JSON the page hands to its script (between `const spec = ` and the end of that line)."""
    match = re.search(r"const spec = (.*);\n", html)
    assert match, "no spec in the script"
    return json.loads(match.group(1))


# -----------------------------------------------------------------------------
# the data and the HTML builder


def test_the_data_has_22_cells_with_every_part_in_both_languages():
    cells = load_cells()
    assert [c["id"] for c in cells] == IDS
    for c in cells:
        assert c["band"] == c["id"][0]
        for lang in ("vi", "en"):
            for part in ("title", "tagline", *PARTS):
                assert c[lang][part].strip(), (c["id"], lang, part)


def test_every_label_exists_in_both_languages():
    for lang in ("vi", "en"):
        assert all(v.strip() for v in labels(lang).values())
        assert text("map.reading_order", lang) and text("map.hide_overlay", lang)
        assert text("map.hint", lang) and text("map.live_legend", lang) and text("map.filter", lang)


def test_filter_chip_labels():
    def t(key):
        return text(key, "vi")

    label = band_choice_label(t)
    assert BAND_CHOICES == ("all", "1", "2", "3", "4", "5")
    assert label("all") == "Tất cả (22)"
    assert label("3") == "3 Học từ sai số"
    assert band_choice_label(lambda key: text(key, "en"))("5") == "5 Inference"


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_all_22_cells_and_their_popovers(lang):
    doc = Tags(build(lang))
    buttons = doc.find("button", "dlm-cell")
    assert [b["data-cell"] for b in buttons] == IDS
    assert [d["data-cell"] for d in doc.find("dialog", "dlm-pop")] == IDS
    for b in buttons:  # each cell opens its own pop-over and is described by its tooltip
        assert b["aria-controls"] == f"dlm-pop-{b['data-cell']}"
        assert b["aria-describedby"] == f"dlm-tip-{b['data-cell']}"
    body = "".join(doc.text)
    cells = load_cells()
    for c in cells:
        assert c[lang]["title"] in body and c[lang]["tagline"] in body and c[lang]["caveat"] in body
    for part in PARTS:
        assert body.count(text(f"map.{part}", lang)) >= len(cells)
    assert len([a for a in doc.find("button", "dlm-close") if a["aria-label"] == text("map.close", lang)]) == 22


def test_layout_four_columns_and_band_five():
    doc = Tags(build())
    columns = [a["data-band"] for a in doc.find("section", "dlm-col")]
    assert columns == ["1", "2", "3", "4"]
    assert [a["data-band"] for a in doc.find("section", "dlm-band5")] == ["5"]
    html = build()
    for n in "1234":  # column n holds exactly band n's cells, in order
        block = html.split(f'class="dlm-col dlm-col-{n}')[1].split("</section>")[0]
        assert re.findall(r'data-cell="(\w+)" data-band', block) == [i for i in IDS if i[0] == n]
    assert text("map.col4_note", "vi") in html  # column 4 says it is not a next step


def test_a_malicious_text_shows_as_text():
    cells = copy.deepcopy(list(load_cells()))
    cells[0]["vi"]["title"] = "<script>alert(1)</script>"
    cells[0]["vi"]["tagline"] = '"><img src=x onerror=alert(2)>'
    cells[1]["vi"]["caveat"] = "</dialog><b>x</b>"
    bad = dict(labels("vi"))
    bad["map.arrow_next_batch"] = "</script><script>alert(3)</script>"
    bad["map.receives"] = "<i>Nhận</i>"
    html = build(cells=cells, custom_labels=bad)
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<img" not in html and "&lt;img src=x onerror=alert(2)&gt;" in html
    assert "<b>x</b>" not in html and "<i>Nhận</i>" not in html
    # exactly our own script element: the label went in as JSON with < and > escaped
    assert html.count("<script>") == 1 and html.count("</script>") == 1
    assert spec_of(html)["arrows"][-2]["label"] == "</script><script>alert(3)</script>"
    # the text still reads right once parsed
    doc = Tags(html)
    assert "<script>alert(1)</script>" in "".join(doc.text)


def test_script_and_style_survive_the_sanitizer():
    # st.html runs DOMPurify, which drops a <script> or <style> whose text has "<" followed by a letter,
    # "/" or "!": neither may contain one, whatever the data
    html = build()
    script = html[html.index("<script>") + len("<script>") : html.index("</script>")]
    style = html[html.index("<style>") + len("<style>") : html.index("</style>")]
    for body in (script, style, SCRIPT, CSS):
        assert not re.search(r"<[/\w!]", body)


def test_hide_overlay_removes_the_arrows_frames_and_labels():
    shown = build(hide_overlay=False)
    arrows = spec_of(shown)["arrows"]
    pairs = [(a["from"], a["to"]) for a in arrows]
    reading = ["1A", "1B", "1C", "2A", "2B", "2C", "2D", "3A", "3B", "3C", "3D", "3E"]
    assert pairs[: len(reading) - 1] == list(itertools.pairwise(reading))
    assert ("5A", "5B") in pairs and ("5B", "5C") in pairs
    assert ("1C", "2A") in pairs and ("2D", "3A") in pairs  # column 1 -> 2 -> 3
    labelled = {a["label"]: (a["from"], a["to"]) for a in arrows if a.get("label")}
    assert labelled == {"batch tiếp theo": ("3E", "col-1"), "nạp trọng số": ("3E", "5A")}  # in the page's language
    english = {a["label"] for a in spec_of(build(lang="en"))["arrows"] if a.get("label")}
    assert english == {"next batch", "load weights"}
    assert not any(a["from"][0] == "4" or a["to"][0] == "4" for a in arrows)  # column 4 is not in the flow
    doc = Tags(shown)
    assert len(doc.find("section", "dlm-frame")) == 5 and len(doc.find("header", "dlm-head")) == 5
    assert "dlm-overlay-on" in shown

    hidden = build(hide_overlay=True)
    assert spec_of(hidden)["arrows"] == []
    assert "dlm-overlay-off" in hidden
    doc = Tags(hidden)
    assert not doc.find("section", "dlm-frame") and not doc.find("header", "dlm-head") and not doc.find("p", "dlm-note")
    assert text("map.col4_note", "vi") not in hidden
    assert [b["data-cell"] for b in doc.find("button", "dlm-cell")] == IDS  # the cells stay


@pytest.mark.parametrize("band", ["1", "2", "3", "4", "5"])
def test_band_filter_highlights_one_band_and_dims_the_rest(band):
    doc = Tags(build(band=band))
    for b in doc.find("button", "dlm-cell"):
        classes = b["class"].split()
        if b["data-band"] == band:
            assert "hl" in classes and "dim" not in classes, b
        else:
            assert "dim" in classes and "hl" not in classes, b
    frames = doc.find("section", "dlm-frame")
    assert {f["data-band"] for f in frames if "hl" in f["class"].split()} == {band}
    assert spec_of(build(band=band))["band"] == band


def test_all_dims_nothing_and_an_unknown_band_means_all():
    for band in ("all", "9"):
        doc = Tags(build(band=band))
        classes = [b["class"].split() for b in doc.find("button", "dlm-cell")]
        assert not any("dim" in c or "hl" in c for c in classes)


def test_all_22_cells_open_a_live_view():
    cells = [c["id"] for c in load_cells()]
    assert len(cells) == 22 and [c for c in cells if not live_views(c)] == []


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_live_links_go_to_the_app_pages_and_keep_the_language(lang):
    html = build(lang)
    for c in load_cells():
        dialog = html.split(f'id="dlm-pop-{c["id"]}"')[1].split("</dialog>")[0]
        links = [a for a in Tags(dialog).find("a", "dlm-live")]
        views = live_views(c["id"])
        assert [a["href"] for a in links] == [
            f"{p.url}?lang={lang}" + (f"&tab={tab_of(a)}" if tab_of(a) else "") + (f"#{a}" if a else "")
            for p, a in views]
        # a link into one of the Fine-tune page's tabs names it, so that the map's script opens it
        assert [a["data-tab"] for a in links] == [
            text(f"finetune.tab_{tab_of(a)}", lang) if tab_of(a) else "" for _, a in views]
        assert all(a["target"] == "_self" for a in links)
        for p, _ in views:
            assert (ROOT / p.path).is_file()
            assert f"{text('map.open_live', lang)}: {text(p.title_key, lang)}" in dialog
    five_b = html.split('id="dlm-pop-5B"')[1].split("</dialog>")[0]
    assert f'href="decode?lang={lang}"' in five_b


# -----------------------------------------------------------------------------
# the page under AppTest


def map_band_html(at: AppTest) -> str:
    bodies = [h.proto.body for h in at.html if "dlm-root" in h.proto.body]
    assert len(bodies) == 1
    return bodies[0]


def test_home_page_runs_in_vietnamese_then_english():
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    assert not at.exception, at.exception
    assert at.header[0].value == text("map.map_title", "vi")
    chips = at.button_group(key="map_band")
    assert chips.value == "all"
    assert chips.options == ["Tất cả (22)", *(f"{b} {text('band.' + b, 'vi')}" for b in "12345")]
    assert at.toggle(key="map_hide_overlay").label == "Ẩn khung overlay"
    assert len(re.findall(r'class="dlm-cell ', map_band_html(at))) == 22
    assert text("map.reading_order", "vi") in [m.value for m in at.markdown]

    chips.set_value("3")
    at.radio(key="lang").set_value("en")
    at.run()
    assert not at.exception, at.exception
    assert at.header[0].value == text("map.map_title", "en")
    assert at.session_state["map_band"] == "3"  # the chosen band survives the language switch
    html = map_band_html(at)
    assert 'lang="en"' in html and 'class="dlm-cell dlm-b3 hl"' in html and 'class="dlm-cell dlm-b1 dim"' in html
    assert at.button_group(key="map_band").options[0] == "All (22)"


def test_home_page_in_english_from_the_url_and_the_overlay_toggle():
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params["lang"] = "en"
    at.run()
    assert not at.exception, at.exception
    assert at.header[0].value == text("map.map_title", "en")
    assert at.toggle(key="map_hide_overlay").label == text("map.hide_overlay", "en")
    assert "dlm-overlay-on" in map_band_html(at)
    at.toggle(key="map_hide_overlay").set_value(True)
    at.run()
    assert not at.exception, at.exception
    html = map_band_html(at)
    assert "dlm-overlay-off" in html and spec_of(html)["arrows"] == []


def test_the_map_page_does_not_import_torch():
    code = textwrap.dedent(
        """
        import sys
        from streamlit.testing.v1 import AppTest
        at = AppTest.from_file("app.py", default_timeout=60)
        at.run()
        assert not at.exception, at.exception
        assert any("dlm-root" in h.proto.body for h in at.html), "the map did not render"
        heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "transformers")))
        engine = sorted(m for m in ("model.engine.runtime", "model.engine.llama", "model.engine.steps")
                        if m in sys.modules)
        print("HEAVY", heavy, engine)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "HEAVY [] []" in run.stdout, run.stdout[-2000:]


# -----------------------------------------------------------------------------
# the real app in Chromium

SIZES = [(1440, 900), (1280, 720)]
PART_LABELS_VI = ["Nhận gì", "Làm gì, vì sao", "Ra gì", "Ví dụ, cách đọc ô", "Lưu ý"]


def open_map(page, base: str, lang: str, size: tuple[int, int]):
    page.set_viewport_size({"width": size[0], "height": size[1]})
    page.goto(f"{base}/?lang={lang}")
    page.locator(".dlm-cell[data-cell='5C']").wait_for()
    page.locator(".dlm-svg").wait_for(state="attached")  # the script ran and drew the arrows
    settled(page)


def full_map_screenshot(page, path: Path, size: tuple[int, int]):
    """Streamlit scrolls inside its own container: a tall viewport of the same width shows the whole map."""
    page.set_viewport_size({"width": size[0], "height": 1800})
    settled(page)
    page.screenshot(path=str(path))
    page.set_viewport_size({"width": size[0], "height": size[1]})
    settled(page)


@pytest.mark.browser
@pytest.mark.parametrize("lang", ["vi", "en"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_map_in_the_browser(app_server, browser_page, artifacts, lang, size):
    page = browser_page
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    open_map(page, app_server, lang, size)
    name = f"map-{size[0]}x{size[1]}-{lang}"
    page.screenshot(path=str(artifacts / f"{name}.png"))

    cells = page.locator(".dlm-cell")
    assert cells.count() == 22
    for cid in IDS:
        assert page.locator(f".dlm-cell[data-cell='{cid}']").is_visible(), cid
    arrow_labels = page.locator(".dlm-arrow-label").all_text_contents()
    assert arrow_labels == [text("map.arrow_next_batch", lang), text("map.arrow_load_weights", lang)]
    # the whole map on the first screen, band 5 (the first lesson's) included
    bottom = page.evaluate("Math.max(...[...document.querySelectorAll('.dlm-cell')]"
                           ".map(e => e.getBoundingClientRect().bottom))")
    assert bottom <= size[1], f"the lowest cell ends at y = {bottom:.0f}"

    # projector checks: no horizontal scrolling, the map fits the main area, cell text ≥ 14 px
    fits = page.evaluate(
        """() => {
          const map = document.querySelector('.dlm').getBoundingClientRect();
          const main = document.querySelector('[data-testid="stMain"]') || document.body;
          const sizes = [...document.querySelectorAll('.dlm-cell .dlm-title, .dlm-cell .dlm-id')]
            .map(e => parseFloat(getComputedStyle(e).fontSize));
          return {scroll: document.documentElement.scrollWidth <= window.innerWidth,
                  mainScroll: main.scrollWidth <= main.clientWidth + 1,
                  right: map.right <= window.innerWidth, minFont: Math.min(...sizes)};
        }"""
    )
    assert fits["scroll"] and fits["mainScroll"] and fits["right"], fits
    assert fits["minFont"] >= 14, fits
    # no two cells overlap, and no arrow label sits on a cell
    boxes = page.evaluate(
        "() => [...document.querySelectorAll('.dlm-cell, .dlm-arrow-label')].map(e => {"
        " const r = e.getBoundingClientRect();"
        " return [e.dataset.cell || e.textContent, r.left, r.top, r.right, r.bottom]; })"
    )
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            overlap = min(a[3], b[3]) - max(a[1], b[1]) > 1 and min(a[4], b[4]) - max(a[2], b[2]) > 1
            assert not overlap, (a, b)

    # hover: the styled tooltip with the tagline
    cell_1b = load_cells()[1]
    page.locator(".dlm-cell[data-cell='1A']").hover()  # a top-row tooltip is not cut off
    tip_1a = page.locator("#dlm-tip-1A")
    tip_1a.wait_for(state="visible")
    assert tip_1a.bounding_box()["y"] >= 0
    page.locator(".dlm-cell[data-cell='1B']").hover()
    tip = page.locator("#dlm-tip-1B")
    tip.wait_for(state="visible")
    assert cell_1b[lang]["tagline"] in tip.text_content()
    assert page.evaluate("getComputedStyle(document.querySelector('#dlm-tip-1B')).position") == "absolute"
    page.screenshot(path=str(artifacts / f"{name}-hover.png"))

    # click 5B: the pop-over with all its parts and the live links
    page.locator(".dlm-cell[data-cell='5B']").click()
    pop = page.locator("#dlm-pop-5B")
    pop.wait_for(state="visible")
    content = pop.text_content()
    cell_5b = load_cells()[20]
    assert cell_5b["id"] == "5B"
    wanted = [text(f"map.{p}", lang) for p in PARTS]
    if lang == "vi":
        assert wanted == PART_LABELS_VI
    for piece in [*wanted, "5B", cell_5b[lang]["title"], cell_5b[lang]["tagline"], text("band.5", lang)]:
        assert piece in content, piece
    decode = pop.locator("a.dlm-live[data-page='decode']")
    assert decode.get_attribute("href") == f"decode?lang={lang}"
    assert page.evaluate("document.querySelector('#dlm-pop-5B a[data-page=decode]').href") == (
        f"{app_server}/decode?lang={lang}"
    )
    box = pop.locator(".dlm-pop-box").bounding_box()
    assert box["y"] >= 0 and box["y"] + box["height"] <= size[1] + 1, box  # not cut off
    assert box["x"] >= 0 and box["x"] + box["width"] <= size[0] + 1, box
    page.screenshot(path=str(artifacts / f"{name}-popover.png"))

    # it closes with Escape, the close button and a click outside
    page.keyboard.press("Escape")
    pop.wait_for(state="hidden")
    page.locator(".dlm-cell[data-cell='5B']").click()
    pop.wait_for(state="visible")
    pop.locator(".dlm-close").click()
    pop.wait_for(state="hidden")
    page.locator(".dlm-cell[data-cell='3A']").click()
    page.locator("#dlm-pop-3A").wait_for(state="visible")
    page.mouse.click(5, size[1] - 5)
    page.locator("#dlm-pop-3A").wait_for(state="hidden")

    full_map_screenshot(page, artifacts / f"{name}-full.png", size)
    assert not errors, errors


@pytest.mark.browser
def test_band_filter_and_hide_overlay_in_the_browser(app_server, browser_page, artifacts):
    page = browser_page
    open_map(page, app_server, "vi", (1280, 720))
    page.get_by_text("3 Học từ sai số", exact=True).click()
    page.locator(".dlm-cell.hl").first.wait_for()
    assert [c.get_attribute("data-cell") for c in page.locator(".dlm-cell.hl").all()] == ["3A", "3B", "3C", "3D", "3E"]
    assert page.locator(".dlm-cell.dim").count() == 17
    assert page.locator(".dlm-svg").count() == 1  # the arrows stay, faint outside the band
    full_map_screenshot(page, artifacts / "map-1280x720-vi-band3.png", (1280, 720))

    page.get_by_text(text("map.hide_overlay", "vi")).click()
    page.locator(".dlm-overlay-off").wait_for(state="attached")
    settled(page)
    assert page.locator(".dlm-svg").count() == 0 and page.locator(".dlm-arrow-label").count() == 0
    assert page.locator(".dlm-frame").count() == 0 and page.locator(".dlm-head").count() == 0
    assert page.locator(".dlm-cell").count() == 22 and page.locator(".dlm-cell.hl").count() == 5
    full_map_screenshot(page, artifacts / "map-1280x720-vi-no-overlay.png", (1280, 720))


@pytest.mark.browser
def test_a_live_link_opens_its_page_in_the_same_tab_and_session(app_server, browser_page):
    page = browser_page
    open_map(page, app_server, "en", (1280, 720))
    page.evaluate("window.__sameDocument = true")  # gone if the browser loaded a new document
    page.locator(".dlm-cell[data-cell='5C']").click()
    page.locator("#dlm-pop-5C a[data-page='decode']").click()
    page.wait_for_url(re.compile(r"/decode\?(.*&)?lang=en"))
    assert len(page.context.pages) == 1
    assert page.evaluate("window.__sameDocument") is True  # Streamlit switched page: the session stays
    page.locator(".dlm-root").wait_for(state="detached")


@pytest.mark.browser
def test_switching_the_language_keeps_the_chosen_band(app_server, browser_page):
    page = browser_page
    open_map(page, app_server, "vi", (1440, 900))
    page.get_by_text("3 Học từ sai số", exact=True).click()
    page.locator(".dlm-cell.hl").first.wait_for()
    page.get_by_text("English", exact=True).click()
    page.get_by_text(text("map.map_title", "en")).wait_for()
    page.locator(".dlm-root[lang='en'] .dlm-cell.hl").first.wait_for()
    assert [c.get_attribute("data-cell") for c in page.locator(".dlm-cell.hl").all()] == ["3A", "3B", "3C", "3D", "3E"]
    assert page.get_by_text("3 Learning from error", exact=True).is_visible()
    assert page.locator("[data-testid='stException']").count() == 0


@pytest.mark.browser
@pytest.mark.parametrize("lang", ["vi", "en"])
def test_every_popover_fits_a_projector_screen_without_scrolling(app_server, browser_page, lang):
    """At 1280×720 each cell's card, live links included, is read whole: a text that grows past it shows here."""
    page = browser_page
    open_map(page, app_server, lang, (1280, 720))
    too_tall = []
    for cid in IDS:
        page.locator(f".dlm-cell[data-cell='{cid}']").click()
        pop = page.locator(f"#dlm-pop-{cid}")
        pop.wait_for(state="visible")
        scroll, client = pop.locator(".dlm-pop-box").evaluate("e => [e.scrollHeight, e.clientHeight]")
        if scroll > client:
            too_tall.append((cid, scroll, client))
        page.keyboard.press("Escape")
        pop.wait_for(state="hidden")
    assert too_tall == []


def test_the_band_filter_and_the_overlay_toggle_survive_a_visit_to_another_page():
    from apptest import open_app

    at = open_app("app_pages/map.py", lang="en")
    at.toggle(key="map_hide_overlay").set_value(True).run()
    at.button_group(key="map_band").set_value("3 Learning from error").run()  # AppTest sets it by its label
    at.switch_page("app_pages/cache.py")
    at.run()
    at.switch_page("app_pages/map.py")
    at.run()
    assert not at.exception
    assert at.session_state["map_band"] == "3" and at.toggle(key="map_hide_overlay").value is True


@pytest.mark.browser
@pytest.mark.parametrize("lang", ["vi", "en"])
def test_every_one_of_the_22_cells_opens_a_live_view_in_the_browser(app_server, browser_page, lang):
    """Issue 22: each cell's pop-over holds a live link to a page of the app in the same language; 4D's opens the
    Fine-tune page."""
    page = browser_page
    open_map(page, app_server, lang, (1440, 900))
    pages = {p.url for p in PAGES}
    for cid in IDS:
        page.locator(f".dlm-cell[data-cell='{cid}']").click()
        pop = page.locator(f"#dlm-pop-{cid}")
        pop.wait_for(state="visible")
        links = pop.locator("a.dlm-live")
        assert links.count() >= 1, cid
        for target, href in links.evaluate_all("ls => ls.map(l => [l.dataset.page, l.getAttribute('href')])"):
            assert target in pages and href.startswith(f"{target}?lang={lang}"), (cid, target, href)
        page.keyboard.press("Escape")
        pop.wait_for(state="hidden")
    page.locator(".dlm-cell[data-cell='4D']").click()
    page.locator("#dlm-pop-4D a.dlm-live").first.click()
    page.get_by_role("heading", name=text("finetune.title", lang)).wait_for(timeout=90_000)
    # 4F's link opens its own tab (RLHF), not the one this session had open (SFT), and scrolls to its heading
    page.locator('[data-testid="stSidebarNav"] a').first.click()  # the map, the navigation's first page
    page.locator(".dlm-cell[data-cell='4F']").click()
    page.locator("#dlm-pop-4F a.dlm-live").first.click()
    page.locator("#cell-4f").wait_for(timeout=90_000)
    selected = page.locator('[role="tab"][aria-selected="true"]')
    assert selected.inner_text().strip() == text("finetune.tab_rlhf", lang)
