"""A built-in queue served to its end against this machine's roofs (issue 52's "within 2× of the compute roof"): the
queue's FLOPs by the project's cost model (costs.flops over every step's spans: prompts, chunks, recomputes, decodes)
÷ the matmul peak measured beside it, and the roofline bound of its steps (each step at least its FLOPs at the peak
and its bytes at the read rate: every weight once, each row's keys and values), against the engine's clock.

    .venv/bin/python benchmarks/queue_roof.py [--model smollm2] [--queue mixed]
        [--dtype float32|bfloat16|bfloat16-weights] [--tiles] [--threads 1] [--budget-mb 200] [--solo]

With --tiles a pass of llama.TILE_ROWS rows or more multiplies on the AMX tiles, so its roof is the bfloat16 peak
(torch's 1024 × 1024 bfloat16 matmul, oneDNN's tiles), a smaller pass's the peak of its arithmetic (bfloat16-weights
sums in float32: torch's float32 peak, above the kernels' own); the compute roof is printed at the float32 peak too,
the one a float32 queue is held to. --solo then serves each request alone in the same mode and counts the requests
whose tokens are those they had in the queue (with --tiles a row's bits depend on the rows beside it). Not part of
./dev test.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch
from conditions import ROOT, code_version, cpu_name

from model.engine.counting import step_bytes
from model.engine.loading import load_model
from model.engine.lowbit import ACTIVATIONS, tile_rows, with_weights
from model.serving.costs import flops, weight_bytes
from model.serving.engine import Engine, EngineSettings
from model.serving.measure import measure_machine, with_matmul_peak
from model.serving.queues import built_in_queue


def step_work(model, step) -> tuple[int, int, int]:
    """A step's positions fed, FLOPs and bytes read (every weight once, each span's keys and values)."""
    rows = [(s.stop - s.start, s.stop) for s in step.spans if s.kind != "received"]
    positions = sum(n for n, _ in rows)
    read = step_bytes(weight_bytes(model.module, positions), [model.info.cache_bytes_formula(end) for _, end in rows])
    return positions, flops(model.module, rows), read


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--queue", default="mixed")
    parser.add_argument("--dtype", default="float32", choices=tuple(d for d in ACTIVATIONS if d != "int8"))
    parser.add_argument("--tiles", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget-mb", type=float, default=200)
    parser.add_argument("--solo", action="store_true", help="also serve each request alone and compare its tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = with_weights(load_model(args.model, "cpu", operator=True), args.dtype, tiles=args.tiles)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    settings = EngineSettings(budget_bytes=int(args.budget_mb * 2**20))
    engine = Engine(model, built_in_queue(model, args.queue), settings)
    started = time.perf_counter()
    while not engine.finished:
        engine.step()
    wall = time.perf_counter() - started
    machine = measure_machine(torch.device("cpu"))
    peaks = {"float32": machine.matmul_gflops * 1e9}
    peaks["bfloat16"] = with_matmul_peak(machine, "bfloat16").matmul_gflops * 1e9
    read_rate = machine.read_gb_s * 1e9
    tiled_from = tile_rows(args.dtype)
    arithmetic = str(ACTIVATIONS[args.dtype]).removeprefix("torch.")
    total_flops = compute_s = roofline_s = decode_read_s = 0.0
    for step in engine.steps:
        positions, step_flops, read = step_work(model, step)
        peak = peaks["bfloat16" if args.tiles and positions >= tiled_from else arithmetic]
        total_flops += step_flops
        compute_s += step_flops / peak
        roofline_s += max(step_flops / peak, read / read_rate)
        if all(s.kind == "decode" for s in step.spans):
            decode_read_s += read / read_rate
    clock = engine.clock_ms / 1000
    tokens = sum(len(r.new_ids) for r in engine.requests.values())
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, load average before {load}; code {code_version(ROOT)}")
    print(f"{args.model} {args.dtype}{' with tile products' if args.tiles else ''}, {args.threads} thread(s), "
          f"queue {args.queue}: {len(engine.requests)} requests, {tokens} tokens in {len(engine.steps)} steps")
    print(f"measured: float32 matmul {peaks['float32'] / 1e9:,.1f} GFLOP/s, bfloat16 matmul "
          f"{peaks['bfloat16'] / 1e9:,.1f} GFLOP/s, read {machine.read_gb_s:.1f} GB/s")
    print(f"engine clock {clock:.2f} s (wall {wall:.2f} s), {tokens / clock:.1f} tokens/s")
    print(f"queue FLOPs {total_flops:.3e}: at the float32 peak {total_flops / peaks['float32']:.2f} s "
          f"(clock ÷ that {clock / (total_flops / peaks['float32']):.2f}×); at each pass's own peak {compute_s:.2f} s "
          f"({clock / compute_s:.2f}×)")
    print(f"roofline bound (each step its FLOPs at its peak or its bytes at the read rate, the larger) "
          f"{roofline_s:.2f} s ({clock / roofline_s:.2f}×); the decode-only steps' reads alone {decode_read_s:.2f} s")
    if args.solo:
        same = [r.id for r in engine.requests.values() if solo_tokens(model, r, settings) == r.new_ids]
        print(f"served alone, {len(same)} of {len(engine.requests)} requests gave the tokens they had in the queue")
    engine.close()


def solo_tokens(model, request, settings: EngineSettings) -> list[int]:
    """The request's tokens served alone (from step 0) by an engine of the same settings."""
    alone = Engine(model, [dataclasses.replace(request, arrival_step=0).restart()], settings)
    while not alone.finished:
        alone.step()
    alone.close()
    return next(iter(alone.requests.values())).new_ids


if __name__ == "__main__":
    main()
