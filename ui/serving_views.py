"""The Serving page's three measurements on a click: each dtype's step and accuracy, ITL and tokens/s by B and
context, the profiler's ops of one step. Each draws its button, runs under a Stop bar, and keeps what it measured."""

import tempfile
from html import escape
from pathlib import Path

import streamlit as st

from model.engine.kernels import PROFILED, machine_products
from model.engine.runtime import LoadedModel
from model.serving import measure
from model.serving.quality import held_out, unknown_tokens
from ui import serving_run as run  # by the module: a test pins its machine's roofs there
from ui import svg
from ui.errors import error_sentence, guarded
from ui.i18n import decimal, number, t
from ui.widgets import table_html


def lane_legend(requests: list[int], waiting: int) -> None:
    """The lane chart's key: each request's colour with its number, the bar where a request leaves, a free slot, and
    how many requests wait for one."""
    chips = "".join(f'<span class="dl-lane-key" style="background:{svg.lane_colour(r)};color:'
                    f'{"#fff" if r % len(svg.LANE_COLOURS) in svg.DARK_LANES else svg.INK}">{r}</span>'
                    for r in requests)
    st.html(f'<div class="dl-lane-legend"><span>{escape(t("serving.legend_requests"))}</span>{chips}'
            f'<span><span class="dl-lane-key dl-lane-left"></span>{escape(t("serving.legend_left"))}</span>'
            f'<span><span class="dl-lane-key dl-lane-free"></span>{escape(t("serving.legend_free"))}</span>'
            f'<span>{escape(t("serving.legend_waiting", waiting=waiting))}</span></div>' + LEGEND_CSS)


LEGEND_CSS = """<style>
.dl-lane-legend{display:flex;flex-wrap:wrap;gap:.35rem .6rem;align-items:center;font-size:1rem}
.dl-lane-key{display:inline-block;min-width:1.6em;padding:0 .3em;border-radius:.2em;text-align:center;
font-weight:600;margin-right:.3em}
.dl-lane-left{min-width:0;width:.25em;height:1.3em;padding:0;background:#212529;vertical-align:middle}
.dl-lane-free{height:1.2em;background:#f8f9fa;border:1px solid #dee2e6;vertical-align:middle}
</style>"""


def dtype_table(model: LoadedModel) -> None:
    """Fewer bits: a row per dtype (B = 1 step, bytes, share of the read roof, perplexity, agreement, KL), measured
    once per model for the process, and what this CPU offers for bf16 and int8."""
    info = model.info
    st.subheader(t("serving.dtypes"))
    if st.button(t("serving.measure_dtypes"), key="serving_measure_dtypes", icon=":material/compare_arrows:"):
        bar = run.StopBar("serving_dtypes_stop", t("serving.measuring"))
        guarded(lambda: run.measure_dtype_costs(model, lambda done: bar.draw(done, t("serving.measuring"))))
        bar.clear()
    kept = run.kept_dtype_costs(model)
    if kept is None:
        st.caption(t("serving.dtypes_help"))
    else:
        costs, quality, refused = kept
        read_roof = run.machine(info.device, "float32").read_gb_s  # the roofline's measurement
        st.html(table_html(
            [t("serving.col_dtype"), t("serving.col_step_b1"), t("serving.col_mb_read"), "GB/s",
             t("serving.col_of_read"), t("serving.col_perplexity"), t("serving.col_agreement"), t("serving.col_kl")],
            [[c.dtype, decimal(c.step_ms, 2), decimal(c.bytes_read / 1e6, 1), decimal(c.gb_s, 2),
              f"{c.gb_s / read_roof:.0%}", decimal(c.perplexity, 3), f"{decimal(100 * c.greedy_agreement)}%",
              decimal(c.mean_kl, 5)]
             for c in costs]))
        for refusal in refused:  # said in this visitor's language
            st.caption(error_sentence(refusal))
        st.caption(t("serving.dtypes_note", repeats=run.DTYPE_REPEATS, context=number(run.dtype_context(model)),
                     read=decimal(read_roof), tokens=number(quality.tokens), text=quality.text,
                     title=held_out(info.language).title, greedy=number(quality.rows[0].greedy_total),
                     prompts=quality.prompts))
        unk = unknown_tokens(model)
        if unk:  # a word-level vocabulary that lacks the text's words: the perplexity is over <unk> mostly
            st.caption(t("serving.quality_unk", unk=number(unk), tokens=number(quality.tokens)))
    if info.device == "cpu":
        st.caption(" ".join(run.cpu_sentences(machine_products())))


def sweep(run_model: LoadedModel, batches: tuple[int, ...], wanted_contexts: tuple[int, ...]) -> None:
    """ITL and tokens/s of the run's weights by B and context (the contexts that fit, or half the context)."""
    state, run_info = st.session_state, run_model.info
    st.subheader(t("serving.sweep"))
    contexts = [c for c in wanted_contexts if c < run_info.context_length] or [run_info.context_length // 2]
    if st.button(t("serving.measure_sweep"), key="serving_measure", icon=":material/timer:"):
        bar = run.StopBar("serving_measure_stop", t("serving.measuring"))
        measured = guarded(lambda: measure.sweep(
            run_model, list(batches), contexts, report=lambda done, total, batch, context: bar.draw(
                done / total, t("serving.sweep_progress", batch=batch, n=number(context), k=done + 1, total=total))))
        bar.clear()
        if measured is not None:
            state.serving_sweep = (run_info.dtype, measured)
    if state.serving_sweep is None:
        listed = [number(c) for c in contexts]
        st.caption(t("serving.sweep_help", dtype=run_info.dtype, contexts=listed[0] if len(listed) == 1
                     else t("serving.and", a=listed[0], b=listed[1])))
        return
    sweep_dtype, measured = state.serving_sweep
    label = t("serving.context_label")
    charts = [svg.line_chart_svg(list(batches), {label.format(n=c): [w.p50 for w in works]
                                                 for c, works in measured.items()},
                                 "B", t("serving.itl_ms"), t("serving.itl_ms"), number=lambda v: number(v, "g")),
              svg.line_chart_svg(list(batches), {label.format(n=c): [w.tokens_per_s for w in works]
                                                 for c, works in measured.items()},
                                 "B", t("serving.tokens_per_s"), t("serving.tokens_per_s"),
                                 number=lambda v: number(v, "g"))]
    st.html(f'<div class="dl-grid"><div>{charts[0]}</div><div>{charts[1]}</div></div>')
    st.caption(t("serving.sweep_note", dtype=sweep_dtype, repeats=5))


def profile(run_model: LoadedModel, steps: int, most_context: int, rows: int) -> None:
    """The profiler's ops of `steps` decode steps of `rows` rows, and its Chrome trace to download."""
    state, run_info = st.session_state, run_model.info
    st.subheader(t("serving.profile"))
    if st.button(t("serving.run_profile"), key="serving_profile_button", icon=":material/query_stats:"):
        bar = run.StopBar("serving_profile_stop", t("serving.measuring"))
        ticks = [0, 2 * run_info.n_layers + steps]  # done, and the prefill's and warm-up's layers + the steps

        def tick() -> None:
            ticks[0] += 1
            bar.draw(ticks[0] / ticks[1], t("serving.measuring"))

        with tempfile.TemporaryDirectory() as folder:
            trace = Path(folder) / "trace.json"
            context = min(most_context, run_info.context_length // 2)
            ops = guarded(lambda: measure.profile_steps(run_model, rows, context, steps, str(trace), tick))
            if ops is not None:
                state.serving_profile = (ops, trace.read_bytes(), rows)
        bar.clear()
    if state.serving_profile is None:
        st.caption(t("serving.profile_help"))
        return
    ops, trace_bytes, profiled_rows = state.serving_profile
    on_device = ops[0].clock == "device"
    st.html(table_html([t("serving.col_op"), t("serving.col_ms_device" if on_device else "serving.col_ms"),
                        t("serving.col_share"), t("serving.col_calls")],
                       [[op.name, decimal(op.ms_per_step, 3), f"{op.share:.0%}", number(round(op.calls_per_step))]
                        for op in ops]))
    st.caption(t("serving.profile_note_device" if on_device else "serving.profile_note", steps=steps,
                 rows=profiled_rows))
    if any(op.name.startswith(PROFILED) for op in ops):  # the model ran in the decode kernels
        st.caption(t("serving.profile_kernels"))
    st.download_button(t("serving.download_trace"), data=trace_bytes, file_name="decode-lab-step-trace.json",
                       mime="application/json", key="serving_trace_download", on_click="ignore")
