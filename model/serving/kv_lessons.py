"""The "KV cache in fewer bytes" page's three lessons as plain numbers (model/engine: kv_quant, kv_heads, kv_evict).

1. cache_bytes: one position's cache in each option for a model (its own float, int8 KIVI, fp8 e4m3, the multi-head
   equivalent, MLA's formula at DeepSeek-V2's ratios); cache_quality: perplexity, KL and greedy agreement per cache
   dtype over the held-out text, as `python -m model quality --kv-dtype` measures them.
2. along: the negative log-likelihood by position of one text fed a token a step through the full cache, sinks and
   a window (StreamingLLM), the window alone and H2O's heavy hitters at the same budget, each re-run, not replayed.
3. sink_map: the attention mass each layer and head puts on position 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from model.engine.kernels import cpu_features
from model.engine.kv_evict import HeavyHitterCache, SinkWindowCache, check_window, fed_along, nll_along, sink_mass
from model.engine.kv_heads import cache_formulas, mla_bytes_per_position
from model.engine.kv_quant import bytes_per_position, with_kv_dtype
from model.engine.runtime import NativeModel
from model.serving.quality import (
    CHUNK,
    Quality,
    StepTime,
    decode_step_times,
    held_out,
    measure_quality,
    text_ids,
    windows,
)
from model.serving.timing import percentile

# the papers the page cites, by arXiv number (passed into its sentences, where a number would be read as one)
PAPERS = {"kivi": "2402.02750", "streaming": "2309.17453", "h2o": "2306.14048", "gqa": "2305.13245",
          "mqa": "1911.02150", "mla": "2405.04434"}
QUANTIZED = ("int8", "fp8")
MLA_LATENT_PER_D_HEAD, MLA_ROPE_PER_D_HEAD = 4, 0.5  # DeepSeek-V2: d_c = 4 d_h, d_h^R = d_h / 2
MAX_ALONG = 384       # tokens fed one a step in each run (as `quality --kv-window`), at most the model's context
SMOOTH = 16           # positions the curves' perplexity is averaged over (the NLL of one token is noisy)


@dataclass(frozen=True)
class CacheOption:
    option: str                 # "float" (the model's own), "int8", "fp8", "multi_head", "mla"
    bytes_per_position: float
    formula_only: bool          # MLA: no model here has it


def cache_bytes(model: NativeModel) -> list[CacheOption]:
    """One position's cache bytes per option, the int8 scales counted (kv_quant.bytes_per_position)."""
    info = model.info
    shipped, multi = cache_formulas(model)
    quantized = [CacheOption(d, bytes_per_position(d, info.n_layers, info.n_kv_heads, info.d_head), False)
                 for d in QUANTIZED]
    mla = mla_bytes_per_position(info.n_layers, MLA_LATENT_PER_D_HEAD * info.d_head,
                                 int(MLA_ROPE_PER_D_HEAD * info.d_head), info.bytes_per_element)
    return [CacheOption("float", shipped.bytes_per_position, False), *quantized,
            CacheOption("multi_head", multi.bytes_per_position, False), CacheOption("mla", mla, True)]


@dataclass(frozen=True)
class CacheQuality:
    quality: Quality  # perplexity, KL and greedy agreement per cache dtype (rows in QUANTIZED order after float32)
    steps: StepTime   # one decode step's times per cache dtype, the dtypes' steps taken in turn

    def step_ms(self, kv_dtype: str) -> float:
        return percentile(self.steps.ms[kv_dtype], 50)


def cache_quality(model: NativeModel, progress: Callable[[float], None] | None = None) -> CacheQuality:
    """Perplexity, mean KL to the model's own cache and greedy agreement per cache dtype, on the held-out text of
    the model's language (its file in Quality.text), and the decode step's time with each cache. progress(share
    done) runs between the passes (a caller that may stop there)."""
    text = held_out(model.info.language)
    ids = text_ids(model, text.text, text.name)
    models = {"float32": model} | {d: with_kv_dtype(model, d) for d in QUANTIZED}
    passes = sum(-(-(end - start) // CHUNK) for start, end, _ in windows(len(ids), model.info.context_length))
    quality = measure_quality(models, model.info.name, text.name, ids, text.prompts,
                              counting(progress, len(models) * (passes + 1)))
    steps = decode_step_times(models, ids)
    if progress is not None:  # the passes counted above are about all; the timed steps end it
        progress(1.0)
    return CacheQuality(quality, steps)


def counting(progress: Callable[[float], None] | None, total: int) -> Callable[[], None] | None:
    """A tick() that tells progress the share of `total` ticks done so far."""
    if progress is None:
        return None
    done = [0]

    def tick() -> None:
        done[0] += 1
        progress(min(1.0, done[0] / total))

    return tick


BOUNDED = ("sinks", "window", "heavy_hitters")  # the bounded caches compared with the full one


def default_bound(context_length: int) -> tuple[int, int]:
    """(sinks, window) the pages start from: 4 sinks and up to 60 latest positions, a quarter of the context in all
    at most."""
    return 4, max(1, min(60, context_length // 4 - 4))


def bounded_cache(model: NativeModel, policy: str, sinks: int, window: int):
    """A bounded cache of sinks + window positions a layer: StreamingLLM's sinks and latest ("sinks"), the same
    budget of latest positions alone ("window"), or H2O's heavy hitters and latest ("heavy_hitters")."""
    if policy == "sinks":
        return SinkWindowCache(model, sinks, window)
    if policy == "window":
        return SinkWindowCache(model, 0, sinks + window)
    return HeavyHitterCache(model, sinks, window)


def kept_along(model: NativeModel, ids: list[int], policy: str, sinks: int, window: int) -> list[list[int]]:
    """Per layer, the positions of `ids` a bounded cache (bounded_cache) holds once every one is fed through it: a
    re-run of the tokens with that cache, not a replay of the full cache's attention. Refused as check_window
    refuses (Gemma 3's sliding layers bound themselves)."""
    check_window(model, sinks, window)
    cache = bounded_cache(model, policy, sinks, window)
    for _ in fed_along(model, ids, cache):
        pass
    return [cache.kept(layer) for layer in range(model.info.n_layers)]


@dataclass(frozen=True)
class Along:
    text: str                   # the held-out text's file
    sinks: int
    window: int
    nll: dict[str, np.ndarray]  # policy -> NLL of tokens 1 .. n − 1 ("full", "sinks", "window", "heavy_hitters")
    kept: dict[str, list[list[int]]]  # bounded policy -> per layer, the text positions its cache held at the end

    def perplexity(self, policy: str, smooth: int = SMOOTH) -> np.ndarray:
        """exp of the mean NLL of the `smooth` tokens up to each position (fewer at the start)."""
        nll = self.nll[policy]
        running = np.cumsum(np.concatenate(([0.0], nll)))
        starts = np.maximum(np.arange(1, len(nll) + 1) - smooth, 0)
        return np.exp((running[1:] - running[starts]) / (np.arange(1, len(nll) + 1) - starts))

    def past_bound(self, policy: str) -> float:
        """The perplexity over the tokens past the bound (sinks + window), where the policies differ."""
        tail = self.nll[policy][self.sinks + self.window:]
        return math.exp(float(tail.mean())) if len(tail) else math.nan


def along(model: NativeModel, sinks: int, window: int, progress: Callable[[float], None] | None = None) -> Along:
    """The four runs over the first min(MAX_ALONG, context) tokens of the held-out text (H2O keeps the text's
    positions, so a run never passes the context); check_window refuses a model with sliding layers. progress(share
    done) runs after each token of each run (a caller that may stop there)."""
    check_window(model, sinks, window)
    text = held_out(model.info.language)
    ids = text_ids(model, text.text, text.name)[:min(MAX_ALONG, model.info.context_length)]
    caches = {"full": model.new_cache()} | {policy: bounded_cache(model, policy, sinks, window) for policy in BOUNDED}
    tick = counting(progress, len(caches) * (len(ids) - 1))
    nll = {name: np.array(nll_along(model, ids, cache, tick)) for name, cache in caches.items()}
    kept = {name: [cache.kept(layer) for layer in range(model.info.n_layers)]
            for name, cache in caches.items() if name != "full"}
    return Along(text.name, sinks, window, nll, kept)


@dataclass(frozen=True)
class SinkMap:
    text: str
    tokens: int                 # the text's first tokens read in one pass
    skip: int                   # queries before this position are left out (few keys: any key takes much weight)
    mass: np.ndarray            # (layers, heads): mean attention weight on position 0

    @property
    def even(self) -> float:
        """The same mean had every query spread its weight evenly over the keys it sees: 1 / (q + 1) at query q."""
        return float(np.mean(1.0 / np.arange(self.skip + 1, self.tokens + 1)))


def sink_map(model: NativeModel, skip: int = 4) -> SinkMap:
    """The attention weight each layer and head puts on position 0, over the held-out text's first tokens (at most
    the context, at most 512), the queries from position `skip` on."""
    text = held_out(model.info.language)
    ids = text_ids(model, text.text, text.name)[:min(model.info.context_length, 512)]
    return SinkMap(text.name, len(ids), skip, sink_mass(model, ids, first=1, skip=skip).numpy())


def machine(model: NativeModel) -> tuple[str, int]:
    """(the device as the page names it, torch's CPU threads)."""
    device = model.info.device
    if device.startswith("cuda") and torch.cuda.is_available():
        device = f"{device} ({torch.cuda.get_device_name()})"
    elif device == "cpu":
        device = f"cpu ({cpu_features().vector})"
    return device, torch.get_num_threads()
