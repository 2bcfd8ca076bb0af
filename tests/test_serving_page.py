"""The Serving page under AppTest (steps, Run to end, the roofline, the profiler, bad input, both languages) and in
headless Chromium with 4 requests in both languages."""

import base64
import json
import re
from html import escape

import pytest
from apptest import click, open_app
from conftest import needs_kernels, wait_idle
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


# the machine's roofs pinned (read GB/s, the slanted roof; matmul GFLOP/s): a measured ridge moves with the machine's
# load (CI's once fell to 1.7 FLOPs/byte, below small's prefill), and each of the prefill's sentences is to be seen once
RIDGE_ABOVE_PREFILL, RIDGE_BELOW_PREFILL = (26.0, 130.0), (26.0, 26.0)


def pin_roofs(monkeypatch, roofs_by_dtype: dict[str, tuple[float, float]]) -> list[str]:
    """ui.serving_run.machine answers these roofs for each dtype; returns the dtypes the page asked for."""
    import ui.serving_run
    from model.serving import measure

    asked = []

    def machine(device, dtype="float32"):
        asked.append(dtype)
        read_gb_s, matmul_gflops = roofs_by_dtype[dtype]
        return measure.Machine(device, 1, read_gb_s / 1.5, read_gb_s, matmul_gflops, dtype)  # a copy moves less

    monkeypatch.setattr(ui.serving_run, "machine", machine)
    return asked


def decimal(value: float, places: int, lang: str) -> str:  # as ui.i18n.decimal writes it in `lang`
    written = f"{value:,.{places}f}"
    return written.translate(str.maketrans(",.", ".,")) if lang == "vi" else written


def number(value: int, lang: str) -> str:  # as ui.i18n.number writes it in `lang`
    return f"{value:,}".replace(",", "." if lang == "vi" else ",")


def captions(at) -> list[str]:
    return [c.value for c in at.caption]


@pytest.mark.parametrize(("lang", "roofs"), [("vi", RIDGE_ABOVE_PREFILL), ("en", RIDGE_BELOW_PREFILL)])
def test_steps_then_run_to_end_serve_every_request(lang, roofs, monkeypatch):
    from model.serving import analysis, costs

    pin_roofs(monkeypatch, {"float32": roofs})
    at = click(open_page(lang), "serving_start")
    server = at.session_state["serving_server"]
    assert len(server.steps) == 1 and server.steps[0].admitted == [0, 1] and not at.error
    click(at, "serving_next")
    assert len(server.steps) == 2 and [p.kind for p in server.steps[1].passes] == ["decode"]
    # the shared counts row: the last step's time, its "?" saying what the step ran (its 2 decode rows)
    last = {m.label: m for m in at.metric}[text("serving.last_step", lang)]
    assert last.value == f"{decimal(server.steps[1].ms, 1, lang)} ms"
    assert last.proto.help.startswith(text("serving.last_step_help", lang).format(rows=2, prefill="", decode="")[:12])
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
    # where the clock went, by kind of pass: the prompts' passes, the decode passes, choosing the tokens
    parts = ("serving.time_forward_prefill", "serving.time_forward_decode", "serving.time_draws")
    assert all(escape(text(key, lang)) in html for key in parts)
    assert escape(text("serving.time_forward_mixed", lang)) not in html  # no pass mixes them on this page
    # the prefill sentence follows the run: its longest prefill (8 positions, ~3.7 FLOPs/byte) against the ridge
    longest = analysis.longest_prefill(server)
    ridge = roofs[1] / roofs[0]
    said = dict(n=number(longest.positions, lang), i=decimal(longest.intensity, 2, lang),
                ridge=decimal(ridge, 2, lang))
    if roofs == RIDGE_ABOVE_PREFILL:
        assert longest.intensity < ridge
        cross = costs.positions_to_pass(server.model, ridge)
        assert cross is not None  # small's context (128) holds a prefill that passes a ridge of 5
        # texts review S6: not 'memory still limits it' but what it read of the read roof (small's 8 positions: a
        # few % of it, the fixed cost per op bounds it)
        share = f"{longest.bytes_read / (longest.ms / 1000) / 1e9 / roofs[0]:.0%}"
        expected = text("serving.prefill_memory_bound", lang).format(cross=number(cross, lang), share=share, **said)
        assert share in expected
    else:
        assert longest.intensity >= ridge
        expected = text("serving.prefill_compute_bound", lang).format(**said)
    assert expected in captions(at)
    # the rows' sentence is this run's own measurement: the fewest and the most rows a decode pass had
    decodes = [p for p in analysis.roofline_points(server) if p.rows is not None]
    assert [p.rows for p in decodes] == sorted(p.rows for p in decodes) and len(decodes) > 1
    scaling = text("serving.rows_scaling", lang).format(small=decodes[0].rows, big=decodes[-1].rows,
                                                         ratio=decimal(decodes[-1].ms / decodes[0].ms, 2, lang))
    assert scaling in captions(at)
    # decode at B = 1 (~0.5 FLOPs/byte) is left of either ridge, and a prefill passes it within the context here:
    # the two designs the asymmetry leads to are said (not where decode is compute-bound: test_the_roofs_are_...)
    assert decodes[0].intensity < ridge
    assert text("serving.two_designs", lang) in captions(at)


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
    # its GELU is torch's: rows claimed within a tolerance, not bit for bit as a Llama's
    shown = [m.value for m in at.markdown]
    assert text("serving.how_exact_gemma", "en") in shown and text("serving.how_exact", "en") not in shown


def test_profile_shows_the_ops_of_a_step_and_a_trace():
    at = click(click(open_page("en"), "serving_start"), "serving_profile_button")
    ops, trace, rows = at.session_state["serving_profile"]
    assert ops and json.loads(trace)["traceEvents"] and rows >= 1
    assert any(op.name.startswith("aten::") for op in ops)
    # what the decode_lab:: ops are is said where the table has some (the model ran in the decode kernels), only there
    in_kernels = any(op.name.startswith("decode_lab::") for op in ops)
    said = any(c.value.startswith("Ops named decode_lab::") for c in at.caption)
    assert said == in_kernels


@needs_kernels
def test_the_roofs_are_those_of_the_runs_weights(monkeypatch):
    """int8 weights run in torch's int8 kernel, whose flat roof is its own (2.3 GFLOP/s measured here, against 85 for
    float32's matmul): the page draws that roof, names its product, and its decode points fall right of its ridge,
    so the note says compute bounds them, and the prefill/decode contrast is not said."""
    from model.serving import analysis

    asked = pin_roofs(monkeypatch, {"float32": (26.0, 85.0), "int8": (26.0, 2.3)})
    at = click(click(open_page("en", serving_dtype="int8"), "serving_start"), "serving_run")
    server = at.session_state["serving_server"]
    assert server.model.info.dtype == "int8" and not at.error and asked[-1] == "int8"
    product = text("serving.product_int8", "en").format(rows=64)
    assert any(product in c for c in captions(at))
    ridge = 2.3 / 26.0
    fewest = next(p for p in analysis.roofline_points(server) if p.rows is not None)
    assert fewest.intensity > ridge  # int8 weights: ~1 byte a weight, 2 FLOPs a weight a row
    note = text("serving.roofline_note_compute", "en").format(rows=fewest.rows, i=f"{fewest.intensity:.2f}",
                                                                ridge=f"{ridge:.2f}")
    assert note in captions(at)
    assert text("serving.two_designs", "en") not in captions(at)
    # int8's flat roof is the kernels' own product: no sentence that the run's products are not the roof's
    assert not any(text("serving.roof_torch", "en") in c for c in captions(at))


@needs_kernels
def test_a_bfloat16_weights_run_is_the_float32_model_over_rounded_weights_with_its_kernels_roof(monkeypatch):
    """Weights: bfloat16-weights serves every request to its budget (its rows are their solo runs bit for bit:
    tests/test_batch.py), its flat roof is the kernels' own bfloat16-weights product, named so, with no sentence that
    the run's products are not the roof's; its cache is float32 (4 bytes a number). Red once with the roof asked for
    in the run's dtype's arithmetic (float32) instead of its own product."""
    asked = pin_roofs(monkeypatch, {"float32": (26.0, 85.0), "bfloat16-weights": (26.0, 40.0)})
    at = click(click(open_page("en", serving_dtype="bfloat16-weights"), "serving_start"), "serving_run")
    server = at.session_state["serving_server"]
    assert not at.exception and not at.error and asked[-1] == "bfloat16-weights"
    assert server.model.info.dtype == "bfloat16-weights" and server.model.info.bytes_per_element == 4
    assert server.finished and all(len(r.new_ids) == r.max_new_tokens for r in server.requests.values())
    machine = next(c for c in captions(at) if c.startswith("This machine, measured once"))
    assert text("serving.product_bfloat16_weights", "en").format(rows=64) in machine
    assert not machine.endswith(text("serving.roof_torch", "en"))


@needs_kernels
def test_a_float32_run_in_the_kernels_is_told_its_flat_roof_is_torch_s_matmul(monkeypatch):
    """texts review S3: the flat roof of float32 and bfloat16 is torch's matmul (on an AMX CPU, bfloat16's is AMX's:
    985 GFLOP/s against the kernels' 60 here), which the run's products, in the kernels, never use: the machine's
    caption names torch's product and says the run's products are the kernels'."""
    pin_roofs(monkeypatch, {"float32": (26.0, 85.0)})
    at = click(click(open_page("en"), "serving_start"), "serving_run")
    machine = next(c for c in captions(at) if c.startswith("This machine, measured once"))
    assert text("serving.product", "en").format(dtype="float32") in machine
    assert machine.endswith(text("serving.roof_torch", "en"))


@needs_kernels
def test_the_formulas_and_the_rows_sentence_stay_the_runs_until_reset(monkeypatch):
    """A bfloat16 run's formulas read its own weights and cache: small's 4 layers × K and V × 2 KV heads × 32 × 2 B
    = 1,024 B a position (float32's page model has 2,048), 1,612,288 B of weights for one row (packed in bfloat16 for
    the decode kernels: the LM head's 525 outputs filled up to 528). Weights switched to float32 mid-run: the run
    stays bfloat16, the page says the choice applies from the next Start, and the formulas and the sweep's help stay
    the run's until a new one starts; bfloat16 rows, as float32's, are their solo runs bit for bit."""
    pin_roofs(monkeypatch, {"float32": RIDGE_ABOVE_PREFILL, "bfloat16": RIDGE_ABOVE_PREFILL})
    at = click(open_page("en", serving_dtype="bfloat16"), "serving_start")

    def the_runs_own() -> None:
        markdown = " ".join(m.value for m in at.markdown)
        assert "every weight once (1,612,288 B with one row)" in markdown
        assert "each row's cache (1,024 B a position)" in markdown
        assert text("serving.sweep_help", "en").format(dtype="bfloat16", contexts="64") in captions(at)
        assert text("serving.how_exact", "en") in [m.value for m in at.markdown]

    the_runs_own()
    at.selectbox(key="serving_dtype").set_value("float32").run()
    assert at.session_state["serving_server"].info.dtype == "bfloat16"
    assert text("serving.dtype_next_run", "en").format(run="bfloat16", chosen="float32") in captions(at)
    the_runs_own()
    click(at, "serving_next")
    the_runs_own()
    click(at, "serving_start")  # a new run, in float32: the page's packed model, every row its solo run's bits
    markdown = " ".join(m.value for m in at.markdown)
    assert "each row's cache (2,048 B a position)" in markdown
    assert text("serving.how_exact", "en") in [m.value for m in at.markdown]
    assert text("serving.dtype_next_run", "en").format(run="bfloat16", chosen="float32") not in captions(at)


def test_the_longest_prefill_is_the_runs_longest(monkeypatch):
    """The page's default queue (4 slots, 8 requests, prompts of 4 to 24) prefills prompts of 21, 17, 14 and 9
    positions in its first step; each prefill is a pass of its own, timed alone, so the longest, 21, is the
    roofline's prefill point and the sentence's, from the first step on."""
    from model.serving import analysis

    pin_roofs(monkeypatch, {"float32": RIDGE_ABOVE_PREFILL})
    at = click(open_app(PAGE, TIMEOUT, lang="en", model_name="small", device="cpu"), "serving_start")
    server = at.session_state["serving_server"]
    first = server.steps[0]
    assert first.admitted == [0, 1, 2, 3] and [p.positions for p in first.passes] == [21, 17, 14, 9]
    assert {p.kind for p in first.passes} == {"prefill"}
    assert sum(p.ms for p in first.passes) == pytest.approx(first.forward_ms)
    longest = analysis.longest_prefill(server)
    assert (longest.positions, longest.ms) == (21, first.passes[0].ms)
    assert ">prefill 21<" in "".join(h.proto.body for h in at.get("html"))
    assert any(c.startswith("This run's longest prefill (21 positions) does ") for c in captions(at))


@pytest.mark.parametrize(("name", "swept"), [("small", "64"), ("micro", "8")])
def test_the_sweep_says_the_contexts_it_measures(name, swept):
    """small holds 128 positions, micro 16: the sweep measures 64 cached positions on small (256 does not fit), 8 on
    micro (half its context), and its help says so before it runs."""
    at = click(open_app(PAGE, TIMEOUT, lang="en", model_name=name, device="cpu", serving_slots=2,
                        serving_requests=2, serving_prompt_lengths=(2, 4), serving_new_tokens=(2, 3)),
               "serving_start")
    assert text("serving.sweep_help", "en").format(dtype="float32", contexts=swept) in captions(at)
    click(at, "serving_measure")
    dtype, sweep = at.session_state["serving_sweep"]
    assert (dtype, [str(c) for c in sweep]) == ("float32", [swept])


@pytest.mark.parametrize(("slots", "written"), [(16, True), (17, False)])
def test_the_lanes_caption_speaks_of_the_ids_only_where_they_are_written(slots, written):
    at = click(open_page("en", serving_slots=slots, serving_requests=slots, serving_prompt_lengths=(2, 3),
                         serving_new_tokens=(1, 2)), "serving_start")
    chart = next(h.proto.body for h in at.get("html") if "dl-chart" in h.proto.body)
    svg = base64.b64decode(re.search(r"base64,([^\"]+)", chart)[1]).decode()
    assert (re.search(r'class="lane-id"[^>]*>0</text>', svg) is not None) == written  # request 0's number
    with_ids = text("serving.lanes_caption", "en").format(waiting=0)
    without = text("serving.lanes_caption_no_ids", "en").format(waiting=0, most=16)
    assert (with_ids in captions(at), without in captions(at)) == (written, not written)


def test_the_sliders_offer_only_lengths_the_context_holds():
    """small holds 128 positions: prompts up to 64 and new tokens up to 63, so every pair fits; values past that
    (prompt 64 + new tokens 64 was refused in words about a 'context' no control names) are brought inside."""
    at = click(open_page("en", serving_prompt_lengths=(64, 64), serving_new_tokens=(64, 64)), "serving_start")
    assert (at.slider(key="serving_prompt_lengths").max, at.slider(key="serving_new_tokens").max) == (64, 63)
    assert at.session_state["serving_new_tokens"] == (63, 63) and not at.error
    assert len(at.session_state["serving_server"].steps) == 1


@pytest.mark.parametrize("context", [16, 128, 8192, 32768])  # micro, small, SmolLM2, Gemma 3
def test_the_longest_lengths_fit_each_models_context(context):
    from model.serving import workload

    prompt, new = workload.most_lengths(context)
    assert prompt >= 1 and new >= 1 and prompt + new < context


def test_a_queue_past_the_context_is_refused_in_the_pages_words(small):
    from model.errors import InputError
    from model.serving import workload

    with pytest.raises(InputError) as past:
        workload.start_serving(small, 2, 2, (3, 64), (1, 64))
    assert past.value.code == "serving_lengths"
    for lang in ("vi", "en"):
        message = past.value.message(lang)
        assert text("serving.prompt_lengths", lang) in message and text("serving.new_tokens", lang) in message
        assert "(64)" in message and "128" in message


def test_past_the_memory_budget_is_one_sentence(monkeypatch):
    monkeypatch.setenv("DECODE_LAB_SESSION_MB", "0.01")
    at = click(open_page("vi", serving_slots=8, serving_requests=8), "serving_start")
    assert at.session_state["serving_server"] is None
    assert len(at.error) == 1 and "MiB" in at.error[0].value and "8 yêu cầu" in at.error[0].value
    assert all(text(key, "vi") in at.error[0].value.replace("\\", "")
               for key in ("serving.slots", "serving.prompt_lengths", "serving.new_tokens"))


@needs_kernels
def test_a_slow_queue_is_announced_before_start(monkeypatch):
    """With passes timed at 100 ms a prompt position and 150 ms a decode row (plus 150), the first step of a queue
    whose first two prompts are 8 and 7 positions (seed 0's draw from 3 to 9) should take 1.5 s: the page says so
    before Start; with fast passes it says nothing."""
    import ui.serving_run
    from model.serving.workload import PassCosts

    settings = dict(serving_slots=2, serving_requests=4, serving_prompt_lengths=(3, 9))
    monkeypatch.setattr(ui.serving_run, "pass_costs", lambda model: PassCosts((100.0, 400.0), (150.0, 600.0)))
    at = open_page("en", serving_dtype="int8", **settings)
    said = text("serving.slow_steps", "en").format(dtype="int8", first="1.5", prompts=2, positions="15", rows=2,
                                                    decode="0.3", probe=4)
    assert [w.value for w in at.warning] == [said]
    monkeypatch.setattr(ui.serving_run, "pass_costs", lambda model: PassCosts((1.0, 2.0), (1.0, 2.0)))
    assert not open_page("en", serving_dtype="int8", **settings).warning


def test_stop_reaches_a_step_between_two_layers_and_the_run_goes_on(monkeypatch):
    """The first step runs in the page's script, its bar redrawn after each layer (the redraw interval set to 0):
    a Stop there (raised as Streamlit raises it at a redraw when a click is waiting), during the second prefill,
    keeps the step's plan; Next step runs it again whole, and the run's tokens are those of a run never stopped."""
    from streamlit.runtime.scriptrunner_utils.exceptions import StopException

    import ui.serving_run
    from model.serving import workload

    monkeypatch.setattr(ui.serving_run, "RUN_REDRAW_S", 0.0)
    shown = []
    redraw = ui.serving_run.StepBar.show

    def show_then_stop(bar, progress):
        redraw(bar, progress)
        shown.append(progress)
        if (progress.step, progress.prefilled, progress.layer) == (0, 1, 2) and len(shown) == 6:  # once
            raise StopException()

    monkeypatch.setattr(ui.serving_run.StepBar, "show", show_then_stop)
    at = open_page("en", serving_opened_for=("small", "cpu"))  # no first run of its own: Start makes the first
    at.button(key="serving_start").click().run()
    server = at.session_state["serving_server"]
    assert not server.steps and server.plan is not None
    assert [(p.prefilled, p.layer) for p in shown] == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2)]
    at.run()  # the run the click on Stop asks for
    assert text("serving.stopped", "en").format(steps=0) in [i.value for i in at.info]
    click(at, "serving_next")
    assert server.steps[0].admitted == [0, 1] and [p.positions for p in server.steps[0].passes] == [8, 7]
    click(at, "serving_run")
    never_stopped = workload.start_serving(load_model("small", "cpu"), 2, 4, (3, 9), (2, 5))
    while not never_stopped.finished:
        never_stopped.step()
    assert [r.new_ids for r in server.requests.values()] == [r.new_ids for r in never_stopped.requests.values()]
    assert [s.admitted for s in server.steps] == [s.admitted for s in never_stopped.steps]


def test_stop_reaches_the_sweep_between_two_passes(monkeypatch):
    """The sweep runs in the page's script under a bar and Stop (a long one: int8 SmolLM2 prefills 256 positions
    for each of its points): stopped during its second point, it keeps nothing, and measures again on the next
    click."""
    from streamlit.runtime.scriptrunner_utils.exceptions import StopException

    import ui.serving_run

    monkeypatch.setattr(ui.serving_run, "RUN_REDRAW_S", 0.0)
    drawn = []

    def draw_then_stop(bar, done, said):
        drawn.append(said)
        if said.startswith("Measuring B = 2 ") and drawn.count(said) == 1:
            raise StopException()

    at = click(open_page("en"), "serving_start")
    monkeypatch.setattr(ui.serving_run.StopBar, "draw", draw_then_stop)
    at.button(key="serving_measure").click().run()
    assert at.session_state["serving_sweep"] is None
    assert drawn[0] == text("serving.sweep_progress", "en").format(batch=1, n="64", k=1, total=4)
    click(at.run(), "serving_measure")
    dtype, sweep = at.session_state["serving_sweep"]
    assert (dtype, list(sweep), len(sweep[64])) == ("float32", [64], 4)


@pytest.mark.browser
@pytest.mark.parametrize("lang", ["vi", "en"])
def test_browser_serves_4_requests(app_server, browser_page, lang):
    page = browser_page
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{app_server}/serving?lang={lang}")
    page.locator(".st-key-serving_settings summary").click(timeout=90_000)  # the folded settings
    queue = page.get_by_label(text("serving.requests", lang))
    queue.fill("4")
    queue.press("Enter")
    wait_idle(page)
    page.get_by_role("button", name=text("action.start", lang)).click()
    wait_idle(page)
    page.get_by_role("button", name=text("action.run_to_end", lang)).click()
    wait_idle(page)
    page.locator("img.dl-chart").nth(2).wait_for()  # the lanes, the step times, the roofline
    wait_idle(page)
    assert page.get_by_text(text("serving.lanes_caption", lang).format(waiting=0)).count() == 1
    assert page.locator("[data-testid='stException']").count() == 0 and not errors
    page.screenshot(path=f"test-artifacts/serving-{lang}.png", full_page=True)


@needs_kernels
def test_each_dtype_has_a_row_with_its_step_and_its_cost_in_accuracy_kept_for_the_next_visit():
    """small, en: the button measures float32, bfloat16 and int8 (a B = 1 step and the held-out text's quality) and
    the table shows a row each; float32's perplexity is the exponential of the mean NLL summed by hand from one plain
    pass of the module per window; a new session shows the kept table without a click."""
    import math

    from test_quality import nll_by_hand

    from model.serving.quality import held_out

    at = click(click(open_page("en"), "serving_start"), "serving_measure_dtypes")
    assert not at.error
    small = load_model("small", "cpu")
    ids = small.tokenizer.encode(held_out(small.info.language).text).ids
    total, scored = nll_by_hand(small.module, ids, small.info.context_length)
    html = "".join(h.proto.body for h in at.get("html"))
    rows = re.findall(r"<tr><td>(float32|bfloat16|int8)</td>((?:<td>[^<]*</td>)+)</tr>", html)
    assert [dtype for dtype, _ in rows] == ["float32", "bfloat16", "int8"]
    cells = re.findall(r"<td>([^<]*)</td>", rows[0][1])
    assert float(cells[4].replace(",", "")) == pytest.approx(math.exp(total / scored), rel=1e-5)
    assert cells[5] == "100.0%"
    assert any(c.startswith("Step: the median of 10 decode steps at B = 1 over 64 cached positions") and
               f"the {scored} tokens of assets/quality/vi.txt" in c for c in captions(at))
    again = click(open_page("en"), "serving_start")
    assert text("serving.dtypes_help", "en") not in captions(again) and "<td>int8</td>" in "".join(
        h.proto.body for h in again.get("html"))


@pytest.mark.parametrize(("flags", "bf16", "int8", "keys"), [
    ({"avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni"}, "avx512_bf16", "avx512_vnni",
     ["cpu_bf16_native", "cpu_amx", "cpu_int8_vnni"]),
    ({"avx512_bf16"}, "float32", "integer", ["cpu_bf16_unused", "cpu_int8_integer"]),
    ({"avx2", "avx_vnni"}, "float32", "integer", ["cpu_bf16_emulated", "cpu_int8_integer"]),
    (None, "float32", "integer", ["cpu_bf16_unknown", "cpu_int8_integer"]),
    ({"avx512_bf16", "avx512_vnni"}, "torch", "none", ["cpu_bf16_torch", "cpu_int8_none"]),
])
def test_the_cpu_sentences_say_what_the_flags_and_the_kernels_offer(flags, bf16, int8, keys):
    """A CPU with AVX-512 BF16 and AMX whose kernels use them, one whose kernels were built without it, one without
    it, one whose flags are unknown (no /proc/cpuinfo), one where the kernels did not build: each its sentences."""
    from model.engine.kernels import CpuFeatures, MachineProducts, cpu_features
    from ui.serving_run import cpu_sentences

    cpu = cpu_features(frozenset(flags)) if flags is not None else CpuFeatures("AVX2", None, None, None, None, None)
    assert cpu_sentences(MachineProducts(cpu, bf16, int8)) == [text("serving." + k, "vi") for k in keys]


def test_the_dtype_table_writes_vietnamese_numbers_and_says_a_refused_dtype(monkeypatch):
    """The kept table of a machine that cannot run int8 (its sentence under the table), in Vietnamese: 26,35 ms,
    541,1 MB, perplexity 34,332, agreement 96,4%, and the note's 911 tokens; no measurement is run (the kept entry
    is this test's)."""
    import ui.serving_run
    from model.serving.measure import DtypeCost
    from model.serving.quality import DtypeQuality, Quality

    pin_roofs(monkeypatch, {"float32": (26.0, 85.0)})  # read roof 26 GB/s: 20.53 GB/s is 79 % of it
    rows = [DtypeCost("float32", 26.35, 541_057_536, 20.53, 34.3323, 1.0, 0.0),
            DtypeCost("bfloat16", 20.1, 270_528_768, 13.46, 34.3825, 185 / 192, 0.00099)]
    quality = Quality("small", "assets/quality/vi.txt", 911, 1, 128, 8, 24,
                      [DtypeQuality("float32", 34.3323, 3.536, 192, 192, 0.0),
                       DtypeQuality("bfloat16", 34.3825, 3.5375, 185, 192, 0.00099)])
    from model.errors import InputError

    refused = text("error.int8_no_kernels", "vi")
    # kept as the refusal itself, said in each visitor's language (texts review S2: the first visitor's sentence was
    # kept for every session)
    monkeypatch.setitem(ui.serving_run._dtype_costs, ("small", "cpu"), (rows, quality, [InputError("int8_no_kernels")]))
    at = click(open_page("vi"), "serving_start")
    html = "".join(h.proto.body for h in at.get("html"))
    assert ("<tr><td>float32</td><td>26,35</td><td>541,1</td><td>20,53</td><td>79%</td><td>34,332</td>"
            "<td>100,0%</td><td>0,00000</td></tr>") in html
    assert "<td>bfloat16</td><td>20,10</td><td>270,5</td>" in html and "<td>96,4%</td>" in html
    assert refused in captions(at) and any("911 token" in c and "192 token" in c for c in captions(at))


def test_the_dtype_table_says_how_many_scored_tokens_the_model_reads_as_unk(monkeypatch):
    """texts review S5: small's word-level vocabulary lacks most words of assets/quality/vi.txt, so the perplexity
    (277,649 there) is over <unk> mostly: the caption under the table says how many of the scored tokens are <unk>."""
    import ui.serving_run
    from model.serving.measure import DtypeCost
    from model.serving.quality import DtypeQuality, Quality, held_out

    small = load_model("small", "cpu")
    ids = small.tokenizer.encode(held_out(small.info.language).text).ids
    unk = ids[1:].count(small.tokenizer.unk_id)
    assert unk > len(ids) // 3
    rows = [DtypeCost("float32", 1.0, 1_000_000, 1.0, 277648.857, 1.0, 0.0)]
    quality = Quality("small", "assets/quality/vi.txt", len(ids) - 1, 1, 128, 4, 24,
                      [DtypeQuality("float32", 277648.857, 12.5, 96, 96, 0.0)])
    monkeypatch.setitem(ui.serving_run._dtype_costs, ("small", "cpu"), (rows, quality, []))
    pin_roofs(monkeypatch, {"float32": (26.0, 85.0)})
    for lang in ("vi", "en"):
        at = click(open_page(lang), "serving_start")
        said = text("serving.quality_unk", lang).format(unk=number(unk, lang), tokens=number(len(ids) - 1, lang))
        assert said in captions(at)


def test_the_machine_s_read_roof_is_measured_once_for_every_dtype(monkeypatch):
    """texts review S1: machine("cpu") and machine("cpu", "float32") were two cache keys, two measurements, and the
    page showed two different "read roofs of this machine, measured once" (13.3 and 14.0 GB/s)."""
    import ui.serving_run
    from model.serving import measure

    measured = []
    monkeypatch.setattr(measure, "measure_machine", lambda device: measured.append(device) or object())
    monkeypatch.setattr(measure, "with_matmul_peak", lambda roofs, dtype: roofs)
    ui.serving_run.machine.cache_clear()
    try:
        ui.serving_run.machine("cpu", "float32")
        ui.serving_run.machine("cpu", "bfloat16")
        assert len(measured) == 1
    finally:
        ui.serving_run.machine.cache_clear()


def amx_cpu(monkeypatch, amx: bool) -> None:
    """This CPU seen as one that lists AMX-BF16 (or not): the page's switch and lowbit's refusal read the flags."""
    import dataclasses

    import model.engine.kernels as kernels
    import model.engine.lowbit as lowbit

    real = kernels.cpu_features()
    seen = dataclasses.replace(real, amx_bf16=amx)
    monkeypatch.setattr(kernels, "cpu_features", lambda flags=None: seen)
    monkeypatch.setattr(lowbit, "cpu_features", lambda: seen)


@needs_kernels
def test_amx_tile_products_are_a_switch_the_page_says_is_not_bit_for_bit(monkeypatch):
    """On a CPU with AMX-BF16 the switch serves the queue with tile products and the page says which exactness holds
    (in the how expander too); switched off, the next Start is announced; without AMX the switch is disabled."""
    amx_cpu(monkeypatch, True)
    at = open_page("en", serving_tiles=True)
    click(at, "serving_start")
    click(at, "serving_run")
    server = at.session_state["serving_server"]
    from model.engine.llama import has_tile_products
    assert server.finished and has_tile_products(server.model.module) and not at.error
    said = text("serving.tiles_on", "en").format(rows=64, pool="")  # float32 weights: from 64 rows, no pool clause
    assert said in captions(at)
    assert text("serving.how_exact", "en") not in [m.value for m in at.markdown]
    at.toggle(key="serving_tiles").set_value(False).run()
    assert text("serving.tiles_next_run_off", "en") in captions(at)
    click(at, "serving_start")
    assert not has_tile_products(at.session_state["serving_server"].model.module)
    assert said not in captions(at)
    amx_cpu(monkeypatch, False)
    again = open_page("vi", serving_tiles=True)
    assert again.toggle(key="serving_tiles").disabled
    click(again, "serving_start")
    assert not has_tile_products(again.session_state["serving_server"].model.module)


def test_start_again_and_reset_let_the_runs_pool_go_at_once():
    """A new Start closes the run it replaces and Reset closes the run, their pools let go then (not at a garbage
    collection); red if either only drops the reference."""
    at = click(open_page("en"), "serving_start")
    first = at.session_state["serving_server"]
    assert first.cache.keys.numel() > 0
    click(at, "serving_start")
    second = at.session_state["serving_server"]
    assert second is not first and first.cache.keys.numel() == 0 and second.cache.keys.numel() > 0
    click(at, "serving_reset")
    assert at.session_state["serving_server"] is None and second.cache.keys.numel() == 0
