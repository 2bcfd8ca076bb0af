"""The Decode page's attention row under a bounded cache (issue 53: the positions each policy kept, drawn on the
Decode page's attention row): the positions come from a real re-run of the run's tokens through that cache."""

import pytest
from apptest import click, open_app

from model.engine.loading import load_model
from model.serving.kv_lessons import kept_along
from model.texts import text


@pytest.fixture(scope="module")
def small():
    return load_model("small", "cpu")


def test_the_positions_each_bounded_cache_holds(small):
    """Exact sets: sinks + window holds the first S and the last W; the window alone the last S + W; H2O the last W
    and S heavy hitters older than them. Made red by a window that counts the sinks inside it."""
    ids = list(range(10, 20))
    assert all(kept == [0, 1, 7, 8, 9] for kept in kept_along(small, ids, "sinks", 2, 3))
    assert all(kept == [5, 6, 7, 8, 9] for kept in kept_along(small, ids, "window", 2, 3))
    for kept in kept_along(small, ids, "heavy_hitters", 2, 3):
        assert len(kept) == 5 and kept[-3:] == [7, 8, 9] and all(p < 7 for p in kept[:2])


def row_html(at) -> str:
    return " ".join(h.proto.body for h in at.html)


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_the_decode_row_strikes_out_what_the_bounded_cache_lost(lang):
    """With S = 1, W = 2 (the KV page's settings, kept across pages) and sinks + window chosen, the row of the
    first decode step strikes out every position but the first and the last two, and says so. Made red by a row drawn
    without the struck set."""
    at = open_app("app_pages/decode.py", lang=lang, model_name="small", device="cpu", prompt_mode="text",
                  kv_sinks=1, kv_window=2)
    at.text_input(key="prompt_text").set_value("con mèo đen nằm ngủ").run()
    click(at, "run_prefill")
    at.selectbox(key=f"decode_bounded.{lang}").set_value("sinks").run()
    click(at, "next")
    gen = at.session_state["generation"]
    n = gen.steps[-1].cache_len
    html = row_html(at)
    assert html.count("line-through") == n - 3
    said = text("decode.bounded_row", lang).split("{")[0]
    assert said in html and not at.exception


def test_the_kv_pages_measurements_tell_their_progress_to_the_end(small):
    """The KV page runs each measurement under a Stop button, redrawing a bar from these shares (a click ends the
    run at a redraw): each run's shares rise, and reach 1.0 only at its end. Made red by a count of passes too small
    (the bar full before the end) or a run that never says it is done."""
    from model.serving.kv_lessons import along, cache_quality

    for run in (lambda progress: along(small, 4, 28, progress), lambda progress: cache_quality(small, progress)):
        shares = []
        run(shares.append)
        assert shares and shares[-1] == 1.0 and shares == sorted(shares) and shares[-2] < 1.0
