"""The slotted KV cache of a batched decode: one request per slot, each with its own length (and on Gemma 3's
sliding layers its own window), and one decode step over all of them through the model's own forward."""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.engine.cache import KVCache, LayerBytes, cache_layer
from model.engine.llama import DecoderOnly, RowKeys


class SlotCache:
    """Per layer K and V of shape (slots, n_kv, capacity, d_head): slot s holds positions of one request, with its
    own length. A full layer's buffer holds positions 0 .. lengths[s] − 1 of the slot from index 0; a sliding-window
    layer's (`windows[i]`, Gemma 3) holds them from position starts[s] at index 0, at most the layer's `most`: when a
    slot's next position would not fit, the positions its layer keeps (keep_from) move to the front, so its memory
    stops growing. Which positions a query sees, which a layer holds and keeps, and how a buffer grows are the solo
    cache's own layer objects' rules (cache.FullLayer, cache.SlidingLayer), applied here per slot. The buffers
    double when full; a freed slot keeps its old values, which no row reads."""

    def __init__(self, n_layers: int, slots: int, windows: list[int | None] | tuple[int | None, ...] | None = None):
        self.n_layers, self.slots = n_layers, slots
        self.windows = list(windows) if windows else [None] * n_layers   # None: full attention
        self.rules = [cache_layer(window) for window in self.windows]    # the arithmetic, not the buffers
        self.lengths = [0] * slots
        self.starts = [0] * slots   # per slot, the position at index 0 of its sliding layers' buffers
        self._keys: list[torch.Tensor | None] = [None] * n_layers   # (slots, n_kv, capacity, d_head)
        self._values: list[torch.Tensor | None] = [None] * n_layers

    def _start(self, layer: int, slot: int) -> int:
        """The position at index 0 of `slot` in `layer`'s buffer."""
        return 0 if self.windows[layer] is None else self.starts[slot]

    def _ensure(self, like: torch.Tensor, full: int, sliding: int) -> None:
        """Room for `full` positions from index 0 on every full layer, `sliding` on every sliding one; `like`
        (…, n_kv, …, d_head) gives the dtype and device."""
        n_kv, d_head = like.shape[1], like.shape[3]
        for layer, rule in enumerate(self.rules):
            needed = full if rule.window is None else sliding
            old = 0 if self._keys[layer] is None else self._keys[layer].shape[2]
            if needed <= old:
                continue
            capacity = rule.capacity(needed, old)
            for store in (self._keys, self._values):
                bigger = like.new_empty(self.slots, n_kv, capacity, d_head)
                if store[layer] is not None:
                    bigger[:, :, :old] = store[layer]
                store[layer] = bigger

    @torch.inference_mode()
    def load(self, slot: int, solo: KVCache) -> None:
        """Copy a request's prefilled solo cache (1, n_kv, n, d_head) per layer into `slot`: every position of a
        full layer, the window's latest positions of a sliding one (all its next query needs)."""
        n = solo.length
        held = [solo.layer(layer) for layer in range(self.n_layers)]
        window_held = min((k.shape[2] for (k, _), w in zip(held, self.windows) if w is not None), default=n)
        self._ensure(held[0][0], n, window_held)
        for layer, (k, v) in enumerate(held):
            self._keys[layer][slot, :, :k.shape[2]] = k[0]
            self._values[layer][slot, :, :k.shape[2]] = v[0]
        self.lengths[slot], self.starts[slot] = n, n - window_held

    def free(self, slot: int) -> None:
        self.lengths[slot], self.starts[slot] = 0, 0

    def make_room(self, rows: int) -> None:
        """Before a step over slots 0 .. rows − 1: a sliding layer's slot whose next position would pass its buffer
        moves the positions the layer keeps to the front, then every buffer grows to what the step writes."""
        sliding = next((rule for rule in self.rules if rule.window is not None), None)  # one window: Gemma 3
        if sliding is not None:
            for slot in range(rows):
                end = self.lengths[slot] + 1
                if end - self.starts[slot] > sliding.most:
                    self._move_to_front(slot, sliding.keep_from(self.starts[slot], end))
        held = max(self.lengths[s] - self.starts[s] for s in range(rows)) + 1
        self._ensure(self._keys[0], max(self.lengths[:rows]) + 1, held)

    def _move_to_front(self, slot: int, new_start: int) -> None:
        old_start, end = self.starts[slot], self.lengths[slot]
        for layer in range(self.n_layers):
            if self.windows[layer] is not None:
                for store in (self._keys, self._values):
                    kept = store[layer][slot, :, new_start - old_start:end - old_start].clone()
                    store[layer][slot, :, :end - new_start] = kept
        self.starts[slot] = new_start

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new position per row: k, v (rows, n_kv, 1, d_head) of slots 0 .. rows − 1, written at each row's own
        length (after make_room). Returns every row's keys and values up to the longest row's end, (rows, n_kv, S,
        d_head): a view, no copy; `row_keys` tells which of them each row reads. Lengths move on once, after the
        last layer."""
        rows = k.shape[0]
        index = [self.lengths[s] - self._start(layer, s) for s in range(rows)]
        if rows == 1:  # one row: a plain slice, the same write without building index tensors
            self._keys[layer][0, :, index[0]] = k[0, :, 0]
            self._values[layer][0, :, index[0]] = v[0, :, 0]
        else:
            slots = torch.arange(rows, device=k.device)
            at = torch.tensor(index, device=k.device)                    # (rows,)
            self._keys[layer][slots, :, at] = k[:, :, 0]                  # (rows, n_kv, d_head)
            self._values[layer][slots, :, at] = v[:, :, 0]
        S = max(index) + 1
        return self._keys[layer][:rows, :, :S], self._values[layer][:rows, :, :S]

    def row_keys(self, rows: int) -> dict[int | None, RowKeys]:
        """Per layer kind, the buffer indices each of rows 0 .. rows − 1 reads in a decode step: row r's new query
        (at position lengths[r]) sees the keys of its own slot from the layer's first_seen up to its own."""
        keys = {}
        for layer, rule in enumerate(self.rules):
            if rule.window not in keys:
                starts = [self._start(layer, s) for s in range(rows)]
                keys[rule.window] = RowKeys(
                    tuple(rule.first_seen(start, n) - start for n, start in zip(self.lengths, starts)),
                    tuple(n - start + 1 for n, start in zip(self.lengths, starts)))
        return keys

    def advance(self, rows: int) -> None:
        self.lengths[:rows] = [n + 1 for n in self.lengths[:rows]]

    def row(self, slot: int) -> RowCache:
        return RowCache(self, slot)

    def nbytes_reserved(self) -> int:
        """The buffers' memory, every slot's whole capacity: what the session's budget counts."""
        return sum(t.untyped_storage().nbytes() for store in (self._keys, self._values) for t in store
                   if t is not None)

class RowCache(LayerBytes):
    """One slot of a SlotCache seen as a request's own cache: K and V (1, n_kv, positions, d_head) per layer, every
    position on a full layer, the window's latest on a sliding one (what a solo KVCache's layer() gives)."""

    def __init__(self, cache: SlotCache, slot: int):
        self.cache, self.slot, self.n_layers = cache, slot, cache.n_layers

    @property
    def length(self) -> int:
        return self.cache.lengths[self.slot]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        keys = self.cache._keys[layer]
        if keys is None or self.length == 0:
            return None
        start = self.cache._start(layer, self.slot)
        held = slice(self.cache.rules[layer].first_held(start, self.length) - start, self.length - start)
        return keys[self.slot:self.slot + 1, :, held], self.cache._values[layer][self.slot:self.slot + 1, :, held]

@torch.inference_mode()
def decode_rows(module: DecoderOnly, cache: SlotCache, tokens: list[int],
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
    """One decode step for slots 0 .. rows − 1, tokens[r] the token row r feeds (rows = len(tokens)); returns the
    logits (rows, vocab): the model's own forward, each row at its own position over the keys of its own slot.
    after_layer(i) runs once block i has: a caller may stop the pass there by raising, and the rows' lengths have not
    moved on yet, so the same pass can run again whole (it writes the same positions)."""
    rows = len(tokens)
    device = module.device
    cache.make_room(rows)
    positions = torch.tensor(cache.lengths[:rows], device=device)[:, None]  # (rows, 1) each row's own position
    ids = torch.tensor(tokens, device=device)[:, None]                      # (rows, 1)
    logits = module(ids, cache, positions=positions, keys=cache.row_keys(rows),
                    after_layer=after_layer).logits  # (rows, 1, vocab)
    cache.advance(rows)
    return logits[:, 0].float()                                             # (rows, vocab)
