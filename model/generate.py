"""The decode loop as small named steps over a Generation, the state one session owns.

start (prefill + sample) -> step (decode the last choice + sample) ... until a stop condition;
back crops the cache to the previous step; resample re-draws the last step from its stored logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from model.counting import positions_with_cache, positions_without_cache
from model.errors import InputError
from model.runtime import LoadedModel
from model.sampling import SampleResult, SamplingSettings, check_settings, sample
from model.steps import StepTrace, decode, max_abs_logit_diff, prefill, recompute
from model.tokenizer import Encoded, UnknownWordsError


@dataclass
class Generation:
    prompt_ids: list[int]
    cache: object                 # the backend's KV cache, owned by this generation only
    settings: SamplingSettings
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    steps: list[StepTrace] = field(default_factory=list)
    samples: list[SampleResult] = field(default_factory=list)  # samples[i] was drawn from steps[i].logits
    stop_reason: str | None = None
    checks: dict[int, float] = field(default_factory=dict)  # step index -> max |Δlogit| against a recompute

    @property
    def new_ids(self) -> list[int]:
        return [s.chosen_id for s in self.samples]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.new_ids

    @property
    def positions_with_cache(self) -> int:
        return positions_with_cache(len(self.prompt_ids), len(self.samples))

    @property
    def positions_without_cache(self) -> int:
        return positions_without_cache(len(self.prompt_ids), len(self.samples))


def encode_prompt(model: LoadedModel, text: str) -> Encoded:
    if not text.strip():
        raise InputError("empty_prompt")
    try:
        return model.tokenizer.encode(text)
    except UnknownWordsError as unknown:
        raise InputError("unknown_words", words=", ".join(unknown.words)) from None


def parse_prompt_ids(model: LoadedModel, text: str) -> list[int]:
    """"1, 3" -> [1, 3], every id inside the vocabulary."""
    last = model.info.vocab_size - 1
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise InputError("bad_prompt_ids", ids=text, last=last) from None
    if not ids or not all(0 <= i <= last for i in ids):
        raise InputError("bad_prompt_ids", ids=text, last=last)
    return ids


def context_room(model: LoadedModel, prompt_len: int) -> int:
    """How many new tokens fit: the last one is never fed back, so it needs no position."""
    return model.info.context_length - prompt_len + 1


def check_request(model: LoadedModel, prompt_ids: list[int], settings: SamplingSettings, max_new_tokens: int):
    """Raise InputError for anything the model cannot run, before touching any state."""
    context = model.info.context_length
    if len(prompt_ids) == 0 or prompt_ids == [model.tokenizer.bos_id]:
        raise InputError("empty_prompt")
    if len(prompt_ids) >= context:
        raise InputError("prompt_too_long", n=len(prompt_ids), context=context)
    try:
        check_settings(settings)
    except ValueError as bad:
        raise InputError("bad_" + str(bad)) from None
    room = context_room(model, len(prompt_ids))
    if not 1 <= max_new_tokens <= room:
        raise InputError("max_new_tokens", value=max_new_tokens, room=room)


def find_stop(model: LoadedModel, gen: Generation) -> str | None:
    last = gen.samples[-1].chosen_id
    if last == model.info.eos_id:
        return "eos"
    if gen.stop_strings:
        answer = model.tokenizer.decode(gen.new_ids)
        if any(s and s in answer for s in gen.stop_strings):
            return "stop_string"
    # checked before the token limit: asking for every token that fits reaches both at once
    if gen.cache.length >= model.info.context_length:
        return "context_full"  # no position left to feed the token just chosen
    if len(gen.samples) >= gen.max_new_tokens:
        return "max_new_tokens"
    return None


def _draw(model: LoadedModel, gen: Generation) -> None:
    step_index = len(gen.samples)
    gen.samples.append(sample(gen.steps[step_index].logits, gen.settings, step_index))
    gen.stop_reason = find_stop(model, gen)


def start(model: LoadedModel, prompt_ids: list[int], settings: SamplingSettings, max_new_tokens: int,
          stop_strings: tuple[str, ...] = ()) -> Generation:
    check_request(model, prompt_ids, settings, max_new_tokens)
    gen = Generation(list(prompt_ids), model.new_cache(), settings, max_new_tokens, stop_strings)
    gen.steps.append(prefill(model, gen.cache, gen.prompt_ids))
    _draw(model, gen)
    return gen


def step(model: LoadedModel, gen: Generation) -> StepTrace | None:
    """Feed the last chosen token and draw the next one; None once a stop condition holds.
    A cancelled run is only paused: the next step goes on from where it stopped."""
    if gen.stop_reason not in (None, "cancelled"):
        return None
    trace = decode(model, gen.cache, gen.samples[-1].chosen_id)
    gen.steps.append(trace)
    _draw(model, gen)
    return trace


def back(model: LoadedModel, gen: Generation) -> bool:
    """Undo the last decode step: crop the cache to where it was before it. False at the prefill."""
    if len(gen.steps) < 2:
        return False
    gen.checks.pop(len(gen.steps) - 1, None)
    gen.steps.pop()
    gen.samples.pop()
    gen.cache.crop(gen.steps[-1].cache_len)
    gen.stop_reason = find_stop(model, gen)
    return True


def resample(model: LoadedModel, gen: Generation, settings: SamplingSettings) -> None:
    """New sampling settings apply from the current step on: redraw it from its stored logits."""
    try:
        check_settings(settings)
    except ValueError as bad:
        raise InputError("bad_" + str(bad)) from None
    gen.settings = settings
    index = len(gen.steps) - 1
    gen.samples[index] = sample(gen.steps[index].logits, settings, index)  # replaced in one assignment
    gen.stop_reason = find_stop(model, gen)


def check_last_step(model: LoadedModel, gen: Generation) -> float:
    """max |Δlogit| between the last step's cached logits and recomputing its whole sequence without a cache.
    Done once per step: the page redraws often (sliders, selectors), the answer does not change."""
    index = len(gen.steps) - 1
    if index not in gen.checks:
        trace = gen.steps[index]
        gen.checks[index] = max_abs_logit_diff(trace, recompute(model, gen.ids[: trace.cache_len]))
    return gen.checks[index]


def run_to_end(model: LoadedModel, gen: Generation, cancelled: Callable[[], bool] = lambda: False) -> None:
    while gen.stop_reason is None:
        if cancelled():
            gen.stop_reason = "cancelled"
            return
        step(model, gen)


def attention_history(gen: Generation, layer: int, head: int) -> np.ndarray:
    """(S, S) lower triangle for one layer and head: the prompt's rows from prefill, then one row per
    decode step, so the triangle grows by a row each time the cache grows by a position."""
    size = gen.steps[-1].cache_len
    history = np.zeros((size, size), dtype=np.float32)
    for trace in gen.steps:
        first = trace.positions[0]
        rows = trace.attention[layer, head]  # (queries, keys)
        history[first:first + rows.shape[0], : rows.shape[1]] = rows
    return history
