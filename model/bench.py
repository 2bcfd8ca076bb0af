"""Time per output token, with and without the KV cache, and the engine against transformers.

Timings synchronise the device and drop a warm-up step. Ratios are measured side by side in one run,
because these machines are shared and noisy: compare the ratios, not absolute numbers across runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from model.runtime import LoadedModel, synchronize

DEFAULT_CONTEXTS = (8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class TokenTiming:
    context: int            # positions before the new token
    cached_ms: list[float]  # one decode step over a cache of `context` positions
    recompute_ms: list[float]  # the whole sequence of context + 1 positions, no cache

    @staticmethod
    def p(values: list[float], q: int) -> float:
        return float(np.percentile(values, q))


def timed(device: torch.device, fn: Callable[[], object], repeats: int) -> list[float]:
    """Milliseconds of each call after one dropped warm-up call."""
    times = []
    for i in range(repeats + 1):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        if i:
            times.append((time.perf_counter() - t0) * 1000)
    return times


def filler_ids(model: LoadedModel, n: int, seed: int = 0) -> list[int]:
    """A reproducible sequence of ordinary (non-special) ids to time with."""
    rng = np.random.default_rng(seed)
    low = 4 if model.info.backend == "native" else 0
    return rng.integers(low, model.info.vocab_size, size=n).tolist()


def contexts_for(model: LoadedModel, limit: int = 4) -> list[int]:
    fits = [c for c in DEFAULT_CONTEXTS if c < model.info.context_length]
    return fits[-limit:] if fits else [model.info.context_length - 1]


def time_per_token(model: LoadedModel, contexts: list[int], repeats: int = 10,
                   progress: Callable[[float], None] | None = None) -> list[TokenTiming]:
    """For each context length L: one decode step over an L-position cache (cropped back to L after each
    step, so every repeat sees the same length) against recomputing all L + 1 positions."""
    rows = []
    for done, context in enumerate(contexts):
        ids = filler_ids(model, context + 1)
        cache = model.new_cache()
        with torch.inference_mode():
            model.forward(ids[:context], cache, output_attentions=False)

            def cached_step():
                model.forward(ids[context:], cache, output_attentions=False)
                cache.crop(context)

            cached = timed(model.device, cached_step, repeats)
            recomputed = timed(model.device, lambda: model.forward(ids, None, output_attentions=False), repeats)
        rows.append(TokenTiming(context, cached, recomputed))
        if progress:
            progress((done + 1) / len(contexts))
    return rows
