"""torch.compile on a decode step, beside eager torch and the decode kernels (issue 38, item 5: "an optional
torch.compile mode if it measures faster here"). One decode step at B = 1 over `--context` cached positions, the cache
cropped back after each step so that every call has the same shapes (no recompile for a longer cache): the model as
dense torch modules in eager mode, the same modules under torch.compile (inductor, default mode), and the shared model
as it runs in the app (its products, norms, attention and a Llama layer's decode step in Decode Lab's C++ kernels).
Rounds interleaved; the first compiled call's time (the compile) printed apart.

    .venv/bin/python benchmarks/compile_decode.py [--model smollm2] [--context 64] [--rounds 6] [--recompiles 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo
from conditions import ROOT, print_conditions

from model.engine.llama import dense_copy
from model.engine.loading import load_model

STEPS_PER_ROUND = 5


def decode_step(module: torch.nn.Module, context: int):
    """A function running one decode step of `module` after `context` prefilled positions, each call the same."""
    cache = module.new_cache()
    with torch.inference_mode():
        module(torch.arange(10, 10 + context)[None], cache)
    token = torch.tensor([[42]])

    def step() -> torch.Tensor:
        with torch.inference_mode():
            logits = module(token, cache, last_logits_only=True).logits
        cache.crop(context)
        return logits

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--recompiles", type=int, default=64,
                        help="torch._dynamo's recompile limit (each block's cache layer is its own guard; default 8)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = args.recompiles
    print_conditions(ROOT, model=args.model, context=args.context, threads=1,
                     recompile_limit=args.recompiles, steps=f"{args.rounds} rounds × {STEPS_PER_ROUND}, interleaved")
    shared = load_model(args.model, "cpu").module
    dense = dense_copy(shared).eval().requires_grad_(False)
    eager = decode_step(dense, args.context)
    started = time.perf_counter()
    compiled = decode_step(torch.compile(dense), args.context)
    first = compiled()
    print(f"first compiled call (the compile included): {time.perf_counter() - started:.1f} s; "
          f"max |compiled − eager| logit {(first - eager()).abs().max().item():.2e}")
    kernels = decode_step(shared, args.context)
    ways = {"eager torch": eager, "torch.compile": compiled, "decode kernels": kernels}
    times = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, step in ways.items():
            step()
            for _ in range(STEPS_PER_ROUND):
                t = time.perf_counter()
                step()
                times[name].append((time.perf_counter() - t) * 1000)
    for name, ms in times.items():
        print(f"{name:<16}{statistics.median(ms):>9.2f} ms median{min(ms):>9.2f} min"
              f"{statistics.median(ms) / statistics.median(times['eager torch']):>8.2f}× eager's")


if __name__ == "__main__":
    main()
