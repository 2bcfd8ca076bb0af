"""The decode loop as small named steps over a Generation, the state one session owns.

start (prefill + draw) -> step (decode the last choice + draw) ... until a stop condition;
back crops the cache to the previous step; resample re-draws the last step from its stored logits.

A session keeps, per step, the new position's attention over the cache (float16; the prefill's as its lower
triangle) and a Draw (a few numbers and the 20 most probable ids); the vocabulary-sized logits only for the prefill
and the latest steps (Back restores an older step's logits and attention by running that step again on the cropped
cache). Past the session's memory budget, decode steps older than the latest LOGITS_KEPT first keep only the rows of
the layer and head on view (Generation.view), oldest first, then lose their rows altogether, oldest first; the
budget counts Generation.memory_bytes (kept arrays and KV cache buffers).
"""

from __future__ import annotations

import contextlib
import copy
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Executor, Future
from dataclasses import dataclass, field

import numpy as np

from model.engine.cache import Cache
from model.engine.counting import positions_with_cache, positions_without_cache
from model.engine.runtime import LoadedModel
from model.engine.sampling import Draw, SamplingSettings, check_settings_or_refuse, draw
from model.engine.steps import StepTrace, decode, max_abs_logit_diff, prefill, recompute, rewind
from model.engine.stopping import stop_reason
from model.engine.tokenizer import Encoded, UnknownWordsError
from model.errors import InputError
from model.weights.catalog import env_megabytes

MAX_PROMPT_CHARS = 2000
DEFAULT_NEW_TOKENS = 20  # the command line's default answer length
CHECK_TOLERANCE = 1e-4  # the largest |Δlogit| between a cached step and its recompute that counts as the same
# the current step's logits (resample) and the one before (Back without a re-run); the prefill's are kept as well,
# since getting them back means running the whole prompt again, while any other step's logits cost one decode step
LOGITS_KEPT = 2
DEFAULT_SESSION_MB = 256  # a 500-token SmolLM2 prompt alone keeps 135 MB of prefill attention
PROMPT_IDS = re.compile(r"\s*[0-9]+(\s*,\s*[0-9]+)*\s*")  # plain ASCII integers separated by single commas


def session_budget_bytes() -> int:
    """DECODE_LAB_SESSION_MB: the most one session's run may keep (attention, logits, draws), in MiB."""
    return env_megabytes("DECODE_LAB_SESSION_MB", DEFAULT_SESSION_MB)


@dataclass
class Generation:
    prompt_ids: list[int]
    cache: Cache                  # the backend's KV cache, owned by this generation only
    settings: SamplingSettings
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    budget_bytes: int = field(default_factory=session_budget_bytes)
    steps: list[StepTrace] = field(default_factory=list)
    samples: list[Draw] = field(default_factory=list)  # samples[i] was drawn from steps[i]'s logits
    stop_reason: str | None = None
    checks: dict[int, RecomputeCheck] = field(default_factory=dict)  # step index -> its check
    # step index -> (the step, its check running in the background)
    pending_checks: dict[int, tuple[StepTrace, Future]] = field(default_factory=dict)
    view: tuple[int, int] = (0, 0)  # the (layer, head) whose rows old steps keep when the budget is reached
    stepped_at: float = field(default_factory=time.monotonic)  # when the latest step became the run's latest

    @property
    def new_ids(self) -> list[int]:
        return [s.chosen_id for s in self.samples]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.new_ids

    @property
    def finished(self) -> bool:
        """A stop condition holds. A cancelled run is only paused: Next goes on from where it stopped."""
        return self.stop_reason not in (None, "cancelled")

    @property
    def positions_with_cache(self) -> int:
        return positions_with_cache(len(self.prompt_ids), len(self.samples))

    @property
    def positions_without_cache(self) -> int:
        return positions_without_cache(len(self.prompt_ids), len(self.samples))

    @property
    def attention_dropped(self) -> int:
        """Decode steps whose attention rows left, for every layer and head, to fit the budget."""
        return sum(trace.attention is None for trace in self.steps[1:])

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays the run keeps besides its KV cache: traces (attention, logits) and draws."""
        return sum(s.nbytes for s in self.steps) + sum(d.nbytes for d in self.samples)

    @property
    def memory_bytes(self) -> int:
        """What the session's budget counts: the kept arrays and the KV cache's buffers."""
        return self.nbytes + self.cache.nbytes_reserved()


def check_prompt_text(text: str, operator: bool = False) -> str:
    """A prompt with a word in it, and on a page at most MAX_PROMPT_CHARS characters (a page's box protects the
    server its users share); operator: the command line, whose one limit is the model's context (check_request)."""
    if not text.strip():
        raise InputError("empty_prompt")
    if not operator and len(text) > MAX_PROMPT_CHARS:
        raise InputError("prompt_too_many_chars", n=len(text), most=MAX_PROMPT_CHARS)
    return text


def encode_prompt(model: LoadedModel, text: str, operator: bool = False) -> Encoded:
    check_prompt_text(text, operator)
    try:
        return model.tokenizer.encode(text)
    except UnknownWordsError as unknown:
        raise InputError("unknown_words", words=", ".join(unknown.words)) from None


def parse_prompt_ids(model: LoadedModel, text: str) -> list[int]:
    """"1, 3" -> [1, 3]: plain integers separated by commas, every id inside the vocabulary."""
    last = model.info.vocab_size - 1
    if not PROMPT_IDS.fullmatch(text):
        raise InputError("bad_prompt_ids", ids=text, last=last)
    ids = [int(part) for part in text.split(",")]
    if not all(0 <= i <= last for i in ids):
        raise InputError("bad_prompt_ids", ids=text, last=last)
    return ids


def context_room(model: LoadedModel, prompt_len: int) -> int:
    """How many new tokens fit: the last one is never fed back, so it needs no position."""
    return model.info.context_length - prompt_len + 1


def check_request(model: LoadedModel, prompt_ids: list[int], settings: SamplingSettings, max_new_tokens: int):
    """Raise InputError for anything the model cannot run, before touching any state."""
    context = model.info.context_length
    if len(prompt_ids) == 0:
        raise InputError("empty_prompt")
    if prompt_ids == [model.tokenizer.bos_id]:
        raise InputError("only_start_token", token=model.tokenizer.token(prompt_ids[0]))
    if len(prompt_ids) >= context:
        raise InputError("prompt_too_long", n=len(prompt_ids), context=context)
    check_settings_or_refuse(settings)
    room = context_room(model, len(prompt_ids))
    if not 1 <= max_new_tokens <= room:
        raise InputError("max_new_tokens", value=max_new_tokens, room=room)


def find_stop(model: LoadedModel, gen: Generation) -> str | None:
    def stop_string_seen() -> bool:
        answer = model.tokenizer.decode(gen.new_ids) if gen.stop_strings else ""
        return any(s and s in answer for s in gen.stop_strings)

    return stop_reason(gen.samples[-1].chosen_id, model.info.eos_id, gen.cache.length, model.info.context_length,
                       len(gen.samples), gen.max_new_tokens, stop_string_seen)


def _keep_within_budget(gen: Generation) -> None:
    """Old decode steps' logits go first (Back can recompute them); then, oldest first, the steps before the latest
    LOGITS_KEPT keep only the rows of the layer and head on view; then, oldest first, they lose their rows. When the
    rest (the prefill's attention, the latest steps, the KV cache) is still over the budget, the run stops."""
    old = gen.steps[1:-LOGITS_KEPT]
    for trace in old:
        trace.logits = None
    over = gen.memory_bytes - gen.budget_bytes
    for trace in old:
        if over <= 0:
            break
        if trace.keeps_every_head:
            over -= trace.keep_only(*gen.view)
    for trace in old:
        if over <= 0:
            break
        if trace.attention is not None:
            over -= trace.attention.nbytes
            trace.attention, trace.attention_view = None, None
    if over > 0:
        gen.stop_reason = "memory_budget"


def _draw(model: LoadedModel, gen: Generation) -> None:
    step_index = len(gen.samples)
    gen.samples.append(draw(gen.steps[step_index].logits, gen.settings, step_index))
    gen.stop_reason = find_stop(model, gen)
    _keep_within_budget(gen)


def start(model: LoadedModel, prompt_ids: list[int], settings: SamplingSettings, max_new_tokens: int,
          stop_strings: tuple[str, ...] = (), budget_bytes: int | None = None) -> Generation:
    check_request(model, prompt_ids, settings, max_new_tokens)
    gen = Generation(list(prompt_ids), model.new_cache(), settings, max_new_tokens, stop_strings)
    if budget_bytes is not None:
        gen.budget_bytes = budget_bytes
    gen.steps.append(prefill(model, gen.cache, gen.prompt_ids))
    _draw(model, gen)
    return gen


def step(model: LoadedModel, gen: Generation) -> StepTrace | None:
    """Feed the last chosen token and draw the next one; None once a stop condition holds."""
    if gen.finished:
        return None
    trace = decode(model, gen.cache, gen.samples[-1].chosen_id)
    gen.steps.append(trace)
    _draw(model, gen)
    gen.stepped_at = time.monotonic()
    return trace


def _restore_step(model: LoadedModel, gen: Generation) -> None:
    """Run the last step again on its cropped cache: the logits and attention it had, without keeping them all
    along."""
    trace = gen.steps[-1]
    rewind(model, gen.cache, gen.ids, trace.positions[0])
    again = (prefill(model, gen.cache, trace.input_ids) if trace.phase == "prefill"
             else decode(model, gen.cache, trace.input_ids[0]))
    trace.logits, trace.attention, trace.attention_view = again.logits, again.attention, None


def back(model: LoadedModel, gen: Generation) -> bool:
    """Undo the last decode step: crop the cache to where it was before it. False at the prefill."""
    if len(gen.steps) < 2:
        return False
    gen.checks.pop(len(gen.steps) - 1, None)
    gen.steps.pop()
    gen.samples.pop()
    rewind(model, gen.cache, gen.ids, gen.steps[-1].cache_len)
    if gen.steps[-1].logits is None or not gen.steps[-1].keeps_every_head:
        _restore_step(model, gen)
    gen.stop_reason = find_stop(model, gen)
    gen.stepped_at = time.monotonic()
    return True


def resample(model: LoadedModel, gen: Generation, settings: SamplingSettings) -> None:
    """New sampling settings apply from the current step on: redraw it from its stored logits."""
    check_settings_or_refuse(settings)
    gen.settings = settings
    index = len(gen.steps) - 1
    gen.samples[index] = draw(gen.steps[index].logits, settings, index)  # replaced in one assignment
    gen.stop_reason = find_stop(model, gen)


@dataclass(frozen=True)
class RecomputeCheck:
    """A step's cached logits against recomputing its whole sequence without a cache."""
    max_abs_diff: float  # max |Δlogit| at the last position
    ms: float            # the recompute's own time: the work the cache saved at this step


def _recompute_check(model: LoadedModel, ids: list[int], trace: StepTrace) -> RecomputeCheck:
    start = time.perf_counter()
    logits = recompute(model, ids)
    return RecomputeCheck(max_abs_logit_diff(trace, logits), 1000 * (time.perf_counter() - start))


def check_last_step(model: LoadedModel, gen: Generation) -> RecomputeCheck:
    """Recompute the last step's whole sequence without a cache and compare the logits.
    Done once per step: the page redraws often (sliders, selectors), the answer does not change."""
    index = len(gen.steps) - 1
    if index not in gen.checks:
        trace = gen.steps[index]
        gen.checks[index] = _recompute_check(model, gen.ids[: trace.cache_len], trace)
    return gen.checks[index]


def check_last_step_in_background(model: LoadedModel, gen: Generation, checks: Executor, wait_s: float = 0.0,
                                  defer_s: float = 0.0) -> RecomputeCheck | None:
    """The last step's check if it is done, or done within wait_s; otherwise start it (once) on `checks`, the
    executor the caller runs checks on (the app: one thread for the whole process), and return None. The
    result lands in gen.checks only while that step is still the run's step at that index: a verdict belongs to its
    own step. A check still waiting for its turn when the run moves on is cancelled.
    A slow check (the run's latest took longer than wait_s) is not waited for, and starts only once its step is
    defer_s old: a page first draws the step, and the recompute does not compete with that drawing for the
    interpreter and the cores (on 2 cores it held a SmolLM2 token back by about 30 ms, benchmarks/click_latency.py)."""
    index = len(gen.steps) - 1
    if index in gen.checks:
        return gen.checks[index]
    trace = gen.steps[index]
    for stale, (stepped, future) in list(gen.pending_checks.items()):
        if stepped is not trace and future.cancel():
            del gen.pending_checks[stale]
    latest = gen.checks[max(gen.checks)] if gen.checks else None
    quick = latest is None or latest.ms <= wait_s * 1000
    pending = gen.pending_checks.get(index)
    if pending is None or pending[0] is not trace:
        if not quick and time.monotonic() - gen.stepped_at < defer_s:
            return None
        # the ids and the logits as they are now (a shallow copy keeps them when the run drops old logits)
        ids, as_stepped = gen.ids[: trace.cache_len], copy.copy(trace)
        registered = threading.Event()  # the check removes its own entry: it must be there first

        def check() -> None:
            registered.wait()
            try:
                result = _recompute_check(model, ids, as_stepped)
            except Exception:  # out of memory, say: a verdict of NaN fails, and says so, instead of never coming
                result = RecomputeCheck(float("nan"), 0.0)
            if index < len(gen.steps) and gen.steps[index] is trace:
                gen.checks[index] = result
            if gen.pending_checks.get(index, (None,))[0] is trace:
                del gen.pending_checks[index]

        pending = gen.pending_checks[index] = (trace, checks.submit(check))
        registered.set()
    if quick:
        with contextlib.suppress(TimeoutError, CancelledError):  # a small model's check is done at once: drawn inline
            pending[1].result(timeout=wait_s)
    return gen.checks.get(index)


def run_to_end(model: LoadedModel, gen: Generation, on_step: Callable[[Generation], None] | None = None,
               cancelled: Callable[[], bool] = lambda: False) -> None:
    """Step until a stop condition holds; on_step sees the run after each step (a page redraws its strip)."""
    while not gen.finished:
        if cancelled():
            gen.stop_reason = "cancelled"
            return
        step(model, gen)
        if on_step is not None:
            on_step(gen)


def attention_history(gen: Generation, layer: int, head: int) -> np.ndarray:
    """(S, S) lower triangle for one layer and head: the prompt's rows from prefill, then one row per
    decode step, so the triangle grows by a row each time the cache grows by a position. Rows not kept for this
    layer and head (attention_runs says which) stay zero."""
    size = gen.steps[-1].cache_len
    history = np.zeros((size, size), dtype=np.float32)
    for trace in gen.steps:
        rows = trace.weights(layer, head)  # (queries, keys)
        if rows is not None:
            first = trace.positions[0]
            history[first:first + rows.shape[0], : rows.shape[1]] = rows
    return history


def attention_rows_kept(gen: Generation, layer: int, head: int) -> np.ndarray:
    """(S,) bool: which of attention_history's rows the run keeps for this layer and head."""
    kept = np.zeros(gen.steps[-1].cache_len, dtype=bool)
    for trace in gen.steps:
        if trace.keeps(layer, head):
            kept[trace.positions[0]:trace.positions[-1] + 1] = True
    return kept


@dataclass(frozen=True)
class AttentionRun:
    """Consecutive decode steps whose attention rows are kept alike."""
    first: int  # step indices, both included
    last: int
    kept: str  # "every" (every layer and head), "one" (only `view`'s layer and head), "none"
    view: tuple[int, int] | None = None


def attention_runs(gen: Generation) -> list[AttentionRun]:
    """The decode steps in order, grouped by what of their attention the run still keeps."""
    runs: list[AttentionRun] = []
    for index, trace in enumerate(gen.steps[1:], start=1):
        kept = "none" if trace.attention is None else "every" if trace.attention_view is None else "one"
        view = trace.attention_view if kept == "one" else None
        if runs and runs[-1].kept == kept and runs[-1].view == view and runs[-1].last == index - 1:
            runs[-1] = AttentionRun(runs[-1].first, index, kept, view)
        else:
            runs.append(AttentionRun(index, index, kept, view))
    return runs
