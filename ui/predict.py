"""Predict, then reveal (issue 26, item 1): the student guesses before a Next (Decode) or before Reveal (Cache),
then sees the engine's own numbers beside the guess, with the formula that gives them, and a running score.

A guess is only read: it is recorded in the Next callback, before the engine's step, and compared with the new
step's trace afterwards; nothing of the run depends on it. The Decode page's guess inputs sit outside its step
fragment, so while the mode is on a Next reruns the whole page (the inputs then offer the new step's top 5).
"""

from __future__ import annotations

import streamlit as st

from model.engine import generate
from model.engine.counting import cache_bytes_formula, positions_with_cache, positions_without_cache
from model.engine.runtime import LoadedModel
from ui.controls import cache_by_layer_kind
from ui.errors import guarded
from ui.i18n import number, t
from ui.run import on_next
from ui.widgets import heading_html, md_escape, paragraph_html, shown, table_html

CANDIDATES = 5


def add_to_score(results: list[bool]) -> None:
    """The session's score, (right, wrong), replaced whole (never a shared default mutated)."""
    right, wrong = st.session_state.predict_score
    st.session_state.predict_score = (right + sum(results), wrong + len(results) - sum(results))


def score_sentence() -> str:
    right, wrong = st.session_state.predict_score
    return t("predict.score", right=right, wrong=wrong)


# -- Decode ----------------------------------------------------------------------------------------------------

def next_candidates(model: LoadedModel, gen: generate.Generation) -> list[int]:
    """The 5 most probable next tokens, by a side computation (the whole sequence again, with no cache: the
    session's cache and trace are untouched), shown in the order of their ids so the order does not tell the
    ranking. Kept per run and step: the page redraws often."""
    key = (id(gen), tuple(gen.ids))
    held = st.session_state.get("predict_candidates")
    if held is None or held[0] != key:
        logits = guarded(lambda: generate.recompute(model, gen.ids))
        if logits is None:
            return []
        st.session_state.predict_candidates = (key, sorted(int(i) for i in logits.argsort()[-CANDIDATES:]))
    return st.session_state.predict_candidates[1]


def guess_inputs(model: LoadedModel, gen: generate.Generation) -> None:
    """The guesses for the step a Next will make: cache length, cache bytes, and optionally the token."""
    if gen.finished:
        st.caption(t("predict.finished"))
        return
    tok = model.tokenizer
    # no bounds on a guess: a box with bounds keeps showing a number it refused (−4) while the last one it took is
    # recorded; without them the box always shows what a Next records (a negative guess is simply wrong)
    with st.container(border=True, horizontal=True, vertical_alignment="bottom"):
        st.number_input(t("predict.guess_len"), step=1, key="guess_len", width=220)
        st.number_input(t("predict.guess_bytes"), step=1, key="guess_bytes", width=220)
        candidates = next_candidates(model, gen)
        if st.session_state.guess_token not in candidates:
            st.session_state.guess_token = None
        labels = {i: shown(tok.token(i)) for i in candidates}
        st.segmented_control(t("predict.guess_token"), candidates, key="guess_token", format_func=labels.get)
    st.caption(t("predict.before_next", next=t("action.next")))


def on_next_with_guess() -> None:
    """The Next button's callback: without the mode, on_next itself. With it, the guess is read now, the step
    runs as it would have, and the new step's trace is compared with the guess."""
    s = st.session_state
    if not s.predict_on:
        on_next()
        return
    gen = s.generation
    guess = (int(s.guess_len), int(s.guess_bytes), s.guess_token)
    before = len(gen.steps) if gen is not None else 0
    on_next()
    if gen is not None and len(gen.steps) == before + 1:
        trace, drawn = gen.steps[-1], gen.samples[-1]
        results = [guess[0] == trace.cache_len, guess[1] == trace.cache_bytes]
        if guess[2] is not None:
            results.append(guess[2] == drawn.chosen_id)
        add_to_score(results)
        s.predict_reveal = {"gen": id(gen), "step": len(gen.steps) - 1, "len": guess[0], "bytes": guess[1],
                            "token": guess[2]}
    s.guess_token = None
    st.rerun()  # the whole page: the guess inputs, outside the step view, offer the next step's candidates


def verdict(right: bool) -> str:
    return t("predict.right" if right else "predict.wrong")


def reveal_html(model: LoadedModel, gen: generate.Generation) -> str:
    """The guess beside the engine's numbers for the current step, when the guess was made for it."""
    record = st.session_state.predict_reveal
    index = len(gen.steps) - 1
    if record is None or record["gen"] != id(gen) or record["step"] != index:
        return heading_html(t("predict.title")) + paragraph_html(t("predict.waiting", next=t("action.next")),
                                                                 "dl-caption")
    info, tok = model.info, model.tokenizer
    trace, drawn = gen.steps[-1], gen.samples[-1]
    rows = [[t("predict.row_len"), number(record["len"]), number(trace.cache_len),
             verdict(record["len"] == trace.cache_len)],
            [t("predict.row_bytes"), number(record["bytes"]), number(trace.cache_bytes),
             verdict(record["bytes"] == trace.cache_bytes)]]
    if record["token"] is not None:
        rows.append([t("predict.row_token"), shown(tok.token(record["token"])), shown(tok.token(drawn.chosen_id)),
                     verdict(record["token"] == drawn.chosen_id)])
    per_position = cache_bytes_formula(info.n_layers, info.n_kv_heads, 1, info.d_head, info.bytes_per_element)
    length = t("predict.len_formula", prompt=len(gen.prompt_ids), steps=index, n=trace.cache_len)
    size = cache_by_layer_kind(info.cache_shape, trace.cache_len, trace.cache_bytes) or t(
        "decode.formula_text", layers=info.n_layers, kv=info.n_kv_heads, d=info.d_head, b=info.bytes_per_element,
        per_position=number(per_position), positions=number(trace.cache_len), total=number(trace.cache_bytes_formula))
    token = t("predict.token_note", token=md_escape(shown(tok.token(drawn.chosen_id))), id=drawn.chosen_id)
    return (heading_html(t("predict.title"))
            + table_html([t("predict.col_what"), t("predict.col_guess"), t("predict.col_real"),
                          t("predict.col_verdict")], rows)
            + paragraph_html(length, "dl-caption") + paragraph_html(size, "dl-caption")
            + paragraph_html(token, "dl-caption") + paragraph_html(score_sentence()))


# -- Cache -----------------------------------------------------------------------------------------------------

def on_cache_reveal(n: int, new_tokens: int) -> None:
    """Reveal for the N and T chosen: the guesses against counting's own formulas."""
    s = st.session_state
    guess = (int(s.cache_guess_with), int(s.cache_guess_without))
    add_to_score([guess[0] == positions_with_cache(n, new_tokens), guess[1] == positions_without_cache(n, new_tokens)])
    s.cache_reveal = {"n": n, "t": new_tokens, "with": guess[0], "without": guess[1]}


def cache_revealed(n: int, new_tokens: int) -> bool:
    record = st.session_state.cache_reveal
    return record is not None and (record["n"], record["t"]) == (n, new_tokens)


def cache_guess(n: int, new_tokens: int) -> None:
    """The Cache page's guesses for N and T, or, once revealed for them, the guess beside the formulas' numbers."""
    if not cache_revealed(n, new_tokens):
        with st.container(border=True, horizontal=True, vertical_alignment="bottom"):
            st.number_input(t("cache.guess_with"), step=1, key="cache_guess_with", width=240)  # no bounds: as above
            st.number_input(t("cache.guess_without"), step=1, key="cache_guess_without", width=240)
            st.button(t("cache.reveal"), key="cache_reveal_button", type="primary", icon=":material/visibility:",
                      on_click=on_cache_reveal, args=(n, new_tokens))
        st.caption(t("cache.guess_note", n=n, t=new_tokens))
        return
    record = st.session_state.cache_reveal
    with_cache, without_cache = positions_with_cache(n, new_tokens), positions_without_cache(n, new_tokens)
    rows = [[t("cache.with"), number(record["with"]), number(with_cache), verdict(record["with"] == with_cache)],
            [t("cache.without"), number(record["without"]), number(without_cache),
             verdict(record["without"] == without_cache)]]
    st.html(table_html([t("predict.col_what"), t("predict.col_guess"), t("predict.col_real"),
                        t("predict.col_verdict")], rows)
            + paragraph_html(t("cache.with_formula", n=n, t=new_tokens) + " = " + str(with_cache), "dl-caption")
            + paragraph_html(t("cache.without_formula", n=n, t=new_tokens) + " = " + str(without_cache), "dl-caption")
            + paragraph_html(score_sentence()))
