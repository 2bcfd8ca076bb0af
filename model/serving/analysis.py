"""What a served run measured: each request's TTFT and ITL, the roofline's points from its own steps, and its
longest prefill."""

from __future__ import annotations

from dataclasses import dataclass

from model.serving.costs import prefill_counts
from model.serving.scheduler import Server, ServeStep
from model.serving.timing import percentile


@dataclass(frozen=True)
class RequestTiming:
    id: int
    prompt_len: int
    tokens: int
    ttft_ms: float | None
    itl_ms: dict[str, float | None]   # p50, p95, p99
    stop_reason: str | None

def request_timings(server: Server) -> list[RequestTiming]:
    rows = []
    for r in server.requests.values():
        itl = r.itl_ms
        rows.append(RequestTiming(r.id, len(r.prompt_ids), len(r.new_ids), r.ttft_ms,
                                  {f"p{q}": percentile(itl, q) if itl else None for q in (50, 95, 99)},
                                  r.stop_reason))
    return rows

@dataclass(frozen=True)
class RooflinePoint:
    label: str        # "B=4", "prefill 64"
    intensity: float  # FLOPs per byte read
    gflops: float     # achieved
    gb_s: float       # achieved
    ms: float
    rows: int | None = None  # a decode pass's batch size; None for a prefill

def roofline_points(server: Server) -> list[RooflinePoint]:
    """One point per batch size the run's decode passes had (their median step), one for its longest prefill."""
    by_rows: dict[int, list[ServeStep]] = {}
    for step in server.steps:
        if step.decode_lengths:
            by_rows.setdefault(len(step.decode_lengths), []).append(step)
    points = []
    for rows, steps in sorted(by_rows.items()):
        typical = sorted(steps, key=lambda s: s.decode_ms)[len(steps) // 2]
        points.append(point(f"B={rows}", typical.decode_flops, typical.decode_bytes, typical.decode_ms, rows))
    longest = longest_prefill(server)
    if longest is not None:
        points.append(point(f"prefill {longest.positions}", longest.flops, longest.bytes_read, longest.ms))
    return points

@dataclass(frozen=True)
class TimedPrefill:
    positions: int
    ms: float
    bytes_read: int
    flops: int

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes_read

def longest_prefill(server: Server) -> TimedPrefill | None:
    """The run's longest prefill, the first of them when several are as long, with its own time (each joiner's
    prefill runs and is timed alone) and counts; None before any."""
    prefills = [(n, ms) for step in server.steps for n, ms in zip(step.prefill_lengths, step.prefill_each_ms)]
    if not prefills:
        return None
    n, ms = max(prefills, key=lambda p: p[0])
    return TimedPrefill(n, ms, *prefill_counts(server.model, n))

def point(label: str, flops: int, bytes_read: int, ms: float, rows: int | None = None) -> RooflinePoint:
    return RooflinePoint(label, flops / bytes_read, flops / (ms / 1000) / 1e9, bytes_read / (ms / 1000) / 1e9, ms,
                         rows)
