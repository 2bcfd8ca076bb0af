"""The Flash Attention page under AppTest (micro and small, vi and en) and in a real browser."""

import dataclasses
import re
from html import unescape
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from model.engine.flash import block_size_choices, default_block_size, human_bytes
from model.texts import text

TIMEOUT = 60
APP = str(Path(__file__).resolve().parent.parent / "app.py")
PAGE = "app_pages/flash.py"
LONGER_IDS = "1, 2, 3, 4, 5, 3, 4, 5, 2, 3"  # micro, N = 10


def open_flash(model: str = "micro", lang: str = "vi", ids: str | None = None) -> AppTest:
    """The flash page after a prefill, with the sidebar's choices set as session state."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.session_state["lang"] = lang
    at.session_state["model_name"] = model
    at.session_state["device"] = "cpu"
    at.session_state["prompt_mode"] = "ids" if model == "micro" else "text"
    if ids is not None:  # micro's context holds 16 positions: leave room for the longer prompt
        at.session_state["prompt_ids_text"], at.session_state["max_new_tokens"] = ids, 4
    at.run()
    at.switch_page(PAGE)
    at.run()
    assert not at.exception, at.exception
    return click(at, "run_prefill")


def click(at: AppTest, key: str) -> AppTest:
    at.button(key=key).click().run()
    assert not at.exception, at.exception
    return at


def walk_html(at: AppTest) -> str:
    """The tile walk's piece of HTML (its sentences, statistics and charts), with <b> written back as **."""
    (html,) = [h.proto.body for h in at.get("html") if 'class="dl-grid' in h.proto.body]
    return unescape(html.replace("<b>", "**").replace("</b>", "**"))


def tile_info(at: AppTest) -> str:
    """The sentence naming the tile being read: 'Đang đọc tile **2/3** · khối query 1 … × khối key 0 …'."""
    return re.search(r"(?:Đang đọc tile|Tile read) \*\*\d+/\d+\*\*[^<]*", walk_html(at)).group(0)


def max_abs_diff(at: AppTest) -> float:
    return float(next(m.value for m in at.metric if m.label == "max |Δ|").replace(",", "."))


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_before_any_prefill_the_page_walks_its_example_sentence(lang):
    """The page never opens empty: without a run it walks its own example (12 tokens on small, 4 × 4 tiles), says
    so, and points at the prefill that walks a prompt of one's own; no run is made for the other pages."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.session_state["lang"], at.session_state["model_name"], at.session_state["device"] = lang, "small", "cpu"
    at.run()
    at.switch_page(PAGE)
    at.run()
    assert not at.exception and not at.error
    assert at.session_state["generation"] is None
    assert at.session_state["flash_block"] == 4 and at.button(key="flash_next")
    assert tile_info(at).startswith("Đang đọc tile **1/6**" if lang == "vi" else "Tile read **1/6**")
    example = text("flash.using_example", lang).split("{")[0]
    assert any(m.value.startswith(example) and "N = 12" in m.value for m in at.markdown)
    assert max_abs_diff(at) <= 1e-5


def test_a_three_token_prompt_walks_tiles_of_two():
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.session_state["model_name"], at.session_state["device"], at.session_state["lang"] = "small", "cpu", "vi"
    at.run()
    at.switch_page(PAGE)
    at.run()
    click(at, "run_prefill")  # small's own example prompt, "con mèo": <bos> and two words
    assert len(at.session_state["generation"].prompt_ids) == 3 and at.session_state["flash_block"] == 2
    assert tile_info(at).startswith("Đang đọc tile **1/3**")


@pytest.mark.parametrize("model", ["micro", "small"])
@pytest.mark.parametrize("lang", ["vi", "en"])
def test_the_page_runs_and_the_tiles_match_the_naive_attention(model, lang):
    at = open_flash(model, lang)
    assert not at.error
    assert at.session_state["flash_step"] == 0
    assert max_abs_diff(at) <= 1e-5
    assert any(("ĐẠT" if lang == "vi" else "PASS") in s.value for s in at.success)
    n = len(at.session_state["generation"].prompt_ids)
    assert at.selectbox(key="flash_block").value == at.session_state["flash_block"] == default_block_size(n)
    assert tile_info(at).startswith("Đang đọc tile **1/" if lang == "vi" else "Tile read **1/")


def test_three_clicks_on_next_walk_three_tiles():
    at = open_flash(ids=LONGER_IDS)  # N = 10, block 2: 5 × 5 tiles, 15 on or below the diagonal
    assert at.session_state["flash_block"] == 2
    assert at.button(key="flash_back").disabled and at.button(key="flash_first").disabled
    seen = [tile_info(at)]
    for expected in (1, 2, 3):
        click(at, "flash_next")
        assert at.session_state["flash_step"] == expected
        seen.append(tile_info(at))
    assert len(set(seen)) == 4
    # query block 0 reads key block 0 only; block 1 reads key blocks 0 and 1; then block 2 starts
    expected = [(0, 0), (1, 0), (1, 1), (2, 0)]
    for (qb, kb), info in zip(expected, seen, strict=True):
        assert f"khối query {qb} " in info and f"khối key {kb} " in info
    assert seen[0].startswith("Đang đọc tile **1/15**") and seen[3].startswith("Đang đọc tile **4/15**")
    click(at, "flash_back")
    assert at.session_state["flash_step"] == 2
    click(at, "flash_last")
    assert at.session_state["flash_step"] == 14 and at.button(key="flash_next").disabled
    click(at, "flash_first")
    assert at.session_state["flash_step"] == 0


def test_the_course_example_reads_three_tiles_and_skips_one():
    at = open_flash(lang="en")  # micro, prompt ids 1, 3: N = 2, block 1
    assert at.session_state["flash_block"] == 1
    seen = [tile_info(at)]
    for _ in range(2):
        seen.append(tile_info(click(at, "flash_next")))
    assert ["query block 1 " in s for s in seen] == [False, True, True]
    assert ["key block 1 " in s for s in seen] == [False, False, True]  # (0, 1) lies above the diagonal
    assert at.button(key="flash_next").disabled
    # the last tile of query block 1: its output is written
    assert '<div class="dl-box pass">This is the last tile of query block 1: the output O = acc / ℓ of rows 1 ' \
        in walk_html(at)
    assert any("4 tiles, 1 of them skipped" in s.value for s in at.success)


def test_changing_the_block_size_restarts_the_walk():
    at = open_flash(ids=LONGER_IDS)
    assert at.session_state["flash_block"] == 2  # default_block_size(10)
    click(click(at, "flash_next"), "flash_next")
    assert at.session_state["flash_step"] == 2
    at.selectbox(key="flash_block").set_value(4).run()
    assert not at.exception
    assert at.session_state["flash_step"] == 0
    assert tile_info(at).startswith("Đang đọc tile **1/6**")  # 1 + 2 + 3 tiles of ⌈10/4⌉² = 9 are read


def test_n_not_a_multiple_of_the_block_size():
    at = open_flash(ids=LONGER_IDS, lang="en")
    at.selectbox(key="flash_block").set_value(4).run()
    assert any("not a multiple" in i.value and "only 2 × 2" in i.value for i in at.info)
    click(at, "flash_last")
    assert at.session_state["flash_step"] == 5
    assert "rows 8–9" in tile_info(at) and "columns 8–9" in tile_info(at)
    assert max_abs_diff(at) <= 1e-5 and at.success and not at.error


def score_sizes(at: AppTest):
    return next(df.value for df in at.dataframe if "Score matrix N²·b" in df.value.columns)


def test_memory_and_traffic_for_a_typed_n():
    at = open_flash(lang="en")
    assert at.number_input(key="flash_custom_n").value == 32768
    sizes = score_sizes(at)  # rows float16, float32
    assert sizes.iloc[0, 1] == "2 GiB (2\u202f147\u202f483\u202f648 B)"
    assert sizes.iloc[1, 1] == "4 GiB (4\u202f294\u202f967\u202f296 B)"
    traffic = next(df.value for df in at.dataframe if "Read R" in df.value.columns)
    assert list(traffic["Method"]) == ["Ordinary", "Flash (tiles)"] * 2
    at.number_input(key="flash_custom_n").set_value(1000).run()
    assert not at.exception
    assert score_sizes(at).iloc[1, 1] == "3,81 MiB (4\u202f000\u202f000 B)".replace(",", ".")
    at.session_state["lang"] = "vi"
    at.run()
    assert next(df.value for df in at.dataframe if "Ma trận điểm N²·b" in df.value.columns).iloc[1, 1].startswith(
        "3,81 MiB")


def test_the_helpers_behind_the_page():
    assert block_size_choices(2) == [1, 2]
    assert block_size_choices(10) == [1, 2, 4, 8, 16]  # 16 holds all 10 tokens in one tile
    assert block_size_choices(1000) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert all(default_block_size(n) in block_size_choices(n) for n in range(1, 300))
    assert human_bytes(2 * 1024**3) == "2 GiB" and human_bytes(4 * 1024**3) == "4 GiB"
    assert human_bytes(98816) == "96.5 KiB" and human_bytes(98816, ",") == "96,5 KiB"
    assert human_bytes(400) == "400 B"


def test_the_check_sentence_follows_the_verdict():
    """A FAIL must not sit beside a sentence saying the tiles give the same result."""
    at = open_flash(lang="en")
    assert [s.value for s in at.success if s.value.startswith("PASS")] and not at.error
    walk = at.session_state["flash_walk"]
    at.session_state["flash_walk"] = dataclasses.replace(walk, max_abs_diff=0.5)  # what a broken walk would show
    at.run()
    assert not at.exception, at.exception
    assert max_abs_diff(at) == 0.5
    assert not [s.value for s in at.success if "same result" in s.value or s.value.startswith("PASS")]
    (sentence,) = [e.value for e in at.error]
    assert sentence.startswith("FAIL: the tiled walk (B = 1: 4 tiles, 1 of them skipped) does not give the result")
    assert "5.00e-01 is above the tolerance 1e-05" in sentence


def test_the_pages_live_in_app_pages_not_pages():
    """A top-level pages/ folder is Streamlit's old multipage convention: on a fresh server a deep link such as
    /flash would run pages/flash.py on its own, without app.py (no navigation, no sidebar, no session defaults).
    The app's pages live in app_pages/ and st.navigation in app.py is the only way in."""
    root = Path(APP).parent
    assert not (root / "pages").exists()
    assert (root / PAGE).is_file()


@pytest.fixture
def fresh_app_server():
    """A server of its own, so that the test's deep link is the very first request it ever serves."""
    from conftest import SERVER_START_TIMEOUT_S, _free_port, app_on, served

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with served(app_on(port), base + "/_stcore/health", SERVER_START_TIMEOUT_S, "the app server"):
        yield base


@pytest.mark.browser
def test_a_deep_link_on_a_fresh_server_runs_the_page_inside_the_app(fresh_app_server, browser_page, artifacts):
    """The first request the server sees is /flash: app.py must run it (navigation, sidebar, language) and it opens
    on its example sentence's walk; three clicks on Next move the tile three times."""
    from playwright.sync_api import expect

    page = browser_page
    page.set_viewport_size({"width": 1280, "height": 720})
    page.goto(f"{fresh_app_server}/flash?lang=vi")
    expect(page.get_by_test_id("stSidebarNav")).to_contain_text("Bản đồ 22 ô", timeout=60_000)
    expect(page.get_by_role("heading", name="Flash Attention, chạy thật")).to_be_visible(timeout=60_000)
    tile = page.get_by_text(re.compile(r"^Đang đọc tile \d+/\d+"))
    expect(tile).to_contain_text("Đang đọc tile 1/", timeout=60_000)
    total = int(re.search(r"/(\d+)", tile.inner_text()).group(1))
    assert total >= 4
    for shown in (2, 3, 4):
        page.get_by_role("button", name="Tile tiếp").click()
        expect(tile).to_contain_text(f"Đang đọc tile {shown}/{total}")
    expect(page.get_by_text(re.compile(r"^ĐẠT: tính theo tile"))).to_be_visible()
    assert page.get_by_test_id("stException").count() == 0
    # classroom audit 2026-12-06: at half the 1280 screen the grid drew 0.71× its size (its scores at 9 px), and
    # the m and ℓ table beside it must stay whole
    grid = page.locator("img.dl-chart").first
    assert grid.bounding_box()["width"] >= 0.8 * int(grid.get_attribute("width"))
    assert page.evaluate("() => [...document.querySelectorAll('.dl-scroll')]"
                         ".every(e => e.scrollWidth <= e.clientWidth)")
    page.get_by_role("button", name="Tile tiếp").scroll_into_view_if_needed()
    page.screenshot(path=str(artifacts / "flash-browser-vi.png"))


def test_the_vietnamese_walk_writes_its_scores_with_a_decimal_comma():
    """The numbers drawn in the grid and the running output follow the page's language (-0,12 in vi)."""
    import base64

    at = open_flash("small", "vi")
    pictures = "".join(base64.b64decode(src).decode() for src in re.findall(r'base64,([^"]+)"', walk_html(at)))
    scores = re.findall(r'font-size="13"[^>]*>(-?\d+[.,]\d+)</text>', pictures)
    assert scores and all("," in s and "." not in s for s in scores)
