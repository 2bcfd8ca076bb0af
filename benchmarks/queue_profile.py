"""Where the time of one served queue goes (issue 52, part 2): the mixed queue on the paged engine, once, under
torch's profiler, the ops' self CPU time summed by op and grouped (products, attention, gathers and writes of the
paged cache, the kernels' small ops, torch's small ops, the sampler), and the engine clock's forward and draw time
split between the steps that prefill and those that only decode.

.venv/bin/python benchmarks/queue_profile.py [--model smollm2] [--queue mixed] [--threads 1] [--no-profiler]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from model.engine.loading import load_model
from model.serving.kv_runs import KVSettings, QueueRun
from model.serving.queues import built_in_queue


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--queue", default="mixed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget-mb", type=float, default=200)
    parser.add_argument("--no-profiler", action="store_true")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, "cpu", operator=True)
    requests = built_in_queue(model, args.queue)
    settings = KVSettings("paged", 16, int(args.budget_mb * 2**20))
    run = QueueRun(model, requests, settings)
    t0 = time.perf_counter()
    if args.no_profiler:
        run.run()
    else:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run.run()
    wall = time.perf_counter() - t0
    steps = run.steps
    tokens = sum(len(r.new_ids) for r in run.requests)
    summary = run.summary()
    prefill = [s for s in steps if s.prefill_positions]
    decode = [s for s in steps if not s.prefill_positions]
    print(f"wall {wall:.1f} s, steps {len(steps)}, tokens/s {summary.get('tokens_per_s'):.2f}, tokens {tokens}")
    for name, group in (("prefill steps", prefill), ("decode-only steps", decode)):
        fwd, draw = sum(s.forward_ms for s in group), sum(s.draw_ms for s in group)
        pos = sum(s.prefill_positions for s in group)
        print(f"{name}: {len(group)} steps, forward {fwd / 1000:.2f} s, draw {draw / 1000:.2f} s, "
              f"prefill positions {pos}")
    run.close()
    if args.no_profiler:
        return
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for event in prof.events():
        totals[event.name] += event.self_cpu_time_total
        counts[event.name] += 1
    all_us = sum(totals.values())
    print(f"profiled self time {all_us / 1e6:.2f} s")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{us / 1e6:8.2f} s {100 * us / all_us:5.1f} %  {counts[name]:7d}  {name}")


if __name__ == "__main__":
    main()
