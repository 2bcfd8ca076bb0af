"""The token tax section of the Prefill page (cell 1B's live view): one sentence in Vietnamese and its English twin
through every tokenizer the app has (model/engine/token_tax.py), drawn when the toggle asks for it."""

from __future__ import annotations

import streamlit as st

from model.engine.token_tax import TWINS, tax_models, token_tax
from ui.errors import attempt
from ui.i18n import number, t
from ui.widgets import choice, md_escape, paragraph_html, table_html, token_strip_html

TYPED = len(TWINS)  # the choice after the built-in twins: sentences typed by the student


def token_tax_section() -> None:
    st.subheader(t("tax.title"), anchor="token-tax")
    st.caption(t("tax.intro"))
    if not st.toggle(t("tax.show"), key="tax_shown"):
        return
    names = {i: f"{vi} · {en}" for i, (vi, en) in enumerate(TWINS)} | {TYPED: t("tax.typed")}
    twin = choice(st.selectbox, t("tax.twin"), list(names), key="tax_twin", format_func=names.get)
    if twin == TYPED:
        with st.container(horizontal=True):
            st.text_input(t("tax.vi"), key="tax_vi")
            st.text_input(t("tax.en"), key="tax_en")
        texts = (st.session_state.tax_vi, st.session_state.tax_en)
    else:
        texts = TWINS[twin]
    taxes, error = attempt(lambda: [token_tax(name, texts) for name in tax_models()])
    if error is not None:
        st.error(error)
        return
    rows = []
    for tax in taxes:
        vi, en = (tax.cost(p) for p in tax.sentences)
        rows.append([tax.model, vi["n_tokens"], en["n_tokens"], f"{tax.ratio:.2f}", number(vi["cache_bytes"]),
                     number(en["cache_bytes"]),
                     f'{number(vi["positions_with_cache"])} / {number(vi["positions_without_cache"])}',
                     f'{number(en["positions_with_cache"])} / {number(en["positions_without_cache"])}'])
    st.html(table_html([t("tax.model"), t("tax.tokens_vi"), t("tax.tokens_en"), t("tax.ratio"), t("tax.bytes_vi"),
                        t("tax.bytes_en"), t("tax.positions_vi"), t("tax.positions_en")], rows))
    st.caption(t("tax.read", t=taxes[0].new_tokens))
    strips = []
    for tax in taxes:
        for lang, p in zip(("vi", "en"), tax.sentences):
            strips.append(paragraph_html(t("tax.pieces", model=tax.model, lang=lang, n=len(p.ids)), "dl-caption")
                          + token_strip_html(p.tokens, p.ids, [""] * len(p.ids), p.joined))
            if p.unknown:
                strips.append(paragraph_html(t("tax.unknown", words=md_escape(", ".join(p.unknown))), "dl-caption"))
    st.html("".join(strips) + paragraph_html(t("tokens.byte_legend"), "dl-caption"))
