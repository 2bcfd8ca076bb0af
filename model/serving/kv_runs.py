"""A queue served to its end under one KV cache setting, by the one engine (engine.Engine) over a padded or a paged
memory (memory.py: a slot per request holding its whole length, or blocks as positions need them), and what that
run measured: requests at once, bytes reserved and held, the waste,
prefill positions, preemptions, tokens per second, each request's TTFT and ITL. serve-bench --queue and the Paged KV
page both read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from model.engine.kernels import OP_CLASSES
from model.engine.runtime import NativeModel
from model.serving.crossover import Crossover, measure_crossover
from model.serving.engine import Engine, EngineSettings, StepProgress, StepRecord, check_paged
from model.serving.memory import MEMORIES, check_memory, memory_layout, memory_slots
from model.serving.paged import PagedLayout
from model.serving.queues import compared_chunks
from model.serving.request import Request
from model.serving.tiers import check_tier_folder

LAYOUTS = MEMORIES
DEFAULT_PADDED_SLOTS = 4  # the mixed queue's default budget: what the padded cache needs for this many of its longest


@dataclass(frozen=True)
class KVSettings:
    layout: str = "paged"          # "padded" | "paged"
    block_size: int = 16
    budget_bytes: int = 0
    prefix_cache: bool = False
    chunk: int | None = None
    offload: str | None = None      # a preempted request's blocks to a second tier (tiers.py): "disk" | "host"
    tier_folder: str | None = None
    tier_bytes: int | None = None
    prefill_worker: str | None = None  # the model's name for a prefill worker of its own (disaggregated.py); None: one
                                       # process
    kv_dtype: str = "float32"          # what the pool holds (memory.POOL_DTYPES)

    @property
    def paged(self) -> EngineSettings:
        return EngineSettings(memory=self.layout, kv_dtype=self.kv_dtype, block_size=self.block_size,
                              budget_bytes=self.budget_bytes, prefix_cache=self.prefix_cache, chunk=self.chunk,
                              offload=self.offload, tier_folder=self.tier_folder, tier_bytes=self.tier_bytes)


def longest(requests: list[Request]) -> int:
    return max(len(r.prompt_ids) + r.max_new_tokens for r in requests)


def padded_slot_bytes(model: NativeModel, requests: list[Request]) -> int:
    """What a padded slot reserves: the longest request's whole length (its prompt and every token it may write) in
    every layer, a sliding one's too (a slot does not know windows: Gemma 3's is more than its cache formula)."""
    layout = memory_layout(model.info, "padded", 0, longest(requests))
    return len(layout.groups) * layout.block_bytes


def default_budget(model: NativeModel, queue: str, requests: list[Request], block_size: int) -> int:
    """mixed (padded against paged: a budget the padded cache runs short of): what DEFAULT_PADDED_SLOTS padded
    slots of its longest request need; the others (the prefix cache, chunks: not about memory): blocks for every
    request whole at once, so that none is preempted."""
    if queue == "mixed":
        return DEFAULT_PADDED_SLOTS * padded_slot_bytes(model, requests)
    layout = PagedLayout.of(model.info, block_size)
    return sum(layout.request_blocks(len(r.prompt_ids) + r.max_new_tokens - 1) for r in requests) * layout.block_bytes


@dataclass(frozen=True)
class Variant:
    """One setting a queue is compared under: `name` says which (paged, padded, prefix, no_prefix, chunks, whole),
    `chunk` its chunk size where it has one."""
    name: str
    settings: KVSettings
    chunk: int | None = None


def variants(queue: str, context_length: int, block_size: int, budget_bytes: int) -> list[Variant]:
    """What a built-in queue is there to compare, the first the one switched on: mixed, paged against padded and
    against a pool in fp8 (the same budget, more blocks); shared-prefix, the prefix cache against none; long-join,
    chunks of the smaller compared size, no chunks, chunks of the larger (queues.compared_chunks)."""
    paged = KVSettings("paged", block_size, budget_bytes)
    if queue == "mixed":
        return [Variant("paged", paged), Variant("padded", dataclasses.replace(paged, layout="padded")),
                Variant("paged_fp8", dataclasses.replace(paged, kv_dtype="fp8"))]
    if queue == "shared-prefix":
        return [Variant("prefix", dataclasses.replace(paged, prefix_cache=True)), Variant("no_prefix", paged)]
    small, large = compared_chunks(context_length)
    return [Variant("chunks", dataclasses.replace(paged, chunk=small), small), Variant("whole", paged),
            Variant("chunks", dataclasses.replace(paged, chunk=large), large)]


class QueueRun:
    """A fresh copy of `requests` served under `settings`, a step at a time; each step's StepRecord kept. With an
    offload, a victim is moved out from the crossover's positions: `crossover` when given (measured before on this
    machine for this model and block size: a page keeps one), else measured first."""

    def __init__(self, model: NativeModel, requests: list[Request], settings: KVSettings,
                 crossover: Crossover | None = None):
        self.model, self.settings = model, settings
        self.requests = [dataclasses.replace(r).restart() for r in requests]
        self.crossover: Crossover | None = None
        check_memory(settings.layout, prefix_cache=settings.prefix_cache, chunk=settings.chunk,
                     offload=settings.offload, prefill_worker=settings.prefill_worker is not None,
                     kv_dtype=settings.kv_dtype)
        engine = settings.paged
        if settings.offload is not None:
            check_paged(model, engine, self.requests)
            check_tier_folder(model, engine)  # the run's own tier said, before the crossover's scratch one
            self.crossover = crossover or measure_crossover(
                model, PagedLayout.of(model.info, settings.block_size), settings.offload, settings.tier_folder)
            engine = dataclasses.replace(engine, swap_from=self.crossover.positions)
        if settings.prefill_worker is not None:
            engine = dataclasses.replace(engine, prefill_worker=settings.prefill_worker)
        self.server = Engine(model, self.requests, engine)

    @property
    def steps(self) -> list[StepRecord]:
        return self.server.steps

    @property
    def finished(self) -> bool:
        return self.server.finished

    def run(self, report: Callable[[StepProgress], None] | None = None) -> QueueRun:
        while not self.finished:
            self.server.step(report)
        return self

    def close(self) -> None:
        """The pool let go and the tier's file deleted."""
        self.server.close()

    def reset(self) -> None:
        """Back to before the first step: every block back in the pool (the tier's file deleted), every request
        waiting."""
        self.server.reset()

    def summary(self) -> dict:
        """The run's `kv` object (serve-bench --json) with its tokens per second and TTFT / ITL percentiles."""
        steps, settings = self.steps, self.settings
        reserved = sum(s.bytes_reserved for s in steps)
        server = self.server
        clock_s = server.clock_ms / 1000
        ttfts = [r.ttft_ms for r in self.requests if r.ttft_ms is not None]
        itls = [gap for r in self.requests for gap in r.itl_ms]
        joined = [r.ttft_ms for r in self.requests if r.arrival_step > 0 and r.ttft_ms is not None]
        return {
            "layout": settings.layout, "kv_dtype": settings.kv_dtype, "block_size": server.layout.block_size,
            "budget_bytes": settings.budget_bytes, "prefix_cache": settings.prefix_cache, "chunk": settings.chunk,
            "pool_blocks": server.cache.n_blocks, "block_bytes": server.layout.block_bytes,
            "slots": memory_slots(settings.layout, server.layout, server.cache.n_blocks),
            "max_concurrent": max((s.running for s in steps), default=0),
            "bytes_reserved_peak": max((s.bytes_reserved for s in steps), default=0),
            "bytes_held_peak": max((s.bytes_held for s in steps), default=0),
            "waste_fraction": (reserved - sum(s.bytes_held for s in steps)) / reserved if reserved else 0.0,
            "shared_blocks": max((s.blocks_shared for s in steps), default=0),
            "prefill_positions_computed": sum(s.prefill_positions for s in steps),
            "preemptions": sum(len(s.preempted) for s in steps),
            "steps": len(steps),
            "tokens": sum(s.tokens for s in steps),
            "tokens_per_s": sum(s.tokens for s in steps) / clock_s if clock_s else 0.0,
            "ttft_ms_p50": float(np.percentile(ttfts, 50)) if ttfts else None,
            "itl_ms": itl_percentiles(itls),
            # the requests there from the start, and the TTFT of those that arrived later (long-join: the decodes
            # running when the long prompt joins, and that prompt's)
            "itl_ms_from_start": itl_percentiles([gap for r in self.requests if r.arrival_step == 0
                                                  for gap in r.itl_ms]),
            "ttft_ms_joined_p50": float(np.percentile(joined, 50)) if joined else None,
            "time_ms": time_split(steps),
            "ops_ms": op_split(steps),
            "offload": self.offload_summary(),
            "transfer": self.transfer_summary(),
        }

    def transfer_summary(self) -> dict | None:
        """Two workers: the bytes received (and the formula's), the time in recv, the prefill worker's forward
        time, how many prompts came over, and why the run went on alone if it did."""
        if self.settings.prefill_worker is None:
            return None
        transfers, failure = self.server.connector.transfers, self.server.connector.failure
        return {"bytes": sum(t.bytes for t in transfers), "bytes_formula": sum(t.bytes_formula for t in transfers),
                "ms": sum(t.ms for t in transfers), "prefill_ms": sum(t.prefill_ms for t in transfers),
                "prompts": len(transfers), "backend": self.server.connector.pairing.backend,
                "worker_device": self.server.connector.pairing.worker_device,
                "alone": None if failure is None else {"why": failure[0], "step": failure[1]}}

    def offload_summary(self) -> dict | None:
        """The tier: its kind and size, the bytes and blocks moved out and back in this run, the victims computed
        again and why, and the crossover measured before the run (per block: each point's time over its blocks,
        the median over the points)."""
        if self.crossover is None:
            return None
        offload, crossover = self.server.offload, self.crossover
        moves = offload.moves
        said = [what for step in self.server.steps for _, what in step.tier]
        return {
            "kind": offload.kind, "tier_bytes": offload.tier_bytes,
            "bytes": moves.blocks_out * offload.block_bytes, "blocks_out": moves.blocks_out,
            "blocks_in": moves.blocks_in,
            "ms_per_block_out": crossover.ms_per_block_out, "ms_per_block_in": crossover.ms_per_block_in,
            "recompute_ms_per_block": crossover.recompute_ms_per_block,
            "crossover_positions": crossover.positions,
            "run_ms_per_block_out": moves.ms_out / moves.blocks_out if moves.blocks_out else None,
            "run_ms_per_block_in": moves.ms_in / moves.blocks_in if moves.blocks_in else None,
            "recomputed": {why: said.count(why) for why in ("short", "full", "unwritable", "damaged")},
            "points": [{"positions": p.positions, "blocks": p.blocks, "out_ms": p.out_ms, "in_ms": p.in_ms,
                        "recompute_ms": p.recompute_ms} for p in crossover.points],
        }

    def request_rows(self) -> list[dict]:
        """Each request: its prompt ids, the tokens it wrote, TTFT and ITL (p50, p95, p99, max), why it stopped."""
        return [{"id": r.id, "arrival_step": r.arrival_step, "prompt_ids": r.prompt_ids, "tokens": r.new_ids,
                 "ttft_ms": r.ttft_ms, "itl_ms": itl_percentiles(r.itl_ms), "stop_reason": r.stop_reason,
                 "preemptions": r.preemptions} for r in self.requests]


def time_split(steps: list[StepRecord]) -> dict[str, float]:
    """Where a run's clock went, ms: the model's passes by kind (prompts alone, prompts with decode rows beside them,
    decode rows alone: PassRecord.kind), choosing the tokens, moving blocks to and from a tier, and waiting for and
    receiving prompts from a prefill worker."""
    passes = [p for s in steps for p in s.passes]
    return {**{f"forward_{kind}": sum((p.ms for p in passes if p.kind == kind), 0.0)
               for kind in ("prefill", "mixed", "decode")},
            "draws": sum(s.draw_ms for s in steps), "tier": sum(s.tier_ms for s in steps),
            "received": sum(s.received_ms for s in steps)}


def op_split(steps: list[StepRecord]) -> dict[str, dict[str, float]]:
    """Where the passes' time went, ms, by kind of pass (those that ran) and within each by kernels.OP_CLASSES, read
    off the kernels' own clocks (the products include the tile products torch runs for them), and "rest": the pass's
    time outside them (torch's ops, the cache's writes, Python between the calls)."""
    split = {}
    for kind in ("prefill", "mixed", "decode"):
        passes = [p for s in steps for p in s.passes if p.kind == kind]
        if passes:
            ops = {op: sum(p.ops_ms.get(op, 0.0) for p in passes) for op in OP_CLASSES}
            split[kind] = {**ops, "rest": max(sum(p.ms for p in passes) - sum(ops.values()), 0.0)}
    return split


def itl_percentiles(gaps: list[float]) -> dict[str, float | None]:
    if not gaps:
        return {"p50": None, "p95": None, "p99": None, "max": None}
    return {**{f"p{q}": float(np.percentile(gaps, q)) for q in (50, 95, 99)}, "max": float(max(gaps))}
