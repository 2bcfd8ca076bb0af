"""KV cache in fewer bytes: three lessons, each its picture first and its numbers beside it (model/serving/kv_lessons).

1. Bytes a position per cache option (bars; the key figure), and the quality per cache dtype from a run over the
   held-out text. 2. Perplexity by position through a bounded cache: full, sinks + window, window alone, H2O.
3. The attention sink: the weight each layer and head puts on position 0 (a heat map).

Every measured figure comes from a run on the sidebar's model, at open for the small models (a second or two),
behind a button for the others; the text, model, dtype and machine are said beside it.
"""

import numpy as np
import streamlit as st

from model.engine.kv_evict import check_window
from model.engine.kv_quant import GROUP
from model.errors import InputError
from model.serving.kv_lessons import (
    PAPERS,
    QUANTIZED,
    SMOOTH,
    along,
    cache_bytes,
    cache_quality,
    default_bound,
    machine,
    sink_map,
)
from model.serving.quality import unknown_tokens
from ui import charts
from ui.classroom import key_figure, localised, settings, why
from ui.errors import guarded
from ui.i18n import decimal, number, scientific, t
from ui.models import current_model
from ui.serving_run import StopBar
from ui.state import keep_across_pages
from ui.widgets import table_html

MEASURE_AT_OPEN = ("small",)  # models whose three runs take about two seconds on one CPU thread
COLOURS = {"full": "#495057", "sinks": charts.KEPT, "window": charts.CHOSEN, "heavy_hitters": "#2b8a3e"}

st.title(t("kv.title"))
st.caption(t("kv.intro"))
model = current_model()
if model is None:
    st.stop()
info = model.info
native = info.backend == "native"
device, threads = machine(model)
where = dict(model=info.name, dtype=info.dtype, device=device, threads=threads)
store = st.session_state.setdefault("kv_measured", {})
# the bound's settings survive a visit to another page; the window's first value fits the first model's context
keep_across_pages(dict(zip(("kv_sinks", "kv_window"), default_bound(info.context_length))))


def measured(lesson: str, action, label: str):
    """The lesson's run for this model: done at open for the small models, else when its button is pressed, in the
    page's script under a Stop button and a bar (a click on Stop, or anything else, ends it at the next redraw and
    nothing is kept); action(progress) tells the share done. A refusal is said once, in a sentence."""
    key = (lesson, info.name, info.device)
    if key not in store and native and (info.name in MEASURE_AT_OPEN
                                        or st.button(t(label), key=f"kv_measure_{lesson}", type="primary",
                                                     icon=":material/science:")):
        bar = StopBar(f"kv_stop_{lesson}", t("kv.measuring"))
        store[key] = guarded(lambda: action(lambda done: bar.draw(done, t("kv.measuring"))))
        bar.clear()
    return store.get(key)


def bars_figure() -> dict:
    options = cache_bytes(model)
    names = [t("kv.opt_" + o.option, dtype=info.dtype) for o in options]
    values = [o.bytes_per_position for o in options]
    colours = ["#adb5bd" if o.formula_only else charts.CHOSEN if o.option == "multi_head" else charts.KEPT
               for o in options]
    bar = dict(type="bar", x=values, y=names, orientation="h", marker=dict(color=colours),
               text=[number(v, ",.0f") for v in values], textposition="auto",
               hovertemplate="%{x:,.0f} B<extra></extra>")
    return charts.figure([bar], 260, xaxis=dict(title=dict(text=t("kv.axis_bytes"))),
                         yaxis=dict(autorange="reversed"), margin=dict(l=10),
                         uniformtext=dict(minsize=16, mode="show"))  # plotly would shrink a label to fit its bar


def kept_figure(run) -> dict:
    """Which text positions each bounded cache held at the end of its run: one row for the sinks + window and one
    for the window alone (every layer holds the same), one per layer for H2O (each layer's attention chooses)."""
    fed = len(run.nll["full"])
    rows = [(t("kv.policy_sinks"), run.kept["sinks"][0]), (t("kv.policy_window"), run.kept["window"][0])]
    rows += [(t("kv.kept_h2o_layer", layer=layer), held) for layer, held in enumerate(run.kept["heavy_hitters"])]
    z = [[int(p in kept) for p in range(fed)] for kept in (set(held) for _, held in rows)]
    heat = dict(type="heatmap", z=z, x=list(range(fed)), y=[name for name, _ in rows], zmin=0, zmax=1,
                colorscale=[[0, "#f1f3f5"], [1, charts.KEPT]], showscale=False, xgap=0, ygap=2,
                hovertemplate="%{y} · %{x}<extra></extra>")
    return charts.figure([heat], 18 * len(rows) + 110, xaxis=dict(title=dict(text=t("kv.axis_kept"))),
                         yaxis=dict(autorange="reversed"), margin=dict(l=10))


# -- 1. bytes a position, and quality per cache dtype ----------------------------------------------------------------
st.subheader(t("kv.lesson_bytes"))
with key_figure():
    left, right = st.columns([1, 1])  # the quality table beside the bars: its five columns need half the width
    left.plotly_chart(localised(bars_figure()), key="kv_chart_bytes")
    with right:
        measured_quality = measured("quality", lambda progress: cache_quality(model, progress), "kv.measure_quality")
        if measured_quality is not None:
            quality, steps = measured_quality.quality, measured_quality.steps
            st.html(table_html(
                [t("kv.col_kv_dtype"), t("kv.col_perplexity"), t("kv.col_kl"), t("kv.col_agreement"),
                 t("kv.col_step_ms")],
                [[r.dtype, decimal(r.perplexity, 3), scientific(r.mean_kl), f"{r.greedy_agree}/{r.greedy_total}",
                  decimal(measured_quality.step_ms(r.dtype), 2)] for r in quality.rows]))
            st.caption(t("kv.quality_conditions", text=quality.text, tokens=number(quality.tokens),
                         prompts=quality.prompts, new=quality.new_tokens, **where))
            unk = unknown_tokens(model)
            if unk:  # a word-level vocabulary that lacks the text's words: the perplexity is over <unk> mostly
                st.caption(t("serving.quality_unk", unk=number(unk), tokens=number(quality.tokens)))
            st.caption(t("kv.step_conditions", context=number(steps.context), repeats=len(steps.ms["float32"])))
            if all(measured_quality.step_ms(d) > measured_quality.step_ms("float32") for d in QUANTIZED):
                st.caption(t("kv.step_slower"))
        elif not native:
            st.info(t("kv.native_only", model=info.name))
groups = info.n_heads // info.n_kv_heads
st.caption(t("kv.bytes_caption", model=info.name, layers=info.n_layers, heads=info.n_heads, kv=info.n_kv_heads,
             d=info.d_head, group=GROUP, mla=PAPERS["mla"]))
with why("kv_bytes"):
    st.markdown(t("kv.why_bytes", model=info.name, kv=info.n_kv_heads, heads=info.n_heads, ratio=groups, **PAPERS))

# -- 2. a bounded cache along a text ---------------------------------------------------------------------------------
st.subheader(t("kv.lesson_along"))
with settings("kv"):
    s1, s2 = st.columns(2)
    sinks = s1.number_input(t("kv.sinks"), min_value=0, max_value=64, key="kv_sinks")
    window = s2.number_input(t("kv.window"), min_value=1, max_value=1024, key="kv_window")
try:
    check_window(model, int(sinks), int(window))
    refusal = None
except InputError as bad:
    refusal = (t("kv.sliding", model=info.name) if bad.code == "kv_window_sliding" else
               t("decode.bounded_range", s=int(sinks), w=int(window), context=info.context_length))
if refusal is not None:
    st.info(refusal)
else:
    run = measured(f"along_{sinks}_{window}", lambda progress: along(model, int(sinks), int(window), progress),
                   "kv.measure_along")
    if run is not None:
        picture, table = st.columns([3, 2])
        bound = run.sinks + run.window
        traces = [dict(type="scatter", x=list(range(1, len(nll) + 1)), y=run.perplexity(policy).tolist(),
                       name=t("kv.policy_" + policy), mode="lines", line=dict(color=COLOURS[policy], width=3))
                  for policy, nll in run.nll.items()]
        picture.plotly_chart(localised(charts.figure(
            traces, 340, xaxis=dict(title=dict(text=t("kv.axis_position"))),
            yaxis=dict(title=dict(text=t("kv.axis_perplexity", smooth=SMOOTH)), type="log"),
            legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0), margin=dict(t=40),
            shapes=[dict(type="line", x0=bound, x1=bound, yref="paper", y0=0, y1=1,
                         line=dict(color="#495057", dash="dash"))],
            annotations=[dict(x=bound, yref="paper", y=1, text=t("kv.bound"), showarrow=False, xanchor="left")])),
            key="kv_chart_along")
        kept = {"full": t("kv.kept_all"), "sinks": f"{run.sinks} + {run.window}", "window": str(bound),
                "heavy_hitters": f"{run.sinks} + {run.window}"}
        table.html(table_html([t("kv.col_policy"), t("kv.col_kept"), t("kv.col_past_bound")],
                              [[t("kv.policy_" + p), kept[p], decimal(run.past_bound(p), 1)] for p in run.nll]))
        fed = len(run.nll["full"]) + 1
        table.caption(t("kv.along_conditions", text=run.text, tokens=number(fed), **where))
        unk = unknown_tokens(model, fed)
        if unk:
            table.caption(t("kv.along_unk", unk=number(unk), tokens=number(fed - 1), model=info.name))
        st.plotly_chart(localised(kept_figure(run)), key="kv_chart_kept")
with why("kv_along"):
    st.markdown(t("kv.why_along", **PAPERS))

# -- 3. the attention sink -------------------------------------------------------------------------------------------
st.subheader(t("kv.lesson_sinks"))
sink = measured("sinks", lambda progress: sink_map(model), "kv.measure_sinks")
if sink is not None:
    picture, table = st.columns([3, 2])
    layers, heads = sink.mass.shape
    cells = np.round(sink.mass, 2)
    heat = dict(type="heatmap", z=cells.tolist(), x=list(range(heads)), y=list(range(layers)), zmin=0, zmax=1,
                colorscale=charts.HEAT, hovertemplate="%{z:.3f}<extra></extra>",
                colorbar=dict(thickness=14), **({"texttemplate": "%{z:.2f}"} if layers * heads <= 64 else {}))
    picture.plotly_chart(localised(charts.figure(
        [heat], max(240, 22 * layers + 80), xaxis=dict(title=dict(text=t("kv.axis_head")), dtick=1),
        yaxis=dict(title=dict(text=t("kv.axis_layer")), autorange="reversed", dtick=1))), key="kv_chart_sinks")
    table.html(table_html([t("kv.col_layer"), t("kv.col_mean"), t("kv.col_max")],
                          [[layer, decimal(float(row.mean()), 3), decimal(float(row.max()), 3)]
                           for layer, row in enumerate(sink.mass)]))
    table.caption(t("kv.sinks_conditions", text=sink.text, tokens=number(sink.tokens), skip=sink.skip,
                    uniform=decimal(sink.even, 3), **where))
