"""Paged KV: the KV cache as a server's memory. A built-in queue served step by step on a paged cache (its block pool,
a request's block table, the lanes of prompt chunks beside decode rows), then served again under what it is compared
with (padded slots, no prefix cache, no chunks), side by side. The engine's work is model/serving/ (paged.py,
engine.py, kv_runs.py)."""

from itertools import pairwise

import streamlit as st

from model.engine.generate import session_budget_bytes
from model.engine.llama import is_packed
from model.serving import kv_runs, queues
from model.serving.paged import ALIGN
from ui import svg
from ui.classroom import key_figure, settings, why
from ui.errors import callback_error_here, guarded, guarded_in_callback
from ui.i18n import decimal, labels, number, t
from ui.models import page_start
from ui.pages import page
from ui.pool_view import budget_slider, draw_pool, draw_request_lanes, request_legend
from ui.serving_panel import comparison, counts_row, run_sentences, step_time_chart, time_split_table
from ui.serving_run import asked_steps, run_buttons, run_steps
from ui.session_end import hold
from ui.state import keep_across_pages
from ui.widgets import table_html

# paged_wanted: what the last click asked for, run by this script where Stop reaches it ("one" step, or to the "end");
# paged_opened_for: the model the page last opened on, with a run of its default queue started for it
PAGE_DEFAULTS = {"paged_run": None, "paged_for": None, "paged_queue": "mixed", "paged_block_size": 16,
                 "paged_budget_mb": 1.0, "paged_budget_for": None, "paged_wanted": None, "paged_running": False,
                 "paged_compared": None, "paged_table_request": None, "paged_opened_for": None}
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIB = 2**20

keep_across_pages(PAGE_DEFAULTS)

model = page_start("paged", intro=False)
info = model.info
state = st.session_state
# a value the selects do not offer (only a forged websocket message sends one) put back to the default
if state.paged_block_size not in BLOCK_SIZES or state.paged_block_size > info.context_length:
    state.paged_block_size = PAGE_DEFAULTS["paged_block_size"]
if state.paged_queue not in queues.QUEUES:
    state.paged_queue = PAGE_DEFAULTS["paged_queue"]


def drop_run() -> None:
    """The run ends: its pool let go now, not at a garbage collection."""
    if state.paged_run is not None:
        state.paged_run.close()
    state.paged_run, state.paged_compared = None, None


if state.paged_for is not None and state.paged_for[0] != (info.name, info.device):
    drop_run()


def requests():
    return queues.built_in_queue(model, state.paged_queue)


def session_mib() -> float:
    return session_budget_bytes() / MIB


# a queue's default budget (kv_runs.default_budget, within the session's), set again when the model, the queue or
# the block size changes
if state.paged_budget_for != (info.name, state.paged_queue, state.paged_block_size):
    default = guarded(lambda: kv_runs.default_budget(model, state.paged_queue, requests(),
                                                     int(state.paged_block_size)))
    if default is not None:
        state.paged_budget_mb = round(min(-(-default * 100 // MIB) / 100, session_mib()), 2)
        state.paged_budget_for = (info.name, state.paged_queue, state.paged_block_size)


def chosen_variants() -> list[kv_runs.Variant]:
    return kv_runs.variants(state.paged_queue, info.context_length, int(state.paged_block_size),
                            int(float(state.paged_budget_mb) * MIB))


def common_start(a: list[int], b: list[int]) -> int:
    """How many ids two prompts begin with in common."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def variant_name(variant: kv_runs.Variant) -> str:
    return t("paged.variant_" + variant.name, chunk=variant.chunk)


def same_tokens(tokens: list[list[int]], mine: list[list[int]]) -> str:
    """Whether a compared run wrote this run's tokens: all, none, or how many of its requests did."""
    same = sum(a == b for a, b in zip(tokens, mine))
    if same == len(mine):
        return t("paged.same")
    return t("paged.some_same", same=same, n=len(mine)) if same else t("paged.not_same")


def offered() -> bool:
    """Whether the block size, the queue and the budget are values the widgets offer. A click's callback runs before
    the page puts back a forged one (a websocket message can send any string: "abc", "16.0")."""
    try:
        budget = float(state.paged_budget_mb)
    except (TypeError, ValueError):
        return False
    size = state.paged_block_size
    return (type(size) is int and size in BLOCK_SIZES and size <= info.context_length
            and state.paged_queue in queues.QUEUES and 0 < budget <= session_mib())


def start() -> None:
    """A new run of the queue's first variant; its first step runs in the page's script, as every step does. A
    refused Start says why: a forged setting leaves the run as it was, a budget too small leaves none."""
    if not offered():
        state.callback_error = t("error.paged_not_offered")
        return
    live = chosen_variants()[0]
    run = guarded_in_callback(lambda: kv_runs.QueueRun(model, requests(), live.settings))
    drop_run()
    state.paged_run = run
    if run is not None:
        hold(run)
        state.paged_wanted = "one"
        state.paged_for = ((info.name, info.device), state.paged_queue, live)


def ask_compare() -> None:
    state.paged_wanted = "end"  # a finished run's comparison runs where Stop reaches it


def reset() -> None:
    """Every block back in the pool, every request waiting again: the run starts over on the same settings."""
    state.paged_run.reset()
    state.paged_compared, state.paged_wanted = None, None


# -- the settings, folded -----------------------------------------------------------------------------------------
with settings("paged"):
    with st.container(horizontal=True, vertical_alignment="bottom"):
        st.selectbox(t("paged.queue"), queues.QUEUES, key="paged_queue", width=260,
                     format_func=labels("paged.queue_", queues.QUEUES).get,
                     help=t("paged.queue_help", mixed=queues.MIXED_REQUESTS, shared=queues.SHARED_REQUESTS,
                            filler=queues.SHARED_FILLER, short=queues.LONG_JOIN_SHORT, step=queues.LONG_JOIN_STEP))
        sizes = [b for b in BLOCK_SIZES if b <= info.context_length]
        st.selectbox(t("paged.block_size"), sizes, key="paged_block_size", width=140,
                     help=t("paged.block_size_help"))
        budget_slider("paged_budget_mb", t("paged.budget_help", slots=kv_runs.DEFAULT_PADDED_SLOTS,
                                           session=decimal(session_mib())))
    compared = chosen_variants()
    st.caption(t("paged.compares", live=variant_name(compared[0]),
                 others=", ".join(variant_name(v) for v in compared[1:])))

# the first visit on this model: its default queue's run already started (one step; small's takes milliseconds)
if state.paged_run is None and state.paged_opened_for != (info.name, info.device):
    state.paged_opened_for = (info.name, info.device)
    start()

# -- the steps a click asked for: here, where a click on Stop (or anything else) reaches them -------------------------
run = state.paged_run
wanted, stopped = asked_steps("paged", run,
                              lambda to_end: run_steps(run.server, to_end, "paged_stop", "paged.progress"))
run_buttons("paged", run, "action.start", start, reset, run_key="paged_run_button", play=True)
callback_error_here()
if run is None:
    with key_figure():
        st.info(t("paged.press_start"))
    st.stop()
_, run_queue, live = state.paged_for
server = run.server
# any change a new Start would apply (the queue, the block size, the budget) is said
run_sentences(t("paged.stopped", steps=len(run.steps)) if stopped else None,
              run.settings != compared[0].settings or run_queue != state.paged_queue)

# -- the pool: the page's key figure -------------------------------------------------------------------------------
pool = server.pool_view()
n_blocks = len(pool.holder)
free = int((pool.holder < 0).sum())
steps = server.steps
layout = server.layout
with key_figure():
    st.subheader(t("paged.pool"))
    draw_pool(pool)
    st.html(request_legend(sorted(server.requests), bool((pool.refs > 1).any())))
counts_row([(t("serving.steps"), len(steps)), (t("paged.running_now"), len(server.running)),
            (t("paged.free_blocks"), f"{number(free)} / {number(n_blocks)}"),
            (t("paged.shared_now"), int((pool.refs > 1).sum())),
            (t("paged.preemptions"), sum(len(s.preempted) for s in steps))])
if run_queue == "shared-prefix" and run.settings.prefix_cache:
    # the prefix cache shares full blocks only: a block longer than any two prompts' common start shares nothing
    prompts = sorted(r.prompt_ids for r in run.requests)
    most = max(common_start(a, b) for a, b in pairwise(prompts))
    if most < server.layout.block_size:
        st.caption(t("paged.nothing_shared", n=len(prompts), common=number(common_start(prompts[0], prompts[-1])),
                     size=number(server.layout.block_size)))
with why("paged"):
    st.markdown(t("paged.intro"))
    groups = len(layout.groups)
    sliding_groups = sum(w is not None for w in pool.windows)
    st.markdown(t("paged.pool_text", blocks=number(n_blocks), size=layout.block_size, layers=layout.group_layers,
                  block_bytes=number(layout.block_bytes), budget=decimal(run.settings.budget_bytes / MIB, 2))
                + (" " + t("paged.pool_groups", groups=groups, sliding=sliding_groups, full=groups - sliding_groups,
                           window=number(info.window)) if sliding_groups else ""))
    # the white of a held block: a last block's top, or (chunks) whole blocks given out ahead of the chunks that
    # fill them
    st.caption(t("paged.pool_caption") + " " + (t("paged.waste_chunks", chunk=number(run.settings.chunk))
                                                if run.settings.chunk is not None else t("paged.waste_whole")))

if not steps:  # reset, or the first step stopped: the pool as it stands, nothing run yet
    st.stop()

# -- the lanes: prompt chunks beside decode rows -----------------------------------------------------------------
st.subheader(t("paged.lanes"))
draw_request_lanes(server)
with why("paged-lanes"):
    st.caption(t("paged.lanes_caption"))

# -- a request's block tables ----------------------------------------------------------------------------------------
holders = sorted(pool.tables)
if holders:
    if state.paged_table_request not in holders:
        state.paged_table_request = holders[0]
    st.selectbox(t("paged.table_request"), holders, key="paged_table_request", width=200)
    tables = pool.tables[state.paged_table_request]
    width = max(len(table) for table in tables)
    kinds = [t("paged.kind_sliding") if w is not None else t("paged.kind_full") for w in pool.windows]
    st.html(table_html([t("paged.col_group")] + [str(j) for j in range(width)],
                       [[f"{g} ({kind})"] + ["—" if b < 0 else b for b in table] + [""] * (width - len(table))
                        for g, (kind, table) in enumerate(zip(kinds, tables))]))
    with why("paged-table"):
        st.caption(t("paged.table_caption", size=layout.block_size))

st.html(svg.line_chart_svg(list(range(len(run.steps))),
                           {t("paged.reserved_mib"): [s.bytes_reserved / MIB for s in run.steps],
                            t("paged.held_mib"): [s.bytes_held / MIB for s in run.steps]},
                           t("serving.axis_step"), "MiB", t("paged.memory_alt"), number=lambda v: number(v, ",g"),
                           title=t("paged.memory_alt"), zoom=1.5))
step_time_chart([s.ms for s in steps], "ms")
time_split_table(run.steps)

# -- the comparison: the same queue under the settings it is compared with ------------------------------------------
# each compared run by its variant, named in the language of the draw (a switch renames the rows)
compared_runs = comparison(
    "paged", run, wanted, lambda: [kv_runs.QueueRun(model, list(run.requests), v.settings) for v in compared[1:]],
    [variant_name(v) for v in compared[1:]],
    lambda others: [(v, o.summary(), [r.new_ids for r in o.requests]) for v, o in zip(compared[1:], others)],
    ask_compare)
if compared_runs is not None:
    mine = [r.new_ids for r in run.requests]

    def ms(value: float | None) -> str:
        return "—" if value is None else decimal(value)

    rows = []
    for variant, kv, tokens in [(live, run.summary(), mine)] + compared_runs:
        rows.append([variant_name(variant), kv["max_concurrent"], decimal(kv["bytes_reserved_peak"] / MIB, 2),
                     decimal(kv["bytes_held_peak"] / MIB, 2), f"{decimal(100 * kv['waste_fraction'])} %",
                     number(kv["prefill_positions_computed"]), kv["shared_blocks"], kv["preemptions"],
                     ms(kv["ttft_ms_p50"]), ms(kv["itl_ms_from_start"]["p99"]), ms(kv["itl_ms_from_start"]["max"]),
                     ms(kv["ttft_ms_joined_p50"]), decimal(kv["tokens_per_s"]),
                     same_tokens(tokens, mine)])
    labels = [t("paged.col_variant"), t("paged.col_at_once"), t("paged.col_reserved"), t("paged.col_held"),
              t("paged.col_waste"), t("paged.col_prefill"), t("paged.col_shared"), t("paged.col_preempted"),
              t("paged.col_ttft"), t("paged.col_itl_p99"), t("paged.col_itl_max"), t("paged.col_ttft_joined"),
              t("serving.tokens_per_s"), t("paged.col_tokens")]
    # a setting a column, a measure a row: thirteen measures side by side were wider than a 1280 screen
    columns = list(zip(labels, *rows))
    st.html(table_html(list(columns[0]), [list(measure) for measure in columns[1:]]))
    st.caption(t("paged.comparison_caption", queue=t("paged.queue_" + run_queue),
                 differs=t("paged.differs_" + run_queue))
               + (" " + t("paged.fp8_caption") if any(v.settings.kv_dtype == "fp8" for v, _, _ in compared_runs)
                  else ""))
st.page_link(page("kv").path, label=t("kv.link"), icon=page("kv").icon)
st.page_link(page("live").path, label=t("live.link"), icon=page("live").icon)
with st.expander(t("paged.how")):
    st.markdown(t("paged.how_text"))
    exact = "paged.how_exact_gemma" if model.info.architecture == "gemma3_text" else "paged.how_exact"
    st.markdown(t(exact, align=ALIGN) if is_packed(model.module) else t("paged.how_not_exact"))
