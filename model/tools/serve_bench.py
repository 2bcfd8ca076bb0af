"""Serving, measured: a batched decode step's time, the bytes it reads and the operations it does, against this
machine's own copy bandwidth and matmul peak; float32, bfloat16 and int8 weights and what they cost in accuracy;
a profiler timeline of a few steps.

python -m model serve-bench --model M --batch 1,2,4,8 --context 64,256 --dtype float32,bfloat16,int8 [--json]
python -m model profile --model M --steps N --trace FILE
"""

from __future__ import annotations

import json
from dataclasses import asdict

import torch

from model.engine.kernels import bf16_products, cpu_features
from model.engine.loading import load_model
from model.engine.lowbit import check_dtype, with_weights
from model.engine.runtime import NativeModel
from model.engine.sampling import MAX_SEED, SamplingSettings, check_settings_or_refuse
from model.errors import InputError
from model.serving.costs import weight_bytes
from model.serving.measure import (
    ACCURACY_PROMPTS,
    GREEDY,
    accuracy,
    checked_batch,
    decode_work,
    measure_machine,
    prefill_work,
    profile_steps,
)
from model.serving.memory import MAX_SLOTS
from model.serving.timing import percentile
from model.tools.options import check_list, check_option, file_target, written_at_end
from model.tools.serve_queue import check_not_queue_options, run_queue_cli

BENCH_CONTEXTS = (64, 256)  # serve-bench's contexts: those below the model's context, else its context - 1
DEFAULT_BATCHES, DEFAULT_DTYPES, DEFAULT_BENCH_STEPS = "1,2,4,8", "float32,bfloat16,int8", 20
MAX_BENCH_STEPS = 1000      # serve-bench --steps: timed steps per setting
PROFILE_CONTEXT = 64        # profile's context, or the model's context - 1 where that is shorter
# profile --steps: the profiler holds every event of every step in memory, about 4.7 MB a step of small and 34 MB
# of smollm2 (max RSS measured on CPU: small 490 MB at 20 steps, 1,336 MB at 200; smollm2 1.8 GB at 10, 3.2 GB at 50)
MAX_PROFILE_STEPS = 50


def parse_list(text: str, convert, what: str) -> list:
    try:
        values = [convert(part) for part in text.split(",")] if all(p.strip() for p in text.split(",")) else []
    except ValueError:
        raise InputError("bad_list", what=what, text=text) from None
    if not values:
        raise InputError("bad_list", what=what, text=text)
    return values


def check_options(model: NativeModel, batch: int, context: int) -> None:
    """The command line's --batch and --context on `model`, each refusal naming the options typed (checked_batch
    says them in the Serving page's words)."""
    check_option("--batch", batch, 1, MAX_SLOTS)
    check_option("--context", context, 1, model.info.context_length - 1)
    try:
        checked_batch(model, batch, context)
    except InputError as refused:
        if refused.code != "serving_budget":
            raise
        raise InputError("option_budget", context=context, **refused.details) from None


def default_contexts(model: NativeModel) -> list[int]:
    return [c for c in BENCH_CONTEXTS if c < model.info.context_length] or [model.info.context_length - 1]


def run_serve_bench(model_name: str, batches: list[int], contexts: list[int] | None, dtypes: list[str], device: str,
                    repeats: int, settings: SamplingSettings = GREEDY) -> dict:
    """contexts None: default_contexts."""
    check_settings_or_refuse(settings)
    base = load_model(model_name, device, operator=True)
    contexts = contexts or default_contexts(base)
    models = {dtype: with_weights(base, dtype) for dtype in dtypes}  # every refusal before any timing
    for model in models.values():
        for batch in batches:
            for context in contexts:
                check_options(model, batch, context)
    machine = measure_machine(base.device)
    rows = []
    for dtype, model in models.items():
        for context in contexts:
            for batch in batches:
                work = decode_work(model, batch, context, repeats, settings)
                rows.append({"batch": batch, "context": context, "dtype": dtype,
                             "step_ms": {f"p{q}": round(percentile(work.ms, q), 3) for q in (50, 95, 99)},
                             "tokens_per_s": round(work.tokens_per_s, 1), "bytes_read": work.bytes_read,
                             "achieved_gb_s": round(work.gb_s, 3), "flops": work.flops,
                             "achieved_gflops": round(work.gflops, 3), "machine_gb_s": round(machine.copy_gb_s, 3),
                             "machine_read_gb_s": round(machine.read_gb_s, 3),
                             "machine_gflops": round(machine.matmul_gflops, 3)})
    prefill = prefill_work(base, max(contexts), repeats)
    measured = [accuracy(base, model, dtype) for dtype, model in models.items() if dtype != "float32"]
    compared = (f"; accuracy over {ACCURACY_PROMPTS} prompts of {measured[0].prompt_len} ids × "
                f"{measured[0].new_tokens} tokens float32 wrote" if measured else "")
    info = base.info
    return {
        "model": {"name": info.name, "n_layers": info.n_layers, "n_heads": info.n_heads, "n_kv_heads": info.n_kv_heads,
                  "d_head": info.d_head, "device": info.device,
                  "weight_bytes_b1": {d: weight_bytes(m.module, 1) for d, m in models.items()}},
        "machine": asdict(machine) | {"how": machine.how, "cpu": asdict(cpu_features()),
                                      "bf16_products": bf16_products()},
        "rows": rows,
        "prefill": {"positions": max(contexts), "ms_p50": round(prefill.p50, 3), "bytes_read": prefill.bytes_read,
                    "flops": prefill.flops, "achieved_gflops": round(prefill.gflops, 3),
                    "intensity": round(prefill.intensity, 2)},
        "accuracy": [asdict(a) | {"agreement": round(a.agreement, 4)} for a in measured],
        "sampling": asdict(settings),
        "conditions": f"{repeats} timed steps per setting after a warm-up, {drawn(settings)}, filler-id prompts, "
                      f"rows rewound to the same context every step{compared}",
    }


def drawn(settings: SamplingSettings) -> str:
    if settings.greedy:
        return "greedy"
    return (f"sampled (temperature {settings.temperature}, top-k {settings.top_k or 'off'}, top-p {settings.top_p}, "
            f"row r with seed {settings.seed} + r)")


def print_report(report: dict) -> None:
    m, machine = report["model"], report["machine"]
    print(f"model {m['name']}: {m['n_layers']} layers, {m['n_heads']} heads ({m['n_kv_heads']} KV), d_head "
          f"{m['d_head']} on {m['device']}")
    print(f"machine: {machine['copy_gb_s']:.2f} GB/s copy, {machine['read_gb_s']:.2f} GB/s read, "
          f"{machine['matmul_gflops']:.1f} GFLOP/s matmul ({machine['how']})")
    print(cpu_line(machine["cpu"], machine["bf16_products"]))
    width = max([9] + [len(r["dtype"]) + 1 for r in report["rows"]])  # "bfloat16-weights" is 16 characters
    print(f"{'dtype':<{width}}{'batch':>6}{'context':>8}{'p50 ms':>9}{'p95':>8}{'p99':>8}{'tok/s':>9}{'MB read':>9}"
          f"{'GB/s':>7}{'of read':>9}{'of copy':>9}{'GFLOP/s':>9}")
    for r in report["rows"]:
        s = r["step_ms"]
        print(f"{r['dtype']:<{width}}{r['batch']:>6}{r['context']:>8}{s['p50']:>9.2f}{s['p95']:>8.2f}{s['p99']:>8.2f}"
              f"{r['tokens_per_s']:>9.1f}{r['bytes_read'] / 1e6:>9.1f}{r['achieved_gb_s']:>7.2f}"
              f"{r['achieved_gb_s'] / r['machine_read_gb_s']:>9.0%}{r['achieved_gb_s'] / r['machine_gb_s']:>9.0%}"
              f"{r['achieved_gflops']:>9.2f}")
    p = report["prefill"]
    print(f"prefill of {p['positions']} positions (float32): {p['ms_p50']:.1f} ms, {p['achieved_gflops']:.2f} GFLOP/s, "
          f"{p['intensity']:.1f} FLOP/byte")
    for a in report["accuracy"]:
        print(f"{a['dtype']}: max |Δlogit| vs float32 {a['max_abs_logit_diff']:.4f}, greedy tokens agreeing "
              f"{a['greedy_agree']}/{a['greedy_total']} ({a['agreement']:.1%})")
    print(report["conditions"])


def cpu_line(cpu: dict, bf16: str) -> str:
    """What this CPU offers the products, and how the bfloat16 ones run here."""
    def said(value: bool | None) -> str:
        return "not known" if value is None else "yes" if value else "no"

    how = {"avx512_bf16": "on its AVX-512 BF16 dot product (vdpbf16ps), in the decode kernels",
           "float32": "as float32 multiply-adds in the decode kernels (no bf16 instruction used)",
           "torch": "in torch's own product (the decode kernels did not build)"}[bf16]
    return (f"CPU: {cpu['vector']} vectors, AVX-512 BF16 {said(cpu['avx512_bf16'])}, AMX-BF16 "
            f"{said(cpu['amx_bf16'])}, AVX-512 VNNI {said(cpu['avx512_vnni'])}, AVX-VNNI {said(cpu['avx_vnni'])}; "
            f"bfloat16 products run {how}")


def run_cli(args) -> int:
    if args.queue is not None:
        return run_queue_cli(args)
    check_not_queue_options(args)
    steps = DEFAULT_BENCH_STEPS if args.steps is None else args.steps
    check_option("--steps", steps, 1, MAX_BENCH_STEPS)
    batches = parse_list(DEFAULT_BATCHES if args.batch is None else args.batch, int, "--batch")
    contexts = None if args.context is None else parse_list(args.context, int, "--context")
    dtypes = parse_list(DEFAULT_DTYPES if args.dtype is None else args.dtype, str.strip, "--dtype")
    for option, values in (("--batch", batches), ("--context", contexts), ("--dtype", dtypes)):
        if values is not None:
            check_list(option, values)
    for dtype in dtypes:
        check_dtype(dtype)  # before the model loads
    for batch in batches:
        check_option("--batch", batch, 1, MAX_SLOTS)
    check_option("--seed", args.seed, 0, MAX_SEED - (max(batches) - 1))  # row r draws with seed + r
    settings = SamplingSettings(args.temperature, args.top_k, args.top_p, args.seed)
    report = run_serve_bench(args.model, batches, contexts, dtypes, args.device, steps, settings)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


# -- the timeline -------------------------------------------------------------------------------------------------


def run_profile_cli(args) -> int:
    check_option("--steps", args.steps, 1, MAX_PROFILE_STEPS)
    check_option("--batch", args.batch, 1, MAX_SLOTS)
    target = None if args.trace is None else file_target(args.trace, args.overwrite, "--trace")
    model = load_model(args.model, args.device, operator=True)
    context = min(PROFILE_CONTEXT, model.info.context_length - 1) if args.context is None else args.context
    check_options(model, args.batch, context)
    if target is None:
        ops = profile_steps(model, args.batch, context, args.steps)
    else:
        with written_at_end(target, "--trace") as partial:
            ops = profile_steps(model, args.batch, context, args.steps, str(partial))
    print(f"{model.info.name}: {args.steps} decode steps, batch {args.batch}, {context} positions, "
          f"{torch.get_num_threads()} thread(s) on {model.info.device}; each op's own time per step:")
    for op in ops:
        print(f"{op.name:<40}{op.ms_per_step:>9.3f} ms{op.share:>7.1%}{op.calls_per_step:>7.0f} calls")
    if target is not None:
        print(f"Chrome trace: {target} (open it in https://ui.perfetto.dev)")
    return 0


# -- the Serving page's run ---------------------------------------------------------------------------------------


