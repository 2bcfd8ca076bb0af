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
from dataclasses import dataclass

import torch

from model.engine.counting import step_bytes
from model.engine.runtime import NativeModel, synchronize
from model.engine.sampling import check_settings_or_refuse
from model.errors import InputError
from model.serving.costs import flops, prefill_counts, weight_bytes
from model.serving.memory import MAX_SLOTS, make_memory
from model.serving.request import Request
from model.serving.slots import decode_rows

# -- the scheduler ------------------------------------------------------------------------------------------------

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
        self.memory = make_memory(info, slots=slots)
        self.cache = self.memory.cache
        self.waiting = list(requests)
        self.requests = {r.id: r for r in requests}
        self.joining: list[Request] = []  # the step under way's prefills done so far (a stopped step keeps them)
        self.steps: list[ServeStep] = []
        self.clock_ms = 0.0

    @property
    def finished(self) -> bool:
        return not self.waiting and all(h is None for h in self.memory.holders)

    def _emit(self, request: Request, token: int, step: int) -> None:
        request.emit(token, step, self.clock_ms, self.info.eos_id, self.info.context_length)

    def _arrived(self, step: int) -> int:
        """Waiting requests that have reached the server by `step` (the first ones: the queue is in arrival order),
        their arrival clock set when they first are."""
        arrived = 0
        for request in self.waiting:
            if request.arrival_step > step:
                break
            if request.arrived_ms is None:
                request.arrived_ms = self.clock_ms
            arrived += 1
        return arrived

    @torch.inference_mode()
    def step(self, report: Callable[[StepProgress], None] | None = None) -> ServeStep:
        """Waiting requests take the free slots (each prefilled alone: its first token), then every request that was
        already running decodes one token in one batched pass; the finished ones leave.
        report(progress), when given, runs after each layer of each pass and may stop the step there by raising
        (the Serving page's Stop): the prefills done keep their slots in `joining`, and the next call goes on from
        them (a decode pass stopped midway runs again whole); nothing else has changed. Its time is not counted."""
        index, device = len(self.steps), self.model.device
        joining = {r.id for r in self.joining}
        holders = self.memory.holders
        decoding = [h is not None and h.id not in joining and h.stop_reason is None for h in holders]
        rows = max((s + 1 for s, d in enumerate(decoding) if d), default=0)
        free = sum(h is None for h in holders)
        arrived = self._arrived(index)
        prefills = len(self.joining) + min(free, arrived)
        progress = Progress(report, index, len(self.joining), prefills, rows, self.info.n_layers)
        while self.waiting and self.waiting[0].arrival_step <= index and self.memory.can_admit(self.waiting[0], []):
            request = self.waiting[0]
            synchronize(device)
            t0 = progress.clock()
            solo = self.model.new_cache()
            logits, _ = self.model.forward(request.prompt_ids, solo, output_attentions=False,
                                           after_layer=progress.after_layer)
            self.memory.grow(request, len(request.prompt_ids))  # the first free slot, its whole length
            self.cache.load(request.slot, solo)
            synchronize(device)
            request.first_logits, request.prefill_ms = logits, (progress.clock() - t0) * 1000
            self.joining.append(request)
            self.waiting.pop(0)
            request.joined_step = index
            progress.prefilled += 1

        if rows:
            # an idle row (a free slot below the last busy one) feeds token 0 at its length 0: its output is dropped
            tokens = [h.new_ids[-1] if decoding[s] else 0 for s, h in enumerate(holders[:rows])]
            lengths = [self.cache.lengths[s] + 1 for s in range(rows) if decoding[s]]
            t0 = progress.clock()
            logits = decode_rows(self.model.module, self.cache, tokens, progress.after_layer)  # (rows, vocab)
            synchronize(device)
            decode_ms = (progress.clock() - t0) * 1000
        else:
            lengths, decode_ms = [], 0.0
        # from here on the step runs to its end: nothing below reports
        joined, self.joining = self.joining, []
        prefill_ms = sum(r.prefill_ms for r in joined)
        t0 = time.perf_counter()
        first_tokens = [r.choose(r.first_logits) for r in joined]
        draw_ms = (time.perf_counter() - t0) * 1000
        self.clock_ms += prefill_ms + draw_ms
        for request, token in zip(joined, first_tokens):
            request.first_logits = None
            self._emit(request, token, index)
        if rows:
            t0 = time.perf_counter()
            chosen = {s: holders[s].choose(logits[s]) for s in range(rows) if decoding[s]}
            row_draw_ms = (time.perf_counter() - t0) * 1000
            draw_ms += row_draw_ms
            self.clock_ms += decode_ms + row_draw_ms
            for s in range(rows):
                if decoding[s]:
                    self._emit(holders[s], chosen[s], index)
                else:  # a row that joined this step or an idle one gives back the position it was fed
                    self.cache.lengths[s] -= 1
        held = [h.id if h else None for h in holders]
        left = []
        for holder in list(holders):
            if holder is not None and holder.stop_reason is not None:
                holder.left_step = index
                left.append(holder.id)
                self.memory.free(holder)
        prefill_lengths = [len(r.prompt_ids) for r in joined]
        step = ServeStep(
            index=index, rows=rows, slots=held,
            joined=[r.id for r in joined], left=left, prefill_ms=prefill_ms,
            prefill_lengths=prefill_lengths, prefill_each_ms=[r.prefill_ms for r in joined], decode_ms=decode_ms,
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
