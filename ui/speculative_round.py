"""One speculative round drawn as the Speculative page draws it: the sequence's chips, the proposals' table, the
target's own token, both caches, and the running counts. The Speculative page draws its live run with it, the
Replay page a recorded one (model/recording/replay.py replayed_run): both pass a run and a token(id) -> text."""

from collections.abc import Callable
from html import escape

import streamlit as st

from model.speculative import decoding, rules
from ui.i18n import decimal, t
from ui.widgets import md_escape, token_strip

ROUND_CSS = """<style>
.tok.spec-accepted{background:#d3f9d8;border-color:#2b8a3e}
.tok.spec-target{background:#ffe8cc;border-color:#e8590c;font-weight:700}
</style>"""
# the round as a picture: a column per proposal (and one for a token the target adds after them), the draft's row
# above the target's; sized in rem, so presenter mode's larger root enlarges it
PICTURE_CSS = """<style>
.spec-round{display:grid;gap:.5rem;align-items:stretch;width:100%;margin:.25rem 0 .5rem 0}
.spec-round .who{font-weight:600;font-size:1rem;align-self:center;padding-right:.5rem}
.spec-cell{border:3px solid #dee2e6;border-radius:.5rem;padding:.35rem .5rem;text-align:center;background:#f8f9fa;
min-width:0;overflow-wrap:anywhere}
.spec-cell b{display:block;font-size:1.4rem;line-height:1.3}
.spec-cell small{display:block;font-size:.85rem;color:#343a40}
.spec-cell.kept{background:#d3f9d8;border-color:#2b8a3e}
.spec-cell.rejected{background:#ffe3e3;border-color:#c92a2a}
.spec-cell.rejected b{text-decoration:line-through;text-decoration-color:#c92a2a}
.spec-cell.own{background:#ffe8cc;border-color:#e8590c}
.spec-cell.dropped{background:#f1f3f5;border-style:dashed;color:#495057}
.spec-cell.empty{visibility:hidden}
.spec-legend{display:flex;flex-wrap:wrap;gap:.3rem 1rem;font-size:1rem}
.spec-legend span::before{content:"";display:inline-block;width:1em;height:1em;border-radius:.2em;margin-right:.3em;
vertical-align:-.15em;border:2px solid}
.spec-legend .kept::before{background:#d3f9d8;border-color:#2b8a3e}
.spec-legend .rejected::before{background:#ffe3e3;border-color:#c92a2a}
.spec-legend .own::before{background:#ffe8cc;border-color:#e8590c}
.spec-legend .dropped::before{background:#f1f3f5;border-color:#dee2e6;border-style:dashed}
</style>"""
CROP_BY_KIND = {"resampled": "rejected", "corrected": "rejected", "bonus": "all_kept", "target": "no_proposal",
                "eos": "eos"}
Token = Callable[[int], str]


def run_strip(run: decoding.SpeculativeRun, token: Token) -> tuple[list[str], list[int], list[str]]:
    """Tokens, ids and chip kinds: the prompt, earlier rounds' tokens, then the last round's kept proposals and
    the target's own token."""
    last = run.rounds[-1]
    before = len(run.ids) - len(last.new_ids)
    kinds = [""] * len(run.prompt_ids) + ["new"] * (before - len(run.prompt_ids))
    kinds += ["spec-accepted"] * last.accepted + ["spec-target"] * (len(last.new_ids) - last.accepted)
    return [token(i) for i in run.ids], run.ids, kinds


def cache_note(r: decoding.Round) -> str:
    """What the round's crop removed from the target's cache, then what each cache holds: prompt lookup keeps no
    cache; the draft's lags the target's after a round that kept every proposal or made none."""
    crop = t("speculative.crop_" + CROP_BY_KIND[r.next_kind], dropped=r.target_len_checked - r.target_len_after)
    if r.draft_len_after is None:
        held = t("speculative.cache_target_only")
    elif r.draft_len_after == r.target_len_after:
        held = t("speculative.cache_both")
    elif r.next_kind == "bonus":
        held = t("speculative.cache_draft_lacks_last")
    else:
        held = t("speculative.cache_draft_not_fed", behind=r.target_len_after - r.draft_len_after)
    return f"{crop} {held}"


def draw_sequence(run: decoding.SpeculativeRun, token: Token) -> None:
    """The sequence: earlier rounds, then this round's kept proposals and the target's own token."""
    st.html(ROUND_CSS)
    token_strip(*run_strip(run, token))
    st.caption(t("speculative.strip_legend"))


def _cell(kind: str, text: str, note: str) -> str:
    return f'<div class="spec-cell {kind}"><b>{escape(text)}</b><small>{escape(note)}</small></div>'


def round_picture_html(r: decoding.Round, token: Token) -> str:
    """The round as a picture: above, each token the draft proposed with its q and the target's p; below, what the
    target made of it: kept, the first one rejected replaced by the target's own token, the rest dropped unjudged;
    the target's own token after them where every proposal was kept (a bonus) or none was made."""
    draft, target = [], []
    for c in r.checks:
        probabilities = t("speculative.picture_qp", q=decimal(c.q, 2), p=decimal(c.p, 2))
        if c.accepted:
            draft.append(_cell("kept", token(c.id), probabilities))
            target.append(_cell("kept", token(c.id), t("speculative.picture_kept")))
        elif c.accepted is False:
            draft.append(_cell("rejected", token(c.id), probabilities))
            own = "—" if r.next_id is None else token(r.next_id)
            target.append(_cell("own", own, t("speculative.picture_" + r.next_kind)))
        else:  # never judged: the target's p of it says nothing
            draft.append(_cell("dropped", token(c.id), t("speculative.picture_q", q=decimal(c.q, 2))))
            target.append(_cell("dropped", "—", t("speculative.picture_dropped")))
    if r.next_kind in ("bonus", "target") and r.next_id is not None:
        draft.append(_cell("empty", "·", ""))
        target.append(_cell("own", token(r.next_id), t("speculative.picture_" + r.next_kind)))
    columns = f"auto repeat({len(draft)}, minmax(0, 1fr))"
    rows = (f'<div class="who">{escape(t("speculative.picture_draft_row"))}</div>' + "".join(draft)
            + f'<div class="who">{escape(t("speculative.picture_target_row"))}</div>' + "".join(target))
    legend = "".join(f'<span class="{kind}">{escape(t("speculative.legend_" + kind))}</span>'
                     for kind in ("kept", "rejected", "own", "dropped"))
    return (PICTURE_CSS + f'<div class="spec-round" style="grid-template-columns:{columns}">{rows}</div>'
            f'<div class="spec-legend">{legend}</div>')


def draw_round_picture(run: decoding.SpeculativeRun, token: Token) -> None:
    """The last round's heading and its picture: the draft's proposals against the target's choices."""
    last = run.rounds[-1]
    st.subheader(t("speculative.round", n=last.index + 1, k=len(last.checks), gamma=last.gamma, draft=run.draft.name))
    st.html(round_picture_html(last, token))


def draw_round(run: decoding.SpeculativeRun, token: Token, greedy: bool, folded: bool = False) -> None:
    """The last round: each proposal's q, p and verdict, the target's own token, both caches through the round;
    `folded`: under draw_round_picture, in an expander (the heading is the picture's)."""
    last = run.rounds[-1]
    if folded:
        with st.expander(t("speculative.round_details")):
            _round_tables(run, last, token, greedy)
        return
    st.subheader(t("speculative.round", n=last.index + 1, k=len(last.checks), gamma=last.gamma, draft=run.draft.name))
    _round_tables(run, last, token, greedy)


def _round_tables(run: decoding.SpeculativeRun, last: decoding.Round, token: Token, greedy: bool) -> None:
    rows = []
    for i, c in enumerate(last.checks):
        verdict = {True: "accepted", False: "rejected", None: "unchecked"}[c.accepted]
        rows.append({
            "#": i + 1, t("speculative.col_token"): token(c.id), t("speculative.col_q"): decimal(c.q, 4),
            t("speculative.col_p"): decimal(c.p, 4),
            t("speculative.col_ratio"): "—" if greedy else decimal(c.threshold, 4),
            t("speculative.col_r"): "—" if c.r is None else decimal(c.r, 4),
            t("speculative.col_verdict"): t("speculative." + verdict),
        })
    left, right = st.columns([3, 2])
    with left:
        if rows:
            st.dataframe(rows, hide_index=True, width="stretch")
            st.caption(t("speculative.table_note_greedy" if greedy else "speculative.table_note"))
        else:
            st.caption(t("speculative.no_proposal"))
        if last.next_id is None:
            st.markdown(t("speculative.next_eos"))
        else:
            st.markdown(t("speculative.next_" + last.next_kind, token=md_escape(token(last.next_id)),
                          id=last.next_id, n=last.accepted, proposed=len(last.checks)))
        if last.residual_top:
            st.caption(t("speculative.residual_caption"))
            st.dataframe([{t("speculative.col_token"): token(x), t("speculative.col_p"): decimal(p, 4),
                           t("speculative.col_q"): decimal(q, 4), t("speculative.col_residual"): decimal(rest, 4)}
                          for x, p, q, rest in last.residual_top], hide_index=True, width="stretch")
    with right:
        stages = [("col_before", last.target_len_before, last.draft_len_before),
                  ("col_checked", last.target_len_checked, last.draft_len_proposed),
                  ("col_after", last.target_len_after, last.draft_len_after)]
        has_draft_cache = last.draft_len_before is not None
        st.dataframe([{t("speculative.col_cache"): t("speculative." + stage),
                       t("speculative.target_cache"): target_len}
                      | ({t("speculative.draft_cache"): draft_len} if has_draft_cache else {})
                      for stage, target_len, draft_len in stages], hide_index=True, width="stretch")
        st.caption(cache_note(last))
        st.caption(t("speculative.round_ms", draft=decimal(last.draft_ms), target=decimal(last.target_ms),
                     total=decimal(last.total_ms), passes=last.draft_passes))


def draw_counts(run: decoding.SpeculativeRun, token: Token) -> None:
    """The counts over the rounds so far, then one row a round."""
    st.subheader(t("speculative.counts"))
    alpha = run.alpha
    m1, m2, m3, m4, m5 = st.columns(5)
    m1.metric(t("speculative.tokens"), len(run.new_ids))
    m2.metric(t("speculative.target_passes"), run.target_passes, help=t("speculative.target_passes_help"))
    m3.metric(t("speculative.draft_passes"), run.draft_passes)
    m4.metric(t("speculative.alpha"), "—" if alpha is None else decimal(alpha, 2),
              help=t("speculative.alpha_help", accepted=run.accepted, judged=run.judged, proposed=run.proposed))
    m5.metric(t("speculative.per_pass"), decimal(run.tokens_per_pass, 2),
              delta=None if alpha is None else t("speculative.expected",
                                                    value=decimal(rules.expected_tokens_per_pass(alpha, run.gamma), 2)),
              delta_color="off", help=t("speculative.per_pass_help", gamma=run.gamma))
    st.dataframe([{t("speculative.col_round"): r.index + 1,
                   t("speculative.col_proposed"): " ".join(token(c.id) for c in r.checks) or "—",
                   t("speculative.col_kept"): r.accepted,
                   t("speculative.col_next"): "—" if r.next_id is None else token(r.next_id),
                   t("speculative.col_after"): r.target_len_after, "ms": decimal(r.total_ms)} for r in run.rounds],
                 hide_index=True, width="stretch", height=min(36 * (len(run.rounds) + 1) + 2, 250))
