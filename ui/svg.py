"""The Decode page's two charts as SVG images: nothing to load or run in the browser but the picture itself.

A Next click redraws the attention triangle and the bytes per step. As plotly figures they cost the browser more
than the rest of the click together (benchmarks/click_latency.py); as an <img> of SVG each is one element inside
a piece of st.html.
The triangle is one PNG image, a pixel per cell scaled up, so the page does not grow with the square of the context.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Callable
from html import escape

import numpy as np
from PIL import Image

from ui.charts import CHOSEN, KEPT

# ColorBrewer's YlGnBu, from light (no attention) to dark (all of it), as in the Prefill page's heatmaps
SCALE = ("#ffffd9", "#edf8b1", "#c7e9b4", "#7fcdbb", "#41b6c4", "#1d91c0", "#225ea8", "#253494", "#081d58")
SCALE_RGB = np.array([[int(c[i:i + 2], 16) for i in (1, 3, 5)] for c in SCALE], dtype=np.float64)
INK, GRID_INK = "#212529", "#dee2e6"
FONT_FAMILY = "'Source Sans Pro', 'Source Sans 3', 'Helvetica Neue', Arial, sans-serif"  # an image sees no web font
FONT_PX, CHAR_PX = 14, 8  # label font size, and the width of one character, to make room for labels
HEAT_SIDE = (240, 340)  # the triangle's side in pixels, the smallest and the largest
CELL_PX = 24  # a cell's side while the triangle is small enough
GAP_FROM_PX = 6  # cells this wide or wider get a white line between them
LABEL_CHARS = 14


def colours(values: np.ndarray) -> np.ndarray:
    """values in [0, 1] -> (..., 3) uint8 RGB along SCALE, linearly between its stops."""
    position = np.clip(values, 0.0, 1.0) * (len(SCALE) - 1)
    low = np.minimum(position.astype(int), len(SCALE) - 2)
    part = (position - low)[..., None]
    return np.round(SCALE_RGB[low] * (1 - part) + SCALE_RGB[low + 1] * part).astype(np.uint8)


def png_data_uri(rgb: np.ndarray) -> str:
    """(H, W, 3) uint8 -> a data: URI of a PNG (fast compression: these images are flat colour)."""
    buffer = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def triangle_pixels(weights: np.ndarray) -> np.ndarray:
    """weights (S, S) -> (S, S, 3): a pixel per cell, exact zeros (the future, rows not kept) white."""
    return np.where((weights > 0)[..., None], colours(weights), np.uint8(255))


def _label(text: str) -> str:
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"


def heatmap_svg(weights: np.ndarray, labels: list[str], description: str) -> str:
    """A lower-triangular attention map, weights (queries, keys) over the same positions `labels`, on a fixed
    0–1 colour scale with its bar. Rows are labelled on the left, columns on top (slanted); when labels would
    crowd, every k-th is shown. `description` is the picture's accessible name."""
    n = len(labels)
    side = min(HEAT_SIDE[1], max(HEAT_SIDE[0], CELL_PX * n))
    shown_labels = [_label(label) for label in labels]
    every = math.ceil(n / max(1, side // (FONT_PX + 3)))
    ticks = range(0, n, every)
    text_px = CHAR_PX * max(len(shown_labels[i]) for i in ticks)
    left, top = round(text_px) + 10, round(text_px * 0.71) + 14  # 0.71: sin 45°, the column labels' slant
    bar_x = left + side + 14
    width, height = max(bar_x + 52, round(left + side + text_px * 0.71)), top + side + 6
    step = side / n
    parts = [f'<image x="{left}" y="{top}" width="{side}" height="{side}" preserveAspectRatio="none" '
             f'style="image-rendering:pixelated" href="{png_data_uri(triangle_pixels(weights))}"/>',
             f'<rect x="{left}" y="{top}" width="{side}" height="{side}" fill="none" stroke="{GRID_INK}"/>']
    if step >= GAP_FROM_PX:  # white lines between cells wide enough to show them
        lines = "".join(f"M{left + k * step:.1f} {top}v{side}M{left} {top + k * step:.1f}h{side}" for k in range(1, n))
        parts.append(f'<path d="{lines}" stroke="#fff" stroke-width="1"/>')
    for i in ticks:
        centre = (i + 0.5) * step
        text = escape(shown_labels[i])
        parts.append(f'<text x="{left - 6}" y="{top + centre:.1f}" text-anchor="end" dominant-baseline="middle">'
                     f"{text}</text>")
        parts.append(f'<text transform="translate({left + centre:.1f},{top - 6}) rotate(-45)">{text}</text>')
    stops = "".join(f'<stop offset="{k / (len(SCALE) - 1):.3f}" stop-color="{c}"/>' for k, c in enumerate(SCALE))
    parts.append(f'<defs><linearGradient id="dl-heat-scale" x1="0" y1="1" x2="0" y2="0">{stops}</linearGradient>'
                 f'</defs><rect x="{bar_x}" y="{top}" width="14" height="{side}" fill="url(#dl-heat-scale)" '
                 f'stroke="{GRID_INK}"/>')
    for value, y in ((1, top), (0.5, top + side / 2), (0, top + side)):
        parts.append(f'<text x="{bar_x + 20}" y="{y:.1f}" dominant-baseline="middle">{value}</text>')
    return _svg(width, height, description, parts)


def nice_ticks(top: float, most: int = 5) -> list[float]:
    """0 and round steps (1, 2, 2.5 or 5 × 10^k) up to the first tick at or above `top`: at most `most` steps."""
    if top <= 0:
        return [0]
    rough = top / most
    power = 10 ** math.floor(math.log10(rough))
    size = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= rough)
    return [size * i for i in range(math.ceil(top / size - 1e-9) + 1)]


def line_chart_svg(x: list[int], series: dict[str, list[float]], x_title: str, y_title: str, description: str,
                   dashed: tuple[str, ...] = (), number: Callable[[float], str] = str) -> str:
    """Lines over integer steps from y = 0, a legend above, ticks at every step while there are at most 20.
    `number` writes the y ticks (the page's thousands separator)."""
    width, right, bottom, plot_h = 400, 14, 46, 190
    entries, legend_x, legend_y = [], 0, 14  # the legend wraps to another line where a name would not fit
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

    parts = []
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
    return _svg(width, height, description, parts)


def _svg(width: int, height: int, description: str, parts: list[str]) -> str:
    """An <img> of the SVG: st.html's sanitiser drops inline SVG, and an image is one element for the page to lay
    out. It scales down with its column, never up, so the text keeps its size where there is room."""
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
           f'height="{height}" font-family="{FONT_FAMILY}" font-size="{FONT_PX}" fill="{INK}">'
           + "".join(parts) + "</svg>")
    source = "data:image/svg+xml;base64," + base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return (f'<img class="dl-chart" src="{source}" alt="{escape(description)}" width="{width}" height="{height}" '
            f'style="width:100%;max-width:{width}px;height:auto">')
