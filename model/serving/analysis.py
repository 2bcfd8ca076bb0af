"""What a served run measured: each request's TTFT and ITL, the roofline's points from its own passes (an engine
whose prompts run in passes of their own: EngineSettings.mixed False), and its longest prefill."""

from __future__ import annotations

from dataclasses import dataclass

from model.engine.counting import step_bytes
from model.serving.costs import flops, prefill_counts, weight_bytes
from model.serving.engine import Engine, PassRecord
from model.serving.timing import percentile


@dataclass(frozen=True)
class RequestTiming:
    id: int
    prompt_len: int
    tokens: int
    ttft_ms: float | None
    itl_ms: dict[str, float | None]   # p50, p95, p99
    stop_reason: str | None

def request_timings(server: Engine) -> list[RequestTiming]:
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

def passes(server: Engine, kind: str) -> list[PassRecord]:
    return [p for step in server.steps for p in step.passes if p.kind == kind]

def decode_counts(server: Engine, decode: PassRecord) -> tuple[int, int]:
    """A decode pass's FLOPs and bytes read (the weights once, each row's cache of the keys its query attends
    over)."""
    module = server.model.module
    lengths = [span.stop for span in decode.spans]
    return (flops(module, [(1, n) for n in lengths]),
            step_bytes(weight_bytes(module, len(lengths)), [server.info.cache_bytes_formula(n) for n in lengths]))

def roofline_points(server: Engine) -> list[RooflinePoint]:
    """One point per batch size the run's decode passes had (their median pass), one for its longest prefill."""
    by_rows: dict[int, list[PassRecord]] = {}
    for decode in passes(server, "decode"):
        by_rows.setdefault(len(decode.spans), []).append(decode)
    points = []
    for rows, same in sorted(by_rows.items()):
        typical = sorted(same, key=lambda p: p.ms)[len(same) // 2]
        points.append(point(f"B={rows}", *decode_counts(server, typical), typical.ms, rows))
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

def longest_prefill(server: Engine) -> TimedPrefill | None:
    """The run's longest prefill pass, the first of them when several are as long, with its own time (each prompt
    runs in a pass of its own) and counts; None before any."""
    prefills = passes(server, "prefill")
    if not prefills:
        return None
    longest = max(prefills, key=lambda p: p.positions)
    return TimedPrefill(longest.positions, longest.ms, *prefill_counts(server.model, longest.positions))

def point(label: str, flops: int, bytes_read: int, ms: float, rows: int | None = None) -> RooflinePoint:
    return RooflinePoint(label, flops / bytes_read, flops / (ms / 1000) / 1e9, bytes_read / (ms / 1000) / 1e9, ms,
                         rows)
