"""The Serving page's run: its queue of requests, the lengths its sliders offer, an estimate of its steps' time
before it starts, and the engine that runs it (the padded memory: a slot per request; each prompt's pass alone)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from model.engine.generate import session_budget_bytes
from model.engine.runtime import NativeModel
from model.engine.sampling import SamplingSettings, check_settings_or_refuse
from model.errors import InputError
from model.serving.engine import Engine, EngineSettings, longest_held
from model.serving.measure import GREEDY, decode_work, prefill_work
from model.serving.memory import MAX_SLOTS, padded_bytes
from model.serving.request import Request
from model.serving.timing import filler_ids


def queue_lengths(requests: int, prompt_lengths: tuple[int, int], new_tokens: tuple[int, int],
                  seed: int = 0) -> tuple[list[int], list[int]]:
    """Each request's prompt length and token budget, drawn (seeded) from the two ranges."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt_lengths[0], prompt_lengths[1] + 1, size=requests).tolist()
    budgets = rng.integers(new_tokens[0], new_tokens[1] + 1, size=requests).tolist()
    return lengths, budgets

def queue(model: NativeModel, requests: int, prompt_lengths: tuple[int, int], new_tokens: tuple[int, int],
          seed: int = 0, settings: SamplingSettings = GREEDY) -> list[Request]:
    """`requests` requests of filler ids, each with its own prompt length and token budget (queue_lengths), so that
    they finish at different steps and the waiting ones join as slots free; request i draws with `settings` and its
    own seed, settings.seed + i."""
    lengths, budgets = queue_lengths(requests, prompt_lengths, new_tokens, seed)
    return [Request(i, filler_ids(model, n, seed=seed + i), budget,
                    settings=dataclasses.replace(settings, seed=settings.seed + i))
            for i, (n, budget) in enumerate(zip(lengths, budgets))]

def most_lengths(context_length: int) -> tuple[int, int]:
    """The Serving page's longest prompt and most new tokens on a model of `context_length` positions: a prompt of
    up to half the context (256 at most), new tokens up to 64 within what is left, so that any pair fits."""
    prompt = max(1, min(256, context_length // 2))
    return prompt, max(1, min(64, context_length - 1 - prompt))

PROBE_ROWS = 4

@dataclass(frozen=True)
class PassCosts:
    """A model's passes on this machine, timed once each: a prefill of 1 and of PROBE_ROWS positions, a decode step
    of 1 and of PROBE_ROWS rows (ms); a longer pass is told by the straight line through the two (never falling)."""
    prefill_ms: tuple[float, float]
    decode_ms: tuple[float, float]

    @staticmethod
    def _line(ms: tuple[float, float], n: int) -> float:
        one, probe = ms
        return one + max(0.0, probe - one) * (n - 1) / (PROBE_ROWS - 1)

    def prefill(self, positions: int) -> float:
        return self._line(self.prefill_ms, positions)

    def decode(self, rows: int) -> float:
        return self._line(self.decode_ms, rows)

def pass_costs(model: NativeModel) -> PassCosts:
    """PassCosts of `model` in its own weights (each pass timed once after a warm-up)."""
    return PassCosts((prefill_work(model, 1, 1).p50, prefill_work(model, PROBE_ROWS, 1).p50),
                     (decode_work(model, 1, 1, 1).p50, decode_work(model, PROBE_ROWS, 1, 1).p50))

@dataclass(frozen=True)
class StepEstimate:
    prompts: int       # prompts the first step prefills
    positions: int     # their positions together
    first_ms: float    # the first step: those prefills
    rows: int          # the most rows a decode step has
    decode_ms: float   # a decode step of that many rows

def estimate_steps(costs: PassCosts, slots: int, requests: int, prompt_lengths: tuple[int, int],
                   new_tokens: tuple[int, int]) -> StepEstimate:
    """What start_serving's queue would cost by `costs`: its first step prefills the first `slots` prompts; a decode
    step has at most min(slots, requests) rows."""
    first = queue_lengths(requests, prompt_lengths, new_tokens)[0][:slots]
    rows = min(slots, requests)
    return StepEstimate(len(first), sum(first), sum(costs.prefill(n) for n in first), rows, costs.decode(rows))

# the Serving page's controls, as its refusals name them
PAGE_LABELS = {"slots_label_text": "serving.slots", "prompt_label_text": "serving.prompt_lengths",
               "new_label_text": "serving.new_tokens"}

def slot_budget(model: NativeModel, requests: list[Request], slots: int) -> int:
    """The bytes of `slots` padded slots, each of the queue's longest request whole."""
    return padded_bytes(model.info, slots, longest_held(model.info, requests))

def slot_engine(model: NativeModel, requests: list[Request], slots: int) -> Engine:
    """The Serving page's server: the engine over `slots` padded slots, each step's prompts in passes of their own,
    then its decode rows in one pass."""
    return Engine(model, requests, EngineSettings(memory="padded", budget_bytes=slot_budget(model, requests, slots),
                                                  mixed=False))

def start_serving(model: NativeModel, slots: int, requests: int, prompt_lengths: tuple[int, int],
                  new_tokens: tuple[int, int], settings: SamplingSettings = GREEDY) -> Engine:
    """The Serving page's run (slot_engine), refused in the page's own terms (its controls' names)."""
    if requests < 1:
        raise InputError("serving_requests", requests=requests)
    if not 1 <= slots <= MAX_SLOTS:
        raise InputError("serving_slots", slots=slots)
    if prompt_lengths[1] + new_tokens[1] >= model.info.context_length:
        raise InputError("serving_lengths", prompt=prompt_lengths[1], new=new_tokens[1],
                         context=model.info.context_length, **PAGE_LABELS)
    check_settings_or_refuse(settings)
    served = queue(model, requests, prompt_lengths, new_tokens, settings=settings)
    budget = slot_budget(model, served, slots)
    if budget > session_budget_bytes():
        raise InputError("serving_queue_budget", slots=slots, mb=round(budget / 2**20),
                         budget=round(session_budget_bytes() / 2**20), **PAGE_LABELS)
    return slot_engine(model, served, slots)
