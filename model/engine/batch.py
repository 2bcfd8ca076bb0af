"""Batched decode: B requests of different lengths in one forward pass, joining and leaving between steps.

A server does not run one sequence at a time: each step it feeds the next token of every running request through
the model together, so that the weights are read once for all of them (Orca's iteration-level scheduling, vLLM's
continuous batching). Here:

- `SlotCache` holds one request per slot: per layer K and V (slots, n_kv, capacity, d_head), right-padded, so slot s
  keeps its request's positions 0 .. length − 1 at the same places as a solo KVCache would;
- `decode_rows` feeds one token per row: RoPE turns each row at its own position, and an additive mask lets each
  row's query see only the keys of its own slot up to its own position (the rest of the padded buffer gets −∞);
- `Server` schedules: a waiting request takes the first free slot, its prompt is prefilled alone (the solo code, so
  its first token is the solo run's), and from the next step on it decodes with the others; a request that
  finished (eos, its token budget, the context) leaves at once and frees its slot for the next one waiting.

Greedy decoding only (argmax): the batch is about throughput, the sampling controls live on the Decode page.
The native Llama only: Gemma 3's sliding windows would need a per-row window in the mask and a per-slot ring
buffer, which this module does not do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from model.engine.cache import MIN_CAPACITY, KVCache, LayerBytes
from model.engine.counting import step_bytes, step_flops
from model.engine.llama import Llama
from model.engine.runtime import NativeModel, synchronize
from model.errors import InputError


class SlotCache:
    """Per layer K and V of shape (slots, n_kv, capacity, d_head): slot s holds positions 0 .. lengths[s] − 1 of one
    request. The buffers start zeroed and double when full; a freed slot keeps its old values (finite, masked)."""

    def __init__(self, n_layers: int, slots: int):
        self.n_layers, self.slots = n_layers, slots
        self.lengths = [0] * slots
        self._keys: list[torch.Tensor | None] = [None] * n_layers   # (slots, n_kv, capacity, d_head)
        self._values: list[torch.Tensor | None] = [None] * n_layers

    @property
    def capacity(self) -> int:
        return 0 if self._keys[0] is None else self._keys[0].shape[2]

    def _ensure(self, like: torch.Tensor, needed: int) -> None:
        """Room for `needed` positions in every slot; `like` (…, n_kv, …, d_head) gives the dtype and device."""
        if needed <= self.capacity:
            return
        old, n_kv, d_head = self.capacity, like.shape[1], like.shape[3]
        capacity = max(needed, 2 * old, MIN_CAPACITY)
        for store in (self._keys, self._values):
            for layer in range(self.n_layers):
                # zeros, never empty memory: a padded key is multiplied by its weight 0, and 0 × NaN would be NaN
                bigger = like.new_zeros(self.slots, n_kv, capacity, d_head)
                if store[layer] is not None:
                    bigger[:, :, :old] = store[layer]
                store[layer] = bigger

    @torch.inference_mode()
    def load(self, slot: int, solo: KVCache) -> None:
        """Copy a request's prefilled solo cache (1, n_kv, n, d_head) per layer into `slot`."""
        n = solo.length
        self._ensure(solo.layer(0)[0], n)
        for layer in range(self.n_layers):
            k, v = solo.layer(layer)
            self._keys[layer][slot, :, :n] = k[0]
            self._values[layer][slot, :, :n] = v[0]
        self.lengths[slot] = n

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new position per row: k, v (rows, n_kv, 1, d_head) of slots 0 .. rows − 1, written at each row's own
        length. Returns every row's keys and values up to the longest row, (rows, n_kv, S, d_head): a view, no copy;
        `decode_rows` masks what lies past each row's own end. Lengths move on once, after the last layer."""
        rows = k.shape[0]
        positions = torch.tensor(self.lengths[:rows], device=k.device)  # (rows,)
        self._ensure(k, max(self.lengths[:rows]) + 1)
        slots = torch.arange(rows, device=k.device)
        self._keys[layer][slots, :, positions] = k[:, :, 0]             # (rows, n_kv, d_head)
        self._values[layer][slots, :, positions] = v[:, :, 0]
        S = max(self.lengths[:rows]) + 1
        return self._keys[layer][:rows, :, :S], self._values[layer][:rows, :, :S]

    def advance(self, rows: int) -> None:
        self.lengths[:rows] = [n + 1 for n in self.lengths[:rows]]

    def row(self, slot: int) -> RowCache:
        return RowCache(self, slot)

    def nbytes_reserved(self) -> int:
        """The buffers' memory, every slot's whole capacity: what the session's budget counts."""
        return sum(t.untyped_storage().nbytes() for store in (self._keys, self._values) for t in store
                   if t is not None)


class RowCache(LayerBytes):
    """One slot of a SlotCache seen as a request's own cache: K and V (1, n_kv, length, d_head) per layer."""

    def __init__(self, cache: SlotCache, slot: int):
        self.cache, self.slot, self.n_layers = cache, slot, cache.n_layers

    @property
    def length(self) -> int:
        return self.cache.lengths[self.slot]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        keys = self.cache._keys[layer]
        if keys is None or self.length == 0:
            return None
        n, s = self.length, self.slot
        return keys[s:s + 1, :, :n], self.cache._values[layer][s:s + 1, :, :n]


def row_mask(lengths: list[int], device, dtype) -> torch.Tensor:
    """(rows, 1, 1, S) additive mask, S = the longest row after the step: row r's new query (at position
    lengths[r]) sees keys 0 .. lengths[r] of its own slot, −∞ on the padding after them; broadcast over heads."""
    S = max(lengths) + 1
    keys = torch.arange(S, device=device)[None, :]                      # (1, S)
    allowed = keys <= torch.tensor(lengths, device=device)[:, None]    # (rows, S)
    mask = torch.zeros(allowed.shape, device=device, dtype=dtype).masked_fill(~allowed, float("-inf"))
    return mask[:, None, None, :]                                       # (rows, 1, 1, S)


@torch.inference_mode()
def decode_rows(module: Llama, cache: SlotCache, tokens: list[int]) -> torch.Tensor:
    """One decode step for slots 0 .. rows − 1, tokens[r] the token row r feeds (rows = len(tokens)); returns the
    logits (rows, vocab). The blocks are Llama's own: RoPE's cos and sin and the mask simply carry a row axis."""
    rows = len(tokens)
    device = module.lm_head.weight.device
    positions = torch.tensor(cache.lengths[:rows], device=device)       # (rows,) each row's own position
    x = module.model.embed_tokens(torch.tensor(tokens, device=device)[:, None])  # (rows, 1, hidden)
    cos = module.rope_cos[positions].to(x.dtype)[:, None, None, :]      # (rows, 1, 1, d_head): over heads, T = 1
    sin = module.rope_sin[positions].to(x.dtype)[:, None, None, :]
    mask = row_mask(cache.lengths[:rows], device, x.dtype)              # (rows, 1, 1, S)
    for i, block in enumerate(module.model.layers):
        x, _, _ = block(x, cos, sin, mask, cache, i)                    # (rows, 1, hidden)
    cache.advance(rows)
    return module.lm_head(module.model.norm(x))[:, 0].float()           # (rows, vocab)


# -- the scheduler ------------------------------------------------------------------------------------------------

@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    max_new_tokens: int
    slot: int | None = None
    new_ids: list[int] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)  # the step each new token came out of
    token_ms: list[float] = field(default_factory=list)   # the engine clock (ms since the run began) at each token
    joined_step: int | None = None
    left_step: int | None = None
    stop_reason: str | None = None                        # "eos" | "max_new_tokens" | "context_full"

    @property
    def ttft_ms(self) -> float | None:
        """Time to first token: from the run's start (every request is there from the beginning) to its first."""
        return self.token_ms[0] if self.token_ms else None

    @property
    def itl_ms(self) -> list[float]:
        """Inter-token latencies: the clock between one token and the next."""
        return [b - a for a, b in zip(self.token_ms, self.token_ms[1:])]


@dataclass
class ServeStep:
    index: int
    rows: int                     # rows of the decode pass (slots 0 .. rows − 1; a free one among them is idle)
    slots: list[int | None]       # per slot, the request holding it during the step (None: free)
    joined: list[int]             # requests prefilled into a slot this step
    left: list[int]               # requests that finished this step and freed their slot
    prefill_ms: float             # the joiners' prefills
    decode_ms: float              # the batched decode pass
    decode_lengths: list[int]     # per decoding row, the keys its query attended over
    decode_bytes: int             # step_bytes of the decode pass: weights once + each row's cache
    decode_flops: int
    prefill_tokens: int           # prompt positions prefilled this step
    prefill_bytes: int            # each prefill reads the weights once and writes its request's cache
    prefill_flops: int

    @property
    def ms(self) -> float:
        return self.prefill_ms + self.decode_ms

    @property
    def tokens(self) -> int:
        """New tokens the step produced: one per decoding row, one per prefill."""
        return len(self.decode_lengths) + len(self.joined)


def weight_bytes(module: Llama, rows: int) -> int:
    """Bytes of the weights one step over `rows` rows reads: every matmul's weight (with its int8 scales) and every
    norm once, however many rows share them, and the `rows` rows of the embedding that the lookup reads (a tied LM
    head reads the whole table, as a matmul weight)."""
    linears = [m for m in module.modules() if hasattr(m, "in_features")]
    embedding = module.model.embed_tokens.weight
    matmul = {id(t): t for m in linears for t in (*m.parameters(), *m.buffers())}
    rest = {id(p): p for p in module.parameters() if id(p) not in matmul and p is not embedding}
    held = sum(t.numel() * t.element_size() for t in (*matmul.values(), *rest.values()))
    return held + rows * embedding.shape[1] * embedding.element_size()


def matmul_params(module: torch.nn.Module) -> int:
    """Weights that take part in a matmul: every Linear (the LM head included), not the embedding (a lookup of one
    row) nor the norms."""
    return sum(m.in_features * m.out_features for m in module.modules() if hasattr(m, "in_features"))


def flops(module: Llama, rows: list[tuple[int, int]]) -> int:
    """counting.step_flops for this module's shapes, rows = [(new positions, keys attended), ...]."""
    cfg, head = module.config, module.lm_head.in_features * module.lm_head.out_features
    return step_flops(matmul_params(module) - head, head, cfg.num_hidden_layers, cfg.num_attention_heads,
                      cfg.head_dim, rows)


MAX_SLOTS = 32


def check_batch(model: NativeModel, slots: int, longest: int, budget_bytes: int) -> None:
    """A batch this module can run within the session's memory budget, else one sentence: a native Llama, 1 to
    MAX_SLOTS slots, and the slot buffers, which double ahead and so may reserve up to twice the longest request's
    cache in every slot, within `budget_bytes`."""
    if not isinstance(model, NativeModel) or not isinstance(model.module, Llama):
        raise InputError("serving_needs_llama", model=model.info.name)
    if not 1 <= slots <= MAX_SLOTS:
        raise InputError("serving_slots", slots=slots)
    needed = 2 * slots * model.info.cache_bytes_formula(longest)
    if needed > budget_bytes:
        raise InputError("serving_budget", slots=slots, mb=round(needed / 2**20), budget=round(budget_bytes / 2**20))


class Server:
    """Iteration-level scheduling over `slots` slots of one SlotCache; `step()` runs one iteration."""

    def __init__(self, model: NativeModel, slots: int, requests: list[Request], budget_bytes: int):
        check_batch(model, slots, max(len(r.prompt_ids) + r.max_new_tokens for r in requests), budget_bytes)
        info = model.info
        self.model, self.info = model, info
        self.cache = SlotCache(info.n_layers, slots)
        self.waiting = list(requests)
        self.requests = {r.id: r for r in requests}
        self.holders: list[Request | None] = [None] * slots
        self.steps: list[ServeStep] = []
        self.clock_ms = 0.0

    @property
    def finished(self) -> bool:
        return not self.waiting and all(h is None for h in self.holders)

    def _emit(self, request: Request, token: int, step: int) -> None:
        request.new_ids.append(token)
        request.token_steps.append(step)
        request.token_ms.append(self.clock_ms)
        eos = self.info.eos_id
        if eos is not None and token == eos:
            request.stop_reason = "eos"
        elif len(request.new_ids) >= request.max_new_tokens:
            request.stop_reason = "max_new_tokens"
        elif len(request.prompt_ids) + len(request.new_ids) >= self.info.context_length:
            request.stop_reason = "context_full"

    @torch.inference_mode()
    def step(self) -> ServeStep:
        """Waiting requests take the free slots (each prefilled alone: its first token), then every request that was
        already running decodes one token in one batched pass; the finished ones leave."""
        index, device = len(self.steps), self.model.device
        joined, first_tokens, prefill_rows = [], [], []
        synchronize(device)
        t0 = time.perf_counter()
        for slot, holder in enumerate(self.holders):
            if holder is None and self.waiting:
                request = self.waiting.pop(0)
                solo = self.model.new_cache()
                logits, _ = self.model.forward(request.prompt_ids, solo, output_attentions=False)
                self.cache.load(slot, solo)
                request.slot, request.joined_step = slot, index
                self.holders[slot] = request
                joined.append(request)
                first_tokens.append(int(torch.argmax(logits)))
                prefill_rows.append((len(request.prompt_ids), len(request.prompt_ids)))
        synchronize(device)
        prefill_ms = (time.perf_counter() - t0) * 1000
        self.clock_ms += prefill_ms
        for request, token in zip(joined, first_tokens):
            self._emit(request, token, index)

        joined_ids = {r.id for r in joined}
        decoding = [h is not None and h.id not in joined_ids and h.stop_reason is None for h in self.holders]
        rows = max((s + 1 for s, d in enumerate(decoding) if d), default=0)
        lengths, decode_ms = [], 0.0
        if rows:
            # an idle row (a free slot below the last busy one) feeds token 0 at its length 0: its output is dropped
            tokens = [h.new_ids[-1] if decoding[s] else 0 for s, h in enumerate(self.holders[:rows])]
            lengths = [self.cache.lengths[s] + 1 for s in range(rows) if decoding[s]]
            t0 = time.perf_counter()
            logits = decode_rows(self.model.module, self.cache, tokens)  # (rows, vocab)
            synchronize(device)
            decode_ms = (time.perf_counter() - t0) * 1000
            self.clock_ms += decode_ms
            chosen = logits.argmax(-1).tolist()
            for s in range(rows):
                if decoding[s]:
                    self._emit(self.holders[s], chosen[s], index)
                else:  # a row that joined this step or an idle one gives back the position it was fed
                    self.cache.lengths[s] -= 1
        held = [h.id if h else None for h in self.holders]
        left = []
        for slot, holder in enumerate(self.holders):
            if holder is not None and holder.stop_reason is not None:
                holder.left_step = index
                left.append(holder.id)
                self.holders[slot] = None
                self.cache.free(slot)
        step = ServeStep(
            index=index, rows=rows, slots=held,
            joined=[r.id for r in joined], left=left, prefill_ms=prefill_ms, decode_ms=decode_ms,
            decode_lengths=lengths,
            decode_bytes=step_bytes(weight_bytes(self.model.module, rows),
                                    [self.info.cache_bytes_formula(n) for n in lengths]) if rows else 0,
            decode_flops=flops(self.model.module, [(1, n) for n in lengths]),
            prefill_tokens=sum(n for n, _ in prefill_rows), prefill_flops=flops(self.model.module, prefill_rows),
            prefill_bytes=sum(step_bytes(weight_bytes(self.model.module, n), [self.info.cache_bytes_formula(n)])
                              for n, _ in prefill_rows))
        self.steps.append(step)
        return step
