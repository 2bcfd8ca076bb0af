"""Small HTML pieces shared by pages. Every text is escaped before it reaches HTML."""

from __future__ import annotations

from html import escape

import streamlit as st

STRIP_CSS = """
<style>
.tok-strip{display:flex;flex-wrap:wrap;gap:6px;margin:4px 0 10px 0}
.tok{border-radius:8px;padding:4px 9px;font-size:18px;line-height:1.35;border:2px solid #343a40;background:#f1f3f5;
     color:#212529;text-align:center}
.tok small{display:block;font-size:12px;color:#495057}
.tok.new{background:#d0ebff;border-color:#1c7ed6}
.tok.current{background:#ffe8cc;border-color:#e8590c;font-weight:700}
.tok.unknown{background:#ffe3e3;border-color:#c92a2a}
.tok.special{font-family:monospace;font-size:15px}
</style>
"""


def token_strip(tokens: list[str], ids: list[int], kinds: list[str]) -> None:
    """A row of token chips: word above, position and id below; kinds add CSS classes."""
    chips = []
    for position, (tok, tid, kind) in enumerate(zip(tokens, ids, kinds)):
        special = " special" if tok.startswith("<") and tok.endswith(">") else ""
        chips.append(f'<div class="tok {escape(kind)}{special}">{escape(tok)}<small>#{position} · id {tid}</small>'
                     "</div>")
    st.html(STRIP_CSS + '<div class="tok-strip">' + "".join(chips) + "</div>")


MARKDOWN_SPECIAL = set("\\`*_{}[]()#+-.!|<>~$")


def md_escape(text: str) -> str:
    """Text from the model or the user, safe to put inside a markdown sentence."""
    return "".join("\\" + c if c in MARKDOWN_SPECIAL else c for c in text)
