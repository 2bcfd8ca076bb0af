"""Plotly figures as plain dicts built from numpy arrays; colours chosen to stay visible on a projector.

Plain dicts, not graph objects: st.plotly_chart validates every figure once anyway, and the graph objects'
update_* calls cost more than the rest of a Next click together.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Figure = dict
HEAT = "YlGnBu"
FONT = dict(size=15, color="#212529")
TICKS = dict(size=14, color="#212529")
KEPT, CHOSEN = "#1f5fbf", "#e8590c"


def figure(data: list[dict], height: int, xaxis: dict | None = None, yaxis: dict | None = None,
           margin: dict | None = None, **layout) -> Figure:
    """The shared look: white background, readable fonts, tight margins."""
    return {"data": data, "layout": {
        "height": height, "margin": dict(l=10, r=10, t=10, b=10) | (margin or {}), "font": FONT,
        "plot_bgcolor": "white", "paper_bgcolor": "white",
        "xaxis": {"tickfont": TICKS, **(xaxis or {})}, "yaxis": {"tickfont": TICKS, **(yaxis or {})}, **layout}}


ATTENTION_SCALES = ("row", "log", "linear")  # what an attention cell's colour says; per row by default
LOG_FLOOR = 1e-3  # the log scale's lightest colour: a weight of 0.001 or less
NUMBERS_UP_TO = 12  # positions up to which each weight is written in its cell


def attention_colours(weights: np.ndarray, scale: str) -> np.ndarray:
    """Each weight's place on the colour scale, 0 to 1: the weight itself ("linear"), the weight over its row's
    largest ("row": a first position that takes most of every row, the attention sink, no longer leaves the rest
    pale), or log10 of the weight from LOG_FLOOR to 1 ("log"). Masked cells (exact zeros) stay 0."""
    w = np.asarray(weights, dtype=np.float64)
    if scale == "row":
        return w / np.maximum(w.max(axis=-1, keepdims=True), 1e-12)
    if scale == "log":
        floor = np.log10(LOG_FLOOR)
        return np.where(w > 0, (np.log10(np.maximum(w, LOG_FLOOR)) - floor) / -floor, 0.0)
    return w


def attention_heatmap(weights: np.ndarray, query_labels: list[str], key_labels: list[str], height: int = 420,
                      scale: str = "linear", scale_title: str = "",
                      number: Callable[[float], str] | None = None) -> Figure:
    """weights (queries, keys); masked (future) cells are exact zeros and shown blank. The colour follows `scale`
    (attention_colours), its bar titled `scale_title`; a hover says the weight itself, and up to NUMBERS_UP_TO
    positions each cell shows it too, written by `number`. The labels are the axes' categories, so a hover names
    its query and key without a label per cell (a 300-position triangle would send 90,000 of them on every click),
    and plotly thins the tick labels when they crowd."""
    z = np.where(weights > 0, np.round(attention_colours(weights, scale), 3), np.nan)
    big = dict(size=16, color=TICKS["color"])  # the triangle's text at 16 px and more: read from the back row
    bar = dict(thickness=16, title=dict(text=scale_title, side="right", font=big), tickfont=big)
    if scale == "log":  # ticks at the weights themselves: 0.001, 0.01, 0.1, 1
        powers = np.arange(int(np.log10(LOG_FLOOR)), 1)
        bar |= dict(tickvals=list((powers - powers[0]) / -powers[0]),
                    ticktext=[(number or str)(float(10.0 ** p)) for p in powers])
    heat = dict(type="heatmap", z=z, customdata=np.round(weights, 3), x=key_labels, y=query_labels, zmin=0, zmax=1,
                colorscale=HEAT, colorbar=bar, xgap=1 if len(key_labels) <= 64 else 0,
                ygap=1 if len(query_labels) <= 64 else 0,
                hovertemplate="%{y} → %{x}<br>%{customdata:.3f}<extra></extra>")
    if number is not None and len(query_labels) <= NUMBERS_UP_TO:
        heat |= dict(text=[[number(float(w)) if w > 0 else "" for w in row] for row in weights],
                     texttemplate="%{text}", textfont=dict(size=16))
    return figure([heat], height, xaxis=dict(type="category", side="top", tickangle=-45, tickfont=big),
                  yaxis=dict(type="category", autorange="reversed", tickfont=big))


def heads_grid(weights: np.ndarray, head_title: str, height: int = 300) -> Figure:
    """weights (heads, queries, keys): one small heatmap per head, side by side."""
    n_heads, gap = weights.shape[0], 0.03
    width = (1 - gap * (n_heads - 1)) / n_heads
    data, axes, titles = [], {}, []
    for h in range(n_heads):
        suffix, left = ("" if h == 0 else str(h + 1)), h * (width + gap)
        data.append(dict(type="heatmap", z=np.where(weights[h] > 0, weights[h], np.nan), zmin=0, zmax=1,
                         colorscale=HEAT, showscale=h == n_heads - 1, hovertemplate="%{z:.3f}<extra></extra>",
                         xaxis="x" + suffix, yaxis="y" + suffix))
        axes["xaxis" + suffix] = dict(domain=[left, left + width], showticklabels=False)
        axes["yaxis" + suffix] = dict(anchor="x" + suffix, autorange="reversed", showticklabels=h == 0)
        titles.append(dict(text=head_title.format(h=h), x=left + width / 2, y=1.0, xref="paper", yref="paper",
                           xanchor="center", yanchor="bottom", showarrow=False))
    return figure(data, height, xaxis=axes.pop("xaxis"), yaxis=axes.pop("yaxis"), annotations=titles,
                  margin=dict(t=30), **axes)  # the top margin holds the head titles


def lines(x: list, series: dict[str, list], x_title: str, y_title: str, height: int = 340,
          dashed: tuple[str, ...] = ()) -> Figure:
    palette = [KEPT, CHOSEN, "#2b8a3e", "#862e9c"]
    traces = [dict(type="scatter", x=x, y=ys, name=name, mode="lines+markers", marker=dict(size=8),
                   line=dict(color=colour, width=3, dash="dash" if name in dashed else "solid"))
              for (name, ys), colour in zip(series.items(), palette)]
    # the legend sits in the top margin, above the lines it names
    return figure(traces, height, legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0), margin=dict(t=40),
                  xaxis=dict(title=dict(text=x_title), tickvals=x if len(x) <= 20 else None),
                  yaxis=dict(title=dict(text=y_title), rangemode="tozero"))


def curve(x: list, y: list, name: str, x_title: str, y_title: str, mark: tuple | None = None,
          level: tuple[float, str] | None = None, height: int = 320) -> Figure:
    """One line over many steps (a loss curve, a schedule); mark = (x, y, name) of one point drawn large,
    level = (y, name) of a dashed horizontal reference line."""
    few = len(x) <= 30  # a short curve shows its points, or a single step would draw nothing
    traces = [dict(type="scatter", x=x, y=y, name=name, mode="lines+markers" if few else "lines",
                   line=dict(color=KEPT, width=3), marker=dict(size=7))]
    if level is not None:
        traces.append(dict(type="scatter", x=[x[0], x[-1]], y=[level[0]] * 2, name=level[1], mode="lines",
                           line=dict(color="#495057", width=2, dash="dash")))
    if mark is not None:
        traces.append(dict(type="scatter", x=[mark[0]], y=[mark[1]], name=mark[2], mode="markers",
                           marker=dict(color=CHOSEN, size=14)))
    return figure(traces, height, legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0), margin=dict(t=40),
                  xaxis=dict(title=dict(text=x_title)), yaxis=dict(title=dict(text=y_title), rangemode="tozero"))
