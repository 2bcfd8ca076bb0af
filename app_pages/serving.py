"""Serving: many requests decoded in one step, joining and leaving between steps; where each step's time goes
(bytes read and operations done against this machine's measured roofs); float32, bfloat16 and int8 weights;
the profiler's ops of one step. The engine's work is model/serving/."""

import tempfile
from pathlib import Path

import streamlit as st

from model.engine.kernels import machine_products
from model.engine.llama import is_packed
from model.engine.lowbit import DTYPES
from model.engine.sampling import SamplingSettings
from model.serving import analysis, measure, timing, workload
from model.serving.costs import matmul_params, positions_to_pass, weight_bytes
from model.serving.quality import held_out
from ui import svg
from ui.errors import callback_error_here, guarded, guarded_in_callback
from ui.i18n import decimal, number, t
from ui.models import page_start, shared_model_in
from ui.serving_run import (
    DTYPE_REPEATS,
    StopBar,
    cpu_sentences,
    dtype_context,
    kept_dtype_costs,
    machine,
    measure_dtype_costs,
    pass_costs,
    run_steps,
)
from ui.state import keep_across_pages
from ui.widgets import NEXT_KEY, table_html

# serving_wanted: what the last click asked for, run by this script where Stop reaches it ("one" step, or to the "end")
PAGE_DEFAULTS = {"serving_server": None, "serving_for": None, "serving_dtype": "float32", "serving_slots": 4,
                 "serving_requests": 8, "serving_prompt_lengths": (4, 24), "serving_new_tokens": (4, 16),
                 "serving_wanted": None, "serving_running": False, "serving_sweep": None,
                 "serving_profile": None, "serving_temperature": 0.0, "serving_top_k": 0, "serving_top_p": 1.0,
                 "serving_seed": 0}
SWEEP_BATCHES = (1, 2, 4, 8)
SWEEP_CONTEXTS = (64, 256)
PROFILE_STEPS = 3
PROFILE_CONTEXT = 64
SLOW_STEP_MS = 1000  # a queue whose first step or decode step should take longer is announced before Start

keep_across_pages(PAGE_DEFAULTS)

model = page_start("serving")
info = model.info
state = st.session_state
if state.serving_for != (info.name, info.device):
    state.serving_server, state.serving_sweep, state.serving_profile = None, None, None


def chosen_model():
    return shared_model_in(model, state.serving_dtype)


def sampling() -> SamplingSettings:
    """The queue's sampling settings; request i draws with seed serving_seed + i."""
    return SamplingSettings(float(state.serving_temperature), int(state.serving_top_k) or None,
                            float(state.serving_top_p), int(state.serving_seed))


def start() -> None:
    """A new run; its first step runs in the page's script, as every step does (a callback cannot be stopped)."""
    server = guarded_in_callback(lambda: workload.start_serving(
        chosen_model(), int(state.serving_slots), int(state.serving_requests),
        tuple(state.serving_prompt_lengths), tuple(state.serving_new_tokens), sampling()))
    if server is not None:
        state.serving_server, state.serving_for = server, (info.name, info.device)
        state.serving_profile, state.serving_wanted = None, "one"


def next_step() -> None:
    state.serving_wanted = "one"


def request_run() -> None:
    state.serving_wanted = "end"


def reset() -> None:
    state.serving_server, state.serving_wanted = None, None


# -- the settings ------------------------------------------------------------------------------------------------
# every pair the two sliders offer fits the model's context (a value past a slider's end would be replaced by its
# start, so the values are brought inside first)
most_prompt, most_new = workload.most_lengths(info.context_length)
state.serving_prompt_lengths = tuple(min(v, most_prompt) for v in state.serving_prompt_lengths)
state.serving_new_tokens = tuple(min(v, most_new) for v in state.serving_new_tokens)
with st.container(border=True, horizontal=True, vertical_alignment="bottom"):
    st.selectbox(t("serving.dtype"), DTYPES, key="serving_dtype", width=140,
                 help=t("serving.dtype_help"))
    st.slider(t("serving.slots"), 1, 32, key="serving_slots", width=200, help=t("serving.slots_help"))
    st.number_input(t("serving.requests"), min_value=1, max_value=64, key="serving_requests", width=140)
    st.slider(t("serving.prompt_lengths"), 1, most_prompt, key="serving_prompt_lengths", width=220)
    st.slider(t("serving.new_tokens"), 1, most_new, key="serving_new_tokens", width=200)
with st.container(border=True, horizontal=True, vertical_alignment="bottom"):
    st.slider(t("sampling.temperature"), 0.0, 2.0, step=0.05, key="serving_temperature", width=200,
              help=t("sampling.temperature_help"))
    st.number_input(t("serving.top_k"), min_value=0, max_value=1000, key="serving_top_k", width=140)
    st.slider(t("sampling.top_p"), 0.01, 1.0, step=0.01, key="serving_top_p", width=200, help=t("sampling.top_p_help"))
    st.number_input(t("sampling.seed"), min_value=0, max_value=2**31 - 1, key="serving_seed", width=140,
                    help=t("serving.seed_help"))

server = state.serving_server
if server is not None and server.info.dtype != state.serving_dtype:
    st.caption(t("serving.dtype_next_run", run=server.info.dtype, chosen=state.serving_dtype))
with st.spinner(t("serving.timing_passes", dtype=state.serving_dtype)):
    costs = guarded(lambda: pass_costs(chosen_model()))
if costs is not None:
    estimate = workload.estimate_steps(costs, int(state.serving_slots), int(state.serving_requests),
                                          tuple(state.serving_prompt_lengths), tuple(state.serving_new_tokens))
    if max(estimate.first_ms, estimate.decode_ms) > SLOW_STEP_MS:
        st.warning(t("serving.slow_steps", dtype=state.serving_dtype, first=decimal(estimate.first_ms / 1000),
                     prompts=estimate.prompts, positions=number(estimate.positions), rows=estimate.rows,
                     decode=decimal(estimate.decode_ms / 1000), probe=workload.PROBE_ROWS))

# -- the steps a click asked for: here, where a click on Stop (or anything else) reaches them -------------------------
wanted, state.serving_wanted = state.serving_wanted, None
stopped = state.serving_running and server is not None and not server.finished  # the last run was cut short
state.serving_running = False
if wanted is not None and server is not None and not server.finished:
    state.serving_running, stopped = True, False
    error = run_steps(server, to_end=wanted == "end")
    state.serving_running = False
    if error is not None:
        state.callback_error = error
with st.container(horizontal=True):
    st.button(t("serving.start"), key="serving_start", type="primary" if server is None else "secondary",
              icon=":material/play_arrow:", on_click=start)
    if server is not None:
        st.button(t("serving.next"), key="serving_next", type="primary", icon=":material/skip_next:",
                  disabled=server.finished, on_click=next_step, shortcut=NEXT_KEY)
        st.button(t("serving.run"), key="serving_run", icon=":material/fast_forward:", disabled=server.finished,
                  on_click=request_run)
        st.button(t("serving.reset"), key="serving_reset", icon=":material/restart_alt:", on_click=reset)
callback_error_here()
if server is None:
    st.info(t("serving.press_start"))
    st.stop()
if stopped:
    st.info(t("serving.stopped_in_step", step=len(server.steps), k=len(server.joining)) if server.joining
            else t("serving.stopped", steps=len(server.steps)))
if not server.steps:  # the first step was stopped or refused: nothing to draw yet
    st.stop()
run_model, run_info = server.model, server.info  # the run's own weights, whatever Weights says now

# -- the lanes: which request holds which slot -------------------------------------------------------------------
steps = server.steps
st.subheader(t("serving.lanes"))
st.html(svg.lane_chart_svg([s.slots for s in steps], [s.joined for s in steps], [s.left for s in steps],
                           t("serving.axis_step"), t("serving.axis_slot"), t("serving.lanes_alt")))
slots = len(server.holders)
st.caption(t("serving.lanes_caption", waiting=len(server.waiting)) if svg.lane_ids_written(slots)
           else t("serving.lanes_caption_no_ids", waiting=len(server.waiting), most=svg.LANE_IDS_MOST_SLOTS))

tokens = sum(s.tokens for s in steps)
last = steps[-1]
with st.container(horizontal=True):
    st.metric(t("serving.steps"), len(steps))
    st.metric(t("serving.tokens"), tokens)
    st.metric(t("serving.tokens_per_s"), decimal(tokens / (server.clock_ms / 1000)))
    st.metric(t("serving.last_step"), f"{decimal(last.ms)} ms", help=t("serving.last_step_help", rows=last.rows,
                                                                        prefill=decimal(last.prefill_ms),
                                                                        decode=decimal(last.decode_ms)))
st.html(svg.line_chart_svg(list(range(len(steps))), {t("serving.step_ms"): [s.ms for s in steps]},
                           t("serving.axis_step"), "ms", t("serving.step_ms"), number=lambda v: f"{v:g}"))


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


timings = analysis.request_timings(server)
st.html(table_html(
    [t("serving.col_request"), t("serving.col_prompt"), t("serving.col_tokens"), "TTFT ms", "ITL p50", "ITL p95",
     "ITL p99", t("serving.col_stop")],
    [[r.id, r.prompt_len, r.tokens, ms(r.ttft_ms), ms(r.itl_ms["p50"]), ms(r.itl_ms["p95"]), ms(r.itl_ms["p99"]),
      t("stop." + r.stop_reason) if r.stop_reason else t("serving.waiting" if r.tokens == 0 else "serving.running_req")]
     for r in timings]))
st.caption(t("serving.timing_note"))

# -- where the time goes: the roofline ---------------------------------------------------------------------------
st.subheader(t("serving.roofline"))
roofs = machine(run_info.device, run_info.dtype)
# the slanted roof is the read bandwidth: a step's counted bytes are reads (weights, cache), not copies
ridge = roofs.matmul_gflops / roofs.read_gb_s  # FLOPs per byte where the slanted roof meets the flat one
points = analysis.roofline_points(server)
st.html(svg.roofline_svg([(p.label, p.intensity, p.gflops) for p in points], roofs.read_gb_s, roofs.matmul_gflops,
                         t("serving.axis_intensity"), "GFLOP/s", t("serving.roofline_alt")))
product = (t("serving.product_int8", rows=timing.INT8_PEAK_ROWS) if roofs.dtype == "int8"
           else t("serving.product", dtype=roofs.dtype))
st.caption(t("serving.machine", gb_s=decimal(roofs.read_gb_s), copy=decimal(roofs.copy_gb_s), product=product,
             gflops=decimal(roofs.matmul_gflops), threads=roofs.threads, device=roofs.device))
module = run_model.module
head = module.lm_head.in_features * module.lm_head.out_features
st.markdown(t("serving.formulas", weights=number(weight_bytes(module, 1)), kv=number(run_info.cache_bytes_formula(1)),
              params=number(matmul_params(module) - head), head=number(head), layers=run_info.n_layers,
              heads=run_info.n_heads, d_head=run_info.d_head))
if run_info.window is not None:
    sliding = len(run_info.sliding_layers)
    st.markdown(t("serving.formulas_sliding", full=run_info.n_layers - sliding, sliding=sliding,
                  window=run_info.window,
                  per_layer=number(2 * run_info.n_kv_heads * run_info.d_head * run_info.bytes_per_element)))
st.html(table_html(
    [t("serving.col_point"), "ms", t("serving.col_intensity"), "GB/s", t("serving.col_of_bandwidth"), "GFLOP/s",
     t("serving.col_of_peak")],
    [[p.label, f"{p.ms:.2f}", f"{p.intensity:.2f}", f"{p.gb_s:.2f}", f"{p.gb_s / roofs.read_gb_s:.0%}",
      f"{p.gflops:.2f}", f"{p.gflops / roofs.matmul_gflops:.0%}"] for p in points]))
decodes = [p for p in points if p.rows is not None]  # one per batch size, fewest rows first
decode_memory_bound = bool(decodes) and decodes[0].intensity < ridge
if decodes:
    st.caption(t("serving.roofline_note" if decode_memory_bound else "serving.roofline_note_compute",
                 rows=decodes[0].rows, i=decimal(decodes[0].intensity, 2), ridge=decimal(ridge, 2)))
if len(decodes) > 1:
    fewest, most = decodes[0], decodes[-1]
    st.caption(t("serving.rows_scaling", small=fewest.rows, big=most.rows, ratio=decimal(most.ms / fewest.ms, 2)))
longest = analysis.longest_prefill(server)
if longest is not None:
    said = dict(n=number(longest.positions), i=decimal(longest.intensity, 2), ridge=decimal(ridge, 2))
    passes = longest.intensity >= ridge
    if passes:
        st.caption(t("serving.prefill_compute_bound", **said))
    else:
        # a binary search over the context by the counting formulas (~50 ms on gemma3): once per run and roof
        if state.get("serving_ridge_positions", (None,))[:2] != (server, ridge):
            state.serving_ridge_positions = (server, ridge, positions_to_pass(run_model, ridge))
        cross = state.serving_ridge_positions[2]
        passes = cross is not None
        st.caption(t("serving.prefill_memory_bound", cross=number(cross), **said) if passes
                   else t("serving.prefill_never_passes", context=number(run_info.context_length), **said))
    if passes and decode_memory_bound:  # a prefill can be compute-bound where a small decode step is memory-bound
        st.caption(t("serving.two_designs"))

# -- fewer bits: each dtype's step and accuracy ----------------------------------------------------------------
st.subheader(t("serving.dtypes"))
if st.button(t("serving.measure_dtypes"), key="serving_measure_dtypes", icon=":material/compare_arrows:"):
    dtypes_bar = StopBar("serving_dtypes_stop", t("serving.measuring"))
    guarded(lambda: measure_dtype_costs(model, lambda done: dtypes_bar.draw(done, t("serving.measuring"))))
    dtypes_bar.clear()
kept = kept_dtype_costs(model)
if kept is None:
    st.caption(t("serving.dtypes_help"))
else:
    costs, quality, refused = kept
    read_roof = machine(info.device).read_gb_s
    st.html(table_html(
        [t("serving.col_dtype"), t("serving.col_step_b1"), t("serving.col_mb_read"), "GB/s", t("serving.col_of_read"),
         t("serving.col_perplexity"), t("serving.col_agreement"), t("serving.col_kl")],
        [[c.dtype, decimal(c.step_ms, 2), decimal(c.bytes_read / 1e6, 1), decimal(c.gb_s, 2),
          f"{c.gb_s / read_roof:.0%}", decimal(c.perplexity, 3), f"{decimal(100 * c.greedy_agreement)}%",
          decimal(c.mean_kl, 5)]
         for c in costs]))
    for sentence in refused:
        st.caption(sentence)
    st.caption(t("serving.dtypes_note", repeats=DTYPE_REPEATS, context=number(dtype_context(model)),
                 read=decimal(read_roof), tokens=number(quality.tokens), text=quality.text,
                 title=held_out(info.language).title, greedy=number(quality.rows[0].greedy_total),
                 prompts=quality.prompts))
if info.device == "cpu":
    st.caption(" ".join(cpu_sentences(machine_products())))

# -- ITL and throughput against B and context length -------------------------------------------------------------
st.subheader(t("serving.sweep"))
contexts = [c for c in SWEEP_CONTEXTS if c < run_info.context_length] or [run_info.context_length // 2]
if st.button(t("serving.measure_sweep"), key="serving_measure", icon=":material/timer:"):
    sweep_bar = StopBar("serving_measure_stop", t("serving.measuring"))
    measured = guarded(lambda: measure.sweep(
        run_model, list(SWEEP_BATCHES), contexts, report=lambda done, total, batch, context: sweep_bar.draw(
            done / total, t("serving.sweep_progress", batch=batch, n=number(context), k=done + 1, total=total))))
    sweep_bar.clear()
    if measured is not None:
        state.serving_sweep = (run_info.dtype, measured)
if state.serving_sweep is not None:
    sweep_dtype, sweep = state.serving_sweep
    label = t("serving.context_label")
    charts = [svg.line_chart_svg(list(SWEEP_BATCHES), {label.format(n=c): [w.p50 for w in works]
                                                       for c, works in sweep.items()},
                                 "B", t("serving.itl_ms"), t("serving.itl_ms"), number=lambda v: f"{v:g}"),
              svg.line_chart_svg(list(SWEEP_BATCHES), {label.format(n=c): [w.tokens_per_s for w in works]
                                                       for c, works in sweep.items()},
                                 "B", t("serving.tokens_per_s"), t("serving.tokens_per_s"),
                                 number=lambda v: f"{v:g}")]
    st.html(f'<div class="dl-grid"><div>{charts[0]}</div><div>{charts[1]}</div></div>')
    st.caption(t("serving.sweep_note", dtype=sweep_dtype, repeats=5))
else:
    listed = [number(c) for c in contexts]
    st.caption(t("serving.sweep_help", dtype=run_info.dtype, contexts=listed[0] if len(listed) == 1
                 else t("serving.and", a=listed[0], b=listed[1])))

# -- the profiler: the ops of one step ---------------------------------------------------------------------------
st.subheader(t("serving.profile"))
if st.button(t("serving.run_profile"), key="serving_profile_button", icon=":material/query_stats:"):
    profile_bar = StopBar("serving_profile_stop", t("serving.measuring"))
    ticks = [0, 2 * run_info.n_layers + PROFILE_STEPS]  # done, and the prefill's and warm-up's layers + the steps

    def tick() -> None:
        ticks[0] += 1
        profile_bar.draw(ticks[0] / ticks[1], t("serving.measuring"))

    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        context = min(PROFILE_CONTEXT, run_info.context_length // 2)
        ops = guarded(lambda: measure.profile_steps(run_model, max(1, last.rows), context, PROFILE_STEPS,
                                                        str(trace), tick))
        if ops is not None:
            state.serving_profile = (ops, trace.read_bytes(), max(1, last.rows))
    profile_bar.clear()
if state.serving_profile is not None:
    ops, trace_bytes, rows = state.serving_profile
    on_device = ops[0].clock == "device"
    st.html(table_html([t("serving.col_op"), t("serving.col_ms_device" if on_device else "serving.col_ms"),
                        t("serving.col_share"), t("serving.col_calls")],
                       [[op.name, f"{op.ms_per_step:.3f}", f"{op.share:.0%}", f"{op.calls_per_step:.0f}"]
                        for op in ops]))
    st.caption(t("serving.profile_note_device" if on_device else "serving.profile_note", steps=PROFILE_STEPS,
                 rows=rows))
    st.download_button(t("serving.download_trace"), data=trace_bytes, file_name="decode-lab-step-trace.json",
                       mime="application/json", key="serving_trace_download", on_click="ignore")
else:
    st.caption(t("serving.profile_help"))
with st.expander(t("serving.how")):
    st.markdown(t("serving.how_text"))
    st.markdown(t("serving.how_exact" if is_packed(module) else "serving.how_not_exact"))
