"""python -m model train: the Train page's steps from the command line, as lines or one JSON object."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import torch

from model.training.train import Trainer, TrainSettings, limits


def run_cli(args) -> int:
    steps = args.steps
    settings = TrainSettings(model=args.model, init=args.init, seed=args.seed, batch_size=args.batch,
                             seq_len=args.seq_len, lr=args.lr, clip=args.clip, warmup_steps=min(20, steps // 10),
                             schedule_steps=steps)
    # the matrices are tiny: one thread is faster, and the same thread count keeps the curve reproducible
    torch.set_num_threads(1)
    trainer = Trainer(settings, args.device, replace(limits(), max_steps=steps))
    cfg = trainer.config
    points = []
    for _ in range(steps):
        trainer.step()
        p = trainer.history[-1]
        points.append({"step": p.step, "loss": round(p.loss, 6), "grad_norm": round(p.grad_norm, 6),
                       "grad_norm_clipped": round(p.grad_norm_clipped, 6), "lr": round(p.lr, 8),
                       "ms": round(p.ms, 3)})
        if not args.json:
            print(f"step {p.step:5d}  loss {p.loss:.4f}  |g| {p.grad_norm:.3f} -> {p.grad_norm_clipped:.3f}  "
                  f"lr {p.lr:.2e}  {p.ms:.1f} ms")
    checkpoint_dir = None
    if args.save:
        trainer.save(args.save)
        checkpoint_dir = str(args.save)
    report = {
        "model": {"name": settings.model, "init": settings.init, "n_layers": cfg.num_hidden_layers,
                  "n_heads": cfg.num_attention_heads, "n_kv_heads": cfg.num_key_value_heads, "d_head": cfg.head_dim,
                  "vocab_size": cfg.vocab_size, "parameters": sum(p.numel() for _, p in trainer.named_params),
                  "dtype": "float32", "device": str(trainer.device)},
        "settings": asdict(settings), "clip": settings.clip, "ln_vocab": trainer.ln_vocab,
        "steps": points, "checkpoint": checkpoint_dir,
    }
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    elif checkpoint_dir:
        print(f"saved {checkpoint_dir}")
    return 0
