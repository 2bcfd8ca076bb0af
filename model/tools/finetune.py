"""python -m model finetune: the Fine-tune page's steps (SFT, LoRA, DPO, RLHF) from the command line, as lines or
one JSON object. Every setting and the --save folder are checked before the first step."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import torch

from model.errors import InputError
from model.tools.options import save_target
from model.tools.train import said_for_the_command_line
from model.training.posttrain import DEFAULT_BATCH, FinetuneSettings
from model.training.train import MAX_STEPS, limits

ROUND = 6


def trainer_class(method: str):
    from model.training.dpo import DPO
    from model.training.lora import LoRA
    from model.training.rlhf import RLHF
    from model.training.sft import SFT

    return {"sft": SFT, "lora": LoRA, "dpo": DPO, "rlhf": RLHF}[method]


def rounded(record: dict) -> dict:
    return {k: round(v, ROUND) if isinstance(v, float) else v for k, v in record.items()}


def run_cli(args) -> int:
    if not 1 <= args.steps <= MAX_STEPS:
        raise InputError("finetune_setting", setting_text="finetune.steps", low=1, high=MAX_STEPS, value=args.steps)
    batch = args.batch or DEFAULT_BATCH[args.model]
    settings = FinetuneSettings(method=args.method, model=args.model, seed=args.seed, batch_size=batch,
                                lr=args.lr, rank=args.rank, alpha=args.alpha, targets=args.targets, beta=args.beta,
                                group_size=args.group, reward_steps=args.reward_steps, length_bonus=args.length_bonus)
    bound = replace(limits(), max_steps=args.steps + settings.reward_steps)
    settings.check(bound)  # before any weight is loaded
    target = save_target(args.save, args.overwrite) if args.save is not None else None
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, and the numbers reproducible
    trainer = trainer_class(args.method)(settings, args.device, bound)
    report: dict = {"method": args.method, "model": args.model, "settings": asdict(trainer.settings),
                    "dtype": "float32", "device": str(trainer.device)}
    if args.method == "lora":
        report.update(trainable_params=trainer.trainable_count(), total_params=trainer.total_count(),
                      formula=[{"target": k, "d_in": i, "d_out": o, "params": n} for k, i, o, n in trainer.formula],
                      adapter_bytes=trainer.adapter_bytes())
    try:
        if args.method == "rlhf":
            rm = [trainer.reward_step() for _ in range(settings.reward_steps)]
            report["reward_model"] = {"steps": [rounded(r) for r in rm],
                                      "held_out_accuracy": rm[-1]["held_out_accuracy"],
                                      "held_out_pairs": len(trainer.held_out)}
        steps = []
        for _ in range(args.steps):
            record = rounded(trainer.step())
            if args.method == "rlhf":
                record["samples"] = [rounded(s) for s in trainer.last_samples[:3]]
            steps.append(record)
            if not args.json:
                print("  ".join(f"{k} {v}" for k, v in record.items() if k != "samples"))
    except InputError as bad:  # a loss that is no longer finite, said for the command line
        raise said_for_the_command_line(bad) from None
    report["steps"] = steps
    report["before"] = [{"prompt": p, "answer": a} for p, a in trainer.before]
    report["after"] = [{"prompt": p, "answer": a} for p, a in trainer.answers()]
    report["checkpoint"] = None
    if target is not None:
        trainer.save(target)
        report["checkpoint"] = str(target)
    if args.json:
        print(json.dumps(report, ensure_ascii=False, allow_nan=False))
    else:
        for before, after in zip(report["before"], report["after"]):
            print(f"{before['prompt']!r}: before {before['answer']!r} -> after {after['answer']!r}")
        if target is not None:
            print(f"saved {target}")
    return 0
