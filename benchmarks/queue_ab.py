"""serve-bench --queue from two checkouts in turn (issue 52's before / after): `--pairs` times the BEFORE tree's run
then the AFTER tree's, each a process of its own on the same interpreter, each run's tokens/s on the engine clock;
prints every pair's ratio after ÷ before, their median, the ratio of the two processes' CPU seconds (before ÷ after:
steadier where other work shares the cores, the model's load included in both), and whether both served the same
tokens.

.venv/bin/python benchmarks/queue_ab.py /tmp/base . [--queue mixed] [--pairs 3] [--threads 1]
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys

from conditions import ab_parser


def served(tree: str, args) -> dict:
    command = [sys.executable, "-m", "model", "serve-bench", "--model", args.model, "--queue", args.queue, "--kv",
               "paged", "--kv-budget-mb", str(args.budget_mb), "--json"]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), DECODE_LAB_CPU_THREADS=str(args.threads))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = json.loads(out)
    # the process's CPU seconds (its load included): on a shared machine, time spent waiting for a core is not in it
    report["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return report


def main() -> None:
    parser = ab_parser()
    parser.add_argument("--queue", default="mixed")
    parser.add_argument("--budget-mb", type=float, default=200)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    ratios, cpu_ratios = [], []
    for pair in range(args.pairs):
        before, after = served(args.before, args), served(args.after, args)
        same = [r.get("tokens") for r in before.get("requests", [])] == [r.get("tokens") for r in
                                                                           after.get("requests", [])]
        ratio = after["tokens_per_s"] / before["tokens_per_s"]
        ratios.append(ratio)
        cpu_ratios.append(before["cpu_s"] / after["cpu_s"])
        print(f"pair {pair + 1}: before {before['tokens_per_s']:.2f} tok/s, after {after['tokens_per_s']:.2f} tok/s, "
              f"after/before {ratio:.2f}x; process CPU s {before['cpu_s']:.1f} / {after['cpu_s']:.1f} = "
              f"{cpu_ratios[-1]:.2f}x; same tokens: {same}", flush=True)
    print(f"median after/before {statistics.median(ratios):.2f}x tokens/s, {statistics.median(cpu_ratios):.2f}x "
          f"process CPU time (load included), over {len(ratios)} pairs ({args.queue}, {args.model}, {args.threads} "
          "thread(s))")


if __name__ == "__main__":
    main()
