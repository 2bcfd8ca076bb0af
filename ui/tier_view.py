"""The Tiers and workers page's drawings: the pool beside the second tier's slots, what the tier did step by step,
the crossover measured on this machine, and the two workers' lanes with each transfer's bytes beside the cache
formula. The numbers come from model/serving (tiers.py, disaggregated.py, engine.py); here they are drawn."""

from __future__ import annotations

import threading

import streamlit as st

from model.engine.runtime import LoadedModel
from model.serving.crossover import Crossover, measure_crossover
from model.serving.engine import Engine
from model.serving.forecast import FirstMove
from model.serving.paged import PagedLayout
from ui import svg
from ui.errors import error_sentence
from ui.i18n import decimal, number, t
from ui.pool_view import draw_pool, request_legend
from ui.widgets import legend_html, table_html

_measuring = threading.Lock()  # one measurement at a time: two at once would time each other's work


@st.cache_resource(show_spinner=False, max_entries=16)
def measured_crossover(_model: LoadedModel, name: str, device: str, dtype: str, block_size: int,
                       kind: str, _said_bytes: int | None = None) -> Crossover:
    """tiers.measure_crossover of the model (by name, device and dtype) at this block size, measured once on this
    server and kept for every session (st.cache_resource): a property of the machine and the model's shapes. A
    folder that cannot take its scratch tier is refused naming `_said_bytes`, the run's tier (not in the cache's
    key: a refusal is not kept)."""
    with _measuring:
        return measure_crossover(_model, PagedLayout.of(_model.info, block_size), kind, None, _said_bytes)


def ms(value: float | None) -> str:
    return "—" if value is None else decimal(value, 2)


def draw_pool_and_tier(server: Engine) -> None:
    """The pool's blocks, then the tier's slots below (each as wide as the page), with what went out and came back
    in the last step, and the legend of the requests' colours."""
    offload = server.offload
    pool, tier = server.pool_view(), offload.view()
    free = int((pool.holder < 0).sum())
    st.markdown(f"**{t('tiers.pool_heading', free=number(free), blocks=number(len(pool.holder)))}**")
    draw_pool(pool)
    held = int((tier.holder >= 0).sum())
    if not len(tier.holder):
        st.caption(t("tiers.tier_deleted"))
    elif len(tier.holder) > svg.MAX_GRID_BLOCKS:  # as the pool past it: one bar, a segment per request
        st.markdown(f"**{t('tiers.tier_heading', held=number(held), slots=number(len(tier.holder)))}**")
        out = {int(r): int((tier.holder == r).sum()) for r in set(tier.holder[tier.holder >= 0].tolist())}
        st.html(svg.pool_bar_svg(tier.holder, {r: t("tiers.tip_out_many", request=r, slots=number(n))
                                               for r, n in out.items()},
                                 t("tiers.tip_free_many", slots=number(len(tier.holder) - held)),
                                 t("tiers.tier_alt", held=held, slots=len(tier.holder))))
    else:
        tips = []
        for s in range(len(tier.holder)):
            if tier.holder[s] >= 0:
                tips.append(t("tiers.tip_out_now" if tier.went_out[s] else "tiers.tip_out", slot=s,
                              request=int(tier.holder[s])))
            elif tier.came_back[s] >= 0:
                tips.append(t("tiers.tip_came_back", slot=s, request=int(tier.came_back[s])))
            else:
                tips.append(t("tiers.tip_free", slot=s))
        st.markdown(f"**{t('tiers.tier_heading', held=number(held), slots=number(len(tier.holder)))}**")
        st.html(svg.tier_slots_svg(tier.holder, tier.went_out, tier.came_back, tips,
                                   t("tiers.tier_alt", held=held, slots=len(tier.holder))))
    st.html(request_legend(sorted(server.requests)))
    if offload.failure is not None:
        st.error(error_sentence(offload.failure))


def first_move_said(server: Engine, first: FirstMove | None, crossover: Crossover) -> str | None:
    """When the tier first moves blocks out: done (its step and request), or to come (its step, how many Next
    presses away, the victim and its positions: forecast.first_move_out, at Start), or not in this run; None where
    nothing moves on this machine (crossover_none says so) or the step foreseen passed with no move (the tier
    was full or could not be written: the events say why)."""
    done = next(((step.index, rid) for step in server.steps for rid, what in step.tier if what == "out"), None)
    if done is not None:
        return t("tiers.first_out_done", step=done[0], request=done[1])
    if crossover.positions is None:
        return None
    if first is None:
        return t("tiers.first_out_none", crossover=number(crossover.positions))
    presses = first.step - len(server.steps) + 1
    if presses < 1:
        return None
    return t("tiers.first_out_next" if presses == 1 else "tiers.first_out_at", step=first.step, presses=presses,
             request=first.request, positions=number(first.positions), crossover=number(crossover.positions))


def step_events(server: Engine, crossover: Crossover) -> None:
    """This step's moves as a sentence, then every step's as a table: moved out, moved back, or computed again and
    why."""
    offload = server.offload
    if not server.steps:
        st.markdown(t("tiers.now_no_step"))
        return
    last = server.steps[-1]
    said = [t("tiers.now_out", request=rid, blocks=len(slots)) for rid, slots in offload.went_out.items()]
    said += [t("tiers.now_back" if (rid, "in") in last.tier else "tiers.now_damaged", request=rid, blocks=len(slots))
             for rid, slots in offload.came_back.items()]
    said += [event_text(what, rid, crossover) for rid, what in last.tier if what not in ("out", "in", "damaged")]
    st.markdown(" ".join(said) if said else t("tiers.now_nothing"))
    rows = [[step.index, rid, event_text(what, rid, crossover), ms(step.tier_ms)]
            for step in server.steps for rid, what in step.tier]
    if rows:
        st.html(table_html([t("tiers.col_step"), t("tiers.col_request"), t("tiers.col_event"),
                            t("tiers.col_tier_ms")], rows))
    moves = offload.moves
    st.caption(t("tiers.moves_caption", out=number(moves.blocks_out), back=number(moves.blocks_in),
                 ms_out=ms(moves.ms_out / moves.blocks_out if moves.blocks_out else None),
                 ms_in=ms(moves.ms_in / moves.blocks_in if moves.blocks_in else None)))


def event_text(what: str, request: int, crossover: Crossover) -> str:
    """What the tier did with a victim, in words (a victim too short: from how many positions it would move)."""
    if what == "short" and crossover.positions is None:
        return t("tiers.event_never", request=request)
    return t("tiers.event_" + what, request=request, positions=number(crossover.positions or 0))


def draw_crossover(crossover: Crossover) -> None:
    """Round trip against recompute by positions, the crossover marked and printed, the medians per block."""
    points = crossover.points
    positions = [p.positions for p in points]
    label = "" if crossover.positions is None else t("tiers.crossover_mark", positions=number(crossover.positions))
    st.html(svg.crossover_svg(positions, {t("tiers.round_trip"): [p.round_trip_ms for p in points],
                                          t("tiers.recompute"): [p.recompute_ms for p in points]},
                              crossover.positions, label, t("tiers.axis_positions"), "ms",
                              t("tiers.crossover_alt"), number=lambda v: number(v)))
    if crossover.positions is None:
        st.markdown(t("tiers.crossover_none", most=number(positions[-1])))
    else:
        st.markdown(t("tiers.crossover_at", positions=number(crossover.positions)))
    st.caption(t("tiers.crossover_caption", out=ms(crossover.ms_per_block_out), back=ms(crossover.ms_per_block_in),
                 recompute=ms(crossover.recompute_ms_per_block), bytes=number(crossover.block_bytes),
                 repeats=crossover.conditions.get("repeats", 0), threads=crossover.conditions.get("threads", 0)))


def formula_text(model: LoadedModel, positions: int) -> str:
    """The cache formula written out for `positions` positions, its value: per layer kind where there are two."""
    shape = model.info.cache_shape
    common = f"2 × {shape.n_kv_heads} × {shape.d_head} × {shape.bytes_per_element}"
    n = number(positions)
    if shape.sliding_layers:
        full = shape.n_layers - shape.sliding_layers
        written = f"{common} × ({full} × {n} + {shape.sliding_layers} × min({n}, {number(shape.window)}))"
    else:
        written = f"{shape.n_layers} × {common} × {n}"
    return f"{written} = {number(model.info.cache_bytes_formula(positions))}"


def draw_worker_lanes(server: Engine) -> None:
    """The two lanes, each transfer an arrow from the prefill worker's to the decode worker's step that received it,
    and their legend."""
    steps = server.steps
    transfers = server.connector.transfers
    boxes = [(x.request, x.step, t("tiers.tip_transfer", request=x.request, step=x.step, bytes=number(x.bytes),
                                   ms=ms(x.ms))) for x in transfers]
    cells = []
    for step in steps:
        kinds = [span.kind for span in step.spans]
        here = kinds.count("prefill") + kinds.count("recompute")
        kind = "prefill" if here else next((k for k in ("received", "decode") if k in kinds), None)
        cells.append(None if kind is None else (kind, t("tiers.tip_decode_step", step=step.index,
                                                        received=kinds.count("received"),
                                                        here=here,
                                                        decodes=kinds.count("decode"))))
    gone = None if server.connector.failure is None else server.connector.failure[1]
    st.html(svg.worker_lanes_svg(len(steps), boxes, cells, gone, (t("tiers.lane_prefill"), t("tiers.lane_decode")),
                                 t("serving.axis_step"), t("tiers.lanes_alt", transfers=len(transfers))))
    st.html(legend_html({t("tiers.legend_" + kind): colour for kind, colour in svg.WORKER_COLOURS.items()}))


def draw_transfers(server: Engine, model: LoadedModel) -> None:
    """Each transfer's bytes beside the cache formula's."""
    transfers = server.connector.transfers
    rows = [[x.request, x.step, number(x.positions), number(x.bytes), formula_text(model, x.positions),
             t("paged.same" if x.bytes == x.bytes_formula else "paged.not_same"), ms(x.ms), ms(x.prefill_ms)]
            for x in transfers]
    if rows:
        st.html(table_html([t("tiers.col_request"), t("tiers.col_received_at"), t("tiers.col_positions"),
                            t("tiers.col_bytes"), t("tiers.col_formula"), t("tiers.col_equal"), t("tiers.col_recv_ms"),
                            t("tiers.col_prefill_ms")], rows))
    st.caption(t("tiers.transfers_caption"))
