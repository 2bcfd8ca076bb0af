"""The crossover from which moving a request's blocks out to a tier and back beats recomputing its positions,
measured on this machine (docs/serving.md, "Serving III"): a measurement above the engine, which never calls it; the
Tiers page and QueueRun read it."""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field

import torch

from model.engine.runtime import NativeModel
from model.errors import InputError
from model.serving.paged import PagedCache, PagedLayout
from model.serving.runner import prompt_alone, run_rows
from model.serving.tiers import Offload, check_tier, held, tier_maker
from model.serving.timing import timed

CROSSOVER_MOST_POSITIONS = 512  # the longest recompute timed (a prefill of 512 positions: about a second of SmolLM2)
CROSSOVER_REPEATS = 3           # each point's times: the median of this many


@dataclass(frozen=True)
class CrossoverPoint:
    positions: int
    blocks: int          # the blocks those positions fill in every group's table
    out_ms: float        # moving them out (medians)
    in_ms: float         # and back
    recompute_ms: float  # a prefill of the positions, one pass

    @property
    def round_trip_ms(self) -> float:
        return self.out_ms + self.in_ms


@dataclass(frozen=True)
class Crossover:
    """Times measured on this machine by positions, and what follows from them."""
    points: tuple[CrossoverPoint, ...]
    kind: str
    block_bytes: int
    block_size: int
    conditions: dict = field(default_factory=dict)

    @property
    def ms_per_block_out(self) -> float:
        return statistics.median(p.out_ms / p.blocks for p in self.points)

    @property
    def ms_per_block_in(self) -> float:
        return statistics.median(p.in_ms / p.blocks for p in self.points)

    @property
    def recompute_ms_per_block(self) -> float:
        return statistics.median(p.recompute_ms / p.blocks for p in self.points)

    @property
    def positions(self) -> int | None:
        """The fewest measured positions from which a move out and back beat the recompute at every larger measured
        point; None when it did not at the largest."""
        found = None
        for point in reversed(self.points):
            if point.round_trip_ms >= point.recompute_ms:
                break
            found = point.positions
        return found


def crossover_positions(context_length: int, block_size: int) -> list[int]:
    """One block, two, four... up to CROSSOVER_MOST_POSITIONS and the context − 1 (which a block may pass)."""
    most = min(context_length - 1, CROSSOVER_MOST_POSITIONS)
    points, n = [], block_size
    while n < most:
        points.append(n)
        n *= 2
    return points + [most]


def round_trip(offload: Offload, cache: PagedCache) -> tuple[float, float]:
    """Request 0's blocks out to the tier and back into the pool: the ms of each way."""
    before = (offload.moves.ms_out, offload.moves.ms_in)
    offload.move_out(cache, 0)
    cache.pool.free(held(cache.tables[0]))
    cache.tables[0] = offload.move_in(cache, 0)
    return offload.moves.ms_out - before[0], offload.moves.ms_in - before[1]


@torch.inference_mode()
def measure_crossover(model: NativeModel, layout: PagedLayout, kind: str, folder: str | None,
                      said_bytes: int | None = None) -> Crossover:
    """Each point's move out and back (through a scratch tier, deleted after) and recompute (the same positions'
    prefill, the runner's pass), CROSSOVER_REPEATS times after a warm-up. A folder that cannot take the scratch tier
    is refused naming `said_bytes` where given (the run's own tier, which is larger)."""
    check_tier(kind, model.device)
    points = crossover_positions(model.info.context_length, layout.block_size)
    blocks = layout.request_blocks(points[-1])
    dtype, device = model.kv_dtype, model.device
    try:
        offload = Offload(tier_maker(kind, folder, blocks, layout, dtype), layout.block_bytes, 0)
    except InputError as refused:
        if said_bytes is None or refused.code != "tier_unwritable":
            raise
        raise InputError("tier_unwritable", **{**refused.details, "mib_number": round(said_bytes / 2**20, 2)}) from None
    cache = PagedCache(layout, blocks, dtype, device)
    ids = torch.randint(4, model.info.vocab_size, (1, points[-1]), generator=torch.Generator().manual_seed(0))
    measured, trips = [], []  # trips: after each recompute, a round trip's (out, in) ms
    try:
        for n in points:
            trips.clear()
            recompute = timed(device, functools.partial(run_rows, model.module, cache, prompt_alone(cache, n),
                                                        ids[:, :n].to(device)),
                              CROSSOVER_REPEATS, lambda: trips.append(round_trip(offload, cache)))
            out, back = zip(*trips[1:])  # the first followed the warm-up
            measured.append(CrossoverPoint(n, layout.request_blocks(n), statistics.median(out),
                                           statistics.median(back), statistics.median(recompute)))
    finally:
        offload.close()
    return Crossover(tuple(measured), offload.kind, layout.block_bytes, layout.block_size,
                     {"threads": torch.get_num_threads(), "device": str(device), "repeats": CROSSOVER_REPEATS})
