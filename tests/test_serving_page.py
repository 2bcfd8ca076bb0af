"""The Serving page under AppTest (steps, Run to end, the roofline, the profiler, bad input, both languages) and in
headless Chromium with 4 requests in both languages."""

import json
import re

import pytest
from apptest import click, open_app
from conftest import wait_idle
from test_gemma3 import needs_model as needs_gemma3

from model.engine.generate import run_to_end, start
from model.engine.loading import load_model
from model.engine.sampling import SamplingSettings
from model.texts import text

TIMEOUT = 120
PAGE = "app_pages/serving.py"


def open_page(lang: str = "vi", **state):
    settings = dict(serving_slots=2, serving_requests=4, serving_prompt_lengths=(3, 9), serving_new_tokens=(2, 5))
    return open_app(PAGE, TIMEOUT, lang=lang, model_name="small", device="cpu", **(settings | state))


# the machine's roofs pinned (copy GB/s, matmul GFLOP/s): a measured ridge moves with the machine's load (CI's once
# fell to 1.7 FLOPs/byte, below small's prefill), and each of the prefill's sentences is to be seen once
RIDGE_ABOVE_PREFILL, RIDGE_BELOW_PREFILL = (26.0, 85.0), (26.0, 26.0)


@pytest.mark.parametrize(("lang", "roofs"), [("vi", RIDGE_ABOVE_PREFILL), ("en", RIDGE_BELOW_PREFILL)])
def test_steps_then_run_to_end_serve_every_request(lang, roofs, monkeypatch):
    import ui.session
    from model.tools import serve_bench

    monkeypatch.setattr(ui.session, "machine", lambda device: serve_bench.Machine(device, 1, *roofs))
    at = click(open_page(lang), "serving_start")
    server = at.session_state["serving_server"]
    assert len(server.steps) == 1 and server.steps[0].joined == [0, 1] and not at.error
    click(at, "serving_next")
    assert len(server.steps) == 2 and server.steps[1].decode_lengths
    click(at, "serving_run")
    assert server.finished and at.button(key="serving_next").disabled
    assert all(r.stop_reason is not None for r in server.requests.values())
    # a waiting request took a freed slot: the queue of 4 went through 2 slots
    assert max(r.joined_step for r in server.requests.values()) > 0
    html = "".join(h.proto.body for h in at.get("html"))
    assert html.count('class="dl-chart"') >= 3  # the lanes, the step times, the roofline
    # the roofline's table: a point per batch size the run had and one for its longest prefill
    assert "ITL p99" in html and ">B=2<" in html and re.search(r">prefill \d+<", html)
    assert text("serving.lanes", lang) in [h.value for h in at.subheader]
    # the prefill sentence follows the run: its longest lone prefill (~2.8 FLOPs/byte here) against the ridge
    def number(value: int) -> str:  # as ui.i18n.number writes it in `lang`
        return f"{value:,}".replace(",", "." if lang == "vi" else ",")

    longest = serve_bench.longest_prefill(server)
    ridge = roofs[1] / roofs[0]
    intensity = longest.prefill_flops / longest.prefill_bytes
    said = dict(n=longest.prefill_tokens, i=f"{intensity:.1f}", ridge=f"{ridge:.1f}")
    if roofs == RIDGE_ABOVE_PREFILL:
        assert intensity < ridge
        cross = serve_bench.positions_to_pass(server.model, ridge)
        assert cross is not None  # small's context (128) holds a prefill that passes a ridge of 3.3
        expected = text("serving.prefill_memory_bound", lang).format(cross=number(cross), **said)
    else:
        assert intensity >= ridge
        expected = text("serving.prefill_compute_bound", lang).format(**said)
    assert expected in [c.value for c in at.caption]
    # the rows' sentence is this run's own measurement: the fewest and the most rows a decode pass had
    decodes = [p for p in serve_bench.roofline_points(server) if p.rows is not None]
    assert [p.rows for p in decodes] == sorted(p.rows for p in decodes) and len(decodes) > 1
    scaling = text("serving.rows_scaling", lang).format(small=decodes[0].rows, big=decodes[-1].rows,
                                                         ratio=f"{decodes[-1].ms / decodes[0].ms:.2f}",
                                                         rows=f"{decodes[-1].rows / decodes[0].rows:.3g}")
    assert scaling in [c.value for c in at.caption]


def test_sampled_requests_draw_as_their_solo_runs():
    """temperature, top-k and top-p from the page's controls, request i with seed + i: each request's tokens are its
    solo run's (generate.py) with those settings."""
    at = click(open_page("en", serving_temperature=0.9, serving_top_k=8, serving_top_p=0.95, serving_seed=5),
               "serving_start")
    click(at, "serving_run")
    server = at.session_state["serving_server"]
    assert server.finished and not at.error
    small = load_model("small", "cpu")
    for r in server.requests.values():
        assert r.settings == SamplingSettings(0.9, 8, 0.95, 5 + r.id)
        solo = start(small, r.prompt_ids, r.settings, r.max_new_tokens)
        run_to_end(small, solo)
        assert r.new_ids == solo.new_ids


@needs_gemma3
def test_gemma3_serves_with_its_sliding_layers_formula():
    at = open_app(PAGE, TIMEOUT, lang="en", model_name="gemma3", device="cpu", serving_slots=2, serving_requests=3,
                  serving_prompt_lengths=(3, 9), serving_new_tokens=(2, 4))
    click(click(at, "serving_start"), "serving_run")
    assert at.session_state["serving_server"].finished and not at.error
    markdown = " ".join(m.value for m in at.markdown)
    assert "3 full-attention layers keep every position, and 15 sliding-window layers only the 512 latest" in markdown
    assert "(3 × n + 15 × min(n, 512)) × 2,048 B" in markdown  # 2 × 1 KV head × 256 × 4 B


def test_profile_shows_the_ops_of_a_step_and_a_trace():
    at = click(click(open_page("en"), "serving_start"), "serving_profile_button")
    ops, trace, rows = at.session_state["serving_profile"]
    assert ops and json.loads(trace)["traceEvents"] and rows >= 1
    assert any(op.name.startswith("aten::") for op in ops)


def test_int8_weights_run_the_same_page():
    at = click(open_page("en", serving_dtype="int8"), "serving_start")
    server = at.session_state["serving_server"]
    assert server.model.info.dtype == "int8" and not at.error


def test_past_the_context_is_one_sentence_and_the_session_stays():
    at = click(open_page("en", serving_prompt_lengths=(64, 64), serving_new_tokens=(64, 64)), "serving_start")
    assert at.session_state["serving_server"] is None
    assert [e.value for e in at.error] == [text("error.serving_context", "en").format(context=128, most=127)]
    click(at, "serving_start")  # the page is still there and answers again the same way
    assert len(at.error) == 1


def test_past_the_memory_budget_is_one_sentence(monkeypatch):
    monkeypatch.setenv("DECODE_LAB_SESSION_MB", "0.01")
    at = click(open_page("vi", serving_slots=8, serving_requests=8), "serving_start")
    assert at.session_state["serving_server"] is None
    assert len(at.error) == 1 and "MiB" in at.error[0].value and "8 yêu cầu" in at.error[0].value


@pytest.mark.browser
@pytest.mark.parametrize("lang", ["vi", "en"])
def test_browser_serves_4_requests(app_server, browser_page, lang):
    page = browser_page
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{app_server}/serving?lang={lang}")
    queue = page.get_by_label(text("serving.requests", lang))
    queue.fill("4")
    queue.press("Enter")
    wait_idle(page)
    page.get_by_role("button", name=text("serving.start", lang)).click()
    wait_idle(page)
    page.get_by_role("button", name=text("serving.run", lang)).click()
    wait_idle(page)
    page.locator("img.dl-chart").nth(2).wait_for()  # the lanes, the step times, the roofline
    wait_idle(page)
    assert page.get_by_text(text("serving.lanes_caption", lang).format(waiting=0)).count() == 1
    assert page.locator("[data-testid='stException']").count() == 0 and not errors
    page.screenshot(path=f"test-artifacts/serving-{lang}.png", full_page=True)
