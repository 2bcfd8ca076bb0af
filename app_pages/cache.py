"""Cache vs recompute: positions processed by the formula and by the real run, and measured time per token.

The key figure is the two counts for the chosen N and T (with and without the cache) and their running totals;
N, T and the lesson's presets sit in one row above it, the explanation below it."""

import streamlit as st

from model.engine.counting import cumulative_positions, positions_with_cache, positions_without_cache, step_bytes
from model.serving.costs import weight_bytes
from model.serving.timing import contexts_for, percentile, time_per_token
from ui import charts
from ui.classroom import key_figure, localised, why
from ui.controls import cache_by_layer_kind
from ui.errors import guarded
from ui.i18n import decimal, number, t
from ui.models import current_model
from ui.predict import cache_guess, cache_revealed
from ui.run import generation

PRESETS = {"13/5": (13, 5), "2/4": (2, 4)}
SERVING_ROWS = 8  # requests of the run's length decoded together, the Serving page's example batch


def apply_preset(n: int, new_tokens: int) -> None:
    st.session_state.count_n, st.session_state.count_t = n, new_tokens


def ms(value: float) -> str:
    return decimal(value, 3)


st.title(t("cache.title"))
c1, c2, c3 = st.columns([2, 2, 3], vertical_alignment="bottom")
c1.slider(t("cache.n"), 1, 200, key="count_n")
c2.slider(t("cache.t"), 1, 200, key="count_t")
with c3, st.container(horizontal=True, vertical_alignment="center"):  # buttons as wide as their labels
    for name, (n, new) in PRESETS.items():
        st.button(t("cache.preset", n=n, t=new), key=f"preset_{name}", on_click=apply_preset, args=(n, new),
                  help=t("cache.preset_help"))
    st.toggle(t("predict.toggle"), key="predict_on", help=t("predict.help_cache"))
n, new = st.session_state.count_n, st.session_state.count_t
shown = not st.session_state.predict_on or cache_revealed(n, new)
with key_figure():
    if st.session_state.predict_on:
        cache_guess(n, new)  # the guesses first; the numbers below only once revealed for this N and T
    if shown:
        with_cache, without_cache = positions_with_cache(n, new), positions_without_cache(n, new)
        m1, m2, m3 = st.columns(3)
        m1.metric(t("cache.with"), number(with_cache), help=t("cache.with_formula", n=n, t=new))
        m2.metric(t("cache.without"), number(without_cache), help=t("cache.without_formula", n=n, t=new))
        m3.metric(t("cache.ratio"), decimal(without_cache / with_cache, 2) + "×")
        running_with, running_without = cumulative_positions(n, new)
        st.plotly_chart(localised(charts.lines(list(range(1, new + 1)), {t("cache.with"): running_with,
                                                                         t("cache.without"): running_without},
                                               t("cache.axis_token"), t("cache.axis_positions"), height=300)),
                        key="cache_counts")
with why("cache"):
    if shown:
        st.markdown(t("cache.explain", n=n, t=new, with_cache=number(with_cache),
                      without_cache=number(without_cache), last=n + new - 1))
    st.caption(t("cache.intro"))

st.subheader(t("cache.your_run"))
model = current_model()
if model is None:
    st.stop()
gen = generation(model)
if gen is None:
    st.info(t("cache.no_run"))
else:
    r1, r2, r3, r4 = st.columns(4)
    r1.metric(t("cache.prompt_len"), number(len(gen.prompt_ids)))
    r2.metric(t("cache.new_tokens"), number(len(gen.new_ids)))
    r3.metric(t("cache.with"), number(gen.positions_with_cache))
    r4.metric(t("cache.without"), number(gen.positions_without_cache))
    st.caption(t("cache.your_run_note", cache=number(gen.cache.length),
                 fed=number(sum(len(s.input_ids) for s in gen.steps))))
    by_kind = cache_by_layer_kind(model.info.cache_shape, gen.cache.length, gen.cache.nbytes())
    if by_kind:
        st.markdown(by_kind)
    if model.info.backend == "native":
        n, b = gen.cache.length, SERVING_ROWS
        one = model.info.cache_bytes_formula(n)
        weights_b, weights_1 = weight_bytes(model.module, b), weight_bytes(model.module, 1)
        st.markdown(t("cache.serving_note", n=n, b=b, one=number(one), many=number(b * one),
                      weights=number(weights_b), weights_one=number(weights_1),
                      step=number(step_bytes(weights_b, [one] * b)),
                      solo=number(b * step_bytes(weights_1, [one]))))

st.subheader(t("cache.measured"))
info = model.info
contexts = contexts_for(model)
conditions = t("cache.conditions", model=info.name, device=info.device, dtype=info.dtype,
               contexts=", ".join(map(number, contexts)))
st.caption(conditions)
if st.button(t("cache.measure"), key="measure", type="primary", icon=":material/timer:"):
    bar = st.progress(0.0, text=t("cache.measuring"))
    rows = guarded(lambda: time_per_token(model, contexts, progress=lambda f: bar.progress(f, t("cache.measuring"))))
    bar.empty()
    if rows is not None:
        st.session_state.bench_result = (conditions, rows)
if st.session_state.bench_result is not None:
    measured_conditions, rows = st.session_state.bench_result
    # the whole main column's width: the six columns fit at 1280 px (beside the chart they were cut off)
    st.plotly_chart(localised(charts.lines([r.context for r in rows], {
        t("cache.cached_p50"): [percentile(r.cached_ms, 50) for r in rows],
        t("cache.recompute_p50"): [percentile(r.recompute_ms, 50) for r in rows]},
        t("cache.context"), "ms")), key="cache_timing")
    st.dataframe([{t("cache.context"): number(r.context),
                   t("cache.cached_p50"): ms(percentile(r.cached_ms, 50)),
                   t("cache.cached_p95"): ms(percentile(r.cached_ms, 95)),
                   t("cache.recompute_p50"): ms(percentile(r.recompute_ms, 50)),
                   t("cache.recompute_p95"): ms(percentile(r.recompute_ms, 95)),
                   t("cache.speedup"): decimal(r.speedup, 1) + "×"} for r in rows], hide_index=True)
    st.caption(measured_conditions)
    st.caption(t("cache.timing_note"))
