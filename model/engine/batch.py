"""Batched decode: B requests of different lengths in one forward pass, joining and leaving between steps.

A server does not run one sequence at a time: each step it feeds the next token of every running request through
the model together, so that the weights are read once for all of them (Orca's iteration-level scheduling, vLLM's
continuous batching). Here:

- `SlotCache` holds one request per slot: per layer K and V (slots, n_kv, capacity, d_head), right-padded, so slot s
  keeps its request's positions in the order a solo KVCache keeps them; on Gemma 3's sliding-window layers each slot
  keeps only its own window (and a margin), from a start of its own;
- `decode_rows` feeds one token per row, on the native Llama or Gemma 3: RoPE turns each row at its own position, and
  each row's query is attended over the keys of its own slot up to its own position alone (on a sliding layer only
  its own window), exactly the keys of its solo decode, never over the padding: with the linears' batch-invariant
  products (llama.Linear) every row's logits are its solo run's, bit for bit;
- `Server` schedules: a waiting request takes the first free slot, its prompt is prefilled alone (the solo code, so
  its first token is the solo run's), and from the next step on it decodes with the others; a request that
  finished (eos, its token budget, the context) leaves at once and frees its slot for the next one waiting. Each
  request draws its tokens with its own sampling settings and seed, as its solo run would (greedy by default).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model.engine.cache import KVCache, LayerBytes, cache_layer
from model.engine.counting import step_bytes, step_flops
from model.engine.llama import DecoderOnly, Llama, RowKeys
from model.engine.runtime import NativeModel, synchronize
from model.engine.sampling import SamplingSettings, check_settings_or_refuse, sample
from model.engine.stopping import stop_reason
from model.errors import InputError


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
        slots = torch.arange(rows, device=k.device)
        at = torch.tensor(index, device=k.device)                        # (rows,)
        self._keys[layer][slots, :, at] = k[:, :, 0]                      # (rows, n_kv, d_head)
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
    device = module.lm_head.weight.device
    cache.make_room(rows)
    positions = torch.tensor(cache.lengths[:rows], device=device)[:, None]  # (rows, 1) each row's own position
    ids = torch.tensor(tokens, device=device)[:, None]                      # (rows, 1)
    logits = module(ids, cache, positions=positions, keys=cache.row_keys(rows),
                    after_layer=after_layer).logits  # (rows, 1, vocab)
    cache.advance(rows)
    return logits[:, 0].float()                                             # (rows, vocab)


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
    stop_reason: str | None = None                        # "eos" | "context_full" | "max_new_tokens"
    # greedy by default; otherwise temperature → top-k → top-p with the request's own seed, as its solo run draws
    settings: SamplingSettings = field(default_factory=SamplingSettings)

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from this request's logits (vocab,): the argmax when greedy, else sampling.sample at the
        draw index of its solo run (generate.py draws its k-th token, counting from 0, at step k)."""
        if self.settings.greedy:
            return int(torch.argmax(logits))
        return sample(logits.float().cpu().numpy(), self.settings, len(self.new_ids)).chosen_id

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
    prefill_lengths: list[int]    # per joiner (in `joined`'s order), the positions its prefill fed
    prefill_each_ms: list[float]  # per joiner, its own prefill's time (each runs alone)
    decode_ms: float              # the batched decode pass
    draw_ms: float                # choosing every row's token from its logits (sampling's softmax and filters)
    decode_lengths: list[int]     # per decoding row, the keys its query attended over
    decode_bytes: int             # step_bytes of the decode pass: weights once + each row's cache
    decode_flops: int
    prefill_tokens: int           # prompt positions prefilled this step
    prefill_bytes: int            # each prefill reads the weights once and writes its request's cache
    prefill_flops: int

    @property
    def ms(self) -> float:
        return self.prefill_ms + self.decode_ms + self.draw_ms

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
    windows = [w for w in module.windows if w is not None]
    return step_flops(matmul_params(module) - head, head, cfg.num_hidden_layers, cfg.num_attention_heads,
                      cfg.head_dim, rows, len(windows), windows[0] if windows else None)


def prefill_counts(model: NativeModel, n: int) -> tuple[int, int]:
    """Bytes read and FLOPs of a prefill of n positions: it reads every weight once and writes n positions of
    cache; every position multiplies through the layers, the LM head runs on the last."""
    return (step_bytes(weight_bytes(model.module, n), [model.info.cache_bytes_formula(n)]),
            flops(model.module, [(n, n)]))


MAX_SLOTS = 32


def check_batch(model: NativeModel, slots: int, longest: int, budget_bytes: int) -> None:
    """A batch this module can run within the session's memory budget, else one sentence: the native engine (Llama
    or Gemma 3), 1 to MAX_SLOTS slots, and the slot buffers, which double ahead and so may reserve up to twice the
    longest request's cache in every slot (a sliding layer's window + 2 × CROP_MARGIN ≤ twice its window), within
    `budget_bytes`."""
    if not isinstance(model, NativeModel):
        raise InputError("serving_needs_native", model=model.info.name)
    if not 1 <= slots <= MAX_SLOTS:
        raise InputError("serving_slots", slots=slots)
    needed = 2 * slots * model.info.cache_bytes_formula(longest)
    if needed > budget_bytes:
        raise InputError("serving_budget", slots=slots, mb=round(needed / 2**20), budget=round(budget_bytes / 2**20))


@dataclass(frozen=True)
class StepProgress:
    """Where a step is, told after each layer of each of its passes (each joiner's prefill, then the decode pass)."""
    step: int        # the step's index
    prefilled: int   # prefills done so far in this step
    prefills: int    # prefills the step runs in all
    rows: int        # rows of its decode pass (0: none)
    layer: int       # layers done of the pass under way: a prefill's while prefilled < prefills, else the decode's
    layers: int

    @property
    def done(self) -> float:
        """The share of the step's passes done, a layer at a time."""
        passes = self.prefills + (1 if self.rows else 0)
        return min(1.0, (self.prefilled + self.layer / self.layers) / passes)


@dataclass
class Joiner:
    """A request prefilled into its slot in the step under way, its first token not drawn yet."""
    request: Request
    logits: torch.Tensor   # (vocab,) of its prompt's last position
    ms: float              # its prefill's own time


class Progress:
    """A step's `report`, told where the step is (`prefilled` so far, then block i of the pass under way done);
    `clock()` runs as time.perf_counter() but stands still while the report runs (it draws a page), so that no
    step's time counts it."""

    def __init__(self, report: Callable[[StepProgress], None] | None, step: int, prefilled: int, prefills: int,
                 rows: int, layers: int):
        self.report, self.step, self.prefilled, self.prefills = report, step, prefilled, prefills
        self.rows, self.layers = rows, layers
        self.paused = 0.0

    def clock(self) -> float:
        return time.perf_counter() - self.paused

    def after_layer(self, i: int) -> None:
        if self.report is not None:
            start = time.perf_counter()
            self.report(StepProgress(self.step, self.prefilled, self.prefills, self.rows, i + 1, self.layers))
            self.paused += time.perf_counter() - start


class Server:
    """Iteration-level scheduling over `slots` slots of one SlotCache; `step()` runs one iteration."""

    def __init__(self, model: NativeModel, slots: int, requests: list[Request], budget_bytes: int):
        check_batch(model, slots, max(len(r.prompt_ids) + r.max_new_tokens for r in requests), budget_bytes)
        for request in requests:
            check_settings_or_refuse(request.settings)
        info = model.info
        self.model, self.info = model, info
        self.cache = SlotCache(info.n_layers, slots, info.layer_windows)
        self.waiting = list(requests)
        self.requests = {r.id: r for r in requests}
        self.holders: list[Request | None] = [None] * slots
        self.joining: list[Joiner] = []   # the step under way's prefills done so far (a stopped step keeps them)
        self.steps: list[ServeStep] = []
        self.clock_ms = 0.0

    @property
    def finished(self) -> bool:
        return not self.waiting and all(h is None for h in self.holders)

    def _emit(self, request: Request, token: int, step: int) -> None:
        request.new_ids.append(token)
        request.token_steps.append(step)
        request.token_ms.append(self.clock_ms)
        # every token but the one just chosen has been fed
        request.stop_reason = stop_reason(token, self.info.eos_id, len(request.prompt_ids) + len(request.new_ids) - 1,
                                          self.info.context_length, len(request.new_ids), request.max_new_tokens)

    @torch.inference_mode()
    def step(self, report: Callable[[StepProgress], None] | None = None) -> ServeStep:
        """Waiting requests take the free slots (each prefilled alone: its first token), then every request that was
        already running decodes one token in one batched pass; the finished ones leave.
        report(progress), when given, runs after each layer of each pass and may stop the step there by raising
        (the Serving page's Stop): the prefills done keep their slots in `joining`, and the next call goes on from
        them (a decode pass stopped midway runs again whole); nothing else has changed. Its time is not counted."""
        index, device = len(self.steps), self.model.device
        joining = {j.request.id for j in self.joining}
        decoding = [h is not None and h.id not in joining and h.stop_reason is None for h in self.holders]
        rows = max((s + 1 for s, d in enumerate(decoding) if d), default=0)
        free = sum(h is None for h in self.holders)
        prefills = len(self.joining) + min(free, len(self.waiting))
        progress = Progress(report, index, len(self.joining), prefills, rows, self.info.n_layers)
        for slot, holder in enumerate(self.holders):
            if holder is None and self.waiting:
                request = self.waiting[0]
                synchronize(device)
                t0 = progress.clock()
                solo = self.model.new_cache()
                logits, _ = self.model.forward(request.prompt_ids, solo, output_attentions=False,
                                               after_layer=progress.after_layer)
                self.cache.load(slot, solo)
                synchronize(device)
                self.joining.append(Joiner(request, logits, (progress.clock() - t0) * 1000))
                self.waiting.pop(0)
                request.slot, request.joined_step = slot, index
                self.holders[slot] = request
                progress.prefilled += 1

        if rows:
            # an idle row (a free slot below the last busy one) feeds token 0 at its length 0: its output is dropped
            tokens = [h.new_ids[-1] if decoding[s] else 0 for s, h in enumerate(self.holders[:rows])]
            lengths = [self.cache.lengths[s] + 1 for s in range(rows) if decoding[s]]
            t0 = progress.clock()
            logits = decode_rows(self.model.module, self.cache, tokens, progress.after_layer)  # (rows, vocab)
            synchronize(device)
            decode_ms = (progress.clock() - t0) * 1000
        else:
            lengths, decode_ms = [], 0.0
        # from here on the step runs to its end: nothing below reports
        joined, self.joining = self.joining, []
        prefill_ms = sum(j.ms for j in joined)
        t0 = time.perf_counter()
        first_tokens = [j.request.choose(j.logits) for j in joined]
        draw_ms = (time.perf_counter() - t0) * 1000
        self.clock_ms += prefill_ms + draw_ms
        for j, token in zip(joined, first_tokens):
            self._emit(j.request, token, index)
        if rows:
            t0 = time.perf_counter()
            chosen = {s: self.holders[s].choose(logits[s]) for s in range(rows) if decoding[s]}
            row_draw_ms = (time.perf_counter() - t0) * 1000
            draw_ms += row_draw_ms
            self.clock_ms += decode_ms + row_draw_ms
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
        prefill_lengths = [len(j.request.prompt_ids) for j in joined]
        step = ServeStep(
            index=index, rows=rows, slots=held,
            joined=[j.request.id for j in joined], left=left, prefill_ms=prefill_ms,
            prefill_lengths=prefill_lengths, prefill_each_ms=[j.ms for j in joined], decode_ms=decode_ms,
            draw_ms=draw_ms,
            decode_lengths=lengths,
            decode_bytes=step_bytes(weight_bytes(self.model.module, rows),
                                    [self.info.cache_bytes_formula(n) for n in lengths]) if rows else 0,
            decode_flops=flops(self.model.module, [(1, n) for n in lengths]),
            prefill_tokens=sum(prefill_lengths),
            prefill_bytes=sum(prefill_counts(self.model, n)[0] for n in prefill_lengths),
            prefill_flops=sum(prefill_counts(self.model, n)[1] for n in prefill_lengths))
        self.steps.append(step)
        return step
