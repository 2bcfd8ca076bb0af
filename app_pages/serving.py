"""Serving: many requests decoded in one step, joining and leaving between steps; where each step's time goes
(bytes read and operations done against this machine's measured roofs); float32, bfloat16 and int8 weights;
the profiler's ops of one step. The engine's work is model/serving/."""

import streamlit as st

from model.engine.kernels import machine_products
from model.engine.llama import has_tile_products, is_packed
from model.engine.lowbit import DTYPES, tile_rows
from model.engine.sampling import SamplingSettings
from model.serving import analysis, timing, workload
from model.serving.costs import matmul_params, positions_to_pass, weight_bytes
from ui import serving_views as views
from ui import svg
from ui.classroom import key_figure, settings, why
from ui.controls import decimal_slider
from ui.errors import callback_error_here, guarded, guarded_in_callback
from ui.i18n import decimal, number, t
from ui.models import page_start, shared_model_in
from ui.serving_panel import counts_row, run_sentences, step_time_chart, time_split_table
from ui.serving_run import asked_steps, machine, pass_costs, run_buttons, run_steps
from ui.session_end import hold
from ui.state import keep_across_pages
from ui.widgets import table_html

# serving_wanted: what the last click asked for, run by this script where Stop reaches it ("one" step, or to the "end")
PAGE_DEFAULTS = {"serving_server": None, "serving_for": None, "serving_dtype": "float32", "serving_slots": 4,
                 "serving_requests": 8, "serving_prompt_lengths": (4, 24), "serving_new_tokens": (4, 16),
                 "serving_wanted": None, "serving_running": False, "serving_sweep": None,
                 "serving_profile": None, "serving_temperature": 0.0, "serving_top_k": 0, "serving_top_p": 1.0,
                 "serving_seed": 0, "serving_opened_for": None, "serving_tiles": False}
SWEEP_BATCHES = (1, 2, 4, 8)
SWEEP_CONTEXTS = (64, 256)
PROFILE_STEPS = 3
PROFILE_CONTEXT = 64
SLOW_STEP_MS = 1000  # a queue whose first step or decode step should take longer is announced before Start

keep_across_pages(PAGE_DEFAULTS)

model = page_start("serving")
info = model.info
state = st.session_state


def drop_server() -> None:
    """The run ends: its pool let go now, not at a garbage collection."""
    if state.serving_server is not None:
        state.serving_server.close()
    state.serving_server = None


if state.serving_for != (info.name, info.device):
    drop_server()
    state.serving_sweep, state.serving_profile = None, None


# tile products (model/engine/lowbit.py): on a CPU that lists AMX-BF16, for the kernels' float32 or bfloat16 weights
tiles_offered = bool(machine_products().cpu.amx_bf16) and is_packed(model.module)


def tiles_chosen() -> bool:
    return bool(state.serving_tiles) and tiles_offered and state.serving_dtype != "int8"


def chosen_model():
    return shared_model_in(model, state.serving_dtype, tiles_chosen())


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
        drop_server()
        hold(server)  # closed with the session too
        state.serving_server, state.serving_for = server, (info.name, info.device)
        state.serving_profile, state.serving_wanted = None, "one"


def reset() -> None:
    drop_server()
    state.serving_wanted = None


# -- the settings ------------------------------------------------------------------------------------------------
# every pair the two sliders offer fits the model's context (a value past a slider's end would be replaced by its
# start, so the values are brought inside first)
most_prompt, most_new = workload.most_lengths(info.context_length)
state.serving_prompt_lengths = tuple(min(v, most_prompt) for v in state.serving_prompt_lengths)
state.serving_new_tokens = tuple(min(v, most_new) for v in state.serving_new_tokens)
with settings("serving"):
    with st.container(horizontal=True, vertical_alignment="bottom"):
        st.selectbox(t("serving.dtype"), DTYPES, key="serving_dtype", width=140, help=t("serving.dtype_help"))
        st.toggle(t("serving.tiles"), key="serving_tiles", disabled=not tiles_offered or state.serving_dtype == "int8",
                  help=t("serving.tiles_help" if tiles_offered else "serving.tiles_unavailable"))
        st.slider(t("serving.slots"), 1, 32, key="serving_slots", width=200, help=t("serving.slots_help"))
        st.number_input(t("serving.requests"), min_value=1, max_value=64, key="serving_requests", width=140)
        st.slider(t("serving.prompt_lengths"), 1, most_prompt, key="serving_prompt_lengths", width=220)
        st.slider(t("serving.new_tokens"), 1, most_new, key="serving_new_tokens", width=200)
    with st.container(horizontal=True, vertical_alignment="bottom"):
        decimal_slider(t("sampling.temperature"), 0.0, 2.0, 0.05, key="serving_temperature", width=200,
                       help=t("sampling.temperature_help"))
        st.number_input(t("serving.top_k"), min_value=0, max_value=1000, key="serving_top_k", width=140)
        decimal_slider(t("sampling.top_p"), 0.01, 1.0, 0.01, key="serving_top_p", width=200,
                       help=t("sampling.top_p_help"))
        st.number_input(t("sampling.seed"), min_value=0, max_value=2**31 - 1, key="serving_seed", width=140,
                        help=t("serving.seed_help"))

server = state.serving_server
if server is not None and server.info.dtype != state.serving_dtype:
    st.caption(t("serving.dtype_next_run", run=server.info.dtype, chosen=state.serving_dtype))
if server is not None and has_tile_products(server.model.module) != tiles_chosen():
    st.caption(t("serving.tiles_next_run_on" if tiles_chosen() else "serving.tiles_next_run_off"))
with st.spinner(t("serving.timing_passes", dtype=state.serving_dtype)):
    costs = guarded(lambda: pass_costs(chosen_model()))
slow = True
if costs is not None:
    estimate = workload.estimate_steps(costs, int(state.serving_slots), int(state.serving_requests),
                                          tuple(state.serving_prompt_lengths), tuple(state.serving_new_tokens))
    slow = max(estimate.first_ms, estimate.decode_ms) > SLOW_STEP_MS
    if slow:
        st.warning(t("serving.slow_steps", dtype=state.serving_dtype, first=decimal(estimate.first_ms / 1000),
                     prompts=estimate.prompts, positions=number(estimate.positions), rows=estimate.rows,
                     decode=decimal(estimate.decode_ms / 1000), probe=workload.PROBE_ROWS))
# the first visit with this model opens on a run of the settings shown, its first step made, where that is quick
if server is None and state.serving_opened_for != (info.name, info.device):
    state.serving_opened_for = (info.name, info.device)
    if not slow:
        start()
        server = state.serving_server

# -- the steps a click asked for: here, where a click on Stop (or anything else) reaches them -------------------------
_, stopped = asked_steps("serving", server, lambda to_end: run_steps(server, to_end))
run_buttons("serving", server, "action.start", start, reset, run_key="serving_run", play=True)
callback_error_here()
if server is None:
    st.info(t("serving.press_start"))
    st.stop()
run_sentences(t("serving.stopped", steps=len(server.steps)) if stopped else None, False)
if not server.steps:  # the first step was stopped or refused: nothing to draw yet
    st.stop()
run_model, run_info = server.model, server.info  # the run's own weights, whatever Weights says now
tiled = has_tile_products(run_model.module)
tiles_said = tiled and t("serving.tiles_on", rows=tile_rows(run_info.dtype),
                         pool=t("serving.tiles_on_pool") if run_info.dtype == "bfloat16" else "")

# -- the lanes: which request holds which slot, the page's key figure -------------------------------------------
steps = server.steps
slots = server.slots
with key_figure():
    st.subheader(t("serving.lanes"))
    st.html(svg.lane_chart_svg([s.slots for s in steps], [s.admitted for s in steps], [s.left for s in steps],
                               t("serving.lanes_axis_step"), t("serving.axis_slot"), t("serving.lanes_alt")))
    views.lane_legend(sorted({r for s in steps for r in s.slots if r is not None}), len(server.waiting))
with why("serving-lanes"):
    st.caption(t("serving.lanes_caption", waiting=len(server.waiting)) if svg.lane_ids_written(slots)
               else t("serving.lanes_caption_no_ids", waiting=len(server.waiting), most=svg.LANE_IDS_MOST_SLOTS))

if tiled:  # under the lanes, the page's key figure: which exactness holds for this run
    st.caption(tiles_said)
tokens = sum(s.tokens for s in steps)
last = steps[-1]
last_rows = sum(len(p.spans) for p in last.passes if p.kind == "decode")  # the last step's decode batch
counts_row([(t("serving.steps"), len(steps)), (t("serving.tokens"), tokens),
            (t("serving.tokens_per_s"), decimal(tokens / (server.clock_ms / 1000))),
            (t("serving.last_step"), f"{decimal(last.ms)} ms", t(
                "serving.last_step_help", rows=last_rows,
                prefill=decimal(sum(p.ms for p in last.passes if p.kind == "prefill")),
                decode=decimal(sum(p.ms for p in last.passes if p.kind == "decode"))))])
step_time_chart([s.ms for s in steps], t("serving.step_ms"))


def ms(value: float | None) -> str:
    return "—" if value is None else decimal(value)


timings = analysis.request_timings(server)
st.html(table_html(
    [t("serving.col_request"), t("serving.col_prompt"), t("serving.col_tokens"), "TTFT ms", "ITL p50", "ITL p95",
     "ITL p99", t("serving.col_stop")],
    [[r.id, r.prompt_len, r.tokens, ms(r.ttft_ms), ms(r.itl_ms["p50"]), ms(r.itl_ms["p95"]), ms(r.itl_ms["p99"]),
      t("stop." + r.stop_reason) if r.stop_reason else t("serving.waiting" if r.tokens == 0 else "serving.running_req")]
     for r in timings]))
with why("serving-timing"):
    st.markdown(t("serving.ttft_itl"))
    st.caption(t("serving.timing_note"))

# -- where the time goes: the roofline ---------------------------------------------------------------------------
st.subheader(t("serving.roofline"))
# bfloat16-weights off the kernels is float32 on torch's product, over rounded weights
packed = is_packed(run_model.module)
roofs = machine(run_info.device, run_info.dtype if packed or run_info.dtype != "bfloat16-weights" else "float32")
# the slanted roof is the read bandwidth: a step's counted bytes are reads (weights, cache), not copies
ridge = roofs.matmul_gflops / roofs.read_gb_s  # FLOPs per byte where the slanted roof meets the flat one
points = analysis.roofline_points(server)
st.html(svg.roofline_svg([(p.label, p.intensity, p.gflops) for p in points], roofs.read_gb_s, roofs.matmul_gflops,
                         t("serving.axis_intensity"), "GFLOP/s", t("serving.roofline_alt")))
product = (t("serving.product_" + roofs.dtype.replace("-", "_"), rows=timing.KERNEL_PEAK_ROWS)
           if roofs.dtype in timing.KERNEL_PEAKS else t("serving.product", dtype=roofs.dtype))
# the flat roof is torch's product, save the kernels' own peaks: a run whose products are the kernels' is told so
st.caption(t("serving.machine", gb_s=decimal(roofs.read_gb_s), copy=decimal(roofs.copy_gb_s), product=product,
             gflops=decimal(roofs.matmul_gflops), threads=roofs.threads, device=roofs.device)
           + (" " + t("serving.roof_torch")
              if roofs.dtype not in timing.KERNEL_PEAKS and packed and not tiled else ""))
if tiled:  # its small passes in the kernels, its large ones on the tiles
    st.caption(t("serving.roof_tiles", rows=tile_rows(run_info.dtype),
                 gflops=decimal(machine(run_info.device, "bfloat16").matmul_gflops)))
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
    [[p.label, decimal(p.ms, 2), decimal(p.intensity, 2), decimal(p.gb_s, 2), f"{p.gb_s / roofs.read_gb_s:.0%}",
      decimal(p.gflops, 2), f"{p.gflops / roofs.matmul_gflops:.0%}"] for p in points]))
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
    read = f"{longest.bytes_read / (longest.ms / 1000) / 1e9 / roofs.read_gb_s:.0%}"  # of the read roof
    passes = longest.intensity >= ridge
    if passes:
        st.caption(t("serving.prefill_compute_bound", **said))
    else:
        # a binary search over the context by the counting formulas (~50 ms on gemma3): once per run and roof
        if state.get("serving_ridge_positions", (None,))[:2] != (server, ridge):
            state.serving_ridge_positions = (server, ridge, positions_to_pass(run_model, ridge))
        cross = state.serving_ridge_positions[2]
        passes = cross is not None
        st.caption(t("serving.prefill_memory_bound", cross=number(cross), share=read, **said) if passes
                   else t("serving.prefill_never_passes", context=number(run_info.context_length), share=read,
                          **said))
    if passes and decode_memory_bound:  # a prefill can be compute-bound where a small decode step is memory-bound
        st.caption(t("serving.two_designs"))
time_split_table(steps)

# -- fewer bits, B and context, the profiler: measured on a click each -------------------------------------------
views.dtype_table(model)
views.sweep(run_model, SWEEP_BATCHES, SWEEP_CONTEXTS)
views.profile(run_model, PROFILE_STEPS, PROFILE_CONTEXT, max(1, last_rows))
with st.expander(t("serving.how")):
    st.markdown(t("serving.how_text"))
    exact = "serving.how_exact_gemma" if module.architecture == "gemma3_text" else "serving.how_exact"
    st.markdown(tiles_said if tiled else t(exact if is_packed(module) else "serving.how_not_exact"))
