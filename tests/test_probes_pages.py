"""Issue 26 on the pages: the logit lens and switched-off heads in the Decode step view and on Prefill, side
computations that leave the run as it was."""

from html import escape

import numpy as np
import pytest
from apptest import click, open_app

from model.texts import text


def open_run(page: str, lang: str = "en", **state):
    at = open_app(page, lang=lang, model_name="small", device="cpu", prompt_mode="text", **state)
    return click(at, "run_prefill")


def step_view_html(at) -> str:
    return "".join(h.proto.body for h in at.get("html"))


def run_state(gen):
    """What a side computation must not change: the tokens, the cache's length and contents, the traces."""
    keys = [gen.cache.layer(i)[0].clone() for i in range(gen.cache.n_layers)]
    return gen.ids, gen.cache.length, keys, [s.logits.copy() if s.logits is not None else None for s in gen.steps]


def assert_same_run(before, after):
    assert before[0] == after[0] and before[1] == after[1]
    assert all(bool((a == b).all()) for a, b in zip(before[2], after[2], strict=True))
    assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(before[3], after[3], strict=True))


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_the_lens_and_heads_off_draw_in_the_step_view_and_leave_the_run(lang):
    at = click(open_run("app_pages/decode.py", lang), "next")
    gen = at.session_state["generation"]
    before = run_state(gen)
    at.toggle(key="logit_lens").set_value(True)
    at.multiselect(key="heads_off").set_value(["0.0", "1.2"])
    at.run()
    assert not at.exception and not at.error
    html = step_view_html(at)
    assert text("lens.title", lang) in html and text("ablation.title", lang).format(heads="0.0, 1.2") in html
    assert_same_run(before, run_state(at.session_state["generation"]))
    click(at, "next")  # the run goes on as if nothing had been looked at
    assert len(at.session_state["generation"].steps) == 3


def test_heads_off_on_the_prefill_page():
    at = open_run("app_pages/prefill.py")
    before = run_state(at.session_state["generation"])
    at.multiselect(key="heads_off").set_value(["3.1"]).run()
    assert not at.exception and not at.error
    assert text("ablation.title", "en").format(heads="3.1") in step_view_html(at)
    assert_same_run(before, run_state(at.session_state["generation"]))


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_the_token_tax_on_the_prefill_page_before_any_run(lang):
    at = open_app("app_pages/prefill.py", lang=lang, model_name="small", device="cpu")
    assert "token-tax" in {h.proto.anchor for h in at.subheader}
    at.toggle(key="tax_shown").set_value(True).run()
    html = step_view_html(at)
    assert not at.exception and not at.error and "<td>small</td><td>6</td><td>7</td><td>0.86</td>" in html
    at.session_state["tax_twin"] = 3  # typed: an HTML sentence is shown escaped, never run
    at.run()
    at.text_input(key="tax_vi").input("<b>mèo</b>").run()
    at.text_input(key="tax_en").input("cat").run()
    html = step_view_html(at)
    assert not at.exception and "<b>mèo" not in html
    # small's words: the tags are outside its vocabulary, and the line that lists them shows them as text
    unknown = escape(text("tax.unknown", lang).format(words="<, b, >, </, b, >"))
    assert f'<p class="dl-caption">{unknown}</p>' in html
    at.text_input(key="tax_en").input("   ").run()
    assert [e.value for e in at.error] == [text("error.empty_prompt", lang)]
