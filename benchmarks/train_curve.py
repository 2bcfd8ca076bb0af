"""The small model's loss over 200 training steps from random weights, printed as a curve (not a timed test).

    .venv/bin/python benchmarks/train_curve.py [--model small] [--steps 200] [--seed 0] [--every 10]

The same engine as the Train page and `python -m model train`, with the page's default settings.
"""

import argparse
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from model.training.train import Trainer, TrainSettings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small", choices=["small", "micro"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=10, help="print one step in this many")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the page runs a model this size
    settings = TrainSettings(model=args.model, seed=args.seed, schedule_steps=args.steps)
    trainer = Trainer(settings, "cpu")
    print(f"{args.model} from random weights, {args.steps} steps, float32 on cpu, 1 thread, "
          f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), torch {torch.__version__}")
    print("settings:", asdict(settings))
    print(f"ln V = ln {trainer.config.vocab_size} = {trainer.ln_vocab:.4f}")
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.step()
        point = trainer.history[-1]
        if point.step == 1 or point.step % args.every == 0:
            bar = "#" * round(point.loss * 8)
            print(f"step {point.step:4d}  loss {point.loss:7.4f}  lr {point.lr:.2e}  {bar}")
    first, last = trainer.history[0].loss, trainer.history[-1].loss
    tail = [p.loss for p in trainer.history[-10:]]
    print(f"first loss {first:.4f}, last {last:.4f}, mean of the last 10 {sum(tail) / len(tail):.4f}; "
          f"{time.perf_counter() - t0:.1f} s in all")


if __name__ == "__main__":
    main()
