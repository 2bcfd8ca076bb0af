"""Plotly figures built from plain numpy arrays; colours chosen to stay visible on a projector."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

HEAT = "YlGnBu"
FONT = dict(size=15)
KEPT, CHOSEN, CUT_K, CUT_P = "#1f5fbf", "#e8590c", "#adb5bd", "#ffc9a8"


def _layout(fig: go.Figure, height: int, title: str = "") -> go.Figure:
    fig.update_layout(height=height, margin=dict(l=10, r=10, t=40 if title else 10, b=10), font=FONT,
                      title=dict(text=title, font=dict(size=16)) if title else None,
                      plot_bgcolor="white", paper_bgcolor="white")
    return fig


def attention_heatmap(weights: np.ndarray, query_labels: list[str], key_labels: list[str], title: str = "",
                      height: int = 420) -> go.Figure:
    """weights (queries, keys); masked (future) cells are exact zeros and shown blank."""
    shown = np.where(weights > 0, weights, np.nan)
    fig = go.Figure(go.Heatmap(
        z=shown, x=list(range(len(key_labels))), y=list(range(len(query_labels))), zmin=0, zmax=1,
        colorscale=HEAT, colorbar=dict(thickness=14), customdata=np.array(
            [[f"{q} → {k}" for k in key_labels] for q in query_labels]),
        hovertemplate="%{customdata}<br>%{z:.3f}<extra></extra>", xgap=1, ygap=1,
    ))
    fig.update_xaxes(tickvals=list(range(len(key_labels))), ticktext=key_labels, side="top", tickangle=-45)
    fig.update_yaxes(tickvals=list(range(len(query_labels))), ticktext=query_labels, autorange="reversed")
    return _layout(fig, height, title)


def heads_grid(weights: np.ndarray, head_title: str, height: int = 300) -> go.Figure:
    """weights (heads, queries, keys): one small heatmap per head, side by side."""
    n_heads = weights.shape[0]
    fig = make_subplots(rows=1, cols=n_heads, subplot_titles=[head_title.format(h=h) for h in range(n_heads)],
                        horizontal_spacing=0.03)
    for h in range(n_heads):
        fig.add_trace(go.Heatmap(z=np.where(weights[h] > 0, weights[h], np.nan), zmin=0, zmax=1, colorscale=HEAT,
                                 showscale=h == n_heads - 1, hovertemplate="%{z:.3f}<extra></extra>"),
                      row=1, col=h + 1)
        fig.update_yaxes(autorange="reversed", showticklabels=h == 0, row=1, col=h + 1)
    fig.update_xaxes(showticklabels=False)
    return _layout(fig, height)


def probability_bars(labels: list[str], probs: np.ndarray, status: list[str], status_names: dict[str, str],
                     height: int = 380) -> go.Figure:
    """One bar per candidate; status is 'chosen', 'kept', 'cut_k' or 'cut_p'."""
    colours = {"chosen": CHOSEN, "kept": KEPT, "cut_k": CUT_K, "cut_p": CUT_P}
    fig = go.Figure()
    for kind in ("chosen", "kept", "cut_p", "cut_k"):
        idx = [i for i, s in enumerate(status) if s == kind]
        if idx:
            fig.add_trace(go.Bar(x=[labels[i] for i in idx], y=probs[idx], name=status_names[kind],
                                 marker_color=colours[kind], text=[f"{probs[i]:.2f}" for i in idx],
                                 textposition="outside", hovertemplate="%{x}: %{y:.4f}<extra></extra>"))
    fig.update_xaxes(categoryorder="array", categoryarray=labels)
    fig.update_yaxes(range=[0, min(1.0, float(probs.max()) * 1.25 + 0.02)], tickformat=".0%")
    fig.update_layout(legend=dict(orientation="h", y=1.12, x=0), barmode="overlay")
    return _layout(fig, height)


def lines(x: list, series: dict[str, list], x_title: str, y_title: str, height: int = 340,
          dashed: tuple[str, ...] = ()) -> go.Figure:
    fig = go.Figure()
    palette = [KEPT, CHOSEN, "#2b8a3e", "#862e9c"]
    for (name, ys), colour in zip(series.items(), palette):
        fig.add_trace(go.Scatter(x=x, y=ys, name=name, mode="lines+markers", line=dict(
            color=colour, width=3, dash="dash" if name in dashed else "solid"), marker=dict(size=8)))
    fig.update_xaxes(title=x_title)
    fig.update_yaxes(title=y_title, rangemode="tozero")
    fig.update_layout(legend=dict(orientation="h", y=1.15, x=0))
    return _layout(fig, height)
