"""The shared model's packed linears (Decode Lab's decode kernels, model/engine/kernels.py, llama.PackedWeight) against
oneDNN's packed product (torch.ops.mkldnn, the loader's until 2026-12-04) and torch's plain product (F.linear, MKL's
sgemm on a CPU) on dense weights as they are stored (row-major) and column-major (each weight the transpose of a
row-major matrix: quicker for one row), side by side in one run: a decode step of B rows over the same context, the
models' steps interleaved so that the machine's noisy minutes weigh on all alike; then B rows of different lengths
(each row attended over its own keys) against B rows of one length.

    .venv/bin/python benchmarks/batch_kernels.py [--model smollm2] [--batch 1,8] [--context 256] [--steps 20]

Printed per setting: p50 / p95 ms and tokens per second of each, and each other one's p50 ÷ packed's; then the
throughput of B rows against 1 row for each kind of product.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from conditions import p50_p95, print_conditions

from model.engine.llama import Linear, dense_copy
from model.engine.loading import load_model
from model.engine.runtime import NativeModel
from model.serving.measure import decode_pass, filled_memory
from model.serving.timing import filler_ids


def step_timer(model: NativeModel, batch: int, lengths: list[int]):
    """A function that runs one decode step of `batch` rows at `lengths` through the serving engine's runner and
    returns its milliseconds (every call writes the same positions, so sees the same lengths)."""
    memory = filled_memory(model, batch, max(lengths))
    tokens = filler_ids(model, batch, seed=1)

    def one_step() -> float:
        t0 = time.perf_counter()
        decode_pass(model, memory, lengths, tokens)
        return (time.perf_counter() - t0) * 1000
    return one_step


def plain_copy(model: NativeModel, column_major: bool) -> NativeModel:
    """The model with dense weights of its own (llama.dense_copy): torch's F.linear on the stored layout, or on every
    2-D weight laid out as the transpose of a row-major matrix (same shapes and values)."""
    module = dense_copy(model.module)
    if column_major:
        for parameter in module.parameters():
            if parameter.dim() == 2:
                parameter.data = parameter.data.t().contiguous().t()
    return NativeModel(model.info.name, module, model.tokenizer, model.device)


def onednn_copy(model: NativeModel) -> NativeModel:
    """The model with each Linear multiplying through oneDNN's packed copy of its weight (packed for 8 rows, as the
    loader did until 2026-12-04; timing only: inputs over 1,024 are not cut into parts, so rows may round apart)."""
    module = dense_copy(model.module)
    for linear in (m for m in module.modules() if isinstance(m, Linear)):
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 8)

        def forward(x, packed=packed):
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            y = torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
            return y.view(*x.shape[:-1], y.shape[-1])
        linear.forward = forward
    return NativeModel(model.info.name, module, model.tokenizer, model.device)


def interleaved(timers: dict[str, callable], steps: int) -> dict[str, list[float]]:
    for timer in timers.values():
        timer()  # warm-up
    times = {name: [] for name in timers}
    for _ in range(steps):
        for name, timer in timers.items():
            times[name].append(timer())
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    packed = load_model(args.model, "cpu")
    kinds = {"packed": packed, "oneDNN": onednn_copy(packed), "row-major": plain_copy(packed, column_major=False),
             "column-major": plain_copy(packed, column_major=True)}
    print_conditions(Path(__file__).resolve().parent.parent, model=args.model, context=args.context,
                     steps=f"{args.steps} per setting after a warm-up, interleaved",
                     threads=torch.get_num_threads(), dtype="float32")
    print(f"{'rows':>4} | " + " | ".join(f"{name + ' p50/p95 ms':>24} {'tok/s':>6}" for name in kinds)
          + " | other ÷ packed (p50)")
    tokens_per_s = {}
    for batch in batches:
        same = [args.context] * batch
        times = interleaved({name: step_timer(model, batch, same) for name, model in kinds.items()}, args.steps)
        p50 = {name: p50_p95(times[name])[0] for name in kinds}
        tokens_per_s[batch] = {name: 1000 * batch / p50[name] for name in kinds}
        print(f"{batch:>4} | " + " | ".join(
            f"{p50[name]:>12.1f} / {p50_p95(times[name])[1]:>9.1f} {tokens_per_s[batch][name]:>6.1f}" for name in kinds)
            + " | " + ", ".join(f"{name} {p50[name] / p50['packed']:.2f}×" for name in kinds if name != "packed"))
    for batch in (b for b in batches if b > 1):
        mixed = [args.context - 7 * r for r in range(batch)]
        times = interleaved({"equal": step_timer(packed, batch, [args.context] * batch),
                             "mixed": step_timer(packed, batch, mixed)}, args.steps)
        (e50, e95), (m50, m95) = p50_p95(times["equal"]), p50_p95(times["mixed"])
        print(f"packed, {batch} rows: one length {e50:.1f} / {e95:.1f} ms; lengths {mixed[-1]}–{mixed[0]} (each row "
              f"attended over its own keys) {m50:.1f} / {m95:.1f} ms: {m50 / e50:.2f}×")
    if 1 in tokens_per_s:
        for batch in (b for b in batches if b > 1):
            print(f"tokens/s at {batch} rows ÷ at 1 row: " + ", ".join(
                f"{name} {tokens_per_s[batch][name] / tokens_per_s[1][name]:.2f}×" for name in kinds))


if __name__ == "__main__":
    main()
