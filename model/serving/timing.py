"""Timing on this machine: a synchronised timer, percentiles, filler prompts, the time per token with and without
the cache, and the machine's own roofs (read and copy bandwidth, matmul peak)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from model.engine import kernels
from model.engine.lowbit import PRODUCTS
from model.engine.runtime import LoadedModel, synchronize


def percentile(values: list[float], q: int) -> float:
    return float(np.percentile(values, q))

@dataclass
class TokenTiming:
    context: int            # positions before the new token
    cached_ms: list[float]  # one decode step over a cache of `context` positions
    recompute_ms: list[float]  # the whole sequence of context + 1 positions, no cache

    @property
    def speedup(self) -> float:
        """How many times longer the recompute takes than the cached step, p50 over p50."""
        return percentile(self.recompute_ms, 50) / percentile(self.cached_ms, 50)

def timed(device: torch.device, fn: Callable[[], object], repeats: int,
          between: Callable[[], None] | None = None) -> list[float]:
    """Milliseconds of each call after one dropped warm-up call; `between` runs after each call, untimed (a caller
    that may stop there)."""
    times = []
    for i in range(repeats + 1):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        if i:
            times.append((time.perf_counter() - t0) * 1000)
        if between is not None:
            between()
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
        rows.append(_time_context(model, context, repeats))
        if progress:
            progress((done + 1) / len(contexts))
    return rows

@torch.inference_mode()
def _time_context(model: LoadedModel, context: int, repeats: int) -> TokenTiming:
    ids = filler_ids(model, context + 1)
    cache = model.new_cache()
    model.forward(ids[:context], cache, output_attentions=False)

    def cached_step():
        model.forward(ids[context:], cache, output_attentions=False)
        cache.crop(context)

    cached = timed(model.device, cached_step, repeats)
    recomputed = timed(model.device, lambda: model.forward(ids, None, output_attentions=False), repeats)
    return TokenTiming(context, cached, recomputed)

def read_bandwidth(device: torch.device, megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes per second this machine reads: a sum over a float32 tensor of `megabytes`, the median of `repeats`
    after a warm-up, on torch's threads (as the steps run). On a CPU the tensor is held as the packed weights are
    (kernels.Arena: 2 MiB pages where Linux gives them), so that the roof and a step read the same kind of memory."""
    n = megabytes * 2**20 // 4
    x = kernels.Arena(4 * n).take(n, torch.float32) if device.type == "cpu" else torch.empty(n, device=device)
    x.fill_(1.0)
    ms = percentile(timed(device, x.sum, repeats), 50)
    return x.numel() * 4 / (ms / 1000)

def copy_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second this machine moves: a copy of a float32 tensor of `megabytes` into another, which reads it
    once and writes it once (2 × its bytes), the median of `repeats` after a warm-up, on torch's threads."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    ms = percentile(timed(device, lambda: dst.copy_(src), repeats), 50)
    return 2 * src.numel() * 4 / (ms / 1000)

def matmul_peak(device: torch.device, n: int = 1024, repeats: int = 5, dtype: str = "float32") -> float:
    """Operations per second of an (n × n) · (n × n) matmul in `dtype`, 2n³ operations, the median of `repeats` after
    a warm-up, on torch's threads: the compute roof a step can reach at best. "int8" and "bfloat16-weights" are the
    decode kernels' products those weights run in (model/engine/kernels.py): float32 rows (int8: rounded to int16
    inside) times an (n × n) int8 or bfloat16 weight, over KERNEL_PEAK_ROWS rows."""
    if dtype in KERNEL_PEAKS:
        weight = PRODUCTS[dtype]
        packed = kernels.pack(torch.randn(n, n), weight, kernels.Arena(kernels.packed_nbytes(n, n, weight)))
        x = torch.randn(KERNEL_PEAK_ROWS, n)
        ms = percentile(timed(device, lambda: kernels.matmul(x, packed), repeats), 50)
        return 2 * KERNEL_PEAK_ROWS * n * n / (ms / 1000)
    a, b = (torch.randn(n, n, device=device, dtype=getattr(torch, dtype)) for _ in range(2))
    ms = percentile(timed(device, lambda: a @ b, repeats), 50)
    return 2 * n**3 / (ms / 1000)


DEFAULT_CONTEXTS = (8, 16, 32, 64, 128, 256, 512, 1024)

# the dtypes whose peak is the decode kernels' own product (matmul_peak), and its rows: enough to be bound by its
# arithmetic, not by reading the weight (1,024 would take longer for the same rate)
KERNEL_PEAKS = ("int8", "bfloat16-weights")
KERNEL_PEAK_ROWS = 64
