"""What a class does to one server: strict input, escaped sentences, stable choices across languages, the
per-session memory budget and its formula, one shared copy per model."""


import numpy as np
import pytest
import streamlit as st
import torch
from apptest import open_app
from conftest import wait_idle
from streamlit.testing.v1 import AppTest

from model.engine.generate import (
    LOGITS_KEPT,
    attention_history,
    attention_runs,
    back,
    parse_prompt_ids,
    run_to_end,
    start,
    step,
)
from model.engine.llama import Llama, LlamaConfig
from model.engine.runtime import NativeModel
from model.engine.sampling import SHOWN_CANDIDATES, SamplingSettings
from model.engine.steps import max_abs_logit_diff, recompute
from model.engine.tokenizer import WordTokenizer, build_word_tokenizer
from model.errors import InputError
from model.texts import text
from ui.models import model_key, shared_model

GREEDY = SamplingSettings()


@pytest.fixture(scope="module")
def endless():
    """A random model whose vocabulary has no <eos>: only the token limit ends its runs."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    tok = WordTokenizer(build_word_tokenizer(["<pad>", "<bos>"] + [f"w{i}" for i in range(38)]))
    return NativeModel("endless", Llama(cfg).eval().requires_grad_(False), tok, torch.device("cpu"))


# -----------------------------------------------------------------------------
# input


@pytest.mark.parametrize(("typed", "ids"), [("1, 3", [1, 3]), ("1,3", [1, 3]), (" 1 , 3 ", [1, 3]), ("7", [7])])
def test_prompt_ids_read_plain_comma_separated_integers(micro, typed, ids):
    assert parse_prompt_ids(micro, typed) == ids


@pytest.mark.parametrize("typed", ["1,,3", "1_0", "１,３", "1 3", "", ",1", "1,", "+1", "-1", "8", "1;3"])
def test_prompt_ids_refuse_anything_else(micro, typed):
    with pytest.raises(InputError) as bad:
        parse_prompt_ids(micro, typed)
    assert bad.value.code == "bad_prompt_ids"


def open_page(page: str, model: str = "small", lang: str = "vi") -> AppTest:
    return open_app(page, lang=lang, model_name=model, device="cpu", prompt_mode="ids" if model == "micro" else "text")


def test_an_error_sentence_shows_typed_markdown_as_text():
    at = open_page("app_pages/prefill.py", model="micro")
    at.text_input(key="prompt_ids_text").set_value("![x](http://198.51.100.1/x.png)").run()
    at.button(key="run_prefill").click().run()
    sentence = at.error[0].value
    assert "![x](http" not in sentence
    assert r"\!\[x\]\(http" in sentence


def test_a_prompt_over_the_limit_is_a_sentence_and_the_run_stays():
    at = open_page("app_pages/decode.py")
    at.button(key="run_prefill").click().run()
    gen = at.session_state["generation"]
    at.switch_page("app_pages/prefill.py")
    at.run()
    at.text_input(key="prompt_text").set_value("con " * 501).run()
    at.button(key="run_prefill").click().run()
    assert "2004" in at.error[0].value and "2000" in at.error[0].value
    assert at.session_state["generation"] is gen
    assert at.text_input(key="prompt_text").value == "con " * 501


# -----------------------------------------------------------------------------
# choices keep their ids when the language changes


def test_three_language_switches_keep_the_model_the_device_and_the_run():
    at = open_page("app_pages/decode.py", model="micro")
    at.button(key="run_prefill").click().run()
    gen = at.session_state["generation"]
    for lang in ("en", "vi", "en"):
        at.radio(key="lang").set_value(lang).run()
        assert not at.exception and not at.error
        assert at.selectbox(key=f"model_name.{lang}").value == "micro"
        assert at.selectbox(key=f"device.{lang}").value == "cpu"
        assert at.session_state["model_name"] == "micro" and at.session_state["generation"] is gen


def test_choosing_another_model_keeps_a_typed_prompt_and_replaces_an_example():
    at = open_page("app_pages/prefill.py")
    assert at.text_input(key="prompt_text").value == "con mèo"  # small's example
    at.selectbox(key="model_name.vi").set_value("micro").run()
    assert at.session_state["prompt_text"] == "ăn"  # an example follows the model
    at.session_state["prompt_text"] = "con chó ăn cá"
    at.selectbox(key="model_name.vi").set_value("small").run()
    assert at.session_state["prompt_text"] == "con chó ăn cá"


def test_the_prompt_mode_cannot_be_left_empty():
    at = open_page("app_pages/prefill.py")
    at.button_group(key="prompt_mode.vi").set_value(None).run()
    assert at.session_state["prompt_mode"] == "text"
    assert at.text_input(key="prompt_text").value == "con mèo"
    # from a mode other than the first option: a click that empties the control keeps that mode
    at.button_group(key="prompt_mode.vi").set_value("ids").run()
    at.button_group(key="prompt_mode.vi").set_value(None).run()
    assert at.session_state["prompt_mode"] == "ids"
    assert at.text_input(key="prompt_ids_text").value == "1, 3"


# -----------------------------------------------------------------------------
# memory


def formula_bytes(info, prompt_len: int, new_tokens: int) -> int:
    """docs/deploy.md: 2·L·H·(N(N+1)/2 + Σ cache_len) bytes of float16 attention (the prefill's lower triangle, each
    decode step's row) + 4·V bytes of float32 logits for the prefill and the LOGITS_KEPT latest steps
    + 8·SHOWN_CANDIDATES bytes per draw (int32 id + float32 probability)."""
    cache_lens = [prompt_len + k for k in range(1, new_tokens)]  # each decode step's cache after it
    attention = 2 * info.n_layers * info.n_heads * (prompt_len * (prompt_len + 1) // 2 + sum(cache_lens))
    logits = 4 * info.vocab_size * min(1 + LOGITS_KEPT, new_tokens)
    return attention + logits + 8 * SHOWN_CANDIDATES * new_tokens


@pytest.mark.parametrize("new_tokens", [1, 2, 30])
def test_a_run_keeps_exactly_the_readme_formula(endless, new_tokens):
    gen = start(endless, [1, 5, 6, 7, 8], SamplingSettings(temperature=1.0, seed=2), new_tokens)
    run_to_end(endless, gen)
    assert len(gen.samples) == new_tokens
    assert gen.nbytes == formula_bytes(endless.info, len(gen.prompt_ids), new_tokens)


PROMPT, SAMPLED, STEPS, VIEW = [1, 5, 6, 7, 8], SamplingSettings(temperature=1.0, seed=4), 60, (1, 2)


def row_bytes(k: int) -> int:
    """Decode step k's attention row for one layer and head, float16: its cache holds N + k positions."""
    return 2 * (len(PROMPT) + k)


def budget_run(model, budget: int):
    gen = start(model, PROMPT, SAMPLED, STEPS, budget_bytes=budget)
    gen.view = VIEW
    run_to_end(model, gen)
    return gen


@pytest.fixture(scope="module")
def unbudgeted(endless):
    gen = start(endless, PROMPT, SAMPLED, STEPS)
    run_to_end(endless, gen)
    return gen


def held_at_least(model, gen) -> int:
    """What no budget can drop at the end of the run: the prefill's triangle, the latest LOGITS_KEPT steps' rows,
    three logits, every draw, the KV cache's buffers."""
    info, t = model.info, STEPS
    lh = info.n_layers * info.n_heads
    return (formula_bytes(info, len(PROMPT), 1) - 8 * SHOWN_CANDIDATES + 4 * info.vocab_size * LOGITS_KEPT
            + lh * sum(row_bytes(k) for k in range(t - LOGITS_KEPT, t)) + 8 * SHOWN_CANDIDATES * t
            + gen.cache.nbytes_reserved())


def test_past_the_budget_old_steps_keep_the_viewed_head_first(endless, unbudgeted):
    """A budget with room for every old step's viewed row and the other rows of steps 40 on: steps 1–39 keep only
    the viewed layer and head, the rest keep everything, and the run holds exactly the budget."""
    lh, old = endless.info.n_layers * endless.info.n_heads, range(1, STEPS - LOGITS_KEPT)
    budget = (held_at_least(endless, unbudgeted) + sum(row_bytes(k) for k in old)
              + sum((lh - 1) * row_bytes(k) for k in range(40, STEPS - LOGITS_KEPT)))
    gen = budget_run(endless, budget)
    assert gen.new_ids == unbudgeted.new_ids and gen.stop_reason == "max_new_tokens"
    assert [trace.attention_view for trace in gen.steps[1:]] == [VIEW] * 39 + [None] * (STEPS - 40)
    assert gen.attention_dropped == 0 and gen.memory_bytes == budget


def test_past_the_budget_the_oldest_rows_go_once_every_old_step_keeps_one_head(endless, unbudgeted):
    budget = held_at_least(endless, unbudgeted) + sum(row_bytes(k) for k in range(11, STEPS - LOGITS_KEPT))
    gen = budget_run(endless, budget)
    assert gen.new_ids == unbudgeted.new_ids and gen.stop_reason == "max_new_tokens"
    assert [trace.attention is None for trace in gen.steps[1:]] == [True] * 10 + [False] * (STEPS - 11)
    assert [trace.attention_view for trace in gen.steps[11:]] == [VIEW] * (STEPS - 13) + [None] * LOGITS_KEPT
    assert gen.attention_dropped == 10 and gen.memory_bytes == budget
    assert [(r.first, r.last, r.kept, r.view) for r in attention_runs(gen)] == [
        (1, 10, "none", None), (11, STEPS - 3, "one", VIEW), (STEPS - 2, STEPS - 1, "every", None)]


def test_the_triangle_drawn_equals_the_full_precision_attention_where_kept(endless, unbudgeted):
    """Against the float32 weights of one pass over the whole sequence: equal to float16's rounding on every row
    kept for the layer and head drawn, zero on every row dropped."""
    budget = held_at_least(endless, unbudgeted) + sum(row_bytes(k) for k in range(11, STEPS - LOGITS_KEPT))
    gen = budget_run(endless, budget)
    ids = gen.ids[: gen.steps[-1].cache_len]
    _, full = endless.forward(ids, None, output_attentions=True)  # (layers, heads, S, S), float32
    prompt_rows, latest = len(PROMPT), gen.steps[-LOGITS_KEPT].positions[0]
    for layer, head in [VIEW, (0, 0)]:
        drawn, exact = attention_history(gen, layer, head), np.tril(full[layer, head].numpy())
        kept_rows = [*range(prompt_rows), *(range(prompt_rows + 10, len(ids)) if (layer, head) == VIEW else
                                             range(latest, len(ids)))]
        np.testing.assert_allclose(drawn[kept_rows], exact[kept_rows], atol=2.5e-4, rtol=0)  # float16: 11 bits
        assert not drawn[sorted(set(range(len(ids))) - set(kept_rows))].any()


def test_back_to_a_thinned_step_gets_every_row_back(endless, unbudgeted):
    budget = held_at_least(endless, unbudgeted) + sum(row_bytes(k) for k in range(11, STEPS - LOGITS_KEPT))
    gen = budget_run(endless, budget)
    while len(gen.steps) > 20:  # back to step 19, which kept only the viewed head, then to 10, which kept nothing
        back(endless, gen)
    assert gen.steps[-1].keeps_every_head
    np.testing.assert_array_equal(gen.steps[-1].attention, unbudgeted.steps[19].attention)
    while len(gen.steps) > 11:
        back(endless, gen)
    np.testing.assert_array_equal(gen.steps[-1].attention, unbudgeted.steps[10].attention)
    assert gen.attention_dropped == 9 and [trace.attention_view for trace in gen.steps[1:]] == [None] * 10
    assert max_abs_logit_diff(gen.steps[-1], recompute(endless, gen.ids[: gen.steps[-1].cache_len])) < 1e-4


def test_back_reruns_only_the_decode_steps_whose_logits_were_dropped(endless, monkeypatch):
    """The prefill's logits are kept: a Back to the prefill does not run the whole prompt again."""
    gen = start(endless, [1, 5, 6, 7, 8], SamplingSettings(temperature=1.0, seed=3), 10)
    for _ in range(4):
        step(endless, gen)  # steps 0 (prefill) … 4: the logits of 0, 3 and 4 are kept
    fed = []
    forward = endless.forward
    monkeypatch.setattr(endless, "forward", lambda ids, cache, output_attentions: fed.append(len(ids)) or forward(
        ids, cache, output_attentions))
    runs = []
    for _ in range(4):
        before = len(fed)
        back(endless, gen)
        runs.append(fed[before:])
    assert runs == [[], [1], [1], []]  # to step 3: kept; to 2 and to 1: one decode step each; to the prefill: kept
    assert len(gen.steps) == 1 and gen.steps[0].logits is not None


def test_a_prefill_over_the_budget_stops_with_a_sentence(small):
    gen = start(small, [1, 5, 6, 7, 8], GREEDY, 20, budget_bytes=1000)
    assert gen.stop_reason == "memory_budget"
    assert text("stop.memory_budget", "vi") and text("stop.memory_budget", "en")


# -----------------------------------------------------------------------------
# the shared models


def test_auto_and_cpu_share_one_copy_and_clearing_streamlits_cache_keeps_it():
    assert model_key("small", "auto") == model_key("small", "cpu")
    first = shared_model("small", "auto")
    st.cache_resource.clear()  # what any visitor's websocket can ask for
    assert shared_model("small", "cpu") is first


@pytest.mark.browser
def test_the_browser_asks_before_a_reload_drops_the_run(app_server, browser_page):
    """A reload is a new session: while a run is held the page sets a beforeunload handler, and Reset clears it."""
    page = browser_page
    page.goto(f"{app_server}/decode?lang=en")
    wait_idle(page, timeout_ms=30_000)
    page.wait_for_function("window.onbeforeunload !== null", timeout=60_000)  # the page opens on a run
    page.locator(".st-key-reset button").click()
    page.wait_for_function("window.onbeforeunload === null", timeout=60_000)
    wait_idle(page)
    if not page.locator(".st-key-run_prefill button").is_visible():
        page.locator(".st-key-decode_settings summary").click()
    page.locator(".st-key-run_prefill button").click()
    page.wait_for_function("window.onbeforeunload !== null", timeout=60_000)


# -----------------------------------------------------------------------------
# presenter mode's charts

def test_presenter_mode_names_every_size_in_a_chart(monkeypatch):
    """Every text a chart draws gets its size from the figure in presenter mode, none from Streamlit's theme: the
    theme's axis titles take the root font as it was at the chart's first draw (14 px in CI on the KV page). Red
    without the axis titles' own font in ui/classroom.localised."""
    from ui import charts, classroom

    monkeypatch.setattr(classroom, "presenter", lambda: True)
    monkeypatch.setattr(classroom, "lang", lambda: "vi")
    line = dict(type="scatter", x=[1, 2], y=[3, 4], name="full")
    layout = classroom.localised(charts.figure(
        [line], 300, xaxis=dict(title=dict(text="position")), yaxis=dict(title=dict(text="perplexity"), type="log"),
        legend=dict(orientation="h"), xaxis2=dict(domain=[0.5, 1])))["layout"]
    assert layout["separators"] == ",." and layout["font"]["size"] >= 18 and layout["legend"]["font"]["size"] >= 18
    assert layout["legend"]["orientation"] == "h" and layout["yaxis"]["type"] == "log"
    for axis in ("xaxis", "yaxis", "xaxis2"):
        assert layout[axis]["tickfont"]["size"] >= 18 and layout[axis]["title"]["font"]["size"] >= 18, axis
    assert layout["xaxis"]["title"]["text"] == "position" and layout["yaxis"]["title"]["text"] == "perplexity"
