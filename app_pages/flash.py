"""Flash Attention, live: one head of a real prefill attended tile by tile with an online softmax, checked
against softmax(QKᵀ/√d_head)·V; then, folded, the bytes of the score matrix and of the traffic to main memory.

The key figure is the tile grid and its walk. Before any prefill the page walks its own example sentence (long
enough that a tile holds several scores), so it never opens empty; a prefill in the folded prompt form walks that
run's prompt instead.

The tile walk is a fragment of four buttons and one piece of HTML with two SVG charts, as on the Decode page: the
browser's work per click grows with the number of elements it redraws (benchmarks/click_latency.py).
"""

import streamlit as st

from model.engine.flash import (
    BLOCK_SIZES,
    block_size_choices,
    default_block_size,
    human_bytes,
    naive_traffic_bytes,
    score_matrix_bytes,
    tile_buffer_bytes,
    tiled_traffic_bytes,
    walk_head,
)
from model.engine.generate import encode_prompt, parse_prompt_ids
from ui import svg
from ui.classroom import key_figure, presenter, settings, why
from ui.controls import layer_head_selectors, prompt_form
from ui.errors import guarded
from ui.i18n import decimal, number, t
from ui.models import current_model
from ui.run import generation
from ui.widgets import BACK_KEY, NEXT_KEY, box_html, legend_html, paragraph_html, table_html

PRECISIONS = {"float16": 2, "float32": 4}
PRESENTER_ZOOM = 1.35  # presenter mode: the grid alone on its row, grown so its 13-14 px labels draw at 17 px and more


def go_to(step: int) -> None:
    st.session_state.flash_step = step


def shift(delta: int) -> None:
    st.session_state.flash_step += delta


def size(n: int) -> str:
    """2147483648 -> '2 GiB (2 147 483 648 B)': human units for the eye, the exact count for the check."""
    exact = f"{n:,}".replace(",", "\u202f")
    return f"{human_bytes(n, t('flash.decimal'))} ({exact} B)"


def span(bounds: tuple[int, int]) -> str:
    """(start, stop) positions -> '4–7', or '4' for one position."""
    return str(bounds[0]) if bounds[1] - bounds[0] == 1 else f"{bounds[0]}–{bounds[1] - 1}"


def score(x: float) -> str:
    return "−∞" if x == float("-inf") else decimal(x, 3)


def example_ids(model) -> list[int]:
    """The page's own prompt before any prefill: the form's ids on a model prompted by ids (micro), else the
    example sentence of the page's language."""
    if st.session_state.prompt_mode == "ids":
        return parse_prompt_ids(model, st.session_state.prompt_ids_text)
    return encode_prompt(model, t("flash.example")).ids


st.title(t("flash.title"))
model = current_model()
if model is None:
    st.stop()
info, tok = model.info, model.tokenizer
if not hasattr(model, "attention_inputs"):
    st.warning(t("flash.no_qkv", name=info.name))
    st.stop()
with settings("flash"):
    prompt_form(model)
gen = generation(model)
ids = gen.prompt_ids if gen is not None else guarded(lambda: example_ids(model))
if ids is None:
    st.stop()
n = len(ids)
choices = block_size_choices(n)
if st.session_state.flash_for != tuple(ids) or st.session_state.flash_block not in choices:
    # a new prompt: a block size scaled to it, and the walk from its first tile
    st.session_state.flash_block, st.session_state.flash_step = default_block_size(n), 0
    st.session_state.flash_for = tuple(ids)
with st.container(horizontal=True, vertical_alignment="bottom"):
    layer, head = layer_head_selectors(info)
    block = st.selectbox(t("flash.block"), choices, key="flash_block", width=200, on_change=go_to, args=(0,),
                         format_func={b: f"{b} × {b}" for b in choices}.get, help=t("flash.block_help"))
walk_for = (info.name, info.device, tuple(ids), layer, head, block)
if st.session_state.flash_walk_for != walk_for:  # Next/Back redraw the same walk: compute it once
    st.session_state.flash_walk = guarded(lambda: walk_head(model, ids, layer, head, block))
    st.session_state.flash_walk_for = walk_for if st.session_state.flash_walk is not None else None
result = st.session_state.flash_walk
if result is None:
    st.stop()
steps, read = result.walk.steps, result.read_steps  # the walk visits only the tiles it reads
labels = [f"{p}:{tok.token(i)}" for p, i in enumerate(ids)]
st.markdown(t("flash.using_prompt" if gen is not None else "flash.using_example", n=n, layer=layer, head=head,
              kv=result.kv_head, d=info.d_head))


@st.fragment
def tile_walk() -> None:
    """What the tile index changes: First, Back, Next and Last rerun only this part of the page, four buttons and
    one piece of HTML (the grid, the tile's sentences, its statistics and the running output), not the check, the
    memory and the traffic below, which hold for the whole walk."""
    last = len(read) - 1
    st.session_state.flash_step = index = max(0, min(st.session_state.flash_step, last))
    with st.container(horizontal=True):
        st.button(t("flash.first"), key="flash_first", icon=":material/first_page:", on_click=go_to, args=(0,),
                  disabled=index == 0, width=150)
        st.button(t("action.back"), key="flash_back", icon=":material/chevron_left:", on_click=shift, args=(-1,),
                  disabled=index == 0, width=150, shortcut=BACK_KEY)
        st.button(t("flash.next"), key="flash_next", icon=":material/chevron_right:", icon_position="right",
                  type="primary", on_click=shift, args=(1,), disabled=index == last, width=150, shortcut=NEXT_KEY)
        st.button(t("flash.last"), key="flash_last", icon=":material/last_page:", icon_position="right", on_click=go_to,
                  args=(last,), disabled=index == last, width=150)
    st.html(tile_html(index, last))


def tile_html(index: int, last: int) -> str:
    """The tile being read: the grid with its legend beside the tile's sentences, the rows' m and ℓ beside the
    running output below them (in presenter mode one below the other, and both pictures grown)."""
    step = steps[read[index]]
    zoom = PRESENTER_ZOOM if presenter() else 1.0
    rows, cols = span(step.q_rows), span(step.k_cols)
    grid = (svg.tile_grid_svg(steps, read[index], labels, (t("flash.axis_keys"), t("flash.axis_queries")),
                              t("flash.walk"), decimal, zoom)
            + legend_html({t("flash.state_" + s): svg.TILE_COLOURS[s] for s in svg.TILE_STATES}, outlined=True)
            + paragraph_html(t("flash.grid_caption"), "dl-caption"))
    done = (box_html(t("flash.block_done", qb=step.q_block, rows=rows), "pass")
            if index == last or steps[read[index + 1]].q_block != step.q_block else "")
    m_before, l_before, alpha = result.before(read[index])
    stats = table_html(
        [t("flash.col_query"), t("flash.col_tile_max"), t("flash.col_m"), t("flash.col_alpha"), t("flash.col_l")],
        [[labels[r], score(step.scores[i].max()), f"{score(m_before[i])} → {score(step.row_max[i])}",
          score(alpha[i]), f"{score(l_before[i])} → {score(step.row_sum[i])}"]
         for i, r in enumerate(range(*step.q_rows))])
    tile = (paragraph_html(t("flash.position", step=index + 1, total=last + 1, qb=step.q_block, kb=step.k_block,
                             rows=rows, cols=cols))
            + paragraph_html(t("flash.read_tile", cols=cols, rows=rows, bq=step.scores.shape[0],
                               bk=step.scores.shape[1]))
            + done)
    rows_state = (paragraph_html("**" + t("flash.stats") + "**")
                  + f'<div class="dl-scroll">{stats}</div>'  # a block of 64 or 128 rows scrolls in place
                  + paragraph_html(t("flash.stats_caption"), "dl-caption"))
    output = (paragraph_html("**" + t("flash.partial") + "**")
              + svg.output_svg(step.partial_output, labels[slice(*step.q_rows)], t("flash.partial"), decimal, zoom)
              + paragraph_html(t("flash.partial_caption", gap=number(result.gap(step), ".3g")), "dl-caption"))
    if presenter():
        return grid + tile + rows_state + output
    # the grid takes three fifths beside the tile's sentences (at half the width its scores drew at 9 px); the rows'
    # m and ℓ and the running output share the row below
    return (f'<div class="dl-grid dl-grid-picture"><div>{grid}</div><div>{tile}</div></div>'
            f'<div class="dl-grid"><div>{rows_state}</div><div>{output}</div></div>')


with key_figure():
    tile_walk()
with why("flash"):
    st.latex(t("flash.latex_update"))
    st.caption(t("flash.intro"))

st.subheader(t("flash.check"))
passed = result.max_abs_diff <= result.tolerance
diff = number(result.max_abs_diff, ".2e")
m1, m2 = st.columns([1, 4])
m1.metric(t("flash.check_metric"), diff, help=t("flash.check_help"))
with m2:
    (st.success if passed else st.error)(t(
        "flash.check_result_pass" if passed else "flash.check_result_fail", block=block, tiles=len(steps),
        skipped=len(steps) - len(read), n=n, diff=diff, tol=number(result.tolerance, ".2g")))
    if n % block:
        st.info(t("flash.ragged", n=n, block=block, rest=n % block))

with st.expander(t("flash.memory"), key="flash_memory_more"):
    st.latex(t("flash.latex_memory"))
    st.caption(t("flash.memory_legend"))
    b = info.bytes_per_element
    score_now, tile_now = score_matrix_bytes(n, b), tile_buffer_bytes(block, block, info.d_head, b)
    st.markdown(t("flash.memory_now", n=n, d=info.d_head, block=block, dtype=info.dtype, b=b))
    n1, n2, n3 = st.columns(3)
    n1.metric(t("flash.score_metric"), human_bytes(score_now, t("flash.decimal")), help=size(score_now))
    n2.metric(t("flash.tile_metric"), human_bytes(tile_now, t("flash.decimal")), help=size(tile_now))
    n3.metric(t("flash.ratio_metric"), decimal(score_now / tile_now, 2) + "×")
    if score_now < tile_now:
        st.caption(t("flash.small_note"))

    st.markdown("**" + t("flash.at_scale") + "**")
    i1, i2, i3 = st.columns(3)
    big_n = i1.number_input(t("flash.custom_n"), min_value=1, max_value=1 << 20, step=1024, key="flash_custom_n",
                            help=t("flash.custom_n_help"))
    d = i2.number_input(t("flash.custom_d"), min_value=1, max_value=1024, key="flash_custom_d")
    big_b = i3.selectbox(t("flash.custom_block"), BLOCK_SIZES, key="flash_custom_block",
                         format_func={x: f"{x} × {x}" for x in BLOCK_SIZES}.get)
    st.dataframe([{t("flash.col_precision"): name, t("flash.col_score"): size(score_matrix_bytes(big_n, nbytes)),
                   t("flash.col_tile"): size(tile_buffer_bytes(big_b, big_b, d, nbytes))}
                  for name, nbytes in PRECISIONS.items()], hide_index=True)

with st.expander(t("flash.traffic"), key="flash_traffic_more"):
    st.markdown(t("flash.traffic_intro"))
    st.markdown(t("flash.naive_label"))
    st.latex(t("flash.latex_naive"))
    st.markdown(t("flash.tiled_label"))
    st.latex(t("flash.latex_tiled"))
    traffic = {}
    for name, nbytes in PRECISIONS.items():
        traffic[name, "naive"] = naive_traffic_bytes(big_n, d, nbytes)
        traffic[name, "tiled"] = tiled_traffic_bytes(big_n, d, big_b, nbytes)
    st.dataframe([{t("flash.col_method"): t("flash.method_" + method), t("flash.col_precision"): name,
                   t("flash.col_read"): size(x.read_bytes), t("flash.col_written"): size(x.written_bytes),
                   t("flash.col_total"): size(x.total)} for (name, method), x in traffic.items()], hide_index=True)
    ratio = traffic["float16", "naive"].total / traffic["float16", "tiled"].total
    st.metric(t("flash.traffic_ratio"), decimal(ratio, 1) + "×",
              help=f"N = {number(big_n)}, d_head = {number(d)}, B = {number(big_b)}")
    st.caption(t("flash.traffic_note"))
