"""The "KV cache in fewer bytes" page (app_pages/kv.py) and its lessons' numbers (model/serving/kv_lessons.py)."""

import json
import math

import numpy as np
import pytest
from apptest import open_app

from model.serving.kv_lessons import Along, SinkMap, along, cache_bytes, cache_quality, sink_map


def test_bytes_a_position_per_option_on_small(small):
    """small: 4 layers, 2 KV heads of 4 query heads, d_head 32, float32. float32 2 × 4 × 2 × 32 × 4 = 2,048;
    int8 4 × 2 × (64 + 4 × 32 / 32 + 4) = 576; fp8 4 × 2 × 64 = 512; multi-head 2 × 4 × 4 × 32 × 4 = 4,096;
    MLA at DeepSeek-V2's ratios 4 × (128 + 16) × 4 = 2,304."""
    got = {o.option: (o.bytes_per_position, o.formula_only) for o in cache_bytes(small)}
    assert got == {"float": (2048, False), "int8": (576, False), "fp8": (512, False), "multi_head": (4096, False),
                   "mla": (2304, True)}


def test_the_quality_rows_are_the_three_cache_dtypes_against_the_model_s_own(small):
    measured = cache_quality(small)
    quality = measured.quality
    assert [r.dtype for r in quality.rows] == ["float32", "int8", "fp8"]
    assert quality.rows[0].mean_kl == 0.0 and quality.rows[0].greedy_agree == quality.rows[0].greedy_total
    assert quality.text == "assets/quality/vi.txt"
    # a decode step timed per cache dtype after the same positions: small's 128 less the warm-up and 20 steps
    assert measured.steps.context == 107 and all(measured.step_ms(r.dtype) > 0 for r in quality.rows)


def test_the_curve_is_the_running_perplexity_of_the_last_tokens():
    run = Along("t", 1, 2, {"full": np.log(np.array([2.0, 8.0, 4.0, 1.0]))}, {})
    assert np.allclose(run.perplexity("full", smooth=2), [2.0, 4.0, math.sqrt(32.0), 2.0])
    assert math.isclose(run.past_bound("full"), 1.0)  # past the bound of 1 + 2: the fourth token alone


def test_the_four_runs_cover_the_text_up_to_the_context(small):
    run = along(small, 4, 28)
    assert set(run.nll) == {"full", "sinks", "window", "heavy_hitters"}
    assert all(len(nll) == small.info.context_length - 1 for nll in run.nll.values())
    # before the bound is reached, every policy holds the whole text: the same NLL as the full cache
    assert np.allclose(run.nll["sinks"][:32], run.nll["full"][:32], atol=1e-4)
    # at the end each bounded cache holds its budget: the sinks and the 28 latest, the 32 latest, H2O's 4 + 28
    end = small.info.context_length - 1
    assert run.kept["sinks"][0] == [0, 1, 2, 3, *range(end - 28, end)]
    assert run.kept["window"][0] == list(range(end - 32, end))
    assert all(len(held) == 32 and held[-28:] == list(range(end - 28, end)) for held in run.kept["heavy_hitters"])


def test_an_even_spread_s_share_of_position_0():
    """Queries 4, 5 and 6 (7 tokens, the first 4 left out) see 5, 6 and 7 keys."""
    assert math.isclose(SinkMap("t", 7, 4, np.zeros((1, 1))).even, (1 / 5 + 1 / 6 + 1 / 7) / 3)


def test_the_sink_map_is_a_share_per_layer_and_head(small):
    sink = sink_map(small)
    assert sink.mass.shape == (small.info.n_layers, small.info.n_heads) and sink.tokens == small.info.context_length
    assert bool(((sink.mass >= 0) & (sink.mass <= 1)).all())


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_the_page_draws_its_three_pictures_on_small(lang):
    at = open_app("app_pages/kv.py", lang=lang, model_name="small", device="cpu", prompt_mode="text")
    assert not at.error
    charts = [c.proto.id for c in at.get("plotly_chart")]
    assert len(charts) == 4, charts  # bytes, the curves, the positions each bounded cache kept, the sinks
    kept = json.loads(at.get("plotly_chart")[2].proto.spec)["data"][0]["z"]
    assert [sum(row) for row in kept] == [4 + 28] * (2 + 4)  # every cache at its budget: 2 policies, H2O's 4 layers
    html = " ".join(h.proto.body for h in at.get("html"))
    assert "int8" in html and "fp8" in html and "H2O" in html


def test_a_model_with_sliding_layers_gets_the_sentence_instead_of_the_curves(small, monkeypatch):
    """Gemma 3's case, on small with two layers said to slide: no bounded-cache run, its sentence instead, and the
    bytes and the sink map still drawn."""
    import copy
    import dataclasses

    import ui.models
    from model.texts import text

    sliding = copy.copy(small)
    sliding.info = dataclasses.replace(small.info, layer_windows=(None, 4, None, 4))
    monkeypatch.setattr(ui.models, "shared_model", lambda *args, **kwargs: sliding)
    at = open_app("app_pages/kv.py", lang="en", model_name="small", device="cpu", prompt_mode="text")
    assert [c.proto.id for c in at.get("plotly_chart")] and len(at.get("plotly_chart")) == 2
    assert text("kv.sliding", "en").format(model="small") in [i.value for i in at.info]


def test_the_bounds_settings_survive_a_visit_to_another_page():
    """Streamlit forgets a widget's value after a run of another page: sinks 2 and window 20 came back as 4 and 28
    before the page kept its keys (ui/state.keep_across_pages)."""
    at = open_app("app_pages/kv.py", lang="en", model_name="small", device="cpu", prompt_mode="text")
    at.number_input(key="kv_sinks").set_value(2).run()
    at.number_input(key="kv_window").set_value(20).run()
    at.switch_page("app_pages/cache.py").run()
    at.switch_page("app_pages/kv.py").run()
    assert (at.number_input(key="kv_sinks").value, at.number_input(key="kv_window").value) == (2, 20)
    assert not at.exception


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_a_window_smaller_than_the_sinks_is_a_sentence_on_the_page(lang):
    """S = 8, W = 4: the page says why, in the page's words (not the command line's --kv-window)."""
    at = open_app("app_pages/kv.py", lang=lang, model_name="small", device="cpu", prompt_mode="text")
    at.number_input(key="kv_sinks").set_value(8).run()
    at.number_input(key="kv_window").set_value(4).run()
    from model.texts import text

    said = text("decode.bounded_range", lang).format(s=8, w=4, context=128)
    assert said in [i.value for i in at.info] and not at.exception


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_small_s_unknown_words_are_said_under_both_lessons(lang, small):
    """classroom audit 2026-12-06: on small, half the held-out text's tokens are <unk>, so its perplexity read
    277,648 and sinks + window lost to the window alone, with no word of why; each lesson now says how many."""
    from model.serving.kv_lessons import MAX_ALONG
    from model.serving.quality import held_out
    from model.texts import number_in, text

    at = open_app("app_pages/kv.py", lang=lang, model_name="small", device="cpu", prompt_mode="text")
    ids, unk = small.tokenizer.encode(held_out(small.info.language).text).ids, small.tokenizer.unk_id
    fed = min(MAX_ALONG, small.info.context_length)
    captions = [c.value for c in at.caption]
    assert text("serving.quality_unk", lang).format(unk=number_in(ids[1:].count(unk), lang),
                                                    tokens=number_in(len(ids) - 1, lang)) in captions
    assert text("kv.along_unk", lang).format(unk=number_in(ids[1:fed].count(unk), lang),
                                             tokens=number_in(fed - 1, lang), model="small") in captions
    assert ids[1:fed].count(unk) > (fed - 1) // 3
