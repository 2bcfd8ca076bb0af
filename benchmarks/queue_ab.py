"""serve-bench --queue from two checkouts in turn (issue 52's before / after): `--pairs` times the BEFORE tree's run
then the AFTER tree's, each a process of its own on the same interpreter, each run's tokens/s on the engine clock;
prints every pair's ratio after ÷ before, their median, and whether both served the same tokens.

.venv/bin/python benchmarks/queue_ab.py /tmp/base . [--queue mixed] [--pairs 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def served(tree: str, args) -> dict:
    command = [sys.executable, "-m", "model", "serve-bench", "--model", args.model, "--queue", args.queue, "--kv",
               "paged", "--kv-budget-mb", str(args.budget_mb), "--json"]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), DECODE_LAB_CPU_THREADS=str(args.threads))
    out = subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--queue", default="mixed")
    parser.add_argument("--budget-mb", type=float, default=200)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    ratios = []
    for pair in range(args.pairs):
        before, after = served(args.before, args), served(args.after, args)
        same = [r.get("tokens") for r in before.get("requests", [])] == [r.get("tokens") for r in
                                                                           after.get("requests", [])]
        ratio = after["tokens_per_s"] / before["tokens_per_s"]
        ratios.append(ratio)
        print(f"pair {pair + 1}: before {before['tokens_per_s']:.2f} tok/s, after {after['tokens_per_s']:.2f} tok/s, "
              f"after/before {ratio:.2f}x, same tokens: {same}", flush=True)
    print(f"median after/before {statistics.median(ratios):.2f}x over {len(ratios)} pairs ({args.queue}, "
          f"{args.model}, {args.threads} thread(s))")


if __name__ == "__main__":
    main()
