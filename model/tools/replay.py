"""Recorded runs: a `trace --json` or `speculate --json` file read back and checked, and re-run for real.

A recording is the JSON of the command line (model/tools/cli.py trace_report, model/tools/speculate.py report) with
its schema name and its settings. Reading one loads no model: the Replay page opens a SmolLM2 run on a machine that
never loaded SmolLM2.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from model.errors import InputError
from model.tools.cli import SCHEMA, trace_report
from model.tools.speculate import SCHEMA as SPECULATE_SCHEMA
from model.tools.speculate import report

MAX_RECORDING_BYTES = 2 * 2**20  # the shipped ones are 2-11 KB, about 1 KB a step (each repeats the answer so far)
RECORDINGS = Path(__file__).resolve().parent.parent.parent / "assets" / "recordings"
# assets/recordings/<name>.json, in the order the page offers them
SHIPPED = ("micro", "small", "smollm2", "gemma3", "small-speculative")
DECODE, SPECULATIVE = "decode", "speculative"
KINDS = {SCHEMA: DECODE, SPECULATE_SCHEMA: SPECULATIVE}  # the schemas this version reads, and the run each holds
# the trace rounds probabilities to 6 decimals (5e-7), and float32 rounds the same sums differently from one
# kernel, weight layout or CPU to another: the shipped recordings' probabilities moved by up to 2e-6 when the CPU
# loader's weight layout changed, a step's logits by up to 3e-5. Tokens and
# cache figures are compared exactly; a probability more than 1e-4 away says the model or the engine changed.
PROB_TOLERANCE = 1e-4

INT, NUMBER, TEXT, LIST, TABLE, BOOL, HEX = "int", "number", "text", "list", "table", "bool", "hex"
# the fields the Replay page reads, each with its kind; None after a kind: the field may be null
MODEL_FIELDS = {"name": TEXT, "n_layers": INT, "n_heads": INT, "n_kv_heads": INT, "d_head": INT, "dtype": TEXT,
                "device": TEXT, "bytes_per_element": INT, "vocab_size": INT, "sliding_window": (INT, None),
                "sliding_layers": LIST}
PROMPT_FIELDS = {"text": TEXT, "ids": LIST, "tokens": LIST, "bytes": LIST}
SAMPLING_FIELDS = {"temperature": NUMBER, "top_k": (INT, None), "top_p": NUMBER, "seed": INT}
SETTINGS_FIELDS = SAMPLING_FIELDS | {"max_new_tokens": INT, "stop": LIST}
STEP_FIELDS = {"index": INT, "phase": TEXT, "input_ids": LIST, "positions": LIST, "cache_len": INT,
               "cache_bytes": INT, "cache_bytes_formula": INT, "chosen_id": INT, "chosen_token": TEXT,
               "chosen_bytes": HEX, "chosen_prob": NUMBER, "top": LIST, "ms": NUMBER, "answer": TEXT}
TOP_FIELDS = {"id": INT, "token": TEXT, "bytes": HEX, "prob": NUMBER}
PHASES = ("prefill", "decode")
STOP_REASONS = (None, "eos", "max_new_tokens", "stop_string", "context_full", "cancelled", "memory_budget")
OUTPUT_FIELDS = {"ids": LIST, "text": TEXT, "stop_reason": (TEXT, None)}
# speculate --json: the run's model, settings and prompt, then one entry a round
SPEC_FIELDS = {"draft": TEXT, "gamma": INT}
SPEC_MODEL_FIELDS = {"name": TEXT, "n_layers": INT, "dtype": TEXT, "device": TEXT}
SPEC_SETTINGS_FIELDS = SAMPLING_FIELDS | {"max_new_tokens": INT}
SPEC_PROMPT_FIELDS = {"ids": LIST, "tokens": LIST, "bytes": LIST, "unknown": LIST}
ROUND_FIELDS = {"index": INT, "gamma": INT, "settings": TABLE, "proposed": LIST, "next_id": (INT, None),
                "next_token": (TEXT, None), "next_bytes": (HEX, None), "next_kind": TEXT, "new_ids": LIST,
                "residual": LIST, "target_cache_len_before": INT, "target_cache_len_checked": INT,
                "target_cache_len": INT, "draft_cache_len_before": (INT, None), "draft_cache_len_proposed": (INT, None),
                "draft_cache_len": (INT, None), "draft_passes": INT, "draft_ms": NUMBER, "target_ms": NUMBER,
                "ms": NUMBER, "answer": TEXT}
PROPOSED_FIELDS = {"id": INT, "token": TEXT, "bytes": HEX, "q": NUMBER, "p": NUMBER, "r": (NUMBER, None),
                   "accepted": (BOOL, None)}
RESIDUAL_FIELDS = {"id": INT, "token": TEXT, "bytes": HEX, "p": NUMBER, "q": NUMBER, "residual": NUMBER}
NEXT_KINDS = ("bonus", "resampled", "corrected", "target", "eos")  # model/speculative/decoding.py Round.next_kind


_HEX_BYTES = {f"{b:02x}" for b in range(256)}


def _is(value, kind) -> bool:
    if isinstance(kind, tuple):
        return any(_is(value, k) for k in kind)
    if kind is None:
        return value is None
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == HEX:  # a token's bytes, as "e1 bb 9b"
        return isinstance(value, str) and all(len(b) == 2 and b in _HEX_BYTES for b in value.split())
    if kind == NUMBER:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {TEXT: str, LIST: list, TABLE: dict, BOOL: bool}[kind])


def _check_fields(table, fields: dict, where: str) -> None:
    if not isinstance(table, dict):
        raise InputError("recording_wrong_type", field=where, kind_text="replay.kind_" + TABLE)
    for name, kind in fields.items():
        field = f"{where}.{name}" if where else name
        if name not in table:
            raise InputError("recording_missing", field=field)
        if not _is(table[name], kind):
            first = kind[0] if isinstance(kind, tuple) else kind
            raise InputError("recording_wrong_type", field=field, kind_text="replay.kind_" + first)


def _check_ints(values: list, where: str) -> None:
    if not all(_is(v, INT) for v in values):
        raise InputError("recording_wrong_type", field=where, kind_text="replay.kind_ints")


def read_recording(data: bytes) -> dict:
    """The run a file holds, checked field by field; InputError says in one sentence what the file is instead.
    recording_kind says which run it is: a Decode run's steps or a speculative run's rounds."""
    if len(data) > MAX_RECORDING_BYTES:
        raise InputError("recording_too_large", kb=len(data) // 1024, most=MAX_RECORDING_BYTES // 1024)
    try:
        run = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InputError("recording_not_json") from None
    if not isinstance(run, dict):
        raise InputError("recording_not_a_run")
    if "schema" not in run:
        for schema, entries in ((SCHEMA, "steps"), (SPECULATE_SCHEMA, "rounds")):
            if {"model", entries, "output"} <= run.keys():
                raise InputError("recording_no_schema", expected=schema)
        raise InputError("recording_not_a_run")
    if run["schema"] not in KINDS:
        found = str(run["schema"])[:60]
        family = [s for s in KINDS if s.split("/")[0] == found.split("/")[0]]  # the version this one reads
        raise InputError("recording_other_schema", found=found, expected=" / ".join(family or KINDS))
    if recording_kind(run) == SPECULATIVE:
        _check_rounds(run)
    else:
        _check_steps(run)
    return run


def recording_kind(run: dict) -> str:
    """DECODE or SPECULATIVE: which run a recording read by read_recording holds."""
    return KINDS[run["schema"]]


def _check_parts(run: dict, parts) -> None:
    for part, fields in parts:
        if part not in run:
            raise InputError("recording_missing", field=part)
        _check_fields(run[part], fields, part)


def _check_entries(run: dict, entries: str) -> list:
    if entries not in run:
        raise InputError("recording_missing", field=entries)
    if not isinstance(run[entries], list) or not run[entries]:
        raise InputError("recording_wrong_type", field=entries, kind_text="replay.kind_" + entries)
    _check_ints(run["prompt"]["ids"], "prompt.ids")
    if not all(_is(b, HEX) for b in run["prompt"]["bytes"]):
        raise InputError("recording_wrong_type", field="prompt.bytes", kind_text="replay.kind_hexes")
    _check_ints(run["output"]["ids"], "output.ids")
    if run["output"]["stop_reason"] not in STOP_REASONS:
        raise InputError("recording_wrong_type", field="output.stop_reason", kind_text="replay.kind_stop")
    if not len(run["prompt"]["tokens"]) == len(run["prompt"]["bytes"]) == len(run["prompt"]["ids"]):
        raise InputError("recording_inconsistent")
    return run[entries]


def _check_steps(run: dict) -> None:
    _check_parts(run, (("model", MODEL_FIELDS), ("prompt", PROMPT_FIELDS), ("settings", SETTINGS_FIELDS),
                       ("output", OUTPUT_FIELDS)))
    for index, step in enumerate(_check_entries(run, "steps")):
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
    if [s["chosen_id"] for s in run["steps"]] != run["output"]["ids"]:
        raise InputError("recording_inconsistent")


def _check_rounds(run: dict) -> None:
    _check_fields(run, SPEC_FIELDS, "")
    _check_parts(run, (("model", SPEC_MODEL_FIELDS), ("prompt", SPEC_PROMPT_FIELDS),
                       ("settings", SPEC_SETTINGS_FIELDS), ("output", OUTPUT_FIELDS)))
    produced = []
    for index, r in enumerate(_check_entries(run, "rounds")):
        where = f"rounds[{index}]"
        _check_fields(r, ROUND_FIELDS, where)
        _check_fields(r["settings"], SAMPLING_FIELDS, where + ".settings")
        _check_ints(r["new_ids"], where + ".new_ids")
        if r["next_kind"] not in NEXT_KINDS:
            raise InputError("recording_wrong_type", field=where + ".next_kind", kind_text="replay.kind_next_kind")
        for rank, row in enumerate(r["proposed"]):
            _check_fields(row, PROPOSED_FIELDS, f"{where}.proposed[{rank}]")
        for rank, row in enumerate(r["residual"]):
            _check_fields(row, RESIDUAL_FIELDS, f"{where}.residual[{rank}]")
        kept = [c["id"] for c in r["proposed"] if c["accepted"]] + ([] if r["next_id"] is None else [r["next_id"]])
        if kept != r["new_ids"]:
            raise InputError("recording_inconsistent")
        produced += r["new_ids"]
    if produced != run["output"]["ids"]:
        raise InputError("recording_inconsistent")


def shipped_recording(name: str) -> dict:
    return read_recording((RECORDINGS / f"{name}.json").read_bytes())


class RecordedTokens:
    """The token texts and bytes a recording holds (of a Decode or a speculative run), by id, with the two calls that
    model.engine.tokenizer.joined_characters makes: the byte pieces of a replayed run are joined as the live
    run's are. decode joins the bytes, which is the tokenizer's decode for the byte-level tokenizers that have
    byte pieces (SmolLM2, Gemma 3)."""

    def __init__(self, run: dict):
        pairs = [(i, t, b) for i, t, b in zip(run["prompt"]["ids"], run["prompt"]["tokens"], run["prompt"]["bytes"])]
        if recording_kind(run) == SPECULATIVE:
            rounds = run["rounds"]
            pairs += [(x["id"], x["token"], x["bytes"]) for r in rounds for x in r["proposed"] + r["residual"]]
            pairs += [(r["next_id"], r["next_token"], r["next_bytes"]) for r in rounds if r["next_id"] is not None]
        else:
            pairs += [(s["chosen_id"], s["chosen_token"], s["chosen_bytes"]) for s in run["steps"]]
        self.texts = {i: t for i, t, _ in pairs}
        self.bytes = {i: bytes.fromhex(b) for i, _, b in pairs}

    def token(self, token_id: int) -> str:
        return self.texts[token_id]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.bytes[i] for i in ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Difference:
    step: int        # a Decode run's step, a speculative run's round
    what: str        # "token", "prob", "cache", "length"; a round's also "proposal", "accepted"
    recorded: str
    now: str


@dataclass(frozen=True)
class Rerun:
    """A recording against the engine run again with its prompt ids and settings."""
    steps: int                       # steps (of a speculative run: rounds) compared
    max_prob_diff: float             # over every recorded probability (chosen and top; q, p) of those compared
    difference: Difference | None    # the first one, None when every token, probability and cache figure matches
    device: str
    dtype: str

    @property
    def matches(self) -> bool:
        return self.difference is None


def rerun(model, run: dict) -> Rerun:
    """Run the recorded prompt ids with the recorded settings and compare each step with the recording: the chosen
    token, every recorded probability (within PROB_TOLERANCE), the cache's length and bytes. A speculative
    recording is compared round by round (rerun_rounds)."""
    if recording_kind(run) == SPECULATIVE:
        return rerun_rounds(model, run)
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


def _sampling(settings: dict):
    from model.engine.sampling import SamplingSettings

    return SamplingSettings(settings["temperature"], settings["top_k"], settings["top_p"], settings["seed"])


def replayed_run(run: dict, rounds: int):
    """A speculative recording's first `rounds` rounds as a SpeculativeRun with no model behind it (target and caches
    None), for the Speculative page's drawing (ui/speculative_round.py): nothing in it can run another round."""
    from types import SimpleNamespace

    from model.speculative.decoding import Check, Round, SpeculativeRun

    done = [Round(
        index=r["index"], gamma=r["gamma"],
        checks=[Check(c["id"], c["q"], c["p"], c["r"], c["accepted"]) for c in r["proposed"]],
        next_id=r["next_id"], next_kind=r["next_kind"], new_ids=r["new_ids"],
        residual_top=[(x["id"], x["p"], x["q"], x["residual"]) for x in r["residual"]],
        target_len_before=r["target_cache_len_before"], target_len_checked=r["target_cache_len_checked"],
        target_len_after=r["target_cache_len"], draft_len_before=r["draft_cache_len_before"],
        draft_len_proposed=r["draft_cache_len_proposed"], draft_len_after=r["draft_cache_len"],
        draft_passes=r["draft_passes"], draft_ms=r["draft_ms"], target_ms=r["target_ms"], total_ms=r["ms"],
        settings=_sampling(r["settings"])) for r in run["rounds"][:rounds]]
    return SpeculativeRun(target=None, draft=SimpleNamespace(name=run["draft"]), prompt_ids=run["prompt"]["ids"],
                          gamma=run["gamma"], settings=done[-1].settings,
                          max_new_tokens=run["settings"]["max_new_tokens"], cache=None,
                          new_ids=[i for r in done for i in r.new_ids], rounds=done,
                          stop_reason=run["output"]["stop_reason"] if rounds >= len(run["rounds"]) else None)


CACHE_LENGTHS = ("target_cache_len_before", "target_cache_len_checked", "target_cache_len", "draft_cache_len_before",
                 "draft_cache_len_proposed", "draft_cache_len")


def _round_difference(ours: dict, theirs: dict) -> Difference | None:
    i = ours["index"]

    def tokens(r: dict, entries: str) -> str:
        return ", ".join(f"{x['token']!r} (id {x['id']})" for x in r[entries]) or "∅"

    if [x["id"] for x in ours["proposed"]] != [x["id"] for x in theirs["proposed"]]:
        return Difference(i, "proposal", tokens(ours, "proposed"), tokens(theirs, "proposed"))
    if [x["accepted"] for x in ours["proposed"]] != [x["accepted"] for x in theirs["proposed"]]:
        return Difference(i, "accepted", str([x["accepted"] for x in ours["proposed"]]),
                          str([x["accepted"] for x in theirs["proposed"]]))
    if (ours["next_id"], ours["next_kind"]) != (theirs["next_id"], theirs["next_kind"]):
        return Difference(i, "token", f"{ours['next_token']!r} (id {ours['next_id']}, {ours['next_kind']})",
                          f"{theirs['next_token']!r} (id {theirs['next_id']}, {theirs['next_kind']})")
    if [ours[k] for k in CACHE_LENGTHS] != [theirs[k] for k in CACHE_LENGTHS]:
        return Difference(i, "cache", " / ".join(str(ours[k]) for k in CACHE_LENGTHS),
                          " / ".join(str(theirs[k]) for k in CACHE_LENGTHS))
    if [x["id"] for x in ours["residual"]] != [x["id"] for x in theirs["residual"]]:
        return Difference(i, "token", tokens(ours, "residual"), tokens(theirs, "residual"))
    return None


def _round_probs(r: dict) -> list[float]:
    return [x[k] for x in r["proposed"] for k in ("q", "p")] + [
        x[k] for x in r["residual"] for k in ("p", "q", "residual")]


def rerun_rounds(model, run: dict) -> Rerun:
    """Run a speculative recording again (its draft, γ, prompt ids, and each round's own sampling settings) and
    compare round by round: the proposed tokens, their verdicts, the target's own token, both caches' lengths
    exactly, every recorded q, p and residual probability within PROB_TOLERANCE."""
    from model.speculative.decoding import next_round, start

    recorded = run["rounds"]
    live = start(model, run["draft"], run["prompt"]["ids"], run["gamma"], _sampling(recorded[0]["settings"]),
                 run["settings"]["max_new_tokens"])
    for ours in recorded:
        live.settings = _sampling(ours["settings"])  # the page applies a change of the controls from a round on
        if next_round(live) is None:
            break
    now = report(live, None, [])["rounds"]
    worst, difference = 0.0, None
    for ours, theirs in zip(recorded, now):
        difference = _round_difference(ours, theirs)
        if difference is not None:
            break
        gaps = [abs(a - b) for a, b in zip(_round_probs(ours), _round_probs(theirs))]
        worst = max(worst, *gaps, 0.0)
        if gaps and max(gaps) > PROB_TOLERANCE:
            k = gaps.index(max(gaps))
            difference = Difference(ours["index"], "prob", f"{_round_probs(ours)[k]:.6f}",
                                    f"{_round_probs(theirs)[k]:.6f}")
            break
    compared = len(recorded) if difference is None else difference.step + 1
    stopped = run["output"]["stop_reason"]
    if difference is None and (len(now), live.stop_reason) != (len(recorded), stopped):
        # fewer rounds, or a run that stopped where the recording went on (a recording saved mid-run does not)
        difference = Difference(min(len(now), len(recorded)), "length", f"{len(recorded)} ({stopped})",
                                f"{len(now)} ({live.stop_reason})")
    return Rerun(compared, worst, difference, model.info.device, model.info.dtype)
