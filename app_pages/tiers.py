"""Tiers and workers: the paged KV cache with a second, slower tier (a preempted request's blocks moved out and back
instead of computed again) or with prefill and decode on two processes (a prefill worker sends each prompt's keys
and values). The mixed queue served step by step, then served again in one process on one tier, side by side. The
engine's work is model/serving/ (tiers.py, disaggregated.py); the drawings are ui/tier_view.py."""

import dataclasses

import streamlit as st

from model.engine.generate import session_budget_bytes
from model.serving import kv_runs, queues
from model.serving.disaggregated import live_workers, max_workers, worker_bytes
from model.serving.engine import mib_up
from model.serving.forecast import first_move_out
from model.serving.tiers import tier_file_bytes, tier_kind
from ui.classroom import key_figure, settings, why
from ui.errors import callback_error_here, guarded
from ui.i18n import decimal, labels, number, t
from ui.models import chosen_model, page_start
from ui.pool_view import budget_slider, draw_request_lanes
from ui.serving_panel import comparison, counts_row, run_sentences, time_split_table
from ui.serving_run import asked_steps, run_buttons, run_steps
from ui.session_end import hold
from ui.state import keep_across_pages
from ui.tier_view import (
    draw_crossover,
    draw_pool_and_tier,
    draw_transfers,
    draw_worker_lanes,
    first_move_said,
    measured_crossover,
    ms,
    step_events,
)
from ui.widgets import table_html

QUEUE = "mixed"  # the queue whose budget runs short: its growing decodes preempt one another
MODES = ("tier", "workers")
BLOCK_SIZES = (4, 8, 16, 32, 64)
MIB = 2**20
# tiers_wanted: what the last click asked for ("start", one step, or to the "end"), done by this script;
# tiers_first_move: when the run's tier first moves blocks out (forecast.first_move_out), known at its Start;
# tiers_opened_for: the model the page last opened on, with a run of the second tier started for it
PAGE_DEFAULTS = {"tiers_run": None, "tiers_for": None, "tiers_mode": "tier", "tiers_block_size": 16,
                 "tiers_budget_mb": 1.0, "tiers_budget_for": None, "tiers_wanted": None, "tiers_running": False,
                 "tiers_compared": None, "tiers_first_move": None, "tiers_opened_for": None}

keep_across_pages(PAGE_DEFAULTS)

model = page_start("tiers", intro=False)
info = model.info
state = st.session_state
kind = tier_kind(model.device)


def drop_run() -> None:
    """The run ended: its prefill worker stopped and its tier's file deleted."""
    if state.tiers_run is not None:
        state.tiers_run.close()
    state.tiers_run, state.tiers_compared, state.tiers_first_move = None, None, None


# a value the select does not offer (only a forged websocket message sends one) put back to the default
if state.tiers_block_size not in BLOCK_SIZES or state.tiers_block_size > info.context_length:
    state.tiers_block_size = PAGE_DEFAULTS["tiers_block_size"]
if state.tiers_for is not None and state.tiers_for[0] != (info.name, info.device):
    drop_run()
requests = queues.built_in_queue(model, QUEUE)
if state.tiers_budget_for != (info.name, state.tiers_block_size):
    default = guarded(lambda: kv_runs.default_budget(model, QUEUE, requests, int(state.tiers_block_size)))
    if default is not None:
        state.tiers_budget_mb = min(mib_up(default), round(session_budget_bytes() / MIB, 2))
        state.tiers_budget_for = (info.name, state.tiers_block_size)


def request(wanted: str) -> None:
    state.tiers_wanted = wanted


def reset() -> None:
    """Every block back in the pool, the tier's file deleted, the prefill worker ended; the run starts over."""
    state.tiers_run.reset()
    state.tiers_compared, state.tiers_wanted = None, None


# -- the settings, folded -----------------------------------------------------------------------------------------
with settings("tiers"):
    with st.container(horizontal=True, vertical_alignment="bottom"):
        st.radio(t("tiers.mode"), MODES, key="tiers_mode", horizontal=True, width=360,
                 format_func=labels("tiers.mode_", MODES).get, help=t("tiers.mode_help"))
        st.selectbox(t("paged.block_size"), [b for b in BLOCK_SIZES if b <= info.context_length],
                     key="tiers_block_size", width=140, help=t("paged.block_size_help"))
        budget_slider("tiers_budget_mb", t("tiers.budget_help", slots=kv_runs.DEFAULT_PADDED_SLOTS))
    mode, block_size = state.tiers_mode, int(state.tiers_block_size)
    st.caption(t("tiers.queue", requests=queues.MIXED_REQUESTS) + " "
               + t("tiers.compares_tier" if mode == "tier" else "tiers.compares_workers",
                   kind=t("tiers.kind_" + kind)))
    if mode == "workers":  # what a Start costs the server, and its cap, said before the cap is reached
        weights, cache = worker_bytes(model, block_size)
        st.caption(t("tiers.worker_cost", mib=decimal((weights + cache) / MIB, 1), weights=decimal(weights / MIB, 1),
                     cache=decimal(cache / MIB, 1), cap=number(max_workers()), live=number(live_workers())))
crossover = None
if mode == "tier":
    with st.spinner(t("tiers.measuring")):
        # a folder's refusal names the run's tier (the budget's), not the crossover's smaller scratch one
        crossover = guarded(lambda: measured_crossover(model, info.name, info.device, info.dtype, block_size, kind,
                                                       tier_file_bytes(model, block_size,
                                                                       int(float(state.tiers_budget_mb) * MIB))))

# the first visit on this model: a run of the second tier already started (one step; small's takes milliseconds)
if state.tiers_run is None and mode == "tier" and state.tiers_opened_for != (info.name, info.device):
    state.tiers_opened_for = (info.name, info.device)
    state.tiers_wanted = "start"

# -- what a click asked for: here, where a click on Stop (or anything else) reaches it -------------------------------
wanted, state.tiers_wanted = state.tiers_wanted, None
if wanted == "start" and (mode == "workers" or crossover is not None):
    drop_run()
    run_settings = kv_runs.KVSettings("paged", block_size, int(float(state.tiers_budget_mb) * MIB),
                                      offload=kind if mode == "tier" else None,
                                      prefill_worker=chosen_model()[0] if mode == "workers" else None)
    with st.spinner(t("tiers.starting_worker" if mode == "workers" else "tiers.making_tier")):
        state.tiers_run = guarded(lambda: kv_runs.QueueRun(model, requests, run_settings, crossover))
    if state.tiers_run is not None:
        hold(state.tiers_run)  # its worker and its tier file ended with the session, not at a garbage collection
        if mode == "tier":  # the step at which its tier first moves blocks out, said before it comes
            state.tiers_first_move = guarded(lambda: first_move_out(model, requests, run_settings.paged,
                                                                    state.tiers_run.crossover.positions))
    state.tiers_for = ((info.name, info.device), mode)
    wanted = "one" if state.tiers_run is not None else None
run = state.tiers_run
state.tiers_wanted = wanted  # a start's first step, Next's or Run's: asked_steps runs them
wanted, stopped = asked_steps("tiers", run,
                              lambda to_end: run_steps(run.server, to_end, "paged_stop", "paged.progress"))
run_buttons("tiers", run, "action.start", lambda: request("start"), reset, run_key="tiers_run_button", play=True)
callback_error_here()
if run is None:
    with key_figure():
        st.info(t("tiers.press_start"))
        if crossover is not None:
            st.subheader(t("tiers.crossover"))
            draw_crossover(crossover)
    with why("tiers"):
        st.markdown(t("tiers.intro"))
    st.stop()
run_mode = state.tiers_for[1]
# any change a new Start would apply (the mode, the block size, the budget) is said
run_sentences(t("paged.stopped", steps=len(run.steps)) if stopped else None,
              run_mode != mode or (run.settings.block_size, run.settings.budget_bytes) != (
                  block_size, int(float(state.tiers_budget_mb) * MIB)))
server = run.server

# -- the key figure: the pool above the second tier, and where each request was; or the two workers' lanes ----------
with key_figure():
    if run_mode == "tier":
        st.subheader(t("tiers.pool_and_tier"))
        said = first_move_said(server, state.tiers_first_move, run.crossover)
        if said is not None:
            st.markdown(said)
        draw_pool_and_tier(server)
        if server.steps:
            st.markdown(f"**{t('tiers.lanes')}**")
            draw_request_lanes(server)
    else:
        st.subheader(t("tiers.workers"))
        draw_worker_lanes(server)
counts_row([(t("serving.steps"), len(server.steps)), (t("paged.running_now"), len(server.running)),
            (t("paged.preemptions"), sum(len(s.preempted) for s in server.steps))]
           + ([(t("tiers.blocks_out"), number(server.offload.moves.blocks_out)),
               (t("tiers.blocks_back"), number(server.offload.moves.blocks_in))] if run_mode == "tier" else
              [(t("tiers.transfers"), len(server.connector.transfers)),
               (t("tiers.bytes_received"), number(sum(x.bytes for x in server.connector.transfers)))]))
with why("tiers"):
    st.markdown(t("tiers.intro"))
    if run_mode == "tier":
        if server.offload.tier is not None:  # after a reset it is made again at the first move out (tier_deleted)
            st.markdown(t("tiers.tier_text", kind=t("tiers.kind_" + server.offload.kind),
                          slots=number(server.offload.tier_bytes // server.layout.block_bytes),
                          block_bytes=number(server.layout.block_bytes),
                          mib=decimal(server.offload.tier_bytes / MIB, 2)))
        st.caption(t("tiers.grids_caption"))

# -- what the tier did and its crossover, or the two workers' transfers ----------------------------------------------
if run_mode == "tier":
    st.subheader(t("tiers.events"))
    step_events(server, run.crossover)
    st.subheader(t("tiers.crossover"))
    draw_crossover(run.crossover)
else:
    if server.connector.failure is not None:
        st.warning(t("tiers.worker_" + server.connector.failure[0], step=server.connector.failure[1]))
    else:
        # which backend runs (ran): NCCL where the worker has a GPU of its own, else gloo through host memory
        wire = t("tiers.wire_gloo" if server.connector.pairing.host_copies else "tiers.wire_nccl")
        worker = server.connector.worker
        if worker is not None:
            st.markdown(t("tiers.worker_alive", pid=worker.process.pid, device=server.connector.pairing.worker_device,
                          wire=wire))
        else:
            st.markdown(t("tiers.worker_done", wire=wire) if run.finished else t("tiers.worker_ended"))
        if server.connector.pairing.host_copies and model.device.type == "cuda":
            st.caption(t("tiers.one_gpu"))
    draw_transfers(server, model)

if server.steps:
    time_split_table(run.steps)

# -- the comparison: the same queue in one process, on one tier -----------------------------------------------------
name_key = "tiers.variant_alone_" + run_mode  # said in the language of the draw (a switch renames the row)
compared_run = comparison(
    "tiers", run, wanted,
    lambda: [kv_runs.QueueRun(model, list(run.requests),
                              dataclasses.replace(run.settings, offload=None, prefill_worker=None))],
    [t(name_key)], lambda others: (name_key, others[0].summary(), [r.new_ids for r in others[0].requests]),
    lambda: request("end"))
if compared_run is not None:
    mine = [r.new_ids for r in run.requests]
    name_key, theirs, their_tokens = compared_run
    rows = []
    for variant, kv, tokens in [(t("tiers.variant_" + run_mode), run.summary(), mine),
                                (t(name_key), theirs, their_tokens)]:
        same = t("paged.same" if tokens == mine else "paged.not_same")
        itl = kv["itl_ms"]
        if run_mode == "tier":
            out = (kv["offload"] or {}).get("blocks_out", 0)
            rows.append([variant, kv["preemptions"], number(out), number(kv["prefill_positions_computed"]),
                         ms(kv["ttft_ms_p50"]), ms(itl["p99"]), decimal(kv["tokens_per_s"]), same])
        else:
            sent = (kv["transfer"] or {}).get("bytes", 0)
            rows.append([variant, ms(kv["ttft_ms_p50"]), ms(itl["p50"]), ms(itl["p99"]), decimal(kv["tokens_per_s"]),
                         number(sent), same])
    if run_mode == "tier":
        headers = [t("paged.col_variant"), t("paged.col_preempted"), t("tiers.blocks_out"), t("paged.col_prefill"),
                   t("paged.col_ttft"), t("paged.col_itl_p99"), t("serving.tokens_per_s"), t("paged.col_tokens")]
    else:
        headers = [t("paged.col_variant"), t("paged.col_ttft"), t("tiers.col_itl_p50"), t("paged.col_itl_p99"),
                   t("serving.tokens_per_s"), t("tiers.bytes_received"), t("paged.col_tokens")]
    st.html(table_html(headers, rows))
    st.caption(t("tiers.comparison_caption_" + run_mode))
with st.expander(t("paged.how")):
    st.markdown(t("tiers.how_text"))
