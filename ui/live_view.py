"""The Live server page's pictures and tables, from ui/live_server's EngineState: the block pool by request (the
Paged KV page's grid, ui/svg.block_grid_svg, with the student's own blocks framed), the lanes of the last steps
(svg.span_lanes_svg), what happened at each step, the latency tables by the course's two axes, and the picture of
the set-up shown while no server answers. The poll itself is shared by every session of the process (one GET per
POLL_SHARED_S whatever the size of the class)."""

from __future__ import annotations

from html import escape
from urllib.parse import urlsplit

import numpy as np
import streamlit as st

from ui import svg
from ui.i18n import decimal, number, t
from ui.live_server import EngineState, LatencyRow, ServerDown, answers_api, fetch_state
from ui.pool_view import pool_tips, request_legend
from ui.widgets import legend_html, table_html

POLL_SHARED_S = 0.4  # a snapshot serves every session that asks within this long
# the most blocks drawn one by one: a grid of 512 is about 150 KB of SVG, sent to every student at each step of a
# busy server (an unchanged picture is sent as a hash only: Streamlit's message cache); past it, one bar
LIVE_GRID_BLOCKS = 512
EVENTS_SHOWN = 8


@st.cache_resource(ttl=POLL_SHARED_S, max_entries=16, show_spinner=False)
def _poll(url: str, api_key: str) -> EngineState | ServerDown:
    try:
        return fetch_state(url, api_key)
    except ServerDown as down:
        return down


def poll(url: str, api_key: str) -> EngineState | ServerDown:
    """The server's state as of at most POLL_SHARED_S ago, or why it could not be read."""
    return _poll(url.strip(), api_key.strip())


@st.cache_resource(ttl=60, max_entries=16, show_spinner=False)
def origin_answers_api(origin: str, api_key: str) -> bool:
    """Whether the address the browser opened the page at serves the API too (asked once a minute)."""
    return answers_api(origin, api_key)


def browser_origin() -> str | None:
    """scheme://host:port of the address the browser opened the page at, None where it is not known."""
    url = st.context.url
    if not url:
        return None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme in ("http", "https") and parts.netloc else None


def down_sentence(down: ServerDown, url: str) -> str:
    """One sentence for a server that could not be read, and how to start one."""
    return t("live.down_" + down.reason, url=url, detail=down.detail, command="python -m model serve --model smollm2")


# -- the pool ---------------------------------------------------------------------------------------------------------

def marked_blocks(state: EngineState, mine: set[int]) -> np.ndarray:
    """Blocks in the tables of the student's requests (a shared block too, though its colour is its first
    holder's)."""
    marked = np.zeros(state.n_blocks, dtype=bool)
    for rid in mine & state.tables.keys():
        for group in state.tables[rid]:
            for block in group:
                if 0 <= block < state.n_blocks:
                    marked[block] = True
    return marked


def drawn_by_block(state: EngineState) -> bool:
    """Whether the pool is drawn block by block (else one bar, where no block can be framed)."""
    return state.n_blocks <= LIVE_GRID_BLOCKS


def pool_html(state: EngineState, mine: set[int]) -> str:
    """The pool block by block (one bar past LIVE_GRID_BLOCKS), and its legend."""
    free = int((state.holder < 0).sum())
    alt = t("paged.pool_alt", blocks=state.n_blocks, free=free)
    if not drawn_by_block(state):
        held = {int(r): int((state.holder == r).sum()) for r in set(state.holder[state.holder >= 0].tolist())}
        picture = svg.pool_bar_svg(state.holder, {r: t("paged.tip_request", request=r, blocks=number(n))
                                                  for r, n in held.items()},
                                   t("paged.tip_free_many", blocks=number(free)), alt)
        summary = t("paged.pool_summary", blocks=number(state.n_blocks), most=number(LIVE_GRID_BLOCKS))
        picture += f'<p class="dl-caption">{escape(summary)}</p>'
    else:
        picture = svg.block_grid_svg(state.holder, state.refs, state.cached, np.zeros(state.n_blocks, dtype=bool),
                                     state.filled, state.block_size, pool_tips(state), alt,
                                     marked=marked_blocks(state, mine))
    holders = sorted(set(state.holder[state.holder >= 0].tolist()) | set(state.tables))
    extra = ('<div class="legend">'
             f'<span><i style="background:{svg.FREE_BLOCK};outline:1px dashed {svg.MUTED_INK}"></i>'
             f'{escape(t("live.legend_cached"))}</span>'
             f'<span><i style="background:#fff;outline:3px solid {svg.MINE_INK}"></i>'
             f'{escape(t("live.legend_mine"))}</span></div>')
    return picture + request_legend(holders, bool((state.refs > 1).any())) + (extra if drawn_by_block(state) else "")


def free_cached(state: EngineState) -> int:
    return int(((state.holder < 0) & state.cached).sum())


# -- the last steps ---------------------------------------------------------------------------------------------------

SPAN_COLOURS = {**svg.SPAN_COLOURS, "received": svg.WORKER_COLOURS["received"]}


def lanes_html(state: EngineState) -> str:
    """What each request did in each of the last steps (a column per step, its real number under it): a prompt
    chunk, positions computed again, a decode, or keys and values received; a red cross where it was preempted."""
    steps = state.steps
    rows = sorted({s.request for step in steps for s in step.spans} | {r for step in steps for r in step.preempted})
    at = {rid: k for k, rid in enumerate(rows)}
    cells: list[list] = [[None] * len(steps) for _ in rows]
    marks = [[False] * len(steps) for _ in rows]
    for column, step in enumerate(steps):
        for span in step.spans:
            tip = t("live.tip_" + span.kind, request=span.request, step=step.index, start=span.start,
                    stop=span.stop - 1, n=span.stop - span.start)
            cells[at[span.request]][column] = (span.kind, tip)
        for rid in step.preempted:
            marks[at[rid]][column] = True
    kinds = {kind for step in steps for span in step.spans for kind in [span.kind]}
    legend = {t("live.legend_" + kind): colour for kind, colour in SPAN_COLOURS.items() if kind in kinds}
    picture = svg.span_lanes_svg(rows, cells, marks, t("serving.axis_step"), t("paged.axis_request"),
                                 t("live.lanes_alt", steps=len(steps)), SPAN_COLOURS,
                                 first_step=steps[0].index if steps else 0)
    return picture + legend_html(legend)


def events(state: EngineState) -> list[tuple[str, str]]:
    """What happened in the last steps, newest first: (kind, sentence), kind "preempted", "hit", "admitted" or
    "left"."""
    found = []
    for step in reversed(state.steps):
        for rid in step.preempted:
            found.append(("preempted", t("live.event_preempted", step=number(step.index), request=rid)))
        for rid in step.admitted:
            hit = step.cached_positions.get(rid, 0)
            found.append(("hit", t("live.event_hit", step=number(step.index), request=rid, n=number(hit)))
                         if hit else ("admitted", t("live.event_admitted", step=number(step.index), request=rid)))
        for rid in step.left:
            found.append(("left", t("live.event_left", step=number(step.index), request=rid)))
    return found


def shown_events(found: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """At most EVENTS_SHOWN of the events, in their order: every preemption and prefix hit first, then the
    others."""
    urgent = [k for k, (kind, _) in enumerate(found) if kind in ("preempted", "hit")][:EVENTS_SHOWN]
    rest = [k for k, (kind, _) in enumerate(found) if kind not in ("preempted", "hit")][:EVENTS_SHOWN - len(urgent)]
    return [found[k] for k in sorted(urgent + rest)]


EVENT_STYLE = {"preempted": "color:#c92a2a;font-weight:600", "hit": "color:#1f5fbf;font-weight:600",
               "admitted": "", "left": ""}


def events_html(state: EngineState) -> str:
    """The latest EVENTS_SHOWN events, newest first, preemptions and prefix hits before the others (a busy server's
    arrivals and departures would push them out of sight)."""
    said = shown_events(events(state))
    if not said:
        return f'<p class="dl-caption">{escape(t("live.no_events", steps=len(state.steps)))}</p>'
    return ('<ul style="margin:0 0 0.5rem 1.2rem;padding:0;line-height:1.5">'
            + "".join(f'<li style="{EVENT_STYLE[kind]}">{escape(sentence)}</li>' for kind, sentence in said)
            + "</ul>")


def queue_html(state: EngineState, mine: set[int]) -> str:
    """The running and the waiting requests as chips in their colours, the student's own marked."""
    def chips(rids: tuple[int, ...]) -> str:
        if not rids:
            return f'<span style="color:{svg.MUTED_INK}">{escape(t("live.queue_empty"))}</span>'
        return "".join(
            f'<b style="display:inline-block;min-width:2em;margin:0 0.25em 0.25em 0;padding:0.1em 0.35em;'
            f'border-radius:0.3em;text-align:center;background:{svg.lane_colour(r)};'
            + (f'outline:3px solid {svg.MINE_INK};' if r in mine else "")
            + f'" title="{escape(state.requests[r].id if r in state.requests else str(r))}">{r}</b>' for r in rids)
    return (f'<div style="line-height:2">{escape(t("live.running"))}: {chips(state.running)}</div>'
            f'<div style="line-height:2">{escape(t("live.waiting"))}: {chips(state.waiting)}</div>')


# -- latency by the course's two axes ---------------------------------------------------------------------------------

def bucket_name(row: LatencyRow) -> str:
    if row.last is None:
        return t("live.bucket_above", first=number(row.first))
    return number(row.first) if row.first == row.last else f"{number(row.first)}–{number(row.last)}"


def latency_table(rows: list[LatencyRow], axis: str) -> str:
    def ms(values: dict[int, float] | None, q: int) -> str:
        return "—" if values is None else decimal(values[q])

    return table_html(
        [t("live.col_" + axis), t("live.col_requests"), "TTFT p50", "TTFT p95", "TTFT p99", "ITL p50", "ITL p95",
         "ITL p99"],
        [[bucket_name(r), number(r.requests), *(ms(r.ttft_ms, q) for q in (50, 95, 99)),
          *(ms(r.itl_ms, q) for q in (50, 95, 99))] for r in rows])


# -- no server: the set-up as a picture -------------------------------------------------------------------------------

def setup_svg() -> str:
    """The class's laptops sending to one server, whose engine this page reads: three boxes and their arrows."""
    width, height, font = svg.LANE_WIDTH, 250, svg.LANE_FONT_PX
    boxes = [(10, t("live.setup_clients"), t("live.setup_clients_what")),
             (370, t("live.setup_server"), t("live.setup_server_what")),
             (730, t("live.setup_page"), t("live.setup_page_what"))]
    parts = [f'<defs><marker id="head" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="8" markerHeight="8" '
             f'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="{svg.INK}"/></marker></defs>']
    for x, name, what in boxes:
        parts.append(f'<rect x="{x}" y="40" width="260" height="150" rx="10" fill="#f1f3f5" stroke="{svg.INK}" '
                     f'stroke-width="2"/><text x="{x + 130}" y="75" text-anchor="middle" font-weight="600">'
                     f"{escape(name)}</text>")
        for k, line in enumerate(what.split("\n")):
            parts.append(f'<text x="{x + 130}" y="{112 + k * 28}" text-anchor="middle">{escape(line)}</text>')
    parts.append(f'<line x1="272" y1="115" x2="366" y2="115" stroke="{svg.INK}" stroke-width="3" '
                 f'marker-end="url(#head)"/><text x="319" y="30" text-anchor="middle">'
                 f"{escape(t('live.setup_send'))}</text>")
    parts.append(f'<line x1="726" y1="115" x2="634" y2="115" stroke="{svg.INK}" stroke-width="3" '
                 f'stroke-dasharray="8 5" marker-end="url(#head)"/><text x="680" y="225" text-anchor="middle">'
                 f"{escape(t('live.setup_poll'))}</text>")
    return svg._svg(width, height, t("live.setup_alt"), parts, font)
