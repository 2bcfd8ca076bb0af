"""The logit lens and switched-off heads as HTML, for the Decode page's step view and the Prefill page: each a
side computation on one step of the session's run (model/engine/lens.py, model/engine/ablation.py), drawn as
one piece of HTML so that the step view stays one element."""

from __future__ import annotations

import streamlit as st

from model.engine.ablation import ablate, parse_heads
from model.engine.generate import Generation
from model.engine.lens import LENS_TOP, LogitLens, logit_lens
from model.engine.runtime import LoadedModel, ModelInfo
from ui.errors import attempt
from ui.i18n import t
from ui.reruns import redraw_only
from ui.widgets import box_html, heading_html, md_escape, paragraph_html, shown, table_html


def head_options(info: ModelInfo) -> list[str]:
    """Every query head as "layer.head", the way the command line's --ablate takes them."""
    return [f"{layer}.{head}" for layer in range(info.n_layers) for head in range(info.n_heads)]


def probe_controls(info: ModelInfo, redraw: str | None = None, lens: bool = True) -> None:
    """The lens toggle and the heads to switch off, drawn into the caller's row; `redraw` names the fragment that
    shows the step. On a transformers model there is nothing to switch: a caption says why."""
    if info.backend != "native":
        st.caption(t("lens.native_only"))
        return
    options = head_options(info)
    # heads chosen on another model's page may not exist here
    st.session_state.heads_off = [h for h in st.session_state.heads_off if h in options]
    change = dict(on_change=redraw_only, args=(redraw,))
    if lens:
        st.toggle(t("lens.toggle"), key="logit_lens", help=t("lens.toggle_help"), **change)
    st.multiselect(t("ablation.select"), options, key="heads_off", help=t("ablation.select_help"),
                   placeholder=t("ablation.placeholder"), width=260,
                   **change)


def token_label(model: LoadedModel, token_id: int) -> str:
    return shown(model.tokenizer.token(token_id))


def lens_reading(lens: LogitLens, token: str, diff: str) -> tuple[str, dict]:
    """The sentence under the lens table as a text key and its details: from which layer on the chosen token is
    first at every layer, and whether a layer before that already had it first (it can lose the lead and take it
    back: settled_at is then later than first_at)."""
    settled, layers = lens.settled_at, len(lens.layers)
    if settled is None:
        return "lens.not_first", {"token": token, "diff": diff}
    details = {"token": token, "layer": settled, "n": layers - settled, "layers": layers, "diff": diff}
    if settled == 0:
        return "lens.settled_all", details
    if lens.first_at < settled:
        earlier = sum(row.chosen_rank == 1 for row in lens.layers[:settled])
        return "lens.settled_again", details | {"first": lens.first_at, "earlier": earlier}
    return "lens.settled", details


def lens_html(model: LoadedModel, gen: Generation) -> str:
    """The current step's logit lens: per layer the top tokens with their probabilities and the chosen token's rank."""
    trace, drawn = gen.steps[-1], gen.samples[-1]
    lens = logit_lens(model, gen.cache, trace, drawn.chosen_id)
    chosen = token_label(model, drawn.chosen_id)
    rows = [[row.layer, *(("★ " if i == drawn.chosen_id else "") + f"{token_label(model, i)} {p:.3f}"
                          for i, p in zip(row.top_ids, row.top_probs)), row.chosen_rank] for row in lens.layers]
    key, details = lens_reading(lens, md_escape(chosen), f"{float(abs(lens.last_logits - trace.logits).max()):.1e}")
    return (heading_html(t("lens.title"))
            + table_html([t("lens.layer"), *(t("lens.top_n", n=n) for n in range(1, LENS_TOP + 1)),
                          t("lens.chosen_rank", token=chosen)], rows)
            + paragraph_html(t(key, **details), "dl-caption"))


def ablation_html(model: LoadedModel, gen: Generation, step_index: int, heads_off: list[str]) -> str:
    """Step `step_index` of the run recomputed with the chosen heads off, beside the real one."""
    trace, drawn = gen.steps[step_index], gen.samples[step_index]
    heads = parse_heads(",".join(heads_off), model.info)
    result = ablate(model, gen.cache, trace, heads, gen.settings, step_index, drawn.chosen_id)
    header = [t("ablation.token"), t("ablation.prob")]

    def side(title: str, top: list[tuple[int, float]]) -> str:
        return (paragraph_html(f"**{title}**")
                + table_html(header, [[("★ " if i == drawn.chosen_id else "") + token_label(model, i), f"{p:.3f}"]
                                      for i, p in top]))

    before, after = (md_escape(token_label(model, i)) for i in (result.chosen_before, result.chosen_after))
    verdict = (t("ablation.changed", before=before, after=after) if result.changed
               else t("ablation.same", token=before))
    return (heading_html(t("ablation.title", heads=", ".join(heads_off)))
            + f'<div class="dl-grid"><div>{side(t("ablation.before"), result.top_before)}</div>'
              f'<div>{side(t("ablation.after"), result.top_after)}</div></div>'
            + paragraph_html(t("ablation.kl", kl=f"{result.kl:.4f}"))
            + paragraph_html(verdict))


def probes_html(model: LoadedModel, gen: Generation, step_index: int, lens: bool) -> str:
    """The views the session asked for on step `step_index` (the lens only on the latest step, whose positions the
    cache holds last), or the sentence saying why one failed; "" when none is asked for."""
    heads_off = st.session_state.heads_off
    if model.info.backend != "native" or not (lens or heads_off):
        return ""
    html, error = attempt(lambda: (lens_html(model, gen) if lens else "")
                          + (ablation_html(model, gen, step_index, heads_off) if heads_off else ""))
    return html if error is None else box_html(error, "fail")
