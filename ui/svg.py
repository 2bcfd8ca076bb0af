"""The charts a click redraws, as SVG images: nothing to load or run in the browser but the picture itself.

A Decode Next click redraws the attention triangle and the bytes per step; a Flash Next click the tile grid and
the running output. As plotly figures they cost the browser more than the rest of the click together
(benchmarks/click_latency.py); as an <img> of SVG each is one element inside a piece of st.html.
A grid of cells is one PNG image, a pixel per cell scaled up, so the page does not grow with the square of the
context.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from html import escape

import numpy as np
from PIL import Image

from ui.charts import CHOSEN, KEPT

# ColorBrewer's YlGnBu, from light (no attention) to dark (all of it), as in the Prefill page's heatmaps
SCALE = ("#ffffd9", "#edf8b1", "#c7e9b4", "#7fcdbb", "#41b6c4", "#1d91c0", "#225ea8", "#253494", "#081d58")
# ColorBrewer's RdBu reversed, for values of either sign: blue below 0, white at 0, red above
DIVERGING = ("#053061", "#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#f7f7f7", "#fddbc7", "#f4a582", "#d6604d",
             "#b2182b", "#67001f")
INK, GRID_INK, MUTED_INK = "#212529", "#dee2e6", "#6c757d"
FONT_FAMILY = "'Source Sans Pro', 'Source Sans 3', 'Helvetica Neue', Arial, sans-serif"  # an image sees no web font
FONT_PX, CHAR_PX = 14, 8  # label font size, and the width of one character, to make room for labels
HEAT_SIDE = (240, 340)  # the triangle's side in pixels, the smallest and the largest
CELL_PX = 24  # a cell's side while the triangle is small enough
GAP_FROM_PX = 6  # cells this wide or wider get a white line between them
LABEL_CHARS = 14


def rgb(hex_colours) -> np.ndarray:
    """("#rrggbb", ...) -> (n, 3) float RGB."""
    return np.array([[int(c[i:i + 2], 16) for i in (1, 3, 5)] for c in hex_colours], dtype=np.float64)


def colours(values: np.ndarray, scale: tuple[str, ...] = SCALE) -> np.ndarray:
    """values in [0, 1] -> (..., 3) uint8 RGB along the scale's stops, linearly between them."""
    stops = rgb(scale)
    position = np.clip(values, 0.0, 1.0) * (len(scale) - 1)
    low = np.minimum(position.astype(int), len(scale) - 2)
    part = (position - low)[..., None]
    return np.round(stops[low] * (1 - part) + stops[low + 1] * part).astype(np.uint8)


def png_data_uri(pixels: np.ndarray, palette: np.ndarray | None = None) -> str:
    """(H, W, 3) uint8 RGB, or (H, W) uint8 indices into palette (n ≤ 256, 3) -> a data: URI of a PNG (fast
    compression: these images are flat colour)."""
    buffer = io.BytesIO()
    if palette is None:
        image = Image.fromarray(pixels, "RGB")
    else:
        image = Image.fromarray(pixels, "P")
        image.putpalette(palette.astype(np.uint8).tobytes())
    image.save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


TRIANGLE_SHADES = 255  # a weight is drawn in one of 255 shades of the scale, 0 to 1 (1/254 apart)
# index 0: white, for exact zeros (the future, rows not kept); index i ≥ 1: the scale at (i − 1) / 254
TRIANGLE_PALETTE = np.vstack([[255, 255, 255], colours(np.linspace(0.0, 1.0, TRIANGLE_SHADES))]).astype(np.uint8)


def triangle_pixels(weights: np.ndarray) -> np.ndarray:
    """weights (S, S) -> (S, S) indices into TRIANGLE_PALETTE, a pixel per cell: a paletted PNG is a third of an RGB
    one's bytes and quick to make (a 245-position triangle: 13.7 KB in 1 ms, against 35 KB in 39 ms)."""
    shade = np.round(np.clip(weights, 0.0, 1.0) * (TRIANGLE_SHADES - 1)).astype(np.uint8) + 1
    return np.where(weights > 0, shade, np.uint8(0))


def _label(text: str) -> str:
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"


@dataclass(frozen=True)
class SquareFrame:
    """Where a square grid of n × n cells sits, with room for its labels: rows on the left, columns on top,
    slanted; when labels would crowd, every k-th position is shown by its number (ticks)."""

    n: int
    side: int  # the grid's side in pixels
    left: int
    top: int
    text_px: int  # the longest shown label's width
    ticks: range
    labels: list[str]

    @property
    def cell(self) -> float:
        return self.side / self.n

    def label_parts(self) -> list[str]:
        parts = []
        for i in self.ticks:
            centre = (i + 0.5) * self.cell
            text = escape(self.labels[i])
            parts.append(f'<text x="{self.left - 6}" y="{self.top + centre:.1f}" text-anchor="end" '
                         f'dominant-baseline="middle">{text}</text>')
            parts.append(f'<text transform="translate({self.left + centre:.1f},{self.top - 6}) rotate(-45)">'
                         f"{text}</text>")
        return parts

    def cell_lines(self) -> list[str]:
        """White lines between the cells, while the cells are wide enough to show them."""
        if self.cell < GAP_FROM_PX:
            return []
        lines = "".join(f"M{self.left + k * self.cell:.1f} {self.top}v{self.side}"
                        f"M{self.left} {self.top + k * self.cell:.1f}h{self.side}" for k in range(1, self.n))
        return [f'<path d="{lines}" stroke="#fff" stroke-width="1"/>']


def square_frame(labels: list[str], side: int, margin_left: int = 0, margin_top: int = 0) -> SquareFrame:
    """The frame of a side × side grid over `labels`, shifted by the margins (room for axis titles)."""
    n = len(labels)
    every = math.ceil(n / max(1, side // (FONT_PX + 3)))
    # every k-th label only: then positions alone, tokens at every k-th position would say little and take room
    shown_labels = [_label(label) for label in labels] if every == 1 else [str(i) for i in range(n)]
    ticks = range(0, n, every)
    text_px = CHAR_PX * max(len(shown_labels[i]) for i in ticks)
    left, top = margin_left + round(text_px) + 10, margin_top + round(text_px * 0.71) + 14  # 0.71: sin 45°
    return SquareFrame(n, side, left, top, text_px, ticks, shown_labels)


def _image(x: float, y: float, width: float, height: float, pixels: np.ndarray,
           palette: np.ndarray | None = None) -> str:
    """A PNG of one pixel per cell (png_data_uri), stretched over the rectangle without smoothing."""
    return (f'<image x="{x}" y="{y}" width="{width}" height="{height}" preserveAspectRatio="none" '
            f'style="image-rendering:pixelated" href="{png_data_uri(pixels, palette)}"/>')


def _colour_bar(x: float, top: float, height: float, scale: tuple[str, ...], ticks: list[tuple[float, str]],
                gradient_id: str) -> list[str]:
    """A vertical bar of the scale, bottom to top, with (fraction of the height from the bottom, text) ticks."""
    stops = "".join(f'<stop offset="{k / (len(scale) - 1):.3f}" stop-color="{c}"/>' for k, c in enumerate(scale))
    parts = [f'<defs><linearGradient id="{gradient_id}" x1="0" y1="1" x2="0" y2="0">{stops}</linearGradient>'
             f'</defs><rect x="{x}" y="{top}" width="14" height="{height}" fill="url(#{gradient_id})" '
             f'stroke="{GRID_INK}"/>']
    parts += [f'<text x="{x + 20}" y="{top + height * (1 - at):.1f}" dominant-baseline="middle">{escape(text)}</text>'
              for at, text in ticks]
    return parts


def _heatmap_frame(labels: list[str]) -> tuple[SquareFrame, int, int]:
    """The triangle's frame and the picture's width and height."""
    side = min(HEAT_SIDE[1], max(HEAT_SIDE[0], CELL_PX * len(labels)))
    frame = square_frame(labels, side)
    width = max(frame.left + side + 14 + 52, round(frame.left + side + frame.text_px * 0.71))
    return frame, width, frame.top + side + 6


def heatmap_svg(weights: np.ndarray, labels: list[str], description: str, colours: np.ndarray | None = None,
                ticks: list[tuple[float, str]] | None = None) -> str:
    """A lower-triangular attention map, weights (queries, keys) over the same positions `labels`, on a fixed
    0–1 colour scale with its bar. `description` is the picture's accessible name. colours: each cell's place on the
    scale when it is not the weight itself (ui/charts.attention_colours), with the bar's (place, text) ticks."""
    frame, width, height = _heatmap_frame(labels)
    left, top, side = frame.left, frame.top, frame.side
    bar_x = left + side + 14
    parts = [_image(left, top, side, side, triangle_pixels(weights if colours is None else colours),
                    TRIANGLE_PALETTE),
             f'<rect x="{left}" y="{top}" width="{side}" height="{side}" fill="none" stroke="{GRID_INK}"/>',
             *frame.cell_lines(), *frame.label_parts(),
             *_colour_bar(bar_x, top, side, SCALE, ticks or [(1, "1"), (0.5, "0.5"), (0, "0")], "dl-heat-scale")]
    return _svg(width, height, description, parts)


HOVER_CELLS_UP_TO = 32  # positions up to which every cell has its own hover text (528 cells); beyond, each row one
HOVER_ROW_TOP = 3  # a row's hover text beyond that: its largest weights
HOVER_BANDS = 64  # the most hover texts over a long triangle: past 64 rows, bands of consecutive rows share one


def _row_said(weights: np.ndarray, labels: list[str], rows_kept: np.ndarray, not_kept: str, q: int) -> str:
    """Row q's hover line: "query → its largest weights", or `not_kept`."""
    if not rows_kept[q]:
        return f"{labels[q]}: {not_kept}"
    top = np.argsort(-weights[q, : q + 1], kind="stable")[:HOVER_ROW_TOP]
    return f"{labels[q]} → " + " · ".join(f"{labels[k]} {float(weights[q, k]):.4f}" for k in top)


def _hover_rows(weights: np.ndarray, labels: list[str], rows_kept: np.ndarray, not_kept: str) -> str:
    """Hover texts over the triangle's rows: per cell "query → key: weight" while the triangle is small, per row
    "query → its largest weights" beyond, and past HOVER_BANDS rows one text per band of consecutive rows, a line
    per row (a row of a 340-pixel triangle is then under 6 pixels high, and an element per row would make every
    click cost the browser more); a row not kept says `not_kept`."""
    n = len(labels)
    if n <= HOVER_CELLS_UP_TO:
        rows = []
        for q in range(n):
            if rows_kept[q]:
                cells = "".join(f'<i title="{escape(f"{labels[q]} → {labels[k]}: {float(weights[q, k]):.4f}")}"></i>'
                                for k in range(q + 1))
            else:
                cells = f'<i title="{escape(f"{labels[q]}: {not_kept}")}" style="width:{100 * (q + 1) / n:.3f}%"></i>'
            rows.append(f"<div>{cells}</div>")
        return "".join(rows)
    band = math.ceil(n / HOVER_BANDS)
    bands = []
    for first in range(0, n, band):
        end = min(n, first + band)
        said = "\n".join(_row_said(weights, labels, rows_kept, not_kept, q) for q in range(first, end))
        bands.append(f'<div style="flex:{end - first}"><i title="{escape(said)}" '
                     f'style="width:{100 * end / n:.3f}%"></i></div>')
    return "".join(bands)


def heatmap_html(weights: np.ndarray, labels: list[str], description: str, rows_kept: np.ndarray,
                 not_kept: str, colours: np.ndarray | None = None, ticks: list[tuple[float, str]] | None = None) -> str:
    """heatmap_svg with hover values: a grid of empty elements with titles laid over the picture's triangle, in
    fractions of the picture, so it follows the picture when the column shrinks it. rows_kept (S,) bool: the rows
    whose weights are there; the others' hover says `not_kept`."""
    frame, width, height = _heatmap_frame(labels)
    place = (f"left:{100 * frame.left / width:.3f}%;top:{100 * frame.top / height:.3f}%;"
             f"width:{100 * frame.side / width:.3f}%;height:{100 * frame.side / height:.3f}%;--n:{len(labels)}")
    picture = heatmap_svg(weights, labels, description, colours, ticks)
    return (f'<div class="dl-heat" style="max-width:{width}px">{picture}'
            f'<div class="dl-hover" style="{place}">{_hover_rows(weights, labels, rows_kept, not_kept)}</div></div>')


# -----------------------------------------------------------------------------
# the Flash page: the tile walk over the score grid, and the running output of the query block

TILE_STATES = ("masked", "skipped", "todo", "done", "current")  # the order of the codes 0..4 in tile_states
TILE_COLOURS = {"masked": "#ffffff", "skipped": "#ffc9c9", "todo": "#dee2e6", "done": "#a5d8ff",
                "current": "#ffa94d"}
TILE_GRID_SIDE = (220, 420)  # the grid's side in pixels, the smallest and the largest
TILE_CELL_PX = 60  # a cell's side while the grid is small enough
SCORES_UP_TO = 12  # positions up to which each computed score is printed in its cell
MARKS_UP_TO = 256  # tiles up to which a skipped tile is marked ✕
FRAME_INK, CURRENT_INK, MARK_INK = "#343a40", "#d9480f", "#c92a2a"


def tile_states(steps: list, current: int) -> tuple[np.ndarray, np.ndarray]:
    """The N×N score grid of a tiled walk over a prefill (steps: model.flash.TileStep in walk order; current: the
    index of the tile being read) -> (state codes into TILE_STATES, the scores computed so far or NaN).
    masked: above the causal diagonal inside a tile that is read; skipped: a whole tile above the diagonal, whose
    K and V are never read."""
    n = steps[-1].q_rows[1]
    code = {s: i for i, s in enumerate(TILE_STATES)}
    state = np.full((n, n), code["todo"])
    scores = np.full((n, n), np.nan)
    for i, step in enumerate(steps):
        (r0, r1), (c0, c1) = step.q_rows, step.k_cols
        if step.skipped:
            state[r0:r1, c0:c1] = code["skipped"]
            continue
        visible = np.isfinite(step.scores)  # (Bq, Bk)
        if i <= current:
            scores[r0:r1, c0:c1] = np.where(visible, step.scores, np.nan)
            state[r0:r1, c0:c1] = np.where(visible, code["current" if i == current else "done"], code["masked"])
        else:
            state[r0:r1, c0:c1] = np.where(visible, code["todo"], code["masked"])
    return state, scores


def fixed(value: float, places: int) -> str:
    return f"{value:.{places}f}"


def tile_grid_svg(steps: list, current: int, labels: list[str], axis_names: tuple[str, str],
                  description: str, decimal: Callable[[float, int], str] = fixed, zoom: float = 1.0) -> str:
    """The score grid of the walk (tile_states): each cell coloured by its state, bold lines between the blocks,
    the tile being read framed, skipped tiles marked ✕, and each computed score printed while the cells are big,
    by `decimal` (value, places: the page's decimal mark). axis_names: (keys, queries); `zoom`: how far it may grow
    past its size (presenter mode)."""
    state, scores = tile_states(steps, current)
    n = len(labels)
    side = min(TILE_GRID_SIDE[1], max(TILE_GRID_SIDE[0], TILE_CELL_PX * n))
    frame = square_frame(labels, side, margin_left=22, margin_top=22)  # room for the axis titles
    left, top, cell = frame.left, frame.top, frame.cell
    width, height = round(left + side + max(14, frame.text_px * 0.71)), top + side + 6
    pixels = rgb([TILE_COLOURS[s] for s in TILE_STATES]).astype(np.uint8)[state]  # (n, n, 3)
    parts = [_image(left, top, side, side, pixels), *frame.cell_lines()]
    block_q, block_k = (steps[0].q_rows[1] - steps[0].q_rows[0]), (steps[0].k_cols[1] - steps[0].k_cols[0])
    borders = "".join(f"M{left + e * cell:.1f} {top}v{side}" for e in range(block_k, n, block_k) if block_k > 1)
    borders += "".join(f"M{left} {top + e * cell:.1f}h{side}" for e in range(block_q, n, block_q) if block_q > 1)
    if borders:  # with block 1 the white lines between the cells already are the borders
        parts.append(f'<path d="{borders}" stroke="{FRAME_INK}" stroke-width="2"/>')
    parts.append(f'<rect x="{left}" y="{top}" width="{side}" height="{side}" fill="none" stroke="{FRAME_INK}"/>')
    if n <= SCORES_UP_TO:
        digits = 2 if n <= 6 else 1  # the numbers must fit their cell
        parts += [f'<text x="{left + (c + 0.5) * cell:.1f}" y="{top + (r + 0.5) * cell:.1f}" text-anchor="middle" '
                  f'dominant-baseline="middle" font-size="13">{decimal(scores[r, c], digits)}</text>'
                  for r in range(n) for c in range(n) if np.isfinite(scores[r, c])]
    if len(steps) <= MARKS_UP_TO:
        parts += [f'<text x="{left + sum(s.k_cols) / 2 * cell:.1f}" y="{top + sum(s.q_rows) / 2 * cell:.1f}" '
                  f'text-anchor="middle" dominant-baseline="middle" fill="{MARK_INK}" '
                  f'font-size="{min(16, max(8, round(cell * block_q * 0.6)))}">✕</text>' for s in steps if s.skipped]
    now = steps[current]
    parts.append(f'<rect x="{left + now.k_cols[0] * cell:.1f}" y="{top + now.q_rows[0] * cell:.1f}" '
                 f'width="{(now.k_cols[1] - now.k_cols[0]) * cell:.1f}" '
                 f'height="{(now.q_rows[1] - now.q_rows[0]) * cell:.1f}" fill="none" stroke="{CURRENT_INK}" '
                 f'stroke-width="4"/>')
    keys, queries = axis_names
    parts += frame.label_parts()
    parts.append(f'<text x="{left + side / 2:.1f}" y="16" text-anchor="middle" fill="{MUTED_INK}">'
                 f"{escape(keys)}</text>"
                 f'<text transform="translate(16,{top + side / 2:.1f}) rotate(-90)" text-anchor="middle" '
                 f'fill="{MUTED_INK}">{escape(queries)}</text>')
    return _svg(width, height, description, parts, zoom=zoom)


def output_svg(values: np.ndarray, row_labels: list[str], description: str,
               decimal: Callable[[float, int], str] = fixed, zoom: float = 1.0) -> str:
    """values (rows, d_head), e.g. a running output, on a scale symmetric around 0 (blue < 0 < red) with its bar;
    each value printed while there are few, by `decimal` (value, places). Rows labelled on the left (every k-th
    where they would crowd), dimensions below; `zoom` as in tile_grid_svg."""
    rows, d = values.shape
    limit = float(np.max(np.abs(values))) or 1.0
    plot_w, plot_h = 330, max(72, min(320, 30 * rows))  # a single row still leaves room for the bar's three ticks
    row_px, col_px = plot_h / rows, plot_w / d
    shown_labels = [_label(label) for label in row_labels]
    every = math.ceil(rows / max(1, plot_h // (FONT_PX + 3)))
    left, top = round(CHAR_PX * max(len(label) for label in shown_labels)) + 10, 8
    bar_x = left + plot_w + 14
    width, height = bar_x + 20 + CHAR_PX * len(f"−{limit:.2g}"), top + plot_h + 24
    parts = [_image(left, top, plot_w, plot_h, colours((values / limit + 1) / 2, DIVERGING))]
    parts += [f'<text x="{left - 6}" y="{top + (r + 0.5) * row_px:.1f}" text-anchor="end" '
              f'dominant-baseline="middle">{escape(shown_labels[r])}</text>' for r in range(0, rows, every)]
    parts += [f'<text x="{left + (j + 0.5) * col_px:.1f}" y="{top + plot_h + 17}" text-anchor="middle">d{j}</text>'
              for j in range(0, d, max(1, d // 8))]
    if d <= 8 and rows <= 16:
        parts += [f'<text x="{left + (j + 0.5) * col_px:.1f}" y="{top + (r + 0.5) * row_px:.1f}" '
                  f'text-anchor="middle" dominant-baseline="middle" font-size="13" '
                  f'fill="{"#fff" if abs(values[r, j]) > 0.6 * limit else INK}">{decimal(values[r, j], 2)}</text>'
                  for r in range(rows) for j in range(d)]
    parts += _colour_bar(bar_x, top, plot_h, DIVERGING,
                         [(1, f"{limit:.2g}"), (0.5, "0"), (0, f"−{limit:.2g}")], "dl-diverging-scale")
    return _svg(width, height, description, parts, zoom=zoom)


def nice_ticks(top: float, most: int = 5) -> list[float]:
    """0 and round steps (1, 2, 2.5 or 5 × 10^k) up to the first tick at or above `top`: at most `most` steps."""
    if top <= 0:
        return [0]
    rough = top / most
    power = 10 ** math.floor(math.log10(rough))
    size = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= rough)
    return [size * i for i in range(math.ceil(top / size - 1e-9) + 1)]


def line_chart_svg(x: list[int], series: dict[str, list[float]], x_title: str, y_title: str, description: str,
                   dashed: tuple[str, ...] = (), number: Callable[[float], str] = str, title: str = "",
                   zoom: float = 1.0) -> str:
    """Lines over integer steps from y = 0, a title and a legend above, ticks at every step while there are at most
    20. `number` writes the y ticks (the page's thousands separator); `zoom`: how far it may grow past its size."""
    width, right, bottom, plot_h = 400, 14, 46, 190
    entries, legend_x, legend_y = [], 0, 36 if title else 14  # the legend wraps where a name would not fit
    for name in series:
        size = 32 + round(CHAR_PX * len(name))
        if legend_x and legend_x + size > width:
            legend_x, legend_y = 0, legend_y + 20
        entries.append((legend_x, legend_y))
        legend_x += size + 18
    top = legend_y + 22
    height = top + plot_h + bottom
    y_ticks = nice_ticks(max(max(ys) for ys in series.values()))
    left = round(CHAR_PX * max(len(number(v)) for v in y_ticks)) + 30
    plot_w = width - left - right
    x_ticks = x if len(x) <= 20 else [v for v in nice_ticks(x[-1]) if v <= x[-1]]
    span = max(1, x[-1] - x[0])

    def px(v: float) -> float:
        return left + (plot_w / 2 if len(x) == 1 else (v - x[0]) / span * plot_w)

    def py(v: float) -> float:
        return top + plot_h * (1 - v / y_ticks[-1]) if y_ticks[-1] else top + plot_h

    parts = [f'<text x="0" y="14" dominant-baseline="middle" font-weight="600">{escape(title)}</text>'] if title else []
    for v in y_ticks:
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(v):.1f}" y2="{py(v):.1f}" stroke="{GRID_INK}"/>'
                     f'<text x="{left - 6}" y="{py(v):.1f}" text-anchor="end" dominant-baseline="middle">'
                     f"{escape(number(v))}</text>")
    for v in x_ticks:
        parts.append(f'<text x="{px(v):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{v}</text>')
    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" text-anchor="middle">{escape(x_title)}</text>'
                 f'<text transform="translate(14,{top + plot_h / 2:.1f}) rotate(-90)" text-anchor="middle">'
                 f"{escape(y_title)}</text>")
    for (name, ys), colour, (lx, ly) in zip(series.items(), (KEPT, CHOSEN), entries):
        dash = ' stroke-dasharray="7 5"' if name in dashed else ""
        points = " ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in zip(x, ys))
        parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="3"{dash}/>')
        if len(x) <= 40:
            parts.extend(f'<circle cx="{px(a):.1f}" cy="{py(b):.1f}" r="4" fill="{colour}"/>' for a, b in zip(x, ys))
        parts.append(f'<line x1="{lx}" x2="{lx + 26}" y1="{ly}" y2="{ly}" stroke="{colour}" stroke-width="3"{dash}/>'
                     f'<text x="{lx + 32}" y="{ly}" dominant-baseline="middle">{escape(name)}</text>')
    return _svg(width, height, description, parts, zoom=zoom)


# one colour per request, ColorBrewer's Set2 and Dark2, repeating past 16
LANE_COLOURS = ("#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#e5c494", "#b3b3b3",
                "#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666")


LANE_IDS_MOST_SLOTS = 16  # up to this many slots a lane is tall enough to write the request's number in its cells
LANE_WIDTH = 1000  # the lane chart's width: the main column's at 1280 px, so its text is drawn near LANE_FONT_PX
LANE_FONT_PX = 20  # ≥ 16 px on the screen down to a column of 800 px
LANE_COLUMNS = 12  # steps the axis shows at least: the lanes fill in from the left as a run goes on
DARK_LANES = frozenset(range(8, 16))  # Dark2's colours: a request's number on them is written in white


def _step_axis(steps: int, left_px: float, cell_w: float, y: float, height: int, step_title: str,
               first: int = 0) -> list[str]:
    """The step numbers under a chart of one column per step (every step up to 16, else about 8 round ones; the
    first column is step `first`) and the axis title at the bottom."""
    ticks = range(steps) if steps <= 16 else [v for v in nice_ticks(steps - 1, 8) if v < steps and v == int(v)]
    return ([f'<text x="{left_px + (v + 0.5) * cell_w:.1f}" y="{y}" text-anchor="middle">{v + first:g}</text>'
             for v in ticks]
            + [f'<text x="{left_px + steps * cell_w / 2:.1f}" y="{height - 6}" text-anchor="middle">'
               f"{escape(step_title)}</text>"])


def lane_ids_written(slots: int) -> bool:
    """Whether lane_chart_svg writes the request's number in its cells (else only in its cells' tooltips)."""
    return slots <= LANE_IDS_MOST_SLOTS


def lane_colour(request: int) -> str:
    return LANE_COLOURS[request % len(LANE_COLOURS)]


def lane_chart_svg(holders: list[list[int | None]], joined: list[list[int]], left: list[list[int]],
                   step_title: str, slot_title: str, description: str) -> str:
    """Which request holds which slot at each step, LANE_WIDTH wide: holders[step][slot] is a request id or None
    (free); a cell is one token of its request (the step it came out of), with the request's number in it (where a
    cell is too narrow, only where the request joins), and a bar marks the step it leaves after. The step axis
    shows at least LANE_COLUMNS steps, so the picture keeps its scale while a run is young."""
    steps, slots = len(holders), len(holders[0]) if holders else 0
    font = LANE_FONT_PX
    left_px, top, right = 80, 6, 10
    ids = lane_ids_written(slots)
    cell_h = max(28.0, min(56.0, 320 / max(1, slots))) if ids else max(8.0, 320 / max(1, slots))
    columns = max(steps, LANE_COLUMNS)
    cell_w = (LANE_WIDTH - left_px - right) / columns
    every_cell = cell_w >= 0.62 * font * len(str(max((r for row in holders for r in row if r is not None),
                                                      default=0))) + 6
    height = round(top + slots * cell_h + 2.6 * font + 12)
    parts = []
    for slot in range(slots):
        y = top + slot * cell_h
        parts.append(f'<rect x="{left_px}" y="{y + 1:.1f}" width="{columns * cell_w:.1f}" height="{cell_h - 2:.1f}" '
                     f'fill="#f8f9fa"/>')
        if ids or slot % math.ceil(slots / 16) == 0:
            parts.append(f'<text x="{left_px - 8}" y="{y + cell_h / 2:.1f}" text-anchor="end" '
                         f'dominant-baseline="middle">{slot}</text>')
        for step, row in enumerate(holders):
            rid = row[slot]
            if rid is None:
                continue
            x = left_px + step * cell_w
            parts.append(f'<rect x="{x:.1f}" y="{y + 1:.1f}" width="{max(1.0, cell_w - 1):.1f}" '
                         f'height="{cell_h - 2:.1f}" fill="{lane_colour(rid)}"><title>{rid}</title></rect>')
            if ids and (every_cell or rid in joined[step]):
                ink = "#fff" if rid % len(LANE_COLOURS) in DARK_LANES else INK
                anchor = (f'x="{x + cell_w / 2:.1f}" text-anchor="middle"' if every_cell else f'x="{x + 3:.1f}"')
                parts.append(f'<text class="lane-id" {anchor} y="{y + cell_h / 2:.1f}" dominant-baseline="middle" '
                             f'font-weight="600" fill="{ink}">{rid}</text>')
    for step, gone in enumerate(left):
        for rid in gone:
            x, y = left_px + (step + 1) * cell_w, top + holders[step].index(rid) * cell_h
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + cell_h}" stroke="{INK}" '
                         f'stroke-width="4"/>')
    parts += _step_axis(columns, left_px, cell_w, round(top + slots * cell_h + font), height, step_title)
    parts.append(f'<text transform="translate({font},{top + slots * cell_h / 2:.1f}) rotate(-90)" '
                 f'text-anchor="middle">{escape(slot_title)}</text>')
    return _svg(LANE_WIDTH, height, description, parts, font)


FREE_BLOCK, SPAN_COLOURS = "#e9ecef", {"prefill": "#225ea8", "recompute": "#d95f02", "decode": "#a6d854",
                                       "waiting": "#dee2e6"}
IN_TIER = "#9c36b5"  # the Tiers page's lanes: a request whose blocks wait in the second tier
GRID_HEIGHT = 300  # the block grid's height at most while its blocks keep at least BLOCK_SIDE[0]
BLOCK_SIDE = (14, 50)  # a block's side in the grid (LANE_WIDTH wide), the least and the most: 20 to a row
NUMBERED_FROM = 32  # a block this wide or wider has its request's number written in it
# a pool of more blocks is drawn as one bar (pool_bar_svg): block by block, block size 1 under the largest budget
# was 131,072 squares, 17.7 MB of HTML each rerun and minutes in a browser (faults review 2026-12-04 #8)
MAX_GRID_BLOCKS = 2048
MINE_INK = "#1864ab"  # the frame of a marked block: a blue no request's lane colour is near


def grid_shape(n: int) -> tuple[int, float]:
    """Columns and a block's side for a grid of n blocks LANE_WIDTH wide: the largest side (BLOCK_SIDE[1] at most)
    that keeps the grid within GRID_HEIGHT, in as few rows as that side allows; a grid of blocks smaller than
    BLOCK_SIDE[0] grows taller instead."""
    columns, side = 1, 0.0
    for c in range(1, max(1, n) + 1):
        s = min(LANE_WIDTH / c, GRID_HEIGHT / -(-n // c), BLOCK_SIDE[1])
        if s >= side - 1e-9:
            columns, side = c, s
    if side < BLOCK_SIDE[0]:
        side = BLOCK_SIDE[0]
        columns = int(LANE_WIDTH // side)
    return columns, side


def _block_number(x: float, y: float, side: float, request: int) -> str:
    """A request's number in the middle of its block, haloed in white to read on its colour and on white."""
    return (f'<text x="{x + side / 2:.1f}" y="{y + side / 2:.1f}" text-anchor="middle" dominant-baseline="central" '
            f'font-weight="600" stroke="#fff" stroke-width="4" paint-order="stroke">{request}</text>')


def pool_bar_svg(holder: np.ndarray, tips: dict[int, str], free_tip: str, description: str) -> str:
    """The block pool as one bar, LANE_WIDTH wide: a segment per request in its lane colour, as long as the blocks
    it holds (first holders, in request order), then the free blocks in grey. tips[request]: its segment's
    tooltip."""
    width, height = LANE_WIDTH, 2 * BLOCK_SIDE[1]
    requests, counts = np.unique(holder[holder >= 0], return_counts=True)
    scale = (width - 2) / max(1, len(holder))
    parts, x = [], 1.0
    for request, count in zip(requests.tolist(), counts.tolist()):
        parts.append(f'<rect x="{x:.1f}" y="1" width="{count * scale:.1f}" height="{height - 2}" '
                     f'fill="{lane_colour(int(request))}"><title>{escape(tips[request])}</title></rect>')
        x += count * scale
    parts.append(f'<rect x="{x:.1f}" y="1" width="{width - 1 - x:.1f}" height="{height - 2}" fill="{FREE_BLOCK}">'
                 f"<title>{escape(free_tip)}</title></rect>")
    return _svg(width, height, description, parts, LANE_FONT_PX)


def block_grid_svg(holder: np.ndarray, refs: np.ndarray, cached: np.ndarray, sliding: np.ndarray,
                   filled: np.ndarray, block_size: int, tips: list[str], description: str,
                   marked: np.ndarray | None = None) -> str:
    """The block pool, a square per block in id order, LANE_WIDTH wide and its blocks as large as fit
    (grid_shape): a held block in its first holder's lane colour, filled from the bottom as far as the positions it
    holds (the rest of a last block is the waste), its request's number written in it where the block is large
    enough, framed dark where more than one request holds it, crossed by a white stripe where a sliding group holds
    it; a free block grey, with a dashed outline while the prefix cache can still find it. tips[b]: block b's
    tooltip; marked[b]: a held block framed thick in MINE_INK (the Live server page: the student's own request's)."""
    n = len(holder)
    columns, cell = grid_shape(n)
    side = cell - max(1.5, 0.08 * cell)
    numbered = cell >= NUMBERED_FROM
    parts = []
    for b in range(n):
        x, y = 1 + (b % columns) * cell, 1 + (b // columns) * cell
        tip = f"<title>{escape(tips[b])}</title>"
        if holder[b] < 0:
            outline = f' stroke="{MUTED_INK}" stroke-dasharray="3,2"' if cached[b] else ""
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{side:.1f}" height="{side:.1f}" fill="{FREE_BLOCK}"'
                         f"{outline}>{tip}</rect>")
            continue
        request = int(holder[b])
        colour = lane_colour(request)
        level = side * int(filled[b]) / block_size
        frame = f' stroke="{INK}" stroke-width="2"' if refs[b] > 1 else f' stroke="{colour}"'
        parts.append(f'<g>{tip}<rect x="{x:.1f}" y="{y:.1f}" width="{side:.1f}" height="{side:.1f}" fill="white"'
                     f'{frame}/><rect x="{x:.1f}" y="{y + side - level:.1f}" width="{side:.1f}" height="{level:.1f}" '
                     f'fill="{colour}"/>'
                     + (f'<line x1="{x:.1f}" y1="{y + side:.1f}" x2="{x + side:.1f}" y2="{y:.1f}" stroke="white" '
                        f'stroke-width="2"/>' if sliding[b] else "")
                     + (_block_number(x, y, side, request) if numbered else "")
                     + (f'<rect x="{x + 2:.1f}" y="{y + 2:.1f}" width="{side - 4:.1f}" height="{side - 4:.1f}" '
                        f'fill="none" stroke="{MINE_INK}" stroke-width="4"/>' if marked is not None and marked[b]
                        else "") + "</g>")
    return _svg(LANE_WIDTH, round(-(-n // columns) * cell + 2), description, parts, LANE_FONT_PX)


def span_lanes_svg(rows: list[int], cells: list[list[tuple[str, str] | None]], preempted: list[list[bool]],
                   step_title: str, row_title: str, description: str,
                   colours: dict[str, str] = SPAN_COLOURS, first_step: int = 0) -> str:
    """What each request did at each step, LANE_WIDTH wide: cells[r][step] is (kind, tooltip) with kind a key of
    `colours` (a prompt's chunk, its positions computed again after a preemption, a decode, waiting for blocks),
    None before it arrives and after it leaves; a red cross where it was preempted. The step axis shows at least
    LANE_COLUMNS steps, numbered from `first_step`; a row is tall enough for its request's number while there are at
    most 16."""
    steps = len(cells[0]) if cells else 0
    font = LANE_FONT_PX
    left_px, top, right = 80, 6, 10
    cell_h = max(8.0, min(32.0, 420 / max(1, len(rows))))
    every = math.ceil((font + 4) / cell_h)  # rows per written number
    columns = max(steps, LANE_COLUMNS)
    cell_w = (LANE_WIDTH - left_px - right) / columns
    height = round(top + len(rows) * cell_h + 2.6 * font + 12)
    parts = []
    for r, rid in enumerate(rows):
        y = top + r * cell_h
        if r % every == 0:
            parts.append(f'<text x="{left_px - 8}" y="{y + cell_h / 2:.1f}" text-anchor="end" '
                         f'dominant-baseline="middle">{rid}</text>')
        for step, cell in enumerate(cells[r]):
            x = left_px + step * cell_w
            if cell is not None:
                kind, tip = cell
                parts.append(f'<rect x="{x:.1f}" y="{y + 1:.1f}" width="{max(1.0, cell_w - 1):.1f}" '
                             f'height="{cell_h - 2:.1f}" fill="{colours[kind]}"><title>{escape(tip)}</title></rect>')
            if preempted[r][step]:
                parts.append(f'<path d="M{x:.1f},{y + 1:.1f} l{cell_w - 1:.1f},{cell_h - 2:.1f} M{x:.1f},'
                             f'{y + cell_h - 1:.1f} l{cell_w - 1:.1f},{-(cell_h - 2):.1f}" stroke="#c92a2a" '
                             f'stroke-width="3"/>')
    parts += _step_axis(columns, left_px, cell_w, round(top + len(rows) * cell_h + font), height, step_title,
                        first_step)
    parts.append(f'<text transform="translate({font},{top + len(rows) * cell_h / 2:.1f}) rotate(-90)" '
                 f'text-anchor="middle">{escape(row_title)}</text>')
    return _svg(LANE_WIDTH, height, description, parts, font)


def tier_slots_svg(holder: np.ndarray, went_out: np.ndarray, came_back: np.ndarray, tips: list[str],
                   description: str) -> str:
    """The second tier's slots, a square per slot in id order, as the pool's blocks are drawn (block_grid_svg): a
    slot holding a moved-out block in its request's lane colour with its number, framed dark when it went out in
    the last step; a free slot grey, outlined dashed in the request's colour when its block went back to the pool
    in the last step."""
    n = len(holder)
    columns, cell = grid_shape(n)
    side = cell - max(1.5, 0.08 * cell)
    numbered = cell >= NUMBERED_FROM
    parts = []
    for s in range(n):
        x, y = 1 + (s % columns) * cell, 1 + (s // columns) * cell
        tip = f"<title>{escape(tips[s])}</title>"
        if holder[s] >= 0:
            request = int(holder[s])
            frame = f' stroke="{INK}" stroke-width="3"' if went_out[s] else ""
            parts.append(f'<g>{tip}<rect x="{x:.1f}" y="{y:.1f}" width="{side:.1f}" height="{side:.1f}" '
                         f'fill="{lane_colour(request)}"{frame}/>'
                         + (_block_number(x, y, side, request) if numbered else "") + "</g>")
        elif came_back[s] >= 0:
            parts.append(f'<rect x="{x + 1:.1f}" y="{y + 1:.1f}" width="{side - 2:.1f}" height="{side - 2:.1f}" '
                         f'fill="{FREE_BLOCK}" stroke="{lane_colour(int(came_back[s]))}" stroke-width="3" '
                         f'stroke-dasharray="5,3">{tip}</rect>')
        else:
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{side:.1f}" height="{side:.1f}" fill="{FREE_BLOCK}">'
                         f"{tip}</rect>")
    return _svg(LANE_WIDTH, round(-(-n // columns) * cell + 2), description, parts, LANE_FONT_PX)


CROSSOVER_FONT_PX = 18  # the crossover chart is drawn at its own size: its text 18 px on the screen


def crossover_svg(positions: list[int], series: dict[str, list[float]], crossover: int | None, crossover_label: str,
                  x_title: str, y_title: str, description: str, number: Callable[[float], str] = str) -> str:
    """Times by positions on log-log axes (positions double from one block up; times from a fraction of a
    millisecond to seconds): a line per series (the first a round trip through the tier, the second the
    recompute), a dashed upright line at the crossover with its label. `number` writes the ticks."""
    font = CROSSOVER_FONT_PX
    width, left, right, bottom, plot_h = 560, 76, 20, 58, 220
    entries, legend_x, legend_y = [], 0, 16
    for name in series:
        size = 36 + round(0.55 * font * len(name))
        if legend_x and legend_x + size > width:
            legend_x, legend_y = 0, legend_y + 26
        entries.append((legend_x, legend_y))
        legend_x += size + 18
    top = legend_y + 30
    height = top + plot_h + bottom
    plot_w = width - left - right
    x_lo, x_hi = math.log2(positions[0]), math.log2(positions[-1])
    values = [v for ys in series.values() for v in ys if v > 0]
    y_lo, y_hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    y_hi = max(y_hi, y_lo + 1)

    def px(v: float) -> float:
        return left + (plot_w / 2 if x_hi == x_lo else (math.log2(v) - x_lo) / (x_hi - x_lo) * plot_w)

    def py(v: float) -> float:
        return top + plot_h * (1 - (math.log10(max(v, 10.0 ** y_lo)) - y_lo) / (y_hi - y_lo))

    parts = []
    for e in range(y_lo, y_hi + 1):
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(10**e):.1f}" y2="{py(10**e):.1f}" '
                     f'stroke="{GRID_INK}"/><text x="{left - 6}" y="{py(10**e):.1f}" text-anchor="end" '
                     f'dominant-baseline="middle">{escape(number(10.0**e))}</text>')
    for v in positions:
        parts.append(f'<text x="{px(v):.1f}" y="{top + plot_h + font + 4}" text-anchor="middle">'
                     f"{escape(number(v))}</text>")
    if crossover is not None:
        parts.append(f'<line x1="{px(crossover):.1f}" x2="{px(crossover):.1f}" y1="{top}" y2="{top + plot_h}" '
                     f'stroke="{INK}" stroke-width="2" stroke-dasharray="6 4"/>'
                     f'<text x="{px(crossover) + 6:.1f}" y="{top + font}">'
                     f"{escape(crossover_label)}</text>")
    for (name, ys), colour, (lx, ly) in zip(series.items(), (KEPT, CHOSEN), entries):
        points = " ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in zip(positions, ys))
        parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="3"/>')
        parts.extend(f'<circle cx="{px(a):.1f}" cy="{py(b):.1f}" r="4" fill="{colour}"><title>{escape(name)}: '
                     f"{escape(number(a))}, {escape(number(round(b, 3)))}</title></circle>"
                     for a, b in zip(positions, ys))
        parts.append(f'<line x1="{lx}" x2="{lx + 26}" y1="{ly}" y2="{ly}" stroke="{colour}" stroke-width="3"/>'
                     f'<text x="{lx + 32}" y="{ly}" dominant-baseline="middle">{escape(name)}</text>')
    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" text-anchor="middle">{escape(x_title)}</text>'
                 f'<text transform="translate({font},{top + plot_h / 2:.1f}) rotate(-90)" text-anchor="middle">'
                 f"{escape(y_title)}</text>")
    return _svg(width, height, description, parts, font)


WORKER_COLOURS = {"received": "#7570b3", "prefill": SPAN_COLOURS["prefill"], "decode": SPAN_COLOURS["decode"]}


def worker_lanes_svg(steps: int, transfers: list[tuple[int, int, str]], decode_cells: list[tuple[str, str] | None],
                     gone_at: int | None, lane_names: tuple[str, str], step_title: str, description: str) -> str:
    """Two lanes over the decode worker's steps, LANE_WIDTH wide (at least LANE_COLUMNS steps): above, the prefill
    worker, a box per prompt it sent (transfers: (request, the step that received it, tooltip)) in the request's
    lane colour with its number where the box is wide enough, stacked where a step received several, an arrow from
    each step's boxes down to the decode worker; below, the decode worker, a cell per step (decode_cells[step]:
    (kind of WORKER_COLOURS, tooltip) or None: nothing ran). gone_at: the step from which the prefill worker was
    gone, its lane crossed out from there."""
    font = LANE_FONT_PX
    left_px, top, box_h = round(0.55 * font * max(len(name) for name in lane_names)) + 16, 6, 28
    columns = max(steps, LANE_COLUMNS)
    cell_w = (LANE_WIDTH - left_px - 10) / columns
    per_step: dict[int, list[tuple[int, str]]] = {}
    for request, step, tip in transfers:
        per_step.setdefault(step, []).append((request, tip))
    lane_h = box_h * max([len(v) for v in per_step.values()] + [1]) + 4
    gap, decode_h = 40, 32
    decode_y = top + lane_h + gap
    height = round(decode_y + decode_h + 2.6 * font + 12)
    parts = [f'<defs><marker id="head" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" markerHeight="7" '
             f'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="{INK}"/></marker></defs>']
    for name, y, h in ((lane_names[0], top, lane_h), (lane_names[1], decode_y, decode_h)):
        parts.append(f'<rect x="{left_px}" y="{y}" width="{columns * cell_w:.1f}" height="{h}" fill="none" '
                     f'stroke="{GRID_INK}"/><text x="{left_px - 8}" y="{y + h / 2:.1f}" text-anchor="end" '
                     f'dominant-baseline="middle">{escape(name)}</text>')
    for step, boxes in per_step.items():
        x = left_px + step * cell_w
        for k, (request, tip) in enumerate(boxes):
            y = top + 2 + k * box_h
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{max(1.0, cell_w - 1):.1f}" height="{box_h - 1}" '
                         f'fill="{lane_colour(request)}"><title>{escape(tip)}</title></rect>')
            if cell_w >= 0.62 * font * len(str(request)) + 6:
                ink = "#fff" if request % len(LANE_COLOURS) in DARK_LANES else INK
                parts.append(f'<text x="{x + cell_w / 2:.1f}" y="{y + box_h / 2:.1f}" text-anchor="middle" '
                             f'dominant-baseline="central" font-weight="600" fill="{ink}">{request}</text>')
        mid = x + cell_w / 2
        parts.append(f'<line x1="{mid:.1f}" x2="{mid:.1f}" y1="{top + 2 + len(boxes) * box_h}" y2="{decode_y - 2}" '
                     f'stroke="{INK}" stroke-width="2" marker-end="url(#head)"/>')
    for step, cell in enumerate(decode_cells):
        if cell is not None:
            kind, tip = cell
            parts.append(f'<rect x="{left_px + step * cell_w:.1f}" y="{decode_y + 2}" '
                         f'width="{max(1.0, cell_w - 1):.1f}" height="{decode_h - 4}" fill="{WORKER_COLOURS[kind]}">'
                         f"<title>{escape(tip)}</title></rect>")
    if gone_at is not None:
        x = left_px + gone_at * cell_w
        parts.append(f'<rect x="{x:.1f}" y="{top}" width="{(steps - gone_at) * cell_w:.1f}" height="{lane_h}" '
                     f'fill="{GRID_INK}" opacity="0.6"/><path d="M{x:.1f},{top} l{min(lane_h, 40)},{lane_h} '
                     f'M{x:.1f},{top + lane_h} l{min(lane_h, 40)},{-lane_h}" stroke="#c92a2a" stroke-width="3"/>')
    parts += _step_axis(columns, left_px, cell_w, round(decode_y + decode_h + font), height, step_title)
    return _svg(LANE_WIDTH, height, description, parts, font)


LABEL_CHAR_PX, LABEL_LINE_PX = 7, 13  # a 12-pixel label's width per character and its height


def place_labels(points: list[tuple[float, float, str]], width: float) -> list[tuple[float, float]]:
    """Where each point's label goes (its text's x and baseline y): beside its point, on the first side that
    overlaps no point and no label placed before it and stays inside `width` (points close together, as B = 3,
    B = 4 and a prefill on a roofline, would otherwise write over each other); the first side when none is free."""
    # (left, top, right, bottom): every point's dot, then the labels as they are placed
    boxes: list[tuple[float, float, float, float]] = [(x - 6, y - 6, x + 6, y + 6) for x, y, _ in points]

    def box(left: float, base: float, w: float) -> tuple[float, float, float, float]:
        return left, base - LABEL_LINE_PX, left + w, base

    def free(b: tuple[float, float, float, float]) -> bool:
        return 0 <= b[0] and b[2] <= width and not any(
            b[0] < o[2] and o[0] < b[2] and b[1] < o[3] and o[1] < b[3] for o in boxes)

    out = []
    for x, y, label in points:
        w = LABEL_CHAR_PX * len(label)
        sides = [(x + 8, y - 6), (x + 8, y + 16), (x - 8 - w, y - 6), (x - 8 - w, y + 16),
                 (x + 8, y - 20), (x + 8, y + 30), (x - 8 - w, y - 20), (x - 8 - w, y + 30)]
        left, base = next((side for side in sides if free(box(*side, w))), sides[0])
        boxes.append(box(left, base, w))
        out.append((left, base))
    return out


def roofline_svg(points: list[tuple[str, float, float]], bandwidth_gb_s: float, peak_gflops: float,
                 x_title: str, y_title: str, description: str) -> str:
    """Log-log roofline: attainable GFLOP/s = min(peak, bandwidth × FLOPs per byte), and (label, intensity,
    achieved GFLOP/s) points under it. The ridge is where the two roofs meet."""
    width, height, left, right, top, bottom = 460, 300, 62, 14, 12, 44
    xs = [p[1] for p in points] + [peak_gflops / bandwidth_gb_s]
    ys = [p[2] for p in points] + [peak_gflops]
    x_lo, x_hi = math.floor(math.log10(min(xs) / 2)), math.ceil(math.log10(max(xs) * 2))
    y_lo, y_hi = math.floor(math.log10(min(ys) / 2)), math.ceil(math.log10(peak_gflops * 2))
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(v: float) -> float:
        return left + (math.log10(v) - x_lo) / (x_hi - x_lo) * plot_w

    def py(v: float) -> float:
        return top + plot_h * (1 - (math.log10(v) - y_lo) / (y_hi - y_lo))

    parts = []
    for e in range(x_lo, x_hi + 1):
        parts.append(f'<line x1="{px(10**e):.1f}" x2="{px(10**e):.1f}" y1="{top}" y2="{top + plot_h}" '
                     f'stroke="{GRID_INK}"/><text x="{px(10**e):.1f}" y="{top + plot_h + 16}" '
                     f'text-anchor="middle">{10**e:g}</text>')
    for e in range(y_lo, y_hi + 1):
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(10**e):.1f}" y2="{py(10**e):.1f}" '
                     f'stroke="{GRID_INK}"/><text x="{left - 6}" y="{py(10**e):.1f}" text-anchor="end" '
                     f'dominant-baseline="middle">{10**e:g}</text>')
    ridge = peak_gflops / bandwidth_gb_s
    start = 10 ** x_lo
    roof = [(start, max(bandwidth_gb_s * start, 10 ** y_lo)), (ridge, peak_gflops), (10 ** x_hi, peak_gflops)]
    parts.append('<polyline points="' + " ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in roof)
                 + f'" fill="none" stroke="{MUTED_INK}" stroke-width="3"/>')
    placed = place_labels([(px(x), py(y), label) for label, x, y in points], width)
    for (label, x, y), (lx, ly) in zip(points, placed):
        colour = CHOSEN if label.startswith("prefill") else KEPT
        parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="5" fill="{colour}"/>'
                     f'<text x="{lx:.1f}" y="{ly:.1f}" font-size="12">{escape(label)}</text>')
    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" text-anchor="middle">{escape(x_title)}</text>'
                 f'<text transform="translate(14,{top + plot_h / 2:.1f}) rotate(-90)" text-anchor="middle">'
                 f"{escape(y_title)}</text>")
    return _svg(width, height, description, parts)


def _svg(width: int, height: int, description: str, parts: list[str], font_px: int = FONT_PX,
         zoom: float = 1.0) -> str:
    """An <img> of the SVG: st.html's sanitiser drops inline SVG, and an image is one element for the page to lay
    out. It scales down with its column, never up past `zoom` times its size, so the text keeps its size (font_px,
    times zoom) where there is room."""
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
           f'height="{height}" font-family="{FONT_FAMILY}" font-size="{font_px}" fill="{INK}">'
           + "".join(parts) + "</svg>")
    source = "data:image/svg+xml;base64," + base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return (f'<img class="dl-chart" src="{source}" alt="{escape(description)}" width="{width}" height="{height}" '
            f'style="width:100%;max-width:{round(width * zoom)}px;height:auto">')
