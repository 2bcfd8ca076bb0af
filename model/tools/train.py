"""python -m model train: the Train page's steps from the command line, as lines or one JSON object.

Every setting and the --save folder are checked before the first step, so that a mistake costs no training."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace

import torch

from model.errors import InputError
from model.tools.options import save_target
from model.training.train import MAX_STEPS, Trainer, TrainSettings, limits


def said_for_the_command_line(bad: InputError) -> InputError:
    """A step refused as not finite in the command line's words (a page's end "lower the learning rate or press
    Reset"); any other refusal as it is."""
    return InputError("train_not_finite_cli", **bad.details) if bad.code == "train_not_finite" else bad


def run_cli(args) -> int:
    steps = args.steps
    if not 1 <= steps <= MAX_STEPS:
        raise InputError("train_setting", setting_text="train.steps", low=1, high=MAX_STEPS, value=steps)
    settings = TrainSettings(model=args.model, init=args.init, seed=args.seed, batch_size=args.batch,
                             seq_len=args.seq_len, lr=args.lr, clip=args.clip, warmup_steps=min(20, steps // 10),
                             schedule_steps=steps)
    # the matrices are tiny: one thread is faster, and the same thread count keeps the curve reproducible
    torch.set_num_threads(1)
    trainer = Trainer(settings, args.device, replace(limits(), max_steps=steps))  # checks every setting
    target = save_target(args.save, args.overwrite) if args.save is not None else None
    cfg = trainer.config
    points, failure = [], None
    for _ in range(steps):
        try:
            trainer.step()
        except InputError as bad:  # a loss or gradient that is no longer finite: the step was refused
            if bad.code != "train_not_finite":
                raise
            failure = said_for_the_command_line(bad)
            break
        p = trainer.history[-1]
        points.append({"step": p.step, "loss": round(p.loss, 6), "grad_norm": round(p.grad_norm, 6),
                       "grad_norm_clipped": round(p.grad_norm_clipped, 6), "lr": round(p.lr, 8),
                       "ms": round(p.ms, 3)})
        if not args.json:
            print(f"step {p.step:5d}  loss {p.loss:.4f}  |g| {p.grad_norm:.3f} -> {p.grad_norm_clipped:.3f}  "
                  f"lr {p.lr:.2e}  {p.ms:.1f} ms")
    checkpoint_dir = None
    if target is not None and failure is None:
        trainer.save(target)
        checkpoint_dir = str(target)
    report = {
        "model": {"name": settings.model, "init": settings.init, "n_layers": cfg.num_hidden_layers,
                  "n_heads": cfg.num_attention_heads, "n_kv_heads": cfg.num_key_value_heads, "d_head": cfg.head_dim,
                  "vocab_size": cfg.vocab_size, "parameters": sum(p.numel() for _, p in trainer.named_params),
                  "dtype": "float32", "device": str(trainer.device)},
        "settings": asdict(settings), "clip": settings.clip, "ln_vocab": trainer.ln_vocab,
        "steps": points, "checkpoint": checkpoint_dir,
        "stop_reason": "steps_done" if failure is None else "not_finite",
        "error": None if failure is None else failure.message("en"),
    }
    if args.json:
        print(json.dumps(report, ensure_ascii=False, allow_nan=False))
    elif checkpoint_dir:
        print(f"saved {checkpoint_dir}")
    if failure is None:
        return 0
    print(failure.message("en") + ("" if target is None else f" Nothing was saved to {target}."), file=sys.stderr)
    return 1
