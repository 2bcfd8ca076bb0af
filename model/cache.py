"""The KV cache, owned by the caller (one per session), never by the shared model."""

from __future__ import annotations

import torch


class KVCache:
    """Per layer, K and V of shape (batch, n_kv_heads, positions, d_head)."""

    def __init__(self, n_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' K, V (B, n_kv, T, d_head) to `layer`; return all of them (B, n_kv, S, d_head)."""
        if self.keys[layer] is not None:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def crop(self, n: int) -> None:
        """Keep the first n positions, forget the rest (Back rewinds the sequence this way)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {n}")
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[layer], self.values[layer] = k[:, :, :n], v[:, :, :n]

    def layer_shape(self, layer: int) -> tuple[int, ...]:
        k = self.keys[layer]
        return () if k is None else tuple(k.shape)

    def layer_bytes(self, layer: int) -> int:
        """Bytes of this layer's K and V tensors as they are stored."""
        k, v = self.keys[layer], self.values[layer]
        return 0 if k is None else k.numel() * k.element_size() + v.numel() * v.element_size()

    def nbytes(self) -> int:
        return sum(self.layer_bytes(layer) for layer in range(len(self.keys)))
