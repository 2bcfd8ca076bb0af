"""A bounded cache: attention sinks and a window (StreamingLLM, arXiv 2309.17453), measured, not drawn.

A cache that keeps only the `window` latest positions forgets the first ones, and a model trained on whole contexts
puts much of its attention on those (the attention sink: the softmax's weights must sum to 1 and the first tokens,
seen by every query, take what no other key needs). StreamingLLM keeps the first `sinks` positions as well, and gives
the positions inside the cache to RoPE (a key at cache slot i turns as position i), not the text's: a query then never
sees a distance the model was not trained on. The cache stores its keys unturned (turned back by their slot's angle
as they arrive) and turns them by their current slot at every pass, so an eviction only shifts slots.

sink_mass measures the sink itself: the attention weight each layer and head puts on the first positions of a text.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.engine.cache import LayerBytes
from model.engine.llama import Probe, apply_rope
from model.engine.runtime import NativeModel
from model.errors import InputError


class BoundedCache(LayerBytes):
    """What the two bounded caches share: K and V lists a layer, every query over every key held, no crop (they are
    for measuring along a text, not for the pages' Back)."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]

    def first_seen(self, layer: int, position: int) -> int:
        return 0

    def crop(self, n: int) -> None:
        if n != self.length:
            raise ValueError("a bounded cache does not crop")

    def can_crop(self, n: int) -> bool:
        return n == self.length

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.keys[layer] is None else (self.keys[layer], self.values[layer])


class SinkWindowCache(BoundedCache):
    """The first `sinks` positions and the `window` latest, per layer (B, n_kv, held, d_head); sinks 0 is the window
    alone. `length` is the number held, so the model's forward turns each new position by its slot in the cache."""

    def __init__(self, model: NativeModel, sinks: int, window: int):
        self.module, self.sinks, self.window = model.module, sinks, window
        self.n_layers = model.info.n_layers
        self.keys: list[torch.Tensor | None] = [None] * self.n_layers    # unturned
        self.values: list[torch.Tensor | None] = [None] * self.n_layers
        self.held = [0] * self.n_layers
        self.evicted = 0                                                   # text positions dropped so far

    @property
    def length(self) -> int:
        return self.held[0]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k turned at slots held .. held + T − 1 (the forward's positions); returns every held key turned at its
        slot and the values, then drops the oldest positions after the sinks past sinks + window."""
        start, T = self.held[layer], k.shape[2]
        cos, sin = self._turn(start, start + T, k.dtype)
        plain = apply_rope(k, cos, -sin)                                   # turned back to position 0
        keys = plain if self.keys[layer] is None else torch.cat((self.keys[layer], plain), dim=2)
        values = v if self.values[layer] is None else torch.cat((self.values[layer], v), dim=2)
        cos, sin = self._turn(0, keys.shape[2], k.dtype)
        turned = apply_rope(keys, cos, sin)                                # (B, n_kv, held + T, d_head)
        read = values
        over = keys.shape[2] - (self.sinks + self.window)
        if over > 0:
            keep = torch.cat((torch.arange(self.sinks), torch.arange(self.sinks + over, keys.shape[2])))
            keys, values = keys[:, :, keep], values[:, :, keep]
            if layer == 0:
                self.evicted += over
        self.keys[layer], self.values[layer], self.held[layer] = keys, values, keys.shape[2]
        return turned, read

    def kept(self, layer: int) -> list[int]:
        """The text positions the layer holds: all of them until the first eviction, then the sinks and the latest."""
        seen = self.held[layer] + self.evicted
        if not self.evicted:
            return list(range(seen))
        return list(range(self.sinks)) + list(range(seen - (self.held[layer] - self.sinks), seen))

    def _turn(self, first: int, end: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(first, end, device=self.module.device)
        return self.module.rope(positions, dtype)[None]


class HeavyHitterCache(BoundedCache):
    """H2O's policy (arXiv 2306.14048) at a budget of `heavy` + `recent` positions a layer: the `recent` latest are
    always kept, and of the older ones the `heavy` whose attention received so far is largest (summed over the
    queries that saw them and over the heads); one position leaves a layer after each step that brings it past
    the budget. Keys keep their text positions (as H2O does), so `length` is the text's and `first_seen` is 0 over the
    positions held, which `keys_for` lists."""

    def __init__(self, model: NativeModel, heavy: int, recent: int):
        self.heavy, self.recent, self.n_layers = heavy, recent, model.info.n_layers
        self.keys: list[torch.Tensor | None] = [None] * self.n_layers
        self.values: list[torch.Tensor | None] = [None] * self.n_layers
        self.scores: list[torch.Tensor | None] = [None] * self.n_layers   # (held,) attention received
        self.positions: list[list[int]] = [[] for _ in range(self.n_layers)]
        self.seen = 0

    @property
    def length(self) -> int:
        return self.seen

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = k.shape[2]
        first = self.seen if layer == 0 else self.seen - T
        self.keys[layer] = k if self.keys[layer] is None else torch.cat((self.keys[layer], k), dim=2)
        self.values[layer] = v if self.values[layer] is None else torch.cat((self.values[layer], v), dim=2)
        self.positions[layer] += range(first, first + T)
        new_scores = torch.zeros(T)
        self.scores[layer] = new_scores if self.scores[layer] is None else torch.cat((self.scores[layer], new_scores))
        if layer == 0:
            self.seen += T
        return self.keys[layer], self.values[layer]

    def kept(self, layer: int) -> list[int]:
        """The text positions the layer holds: the latest and the heavy hitters its own attention chose."""
        return list(self.positions[layer])

    def observe(self, attentions: list[torch.Tensor]) -> None:
        """After a pass: each layer's weights (B, heads, T, held) added to its positions' scores, then the
        lowest-scored older position dropped where the layer is past its budget."""
        for layer, weights in enumerate(attentions):
            self.scores[layer] += weights.float().sum(dim=(0, 1, 2))[-self.scores[layer].shape[0]:]
            while len(self.positions[layer]) > self.heavy + self.recent:
                older = self.scores[layer][:-self.recent] if self.recent else self.scores[layer]
                drop = int(older.argmin())
                keep = [i for i in range(len(self.positions[layer])) if i != drop]
                self.keys[layer], self.values[layer] = self.keys[layer][:, :, keep], self.values[layer][:, :, keep]
                self.scores[layer] = self.scores[layer][keep]
                del self.positions[layer][drop]


def check_window(model: NativeModel, sinks: int, window: int) -> None:
    """A window of at least one position and no fewer than the sinks (a bound mostly sinks keeps almost no recent
    text), sinks within the model's context; a model with sliding layers (Gemma
    3) is refused: its sliding layers bound their own cache already, and its full ones turn with another base."""
    if window < max(1, sinks) or sinks < 0 or sinks + window >= model.info.context_length:
        raise InputError("kv_window_range", sinks=sinks, window=window, context=model.info.context_length)
    if any(w is not None for w in model.info.layer_windows):
        raise InputError("kv_window_sliding", model=model.info.name)


@torch.inference_mode()
def sink_mass(model: NativeModel, ids: list[int], first: int = 1, skip: int = 4) -> torch.Tensor:
    """(layers, heads): the mean attention weight on the first `first` positions, over the queries of one pass of
    `ids` past the first `skip` (an early query has few keys, so any key takes much of its weight)."""
    out = model.module(torch.tensor([ids], device=model.device), probe=Probe(attentions=True))
    weights = torch.cat(out.attentions)                                   # (layers, heads, T, T)
    return weights[:, :, skip:, :first].sum(dim=-1).mean(dim=-1).float()


def fed_along(model: NativeModel, ids: list[int], cache):
    """Each token of `ids` fed one a step through `cache` (a bounded cache re-run as it evicts, not replayed; H2O
    scores its keys by the attention they received); yields the logits (vocab,) after each."""
    watched = isinstance(cache, HeavyHitterCache)
    for token in ids:
        with torch.inference_mode():
            x = torch.tensor([[token]], device=model.device)
            out = model.module(x, cache, probe=Probe(attentions=watched))  # at the cache's length: a slot for sinks
            if watched:
                cache.observe(out.attentions)
        yield out.logits[0, -1]


def nll_along(model: NativeModel, ids: list[int], cache, tick: Callable[[], None] | None = None) -> list[float]:
    """The negative log-likelihood of each token after the first, the text fed through `cache` (fed_along): what a
    perplexity-by-position curve draws. tick() runs after each token (a caller that may stop there)."""
    nlls = []
    for logits, token in zip(fed_along(model, ids[:-1], cache), ids[1:]):
        nlls.append(float(-torch.log_softmax(logits.float(), dim=-1)[token]))
        if tick is not None:
            tick()
    return nlls
