"""Recorded runs: a `trace --json` or `speculate --json` file read back and checked, and re-run for real.

A recording is the JSON of a run (model/recording/trace.py trace_report, model/recording/speculative.py report)
with its schema name and its settings. Reading one loads no model: the Replay page opens a SmolLM2 run on a machine
that never loaded SmolLM2.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from model.errors import InputError
from model.recording.speculative import SCHEMA as SPECULATE_SCHEMA
from model.recording.speculative import report
from model.recording.trace import SCHEMA, trace_report

MAX_RECORDING_BYTES = 2 * 2**20  # the shipped ones are 2-11 KB, about 1 KB a step (each repeats the answer so far)
RECORDINGS = Path(__file__).resolve().parent.parent.parent / "assets" / "recordings"
# assets/recordings/<name>.json, in the order the page offers them
SHIPPED = ("micro", "small", "smollm2", "gemma3", "small-speculative")
DECODE, SPECULATIVE = "decode", "speculative"
# the trace rounds probabilities to 6 decimals (5e-7), and float32 rounds the same sums differently from one
# kernel, weight layout or CPU to another: the shipped recordings' probabilities moved by up to 2e-6 when the CPU
# loader's weight layout changed, a step's logits by up to 3e-5. Tokens and
# cache figures are compared exactly; a probability more than 1e-4 away says the model or the engine changed.
PROB_TOLERANCE = 1e-4

# -- the trace JSON: written by `trace --json` and the Decode page's "Download the run" -------------------------


# -- reading a recording back ---------------------------------------------------------------------------------

TRACE_V1 = "decode-lab.trace/1"  # before each step carried its sampling settings: still read, and said so
# the schemas this version reads, and the run each holds
KINDS = {SCHEMA: DECODE, TRACE_V1: DECODE, SPECULATE_SCHEMA: SPECULATIVE}
# every number the page reads is checked against a range it can draw: a float64, as a chart's scale or a browser's
# JSON holds it, is exact for whole numbers up to here (a cache_bytes of 10^400 overflowed the chart's ticks)
MOST = 2**53 - 1
LONGEST_INT = 30  # digits: a longer number in the file reads as infinity, which every field refuses by its name

# the kinds of field, each said in the user's language by replay.kind_<kind>
INT, POSITIVE, NUMBER, PROBABILITY, TOP_P = "int", "positive", "number", "probability", "top_p"
TEXT, HEX, TABLE, LIST, BOOL = "text", "hex", "table", "list", "bool"
INTS, NONEMPTY_INTS, TEXTS, HEXES = "ints", "nonempty_ints", "texts", "hexes"
# the fields the Replay page reads, each with its kind; None after a kind: the field may be null
MODEL_FIELDS = {"name": TEXT, "n_layers": POSITIVE, "n_heads": POSITIVE, "n_kv_heads": POSITIVE,
                "d_head": POSITIVE, "dtype": TEXT, "device": TEXT, "bytes_per_element": POSITIVE,
                "vocab_size": POSITIVE, "sliding_window": (POSITIVE, None), "sliding_layers": INTS}
PROMPT_FIELDS = {"text": TEXT, "ids": INTS, "tokens": TEXTS, "bytes": HEXES}
SAMPLING_FIELDS = {"temperature": NUMBER, "top_k": (POSITIVE, None), "top_p": TOP_P, "seed": INT}
SETTINGS_FIELDS = SAMPLING_FIELDS | {"max_new_tokens": POSITIVE, "stop": TEXTS}
STEP_FIELDS = {"index": INT, "phase": TEXT, "input_ids": NONEMPTY_INTS, "positions": NONEMPTY_INTS,
               "cache_len": INT, "cache_bytes": INT, "cache_bytes_formula": INT, "chosen_id": INT,
               "chosen_token": TEXT, "chosen_bytes": HEX, "chosen_prob": PROBABILITY, "top": LIST, "ms": NUMBER,
               "answer": TEXT}
STEP_SETTINGS = {SCHEMA: SAMPLING_FIELDS, TRACE_V1: None}  # a step's own settings, by schema
CHECK_FIELD = "max_abs_logit_diff"  # a step's, when the run was checked (--check): a NUMBER
TOP_FIELDS = {"id": INT, "token": TEXT, "bytes": HEX, "prob": PROBABILITY}
PHASES = ("prefill", "decode")
STOP_REASONS = (None, "eos", "max_new_tokens", "stop_string", "context_full", "cancelled", "memory_budget")
OUTPUT_FIELDS = {"ids": INTS, "text": TEXT, "stop_reason": (TEXT, None)}
# speculate --json: the run's model, settings and prompt, then one entry a round
SPEC_FIELDS = {"recorded_at": TEXT, "draft": TEXT, "gamma": POSITIVE}
SPEC_MODEL_FIELDS = {"name": TEXT, "n_layers": POSITIVE, "dtype": TEXT, "device": TEXT}
SPEC_SETTINGS_FIELDS = SAMPLING_FIELDS | {"max_new_tokens": POSITIVE}
SPEC_PROMPT_FIELDS = {"ids": INTS, "tokens": TEXTS, "bytes": HEXES, "unknown": LIST}
ROUND_FIELDS = {"index": INT, "gamma": INT, "settings": TABLE, "proposed": LIST, "next_id": (INT, None),
                "next_token": (TEXT, None), "next_bytes": (HEX, None), "next_kind": TEXT, "new_ids": INTS,
                "residual": LIST, "target_cache_len_before": INT, "target_cache_len_checked": INT,
                "target_cache_len": INT, "draft_cache_len_before": (INT, None), "draft_cache_len_proposed": (INT, None),
                "draft_cache_len": (INT, None), "draft_passes": INT, "draft_ms": NUMBER, "target_ms": NUMBER,
                "ms": NUMBER, "answer": TEXT}
PROPOSED_FIELDS = {"id": INT, "token": TEXT, "bytes": HEX, "q": PROBABILITY, "p": PROBABILITY,
                   "r": (PROBABILITY, None), "accepted": (BOOL, None)}
RESIDUAL_FIELDS = {"id": INT, "token": TEXT, "bytes": HEX, "p": PROBABILITY, "q": PROBABILITY,
                   "residual": PROBABILITY}
NEXT_KINDS = ("bonus", "resampled", "corrected", "target", "eos")  # model/speculative/decoding.py Round.next_kind
# which of a round's fields are null together: the target's own token (none after an accepted end of sequence),
# the draft's cache lengths (none for prompt lookup)
NULL_TOGETHER = (("next_id", "next_token", "next_bytes"),
                 ("draft_cache_len_before", "draft_cache_len_proposed", "draft_cache_len"))


_HEX_BYTES = {f"{b:02x}" for b in range(256)}


def _whole(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= MOST


def _real(value, low: float, high: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high


def _text(value) -> bool:
    """A str the page can send: JSON's \\ud800 escapes read as lone surrogates, which UTF-8 cannot write."""
    return isinstance(value, str) and not any("\ud800" <= c <= "\udfff" for c in value)


def _hex(value) -> bool:  # a token's bytes, as "e1 bb 9b"
    return isinstance(value, str) and all(len(b) == 2 and b in _HEX_BYTES for b in value.split())


TESTS = {
    INT: lambda v: _whole(v, 0), POSITIVE: lambda v: _whole(v, 1), NUMBER: lambda v: _real(v, 0, MOST),
    PROBABILITY: lambda v: _real(v, 0, 1), TOP_P: lambda v: _real(v, 0, 1) and v > 0, TEXT: _text, HEX: _hex,
    INTS: lambda v: isinstance(v, list) and all(_whole(x, 0) for x in v),
    NONEMPTY_INTS: lambda v: isinstance(v, list) and bool(v) and all(_whole(x, 0) for x in v),
    TEXTS: lambda v: isinstance(v, list) and all(_text(x) for x in v),
    HEXES: lambda v: isinstance(v, list) and all(_hex(x) for x in v),
    TABLE: lambda v: isinstance(v, dict), LIST: lambda v: isinstance(v, list), BOOL: lambda v: isinstance(v, bool),
}


def _is(value, kind) -> bool:
    if isinstance(kind, tuple):
        return any(_is(value, k) for k in kind)
    return value is None if kind is None else TESTS[kind](value)


def _wrong(field: str, kind) -> InputError:
    if isinstance(kind, tuple):
        return InputError("recording_wrong_type_or_null", field=field, kind_text="replay.kind_" + kind[0])
    return InputError("recording_wrong_type", field=field, kind_text="replay.kind_" + kind)


def _check_fields(table, fields: dict, where: str) -> None:
    if not isinstance(table, dict):
        raise _wrong(where, TABLE)
    for name, kind in fields.items():
        field = f"{where}.{name}" if where else name
        if name not in table:
            raise InputError("recording_missing", field=field)
        if not _is(table[name], kind):
            raise _wrong(field, kind)


def _check_rows(rows: list, fields: dict, where: str) -> None:
    for index, row in enumerate(rows):
        _check_fields(row, fields, f"{where}[{index}]")


def check_ids(ids: dict[str, int], vocab_size: int, model: str) -> None:
    """Every id (by the field that holds it) inside the model's vocabulary; InputError names the first outside."""
    for field, token_id in ids.items():
        if token_id >= vocab_size:
            raise InputError("recording_token_id", field=field, model=model)


def _listed(ids: list[int], field: str) -> dict[str, int]:
    return {f"{field}[{index}]": token_id for index, token_id in enumerate(ids)}


def _disagrees(field: str, other: str) -> InputError:
    return InputError("recording_disagrees", field=field, other=other)


def _big_int(digits: str) -> int | float:
    """json.loads' reading of a whole number; one too long to be any field's reads as infinity (Python refuses to
    read one of more than 4,300 digits with a ValueError)."""
    return int(digits) if len(digits.lstrip("-")) <= LONGEST_INT else math.inf


def _safe(value) -> str:
    """A value of the file quoted in a sentence: UTF-8 writes '?' for a lone surrogate instead of failing."""
    return str(value)[:60].encode("utf-8", "replace").decode("utf-8")


def read_recording(data: bytes) -> dict:
    """The run a file holds, checked field by field, type and range, so that nothing the page or a re-run does
    with it can fail; InputError says in one sentence which field is wrong, or what the file is instead.
    recording_kind says which run it is: a Decode run's steps or a speculative run's rounds."""
    if len(data) > MAX_RECORDING_BYTES:
        raise InputError("recording_too_large", kb=len(data) // 1024, most=MAX_RECORDING_BYTES // 1024)
    try:
        run = json.loads(data.decode("utf-8"), parse_int=_big_int)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InputError("recording_not_json") from None
    except RecursionError:
        raise InputError("recording_too_deep") from None
    if not isinstance(run, dict):
        raise InputError("recording_not_a_run")
    if "schema" not in run:
        for schema, entries in ((SCHEMA, "steps"), (SPECULATE_SCHEMA, "rounds")):
            if {"model", entries, "output"} <= run.keys():
                raise InputError("recording_no_schema", expected=schema)
        raise InputError("recording_not_a_run")
    if not isinstance(run["schema"], str) or run["schema"] not in KINDS:
        found = _safe(run["schema"])
        family = [s for s in KINDS if s.split("/")[0] == found.split("/")[0]]  # the versions this one reads
        raise InputError("recording_other_schema", found=found,
                         expected=", ".join(f"“{s}”" for s in family or KINDS))
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
    """The steps or rounds, each at its place; the prompt's lists as long as its ids; a stop reason this reads."""
    if entries not in run:
        raise InputError("recording_missing", field=entries)
    if not isinstance(run[entries], list) or not run[entries]:
        raise InputError("recording_wrong_type", field=entries, kind_text="replay.kind_" + entries)
    for index, entry in enumerate(run[entries]):
        if isinstance(entry, dict) and entry.get("index", index) != index:
            raise InputError("recording_index", field=f"{entries}[{index}].index", index=index)
    if run["output"]["stop_reason"] not in STOP_REASONS:
        raise InputError("recording_wrong_type", field="output.stop_reason", kind_text="replay.kind_stop")
    for listed in ("tokens", "bytes"):
        if len(run["prompt"][listed]) != len(run["prompt"]["ids"]):
            raise _disagrees(f"prompt.{listed}", "prompt.ids")
    return run[entries]


def _check_steps(run: dict) -> None:
    _check_fields(run, {"recorded_at": TEXT}, "")
    _check_parts(run, (("model", MODEL_FIELDS), ("prompt", PROMPT_FIELDS), ("settings", SETTINGS_FIELDS),
                       ("output", OUTPUT_FIELDS)))
    m = run["model"]
    if len(set(m["sliding_layers"])) != len(m["sliding_layers"]) or any(
            layer >= m["n_layers"] for layer in m["sliding_layers"]):
        raise _disagrees("model.sliding_layers", "model.n_layers")
    vocab = m["vocab_size"], m["name"]
    check_ids(_listed(run["prompt"]["ids"], "prompt.ids"), *vocab)
    own_settings = STEP_SETTINGS[run["schema"]]
    for index, step in enumerate(_check_entries(run, "steps")):
        where = f"steps[{index}]"
        _check_fields(step, STEP_FIELDS | ({"settings": TABLE} if own_settings else {}), where)
        if own_settings:
            _check_fields(step["settings"], own_settings, where + ".settings")
        if CHECK_FIELD in step and not _is(step[CHECK_FIELD], NUMBER):
            raise _wrong(f"{where}.{CHECK_FIELD}", NUMBER)
        if step["phase"] not in PHASES:
            raise InputError("recording_wrong_type", field=where + ".phase", kind_text="replay.kind_phase")
        if len(step["positions"]) != len(step["input_ids"]):
            raise _disagrees(where + ".positions", where + ".input_ids")
        _check_rows(step["top"], TOP_FIELDS, where + ".top")
        check_ids(_listed(step["input_ids"], where + ".input_ids") | {where + ".chosen_id": step["chosen_id"]}
                  | {f"{where}.top[{rank}].id": row["id"] for rank, row in enumerate(step["top"])}, *vocab)
    if [s["chosen_id"] for s in run["steps"]] != run["output"]["ids"]:
        raise _disagrees("output.ids", "steps[*].chosen_id")


def _check_rounds(run: dict) -> None:
    _check_fields(run, SPEC_FIELDS, "")
    _check_parts(run, (("model", SPEC_MODEL_FIELDS), ("prompt", SPEC_PROMPT_FIELDS),
                       ("settings", SPEC_SETTINGS_FIELDS), ("output", OUTPUT_FIELDS)))
    produced = []
    for index, r in enumerate(_check_entries(run, "rounds")):
        where = f"rounds[{index}]"
        _check_fields(r, ROUND_FIELDS, where)
        _check_fields(r["settings"], SAMPLING_FIELDS, where + ".settings")
        if r["next_kind"] not in NEXT_KINDS:
            raise InputError("recording_wrong_type", field=where + ".next_kind", kind_text="replay.kind_next_kind")
        _check_rows(r["proposed"], PROPOSED_FIELDS, where + ".proposed")
        _check_rows(r["residual"], RESIDUAL_FIELDS, where + ".residual")
        for together in NULL_TOGETHER:
            if len({r[name] is None for name in together}) > 1:
                raise _disagrees(f"{where}.{together[1]}", f"{where}.{together[0]}")
        if (r["next_id"] is None) != (r["next_kind"] == "eos"):
            raise _disagrees(where + ".next_kind", where + ".next_id")
        if r["gamma"] > run["gamma"]:
            raise _disagrees(where + ".gamma", "gamma")
        if len(r["proposed"]) > r["gamma"]:
            raise _disagrees(where + ".proposed", where + ".gamma")
        kept = [c["id"] for c in r["proposed"] if c["accepted"]] + ([] if r["next_id"] is None else [r["next_id"]])
        if kept != r["new_ids"]:
            raise _disagrees(where + ".new_ids", where + ".proposed, next_id")
        produced += r["new_ids"]
    if produced != run["output"]["ids"]:
        raise _disagrees("output.ids", "rounds[*].new_ids")


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
    """Run the recorded prompt ids again, each step with the sampling settings it was drawn with (step_settings),
    and compare each step with the recording: the chosen token, every recorded probability (within
    PROB_TOLERANCE), the cache's length and bytes, then where the run stopped. A speculative recording is compared
    round by round (rerun_rounds). InputError: a prompt id outside the model's vocabulary, or a request the model
    cannot run (a prompt too long for its context...)."""
    check_ids(_listed(run["prompt"]["ids"], "prompt.ids"), model.info.vocab_size, model.info.name)
    if recording_kind(run) == SPECULATIVE:
        return rerun_rounds(model, run)
    from model.engine.generate import start, step

    drawn_with, s = step_settings(run), run["settings"]
    gen = start(model, run["prompt"]["ids"], drawn_with[0], s["max_new_tokens"], tuple(s["stop"]))
    for settings in drawn_with[1:]:
        gen.settings = settings  # the Decode page applies a change of the controls from the step on view
        if step(model, gen) is None:
            break
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
    if difference is None:
        difference = _length_difference(len(run["steps"]), run["output"]["stop_reason"], len(now), gen.stop_reason)
    return Rerun(compared, worst, difference, model.info.device, model.info.dtype)


def _length_difference(recorded: int, stopped: str | None, now: int, stopped_now: str | None) -> Difference | None:
    """Fewer steps (rounds) again, or a run that stopped where the recording went on. A recording saved mid-run
    (stop None) or whose run was interrupted (cancelled, the Decode page's Stop) goes on from there."""
    stopped = None if stopped == "cancelled" else stopped
    if (now, stopped_now) == (recorded, stopped):
        return None
    return Difference(min(now, recorded), "length", f"{recorded} ({stopped})", f"{now} ({stopped_now})")


def step_settings(run: dict) -> list:
    """Each step's SamplingSettings: its own (trace/2); a trace/1 file kept only the run's last ones, so those for
    every step (a step drawn before a change of the controls on the Decode page then re-runs differently)."""
    if STEP_SETTINGS[run["schema"]] is None:
        return [_sampling(run["settings"])] * len(run["steps"])
    return [_sampling(step["settings"]) for step in run["steps"]]


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
    if difference is None:
        difference = _length_difference(len(recorded), run["output"]["stop_reason"], len(now), live.stop_reason)
    return Rerun(compared, worst, difference, model.info.device, model.info.dtype)


