"""The KV cache, owned by the caller (one per session), never by the shared model.

`Cache` is what the steps and the pages use; the native KVCache below and the transformers backend's HFCache
(model/engine/hf.py) both provide it, and both count bytes the one way written in `LayerBytes`.
"""

from __future__ import annotations

from typing import Protocol

import torch

MIN_CAPACITY = 16
# positions a sliding-window layer keeps beyond its window, so that Back and speculative decoding's rejections can
# crop that far and still find every key the next query needs; a crop farther back fills the cache again
CROP_MARGIN = 64


class Cache(Protocol):
    @property
    def length(self) -> int: ...

    def crop(self, n: int) -> None: ...

    def can_crop(self, n: int) -> bool: ...

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def layer_shape(self, layer: int) -> tuple[int, ...]: ...

    def layer_bytes(self, layer: int) -> int: ...

    def layer_bytes_reserved(self, layer: int) -> int: ...

    def nbytes(self) -> int: ...

    def nbytes_reserved(self) -> int: ...


class LayerBytes:
    """Shapes and bytes from `layer(i)`, the K and V (B, n_kv, positions, d_head) that layer i holds.

    Held bytes count the positions stored, which is 2 × n_kv × positions × d_head × bytes per layer: the
    formula. Reserved bytes count the memory those tensors sit in, which is more when a buffer was allocated
    ahead (the native cache doubles its buffers) or kept after a crop."""

    n_layers: int

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        raise NotImplementedError

    def layer_shape(self, layer: int) -> tuple[int, ...]:
        kv = self.layer(layer)
        return () if kv is None else tuple(kv[0].shape)

    def layer_bytes(self, layer: int) -> int:
        kv = self.layer(layer)
        return 0 if kv is None else sum(t.numel() * t.element_size() for t in kv)

    def layer_bytes_reserved(self, layer: int) -> int:
        kv = self.layer(layer)
        return 0 if kv is None else sum(t.untyped_storage().nbytes() for t in kv)

    def nbytes(self) -> int:
        return sum(self.layer_bytes(i) for i in range(self.n_layers))

    def nbytes_reserved(self) -> int:
        return sum(self.layer_bytes_reserved(i) for i in range(self.n_layers))


class KVCache(LayerBytes):
    """Per layer, K and V of shape (batch, n_kv_heads, positions, d_head).

    Each layer's K and V live in a buffer that doubles when full, so a decode step writes its one new position
    in place instead of copying the whole cache (what torch.cat would do every step). A full-attention layer holds
    every position; a sliding-window layer (`windows[i]`, Gemma 3) only the `window` latest ones, the keys its last
    query attended over: older positions are dropped, so its memory stops growing (transformers' sliding-window
    cache drops them too). It keeps CROP_MARGIN more in its buffer, for crops.
    """

    def __init__(self, n_layers: int, windows: list[int | None] | None = None):
        self.n_layers = n_layers
        self.windows = list(windows) if windows is not None else [None] * n_layers  # None: full attention
        self._keys: list[torch.Tensor | None] = [None] * n_layers    # (B, n_kv, capacity, d_head)
        self._values: list[torch.Tensor | None] = [None] * n_layers
        self._lengths = [0] * n_layers  # positions the layer has seen: the sequence length
        self._starts = [0] * n_layers   # the position in buffer slot 0: above 0 once a sliding layer dropped some

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' K, V (B, n_kv, T, d_head) to `layer`; return the keys and values the new
        queries attend over (B, n_kv, S, d_head), which end at the last new position: S = past + T on a full layer,
        on a sliding one the window before the first new query and the T new ones."""
        if self.windows[layer] is not None:
            return self._append_sliding(layer, k, v)
        start, end = self._lengths[layer], self._lengths[layer] + k.shape[2]
        if self._keys[layer] is None or end > self._keys[layer].shape[2]:
            self._grow(layer, k, end)
        self._keys[layer][:, :, start:end] = k
        self._values[layer][:, :, start:end] = v
        self._lengths[layer] = end
        return self._keys[layer][:, :, :end], self._values[layer][:, :, :end]

    def _grow(self, layer: int, like: torch.Tensor, needed: int) -> None:
        old = 0 if self._keys[layer] is None else self._keys[layer].shape[2]
        B, n_kv, _, d_head = like.shape
        capacity = max(needed, 2 * old, MIN_CAPACITY)
        held = self._lengths[layer]
        for store in (self._keys, self._values):
            bigger = like.new_empty(B, n_kv, capacity, d_head)
            if store[layer] is not None:
                bigger[:, :, :held] = store[layer][:, :, :held]
            store[layer] = bigger

    def _append_sliding(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window, start, past = self.windows[layer], self._starts[layer], self._lengths[layer]
        end = past + k.shape[2]
        first_needed = max(start, past - window + 1)  # the oldest key the first new query sees
        buffer = self._keys[layer]
        if k.shape[2] == 1 and buffer is not None and end - start <= buffer.shape[2]:
            # a decode step: written in place, like a full layer
            self._keys[layer][:, :, past - start] = k[:, :, 0]
            self._values[layer][:, :, past - start] = v[:, :, 0]
            self._lengths[layer] = end
            seen = slice(first_needed - start, end - start)
            return self._keys[layer][:, :, seen], self._values[layer][:, :, seen]
        # several positions, or a full buffer: the pass attends over the held keys and the new ones; the buffer
        # then keeps only the window after the last position and the margin before it, in a buffer with room
        # for CROP_MARGIN more decode steps
        keys = torch.cat((self._keys[layer][:, :, :past - start], k), dim=2) if buffer is not None else k
        values = torch.cat((self._values[layer][:, :, :past - start], v), dim=2) if buffer is not None else v
        keep_from = max(start, end - window - CROP_MARGIN)
        kept = end - keep_from
        capacity = max(MIN_CAPACITY, min(2 * kept, window + 2 * CROP_MARGIN))
        for store, new in ((self._keys, keys), (self._values, values)):
            store[layer] = new.new_empty(*new.shape[:2], capacity, new.shape[3])
            store[layer][:, :, :kept] = new[:, :, keep_from - start:]
        self._starts[layer], self._lengths[layer] = keep_from, end
        return keys[:, :, first_needed - start:], values[:, :, first_needed - start:]

    def copy_first(self, n: int) -> KVCache:
        """A cache holding this one's first n positions, on which a step leaves this cache exactly as it was: it
        starts from views of the held tensors cut at n positions, so its first append copies them into buffers of
        its own (a buffer is written in place only below its end) instead of writing into this cache's."""
        if not 0 <= n <= self.length or not self.can_crop(n):
            raise ValueError(f"cannot copy the first {n} positions of a cache of {self.length}")
        copy = KVCache(self.n_layers, self.windows)
        if n == 0:
            return copy
        for layer in range(self.n_layers):
            start = self._starts[layer]
            copy._keys[layer] = self._keys[layer][:, :, :n - start]
            copy._values[layer] = self._values[layer][:, :, :n - start]
            copy._starts[layer], copy._lengths[layer] = start, n
        return copy

    @property
    def length(self) -> int:
        return self._lengths[0]

    def can_crop(self, n: int) -> bool:
        """Whether every layer still holds what the position after the first n needs: a sliding layer that dropped
        positions older than n − window cannot give them back."""
        return n == 0 or all(window is None or start <= max(0, n - window)
                             for window, start in zip(self.windows, self._starts))

    def crop(self, n: int) -> None:
        """Keep the first n positions, forget the rest (Back rewinds the sequence this way)."""
        if not 0 <= n <= self.length or not self.can_crop(n):
            raise ValueError(f"cannot crop a cache of {self.length} positions to {n}")
        # per layer: after a pass that stopped half-way (out of memory) later layers may hold fewer
        self._lengths = [min(held, n) for held in self._lengths]
        if n == 0:
            self._starts = [0] * self.n_layers

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V (B, n_kv, positions, d_head) that `layer` holds, None before its first append: every position,
        or on a sliding-window layer the `window` latest."""
        if self._keys[layer] is None:
            return None
        start, held = self._starts[layer], self._lengths[layer]
        window = self.windows[layer]
        first = start if window is None else max(start, held - window)
        kept = slice(first - start, held - start)
        return self._keys[layer][:, :, kept], self._values[layer][:, :, kept]
