"""One speculative round drawn as the Speculative page draws it: the sequence's chips, the proposals' table, the
target's own token, both caches, and the running counts. The Speculative page draws its live run with it, the
Replay page a recorded one (model/recording/replay.py replayed_run): both pass a run and a token(id) -> text."""

from collections.abc import Callable

import streamlit as st

from model.speculative import decoding, rules
from ui.i18n import t
from ui.widgets import md_escape, token_strip

ROUND_CSS = """<style>
.tok.spec-accepted{background:#d3f9d8;border-color:#2b8a3e}
.tok.spec-target{background:#ffe8cc;border-color:#e8590c;font-weight:700}
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


def draw_round(run: decoding.SpeculativeRun, token: Token, greedy: bool) -> None:
    """The last round: each proposal's q, p and verdict, the target's own token, both caches through the round."""
    last = run.rounds[-1]
    st.subheader(t("speculative.round", n=last.index + 1, k=len(last.checks), gamma=last.gamma, draft=run.draft.name))
    rows = []
    for i, c in enumerate(last.checks):
        verdict = {True: "accepted", False: "rejected", None: "unchecked"}[c.accepted]
        rows.append({
            "#": i + 1, t("speculative.col_token"): token(c.id), t("speculative.col_q"): round(c.q, 4),
            t("speculative.col_p"): round(c.p, 4),
            t("speculative.col_ratio"): "—" if greedy else f"{c.threshold:.4f}",
            t("speculative.col_r"): "—" if c.r is None else f"{c.r:.4f}",
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
            st.dataframe([{t("speculative.col_token"): token(x), t("speculative.col_p"): round(p, 4),
                           t("speculative.col_q"): round(q, 4), t("speculative.col_residual"): round(rest, 4)}
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
        st.caption(t("speculative.round_ms", draft=f"{last.draft_ms:.1f}", target=f"{last.target_ms:.1f}",
                     total=f"{last.total_ms:.1f}", passes=last.draft_passes))


def draw_counts(run: decoding.SpeculativeRun, token: Token) -> None:
    """The counts over the rounds so far, then one row a round."""
    st.subheader(t("speculative.counts"))
    alpha = run.alpha
    m1, m2, m3, m4, m5 = st.columns(5)
    m1.metric(t("speculative.tokens"), len(run.new_ids))
    m2.metric(t("speculative.target_passes"), run.target_passes, help=t("speculative.target_passes_help"))
    m3.metric(t("speculative.draft_passes"), run.draft_passes)
    m4.metric(t("speculative.alpha"), "—" if alpha is None else f"{alpha:.2f}",
              help=t("speculative.alpha_help", accepted=run.accepted, judged=run.judged, proposed=run.proposed))
    m5.metric(t("speculative.per_pass"), f"{run.tokens_per_pass:.2f}",
              delta=None if alpha is None else t("speculative.expected",
                                                    value=f"{rules.expected_tokens_per_pass(alpha, run.gamma):.2f}"),
              delta_color="off", help=t("speculative.per_pass_help", gamma=run.gamma))
    st.dataframe([{t("speculative.col_round"): r.index + 1,
                   t("speculative.col_proposed"): " ".join(token(c.id) for c in r.checks) or "—",
                   t("speculative.col_kept"): r.accepted,
                   t("speculative.col_next"): "—" if r.next_id is None else token(r.next_id),
                   t("speculative.col_after"): r.target_len_after, "ms": round(r.total_ms, 1)} for r in run.rounds],
                 hide_index=True, width="stretch", height=min(36 * (len(run.rounds) + 1) + 2, 250))
