"""A loaded model as the steps see it: facts about it, its tokenizer, and one forward pass.

Two backends fit behind it: the native Llama of this package and (model/hf.py) any transformers causal LM.
A LoadedModel is shared by every session and never changed after loading; sessions own their caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from model.cache import KVCache
from model.errors import InputError
from model.llama import Llama
from model.tokenizer import WordTokenizer

DEFAULT_CPU_THREADS = torch.get_num_threads()
# Below this size every matrix is small: OpenMP threads mostly wait on each other, and on a laptop that also
# draws the page in a browser one thread runs a step several times faster (measured: 5–11 ms against
# 70–170 ms per decode step of `small` with the server and Chromium on two cores).
TINY_MODEL_PARAMETERS = 20_000_000


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
    dtype: str
    device: str
    bytes_per_element: int
    eos_id: int | None

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


class LoadedModel:
    info: ModelInfo
    tokenizer: WordTokenizer
    device: torch.device

    def new_cache(self):
        raise NotImplementedError

    def forward(self, ids: list[int], cache, output_attentions: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ids after what `cache` holds (None: from scratch, no cache kept).
        Returns the last position's logits (vocab,) and, if asked, attention weights (layers, heads, T, S)."""
        raise NotImplementedError


class NativeModel(LoadedModel):
    def __init__(self, name: str, module: Llama, tokenizer: WordTokenizer | None, device: torch.device):
        """tokenizer None: ids only (the benchmark's random models)."""
        cfg = module.config
        self.module, self.tokenizer, self.device = module, tokenizer, device
        dtype = next(module.parameters()).dtype
        self.info = ModelInfo(
            name=name, backend="native", n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads, d_head=cfg.head_dim, vocab_size=cfg.vocab_size,
            context_length=cfg.max_position_embeddings, dtype=str(dtype).removeprefix("torch."),
            device=str(device), bytes_per_element=dtype.itemsize,
            eos_id=tokenizer.eos_id if tokenizer is not None else cfg.eos_token_id,
        )

    def new_cache(self) -> KVCache:
        return self.module.new_cache()

    @torch.inference_mode()
    def forward(self, ids, cache, output_attentions):
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        out = self.module(x, cache, output_attentions=output_attentions, last_logits_only=True)
        attentions = torch.cat(out.attentions) if output_attentions else None  # (layers, heads, T, S)
        return out.logits[0, -1], attentions

    @torch.inference_mode()
    def attention_inputs(self, ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (n_heads, T, d_head), k and v (n_kv, T, d_head) of one layer, after RoPE, for the prompt ids."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        q, k, v = self.module(x, output_qkv_layer=layer).qkv
        return q[0], k[0], v[0]


def load_model(name_or_path: str = "small", device: str = "auto", allow_download: bool = False) -> LoadedModel:
    """A bundled name, a model folder, or a Hugging Face Hub id (downloaded only when allowed).
    The project's Llama checkpoints run on the native model, every other causal LM on transformers."""
    from model import hf  # imported here: hf builds on this module

    source = hf.locate(name_or_path, allow_download)
    if not hf.is_native(source):
        return warmed_up(hf.load_transformers(source, device))
    folder, dev = Path(source.location), pick_device(device)
    return warmed_up(NativeModel(name_or_path, Llama.load(folder, dev), WordTokenizer.load(folder), dev))


def warmed_up(model: LoadedModel) -> LoadedModel:
    """One throw-away pass, so that no step timing the user sees includes one-time start-up costs."""
    if model.device.type == "cpu":
        tiny = sum(p.numel() for p in model.module.parameters()) < TINY_MODEL_PARAMETERS
        torch.set_num_threads(1 if tiny else DEFAULT_CPU_THREADS)
    model.forward([0, 0], model.new_cache(), output_attentions=True)
    return model
