"""What the serving pages (Serving, Paged KV cache, Tiers and workers) draw alike around their own picture: the
sentences under the buttons (a run cut short; settings a new Start would apply), the row of counts, the chart of each
step's time, and the comparison of a finished run with the same queue under other settings, run on a click where a
Stop reaches it and kept until the next Start. Each page keeps only its own picture and its own table's columns."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import streamlit as st

from model.engine.kernels import OP_CLASSES
from model.serving import kv_runs
from model.serving.engine import StepRecord
from model.serving.kv_runs import QueueRun
from ui import svg
from ui.errors import guarded
from ui.i18n import decimal, number, t
from ui.serving_run import run_variants
from ui.widgets import table_html


def run_sentences(stopped_text: str | None, changed: bool) -> None:
    """A run cut short by Stop (its sentence, when given), and a change of settings a new Start would apply."""
    if stopped_text is not None:
        st.info(stopped_text)
    if changed:
        st.caption(t("paged.settings_next_run"))


def counts_row(counts: Sequence[tuple[str, object] | tuple[str, object, str]]) -> None:
    """The run's counts side by side, each a label and its value, and where given the help its "?" shows."""
    with st.container(horizontal=True):
        for label, value, *help_text in counts:
            st.metric(label, value, help=help_text[0] if help_text else None)


def step_time_chart(ms: list[float], axis: str) -> None:
    """Each step's time, ms, by step."""
    st.html(svg.line_chart_svg(list(range(len(ms))), {t("serving.step_ms"): ms}, t("serving.axis_step"), axis,
                               t("serving.step_ms"), number=lambda v: number(v, ",g"), title=t("serving.step_chart"),
                               zoom=1.5))


def time_split_table(steps: list[StepRecord]) -> None:
    """Where the run's clock went (kv_runs.time_split): each part's ms and share, the parts that took any time; then
    within each kind of pass, by the kernels' own clocks (kv_runs.op_split): products, attention, small ops, the
    rest."""
    split = kv_runs.time_split(steps)
    total = sum(split.values())
    if not total:
        return
    st.html(table_html([t("serving.time_part"), "ms", t("serving.time_share")],
                       [[t("serving.time_" + part), decimal(ms), f"{decimal(100 * ms / total)} %"]
                        for part, ms in split.items() if ms]))
    st.caption(t("serving.time_caption"))
    ops = kv_runs.op_split(steps)
    if not ops:  # no forward pass yet (a prefill worker's prompts received): no kernels' clocks to split
        return
    columns = [*OP_CLASSES, "rest"]
    st.html(table_html([t("serving.ops_kind")] + [t("serving.op_" + op) for op in columns],
                       [[t("serving.ops_row_" + kind)]
                        + [f"{decimal(by_op[op])} ms ({decimal(100 * by_op[op] / (sum(by_op.values()) or 1))} %)"
                           for op in columns] for kind, by_op in ops.items()]))
    st.caption(t("serving.ops_caption"))


def comparison(prefix: str, run: QueueRun, wanted: str | None, others: Callable[[], list[QueueRun]],
               names: list[str], kept: Callable[[list[QueueRun]], object], on_click: Callable[[], None]) -> object:
    """The comparison under the subheader: once the run is finished and a click asked for it (`wanted`), the runs
    `others()` makes (names[k]: what the Stop bar calls each) served to their end, and kept(those runs) stored in
    state[prefix + "_compared"]; a refusal or a failure is its sentence, a Stop drops the run under way. Before
    that, a sentence and the Compare button (on_click asks for it). Returns what is stored, or None."""
    state = st.session_state
    st.subheader(t("paged.comparison"))
    if run.finished and state[prefix + "_compared"] is None and wanted is not None:
        made = guarded(others)  # a budget the run takes may be too small for another setting: its sentence
        error = None if made is None else run_variants(made, names)
        if error is not None:
            st.error(error)
        if made is not None and all(o.finished for o in made):  # what they measured and wrote, not their pools
            state[prefix + "_compared"] = kept(made)
    if state[prefix + "_compared"] is None:
        st.caption(t("paged.compare_again" if run.finished else "paged.compare_after"))
        if run.finished:
            st.button(t("action.compare"), key=prefix + "_compare", icon=":material/compare_arrows:",
                      on_click=on_click)
    return state[prefix + "_compared"]
