"""The KV cache, owned by the caller (one per session), never by the shared model.

`Cache` is what the steps and the pages use; the native KVCache below and the transformers backend's HFCache
(model/engine/hf.py) both provide it, and both count bytes the one way written in `LayerBytes`.
"""

from __future__ import annotations

from typing import Protocol

import torch

MIN_CAPACITY = 16


class Cache(Protocol):
    @property
    def length(self) -> int: ...

    def crop(self, n: int) -> None: ...

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
    in place instead of copying the whole cache (what torch.cat would do every step). Everything the cache
    hands out is the first `length` positions of those buffers: the positions it holds.
    """

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self._keys: list[torch.Tensor | None] = [None] * n_layers    # (B, n_kv, capacity, d_head)
        self._values: list[torch.Tensor | None] = [None] * n_layers
        self._lengths = [0] * n_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' K, V (B, n_kv, T, d_head) to `layer`; return all of them (B, n_kv, S, d_head)."""
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

    @property
    def length(self) -> int:
        return self._lengths[0]

    def crop(self, n: int) -> None:
        """Keep the first n positions, forget the rest (Back rewinds the sequence this way)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {n}")
        # per layer: after a pass that stopped half-way (out of memory) later layers may hold fewer
        self._lengths = [min(held, n) for held in self._lengths]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V (B, n_kv, positions, d_head) that `layer` holds, None before its first append."""
        if self._keys[layer] is None:
            return None
        held = self._lengths[layer]
        return self._keys[layer][:, :, :held], self._values[layer][:, :, :held]
