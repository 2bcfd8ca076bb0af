"""serve-bench --queue: one built-in queue served to its end under one KV cache setting, padded or paged, with
what it measured (model/serving/kv_runs.py).

python -m model serve-bench --model M --queue mixed|shared-prefix|long-join --kv padded|paged [--block-size N]
    [--kv-budget-mb X] [--prefix-cache] [--chunk N] [--offload disk|host [--tier-dir DIR]] [--disaggregate]
    [--dtype float32|bfloat16|int8 [--tiles]] [--at-start] [--json]
"""

from __future__ import annotations

import dataclasses
import json

import torch

from model.engine.generate import session_budget_bytes
from model.engine.llama import has_tile_products
from model.engine.loading import load_model
from model.engine.lowbit import check_dtype, with_weights
from model.engine.runtime import NativeModel
from model.engine.sampling import MAX_SEED, SamplingSettings, check_settings_or_refuse
from model.errors import InputError
from model.serving.engine import MIN_CHUNK
from model.serving.kv_runs import KVSettings, QueueRun, default_budget
from model.serving.queues import built_in_queue, queue_size
from model.tools.options import check_option

# the step sweep's options, which a served queue does not take, and a served queue's, which the sweep does not
SWEEP_ONLY = ("--batch", "--context", "--steps")
QUEUE_ONLY = ("--kv", "--block-size", "--kv-budget-mb", "--chunk", "--offload", "--tier-dir", "--kv-dtype")
DEFAULT_BLOCK_SIZE = 16


def given(args, options: tuple[str, ...]) -> list[str]:
    """Those of `options` the command line set (their defaults are None)."""
    return [option for option in options if getattr(args, option[2:].replace("-", "_")) is not None]


def check_not_queue_options(args) -> None:
    """The step sweep refuses a served queue's options (each needs --queue)."""
    stray = (given(args, QUEUE_ONLY) + (["--prefix-cache"] if args.prefix_cache else [])
             + (["--disaggregate"] if args.disaggregate else []) + (["--tiles"] if args.tiles else [])
             + (["--at-start"] if args.at_start else []))
    if stray:
        raise InputError("queue_option_alone", option=stray[0])


def queue_settings(args, requests, model: NativeModel) -> KVSettings:
    block_size = DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size  # 0 is refused, not 16
    budget = (default_budget(model, args.queue, requests, block_size) if args.kv_budget_mb is None
              else int(args.kv_budget_mb * 2**20))
    return KVSettings(args.kv or "paged", block_size, budget, args.prefix_cache, args.chunk, args.offload,
                      args.tier_dir, prefill_worker=args.model if args.disaggregate else None,
                      kv_dtype=args.kv_dtype or "float32")


def run_queue(args) -> dict:
    """The queue on the model, every refusal before the first step; the report (its JSON)."""
    session_mb = session_budget_bytes() / 2**20
    if args.kv_budget_mb is not None:
        check_option("--kv-budget-mb", args.kv_budget_mb, 0.01, session_mb)
    check_option("--seed", args.seed, 0, MAX_SEED - (queue_size(args.queue) - 1))  # request i: seed + i
    settings = SamplingSettings(args.temperature, args.top_k, args.top_p, args.seed)
    check_settings_or_refuse(settings)
    dtype = args.dtype or "float32"
    check_dtype(dtype)
    model = load_model(args.model, args.device, operator=True)
    if not isinstance(model, NativeModel):
        raise InputError("serving_needs_native", model=model.info.name)
    model = with_weights(model, dtype, tiles=args.tiles)
    if args.chunk is not None:
        check_option("--chunk", args.chunk, MIN_CHUNK, model.info.context_length)
    requests = [dataclasses.replace(r, settings=dataclasses.replace(settings, seed=settings.seed + r.id),
                                    arrival_step=0 if args.at_start else r.arrival_step)
                for r in built_in_queue(model, args.queue)]
    kv = queue_settings(args, requests, model)
    if args.kv_budget_mb is None and kv.budget_bytes > session_budget_bytes():
        kv = dataclasses.replace(kv, budget_bytes=session_budget_bytes())
    run = QueueRun(model, requests, kv)
    try:
        run.run()
    finally:
        run.close()
    info = model.info
    summary = run.summary()
    if summary["transfer"] is not None:
        alone = QueueRun(model, requests, dataclasses.replace(kv, prefill_worker=None)).run()
        one = alone.summary()
        summary["transfer"]["one_process"] = {
            "ttft_ms_p50": one["ttft_ms_p50"], "itl_ms": one["itl_ms"], "tokens_per_s": one["tokens_per_s"],
            "same_tokens": [r.new_ids for r in run.requests] == [r.new_ids for r in alone.requests]}
    if kv.kv_dtype != "float32":  # the same queue in a pool of the model's own K and V, request by request
        full = QueueRun(model, requests, dataclasses.replace(kv, kv_dtype="float32")).run()
        theirs = full.summary()
        summary["float32_pool"] = {
            "same_tokens": sum(a.new_ids == b.new_ids for a, b in zip(run.requests, full.requests)),
            "requests": len(requests), "max_concurrent": theirs["max_concurrent"],
            "pool_blocks": theirs["pool_blocks"], "preemptions": theirs["preemptions"],
            "tokens_per_s": theirs["tokens_per_s"]}
        full.close()
    return {
        "model": {"name": info.name, "n_layers": info.n_layers, "n_kv_heads": info.n_kv_heads, "d_head": info.d_head,
                  "sliding_window": info.window, "device": info.device, "dtype": info.dtype,
                  "tiles": has_tile_products(model.module)},
        "queue": args.queue,
        "requests": run.request_rows(),
        "kv": {k: summary[k] for k in ("layout", "kv_dtype", "block_size", "budget_bytes", "max_concurrent",
                                       "bytes_reserved_peak", "bytes_held_peak", "waste_fraction", "shared_blocks",
                                       "prefill_positions_computed", "preemptions", "prefix_cache", "chunk",
                                       "pool_blocks", "block_bytes", "slots", "offload")},
        "steps": summary["steps"], "tokens": summary["tokens"], "tokens_per_s": summary["tokens_per_s"],
        "ttft_ms_p50": summary["ttft_ms_p50"], "itl_ms": summary["itl_ms"],
        "itl_ms_from_start": summary["itl_ms_from_start"], "ttft_ms_joined_p50": summary["ttft_ms_joined_p50"],
        "transfer": summary["transfer"],
        "time_ms": summary["time_ms"], "ops_ms": summary["ops_ms"],
        "float32_pool": summary.get("float32_pool"),
        "sampling": dataclasses.asdict(settings),
        "conditions": f"{len(requests)} requests of the built-in {args.queue} queue served to their end, "
                      f"{info.dtype} weights{' with tile products' if args.tiles else ''}, "
                      f"{'every request there from the first step, ' if args.at_start else ''}"
                      f"{torch.get_num_threads()} thread(s) on {info.device}; times on the engine's clock (each step's "
                      "forward and draws, with --offload its moves to and from the tier, with --disaggregate its waits "
                      "for and receipt of prompts from the prefill worker, measured); request i draws with seed + i",
    }


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def print_report(report: dict) -> None:
    kv, m = report["kv"], report["model"]
    layout = (f"padded, {kv['slots']} slot(s)" if kv["slots"] is not None else
              f"paged, blocks of {kv['block_size']} ({kv['pool_blocks']} blocks of {kv['block_bytes']:,} B)"
              + (", prefix cache" if kv["prefix_cache"] else "")
              + (f", chunks of {kv['chunk']}" if kv["chunk"] else ""))
    layout += ", fp8 pool" if kv["kv_dtype"] == "fp8" else ""
    print(f"model {m['name']} ({m['dtype']}{', tile products' if m['tiles'] else ''}) on {m['device']}, "
          f"queue {report['queue']} ({len(report['requests'])} requests), "
          f"KV cache {layout}, budget {kv['budget_bytes'] / 2**20:.2f} MiB")
    print(f"{'id':>3}{'arrives':>8}{'prompt':>7}{'tokens':>7}{'TTFT ms':>9}{'ITL p50':>8}{'p95':>7}{'p99':>7}{'max':>7}"
          f"{'preempted':>10}  stop")
    for r in report["requests"]:
        itl = r["itl_ms"]
        print(f"{r['id']:>3}{r['arrival_step']:>8}{len(r['prompt_ids']):>7}{len(r['tokens']):>7}{ms(r['ttft_ms']):>9}"
              f"{ms(itl['p50']):>8}{ms(itl['p95']):>7}{ms(itl['p99']):>7}{ms(itl['max']):>7}{r['preemptions']:>10}  "
              f"{r['stop_reason']}")
    print(f"at once at most {kv['max_concurrent']}; reserved peak {kv['bytes_reserved_peak'] / 2**20:.2f} MiB, held "
          f"peak {kv['bytes_held_peak'] / 2**20:.2f} MiB, waste {kv['waste_fraction']:.1%} of the reserved bytes over "
          f"the steps; blocks shared at most {kv['shared_blocks']}; prefill positions computed "
          f"{kv['prefill_positions_computed']:,}; preemptions {kv['preemptions']}")
    itl = report["itl_ms"]
    print(f"{report['tokens']} tokens in {report['steps']} steps, {report['tokens_per_s']:.1f} tokens/s; TTFT p50 "
          f"{ms(report['ttft_ms_p50'])} ms; ITL p50 {ms(itl['p50'])}, p99 {ms(itl['p99'])}, max {ms(itl['max'])} ms")
    split = report["time_ms"]
    total = sum(split.values()) or 1.0
    print("where the clock went: " + ", ".join(f"{name.replace('_', ' ')} {ms:,.0f} ms ({ms / total:.0%})"
                                               for name, ms in split.items() if ms))
    for kind, ops in report["ops_ms"].items():  # the kernels' own clocks within each kind of pass
        print(f"  within the {kind} passes: " + ", ".join(f"{op.replace('_', ' ')} {ms:,.0f} ms"
                                                          for op, ms in ops.items()))
    start, joined = report["itl_ms_from_start"], report["ttft_ms_joined_p50"]
    if joined is not None and start["p99"] is not None:
        print(f"requests there from the start: ITL p99 {ms(start['p99'])}, max {ms(start['max'])} ms; those that "
              f"arrived later: TTFT p50 {ms(joined)} ms")
    if kv["offload"] is not None:
        print_offload(kv["offload"], kv["block_bytes"])
    if report["transfer"] is not None:
        print_transfer(report["transfer"], report["ttft_ms_p50"], report["itl_ms"])
    full = report["float32_pool"]
    if full is not None:
        print(f"the same queue on a float32 pool: {full['pool_blocks']} blocks, at once at most "
              f"{full['max_concurrent']}, preemptions {full['preemptions']}; {full['same_tokens']} of "
              f"{full['requests']} requests wrote the same tokens")
    print(report["conditions"])


def print_transfer(transfer: dict, ttft: float | None, itl: dict) -> None:
    alone = transfer["alone"]
    if alone is not None:
        print(f"the prefill worker {'did not start' if alone['why'] == 'start' else 'stopped'} at step "
              f"{alone['step']}: the run went on in this process, every request served")
    # which backend ran: NCCL between two GPUs; gloo, through host memory, on a CPU or one GPU (disaggregated.pairing)
    wire = "NCCL, GPU to GPU" if transfer["backend"] == "nccl" else "gloo, through host memory"
    print(f"two workers over torch.distributed ({wire}; the prefill worker on {transfer['worker_device']}): "
          f"{transfer['prompts']} prompts' keys and values "
          f"sent, {transfer['bytes']:,} B (the cache formula: {transfer['bytes_formula']:,} B), "
          f"{transfer['ms']:.1f} ms in recv; the prefill worker's forwards {transfer['prefill_ms']:.1f} ms")
    one = transfer["one_process"]
    print(f"TTFT p50 {ms(ttft)} ms, ITL p50 {ms(itl['p50'])}, p99 {ms(itl['p99'])} ms; in one process on the same "
          f"queue: TTFT p50 {ms(one['ttft_ms_p50'])} ms, ITL p50 {ms(one['itl_ms']['p50'])}, p99 "
          f"{ms(one['itl_ms']['p99'])} ms; the same tokens: {'yes' if one['same_tokens'] else 'no'}")


def print_offload(offload: dict, block_bytes: int) -> None:
    where = "a file on disk (pwrite/pread)" if offload["kind"] == "disk" else "host memory below the GPU's pool"
    print(f"second tier: {where}, {offload['tier_bytes'] / 2**20:.2f} MiB; measured before the run, per block of "
          f"{block_bytes:,} B: out {offload['ms_per_block_out']:.3f} ms, back in {offload['ms_per_block_in']:.3f} ms, "
          f"recomputed {offload['recompute_ms_per_block']:.3f} ms")
    print(f"{'positions':>10}{'blocks':>7}{'out ms':>9}{'in ms':>9}{'recompute ms':>14}")
    for p in offload["points"]:
        print(f"{p['positions']:>10}{p['blocks']:>7}{p['out_ms']:>9.3f}{p['in_ms']:>9.3f}{p['recompute_ms']:>14.3f}")
    crossover = offload["crossover_positions"]
    print("moving out and back beats recomputing " + (f"from {crossover} positions on" if crossover is not None
                                                      else "at no measured length: every victim is computed again"))
    recomputed = ", ".join(f"{n} {why}" for why, n in offload["recomputed"].items() if n) or "none"
    print(f"this run: {offload['blocks_out']} blocks moved out ({offload['bytes']:,} B), {offload['blocks_in']} back "
          f"in; victims computed again instead: {recomputed}")


def check_option_pairs(args) -> None:
    """Options that the others make meaningless are refused, not ignored."""
    if args.kv == "padded" and args.block_size is not None:
        raise InputError("option_needs", option="--block-size", needs="--kv paged")
    if args.kv == "padded" and args.disaggregate:
        raise InputError("padded_no_workers")
    if args.dtype is not None and "," in args.dtype:
        raise InputError("queue_one_dtype", dtype=args.dtype)
    if args.disaggregate and (args.dtype not in (None, "float32") or args.tiles):  # the worker loads float32
        raise InputError("option_needs", option="--disaggregate", needs="--dtype float32")
    if args.tier_dir is not None and args.offload != "disk":
        raise InputError("option_needs", option="--tier-dir", needs="--offload disk")
    if args.tier_dir is not None and not args.tier_dir.strip():
        raise InputError("option_empty", option="--tier-dir")


def run_queue_cli(args) -> int:
    stray = given(args, SWEEP_ONLY)
    if stray:
        raise InputError("queue_sweep_option", option=stray[0])
    check_option_pairs(args)
    report = run_queue(args)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0
