"""One decode step as the Decode and Replay pages show it, drawn by one function (step_view_html) from a StepView
that either a live run (live_step) or a recording (recorded_step) fills in: the token strip, the step's summary,
the new token's attention, the probabilities and the token drawn, the cache's bytes against the formula, the
cached-vs-recomputed check and the answer."""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

import numpy as np

from model.engine import generate
from model.engine.counting import CacheShape
from model.engine.generate import CHECK_TOLERANCE
from model.engine.runtime import LoadedModel
from model.engine.sampling import most_probable
from model.engine.tokenizer import joined_characters
from model.recording.replay import TRACE_V1, RecordedTokens
from ui import svg
from ui.bounded_row import struck_out
from ui.charts import LOG_FLOOR, attention_colours
from ui.controls import cache_by_layer_kind
from ui.i18n import decimal, number, scientific, t
from ui.run import strip_tokens
from ui.widgets import (
    attention_row_html,
    box_html,
    heading_html,
    md_escape,
    paragraph_html,
    probability_bars_html,
    shown,
    table_html,
    token_strip_html,
    window_of,
)

TOP_BARS = 12
# a long context's strip and attention row show the start, the latest positions (and the row its heaviest keys),
# each run of the others folded into one chip: a Next then redraws about 50 chips, not 2 per position
# (benchmarks/click_latency.py: a 245-position step view was 1,514 elements and 131 KB); and 20 chips, about three
# rows at 1280 px, leave the attention on the first screen (SmolLM2's chat template alone is 37 positions)
STRIP_HEAD, STRIP_TAIL = 4, 16
FED_HEAD, FED_TAIL = 3, 3  # a step's summary names a long prompt's first and last tokens, and how many it fed
ROW_HEAD, ROW_TOP, ROW_TAIL = 4, 12, 32
TABLE_ROWS = 6  # the cache table shows the latest steps; the chart shows them all


@dataclass
class StepView:
    tokens: list[str]                       # the strip: the sequence so far
    ids: list[int]
    kinds: list[str]                        # a chip's CSS kind: "" (prompt), "new", "current"
    tokenizer: object                       # token(id) and decode(ids): the model's, or a recording's tokens
    summary: str                            # "Step k (decode): fed … at position p · cache: n positions · ms"
    attention: str                          # the attention panel's HTML, under its heading
    bars: tuple[list[str], list[float], list[str]]  # the top tokens, their probabilities, each one's kind
    bar_names: dict[str, str]
    choice: str                             # the sentence on the token drawn
    cache_series: dict[str, list[int]]      # the cache chart's lines, by label; the last one dashed
    cache_columns: list[str]
    cache_rows: list[list]                  # the table's latest steps
    cache_formula: str
    check: str                              # the check panel's HTML, under its heading
    answer: str
    answer_tokens: int
    stop: str
    before_grid: str = ""                   # what the page adds between the summary and the panels


def step_view_html(view: StepView) -> str:
    joined = joined_characters(view.tokenizer, view.ids)
    keep = window_of(len(view.ids), STRIP_HEAD, STRIP_TAIL)
    shown_joined = joined if keep is None else [c for i, c in enumerate(joined) if i in keep]
    legend = (paragraph_html(t("tokens.byte_legend"), "dl-caption") if any(c is not None for c in shown_joined)
              else "")
    if keep is not None:
        legend += paragraph_html(t("decode.strip_folded", n=len(view.ids), head=STRIP_HEAD, tail=STRIP_TAIL,
                                   folded=len(view.ids) - len(keep)), "dl-caption")
    sampling = (heading_html(t("decode.sampling")) + probability_bars_html(*view.bars, view.bar_names)
                + paragraph_html(view.choice))
    steps = list(range(len(next(iter(view.cache_series.values())))))
    cache = (heading_html(t("decode.cache"))
             + svg.line_chart_svg(steps, view.cache_series, t("decode.step_axis"), t("decode.bytes_axis"),
                                  t("decode.cache"), dashed=(list(view.cache_series)[-1],), number=number)
             + table_html(view.cache_columns, view.cache_rows) + paragraph_html(view.cache_formula, "dl-caption"))
    answer = (heading_html(t("decode.check")) + view.check + heading_html(t("decode.answer"))
              + paragraph_html(t("decode.answer_text", text=md_escape(view.answer) or "∅", n=view.answer_tokens))
              + view.stop)
    return (token_strip_html(view.tokens, view.ids, view.kinds, joined, keep, view.tokenizer.decode) + legend
            + view.summary
            + view.before_grid + f'<div class="dl-grid"><div>{heading_html(t("decode.attention"))}{view.attention}'
            f"</div><div>{sampling}</div><div>{cache}</div><div>{answer}</div></div>")


def fed_text(tokens: list[str]) -> str:
    """The tokens a step fed, as its summary names them (as their chips show them: a newline as ↵): all of a few;
    of a long prompt the first and last ones."""
    tokens = [shown(tok) for tok in tokens]
    if len(tokens) <= FED_HEAD + FED_TAIL + 1:
        return ", ".join(tokens)
    return t("decode.fed_folded", first=", ".join(tokens[:FED_HEAD]), last=", ".join(tokens[-FED_TAIL:]),
             n=number(len(tokens)))


def summary_html(step: int, phase: str, fed: list[str], positions: list[int], cache_len: int, ms: float, device: str,
                 dtype: str) -> str:
    """The step's line: what it fed at which positions (a prompt's from the first to the last), the cache, the time."""
    where = (t("decode.at_position", pos=positions[0]) if len(positions) == 1 else
             t("decode.at_positions", first=positions[0], last=positions[-1]))
    return paragraph_html(t("decode.step_summary", step=step, phase=t("phase." + phase), fed=md_escape(fed_text(fed)),
                            where=where, cache=cache_len, ms=decimal(ms, 2), device=device, dtype=dtype))


def formula_text(shape: CacheShape, cache_len: int, measured: int, formula: int) -> str:
    """Where the bytes go: by layer kind on a model with sliding layers, else the one-line formula."""
    return cache_by_layer_kind(shape, cache_len, measured) or t(
        "decode.formula_text", layers=shape.n_layers, kv=shape.n_kv_heads, d=shape.d_head, b=shape.bytes_per_element,
        per_position=number(shape.bytes(1)), positions=number(cache_len), total=number(formula))


def check_html(max_abs_diff: float, cache_len: int, note: str = "") -> str:
    """The largest |Δlogit| between the cached step and its recompute, `note` under it, then the verdict."""
    passed = max_abs_diff <= CHECK_TOLERANCE
    verdict = t("decode.check_result_pass" if passed else "decode.check_result_fail",
                tol=scientific(CHECK_TOLERANCE), n=cache_len)
    return (f'<div class="dl-metric">{escape(t("decode.check_metric"))}<b>{scientific(max_abs_diff)}</b></div>'
            + note
            + box_html(verdict, "pass" if passed else "fail"))


# -- from a live run -------------------------------------------------------------------------------------------

def step_list(runs: list[generate.AttentionRun]) -> str:
    return ", ".join(str(r.first) if r.first == r.last else f"{r.first}–{r.last}" for r in runs)


def attention_kept_html(gen: generate.Generation, layer: int, head: int) -> str:
    """What the budget dropped of the decode steps' attention rows and what stays, for the triangle drawn
    (layer, head): nothing when every step keeps every row."""
    runs = generate.attention_runs(gen)
    if all(r.kept == "every" for r in runs):
        return ""
    mb = number(gen.budget_bytes / 2**20, "g")
    notes = []
    dropped = [r for r in runs if r.kept == "none"]
    if dropped:
        notes.append(t("decode.attention_dropped", mb=mb, steps=step_list(dropped)))
    for view in dict.fromkeys(r.view for r in runs if r.kept == "one"):
        thinned = step_list([r for r in runs if r.view == view])
        key = "decode.attention_thinned_shown" if view == (layer, head) else "decode.attention_thinned_blank"
        notes.append(t(key, mb=mb, steps=thinned, layer=view[0], head=view[1]))
    notes.append(t("decode.attention_kept", steps=step_list([r for r in runs if r.kept == "every"]),
                   back=t("action.back")))
    return "".join(paragraph_html(note, "dl-caption") for note in notes)


def memory_budget_html(gen: generate.Generation) -> str:
    """Why the run stopped at the budget: the bytes that are left when nothing older can be dropped."""
    prefill = gen.steps[0].nbytes
    return paragraph_html(t("decode.memory_budget_stop", mb=number(gen.budget_bytes / 2**20, "g"),
                            prefill=decimal(prefill / 2**20), steps=decimal((gen.nbytes - prefill) / 2**20),
                            cache=decimal(gen.cache.nbytes_reserved() / 2**20), back=t("action.back"),
                            reset=t("action.reset")), "dl-caption")


def scale_ticks(scale: str) -> list[tuple[float, str]]:
    """The triangle's colour bar ticks on the chosen scale (ui/charts.attention_colours), in the session's format."""
    if scale == "log":
        powers = range(round(np.log10(LOG_FLOOR)), 1)
        return [((p - powers[0]) / -powers[0], number(10.0 ** p)) for p in powers]
    return [(1, "1"), (0.5, number(0.5)), (0, "0")]


def live_attention_html(model: LoadedModel, gen: generate.Generation, layer: int, head: int,
                        scale: str = "linear", bounded: str = "off") -> str:
    """The new token's attention row over the cache (a long one folded; with a `bounded` policy, the positions that
    cache would no longer hold struck out), the window's edge, the growing triangle coloured on `scale`."""
    info, tok, trace = model.info, model.tokenizer, gen.steps[-1]
    cached = [tok.token(i) for i in gen.ids[: trace.cache_len]]
    row = trace.weights(layer, head)[-1]  # (cache_len,): the newest query
    keep = window_of(len(row), ROW_HEAD, ROW_TAIL, most_probable(row, ROW_TOP).tolist())
    folded = "" if keep is None else paragraph_html(t(
        "decode.attention_folded", head=ROW_HEAD, top=ROW_TOP, tail=ROW_TAIL, folded=len(row) - len(keep),
        w=decimal(float(row.sum() - row[sorted(keep)].sum()), 2)), "dl-caption")
    window = info.layer_windows[layer] if info.layer_windows else None
    struck, bounded_note = struck_out(model, gen, layer, row, bounded)
    history = generate.attention_history(gen, layer, head)
    edge = (paragraph_html(t("decode.window_edge", layer=layer, window=window, edge=trace.cache_len - window),
                           "dl-caption") if window is not None and trace.cache_len > window else "")
    return (paragraph_html(t("decode.attention_row", token=md_escape(tok.token(trace.input_ids[-1])),
                             n=trace.cache_len), "dl-caption")
            + folded + attention_row_html(cached, row, keep, struck)
            + (paragraph_html(bounded_note, "dl-caption") if bounded_note else "") + edge
            + paragraph_html(t("decode.attention_history"), "dl-caption") + attention_kept_html(gen, layer, head)
            + svg.heatmap_html(history, [f"{p}:{shown(w)}" for p, w in enumerate(cached)], t("decode.attention"),
                               generate.attention_rows_kept(gen, layer, head), t("decode.row_not_kept"),
                               attention_colours(history, scale), scale_ticks(scale))
            + paragraph_html(f"{t('attention.scale')}: {t('attention.colour_' + scale)}", "dl-caption"))


def live_check_html(check: generate.RecomputeCheck | None, checking: bool, trace) -> str:
    """The verdict of this step's check, "checking…" while it runs, or that the check is off."""
    if check is not None:
        return (check_html(check.max_abs_diff, trace.cache_len, paragraph_html(t("decode.check_help"), "dl-caption"))
                + paragraph_html(t("decode.check_timing_prefill" if trace.phase == "prefill" else "decode.check_timing",
                                   n=trace.cache_len, ms=decimal(check.ms), step_ms=decimal(trace.ms)), "dl-caption"))
    if checking:
        return box_html(t("decode.checking", n=trace.cache_len), "note")
    return paragraph_html(t("decode.check_off"), "dl-caption")


def live_step(model: LoadedModel, gen: generate.Generation, layer: int, head: int,
              check: generate.RecomputeCheck | None, checking: bool, before_grid: str = "",
              scale: str = "linear", bounded: str = "off") -> StepView:
    """The current step of this session's run."""
    info, tok = model.info, model.tokenizer
    trace, drawn = gen.steps[-1], gen.samples[-1]
    tokens, ids, kinds = strip_tokens(model, gen)
    chosen = md_escape(tok.token(drawn.chosen_id))
    if drawn.greedy:
        choice = t("sampling.summary_greedy", token=chosen, id=drawn.chosen_id, p=decimal(drawn.chosen_prob, 3))
    else:
        choice = t("sampling.summary", token=chosen, id=drawn.chosen_id, p=decimal(drawn.chosen_final_prob, 3),
                   mode=t("sampling.sampled", seed=gen.settings.seed), k=drawn.n_kept_top_k,
                   p_kept=drawn.n_kept_top_p, vocab=info.vocab_size)
    stop = (box_html(t("decode.stopped", reason=t("stop." + gen.stop_reason)), "note") if gen.stop_reason
            else paragraph_html(t("decode.not_stopped"), "dl-caption"))
    if gen.stop_reason == "memory_budget":
        stop += memory_budget_html(gen)
    latest = list(enumerate(gen.steps))[-TABLE_ROWS:]
    return StepView(
        tokens, ids, kinds, tok,
        summary_html(len(gen.steps) - 1, trace.phase, [tok.token(i) for i in trace.input_ids],
                     list(trace.positions), trace.cache_len, trace.ms, info.device, info.dtype),
        live_attention_html(model, gen, layer, head, scale, bounded),
        ([tok.token(int(i)) for i in drawn.top_ids[:TOP_BARS]], drawn.top_probs[:TOP_BARS],
         list(drawn.top_status[:TOP_BARS])),
        {k: t("sampling." + k) for k in ("chosen", "kept", "cut_k", "cut_p", "other")}, choice,
        {t("decode.measured"): [s.cache_bytes for s in gen.steps],
         t("decode.reserved"): [s.cache_bytes_reserved for s in gen.steps]},
        [t("decode.step_axis"), t("decode.cache_len"), t("decode.measured"), t("decode.formula"), t("decode.reserved")],
        [[i, s.cache_len, number(s.cache_bytes), number(s.cache_bytes_formula), number(s.cache_bytes_reserved)]
         for i, s in latest],
        formula_text(info.cache_shape, trace.cache_len, trace.cache_bytes, trace.cache_bytes_formula),
        live_check_html(check, checking, trace), tok.decode(gen.new_ids), len(gen.new_ids), stop, before_grid)


# -- from a recording ------------------------------------------------------------------------------------------

def recorded_stop_html(run: dict, at_end: bool) -> str:
    """Where the recorded run stopped, once the replay reaches its last step or round."""
    reason = run["output"]["stop_reason"]
    if not at_end:
        return paragraph_html(t("replay.not_stopped"), "dl-caption")
    if reason is None:
        return box_html(t("replay.saved_before_stop"), "note")
    if reason == "cancelled":
        return box_html(t("replay.stop_cancelled"), "note")
    return box_html(t("decode.stopped", reason=t("stop." + reason)), "note")


def recorded_choice(run: dict, step: dict) -> str:
    """The chosen token and the settings it was drawn with: the step's own; a trace/1 file kept only the run's last
    ones, which the sentence says, without calling the step greedy or sampled."""
    if run["schema"] == TRACE_V1:
        key, s = "replay.chosen_last_settings", run["settings"]
    else:
        s = step["settings"]
        key = "replay.chosen_greedy" if s["temperature"] == 0 else "replay.chosen"
    return t(key, token=md_escape(step["chosen_token"]), id=step["chosen_id"], p=decimal(step["chosen_prob"], 3),
             temperature=number(s["temperature"]),
             top_k=s["top_k"] if s["top_k"] is not None else t("replay.top_k_off"), top_p=number(s["top_p"]),
             seed=s["seed"], n=len(step["top"]), schema=run["schema"])


def recorded_step(run: dict, index: int) -> StepView:
    """What a recording holds about one step: no attention weights (only their shape), the recorded check."""
    step, m, prompt = run["steps"][index], run["model"], run["prompt"]
    shown_steps = run["steps"][: index + 1]
    kinds = [""] * len(prompt["ids"]) + ["new"] * (index + 1)
    kinds[-1] = "current"
    fed = dict(zip(prompt["ids"], prompt["tokens"])) | {x["chosen_id"]: x["chosen_token"] for x in run["steps"]}
    shape = CacheShape(m["n_layers"], m["n_kv_heads"], m["d_head"], m["bytes_per_element"],
                       len(m["sliding_layers"]), m["sliding_window"])
    if "max_abs_logit_diff" in step:
        check = check_html(step["max_abs_logit_diff"], step["cache_len"])
    else:
        check = paragraph_html(t("replay.check_absent"), "dl-caption")
    return StepView(
        prompt["tokens"] + [x["chosen_token"] for x in shown_steps],
        prompt["ids"] + [x["chosen_id"] for x in shown_steps], kinds, RecordedTokens(run),
        summary_html(index, step["phase"], [fed.get(i, str(i)) for i in step["input_ids"]],
                     step["positions"], step["cache_len"], step["ms"], m["device"], m["dtype"]),
        box_html(t("replay.attention_absent", layers=m["n_layers"], heads=m["n_heads"],
                   queries=len(step["input_ids"]), keys=step["cache_len"]), "note"),
        ([row["token"] for row in step["top"]], [row["prob"] for row in step["top"]],
         ["chosen" if row["id"] == step["chosen_id"] else "other" for row in step["top"]]),
        {k: t("sampling." + k) for k in ("chosen", "other")}, recorded_choice(run, step),
        {t("decode.measured"): [x["cache_bytes"] for x in shown_steps],
         t("decode.formula"): [x["cache_bytes_formula"] for x in shown_steps]},
        [t("decode.step_axis"), t("decode.cache_len"), t("decode.measured"), t("decode.formula")],
        [[x["index"], x["cache_len"], number(x["cache_bytes"]), number(x["cache_bytes_formula"])]
         for x in shown_steps[-TABLE_ROWS:]],
        formula_text(shape, step["cache_len"], step["cache_bytes"], step["cache_bytes_formula"]),
        check, step["answer"], index + 1, recorded_stop_html(run, index == len(run["steps"]) - 1))
