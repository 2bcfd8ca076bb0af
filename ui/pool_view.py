"""The block pool as the Paged KV and Tiers pages draw it, and the budget that buys it: a grid of blocks as wide as
the main column, each held block in its request's colour with its number, under a legend that ties each request's
colour to its number, the free blocks' grey and the waste's white (a pool too large to draw block by block is one
bar), and what each request did at each step; the budget chosen on a slider that writes its values in the
session's number format."""

from __future__ import annotations

from html import escape

import streamlit as st

from model.engine.generate import session_budget_bytes
from model.serving.engine import Engine
from model.serving.memory import PoolView
from ui import svg
from ui.i18n import decimal, number, t
from ui.widgets import legend_html

# the budgets a slider offers, in MiB: each range's step (0.01 up to 1 MiB, then coarser), up to the session's
BUDGET_STEPS = ((1.0, 0.01), (4.0, 0.05), (16.0, 0.25), (64.0, 1.0), (float("inf"), 4.0))


def budget_options(most: float, current: float) -> list[float]:
    """The budgets from 0.01 MiB to `most` in BUDGET_STEPS, `most` itself and the current value among them."""
    options, value = [], 0.0
    for top, step in BUDGET_STEPS:
        while value < min(top, most) - 1e-9:
            value = round(value + step, 2)
            options.append(min(value, round(most, 2)))
    return sorted(set(options) | {round(min(current, most), 2)})


def budget_slider(key: str, help_text: str) -> None:
    """The cache budget (MiB, state[key] a float) on a slider whose values read as the session's language writes
    them (0,65 in Vietnamese, 0.65 in English), up to the session's own budget."""
    most = session_budget_bytes() / 2**20
    st.session_state[key] = round(min(float(st.session_state[key]), most), 2)
    written = {v: decimal(v, 2) for v in budget_options(most, st.session_state[key])}  # in this run's language
    st.select_slider(t("paged.budget"), list(written), key=key, format_func=written.get, help=help_text, width=360)


def pool_tips(pool: PoolView) -> list[str]:
    """Each block's tooltip: free (and whether the prefix cache still finds it), or whose and how full."""
    tips = []
    for b in range(len(pool.holder)):
        if pool.holder[b] < 0:
            tips.append(t("paged.tip_free_cached" if pool.cached[b] else "paged.tip_free", block=b))
        else:
            tips.append(t("paged.tip_held", block=b, request=int(pool.holder[b]), filled=int(pool.filled[b]),
                          size=pool.block_size, refs=int(pool.refs[b])))
    return tips


def draw_pool(pool: PoolView) -> None:
    """The pool block by block (svg.block_grid_svg), or one bar past svg.MAX_GRID_BLOCKS."""
    n_blocks = len(pool.holder)
    free = int((pool.holder < 0).sum())
    if n_blocks > svg.MAX_GRID_BLOCKS:  # too many squares to draw (or to send to 30 browsers): one bar, in summary
        held = {int(r): int((pool.holder == r).sum()) for r in set(pool.holder[pool.holder >= 0].tolist())}
        st.html(svg.pool_bar_svg(pool.holder, {r: t("paged.tip_request", request=r, blocks=number(n))
                                               for r, n in held.items()},
                                 t("paged.tip_free_many", blocks=number(free)),
                                 t("paged.pool_alt", blocks=n_blocks, free=free)))
        st.caption(t("paged.pool_summary", blocks=number(n_blocks), most=number(svg.MAX_GRID_BLOCKS)))
    else:
        st.html(svg.block_grid_svg(pool.holder, pool.refs, pool.cached, pool.sliding, pool.filled, pool.block_size,
                                   pool_tips(pool), t("paged.pool_alt", blocks=n_blocks, free=free)))


def request_legend(requests: list[int], shared: bool = False) -> str:
    """Each request's number on its colour, as the blocks show it, then the free block's grey, the waste's white
    and (where some block is shared) the shared block's dark frame: HTML for st.html."""
    chip = ("display:inline-block;min-width:1.7em;margin-left:0.25em;padding:0 0.2em;border-radius:0.25em;"
            "text-align:center;font-weight:600;text-shadow:0 0 2px #fff,0 0 2px #fff")
    chips = "".join(f'<b style="{chip};background:{svg.lane_colour(r)}">{r}</b>' for r in requests)
    swatches = {t("paged.legend_free"): f"background:{svg.FREE_BLOCK};outline:1px solid #495057",
                t("paged.legend_waste"): "background:#fff;outline:1px solid #495057"}
    if shared:
        swatches[t("paged.legend_shared")] = f"background:#fff;outline:2px solid {svg.INK}"
    return (f'<div class="legend"><span>{escape(t("paged.legend_requests"))}{chips}</span>'
            + "".join(f'<span><i style="{style}"></i>{escape(name)}</span>' for name, style in swatches.items())
            + "</div>")



def draw_request_lanes(server: Engine) -> None:
    """What each request did at each step (svg.span_lanes_svg: its prompt, a recompute, a decode, waiting; a cross
    where it was preempted) and the legend; with a second tier, the steps its blocks waited there, from the step
    that moved them out to the one that brought them back."""
    steps, ids = server.steps, sorted(server.requests)
    cells = {rid: [None] * len(steps) for rid in ids}
    marks = {rid: [False] * len(steps) for rid in ids}
    away: set[int] = set()  # requests whose blocks are in the tier
    for step in steps:
        for rid, what in step.tier:
            if what == "out":
                away.add(rid)
            elif what in ("in", "damaged"):
                away.discard(rid)
        done = {span.request for span in step.spans}
        for span in step.spans:
            cells[span.request][step.index] = (span.kind, t("paged.tip_" + span.kind, request=span.request,
                                                             step=step.index, start=span.start, stop=span.stop - 1))
        for rid in step.preempted:
            marks[rid][step.index] = True
        for rid in ids:
            request = server.requests[rid]
            arrived = request.arrival_step <= step.index
            left = request.left_step is not None and request.left_step < step.index
            if rid not in done and arrived and not left:
                cells[rid][step.index] = (("out", t("tiers.tip_in_tier", request=rid, step=step.index)) if rid in away
                                          else ("waiting", t("paged.tip_waiting", request=rid, step=step.index)))
    colours = {t("paged.legend_" + kind): colour for kind, colour in svg.SPAN_COLOURS.items()}
    kinds = dict(svg.SPAN_COLOURS)
    if server.offload is not None:
        colours[t("tiers.legend_in_tier")] = kinds["out"] = svg.IN_TIER
    st.html(svg.span_lanes_svg(ids, [cells[rid] for rid in ids], [marks[rid] for rid in ids], t("serving.axis_step"),
                               t("paged.axis_request"), t("paged.lanes_alt"), kinds))
    st.html(legend_html(colours))
