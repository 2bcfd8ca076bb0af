"""Seconds for 50 optimizer steps of each post-training method on `small` (and a few SFT / LoRA steps on smollm2
and gemma3 when they are fetched), float32, CPU, one torch thread; setup (loading, the SFT warm start, the reward
model) timed apart. Usage: .venv/bin/python benchmarks/finetune_speed.py [--steps 50] [--fetched-steps 3]"""

import argparse
import platform
import time

import torch

from model.training.dpo import DPO
from model.training.lora import LoRA
from model.training.posttrain import FinetuneSettings
from model.training.rlhf import RLHF
from model.training.sft import SFT
from model.weights.catalog import resolve_path

CLASSES = {"sft": SFT, "lora": LoRA, "dpo": DPO, "rlhf": RLHF}


def measure(method: str, model: str, steps: int, batch: int) -> None:
    t0 = time.perf_counter()
    trainer = CLASSES[method](FinetuneSettings(method=method, model=model, batch_size=batch), "cpu")
    if method == "rlhf":
        for _ in range(trainer.settings.reward_steps):
            trainer.reward_step()
    setup = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(steps):
        trainer.step()
    took = time.perf_counter() - t1
    last = trainer.history[-1]
    extra = {k: round(last[k], 3) for k in ("loss", "accuracy", "reward", "kl") if k in last}
    print(f"{method:5s} {model:8s} batch {batch:2d}: {steps} steps {took:6.1f} s ({1000 * took / steps:6.0f} ms/step), "
          f"setup {setup:5.1f} s, last {extra}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--fetched-steps", type=int, default=3, help="SFT and LoRA steps on smollm2 and gemma3")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread, float32, "
          f"torch {torch.__version__}")
    for method in ("sft", "lora", "dpo", "rlhf"):
        measure(method, "small", args.steps, 16)
    for model in ("smollm2", "gemma3"):
        if args.fetched_steps and (resolve_path(model) / "model.safetensors").is_file():
            for method in ("sft", "lora"):
                measure(method, model, args.fetched_steps, 4)


if __name__ == "__main__":
    main()
