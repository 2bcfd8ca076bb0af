"""What loading a model adds to a fresh process's resident memory: VmRSS after `load_model` minus before it (the
imports done first), against the model's float32 weight bytes; each run in a new process, repeated, min and median.
Also the same model loaded a second time in that process (what one more model costs once the process's one-time
set-ups are done), and the share of the tokenizer.

    .venv/bin/python benchmarks/load_memory.py [--models smollm2,gemma3] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from conditions import print_conditions

ROOT = Path(__file__).resolve().parent.parent

ONE_RUN = """
import json, sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
from model.engine.loading import load_model, return_freed_memory
from model.engine.tokenizer import load_tokenizer
from model.weights.catalog import resolve_path
name = sys.argv[1]
before = rss()
model = load_model(name, "cpu")
after = rss()
second = load_model(name, "cpu")  # a second copy beside the first (one copy per process is ui/models.py's rule)
again = rss()
tokenizer_before = rss()
tokenizer = load_tokenizer(resolve_path(name))
return_freed_memory()  # as load_model does
print(json.dumps({"added": after - before, "again": again - after, "tokenizer": rss() - tokenizer_before,
                  "float32": 4 * sum(p.numel() for p in model.module.parameters()),
                  "packed": model.facts.packed_bytes, "held": model.facts.held_bytes}))
"""


def said(runs: list[dict], key: str, float32: int) -> str:
    values = [r[key] for r in runs]
    return (f"min {min(values) / 1e6:,.0f} MB ({min(values) / float32:.3f}×), median "
            f"{statistics.median(values) / 1e6:,.0f} MB ({statistics.median(values) / float32:.3f}×)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print_conditions(ROOT, runs=f"{args.runs} fresh processes per model", device="cpu")
    for name in args.models.split(","):
        runs = [json.loads(subprocess.run([sys.executable, "-c", ONE_RUN, name], cwd=ROOT, check=True,
                                          capture_output=True, text=True).stdout.splitlines()[-1])
                for _ in range(args.runs)]
        float32 = runs[0]["float32"]
        print(f"{name}: float32 weights {float32 / 1e6:,.0f} MB; held as 5A says {runs[0]['held'] / 1e6:,.0f} MB "
              f"(packed {(runs[0]['packed'] or 0) / 1e6:,.0f} MB)")
        print(f"  first load in a fresh process: {said(runs, 'added', float32)}")
        print(f"  the same model again in that process: {said(runs, 'again', float32)}")
        print(f"  its tokenizer alone, loaded once more: {said(runs, 'tokenizer', float32)}")


if __name__ == "__main__":
    main()
