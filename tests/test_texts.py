"""The app's texts: the two languages say the same thing (same cells, parts, numbers, placeholders), the words
the audit found misleading stay gone, and text that reaches HTML is escaped."""

from __future__ import annotations

import re
import string
from collections import Counter
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from model.texts import LANGUAGES, strings
from model.training.train import load_corpus
from ui.map_view import PARTS, load_cells
from ui.widgets import token_strip_html

APP = str(Path(__file__).resolve().parent.parent / "app.py")

CELL_PARTS = ("title", "tagline", *PARTS)
SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789−")
# one number as each language writes it: vi 10.000 / 0,5 and en 10,000 / 0.5; a leading − (U+2212) is a sign;
# digits glued to a word are part of a name (float32, Qwen2.5), not a number
NUMBER = {
    "vi": re.compile(r"(?<![\w.,])(−?)(\d{1,3}(?:\.\d{3})+(?:,\d+)?|\d+(?:,\d+)?)"),
    "en": re.compile(r"(?<![\w.,])(−?)(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"),
}


def numbers(sentence: str, lang: str) -> Counter:
    """The numbers of a sentence as a multiset of values: '10.000 câu, 0,5' (vi) == '10,000 sentences, 0.5' (en).
    Superscripts count as numbers of their own: 10⁻⁴ -> 10, −4."""
    sentence = re.sub(r"[⁰¹²³⁴⁵⁶⁷⁸⁹⁻]+", lambda m: " " + m.group().translate(SUPERSCRIPTS), sentence)
    thousands, decimal = (".", ",") if lang == "vi" else (",", ".")
    found = Counter()
    for sign, digits in NUMBER[lang].findall(sentence):
        value = digits.replace(thousands, "").replace(decimal, ".")
        found[sign + value.rstrip("0").rstrip(".") if "." in value else sign + value] += 1
    return found


def test_numbers_are_read_in_each_language_s_format():
    assert numbers("thu về 10.000 câu, loại 1.200; xác suất 0,5 và [0,85; 1,13]", "vi") == Counter(
        ["10000", "1200", "0.5", "0.85", "1.13"])
    assert numbers("10,000 sentences, 1,200 dropped; probability 0.5 and [0.85, 1.13]", "en") == Counter(
        ["10000", "1200", "0.5", "0.85", "1.13"])
    assert numbers("[1, 3, 4, 6] và −100, 3·10⁻⁴", "vi") == Counter(["1", "3", "4", "6", "−100", "3", "10", "−4"])
    assert numbers("7,5·10⁻⁵ ≈ 0,50", "vi") == numbers("7.5·10⁻⁵ ≈ 0.5", "en")
    assert numbers("1.200", "vi") != numbers("1.200", "en")  # the same characters, two different numbers
    assert numbers("float32, Qwen2.5", "vi") == numbers("float32, Qwen2.5", "en") == Counter()


def test_the_cells_of_both_languages_are_in_step():
    """Same 22 ids, same parts, and in every part the same numbers: a fact changed in one language only shows."""
    cells = load_cells()
    assert len({c["id"] for c in cells}) == len(cells) == 22
    apart = []
    for cell in cells:
        assert set(cell) == {"id", "band", *LANGUAGES}, cell["id"]
        for lang in LANGUAGES:
            assert set(cell[lang]) == set(CELL_PARTS), (cell["id"], lang)
        for part in CELL_PARTS:
            vi, en = numbers(cell["vi"][part], "vi"), numbers(cell["en"][part], "en")
            if vi != en:
                apart.append((cell["id"], part, "only vi:", dict(vi - en), "only en:", dict(en - vi)))
    assert apart == []


def placeholders(sentence: str) -> set[str] | None:
    """The {names} t() fills in; None for a text that is no format string (LaTeX, shown as it is)."""
    try:
        return {name for _, name, _, _ in string.Formatter().parse(sentence) if name}
    except ValueError:
        return None


def test_every_string_has_both_languages_with_the_same_placeholders_and_numbers():
    apart = []
    for key, entry in strings().items():
        assert set(entry) == set(LANGUAGES), key
        assert all(entry[lang].strip() for lang in LANGUAGES), key
        assert placeholders(entry["vi"]) == placeholders(entry["en"]), key
        vi, en = numbers(entry["vi"], "vi"), numbers(entry["en"], "en")
        if vi != en:
            apart.append((key, "only vi:", dict(vi - en), "only en:", dict(en - vi)))
    assert apart == []


# -----------------------------------------------------------------------------
# what the audit found: each fact stays fixed, each word stays consistent


def cell(cell_id: str) -> dict:
    return next(c for c in load_cells() if c["id"] == cell_id)


def test_temperature_acts_before_softmax_in_every_text():
    """2D once said softmax comes first and temperature later; the sampling help says the opposite (and is right)."""
    for lang in LANGUAGES:
        help_text = strings()["sampling.temperature_help"][lang]
        caveat = cell("2D")[lang]["caveat"]
        before = "trước softmax" if lang == "vi" else "before softmax"
        assert before in help_text and before in caveat, lang
    assert "softmax comes first" not in cell("2D")["en"]["caveat"]


def test_the_gradient_points_where_the_loss_rises():
    assert "rises" in cell("3B")["en"]["does"] and "−gradient" in cell("3B")["en"]["does"]
    assert "loss tăng" in cell("3B")["vi"]["does"] and "−gradient" in cell("3B")["vi"]["does"]
    assert "lowers the loss" not in cell("3B")["en"]["does"]


def test_no_bytes_label_claims_a_measurement_the_formula_already_gives():
    """The bytes of the positions held equal the formula by construction; "measured" said otherwise."""
    labels = {"decode.measured", "decode.formula", "decode.reserved"}  # the series of the chart in bytes (B)
    for key, entry in strings().items():
        vi, en = (re.sub(r"\{\w+\}", "", entry[lang]) for lang in LANGUAGES)  # placeholders are code, not text
        if key.startswith("prefill.cache") or key in labels or ("cache" in en and "byte" in en.lower()):
            assert "measured" not in en.lower() and "đo được" not in vi and "đo trên" not in vi, key
    assert "held" in strings()["decode.measured"]["en"] and "reserved" in strings()["decode.reserved"]["en"]


@pytest.mark.parametrize(
    "key, lang, wrong",
    [
        ("error.bad_temperature", "vi", "Nhiệt độ"),  # every other place says Temperature
        ("stop.eos", "en", "sentence"),  # <eos> ends a sequence, not a sentence
        ("stop.eos", "vi", "hết câu"),
        ("cache.ratio", "vi", "gấp"),
    ],
)
def test_one_word_per_idea(key, lang, wrong):
    assert wrong not in strings()[key][lang]


def test_vietnamese_texts_name_the_step_buttons_as_they_read_and_say_lop_and_head():
    """Issue 36, P1–P3: the Vietnamese buttons read “Bước tiếp”, “Lùi lại”, “Đặt lại” (a text names them through
    {next}, {back}, {reset}, filled from those keys); the layer and head selectors read “Lớp” and “Head”; the prompt
    box says prompt."""
    english = {strings()[key]["en"] for key in ("action.next", "action.back", "action.reset")}
    for key, entry in strings().items():
        vi = entry["vi"]
        for name in english:
            assert not re.search(rf"\b{name}\b", vi), (key, name)
        assert "tầng" not in vi and "lời nhắc" not in vi and not re.search(r"\b(mọi|các) đầu\b|, đầu \{", vi), key
    for key in ("predict.help", "predict.before_next", "predict.waiting"):
        assert "{next}" in strings()[key]["vi"], key
    assert "{back}" in strings()["decode.attention_kept"]["vi"]
    assert {"back", "reset"} <= placeholders(strings()["decode.memory_budget_stop"]["vi"])


def test_vietnamese_wording_of_the_cells():
    assert "cơ số (base) 10.000" in cell("2A")["vi"]["example"]
    assert "không bao giờ nhìn trước" not in cell("2B")["vi"]["tagline"]
    assert "detokenize" in cell("5C")["vi"]["title"] and "giải mã token" not in cell("5C")["vi"]["title"]
    assert "Dùng softmax đổi logits thành" in cell("3A")["vi"]["does"]
    # "nạp" is the app's word for loading weights: a token is "đưa vào"
    assert not any("nạp token" in c["vi"][p] for c in load_cells() for p in CELL_PARTS)


def test_cell_1a_says_what_this_app_s_corpus_is():
    """Neither deduplicated nor split: the numbers come from the corpus itself."""
    sentences = load_corpus("small").sentences
    counts = Counter(sentences)
    assert (len(sentences), len(counts), max(counts.values())) == (6000, 889, 40)
    vi, en = cell("1A")["vi"], cell("1A")["en"]
    assert "6,000 sentences of small's corpus hold only 889 distinct ones, one of them repeated 40 times" in en["does"]
    assert "6.000 câu của corpus small chỉ có 889 câu khác nhau, một câu lặp lại 40 lần" in vi["does"]
    assert "This app keeps no validation part" in en["outputs"] and "App này không tách phần kiểm định" in vi["outputs"]


def test_flash_page_calls_a_tile_a_tile():
    """In Vietnamese "ô" is a map cell; on the Flash page a tile is "tile" and a heatmap square "ô vuông"."""
    for key, entry in strings().items():
        if key.startswith("flash."):
            assert not re.search(r"\b[Ôô]\b(?! vuông)", entry["vi"]), (key, entry["vi"])


# -----------------------------------------------------------------------------
# text that reaches HTML is escaped


def test_the_token_strip_escapes_tokens_and_kinds():
    html = token_strip_html(["<bos>", "<script>alert(1)</script>", "a&b"], [1, 7, 9], ["", 'new" onclick="x', ""])
    strip = html[html.index('<div class="tok-strip">'):]
    assert "<script>" not in strip and "&lt;script&gt;alert(1)&lt;/script&gt;<small>#1 · id 7</small>" in strip
    assert "&lt;bos&gt;<small>#0 · id 1</small>" in strip and "a&amp;b<small>#2 · id 9</small>" in strip
    assert 'class="tok new&quot; onclick=&quot;x special"' in strip and 'onclick="x"' not in strip


def test_html_typed_in_the_prompt_reaches_the_strip_escaped():
    """The prefill page's strip, as handed to st.html: the small model turns each unknown piece of the typed HTML
    into <unk>, which must arrive as text (unescaped, the browser would take <unk> for an element and show nothing)."""
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["lang"], at.session_state["model_name"], at.session_state["device"] = "en", "small", "cpu"
    at.session_state["prompt_mode"] = "text"
    at.run()
    at.switch_page("app_pages/prefill.py").run()
    at.text_input(key="prompt_text").set_value("<script>alert(1)</script> <b>the</b> dog").run()
    at.button(key="run_prefill").click().run()
    assert not at.exception, at.exception
    (body,) = [h.proto.body for h in at.html if 'class="tok-strip"' in h.proto.body]
    strip = body[body.index('<div class="tok-strip">'):]
    chips = re.findall(r'<div class="tok [^"]*">(.*?)<small>', strip)
    assert chips == ["&lt;bos&gt;", *["&lt;unk&gt;"] * 12, "the", *["&lt;unk&gt;"] * 3, "dog"]
    assert "<unk>" not in strip and "<script" not in body and "<b>" not in body
    (warning,) = [w.value for w in at.warning]
    assert warning.endswith(r"\<, script, \>, alert, \(, 1, \)\</, script, \>, \<, b, \>, \</, b, \>")
