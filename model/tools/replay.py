"""Recorded runs: a `trace --json` file read back and checked, and re-run for real against the engine.

A recording is the trace JSON (model/tools/cli.py trace_report) with its schema name and its settings. Reading one
needs no model and no torch: the Replay page opens a SmolLM2 run on a machine that never loaded SmolLM2.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from model.errors import InputError
from model.tools.cli import SCHEMA, trace_report

MAX_RECORDING_BYTES = 2 * 2**20  # the shipped ones are 2-11 KB, about 1 KB a step (each repeats the answer so far)
RECORDINGS = Path(__file__).resolve().parent.parent.parent / "assets" / "recordings"
SHIPPED = ("micro", "small", "smollm2", "gemma3")  # assets/recordings/<name>.json, in the order the page offers them
# the trace rounds probabilities to 6 decimals (5e-7), and float32 rounds the same sums differently from one
# kernel, weight layout or CPU to another: the shipped recordings' probabilities moved by up to 2e-6 when the CPU
# loader's weight layout changed (model/engine/llama.py column_major), a step's logits by up to 3e-5. Tokens and
# cache figures are compared exactly; a probability more than 1e-4 away says the model or the engine changed.
PROB_TOLERANCE = 1e-4

INT, NUMBER, TEXT, LIST, TABLE = "int", "number", "text", "list", "table"
# the fields the Replay page reads, each with its kind; None after a kind: the field may be null
MODEL_FIELDS = {"name": TEXT, "n_layers": INT, "n_heads": INT, "n_kv_heads": INT, "d_head": INT, "dtype": TEXT,
                "device": TEXT, "bytes_per_element": INT, "vocab_size": INT, "sliding_window": (INT, None),
                "sliding_layers": LIST}
PROMPT_FIELDS = {"text": TEXT, "ids": LIST, "tokens": LIST, "bytes": LIST}
SETTINGS_FIELDS = {"temperature": NUMBER, "top_k": (INT, None), "top_p": NUMBER, "seed": INT, "max_new_tokens": INT,
                   "stop": LIST}
STEP_FIELDS = {"index": INT, "phase": TEXT, "input_ids": LIST, "positions": LIST, "cache_len": INT,
               "cache_bytes": INT, "cache_bytes_formula": INT, "chosen_id": INT, "chosen_token": TEXT,
               "chosen_bytes": TEXT, "chosen_prob": NUMBER, "top": LIST, "ms": NUMBER, "answer": TEXT}
TOP_FIELDS = {"id": INT, "token": TEXT, "bytes": TEXT, "prob": NUMBER}
PHASES = ("prefill", "decode")
STOP_REASONS = (None, "eos", "max_new_tokens", "stop_string", "context_full", "cancelled", "memory_budget")
OUTPUT_FIELDS = {"ids": LIST, "text": TEXT, "stop_reason": (TEXT, None)}


def _is(value, kind) -> bool:
    if isinstance(kind, tuple):
        return any(_is(value, k) for k in kind)
    if kind is None:
        return value is None
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == NUMBER:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {TEXT: str, LIST: list, TABLE: dict}[kind])


def _check_fields(table, fields: dict, where: str) -> None:
    if not isinstance(table, dict):
        raise InputError("recording_wrong_type", field=where, kind_text="replay.kind_" + TABLE)
    for name, kind in fields.items():
        if name not in table:
            raise InputError("recording_missing", field=f"{where}.{name}")
        if not _is(table[name], kind):
            first = kind[0] if isinstance(kind, tuple) else kind
            raise InputError("recording_wrong_type", field=f"{where}.{name}", kind_text="replay.kind_" + first)


def _check_ints(values: list, where: str) -> None:
    if not all(_is(v, INT) for v in values):
        raise InputError("recording_wrong_type", field=where, kind_text="replay.kind_ints")


def read_recording(data: bytes) -> dict:
    """The run a file holds, checked field by field; InputError says in one sentence what the file is instead."""
    if len(data) > MAX_RECORDING_BYTES:
        raise InputError("recording_too_large", kb=len(data) // 1024, most=MAX_RECORDING_BYTES // 1024)
    try:
        run = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InputError("recording_not_json") from None
    if not isinstance(run, dict):
        raise InputError("recording_not_a_run")
    if "rounds" in run and "steps" not in run:
        raise InputError("recording_speculative")
    if "schema" not in run:
        if {"model", "steps", "output"} <= run.keys():
            raise InputError("recording_no_schema", expected=SCHEMA)
        raise InputError("recording_not_a_run")
    if run["schema"] != SCHEMA:
        raise InputError("recording_other_schema", found=str(run["schema"])[:60], expected=SCHEMA)
    for part, fields in (("model", MODEL_FIELDS), ("prompt", PROMPT_FIELDS), ("settings", SETTINGS_FIELDS),
                         ("output", OUTPUT_FIELDS)):
        if part not in run:
            raise InputError("recording_missing", field=part)
        _check_fields(run[part], fields, part)
    if "steps" not in run:
        raise InputError("recording_missing", field="steps")
    if not isinstance(run["steps"], list) or not run["steps"]:
        raise InputError("recording_wrong_type", field="steps", kind_text="replay.kind_steps")
    _check_ints(run["prompt"]["ids"], "prompt.ids")
    _check_ints(run["output"]["ids"], "output.ids")
    for index, step in enumerate(run["steps"]):
        where = f"steps[{index}]"
        _check_fields(step, STEP_FIELDS, where)
        _check_ints(step["input_ids"], where + ".input_ids")
        _check_ints(step["positions"], where + ".positions")
        if step["phase"] not in PHASES:
            raise InputError("recording_wrong_type", field=where + ".phase", kind_text="replay.kind_phase")
        if not step["input_ids"] or len(step["positions"]) != len(step["input_ids"]):
            raise InputError("recording_inconsistent")
        for rank, row in enumerate(step["top"]):
            _check_fields(row, TOP_FIELDS, f"{where}.top[{rank}]")
    if run["output"]["stop_reason"] not in STOP_REASONS:
        raise InputError("recording_wrong_type", field="output.stop_reason", kind_text="replay.kind_stop")
    if [s["chosen_id"] for s in run["steps"]] != run["output"]["ids"] or not (
            len(run["prompt"]["tokens"]) == len(run["prompt"]["bytes"]) == len(run["prompt"]["ids"])):
        raise InputError("recording_inconsistent")
    return run


def shipped_recording(name: str) -> dict:
    return read_recording((RECORDINGS / f"{name}.json").read_bytes())


class RecordedTokens:
    """The token texts and bytes a recording holds, by id, with the two calls that
    model.engine.tokenizer.joined_characters makes: the byte pieces of a replayed run are joined as the live
    run's are. decode joins the bytes, which is the tokenizer's decode for the byte-level tokenizers that have
    byte pieces (SmolLM2, Gemma 3)."""

    def __init__(self, run: dict):
        pairs = [(i, t, b) for i, t, b in zip(run["prompt"]["ids"], run["prompt"]["tokens"], run["prompt"]["bytes"])]
        pairs += [(s["chosen_id"], s["chosen_token"], s["chosen_bytes"]) for s in run["steps"]]
        self.texts = {i: t for i, t, _ in pairs}
        self.bytes = {i: bytes.fromhex(b) for i, _, b in pairs}

    def token(self, token_id: int) -> str:
        return self.texts[token_id]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.bytes[i] for i in ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Difference:
    step: int
    what: str        # "token", "prob", "cache", "length"
    recorded: str
    now: str


@dataclass(frozen=True)
class Rerun:
    """A recording against the engine run again with its prompt ids and settings."""
    steps: int                       # steps compared
    max_prob_diff: float             # over every recorded probability (chosen and top) of the steps compared
    difference: Difference | None    # the first one, None when every token, probability and cache figure matches
    device: str
    dtype: str

    @property
    def matches(self) -> bool:
        return self.difference is None


def rerun(model, run: dict) -> Rerun:
    """Run the recorded prompt ids with the recorded settings and compare each step with the recording: the chosen
    token, every recorded probability (within PROB_TOLERANCE), the cache's length and bytes."""
    from model.engine.generate import run_to_end, start
    from model.engine.sampling import SamplingSettings

    s = run["settings"]
    gen = start(model, run["prompt"]["ids"], SamplingSettings(s["temperature"], s["top_k"], s["top_p"], s["seed"]),
                s["max_new_tokens"], tuple(s["stop"]))
    run_to_end(model, gen)
    now = trace_report(model, gen, run["prompt"]["text"], [])["steps"]
    worst, difference = 0.0, None
    for ours, theirs in zip(run["steps"], now):
        i = ours["index"]
        if ours["chosen_id"] != theirs["chosen_id"]:
            difference = Difference(i, "token", f"{ours['chosen_token']!r} (id {ours['chosen_id']})",
                                    f"{theirs['chosen_token']!r} (id {theirs['chosen_id']})")
            break
        if (ours["cache_len"], ours["cache_bytes"]) != (theirs["cache_len"], theirs["cache_bytes"]):
            difference = Difference(i, "cache", f"{ours['cache_len']} / {ours['cache_bytes']} B",
                                    f"{theirs['cache_len']} / {theirs['cache_bytes']} B")
            break
        recorded = [ours["chosen_prob"]] + [row["prob"] for row in ours["top"]]
        again = [theirs["chosen_prob"]] + [row["prob"] for row in theirs["top"]]
        if [row["id"] for row in ours["top"]] != [row["id"] for row in theirs["top"]][: len(ours["top"])]:
            difference = Difference(i, "token", ", ".join(repr(r["token"]) for r in ours["top"]),
                                    ", ".join(repr(r["token"]) for r in theirs["top"]))
            break
        gaps = [abs(a - b) for a, b in zip(recorded, again)]
        worst = max(worst, *gaps)
        if max(gaps) > PROB_TOLERANCE:
            k = gaps.index(max(gaps))
            difference = Difference(i, "prob", f"{recorded[k]:.6f}", f"{again[k]:.6f}")
            break
    compared = len(run["steps"]) if difference is None else difference.step + 1
    if difference is None and len(now) != len(run["steps"]):
        difference = Difference(min(len(now), len(run["steps"])), "length", str(len(run["steps"])), str(len(now)))
    return Rerun(compared, worst, difference, model.info.device, model.info.dtype)
