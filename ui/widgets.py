"""Small HTML pieces shared by pages. Every text is escaped before it reaches HTML.

Their style sheet, CSS, is put on the page once by app.py, not inside each piece: a <style> element drawn again
with every click makes the browser recompute the style of the whole page.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from collections.abc import Callable, Collection, Sequence
from html import escape

import streamlit as st

from ui.i18n import decimal, lang, t

CSS = """
<style>
/* captions at body size, 7.3:1 on white (WCAG AA asks 4.5:1); every size in rem, so presenter mode's root
   size enlarges them all (ui/classroom.py) */
[data-testid='stCaptionContainer']{font-size:1rem;color:#4b5262}
[data-testid='stMainBlockContainer']{padding-top:2.5rem}
.tok-strip{display:flex;flex-wrap:wrap;gap:6px;margin:4px 0 10px 0}
.tok{border-radius:8px;padding:4px 9px;font-size:1.125rem;line-height:1.35;border:2px solid #343a40;background:#f1f3f5;
     color:#212529;text-align:center;white-space:pre}
.tok small{display:block;font-size:0.8rem;color:#495057}
.tok.new{background:#d0ebff;border-color:#1c7ed6}
.tok.current{background:#ffe8cc;border-color:#e8590c;font-weight:700}
.tok.unknown{background:#ffe3e3;border-color:#c92a2a}
.tok.special{font-family:monospace;font-size:0.9375rem}
.tok.bytes{font-family:monospace;font-size:0.875rem;border-style:dashed}
.att-row{display:flex;flex-wrap:wrap;gap:3px;margin:2px 0 8px 0}
.att{border-radius:5px;padding:2px 6px;font-size:0.9375rem;line-height:1.25;text-align:center;border:1px solid #ced4da;
     white-space:pre;min-width:28px}
.att small{display:block;font-size:0.8rem}
.tok-gap,.att-gap{align-self:center;border:2px dotted #868e96;border-radius:8px;padding:4px 9px;color:#495057;
                  font-size:0.875rem;white-space:nowrap}
.bars{display:grid;grid-template-columns:minmax(60px,max-content) 1fr 54px;gap:3px 8px;align-items:center;
      font-size:1rem;margin:4px 0}
.bars .lbl{white-space:pre;text-align:right;font-family:monospace;overflow:hidden;text-overflow:ellipsis;
           max-width:220px}
.bars .track{background:#f1f3f5;border-radius:4px;height:20px}
.bars .bar{height:20px;border-radius:4px}
.bars .val{font-variant-numeric:tabular-nums;text-align:right}
.legend{display:flex;flex-wrap:wrap;gap:14px;font-size:0.875rem;margin:2px 0 6px 0}
.legend i{display:inline-block;width:14px;height:14px;border-radius:3px;vertical-align:-2px;margin-right:5px}
.mini-table{border-collapse:collapse;font-size:0.9375rem;font-variant-numeric:tabular-nums;margin:4px 0}
.mini-table th,.mini-table td{border-bottom:1px solid #dee2e6;padding:3px 10px;text-align:right}
.mini-table th{background:#f8f9fa;font-weight:600}
.dl-scroll{max-height:19rem;overflow:auto;margin:4px 0}
.dl-scroll th{position:sticky;top:0}
.dl-scroll td{white-space:nowrap}
.dl-h{font-size:1.5rem;font-weight:600;line-height:1.2;margin:0.6rem 0 0.5rem 0;padding:0}
.dl-p{margin:0 0 0.6rem 0;line-height:1.6}
.dl-caption{font-size:1rem;color:#4b5262;margin:0 0 0.5rem 0;line-height:1.5}
.st-key-step_keys{display:none}
.dl-grid{display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1fr);gap:0.5rem 2.5rem;margin-top:0.5rem}
.dl-grid-picture{grid-template-columns:minmax(0,3fr) minmax(0,2fr)}
@media (max-width:1100px){.dl-grid{grid-template-columns:minmax(0,1fr)}}
.dl-metric{font-size:0.875rem;color:#31333f}
.dl-metric b{display:block;font-size:2.1rem;font-weight:400;line-height:1.3;font-variant-numeric:tabular-nums}
.dl-box{border-radius:0.5rem;padding:0.9rem 1rem;margin:0.5rem 0;line-height:1.5}
.dl-box.pass{background:rgba(33,195,84,0.1);color:#177233}
.dl-box.fail{background:rgba(255,43,43,0.09);color:#7d353b}
.dl-box.note{background:rgba(28,131,225,0.1);color:#004280}
.dl-heat{position:relative}
.dl-hover{position:absolute;display:flex;flex-direction:column}
.dl-hover>div{flex:1;display:flex}
.dl-hover i{width:calc(100% / var(--n))}
</style>
"""
# the step buttons' keys, shown on the buttons (a help tooltip would make Streamlit draw each button twice);
# Streamlit ignores a shortcut while the focus is in a text box (tests/test_browser_pages.py)
NEXT_KEY, BACK_KEY = "Right", "Left"
STATUS_COLOURS = {"chosen": "#e8590c", "kept": "#1f5fbf", "other": "#1f5fbf", "cut_p": "#ffc9a8", "cut_k": "#adb5bd"}


def shown(token: str) -> str:
    """A token as a chip shows it: its own spaces kept (CSS white-space: pre), a newline as ↵, and a token of
    spaces only as ␣ each (a blank label beside a probability bar would look like nothing at all)."""
    if token and not token.strip(" "):
        return "␣" * len(token)
    return token.replace("\n", "↵") if token else "∅"


FOLDED_TEXT_CHARS = 2000  # the most of a folded run's text its chip's tooltip holds


def runs(n: int, keep: Collection[int] | None) -> list[tuple[bool, int, int]]:
    """Positions 0 .. n − 1 in order as runs (shown, first, last + 1): the positions in `keep` shown, every run of
    the others folded into one chip; keep None: all shown."""
    if keep is None:
        return [(True, 0, n)] if n else []
    out: list[tuple[bool, int, int]] = []
    for position in range(n):
        shown_here = position in keep
        if out and out[-1][0] == shown_here:
            out[-1] = (shown_here, out[-1][1], position + 1)
        else:
            out.append((shown_here, position, position + 1))
    return out


def window_of(n: int, head: int, tail: int, also: Collection[int] = ()) -> set[int] | None:
    """The positions a long row shows: its first `head`, its latest `tail` and `also`; None (all of them) when that
    would fold nothing."""
    keep = set(range(min(head, n))) | set(range(max(0, n - tail), n)) | set(also)
    return None if len(keep) >= n else keep


def token_strip_html(tokens: list[str], ids: list[int], kinds: list[str],
                     joined: list[str | None] | None = None, keep: Collection[int] | None = None,
                     text_of: Callable[[list[int]], str] | None = None) -> str:
    """A row of token chips: token above, position and id below; kinds add CSS classes. A byte piece (part of a
    character, shown as <E1><BB>) says in its tooltip why, and which character it makes with its neighbours
    (joined: tokenizer.joined_characters of the ids). keep: only these positions get a chip (window_of), each run of
    the others one dotted chip whose tooltip holds their text, as text_of (the tokenizer's decode) writes their ids."""
    chips = []
    for shown_run, first, end in runs(len(tokens), keep):
        if not shown_run:
            text = text_of(ids[first:end]) if text_of is not None else "".join(tokens[first:end])
            text = text if len(text) <= FOLDED_TEXT_CHARS else text[:FOLDED_TEXT_CHARS] + "…"
            title = t("tokens.folded_title", first=first, last=end - 1, text=text)
            chips.append(f'<div class="tok-gap" title="{escape(title)}">{escape(t("tokens.folded", n=end - first))}'
                         "</div>")
            continue
        for position in range(first, end):
            chips.append(_token_chip(position, tokens[position], ids[position], kinds[position],
                                     joined[position] if joined is not None else None))
    return '<div class="tok-strip">' + "".join(chips) + "</div>"


def _token_chip(position: int, tok: str, tid: int, kind: str, piece: str | None) -> str:
    if piece is not None:
        extra = f' bytes" title="{escape(t("tokens.byte_piece", char=piece.strip() or piece))}'
    else:
        extra = " special" if tok.startswith("<") and tok.endswith(">") else ""
    return f'<div class="tok {escape(kind)}{extra}">{escape(shown(tok))}<small>#{position} · id {tid}</small></div>'


def token_strip(tokens: list[str], ids: list[int], kinds: list[str], joined: list[str | None] | None = None) -> None:
    st.html(token_strip_html(tokens, ids, kinds, joined))


def attention_row_html(tokens: list[str], weights, keep: Collection[int] | None = None,
                       struck: Collection[int] = ()) -> str:
    """One query's attention over the cache as chips: each cached token tinted by the weight it gets. keep: only
    these positions get a chip, each run of the others one dotted chip with its count and total weight. struck:
    positions drawn faded and struck out (a bounded cache no longer holds them)."""
    top = float(max(weights.max(), 1e-9))
    chips = []
    for shown_run, first, end in runs(len(tokens), keep):
        if not shown_run:
            total = float(weights[first:end].sum())
            chips.append(f'<div class="att-gap" title="#{first}–#{end - 1}">'
                         f'{escape(t("decode.keys_folded", n=end - first, w=decimal(total, 2)))}</div>')
            continue
        for position in range(first, end):
            w = float(weights[position])
            level = w / top  # the largest weight is the darkest, so small rows still read
            ink = "#fff" if level > 0.55 else "#212529"
            out = ";opacity:.35;text-decoration:line-through" if position in struck else ""
            chips.append(f'<div class="att" style="background:rgba(31,95,191,{level:.2f});color:{ink}{out}" '
                         f'title="#{position}: {decimal(w, 4)}">{escape(shown(tokens[position]))}'
                         f'<small>{decimal(w, 2)}</small></div>')
    return '<div class="att-row">' + "".join(chips) + "</div>"


def probability_bars_html(labels: list[str], probs, status: list[str], status_names: dict[str, str]) -> str:
    """One horizontal bar per candidate, coloured by what the filters did to it, with a legend."""
    legend = legend_html({status_names[s]: STATUS_COLOURS[s] for s in STATUS_COLOURS if s in status})
    rows = "".join(
        f'<div class="lbl">{escape(shown(label))}</div><div class="track"><div class="bar" '
        f'style="width:{100 * float(p):.1f}%;background:{STATUS_COLOURS[s]}"></div></div>'
        f'<div class="val">{decimal(float(p), 3)}</div>'
        for label, p, s in zip(labels, probs, status))
    return legend + f'<div class="bars">{rows}</div>'


def legend_html(colours: dict[str, str], outlined: bool = False) -> str:
    """A row of colour swatches, each with its name; outlined: a thin border, for swatches as light as white."""
    outline = ";outline:1px solid #495057" if outlined else ""
    return ('<div class="legend">' + "".join(f'<span><i style="background:{colour}{outline}"></i>{escape(name)}</span>'
                                             for name, colour in colours.items()) + "</div>")


def table_html(headers: list[str], rows: list[list]) -> str:
    """A small table of numbers (a dataframe widget costs more than it shows here)."""
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f'<table class="mini-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


MARKDOWN_SPECIAL = set("\\`*_{}[]()#+-.!|<>~$")


def md_escape(text: str) -> str:
    """Text from the model or the user, safe to put inside a markdown sentence."""
    return "".join("\\" + c if c in MARKDOWN_SPECIAL else c for c in text)


def markdown_html(text: str) -> str:
    """A sentence in the markdown the texts use (**bold**, and md_escape's backslashes) as escaped HTML, for the
    pieces a page draws as one st.html instead of one element per sentence."""
    out, bold, i = [], False, 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in MARKDOWN_SPECIAL:
            out.append(escape(text[i + 1]))
            i += 2
        elif text.startswith("**", i):
            out.append("</b>" if bold else "<b>")
            bold, i = not bold, i + 2
        else:
            out.append(escape(text[i]))
            i += 1
    return "".join(out) + ("</b>" if bold else "")


def heading_html(text: str) -> str:
    return f'<div class="dl-h">{escape(text)}</div>'


def paragraph_html(sentence: str, kind: str = "dl-p") -> str:
    """A markdown sentence as a paragraph; kind "dl-caption" for a caption's small grey type."""
    return f'<p class="{kind}">{markdown_html(sentence)}</p>'


def box_html(sentence: str, kind: str) -> str:
    """A coloured box for a verdict or a note, like st.success / st.error / st.info: kind pass, fail or note."""
    return f'<div class="dl-box {kind}">{markdown_html(sentence)}</div>'


def choice(widget: Callable, label: str, options: Sequence, key: str, format_func: Callable,
           on_change: Callable[[], None] | None = None, **kwargs):
    """A select box, radio or segmented control whose value is a stable id while its labels follow the language.

    Streamlit reads a choice widget's value back from the label the browser shows, so after a language switch
    the old label would come back as the value itself ("small — song ngữ…" as a model name). The widget's key
    therefore carries the language; the chosen id lives under `key` and is handed to each language's widget.
    """
    if st.session_state.get(key) not in options:
        st.session_state[key] = options[0]
    widget_key = f"{key}.{lang()}"
    st.session_state[widget_key] = st.session_state[key]

    def keep_choice() -> None:
        if st.session_state[widget_key] is not None:  # a segmented control clicked off keeps its choice
            st.session_state[key] = st.session_state[widget_key]
        if on_change is not None:
            on_change()

    widget(label, options, key=widget_key, format_func=format_func, on_change=keep_choice, **kwargs)
    return st.session_state[key]


def warn_before_leaving(run_held: bool) -> None:
    """A reload or a closed tab starts a new session and loses the run: while there is one, the browser asks first."""
    handler = "() => true" if run_held else "null"
    # numbered, so no element is the same as the last run's: the browser keeps one unchanged without running it
    # again, and a handler set by a later call of that run (a page's first run, ui/controls.first_run) would stay
    n = st.session_state["reload_warnings_said"] = st.session_state.get("reload_warnings_said", 0) + 1
    st.html(f"<script>window.onbeforeunload = {handler}; // {n}</script>", unsafe_allow_javascript=True)


def csv_of(rows: list) -> str:
    """One line per row (a dict or a dataclass) under a header of the first row's keys (a training curve, for a
    spreadsheet). Pages pass it to a download button unevaluated, so a click's run does none of this work."""
    if not rows:
        return ""
    rows = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in rows]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
