"""Why GQA exists, measured: the model as shipped beside its multi-head equivalent (model/engine/kv_heads.py).

python -m model kv-heads --model M [--prompt-ids ...] [--steps N] [--json]

Both run the same prefill and the same greedy decode steps; the report gives each one's cache bytes per position
(the formula, and the bytes the real cache holds), the largest logit difference between them at every step, and
the median decode step time of each, measured alternately in one process.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from model.engine.kernels import cpu_features
from model.engine.kv_heads import as_multi_head, cache_formulas, mla_bytes_per_position
from model.engine.loading import load_model
from model.errors import InputError

# DeepSeek-V2's MLA sizes as ratios of the head size (its paper: d_c = 4 d_h, d_h^R = d_h / 2), applied to this model
MLA_LATENT_PER_D_HEAD, MLA_ROPE_PER_D_HEAD = 4, 0.5


def run_cli(args) -> int:
    if args.steps < 1 or args.steps > 256:
        raise InputError("kv_heads_steps", steps=args.steps)
    base = load_model(args.model, args.device, operator=True)
    if base.info.backend != "native":
        raise InputError("kv_heads_native", model=base.info.name)
    if base.info.n_kv_heads == base.info.n_heads:
        print(f"{base.info.name} has as many KV heads as query heads ({base.info.n_heads}): it is already multi-head")
        return 0
    wide = as_multi_head(base)
    prompt = base.tokenizer.encode(args.prompt).ids[: base.info.context_length - args.steps]
    report = compare(base, wide, prompt, args.steps)
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    else:
        print_report(report)
    return 0


@torch.inference_mode()
def compare(base, wide, prompt: list[int], steps: int) -> dict:
    """The same prefill and greedy steps through both models; the shipped model's tokens are fed to both."""
    caches = {"shipped": base.new_cache(), "multi_head": wide.new_cache()}
    models = {"shipped": base, "multi_head": wide}
    logits = {name: models[name].forward(prompt, caches[name], False)[0] for name in models}
    diffs = [float((logits["shipped"] - logits["multi_head"]).abs().max())]
    times = {name: [] for name in models}
    for _ in range(steps):
        token = int(logits["shipped"].argmax())
        for name in models:  # alternately, so that the machine's moods fall on both
            began = time.perf_counter()
            logits[name] = models[name].forward([token], caches[name], False)[0]
            times[name].append((time.perf_counter() - began) * 1e3)
        diffs.append(float((logits["shipped"] - logits["multi_head"]).abs().max()))
    info = base.info
    formulas = {f.name: f for f in cache_formulas(base)}
    return {
        "model": info.name, "n_layers": info.n_layers, "n_heads": info.n_heads, "n_kv_heads": info.n_kv_heads,
        "d_head": info.d_head, "dtype": info.dtype, "prompt_len": len(prompt), "steps": steps,
        "max_abs_logit_diff": max(diffs),
        "rows": [{"name": name, "n_kv_heads": formulas[name].n_kv_heads,
                  "bytes_per_position": formulas[name].bytes_per_position,
                  "cache_bytes": caches[name].nbytes(), "positions": caches[name].length,
                  "decode_ms_p50": round(statistics.median(times[name]), 3)} for name in models],
        "mla_bytes_per_position": mla_bytes_per_position(
            info.n_layers, MLA_LATENT_PER_D_HEAD * info.d_head, int(MLA_ROPE_PER_D_HEAD * info.d_head),
            info.bytes_per_element),
        "conditions": {"threads": torch.get_num_threads(), "device": info.device, "cpu": cpu_features().vector,
                       "timing": f"median of {steps} decode steps each, the two models alternating"},
    }


def print_report(report: dict) -> None:
    print(f"model {report['model']}: {report['n_layers']} layers, {report['n_heads']} query heads, "
          f"{report['n_kv_heads']} KV heads of {report['d_head']}, {report['dtype']}; prompt "
          f"{report['prompt_len']} positions, then {report['steps']} greedy steps")
    print(f"{'':<12}{'KV heads':>9}{'B/position':>12}{'cache bytes':>14}{'decode ms p50':>15}")
    for row in report["rows"]:
        print(f"{row['name']:<12}{row['n_kv_heads']:>9}{row['bytes_per_position']:>12,}{row['cache_bytes']:>14,}"
              f"{row['decode_ms_p50']:>15.3f}")
    print(f"largest |logit difference| over the prefill and every step: {report['max_abs_logit_diff']:.3g}")
    print(f"MLA with DeepSeek-V2's ratios (d_c = 4 d_head, d_h^R = d_head / 2) at this model's sizes, a formula only "
          f"(no model here uses it): {report['mla_bytes_per_position']:,} B/position")
    c = report["conditions"]
    print(f"{c['device']}, {c['threads']} thread(s), {c['cpu']} vectors; {c['timing']}")
