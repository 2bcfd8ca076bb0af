"""python -m model trace | count | build | bench — the engine from the command line."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from model.counting import positions_with_cache, positions_without_cache

TOP_N = 5
DEFAULT_NEW_TOKENS = 20


def percentiles(values: list[float]) -> dict[str, float | None]:
    from model.bench import percentile

    return {f"p{q}": round(percentile(values, q), 3) if values else None for q in (50, 95, 99)}


def trace_report(model, gen, prompt_text: str, unknown: list[str], check: bool) -> dict:
    from model.steps import max_abs_logit_diff, recompute

    info, tok = model.info, model.tokenizer
    steps = []
    for index, (trace, drawn) in enumerate(zip(gen.steps, gen.samples)):
        top_ids = np.argsort(-drawn.probs, kind="stable")[:TOP_N]
        row = {
            "index": index, "phase": trace.phase, "input_ids": trace.input_ids, "positions": trace.positions,
            "cache_len": trace.cache_len, "cache_bytes": trace.cache_bytes,
            "cache_bytes_formula": trace.cache_bytes_formula, "attention_shape": list(trace.attention.shape),
            "chosen_id": drawn.chosen_id, "chosen_token": tok.token(drawn.chosen_id),
            "chosen_prob": round(float(drawn.probs[drawn.chosen_id]), 6),
            "top": [{"id": int(i), "token": tok.token(int(i)), "prob": round(float(drawn.probs[i]), 6)}
                    for i in top_ids],
            "ms": round(trace.ms, 3),
        }
        if check:
            row["max_abs_logit_diff"] = max_abs_logit_diff(trace, recompute(model, gen.ids[: trace.cache_len]))
        steps.append(row)
    return {
        "model": {"name": info.name, "n_layers": info.n_layers, "n_heads": info.n_heads,
                  "n_kv_heads": info.n_kv_heads, "d_head": info.d_head, "dtype": info.dtype, "device": info.device},
        "prompt": {"text": prompt_text, "ids": gen.prompt_ids, "tokens": [tok.token(i) for i in gen.prompt_ids],
                   "unknown": unknown},
        "steps": steps,
        "output": {"ids": gen.new_ids, "text": tok.decode(gen.new_ids), "stop_reason": gen.stop_reason},
        "counts": {"prompt_len": len(gen.prompt_ids), "new_tokens": len(gen.new_ids),
                   "positions_with_cache": gen.positions_with_cache,
                   "positions_without_cache": gen.positions_without_cache},
        "timing": {"ttft_ms": round(gen.steps[0].ms, 3), "itl_ms": percentiles([s.ms for s in gen.steps[1:]])},
    }


def print_table(report: dict) -> None:
    m, p = report["model"], report["prompt"]
    print(f"model {m['name']}: {m['n_layers']} layers, {m['n_heads']} heads, {m['n_kv_heads']} KV heads, "
          f"d_head {m['d_head']}, {m['dtype']} on {m['device']}")
    print(f"prompt {p['text']!r} -> ids {p['ids']} tokens {p['tokens']}"
          + (f"  unknown: {p['unknown']}" if p["unknown"] else ""))
    check = any("max_abs_logit_diff" in s for s in report["steps"])
    header = (f"{'step':>4} {'phase':<8} {'input':<10} {'cache':>5} {'bytes':>9} {'formula':>9} {'chosen':<14} "
              f"{'p':>6} {'ms':>8}")
    print(header + ("  max|Δlogit|" if check else ""))
    for s in report["steps"]:
        chosen = f"{s['chosen_id']} {s['chosen_token']}"
        inputs = ",".join(map(str, s["input_ids"]))
        line = (f"{s['index']:>4} {s['phase']:<8} {inputs[:10]:<10} {s['cache_len']:>5} {s['cache_bytes']:>9} "
                f"{s['cache_bytes_formula']:>9} {chosen[:14]:<14} {s['chosen_prob']:>6.3f} {s['ms']:>8.2f}")
        print(line + (f"  {s['max_abs_logit_diff']:.2e}" if check else ""))
    o, c, t = report["output"], report["counts"], report["timing"]
    print(f"output ids {o['ids']} text {o['text']!r} stop: {o['stop_reason']}")
    print(f"positions processed: {c['positions_with_cache']} with cache, {c['positions_without_cache']} without")
    print(f"TTFT {t['ttft_ms']} ms, ITL p50 {t['itl_ms']['p50']} p95 {t['itl_ms']['p95']} p99 {t['itl_ms']['p99']} ms")


def cmd_trace(args) -> int:
    from model.generate import context_room, encode_prompt, parse_prompt_ids, run_to_end, start
    from model.runtime import load_model
    from model.sampling import SamplingSettings

    model = load_model(args.model, args.device, args.allow_download)
    if args.prompt_ids is not None:
        ids = parse_prompt_ids(model, args.prompt_ids)
        prompt_text, unknown = model.tokenizer.decode(ids), []
    else:
        encoded = encode_prompt(model, args.prompt)
        prompt_text, unknown, ids = args.prompt, encoded.unknown, encoded.ids
    settings = SamplingSettings(args.temperature, args.top_k, args.top_p, args.seed)
    max_new_tokens = args.max_new_tokens or min(DEFAULT_NEW_TOKENS, context_room(model, len(ids)))
    gen = start(model, ids, settings, max_new_tokens, tuple(args.stop))
    run_to_end(model, gen)
    report = trace_report(model, gen, prompt_text, unknown, args.check)
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    else:
        print_table(report)
    return 0


def cmd_count(args) -> int:
    print(f"with cache:    {positions_with_cache(args.N, args.T)}")
    print(f"without cache: {positions_without_cache(args.N, args.T)}")
    return 0


def cmd_build(args) -> int:
    from model.build import build

    build(args.name)
    return 0


def cmd_bench(args) -> int:
    from model.bench import run_bench

    run_bench(args.device, args.quick)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m model", description="Decode Lab engine")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("trace", help="run a prompt step by step and print every step")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,3")
    t.add_argument("--model", default="small", help="micro, small, a model folder or a Hugging Face Hub id")
    t.add_argument("--allow-download", action="store_true", help="let --model download a Hub id (off: offline)")
    t.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"default: {DEFAULT_NEW_TOKENS} or what the context still holds")
    t.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    t.add_argument("--top-k", type=int, default=None)
    t.add_argument("--top-p", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    t.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    t.add_argument("--check", action="store_true", help="compare each step's logits with a full recompute")
    t.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    t.set_defaults(run=cmd_trace)

    c = sub.add_parser("count", help="positions processed with and without the KV cache")
    c.add_argument("N", type=int, help="prompt length")
    c.add_argument("T", type=int, help="new tokens")
    c.set_defaults(run=cmd_count)

    b = sub.add_parser("build", help="re-create a bundled model from scratch")
    b.add_argument("name", choices=["micro", "small"])
    b.set_defaults(run=cmd_build)

    bench = sub.add_parser("bench", help="native engine vs transformers, cached vs recomputed")
    bench.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.set_defaults(run=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    from model.errors import InputError

    args = parser().parse_args(argv)
    if args.command == "count" and (args.N < 1 or args.T < 1):
        print("N and T must be at least 1.", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except InputError as bad:
        print(bad.message("en"), file=sys.stderr)
        return 2
