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


class FullLayer:
    """One full-attention layer's K and V, (B, n_kv, capacity, d_head) buffers holding every position from index 0.

    The buffer doubles when full, so a decode step writes its one new position in place instead of copying the
    whole cache (what torch.cat would do every step). The arithmetic (which positions a query sees, which the layer
    holds, what it keeps) takes the first position held and the length as arguments, so that the slotted cache of
    a batched decode (model/serving) applies the same rules to each of its slots."""

    window: int | None = None
    most: int | None = None  # the largest buffer the layer keeps: none, it grows with the sequence

    def __init__(self):
        self.keys: torch.Tensor | None = None    # (B, n_kv, capacity, d_head)
        self.values: torch.Tensor | None = None
        self.length = 0  # positions the layer has seen: the sequence length
        self.start = 0   # the position at buffer index 0: above 0 once a sliding layer dropped some

    def first_seen(self, start: int, position: int) -> int:
        """The first key position a query at `position` attends over."""
        return start

    def first_held(self, start: int, length: int) -> int:
        """The first position the layer holds (layer()) after `length` positions."""
        return start

    def keep_from(self, start: int, end: int) -> int:
        """The first position a buffer keeps when it is written again after `end` positions."""
        return start

    def capacity(self, needed: int, old: int) -> int:
        """A new buffer's positions: at least `needed`, double the old one, never under MIN_CAPACITY."""
        return max(needed, 2 * old, MIN_CAPACITY)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' K, V (B, n_kv, T, d_head); return the keys and values the new queries attend
        over (B, n_kv, S, d_head), from position first_seen(start, length before) to the last new one."""
        start, end = self.length, self.length + k.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(k, end)
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _grow(self, like: torch.Tensor, needed: int) -> None:
        old = 0 if self.keys is None else self.keys.shape[2]
        B, n_kv, _, d_head = like.shape
        capacity = self.capacity(needed, old)
        for name in ("keys", "values"):
            bigger = like.new_empty(B, n_kv, capacity, d_head)
            if getattr(self, name) is not None:
                bigger[:, :, :self.length] = getattr(self, name)[:, :, :self.length]
            setattr(self, name, bigger)

    def held(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V (B, n_kv, positions, d_head) the layer holds, None before its first append."""
        if self.keys is None:
            return None
        kept = slice(self.first_held(self.start, self.length) - self.start, self.length - self.start)
        return self.keys[:, :, kept], self.values[:, :, kept]

    def can_crop(self, n: int) -> bool:
        """Whether the layer still holds what the position after the first n needs."""
        return True

    def crop(self, n: int) -> None:
        """Keep the first n positions (fewer when a pass that stopped half-way left this layer shorter)."""
        self.length = min(self.length, n)
        if n == 0:
            self.start = 0

    def copy_first(self, n: int) -> FullLayer:
        """This layer's first n positions as views cut at n, so that the copy's first append copies them into
        buffers of its own (a buffer is written in place only below its end) instead of writing into this one's."""
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__)
        if n == 0:
            copy.keys = copy.values = None
            copy.start = copy.length = 0
        else:
            copy.keys, copy.values = self.keys[:, :, :n - self.start], self.values[:, :, :n - self.start]
            copy.length = n
        return copy


class SlidingLayer(FullLayer):
    """One sliding-window layer (Gemma 3): a query sees only the `window` latest positions, its own included, so
    the layer keeps those and drops older ones, and its memory stops growing (transformers' sliding-window cache
    drops them too). It keeps CROP_MARGIN more, for crops (Back, speculative decoding's rejections)."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window
        self.most = window + 2 * CROP_MARGIN

    def first_seen(self, start: int, position: int) -> int:
        return max(start, position - self.window + 1)

    def first_held(self, start: int, length: int) -> int:
        return max(start, length - self.window)

    def keep_from(self, start: int, end: int) -> int:
        return max(start, end - self.window - CROP_MARGIN)

    def capacity(self, needed: int, old: int) -> int:
        return min(super().capacity(needed, old), self.most)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, past = self.start, self.length
        end = past + k.shape[2]
        seen = self.first_seen(start, past) - start  # the buffer index of the oldest key the first new query sees
        if k.shape[2] == 1 and self.keys is not None and end - start <= self.keys.shape[2]:
            # a decode step: written in place, like a full layer
            self.keys[:, :, past - start] = k[:, :, 0]
            self.values[:, :, past - start] = v[:, :, 0]
            self.length = end
            return self.keys[:, :, seen:end - start], self.values[:, :, seen:end - start]
        # several positions, or a full buffer: the pass attends over the held keys and the new ones; the buffer
        # then keeps only the window after the last position and the margin before it, in a buffer with room
        # for CROP_MARGIN more decode steps
        keys = torch.cat((self.keys[:, :, :past - start], k), dim=2) if self.keys is not None else k
        values = torch.cat((self.values[:, :, :past - start], v), dim=2) if self.keys is not None else v
        keep_from = self.keep_from(start, end)
        kept = end - keep_from
        capacity = max(MIN_CAPACITY, min(2 * kept, self.most))
        for name, new in (("keys", keys), ("values", values)):
            buffer = new.new_empty(*new.shape[:2], capacity, new.shape[3])
            buffer[:, :, :kept] = new[:, :, keep_from - start:]
            setattr(self, name, buffer)
        self.start, self.length = keep_from, end
        return keys[:, :, seen:], values[:, :, seen:]

    def can_crop(self, n: int) -> bool:
        """A sliding layer that dropped positions older than n − window cannot give them back."""
        return n == 0 or self.start <= max(0, n - self.window)


def cache_layer(window: int | None) -> FullLayer:
    """The layer object for a layer kind: FullLayer for full attention, SlidingLayer for a window."""
    return FullLayer() if window is None else SlidingLayer(window)


class KVCache(LayerBytes):
    """A sequence's cache: one FullLayer or SlidingLayer per layer, chosen from the model's layer kinds (`windows`,
    None for full attention), as transformers' DynamicCache picks its layer classes from config.layer_types."""

    def __init__(self, n_layers: int, windows: list[int | None] | None = None):
        self.n_layers = n_layers
        self.windows = list(windows) if windows is not None else [None] * n_layers  # None: full attention
        self.layers = [cache_layer(window) for window in self.windows]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' K, V (B, n_kv, T, d_head) to `layer`; return the keys and values the new
        queries attend over (B, n_kv, S, d_head), from first_seen(layer, length before) to the last new position."""
        return self.layers[layer].append(k, v)

    def first_seen(self, layer: int, position: int) -> int:
        """The first key position a query at `position` attends over in `layer` (what the mask starts at)."""
        held = self.layers[layer]
        return held.first_seen(held.start, position)

    def copy_first(self, n: int) -> KVCache:
        """A cache holding this one's first n positions, on which a step leaves this cache exactly as it was."""
        if not 0 <= n <= self.length or not self.can_crop(n):
            raise ValueError(f"cannot copy the first {n} positions of a cache of {self.length}")
        copy = KVCache(self.n_layers, self.windows)
        copy.layers = [held.copy_first(n) for held in self.layers]
        return copy

    @property
    def length(self) -> int:
        return self.layers[0].length

    def can_crop(self, n: int) -> bool:
        """Whether every layer still holds what the position after the first n needs."""
        return all(held.can_crop(n) for held in self.layers)

    def crop(self, n: int) -> None:
        """Keep the first n positions, forget the rest (Back rewinds the sequence this way)."""
        if not 0 <= n <= self.length or not self.can_crop(n):
            raise ValueError(f"cannot crop a cache of {self.length} positions to {n}")
        for held in self.layers:
            held.crop(n)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V (B, n_kv, positions, d_head) that `layer` holds, None before its first append: every position,
        or on a sliding-window layer the `window` latest."""
        return self.layers[layer].held()
