"""The 22-cell map as one self-contained block of HTML/CSS/JS (no network), built by a pure function.

map_html() returns the markup that app_pages/map.py hands to st.html(..., unsafe_allow_javascript=True).
Every text from assets/cells.json or assets/strings/ is escaped with html.escape before it reaches
the markup; the few values the script needs (arrows and their labels) go in as JSON with <, > and &
written as \\u escapes, so no text can close the script tag.

What the script adds in the browser: the arrows (an SVG drawn over the grid from the cells' positions,
redrawn when the map changes size) and the pop-overs (one <dialog> per cell: click a cell to open it;
the close button, Escape or a click outside closes it). The hover tooltip is plain CSS.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import cache
from html import escape
from itertools import pairwise
from typing import Any

from model.texts import ASSETS
from ui.pages import FINETUNE_TABS, PAGES, live_views, tab_of

BANDS = ("1", "2", "3", "4", "5")
BAND_CHOICES = ("all", *BANDS)  # the filter chips' stable values; labels come from band_choice_label
PARTS = ("receives", "does", "outputs", "example", "caveat")  # the pop-over's parts, in order
READING_ORDER = ("1A", "1B", "1C", "2A", "2B", "2C", "2D", "3A", "3B", "3C", "3D", "3E")
INFERENCE_ORDER = ("5A", "5B", "5C")


@cache
def load_cells() -> tuple[dict[str, Any], ...]:
    """The 22 cells of assets/cells.json, read once per process (treat the result as read-only)."""
    data = json.loads((ASSETS / "cells.json").read_text(encoding="utf-8"))
    return tuple(data["cells"])


def band_choice_label(t: Callable[[str], str]) -> Callable[[str], str]:
    """format_func for the filter chips: "all" -> "Tất cả (22)", "3" -> "3 Học từ sai số"."""

    def label(choice: str) -> str:
        return t("map.all") if choice == "all" else f"{choice} {t('band.' + choice)}"

    return label


def map_labels(t: Callable[[str], str]) -> dict[str, str]:
    """Every UI sentence map_html needs, looked up once in the session's language."""
    keys = [
        *(f"map.{part}" for part in PARTS),
        "map.open_live",
        "map.close",
        "map.band",
        "map.click_hint",
        "map.col4_note",
        "map.arrow_next_batch",
        "map.arrow_load_weights",
        "map.map_title",
        *(f"band.{b}" for b in BANDS),
        *(p.title_key for p in PAGES),
        *(f"finetune.tab_{tab}" for tab in FINETUNE_TABS),
    ]
    return {key: t(key) for key in keys}


def tab_label(anchor: str, labels: dict[str, str]) -> str:
    """The label of the Fine-tune tab that holds `anchor` ("" for none): the map's script opens that tab."""
    tab = tab_of(anchor)
    return labels[f"finetune.tab_{tab}"] if tab else ""


def live_href(page: str, lang: str, anchor: str = "") -> str:
    """The app's own URL of a live page, keeping the language, with the Fine-tune tab that holds the anchor
    (relative: it also works under a base path)."""
    tab = tab_of(anchor)
    return f"{page}?lang={lang}" + (f"&tab={tab}" if tab else "") + (f"#{anchor}" if anchor else "")


def script_json(value: Any) -> str:
    """JSON that can sit inside <script>: no "<", ">" or "&" survives, so nothing can close the tag."""
    text = json.dumps(value, ensure_ascii=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def arrows(labels: dict[str, str]) -> list[dict[str, Any]]:
    """The reading-order arrows: kind tells the script how to route each one."""
    out: list[dict[str, Any]] = []
    for order in (READING_ORDER, INFERENCE_ORDER):
        for a, b in pairwise(order):
            kind = "down" if a[0] == b[0] and a[0] != "5" else ("right" if a[0] == b[0] else "hop")
            out.append({"from": a, "to": b, "kind": kind, "bands": sorted({a[0], b[0]})})
    next_batch, load_weights = labels["map.arrow_next_batch"], labels["map.arrow_load_weights"]
    out.append({"from": "3E", "to": "col-1", "kind": "loop", "bands": ["1", "3"], "label": next_batch})
    out.append({"from": "3E", "to": "5A", "kind": "drop", "bands": ["3", "5"], "label": load_weights})
    return out


# -----------------------------------------------------------------------------
# the markup


def _cell_button(cell: dict[str, Any], lang: str, band: str, labels: dict[str, str]) -> str:
    cid = escape(cell["id"])
    text = cell[lang]
    state = "" if band == "all" else (" hl" if cell["band"] == band else " dim")
    live = '<span class="dlm-live-mark" aria-hidden="true">▶</span>' if live_views(cell["id"]) else ""
    return (
        f'<button type="button" class="dlm-cell dlm-b{escape(cell["band"])}{state}" data-cell="{cid}" '
        f'data-band="{escape(cell["band"])}" aria-haspopup="dialog" aria-controls="dlm-pop-{cid}" '
        f'aria-describedby="dlm-tip-{cid}">'
        f'<span class="dlm-id">{cid}</span><span class="dlm-title">{escape(text["title"])}</span>{live}'
        f'<span class="dlm-tip" role="tooltip" id="dlm-tip-{cid}">{escape(text["tagline"])}'
        f'<span class="dlm-tip-hint">{escape(labels["map.click_hint"])}</span></span>'
        "</button>"
    )


def _popover(cell: dict[str, Any], lang: str, labels: dict[str, str]) -> str:
    cid = escape(cell["id"])
    b = escape(cell["band"])
    text = cell[lang]
    parts = "".join(
        f'<section class="dlm-part dlm-part-{part}"><h4>{escape(labels["map." + part])}</h4>'
        f"<p>{escape(text[part])}</p></section>"
        for part in PARTS
    )
    # "Open the live view:" said once before the pages' names (5B links nine pages: a card must fit 1280×720);
    # each link's accessible name still says it whole
    links = "".join(
        f'<a class="dlm-live" href="{escape(live_href(page.url, lang, anchor))}" target="_self" '
        f'data-page="{escape(page.url)}" data-anchor="{escape(anchor)}" data-tab="{escape(tab_label(anchor, labels))}" '
        f'aria-label="{escape(labels["map.open_live"])}: {escape(labels[page.title_key])}">'
        f'{escape(labels[page.title_key])} →</a>'
        for page, anchor in live_views(cell["id"])
    )
    live = (f'<nav class="dlm-links"><span class="dlm-links-label">{escape(labels["map.open_live"])}:</span>{links}'
            '</nav>' if links else "")
    return (
        f'<dialog class="dlm-pop dlm-b{b}" id="dlm-pop-{cid}" data-cell="{cid}" aria-labelledby="dlm-pop-title-{cid}">'
        '<div class="dlm-pop-box">'
        f'<header class="dlm-pop-head"><p class="dlm-pop-band">{escape(labels["map.band"])} {b} · '
        f"{escape(labels['band.' + cell['band']])}</p>"
        f'<h3 id="dlm-pop-title-{cid}"><span class="dlm-pop-id">{cid}</span> {escape(text["title"])}</h3>'
        f'<p class="dlm-pop-tagline">{escape(text["tagline"])}</p>'
        f'<button type="button" class="dlm-close" aria-label="{escape(labels["map.close"])}">✕</button>'
        "</header>"
        f'<div class="dlm-parts">{parts}</div>{live}'
        "</div></dialog>"
    )


def _column(n: str, cells: Sequence[dict[str, Any]], lang: str, band: str, hide_overlay: bool, labels) -> str:
    state = "" if band == "all" else (" hl" if n == band else " dim")
    frame = "" if hide_overlay else " dlm-frame"
    head = ""
    if not hide_overlay:
        head = (
            f'<header class="dlm-head"><span class="dlm-num dlm-b{n}">{n}</span>'
            f'<span class="dlm-name">{escape(labels["band." + n])}</span></header>'
        )
        if n == "4":
            head += f'<p class="dlm-note">{escape(labels["map.col4_note"])}</p>'
    body = "".join(_cell_button(c, lang, band, labels) for c in cells)
    return (
        f'<section class="dlm-col dlm-col-{n}{frame}{state}" data-band="{n}">'
        f'{head}<div class="dlm-cells">{body}</div></section>'
    )


def map_html(
    cells: Sequence[dict[str, Any]],
    lang: str,
    band: str,
    hide_overlay: bool,
    labels: dict[str, str],
) -> str:
    """The whole map: four columns (bands 1-4), band 5 under columns 1-3 and beside column 4 (so the 22 cells fit
    one 1280 × 720 screen under the page's title), arrows and frames unless hide_overlay.

    band is "all" or "1".."5": the chosen band is highlighted (class "hl"), the others dimmed ("dim").
    """
    if band not in BAND_CHOICES:
        band = "all"
    by_band = {b: [c for c in cells if c["band"] == b] for b in BANDS}
    columns = "".join(_column(b, by_band[b], lang, band, hide_overlay, labels) for b in BANDS[:4])

    state5 = "" if band == "all" else (" hl" if band == "5" else " dim")
    head5 = ""
    if not hide_overlay:
        head5 = (
            f'<header class="dlm-head dlm-head5"><span class="dlm-num dlm-b5">5</span>'
            f'<span class="dlm-name">{escape(labels["band.5"])}</span></header>'
        )
    cells5 = "".join(_cell_button(c, lang, band, labels) for c in by_band["5"])
    band5 = (
        f'<section class="dlm-band5{"" if hide_overlay else " dlm-frame"}{state5}" data-band="5">'
        f'{head5}<div class="dlm-cells">{cells5}</div></section>'
    )
    pops = "".join(_popover(c, lang, labels) for c in cells)
    spec = {"band": band, "arrows": [] if hide_overlay else arrows(labels)}
    overlay = "off" if hide_overlay else "on"
    return (
        f'<div class="dlm-root" lang="{escape(lang)}">'
        f"<style>{CSS}</style>"
        f'<div class="dlm dlm-overlay-{overlay}" data-band="{escape(band)}" role="group" '
        f'aria-label="{escape(labels["map.map_title"])}">'
        f'<div class="dlm-grid">{columns}{band5}</div></div>'
        f"{pops}"
        f"<script>{SCRIPT.replace('__SPEC__', script_json(spec))}</script>"
        "</div>"
    )


# -----------------------------------------------------------------------------
# style: saturated band fills with near-black text (they survive a projector); sizes in rem, so presenter mode's
# larger root enlarges the cells' text with the page's

CSS = """
.dlm-root{--ink:#14161a;--line:#2b2f36;font-family:inherit;color:var(--ink);}
.dlm{position:relative;background:#fff;border:1px solid #d5d8de;border-radius:14px;padding:0.5rem 0.75rem 0.75rem;
 box-sizing:border-box;width:100%;}
.dlm *{box-sizing:border-box;}
.dlm-b1{--band:#f5b324;--band-dark:#8a5a00;}
.dlm-b2{--band:#4ea8f0;--band-dark:#0b4f8a;}
.dlm-b3{--band:#f47b5a;--band-dark:#9a2d10;}
.dlm-b4{--band:#b58cf2;--band-dark:#5b2aa6;}
.dlm-b5{--band:#43c27c;--band-dark:#0f6b39;}
.dlm-col-1{--band-dark:#8a5a00;}.dlm-col-2{--band-dark:#0b4f8a;}.dlm-col-3{--band-dark:#9a2d10;}
.dlm-col-4{--band-dark:#5b2aa6;}.dlm-band5{--band-dark:#0f6b39;}
.dlm-grid{display:grid;grid-template-columns:repeat(3,minmax(0,1fr)) minmax(0,1.3fr);grid-template-rows:auto 1fr;
 column-gap:1.4rem;row-gap:2.3rem;align-items:start;}
.dlm-overlay-on .dlm-grid{padding-top:1.6rem;}
.dlm-col{position:relative;min-width:0;}
.dlm-col-4{grid-column:4;grid-row:1 / 3;}
.dlm-frame{border:2px solid var(--band-dark);border-radius:12px;padding:0.3rem 0.35rem 0.4rem;background:#f7f8fa;}
.dlm-col-4.dlm-frame{border-style:dashed;border-width:2.5px;
 background:repeating-linear-gradient(135deg,#f6f2fd 0 10px,#fff 10px 20px);}
.dlm-head{display:flex;align-items:center;gap:0.4rem;margin:0 0 0.3rem;font-weight:700;font-size:0.9rem;
 line-height:1.15;color:var(--ink);}
.dlm-num{flex:none;display:inline-flex;align-items:center;justify-content:center;width:1.4rem;height:1.4rem;
 border-radius:50%;background:var(--band);border:2px solid var(--band-dark);font-size:0.85rem;font-weight:800;}
.dlm-note{margin:-0.1rem 0 0.3rem;font-size:0.8rem;line-height:1.2;color:#3b2470;font-style:italic;}
.dlm-cells{display:flex;flex-direction:column;gap:0.8rem;}
.dlm-col-4 .dlm-cells{gap:0.3rem;}
.dlm-cell{position:relative;display:block;width:100%;text-align:left;cursor:pointer;font:inherit;color:var(--ink);
 background:var(--band);border:2px solid var(--band-dark);border-radius:9px;padding:0.2rem 0.4rem;margin:0;
 font-size:0.875rem;line-height:1.2;min-height:2.4rem;transition:opacity .15s,filter .15s,transform .1s;}
.dlm-cell:hover,.dlm-cell:focus-visible{outline:3px solid #14161a;outline-offset:1px;z-index:5;}
.dlm-cell:active{transform:translateY(1px);}
.dlm-id{font-weight:800;font-size:0.9rem;margin-right:0.3rem;}
.dlm-title{font-weight:500;overflow-wrap:anywhere;}
.dlm-live-mark{position:absolute;top:0.2rem;right:0.25rem;font-size:0.8rem;line-height:1;color:var(--ink);}
.dlm-cell:has(.dlm-live-mark){padding-right:1.1rem;}
.dlm-cell.dim,.dlm-col.dim .dlm-head,.dlm-col.dim .dlm-note,.dlm-band5.dim .dlm-head{opacity:.28;filter:grayscale(.85);}
.dlm-frame.dim{border-color:#c9ccd2;}
.dlm-cell.hl{box-shadow:0 0 0 3px #14161a;}
.dlm-frame.hl{border-width:3px;background:#fffbe6;}
.dlm-tip{display:none;position:absolute;left:-2px;bottom:calc(100% + 9px);width:max(100%,16rem);
 max-width:21rem;z-index:30;
 background:#14161a;color:#fff;border-radius:8px;padding:0.5rem 0.6rem;font-size:0.9375rem;font-weight:500;
 line-height:1.35;box-shadow:0 6px 18px rgba(0,0,0,.3);pointer-events:none;white-space:normal;}
.dlm-tip::after{content:"";position:absolute;left:18px;top:100%;border:7px solid transparent;border-top-color:#14161a;}
.dlm-col-4 .dlm-tip,.dlm-band5 .dlm-cell:last-child .dlm-tip{left:auto;right:-2px;}
.dlm-col-4 .dlm-tip::after,.dlm-band5 .dlm-cell:last-child .dlm-tip::after{left:auto;right:18px;}
.dlm-tip-hint{display:block;margin-top:0.25rem;font-size:0.875rem;color:#c8ccd4;font-style:italic;}
.dlm-cell:hover .dlm-tip,.dlm-cell:focus-visible .dlm-tip{display:block;}
.dlm-band5{position:relative;grid-column:1 / 4;grid-row:2;display:flex;align-items:center;gap:0.8rem;}
.dlm-band5.dlm-frame{padding:0.4rem 0.5rem;}
.dlm-head5{flex:none;flex-direction:column;align-items:flex-start;margin:0;max-width:6rem;}
.dlm-band5 .dlm-cells{flex:1;display:grid;grid-template-columns:repeat(3,minmax(0,1fr));gap:1.6rem;}
.dlm-svg{position:absolute;left:0;top:0;overflow:visible;pointer-events:none;z-index:3;}
.dlm-svg path{fill:none;stroke:var(--line);stroke-width:2.5;stroke-linejoin:round;}
.dlm-svg polygon{fill:var(--line);stroke:none;}
.dlm-svg .faint{opacity:.2;}
.dlm-svg .dlm-long path{stroke-width:3;stroke-dasharray:8 5;}
.dlm-arrow-label{position:absolute;z-index:4;transform:translate(-50%,-50%);background:#fff;
 border:2px solid var(--line);
 border-radius:999px;padding:0 0.6rem;font-size:0.8rem;font-weight:700;white-space:nowrap;color:var(--ink);
 pointer-events:none;}
.dlm-arrow-label.faint{opacity:.3;}
.dlm-pop{border:none;padding:0;background:transparent;max-width:none;max-height:none;overflow:visible;color:var(--ink);}
.dlm-pop::backdrop{background:rgba(10,12,16,.45);}
.dlm-pop-box{width:min(880px,calc(100vw - 32px));max-height:calc(100vh - 40px);overflow:auto;background:#fff;
 border-radius:14px;border-top:10px solid var(--band);box-shadow:0 18px 48px rgba(0,0,0,.35);padding:14px 20px 18px;
 font-size:0.9375rem;line-height:1.45;}
.dlm-pop-head{position:relative;padding-right:44px;margin-bottom:6px;}
.dlm-pop-band{margin:0;font-size:0.875rem;font-weight:700;color:var(--band-dark);text-transform:uppercase;
 letter-spacing:.03em;}
.dlm-pop h3{margin:2px 0 4px;padding:0;font-size:1.375rem;line-height:1.25;font-weight:700;color:var(--ink);}
.dlm-pop-id{display:inline-block;background:var(--band);border:2px solid var(--band-dark);border-radius:7px;
 padding:0 7px;
 margin-right:4px;}
.dlm-pop-tagline{margin:0;font-size:1rem;font-style:italic;color:#333;}
.dlm-close{position:absolute;top:0;right:0;width:38px;height:38px;border-radius:50%;border:2px solid #14161a;
 background:#fff;color:#14161a;font-size:1.125rem;font-weight:700;cursor:pointer;line-height:1;}
.dlm-close:hover,.dlm-close:focus-visible{background:#14161a;color:#fff;}
.dlm-parts{display:flex;flex-direction:column;gap:10px;margin-top:10px;}
.dlm-part h4{margin:0 0 2px;padding:0;font-size:0.875rem;font-weight:800;text-transform:uppercase;letter-spacing:.03em;
 color:var(--band-dark);}
.dlm-part p{margin:0;font-size:0.9375rem;}
.dlm-part-caveat{background:#fff4d6;border-left:5px solid #d99a00;padding:6px 10px;border-radius:6px;}
.dlm-links{display:flex;flex-wrap:wrap;align-items:center;gap:8px 10px;margin-top:14px;}
.dlm-links-label{font-weight:700;font-size:0.9375rem;}
.dlm-live{display:inline-block;background:#14161a;color:#fff !important;text-decoration:none !important;font-weight:700;
 border-radius:8px;padding:7px 12px;font-size:0.9375rem;}
.dlm-live:hover,.dlm-live:focus-visible{background:var(--band-dark);}
.dlm-root{container-type:inline-size;}
@container (max-width:680px){.dlm-grid{grid-template-columns:repeat(2,minmax(0,1fr));grid-template-rows:none;
 row-gap:1rem;}
 .dlm-overlay-on .dlm-grid{padding-top:0;}.dlm-col-4{grid-column:auto;grid-row:auto;}
 .dlm-svg,.dlm-arrow-label{display:none;}.dlm-cells{gap:0.5rem;}
 .dlm-band5{grid-column:1 / -1;grid-row:auto;flex-direction:column;align-items:stretch;}
 .dlm-head5{flex-direction:row;max-width:none;}
 .dlm-band5 .dlm-cells{grid-template-columns:1fr;gap:0.5rem;}}
"""

# -----------------------------------------------------------------------------
# behaviour: arrows from the cells' real positions, pop-overs, same-app links without a page reload

SCRIPT = r"""
(function () {
  const spec = __SPEC__;
  const me = document.currentScript;
  const root = me && me.closest(".dlm-root");
  if (!root) return;
  const map = root.querySelector(".dlm");
  const NS = "http://www.w3.org/2000/svg";
  const cell = (id) => map.querySelector('.dlm-cell[data-cell="' + id + '"]');
  const box = (el) => {
    const r = el.getBoundingClientRect(), m = map.getBoundingClientRect();
    return {l: r.left - m.left, t: r.top - m.top, r: r.right - m.left, b: r.bottom - m.top,
            cx: (r.left + r.right) / 2 - m.left, cy: (r.top + r.bottom) / 2 - m.top};
  };
  const faint = (a) => spec.band !== "all" && !a.bands.includes(spec.band);

  function head(svg, x, y, dir, cls) {  // a filled arrowhead whose tip is at (x, y)
    const s = 7, L = 11;
    const pts = {down: [[x, y], [x - s, y - L], [x + s, y - L]], up: [[x, y], [x - s, y + L], [x + s, y + L]],
                 right: [[x, y], [x - L, y - s], [x - L, y + s]], left: [[x, y], [x + L, y - s], [x + L, y + s]]}[dir];
    const p = document.createElementNS(NS, "polygon");
    p.setAttribute("points", pts.map((q) => q.join(",")).join(" "));
    if (cls) p.setAttribute("class", cls);
    svg.appendChild(p);
  }

  function draw() {
    map.querySelectorAll(".dlm-svg, .dlm-arrow-label").forEach((el) => el.remove());
    if (!spec.arrows.length) return;
    const svg = document.createElementNS(NS, "svg");
    svg.setAttribute("class", "dlm-svg");
    svg.setAttribute("width", map.clientWidth);
    svg.setAttribute("height", map.clientHeight);
    svg.setAttribute("aria-hidden", "true");
    const cols = [1, 2, 3, 4].map((n) => box(map.querySelector(".dlm-col-" + n)));
    const grid = box(map.querySelector(".dlm-grid"));
    const band5 = box(map.querySelector(".dlm-band5"));
    for (const a of spec.arrows) {
      const g = document.createElementNS(NS, "g");
      const cls = faint(a) ? "faint" : "";
      if (a.label) g.setAttribute("class", "dlm-long " + cls); else if (cls) g.setAttribute("class", cls);
      const from = box(cell(a.from));
      let d = "", tip = null, label = null;
      if (a.kind === "down") {
        const to = box(cell(a.to));
        d = `M${from.cx},${from.b + 1} V${to.t - 2}`; tip = [from.cx, to.t - 1, "down"];
      } else if (a.kind === "right") {
        const to = box(cell(a.to));
        d = `M${from.r + 1},${from.cy} H${to.l - 2}`; tip = [to.l - 1, from.cy, "right"];
      } else if (a.kind === "hop") {  // last cell of a column -> first cell of the next, through the gutter
        const to = box(cell(a.to));
        const gx = (from.r + to.l) / 2;
        d = `M${from.r + 1},${from.cy} H${gx} V${to.cy} H${to.l - 2}`; tip = [to.l - 1, to.cy, "right"];
      } else if (a.kind === "loop") {  // 3E -> gutter 3|4 -> lane above the columns -> down onto column 1
        const gx = (cols[2].r + cols[3].l) / 2, y = Math.max(8, grid.t + 12), x = cols[0].cx;
        d = `M${from.r + 1},${from.cy} H${gx} V${y} H${x} V${cols[0].t - 2}`; tip = [x, cols[0].t - 1, "down"];
        label = [(gx + x) / 2, y];
      } else if (a.kind === "drop") {  // 3E -> down to the lane above band 5 -> over to 5A
        const to = box(cell(a.to));
        const y = (Math.max(cols[0].b, cols[1].b, cols[2].b) + band5.t) / 2;
        d = `M${from.cx},${from.b + 1} V${y} H${to.cx} V${to.t - 2}`; tip = [to.cx, to.t - 1, "down"];
        label = [(from.cx + to.cx) / 2, y];
      }
      const p = document.createElementNS(NS, "path");
      p.setAttribute("d", d);
      g.appendChild(p);
      head(g, tip[0], tip[1], tip[2]);
      svg.appendChild(g);
      if (label && a.label) {
        const span = document.createElement("span");
        span.className = "dlm-arrow-label" + (cls ? " faint" : "");
        span.textContent = a.label;
        span.style.left = label[0] + "px";
        span.style.top = label[1] + "px";
        map.appendChild(span);
      }
    }
    map.appendChild(svg);
  }

  // pop-overs: a native modal dialog element (Escape closes it); the close button and a click outside do too
  root.querySelectorAll(".dlm-cell").forEach((c) => {
    c.addEventListener("click", () => {
      const d = root.querySelector("#dlm-pop-" + c.dataset.cell);
      if (d && !d.open) d.showModal();
    });
  });
  root.querySelectorAll(".dlm-pop").forEach((d) => {
    d.addEventListener("click", (e) => { if (e.target === d) d.close(); });
    d.querySelector(".dlm-close").addEventListener("click", () => d.close());
  });
  // links to live pages: switch page inside the app (the session, its cache and tokens stay) by clicking
  // the matching link of Streamlit's own navigation; without one, the plain href loads the page
  root.querySelectorAll("a.dlm-live").forEach((a) => {
    a.addEventListener("click", (e) => {
      if (e.ctrlKey || e.metaKey || e.shiftKey || e.button !== 0) return;
      const page = a.dataset.page;
      const nav = Array.from(document.querySelectorAll('[data-testid="stSidebarNav"] a[href]')).find((l) => {
        try { return new URL(l.href, location.href).pathname.replace(/\/+$/, "").endsWith("/" + page); }
        catch (err) { return false; }
      });
      if (!nav) return;
      e.preventDefault();
      const d = a.closest("dialog");
      if (d) d.close();
      nav.click();
      // the navigation drops the URL's #anchor: once the page is drawn, open the anchor's tab (Fine-tune draws
      // only the open one), then scroll to it; give up after 10 s
      const tab = a.dataset.tab, anchor = a.dataset.anchor;
      if (!anchor) return;
      let tries = 0;
      const timer = setInterval(() => {
        tries += 1;
        if (tries > 100) { clearInterval(timer); return; }
        if (tab) {
          const label = Array.from(document.querySelectorAll('[role="tab"]'))
            .find((b) => b.innerText.trim() === tab);
          if (!label) return;
          if (label.getAttribute("aria-selected") !== "true") { label.click(); return; }
        }
        const target = document.getElementById(anchor);
        if (!target) return;
        clearInterval(timer);
        target.scrollIntoView({block: "start"});
      }, 100);
    });
  });

  draw();
  if (window.ResizeObserver) new ResizeObserver(() => draw()).observe(map);
  if (document.fonts && document.fonts.ready) document.fonts.ready.then(draw);
})();
"""
