"""A server over a paged KV cache (paged.py): admission when blocks are free, preemption by recompute when a growing
request finds none, a prefix cache of full prompt blocks, and chunked prefill; every step one forward pass of the
model's own, its rows (prompt chunks and decodes) side by side, or with EngineSettings.mixed False (the Serving page)
each prompt's pass alone, then one pass of the decode rows, which gives the same tokens.

The scheduling follows nano-vllm's Scheduler (nanovllm/engine/scheduler.py) and vLLM's (vllm/v1/core/sched/
scheduler.py): each step the running requests first, in the order they were admitted (a decode needs one more
block when its position starts one; when none is free, the latest admitted request is preempted: its blocks freed,
back to the front of the queue, its positions computed again when it is admitted again, its tokens kept), then
the waiting ones in order of arrival, each admitted only when the blocks of every position it already has (its
prompt, after a preemption its tokens too) are free, less those the prefix cache gives it. A request's prompt is
prefilled whole in the step it is admitted, or with chunked prefill (Sarathi-Serve, vLLM's default) `chunk`
positions a step at most, together with the decode rows of that step.

With `offload` (tiers.py), a victim holding at least `swap_from` positions is preempted by swap instead (vLLM V0's
`_preempt_by_swap`): its blocks copied out to a slower tier, its computed positions kept; admitted again (first in
the queue, when the pool has its blocks free), its blocks come back and it goes on where it stopped. A victim the
tier cannot take (full, or its file could not be made) or whose blocks come back damaged is computed again, and the
step says why.

Every request's tokens are its solo run's, and with the decode kernels (float32 on a CPU, the packed linears) its
logits are too, bit for bit on any CPU they build on (tests/test_paged.py): every query of a pass (a prompt's chunk,
the rest after a prefix-cache hit, a decode, a preempted request's positions computed again) is attended in the
kernels over exactly the keys its solo run's pass attends it over, in the kernels' own order of sums
(kernels.attend_spans), and the products sum each row alone. A prompt's chunk still reads the keys of its whole
prompt (the ones not computed yet masked) and is two positions long at least, and a prefix-cache hit is a multiple of
paged.ALIGN positions, so that the paths off the kernels (torch's product and softmax: a bfloat16 model, a GPU, no
compiler) see the shapes of the prompt's one prefill (paged.py); only prompt blocks are cached (a written token's
keys come from a decode step, not a prefill). Gemma 3's GELU is torch's, whose rounding of a number can depend on
where it lies: its rows are their solo runs within that rounding (tests/test_batch.py, GELU_TOL).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model.engine.kernels import op_seconds
from model.engine.runtime import NativeModel, synchronize
from model.engine.sampling import SamplingSettings, check_settings_or_refuse
from model.errors import InputError
from model.serving.memory import (
    PoolView,
    check_memory,
    make_memory,
    memory_blocks,
    memory_layout,
    memory_slots,
    pool_dtype,
    too_small,
)
from model.serving.paged import PagedLayout, Row
from model.serving.request import Request
from model.serving.runner import run_rows
from model.serving.tiers import Offload, check_tier, tier_maker, tier_slots

MIN_CHUNK = 16     # positions of a prefill chunk at least
MAX_RUNNING = 128  # requests running at once at most, whatever the blocks allow (vLLM's max_num_seqs)


@dataclass(frozen=True)
class StepProgress:
    """Where a step is, told after each layer of each of its passes (with separate passes each prefill, then the
    decode pass; mixed, the one pass)."""
    step: int        # the step's index
    prefilled: int   # prefill passes done so far in this step
    prefills: int    # prefill passes the step runs in all (0 when mixed)
    rows: int        # rows of its decode pass (mixed: of its one pass; 0: none)
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

    def __init__(self, report: Callable[[StepProgress], None] | None, step: int, prefills: int, rows: int,
                 layers: int):
        self.report, self.step, self.prefilled, self.prefills = report, step, 0, prefills
        self.rows, self.layers = rows, layers
        self.paused = 0.0

    def clock(self) -> float:
        return time.perf_counter() - self.paused

    def after_layer(self, i: int) -> None:
        if self.report is not None:
            start = time.perf_counter()
            self.report(StepProgress(self.step, self.prefilled, self.prefills, self.rows, i + 1, self.layers))
            self.paused += time.perf_counter() - start


@dataclass(frozen=True)
class EngineSettings:
    memory: str = "paged"             # "paged": blocks of block_size | "padded": a slot per request (memory.py)
    kv_dtype: str = "float32"         # what the pool holds: "float32" (the model's own K and V) | "fp8" (e4m3)
    block_size: int = 16
    budget_bytes: int = 64 * 2**20
    prefix_cache: bool = False
    chunk: int | None = None  # positions of prompts a step prefills at most; None: every admitted prompt whole
    offload: str | None = None        # a preempted request's blocks to a second tier: "disk" | "host"; None: recompute
    tier_folder: str | None = None    # the disk tier's folder (None: the system's temporary one)
    tier_bytes: int | None = None     # the tier's size (None: as many blocks as the pool)
    swap_from: int | None = 0         # positions a victim holds from which it is moved out (None: never)
    history: int | None = None        # the last steps (and finished requests) kept; None: all (a queue's run), a
                                      # number: a server that runs for hours keeps its memory bounded
    mixed: bool = True                # True: a step's spans in one pass; False: each span that prefills in a pass
                                      # of its own, then the decode spans in one (nano-vllm never mixes the two in
                                      # a pass): the Serving page times each prefill and the decode batch apart


@dataclass(frozen=True)
class Span:
    """What a step computes for one request: positions start .. stop − 1."""
    request: int
    start: int
    stop: int
    kind: str  # "prefill" (its prompt, first time), "recompute" (after a preemption), "decode", "received" (its
               # prompt prefilled by another worker, its keys and values written into its blocks: no rows here)


@dataclass(frozen=True)
class Plan:
    """A step's schedule, made once: a step stopped midway runs the same plan again (its blocks stay allocated)."""
    spans: list[Span]
    admitted: list[int]
    preempted: list[int]
    cached_positions: dict[int, int]  # per admitted request, the positions the prefix cache gave it
    tier: list[tuple[int, str]]       # what the tier did: (request, "out" | "in" | why it was computed again instead)
    tier_ms: float                    # the moves' time


@dataclass(frozen=True)
class PassRecord:
    """One forward pass of a step: the spans it fed and its time."""
    kind: str         # "prefill" (prompts or recomputes only), "decode" (decode rows only), "mixed" (both)
    spans: list[Span]
    ms: float
    ops_ms: dict[str, float] = field(default_factory=dict)  # of ms, by kernels.OP_CLASSES (their clocks)

    @property
    def positions(self) -> int:
        return sum(s.stop - s.start for s in self.spans)


def pass_kind(spans: list[Span]) -> str:
    decoding = {span.kind == "decode" for span in spans}
    return "mixed" if len(decoding) == 2 else "decode" if True in decoding else "prefill"


@dataclass(frozen=True)
class StepRecord:
    index: int
    spans: list[Span]
    admitted: list[int]           # requests given blocks this step
    preempted: list[int]          # requests whose blocks were taken back this step, to compute again later
    left: list[int]               # requests that finished this step and freed their blocks
    cached_positions: dict[int, int]
    tier: list[tuple[int, str]]   # (request, "out" | "in" | "short" | "full" | "unwritable" | "damaged"): moved out,
                                  # moved back in, or computed again because it held fewer positions than swap_from,
                                  # the tier was full, its file could not be made, or a block came back damaged
    tier_ms: float                # moving blocks out and in
    received_ms: float            # waiting for and receiving prompts prefilled elsewhere (disaggregated.py)
    forward_ms: float             # the forward passes (the sum of passes' ms)
    draw_ms: float                # choosing the tokens
    tokens: int                   # new tokens the step produced
    running: int                  # requests holding blocks after the step
    blocks_held: int              # blocks some request holds after the step
    blocks_shared: int            # of them, held by more than one request
    bytes_reserved: int           # blocks held × block bytes, at the step's peak (before the finished left)
    bytes_held: int               # positions those blocks hold × bytes per position, then
    passes: list[PassRecord]      # the step's forward passes, in the order they ran
    slots: list[int | None] | None  # the padded memory's: per slot the request holding it during the step (None:
                                    # free); None for blocks

    @property
    def ms(self) -> float:
        return self.tier_ms + self.received_ms + self.forward_ms + self.draw_ms

    @property
    def prefill_positions(self) -> int:
        return sum(s.stop - s.start for s in self.spans if s.kind != "decode")


def smallest_budget(layout: PagedLayout, requests: list[Request]) -> int:
    """The bytes of the blocks the longest request holds at its longest (every position but its last token)."""
    longest = max(len(r.prompt_ids) + r.max_new_tokens - 1 for r in requests)
    return layout.request_blocks(longest) * layout.block_bytes


def longest_held(info, requests: list[Request]) -> int:
    """The positions the longest request holds at its longest (a server's open queue: the context)."""
    if not requests:
        return info.context_length
    return min(info.context_length, max(len(r.prompt_ids) + r.max_new_tokens for r in requests))


def check_paged(model: NativeModel, settings: EngineSettings, requests: list[Request]) -> None:
    """A block size that is a power of two within the context, a chunk of MIN_CHUNK positions to the context, and
    a budget that holds the longest request whole (else it could never run to its end), each refused in one
    sentence; what the padded memory does not have."""
    if not isinstance(model, NativeModel):
        raise InputError("serving_needs_native", model=model.info.name)
    check_memory(settings.memory, prefix_cache=settings.prefix_cache, chunk=settings.chunk,
                 offload=settings.offload, prefill_worker=False, kv_dtype=settings.kv_dtype)
    size, context = settings.block_size, model.info.context_length
    if size < 1 or size & (size - 1) or size > context:
        raise InputError("paged_block_size", size=size, context=context)
    if settings.chunk is not None and not MIN_CHUNK <= settings.chunk <= context:
        raise InputError("paged_chunk", chunk=settings.chunk, least=MIN_CHUNK, context=context)
    for request in requests:
        if len(request.prompt_ids) >= context:
            raise InputError("prompt_too_long", n=len(request.prompt_ids), context=context)
    layout = memory_layout(model.info, settings.memory, size, longest_held(model.info, requests), settings.kv_dtype)
    least = smallest_budget(layout, requests) if requests else layout.block_bytes
    if settings.budget_bytes < least:
        raise too_small(settings.memory, settings.budget_bytes, mib_up(least))
    for request in requests:
        check_settings_or_refuse(request.settings)
    if settings.offload is not None:
        check_tier(settings.offload, model.device)
        if settings.tier_bytes is not None and settings.tier_bytes < layout.block_bytes:
            raise InputError("tier_budget", budget_number=round(settings.tier_bytes / 2**20, 2),
                             least_number=mib_up(layout.block_bytes))


def mib_up(n_bytes: int) -> float:
    """Bytes as MiB, rounded up to 2 decimals (a budget of that many MiB holds them)."""
    return -(-n_bytes * 100 // 2**20) / 100


class Engine:
    """Iteration-level scheduling over one BlockMemory of settings.budget_bytes; `step()` runs one iteration."""

    def __init__(self, model: NativeModel, requests: list[Request], settings: EngineSettings):
        check_paged(model, settings, requests)
        self.model, self.info, self.settings = model, model.info, settings
        self.layout = memory_layout(model.info, settings.memory, settings.block_size,
                                    longest_held(model.info, requests), settings.kv_dtype)
        self.cache = make_memory(self.layout, memory_blocks(model.info, settings.memory, self.layout,
                                                            settings.budget_bytes),
                                 pool_dtype(settings.kv_dtype, model.kv_dtype), model.device)
        self.slots = memory_slots(settings.memory, self.layout, self.cache.n_blocks)  # None: blocks
        self.requests = {r.id: r for r in requests}
        self.waiting: deque[Request] = deque(sorted(requests, key=lambda r: r.arrival_step))
        self.running: list[Request] = []
        self.steps: list[StepRecord] = []
        self.steps_run = 0                     # steps taken since the start (self.steps may keep only the last)
        self.next_id = max(self.requests, default=-1) + 1
        self.plan: Plan | None = None
        self.clock_ms = 0.0
        self.offload: Offload | None = None
        # what brings a request's keys and values from outside the pool (disaggregated.PrefillConnector): step_begins
        # before each schedule (its ms), step_ends after each step, reset, close
        self.connector = None
        self.received_ms = 0.0  # this step's, so far
        if settings.offload is not None:
            slots = tier_slots(self.layout, settings.budget_bytes, settings.tier_bytes)
            self.offload = Offload(tier_maker(settings.offload, settings.tier_folder, slots, self.layout,
                                              self.cache.keys.dtype), self.layout.block_bytes, settings.swap_from)

    @property
    def finished(self) -> bool:
        return not self.waiting and not self.running

    def reset(self) -> None:
        """Every block back in the pool, every request waiting again from its start, the tier's slots free and its
        file deleted."""
        if self.connector is not None:
            self.connector.reset()
        self.cache.reset()
        if self.offload is not None:
            self.offload.reset()
        requests = [r.restart() for r in self.requests.values()]
        self.waiting = deque(sorted(requests, key=lambda r: r.arrival_step))
        self.running, self.plan, self.clock_ms, self.steps_run = [], None, 0.0, 0
        self.steps.clear()

    def close(self) -> None:
        """The tier's file deleted and the pool's memory let go (a run that ends keeps neither): the server takes no
        more steps."""
        if self.connector is not None:
            self.connector.close()
        if self.offload is not None:
            self.offload.close()
        self.cache.release()

    # -- requests arriving and leaving while it runs (a server's) --------------------------------------------------

    def add_request(self, prompt_ids: list[int], max_new_tokens: int,
                    settings: SamplingSettings | None = None, *, ignore_eos: bool = False) -> Request:
        """A request that arrives now (it is scheduled from the next step on), refused in one sentence (InputError)
        when it could never run here: a prompt that fills the context, sampling settings out of range, or more
        positions than the whole pool holds."""
        request = Request(self.next_id, list(prompt_ids), max_new_tokens, settings or SamplingSettings(),
                          arrival_step=self.steps_run, ignore_eos=ignore_eos)
        context = self.info.context_length
        if not prompt_ids:
            raise InputError("empty_prompt")
        if len(request.prompt_ids) >= context:
            raise InputError("prompt_too_long", n=len(request.prompt_ids), context=context)
        check_settings_or_refuse(request.settings)
        longest = min(context, request.prompt_len + max_new_tokens) - 1
        if self.layout.request_blocks(longest) > self.cache.n_blocks:
            raise InputError("paged_budget", budget_number=round(self.settings.budget_bytes / 2**20, 2),
                             least_number=mib_up(self.layout.request_blocks(longest) * self.layout.block_bytes))
        self.next_id += 1
        self.requests[request.id] = request
        self.waiting.append(request)
        return request

    def abort(self, request_id: int) -> bool:
        """The request ends now (stop_reason "abort"): its blocks back in the pool at once, its tier slots freed;
        False when it is not waiting or running. The plan of a step stopped midway is made again."""
        request = self.requests.get(request_id)
        if request is None or request.stop_reason is not None:
            return False
        if request in self.running:
            self.cache.free(request)
            self.running.remove(request)
        else:
            self.waiting.remove(request)
            if request.kv_at == "tier":
                self.offload.forget(request.id)
        request.stop_reason, request.left_step, request.first_logits = "abort", self.steps_run, None
        request.received_kv = None
        self.plan = None
        self._forget_finished([request])
        return True

    def _forget_finished(self, left: list[Request]) -> None:
        """With a bounded history, the finished requests are not kept (their callers hold them)."""
        if self.settings.history is not None:
            for request in left:
                self.requests.pop(request.id, None)

    # -- preemption ------------------------------------------------------------------------------------------------

    def _preempt(self, seq: Request, tier: list[tuple[int, str]]) -> None:
        """Its blocks out to the tier (its positions kept: its hashes too, so that the blocks it gets back, which the
        prefix cache does not know, are not cached again), or given back to be computed again."""
        rid = seq.id
        why = "off"
        if self.offload is not None:
            moved = self.offload.should_move(seq.computed)
            why = (self.offload.move_out(self.cache, rid) or "out") if moved else "short"
            tier.append((rid, why))
        hashes = seq.hashes
        self.cache.free(seq)
        if why == "out":
            seq.hashes, seq.kv_at = hashes, "tier"
        else:
            seq.computed = 0
        seq.preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _next_stop(self, seq: Request, budget: int | None) -> tuple[int | None, bool]:
        """Where its next span ends, and whether it is a decode (its prompt done, one token to compute)."""
        decoding = seq.computed == len(seq.tokens) - 1 and seq.computed >= seq.prompt_len
        return (seq.computed + 1 if decoding else self._chunk_end(seq, budget)), decoding

    def _swap_in(self, seq: Request, budget: int | None, tier: list[tuple[int, str]]) -> Span | bool | None:
        """A moved-out request first in the queue: its blocks back into the pool and its next span (None: too few
        blocks free, it waits), or False when a block came back damaged (its positions to compute again)."""
        rid = seq.id
        stop, decoding = self._next_stop(seq, budget)
        out = self.offload.out[rid]
        grown = sum(max(0, self.layout.blocks(stop) - len(table)) for table in out) if stop is not None else 0
        if stop is None or self.offload.blocks_held(rid) + grown > self.cache.pool.n_free:
            return None
        tables = self.offload.move_in(self.cache, rid)
        seq.kv_at = "here"
        if tables is None:
            tier.append((rid, "damaged"))
            seq.computed, seq.hashes = 0, []
            return False
        tier.append((rid, "in"))
        self.cache.tables[rid] = tables
        self.cache.grow(seq, stop)
        return self._span(seq, stop, decoding)

    # -- scheduling --------------------------------------------------------------------------------------------------

    def _chunk_end(self, seq: Request, budget: int | None) -> int | None:
        """Where the request's next span ends within `budget` positions (None: no limit), its prompt's part at least
        two positions (unless the prompt is one): a chunk of one query over a whole prompt's keys rounds differently
        from that row of the prompt's one prefill (measured on SmolLM2). None when the budget leaves no such end."""
        start, prompt, end = seq.computed, seq.prompt_len, len(seq.tokens)
        stop = end if budget is None else min(end, start + budget)
        if stop == prompt - 1 and start < stop:
            stop -= 1                                    # never leave the prompt's last position alone
        if stop <= start or (start < prompt and min(stop, prompt) - start < 2 and prompt > 1):
            return None
        return stop

    def _schedule(self, index: int) -> Plan:
        spans, admitted, preempted, cached, tier = [], [], [], {}, []
        moved_ms = self._moved_ms()
        budget = self.settings.chunk
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            stop, decoding = self._next_stop(seq, budget)
            if stop is None:
                i += 1
                continue
            while not self.cache.grow(seq, stop):
                victim = self.running[-1]
                self._preempt(victim, tier)
                preempted.append(victim.id)
                if victim is seq:
                    break
            else:
                spans.append(self._span(seq, stop, decoding))
                if not decoding and budget is not None:
                    budget -= stop - seq.computed
                i += 1
        for seq in self.waiting:
            if seq.arrival_step > index:
                break
            if seq.arrived_ms is None:
                seq.arrived_ms = self.clock_ms
        # none admitted in a step that preempted (vLLM's rule): the blocks just freed would take it straight back
        while (not preempted and self.waiting and self.waiting[0].arrival_step <= index
               and len(self.running) < MAX_RUNNING):
            seq = self.waiting[0]
            if seq.kv_at == "remote":
                if seq.received_kv is None or self.layout.request_blocks(len(seq.tokens)) > self.cache.pool.n_free:
                    break  # its prompt not here yet, or its blocks not free
                self.connector.load(self.cache, seq)
                self.waiting.popleft()
                self.running.append(seq)
                admitted.append(seq.id)
                cached[seq.id] = 0
                if seq.joined_step is None:
                    seq.joined_step = index
                spans.append(Span(seq.id, 0, seq.prompt_len, "received"))
                continue
            if seq.kv_at == "tier":
                span = self._swap_in(seq, budget, tier)
                if span is None:
                    break
                if span is not False:
                    self.waiting.popleft()
                    self.running.append(seq)
                    admitted.append(seq.id)
                    cached[seq.id] = 0
                    spans.append(span)
                    if budget is not None and span.kind != "decode":
                        budget -= span.stop - span.start
                    continue
            hit = self.cache.prefix_hit(seq) if self.settings.prefix_cache else [[] for _ in self.layout.groups]
            hit_positions = len(hit[0]) * self.layout.block_size
            seq.computed = hit_positions
            stop = self._chunk_end(seq, budget)
            if stop is None or not self.cache.can_admit(seq, hit):
                seq.computed = 0
                break  # admission waits for blocks (or for the next step's chunk)
            self.cache.admit(seq, hit)
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq.id)
            cached[seq.id] = hit_positions
            if seq.joined_step is None:
                seq.joined_step, seq.cached_positions = index, hit_positions
            spans.append(self._span(seq, stop, False))
            if budget is not None:
                budget -= stop - seq.computed
        return Plan(spans, admitted, preempted, cached, tier, self._moved_ms() - moved_ms)

    def _moved_ms(self) -> float:
        return 0.0 if self.offload is None else self.offload.moves.ms_out + self.offload.moves.ms_in

    def _span(self, seq: Request, stop: int, decoding: bool) -> Span:
        kind = "decode" if decoding else "recompute" if seq.preemptions and seq.new_ids else "prefill"
        return Span(seq.id, seq.computed, stop, kind)

    def _rows(self, span: Span, prompt_len: int) -> list[Row]:
        """A span as rows: its prompt's part one masked row, each position after it a row of its own."""
        rows = []
        if span.start < prompt_len:
            rows.append(Row(span.request, span.start, min(span.stop, prompt_len) - span.start, True, prompt_len))
        rows += [Row(span.request, p, 1, False, p + 1) for p in range(max(span.start, prompt_len), span.stop)]
        return rows

    # -- the step ----------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, report: Callable[[StepProgress], None] | None = None) -> StepRecord:
        """One iteration: schedule (once), the forward passes over the spans' rows (one mixed pass, or with
        settings.mixed False each prefilling span's pass, then the decodes'), each request that computed its last
        token draws the next; hashes, windows and the finished ones' blocks then. report(progress) runs after each
        layer and may stop the step there by raising (the page's Stop): the plan stays, and the next call runs its
        passes again whole (they write the same positions); their time is not counted."""
        index = self.steps_run
        if self.plan is None:
            if self.connector is not None:
                self.received_ms += self.connector.step_begins(self)
            if self.offload is not None:
                self.offload.step_begins()
            self.plan = self._schedule(index)
        plan = self.plan
        by_id = {seq.id: seq for seq in self.running}
        computed = [span for span in plan.spans if span.kind != "received"]
        rows_of = {span.request: self._rows(span, by_id[span.request].prompt_len) for span in computed}
        decodes = [span for span in computed if span.kind == "decode"]
        if self.settings.mixed:
            groups = [computed] if computed else []
            progress = Progress(report, index, 0, sum(map(len, rows_of.values())), self.info.n_layers)
        else:
            groups = [[span] for span in computed if span.kind != "decode"] + ([decodes] if decodes else [])
            progress = Progress(report, index, len(groups) - bool(decodes), len(decodes), self.info.n_layers)
        passes, last_logits = [], {}
        device = self.model.device
        for spans in groups:
            rows = [row for span in spans for row in rows_of[span.request]]
            ids = torch.tensor([[by_id[r.request].tokens[p] for r in rows for p in range(r.start, r.end)]],
                               device=device)                                             # (1, N)
            synchronize(device)
            t0, ops_before = progress.clock(), op_seconds()
            logits = run_rows(self.model.module, self.cache, rows, ids, progress.after_layer)  # (rows, vocab)
            synchronize(device)
            ops_ms = {op: (seconds - ops_before[op]) * 1000 for op, seconds in op_seconds().items()}
            passes.append(PassRecord(pass_kind(spans), spans, (progress.clock() - t0) * 1000, ops_ms))
            for n, row in enumerate(rows):
                last_logits[row.request] = logits[n]
            progress.prefilled += 1
        forward_ms = sum((p.ms for p in passes), 0.0)
        # from here on the step runs to its end: nothing below reports
        self.plan = None
        t0 = time.perf_counter()
        drawn = {}
        for span in plan.spans:
            seq = by_id[span.request]
            seq.computed = span.stop
            if span.kind == "received":
                drawn[span.request] = seq.choose(seq.first_logits.float())
                seq.first_logits = None
            elif span.stop == len(seq.tokens):
                drawn[span.request] = seq.choose(last_logits[span.request].float())
        draw_ms = (time.perf_counter() - t0) * 1000
        received_ms, self.received_ms = self.received_ms, 0.0
        self.clock_ms += plan.tier_ms + received_ms + forward_ms + draw_ms
        for request_id, token in drawn.items():
            by_id[request_id].emit(token, index, self.clock_ms, self.info.eos_id, self.info.context_length)
        if self.settings.prefix_cache:
            for span in plan.spans:
                self.cache.cache_blocks(by_id[span.request])
        for span in plan.spans:
            self.cache.free_out_of_window(by_id[span.request])
        reserved, held = self.cache.usage(self.running)
        slots = None if self.slots is None else self.cache.slot_holders(self.running, self.slots)
        held_blocks = len(self.cache.held_blocks())
        shared = self.cache.pool.shared()
        left = []
        for seq in list(self.running):
            if seq.stop_reason is not None:
                seq.left_step = index
                left.append(seq)
                self.cache.free(seq)
                self.running.remove(seq)
        self._forget_finished(left)
        left = [seq.id for seq in left]
        step = StepRecord(index, plan.spans, plan.admitted, plan.preempted, left, plan.cached_positions, plan.tier,
                         plan.tier_ms, received_ms, forward_ms, draw_ms, len(drawn), len(self.running) + len(left),
                         held_blocks, shared, reserved, held, passes, slots)
        self.steps.append(step)
        self.steps_run += 1
        if self.settings.history is not None and len(self.steps) > self.settings.history:
            del self.steps[0]
        if self.connector is not None:
            self.connector.step_ends(self)
        return step

    def pool_view(self) -> PoolView:
        return self.cache.view(self.running)
