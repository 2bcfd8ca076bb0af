"""The serving engine (nano-vllm's LLMEngine and Scheduler, vLLM v1's Scheduler): requests added, stepped, aborted.
Each step schedules the running requests first (grown, or the latest admitted preempted: computed again later, or
with `offload` moved out to a tier, tiers.py), then the waiting ones in order of arrival (received from a prefill
worker, moved back in, a prefix-cache hit, a whole prompt or a chunk), and runs their rows in one forward pass
(runner.py). docs/serving.md (Serving II and III) says how, and why every request's tokens are its solo run's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model.engine.kernels import op_seconds
from model.engine.runtime import ModelInfo, NativeModel, synchronize
from model.engine.sampling import SamplingSettings, check_settings_or_refuse
from model.errors import InputError
from model.serving.disaggregated import PrefillConnector
from model.serving.memory import (
    BlockMemory,
    PoolView,
    check_memory,
    memory_blocks,
    memory_layout,
    memory_slots,
    mib_up,
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
    """Where a step is, told after each layer of each of its passes."""
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
    """A step's `report`, told after each layer; `clock()` stands still while the report runs (it draws a page), so
    that no step's time counts it."""

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
    prefill_worker: str | None = None  # the model a prefill worker of its own loads (disaggregated.py); None: here
    tier_folder: str | None = None    # the disk tier's folder (None: the system's temporary one)
    tier_bytes: int | None = None     # the tier's size (None: as many blocks as the pool)
    swap_from: int | None = 0         # positions a victim holds from which it is moved out (None: never)
    history: int | None = None        # the last steps (and finished requests) kept; None: all (a queue's run)
    mixed: bool = True                # False: each prefilling span in a pass of its own, then the decodes in one


@dataclass(frozen=True)
class Span:
    """What a step computes for one request: positions start .. stop − 1."""
    request: int
    start: int
    stop: int
    kind: str  # "prefill" | "recompute" (after a preemption) | "decode" | "received" (from a prefill worker: no rows)


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
    tier: list[tuple[int, str]]   # (request, "out" | "in" | why it was computed again instead: "short" | "full" |
                                  # "unwritable" | "damaged")
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
    slots: list[int | None] | None  # the padded memory's: per slot its request (None: free); None for blocks

    @property
    def ms(self) -> float:
        return self.tier_ms + self.received_ms + self.forward_ms + self.draw_ms

    @property
    def prefill_positions(self) -> int:
        return sum(s.stop - s.start for s in self.spans if s.kind != "decode")


def longest_held(info, requests: list[Request]) -> int:
    """The positions the longest request holds at its longest (a server's open queue: the context)."""
    if not requests:
        return info.context_length
    return min(info.context_length, max(len(r.prompt_ids) + r.max_new_tokens for r in requests))


def check_requests(info: ModelInfo, layout: PagedLayout, settings: EngineSettings, requests: list[Request]) -> None:
    """Requests the engine could never run to their end under `settings`, refused in one sentence: no prompt, a
    prompt the context cannot hold, sampling settings out of range, a budget under the longest one's blocks."""
    for request in requests:
        if not request.prompt_ids:
            raise InputError("empty_prompt")
        if request.prompt_len >= info.context_length:
            raise InputError("prompt_too_long", n=request.prompt_len, context=info.context_length)
        check_settings_or_refuse(request.settings)
    longest = max((min(info.context_length, r.prompt_len + r.max_new_tokens) - 1 for r in requests),
                  default=0)  # its last token unfed
    least = layout.request_blocks(longest) * layout.block_bytes if requests else layout.block_bytes
    if settings.budget_bytes < least:
        raise too_small(settings.memory, settings.budget_bytes, mib_up(least))


def check_paged(model: NativeModel, settings: EngineSettings, requests: list[Request]) -> None:
    """Settings and requests the engine could never run to their end, refused in one sentence each."""
    if not isinstance(model, NativeModel):
        raise InputError("serving_needs_native", model=model.info.name)
    check_memory(settings.memory, prefix_cache=settings.prefix_cache, chunk=settings.chunk,
                 offload=settings.offload, prefill_worker=settings.prefill_worker is not None,
                 kv_dtype=settings.kv_dtype)
    size, context = settings.block_size, model.info.context_length
    if size < 1 or size & (size - 1) or size > context:
        raise InputError("paged_block_size", size=size, context=context)
    if settings.chunk is not None and not MIN_CHUNK <= settings.chunk <= context:
        raise InputError("paged_chunk", chunk=settings.chunk, least=MIN_CHUNK, context=context)
    layout = memory_layout(model.info, settings.memory, size, longest_held(model.info, requests), settings.kv_dtype)
    check_requests(model.info, layout, settings, requests)
    if settings.offload is not None:
        check_tier(settings.offload, model.device)
        if settings.tier_bytes is not None and settings.tier_bytes < layout.block_bytes:
            raise InputError("tier_budget", budget_number=round(settings.tier_bytes / 2**20, 2),
                             least_number=mib_up(layout.block_bytes))


class Engine:
    """Iteration-level scheduling over one BlockMemory of settings.budget_bytes; `step()` runs one iteration."""

    def __init__(self, model: NativeModel, requests: list[Request], settings: EngineSettings):
        check_paged(model, settings, requests)
        self.model, self.info, self.settings = model, model.info, settings
        self.layout = memory_layout(model.info, settings.memory, settings.block_size,
                                    longest_held(model.info, requests), settings.kv_dtype)
        self.cache = BlockMemory(self.layout, memory_blocks(model.info, settings.memory, self.layout,
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
        self.received_ms = 0.0  # this step's, so far
        if settings.offload is not None:
            slots = tier_slots(self.layout, settings.budget_bytes, settings.tier_bytes)
            self.offload = Offload(tier_maker(settings.offload, settings.tier_folder, slots, self.layout,
                                              self.cache.keys.dtype), self.layout.block_bytes, settings.swap_from)
        # what brings a request's keys and values from outside the pool: its worker started once the checks passed
        self.connector = None if settings.prefill_worker is None else PrefillConnector(
            model, settings.prefill_worker, settings.block_size)

    @property
    def finished(self) -> bool:
        return not self.waiting and not self.running

    def reset(self) -> None:
        """Every block back in the pool, every request waiting again from its start, the tier emptied."""
        if self.connector is not None:
            self.connector.reset()
        self.cache.reset()
        if self.offload is not None:
            self.offload.reset()
        requests = [r.restart() for r in self.requests.values()]
        self.waiting = deque(sorted(requests, key=lambda r: r.arrival_step))
        self.running, self.plan, self.clock_ms, self.steps_run, self.received_ms = [], None, 0.0, 0, 0.0
        self.steps.clear()

    def close(self) -> None:
        """The tier's file deleted and the pool's memory let go: the engine takes no more steps."""
        if self.connector is not None:
            self.connector.close()
        if self.offload is not None:
            self.offload.close()
        self.cache.release()

    def add_request(self, prompt_ids: list[int], max_new_tokens: int,
                    settings: SamplingSettings | None = None, *, ignore_eos: bool = False) -> Request:
        """A request that arrives now (scheduled from the next step on); InputError when it could never run here."""
        request = Request(self.next_id, list(prompt_ids), max_new_tokens, settings or SamplingSettings(),
                          arrival_step=self.steps_run, ignore_eos=ignore_eos)
        check_requests(self.info, self.layout, self.settings, [request])
        self.next_id += 1
        self.requests[request.id] = request
        self.waiting.append(request)
        return request

    def abort(self, request_id: int) -> bool:
        """The request ends now (stop_reason "abort"), its blocks and tier slots freed; False when it is not waiting
        or running. The plan of a step stopped midway is made again."""
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

    # -- scheduling ------------------------------------------------------------------------------------------------

    def _preempt(self, seq: Request, tier: list[tuple[int, str]]) -> None:
        """Its blocks out to the tier (its positions and hashes kept: the blocks it gets back are not cached again),
        or given back to be computed again."""
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

    def _bring_in(self, seq: Request, budget: int | None, tier: list[tuple[int, str]]) -> Span | bool | None:
        """A request whose blocks are coming, loaded into blocks of the pool by its connector (vLLM's KV connector),
        and its span: the prompt received whole from the prefill worker, or the next span of one moved back in from
        the tier. None: they are not here yet or too few blocks are free (it waits); False: they came back damaged
        (computed again)."""
        received = seq.kv_at == "remote"
        stop, decoding = (seq.prompt_len, False) if received else self._next_stop(seq, budget)
        connector = self.connector if received else self.offload
        needed = None if stop is None else connector.blocks_coming(self.cache, seq, stop)
        if needed is None or needed > self.cache.pool.n_free:
            return None
        loaded = connector.load(self.cache, seq)
        if received:
            return Span(seq.id, 0, stop, "received")
        tier.append((seq.id, "in" if loaded else "damaged"))
        if not loaded:
            return False
        self.cache.grow(seq, stop)
        return self._span(seq, stop, decoding)

    def _chunk_end(self, seq: Request, budget: int | None) -> int | None:
        """Where the request's next span ends within `budget` positions (None: no limit), its prompt's part two
        positions at least unless the prompt is one (docs/serving.md); None when the budget leaves no such end."""
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

        def budget() -> int | None:
            """The chunk's positions the spans so far leave (None: no chunk)."""
            if self.settings.chunk is None:
                return None
            return self.settings.chunk - sum(s.stop - s.start for s in spans if s.kind not in ("decode", "received"))

        def start_running(seq: Request, span: Span, hit_positions: int) -> None:
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq.id)
            cached[seq.id] = hit_positions
            if seq.joined_step is None:
                seq.joined_step, seq.cached_positions = index, hit_positions
            spans.append(span)

        i = 0
        while i < len(self.running):
            seq = self.running[i]
            stop, decoding = self._next_stop(seq, budget())
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
            if seq.kv_at != "here":
                span = self._bring_in(seq, budget(), tier)
                if span is None:
                    break  # its blocks not here yet, or not free
                if span is not False:
                    start_running(seq, span, 0)
                    continue
            hit = self.cache.prefix_hit(seq) if self.settings.prefix_cache else [[] for _ in self.layout.groups]
            hit_positions = len(hit[0]) * self.layout.block_size
            seq.computed = hit_positions
            stop = self._chunk_end(seq, budget())
            if stop is None or not self.cache.can_admit(seq, hit):
                seq.computed = 0
                break  # admission waits for blocks (or for the next step's chunk)
            self.cache.admit(seq, hit)
            start_running(seq, self._span(seq, stop, False), hit_positions)
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
        """One iteration: schedule (once), the forward passes over the spans' rows, each request that computed its
        last token draws the next; hashes, windows and the finished ones' blocks then. report(progress) runs after
        each layer and may stop the step by raising (the page's Stop): the plan stays, and the next call runs its
        passes again whole (they write the same positions)."""
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
        left = [seq for seq in self.running if seq.stop_reason is not None]
        for seq in left:
            seq.left_step = index
            self.cache.free(seq)
            self.running.remove(seq)
        self._forget_finished(left)
        step = StepRecord(index, plan.spans, plan.admitted, plan.preempted, [seq.id for seq in left],
                          plan.cached_positions, plan.tier, plan.tier_ms, received_ms, forward_ms, draw_ms, len(drawn),
                          len(self.running) + len(left), held_blocks, shared, reserved, held, passes, slots)
        self.steps.append(step)
        self.steps_run += 1
        if self.settings.history is not None and len(self.steps) > self.settings.history:
            del self.steps[0]
        if self.connector is not None:
            self.connector.step_ends(self)
        return step

    def pool_view(self) -> PoolView:
        return self.cache.view(self.running)
