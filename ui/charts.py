"""Plotly figures as plain dicts built from numpy arrays; colours chosen to stay visible on a projector.

Plain dicts, not graph objects: st.plotly_chart validates every figure once anyway, and the graph objects'
update_* calls cost more than the rest of a Next click together.
"""

from __future__ import annotations

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


def attention_heatmap(weights: np.ndarray, query_labels: list[str], key_labels: list[str],
                      height: int = 420) -> Figure:
    """weights (queries, keys); masked (future) cells are exact zeros and shown blank. The labels are the axes'
    categories, so a hover names its query and key without a label per cell (a 300-position triangle would send
    90,000 of them on every click), and plotly thins the tick labels when they crowd."""
    z = np.where(weights > 0, np.round(weights, 3), np.nan)
    heat = dict(type="heatmap", z=z, x=key_labels, y=query_labels, zmin=0, zmax=1, colorscale=HEAT,
                colorbar=dict(thickness=14), xgap=1 if len(key_labels) <= 64 else 0,
                ygap=1 if len(query_labels) <= 64 else 0, hovertemplate="%{y} → %{x}<br>%{z:.3f}<extra></extra>")
    return figure([heat], height, xaxis=dict(type="category", side="top", tickangle=-45),
                  yaxis=dict(type="category", autorange="reversed"))


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


# -----------------------------------------------------------------------------
# the Flash Attention tile walk

TILE_STATES = ("masked", "skipped", "todo", "done", "current")  # the order of the codes 0..4 in tile_grid
HOVER_POSITIONS = 64  # tile_grid names each cell on hover up to this many positions
TILE_COLOURS = {"masked": "#ffffff", "skipped": "#ffc9c9", "todo": "#dee2e6", "done": "#a5d8ff",
                "current": "#ffa94d"}


def _tick_labels(labels: list[str], most: int = 24) -> tuple[list[int], list[str]]:
    every = -(-len(labels) // most)  # show at most `most` labels: a projector cannot read more
    shown = list(range(0, len(labels), every))
    return shown, [labels[i] for i in shown]


def tile_grid(steps: list, current: int, labels: list[str], names: dict[str, str], height: int = 460) -> Figure:
    """The N×N score grid of a tiled walk. steps: model.flash.TileStep in walk order over a prefill
    (N queries, N keys); current: the index of the tile being read. Each cell is coloured by its state
    (TILE_STATES, named by names[state]): masked = above the causal diagonal inside a tile that is read,
    skipped = a whole tile above the diagonal (K, V never read). Block borders are drawn, the current tile
    framed; small grids print each score computed so far. names also gives 'queries' and 'keys' (axes)."""
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
    k = len(TILE_STATES)
    scale = [[edge, TILE_COLOURS[s]] for i, s in enumerate(TILE_STATES) for edge in (i / k, (i + 1) / k)]
    # a hover per cell while cells are big enough to point at: at SmolLM2's 231 positions the labels alone were
    # 3 MB sent on every click, for cells 2 pixels wide
    hover = np.array([[f"{labels[r]} → {labels[c]}<br>{names[TILE_STATES[state[r, c]]]}"
                       + (f"<br>s = {scores[r, c]:.3f}" if np.isfinite(scores[r, c]) else "")
                       for c in range(n)] for r in range(n)]) if n <= HOVER_POSITIONS else None
    digits = 2 if n <= 6 else 1  # the numbers must fit their cell
    text = np.where(np.isfinite(scores), np.vectorize(lambda x: f"{x:.{digits}f}")(scores), "") if n <= 12 else None
    heat = dict(type="heatmap", z=state, zmin=-0.5, zmax=k - 0.5, colorscale=scale, showscale=False,
                customdata=hover, hovertemplate="%{customdata}<extra></extra>" if hover is not None else None,
                hoverinfo="skip" if hover is None else None, text=text,
                texttemplate="%{text}" if text is not None else None, textfont=dict(size=13, color="#212529"),
                xgap=1, ygap=1)
    legend = [dict(type="scatter", x=[None], y=[None], mode="markers", name=names[s], marker=dict(
        symbol="square", size=16, color=TILE_COLOURS[s], line=dict(color="#495057", width=1)))
        for s in TILE_STATES]  # legend entries: the heatmap itself has no legend
    block_q, block_k = steps[0].q_rows[1] - steps[0].q_rows[0], steps[0].k_cols[1] - steps[0].k_cols[0]
    border = dict(color="#343a40", width=2)
    # block borders (with block 1 the cell gaps already are the borders), then the current tile's frame
    shapes = [dict(type="line", x0=e - 0.5, x1=e - 0.5, y0=-0.5, y1=n - 0.5, line=border)
              for e in sorted({*range(0, n, block_k), n}) if block_k > 1]
    shapes += [dict(type="line", x0=-0.5, x1=n - 0.5, y0=e - 0.5, y1=e - 0.5, line=border)
               for e in sorted({*range(0, n, block_q), n}) if block_q > 1]
    now = steps[current]
    shapes.append(dict(type="rect", x0=now.k_cols[0] - 0.5, x1=now.k_cols[1] - 0.5, y0=now.q_rows[0] - 0.5,
                       y1=now.q_rows[1] - 0.5, line=dict(color="#d9480f", width=5)))
    marks = [dict(x=(sum(s.k_cols) - 1) / 2, y=(sum(s.q_rows) - 1) / 2, text="✕", showarrow=False,
                  font=dict(size=16, color="#c92a2a")) for s in steps if s.skipped] if len(steps) <= 256 else []
    x_ticks, x_text = _tick_labels(labels)
    return figure([heat, *legend], height, shapes=shapes, annotations=marks,
                  margin=dict(r=50),  # room for the last key's slanted label
                  legend=dict(orientation="h", y=-0.01, x=0, yanchor="top", font=dict(size=14)),
                  xaxis=dict(tickvals=x_ticks, ticktext=x_text, side="top", tickangle=-45,
                             title=dict(text=names["keys"]), tickfont=dict(size=13), range=[-0.5, n - 0.5],
                             showgrid=False, zeroline=False),
                  yaxis=dict(tickvals=x_ticks, ticktext=x_text, autorange="reversed",
                             title=dict(text=names["queries"]), tickfont=dict(size=13), showgrid=False,
                             zeroline=False))


def output_heatmap(values: np.ndarray, row_labels: list[str], height: int = 260) -> Figure:
    """values (rows, d_head), e.g. a running output: blue < 0 < red, numbers printed while d_head is small."""
    rows, d = values.shape
    limit = float(np.max(np.abs(values))) or 1.0
    text = np.vectorize(lambda x: f"{x:.2f}")(values) if d <= 8 and rows <= 16 else None
    heat = dict(type="heatmap", z=values, x=list(range(d)), y=list(range(rows)), zmin=-limit, zmax=limit,
                colorscale="RdBu_r", colorbar=dict(thickness=12), text=text,
                texttemplate="%{text}" if text is not None else None, textfont=dict(size=13),
                hovertemplate="%{y} · d%{x}: %{z:.4f}<extra></extra>", xgap=1, ygap=1)
    y_ticks, y_text = _tick_labels(row_labels, 16)
    dims = list(range(0, d, max(1, d // 8)))
    return figure([heat], height, xaxis=dict(tickvals=dims, ticktext=[f"d{i}" for i in dims]),
                  yaxis=dict(tickvals=y_ticks, ticktext=y_text, autorange="reversed"))
