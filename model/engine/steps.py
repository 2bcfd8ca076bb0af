"""Prefill, decode one token, recompute: each step returns a StepTrace of numpy arrays and numbers."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from model.engine.cache import KVCache
from model.engine.llama import ForwardOutput, Probe
from model.engine.runtime import LoadedModel, NativeModel, synchronize
from model.errors import InputError


@dataclass
class StepTrace:
    phase: str                 # "prefill" | "decode"
    input_ids: list[int]       # the ids fed in this step: the prompt, or the one token chosen before
    positions: list[int]       # their positions in the sequence
    # The attention weights as the session keeps them, float16 (every weight to three digits at half the bytes):
    # prefill (layers, heads, N(N+1)/2), each query's row up to its own position, one after the other (the causal
    # triangle without its zeros above the diagonal); decode (layers, heads, 1, cache_len), or (1, 1, 1, cache_len)
    # once only attention_view's layer and head are kept. Read them with weights() and heads(). None once dropped.
    attention: np.ndarray | None
    cache_len: int             # positions in the cache after the step
    cache_bytes: int           # bytes of the positions the cache holds (K and V tensors): equals the formula
    cache_bytes_reserved: int  # bytes of the buffers those positions sit in (the native cache doubles ahead)
    layer_shapes: list[tuple[int, ...]]  # per layer, the shape of K (and of V): (batch, n_kv, positions, d_head)
    layer_bytes: list[int]     # per layer, bytes of the K plus V positions held
    layer_bytes_reserved: list[int]  # per layer, bytes of the K and V buffers
    cache_bytes_formula: int   # 2 × n_layers × n_kv_heads × positions × d_head × bytes (sliding layers: ≤ window)
    logits: np.ndarray | None  # (vocab,) at the last position, float32; kept for the prefill and the latest steps
    ms: float                  # wall time of the forward pass, device synchronised
    attention_view: tuple[int, int] | None = None  # (layer, head) when only its rows are kept; None: every one

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays this trace keeps."""
        return sum(a.nbytes for a in (self.attention, self.logits) if a is not None)

    @property
    def keeps_every_head(self) -> bool:
        return self.attention is not None and self.attention_view is None

    def keeps(self, layer: int, head: int) -> bool:
        return self.attention is not None and self.attention_view in (None, (layer, head))

    def heads(self, layer: int) -> np.ndarray:
        """(heads, queries, keys) of one layer, float16; the trace keeps every layer and head."""
        assert self.keeps_every_head, "only a trace that keeps every layer and head"
        if self.phase == "decode":
            return self.attention[layer]
        n = len(self.positions)
        rows, cols = np.tril_indices(n)
        triangle = np.zeros((self.attention.shape[1], n, n), dtype=self.attention.dtype)
        triangle[:, rows, cols] = self.attention[layer]
        return triangle

    def weights(self, layer: int, head: int) -> np.ndarray | None:
        """(queries, keys) of one layer and head, float16, zeros above the diagonal; None when not kept."""
        if not self.keeps(layer, head):
            return None
        if self.attention_view is not None:
            return self.attention[0, 0]
        if self.phase == "decode":
            return self.attention[layer, head]
        n = len(self.positions)
        triangle = np.zeros((n, n), dtype=self.attention.dtype)
        triangle[np.tril_indices(n)] = self.attention[layer, head]
        return triangle

    def keep_only(self, layer: int, head: int) -> int:
        """Keep only this layer and head's rows (a decode step's); returns the bytes freed."""
        assert self.phase == "decode" and self.keeps_every_head
        before = self.attention.nbytes
        self.attention = self.attention[layer:layer + 1, head:head + 1].copy()  # a copy: the view would hold it all
        self.attention_view = (layer, head)
        return before - self.attention.nbytes


def kept_attention(phase: str, attention: torch.Tensor) -> np.ndarray:
    """(layers, heads, queries, keys) from the forward pass -> the float16 array a StepTrace keeps: a prefill's
    causal square as its lower triangle, row after row (np.tril_indices' order); a decode step's row whole."""
    if phase == "prefill":
        n = attention.shape[-1]
        rows, cols = torch.tril_indices(n, n, device=attention.device)
        attention = attention[:, :, rows, cols]
    return attention.to(torch.float16).cpu().numpy()


def _run(model: LoadedModel, cache, phase: str, ids: list[int]) -> StepTrace:
    start = cache.length
    synchronize(model.device)
    t0 = time.perf_counter()
    try:
        logits, attention = model.forward(ids, cache, output_attentions=True)
        synchronize(model.device)
    except torch.OutOfMemoryError:
        cache.crop(start)  # layers that already appended give their positions back: the session is unchanged
        raise InputError("out_of_memory", device=str(model.device)) from None
    ms = (time.perf_counter() - t0) * 1000
    info = model.info
    return StepTrace(
        phase=phase, input_ids=list(ids), positions=list(range(start, start + len(ids))),
        attention=kept_attention(phase, attention), cache_len=cache.length, cache_bytes=cache.nbytes(),
        layer_shapes=[cache.layer_shape(i) for i in range(info.n_layers)],
        layer_bytes=[cache.layer_bytes(i) for i in range(info.n_layers)],
        cache_bytes_reserved=cache.nbytes_reserved(),
        layer_bytes_reserved=[cache.layer_bytes_reserved(i) for i in range(info.n_layers)],
        cache_bytes_formula=info.cache_bytes_formula(cache.length),
        logits=logits.float().cpu().numpy(), ms=ms,
    )


def prefill(model: LoadedModel, cache, ids: list[int]) -> StepTrace:
    """All prompt positions in one pass; fills an empty cache."""
    assert cache.length == 0, "prefill starts from an empty cache"
    return _run(model, cache, "prefill", ids)


def decode(model: LoadedModel, cache, token_id: int) -> StepTrace:
    """One new position attends over everything cached; its K, V are appended."""
    return _run(model, cache, "decode", [token_id])


def rewind(model: LoadedModel, cache, ids: list[int], n: int) -> None:
    """Make `cache` hold the first n of `ids`, as if the steps after them never ran: a crop, exact wherever every
    layer still holds what position n needs. Farther back than a sliding-window layer's margin (it dropped older
    positions) the cache is emptied and filled again by one pass over ids[:n]: slower, equally exact."""
    if cache.can_crop(n):
        cache.crop(n)
        return
    cache.crop(0)
    if n:
        model.forward(ids[:n], cache, output_attentions=False)


def recompute(model: LoadedModel, ids: list[int]) -> np.ndarray:
    """Logits (vocab,) at the last position of `ids`, computed from scratch with no cache."""
    logits, _ = model.forward(ids, None, output_attentions=False)
    return logits.float().cpu().numpy()


@torch.inference_mode()
def side_step(model: NativeModel, cache: KVCache, trace: StepTrace, probe: Probe) -> ForwardOutput:
    """The step `trace` run again beside the real one, on a copy of the cache as it was before the step: the
    logit lens (the residual stream after each layer) and switched-off heads see the step's own ids and positions,
    while the session's cache, tokens and trace stay exactly as they were. `cache` still holds the step's positions
    (the run's latest steps)."""
    if not isinstance(model, NativeModel):
        raise InputError("native_engine_only", name=model.info.name)
    before = cache.copy_first(trace.positions[0])
    ids = torch.tensor([trace.input_ids], dtype=torch.long, device=model.device)  # (1, T)
    positions = torch.tensor(trace.positions, device=model.device)                # (T,)
    return model.module(ids, before, positions, probe=probe, last_logits_only=True)


def max_abs_logit_diff(trace: StepTrace, recomputed: np.ndarray) -> float:
    return float(np.max(np.abs(trace.logits - recomputed)))
