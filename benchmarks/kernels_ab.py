"""Two builds of kernels.cpp side by side in one process (issue 52's measurements): the shared model's products, a
step's worth at a given number of rows, timed with one build then the other, in turn, `--rounds` times; prints each
build's median and the ratio before ÷ after per rows (a ratio > 1: the second build is faster).

.venv/bin/python benchmarks/kernels_ab.py BEFORE.cpp AFTER.cpp [--rows 1,4,6,8,16,64,512] [--rounds 7]
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from conditions import ab_parser

from model.engine import kernels, llama
from model.engine.loading import load_model


def build(source: str, folder: Path) -> object:
    library = folder / (Path(source).stem + f"-{abs(hash(source))}.so")
    subprocess.run([kernels.compiler(), *kernels.FLAGS, source, "-o", str(library)], check=True)
    return kernels._loaded(library)


def main() -> None:
    parser = ab_parser()
    parser.add_argument("--rows", default="1,2,4,6,8,12,16,64,512")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, "cpu", operator=True)
    products = llama.packed_weights(model.module)
    with tempfile.TemporaryDirectory() as folder:
        libraries = [build(args.before, Path(folder)), build(args.after, Path(folder))]
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {p.inputs: torch.randn(rows, p.inputs) for p in products}
        times: list[list[float]] = [[], []]
        outputs = []
        for _ in range(args.rounds):
            for which, library in enumerate(libraries):
                kernels.kernels = lambda library=library: library
                t0 = time.perf_counter()
                out = [p(inputs[p.inputs]) for p in products]
                times[which].append(time.perf_counter() - t0)
                if len(outputs) < 2:
                    outputs.append(out)
        same = all(torch.equal(a, b) for a, b in zip(*outputs))
        before, after = (statistics.median(t) * 1000 for t in times)
        flops = 2 * rows * sum(p.matrix.shape.outputs * p.inputs for p in products)
        print(f"rows {rows:4d}: before {before:8.1f} ms  after {after:8.1f} ms  before/after {before / after:5.2f}x  "
              f"after {flops / after / 1e6:6.1f} GFLOP/s  same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
