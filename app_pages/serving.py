"""Serving: many requests decoded in one step, joining and leaving between steps; where each step's time goes
(bytes read and operations done against this machine's measured roofs); float32, bfloat16 and int8 weights;
the profiler's ops of one step. The engine's work is model/engine/batch.py and model/tools/serve_bench.py."""

import tempfile
from pathlib import Path

import streamlit as st

from model.engine.batch import matmul_params, weight_bytes
from model.engine.lowbit import DTYPES
from model.engine.sampling import SamplingSettings
from model.tools import serve_bench
from ui import svg
from ui.i18n import number, t
from ui.session import callback_error_here, guarded, guarded_in_callback, machine, page_start, shared_model_in
from ui.state import keep_across_pages
from ui.widgets import NEXT_KEY, table_html

PAGE_DEFAULTS = {"serving_server": None, "serving_for": None, "serving_dtype": "float32", "serving_slots": 4,
                 "serving_requests": 8, "serving_prompt_lengths": (4, 24), "serving_new_tokens": (4, 16),
                 "serving_run_requested": False, "serving_running": False, "serving_sweep": None,
                 "serving_profile": None, "serving_temperature": 0.0, "serving_top_k": 0, "serving_top_p": 1.0,
                 "serving_seed": 0}
SWEEP_BATCHES = (1, 2, 4, 8)
SWEEP_CONTEXTS = (64, 256)
PROFILE_STEPS = 3
PROFILE_CONTEXT = 64

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
    server = guarded_in_callback(lambda: serve_bench.start_serving(
        chosen_model(), int(state.serving_slots), int(state.serving_requests),
        tuple(state.serving_prompt_lengths), tuple(state.serving_new_tokens), sampling()))
    if server is not None:
        state.serving_server, state.serving_for = server, (info.name, info.device)
        state.serving_profile = None
        guarded_in_callback(server.step)


def next_step() -> None:
    guarded_in_callback(state.serving_server.step)


def request_run() -> None:
    state.serving_run_requested = True


def reset() -> None:
    state.serving_server = None


# -- the settings ------------------------------------------------------------------------------------------------
most_prompt = max(2, min(256, info.context_length // 2))
state.serving_prompt_lengths = tuple(min(v, most_prompt) for v in state.serving_prompt_lengths)
with st.container(border=True, horizontal=True, vertical_alignment="bottom"):
    st.selectbox(t("serving.dtype"), DTYPES, key="serving_dtype", width=140,
                 help=t("serving.dtype_help"))
    st.slider(t("serving.slots"), 1, 32, key="serving_slots", width=200, help=t("serving.slots_help"))
    st.number_input(t("serving.requests"), min_value=1, max_value=64, key="serving_requests", width=140)
    st.slider(t("serving.prompt_lengths"), 1, most_prompt, key="serving_prompt_lengths", width=220)
    st.slider(t("serving.new_tokens"), 1, 64, key="serving_new_tokens", width=200)
with st.container(border=True, horizontal=True, vertical_alignment="bottom"):
    st.slider(t("sampling.temperature"), 0.0, 2.0, step=0.05, key="serving_temperature", width=200,
              help=t("sampling.temperature_help"))
    st.number_input(t("serving.top_k"), min_value=0, max_value=1000, key="serving_top_k", width=140)
    st.slider(t("sampling.top_p"), 0.01, 1.0, step=0.01, key="serving_top_p", width=200, help=t("sampling.top_p_help"))
    st.number_input(t("sampling.seed"), min_value=0, key="serving_seed", width=140, help=t("serving.seed_help"))

server = state.serving_server
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
if state.serving_running and not server.finished:  # a click stopped the last Run between two steps
    st.info(t("serving.stopped", steps=len(server.steps)))
state.serving_running = False
if state.serving_run_requested:
    # a whole-page run, as the Decode page's Run to end: a click on Stop (outside any fragment) ends it between steps
    state.serving_run_requested, state.serving_running = False, True
    st.button(t("decode.stop"), key="serving_stop", type="primary", icon=":material/stop:")
    bar = st.progress(0.0, text=t("serving.running"))
    total = len(server.requests)
    while not server.finished and guarded(server.step) is not None:
        done = sum(r.left_step is not None for r in server.requests.values())
        bar.progress(done / total, text=t("serving.running"))
    state.serving_running = False
    st.rerun()

# -- the lanes: which request holds which slot -------------------------------------------------------------------
steps = server.steps
st.subheader(t("serving.lanes"))
st.html(svg.lane_chart_svg([s.slots for s in steps], [s.joined for s in steps], [s.left for s in steps],
                           t("serving.axis_step"), t("serving.axis_slot"), t("serving.lanes_alt")))
st.caption(t("serving.lanes_caption", waiting=len(server.waiting)))

tokens = sum(s.tokens for s in steps)
last = steps[-1]
with st.container(horizontal=True):
    st.metric(t("serving.steps"), len(steps))
    st.metric(t("serving.tokens"), tokens)
    st.metric(t("serving.tokens_per_s"), f"{tokens / (server.clock_ms / 1000):,.1f}")
    st.metric(t("serving.last_step"), f"{last.ms:.1f} ms", help=t("serving.last_step_help", rows=last.rows,
                                                                   prefill=f"{last.prefill_ms:.1f}",
                                                                   decode=f"{last.decode_ms:.1f}"))
st.html(svg.line_chart_svg(list(range(len(steps))), {t("serving.step_ms"): [s.ms for s in steps]},
                           t("serving.axis_step"), "ms", t("serving.step_ms"), number=lambda v: f"{v:g}"))


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


timings = serve_bench.request_timings(server)
st.html(table_html(
    [t("serving.col_request"), t("serving.col_prompt"), t("serving.col_tokens"), "TTFT ms", "ITL p50", "ITL p95",
     "ITL p99", t("serving.col_stop")],
    [[r.id, r.prompt_len, r.tokens, ms(r.ttft_ms), ms(r.itl_ms["p50"]), ms(r.itl_ms["p95"]), ms(r.itl_ms["p99"]),
      t("stop." + r.stop_reason) if r.stop_reason else t("serving.waiting" if r.tokens == 0 else "serving.running_req")]
     for r in timings]))
st.caption(t("serving.timing_note"))

# -- where the time goes: the roofline ---------------------------------------------------------------------------
st.subheader(t("serving.roofline"))
roofs = machine(info.device)
points = serve_bench.roofline_points(server)
st.html(svg.roofline_svg([(p.label, p.intensity, p.gflops) for p in points], roofs.copy_gb_s, roofs.matmul_gflops,
                         t("serving.axis_intensity"), "GFLOP/s", t("serving.roofline_alt")))
st.caption(t("serving.machine", gb_s=f"{roofs.copy_gb_s:.1f}", gflops=f"{roofs.matmul_gflops:.1f}",
             threads=roofs.threads, device=roofs.device))
module = chosen_model().module
head = module.lm_head.in_features * module.lm_head.out_features
st.markdown(t("serving.formulas", weights=number(weight_bytes(module, 1)), kv=number(info.cache_bytes_formula(1)),
              params=number(matmul_params(module) - head), head=number(head), layers=info.n_layers,
              heads=info.n_heads, d_head=info.d_head))
if info.window is not None:
    sliding = len(info.sliding_layers)
    st.markdown(t("serving.formulas_sliding", full=info.n_layers - sliding, sliding=sliding, window=info.window,
                  per_layer=number(2 * info.n_kv_heads * info.d_head * info.bytes_per_element)))
st.html(table_html(
    [t("serving.col_point"), "ms", t("serving.col_intensity"), "GB/s", t("serving.col_of_bandwidth"), "GFLOP/s",
     t("serving.col_of_peak")],
    [[p.label, f"{p.ms:.2f}", f"{p.intensity:.2f}", f"{p.gb_s:.2f}", f"{p.gb_s / roofs.copy_gb_s:.0%}",
      f"{p.gflops:.2f}", f"{p.gflops / roofs.matmul_gflops:.0%}"] for p in points]))
st.caption(t("serving.roofline_note"))
decodes = [p for p in points if p.rows is not None]  # one per batch size, fewest rows first
if len(decodes) > 1:
    fewest, most = decodes[0], decodes[-1]
    st.caption(t("serving.rows_scaling", small=fewest.rows, big=most.rows, ratio=f"{most.ms / fewest.ms:.2f}",
                 rows=f"{most.rows / fewest.rows:.3g}"))
longest = serve_bench.longest_prefill(server)
if longest is not None:
    ridge = roofs.matmul_gflops / roofs.copy_gb_s  # FLOPs per byte where the slanted roof meets the flat one
    intensity = longest.prefill_flops / longest.prefill_bytes
    said = dict(n=longest.prefill_tokens, i=f"{intensity:.1f}", ridge=f"{ridge:.1f}")
    if intensity >= ridge:
        st.caption(t("serving.prefill_compute_bound", **said))
    else:
        # a binary search over the context by the counting formulas (~50 ms on gemma3): once per run, not per rerun
        if state.get("serving_ridge_positions", (None,))[0] is not server:
            state.serving_ridge_positions = (server, serve_bench.positions_to_pass(server.model, ridge))
        cross = state.serving_ridge_positions[1]
        st.caption(t("serving.prefill_memory_bound", cross=number(cross), **said) if cross is not None
                   else t("serving.prefill_never_passes", context=number(info.context_length), **said))

# -- ITL and throughput against B and context length -------------------------------------------------------------
st.subheader(t("serving.sweep"))
contexts = [c for c in SWEEP_CONTEXTS if c < info.context_length] or [info.context_length // 2]
if st.button(t("serving.measure_sweep"), key="serving_measure", icon=":material/timer:"):
    with st.spinner(t("serving.measuring")):
        state.serving_sweep = guarded(lambda: serve_bench.sweep(chosen_model(), list(SWEEP_BATCHES), contexts))
if state.serving_sweep is not None:
    sweep = state.serving_sweep
    label = t("serving.context_label")
    charts = [svg.line_chart_svg(list(SWEEP_BATCHES), {label.format(n=c): [w.p50 for w in works]
                                                       for c, works in sweep.items()},
                                 "B", t("serving.itl_ms"), t("serving.itl_ms"), number=lambda v: f"{v:g}"),
              svg.line_chart_svg(list(SWEEP_BATCHES), {label.format(n=c): [w.tokens_per_s for w in works]
                                                       for c, works in sweep.items()},
                                 "B", t("serving.tokens_per_s"), t("serving.tokens_per_s"),
                                 number=lambda v: f"{v:g}")]
    st.html(f'<div class="dl-grid"><div>{charts[0]}</div><div>{charts[1]}</div></div>')
    st.caption(t("serving.sweep_note", dtype=state.serving_dtype, repeats=5))
else:
    st.caption(t("serving.sweep_help"))

# -- the profiler: the ops of one step ---------------------------------------------------------------------------
st.subheader(t("serving.profile"))
if st.button(t("serving.run_profile"), key="serving_profile_button", icon=":material/query_stats:"):
    with st.spinner(t("serving.measuring")), tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        context = min(PROFILE_CONTEXT, info.context_length // 2)
        ops = guarded(lambda: serve_bench.profile_steps(chosen_model(), max(1, last.rows), context, PROFILE_STEPS,
                                                        str(trace)))
        if ops is not None:
            state.serving_profile = (ops, trace.read_bytes(), max(1, last.rows))
if state.serving_profile is not None:
    ops, trace_bytes, rows = state.serving_profile
    st.html(table_html([t("serving.col_op"), t("serving.col_ms"), t("serving.col_share"), t("serving.col_calls")],
                       [[op.name, f"{op.ms_per_step:.3f}", f"{op.share:.0%}", f"{op.calls_per_step:.0f}"]
                        for op in ops]))
    st.caption(t("serving.profile_note", steps=PROFILE_STEPS, rows=rows))
    st.download_button(t("serving.download_trace"), data=trace_bytes, file_name="decode-lab-step-trace.json",
                       mime="application/json", key="serving_trace_download", on_click="ignore")
else:
    st.caption(t("serving.profile_help"))
with st.expander(t("serving.how")):
    st.markdown(t("serving.how_text"))
