"""Serving, measured: a batched decode step's time, the bytes it reads and the operations it does, against this
machine's own copy bandwidth and matmul peak; float32, bfloat16 and int8 weights and what they cost in accuracy;
a profiler timeline of a few steps.

python -m model serve-bench --model M --batch 1,2,4,8 --context 64,256 --dtype float32,bfloat16,int8 [--json]
python -m model profile --model M --steps N --trace FILE
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch.autograd import DeviceType

from model.engine.batch import (
    MAX_SLOTS,
    Request,
    Server,
    ServeStep,
    SlotCache,
    check_batch,
    decode_rows,
    flops,
    prefill_counts,
    weight_bytes,
)
from model.engine.counting import step_bytes
from model.engine.generate import session_budget_bytes
from model.engine.loading import load_model
from model.engine.lowbit import with_weights
from model.engine.runtime import NativeModel, synchronize
from model.engine.sampling import MAX_SEED, SamplingSettings, check_settings_or_refuse
from model.errors import InputError
from model.tools.bench import INT8_PEAK_ROWS, copy_bandwidth, filler_ids, matmul_peak, percentile, timed
from model.tools.options import check_list, check_option, file_target, written_at_end

ACCURACY_PROMPTS = 4       # prompts of filler ids, seeds 0 .. 3
ACCURACY_PROMPT_LEN = 16
ACCURACY_NEW_TOKENS = 24
TOP_OPS = 12
GREEDY = SamplingSettings()
BENCH_CONTEXTS = (64, 256)  # serve-bench's contexts: those below the model's context, else its context - 1
MAX_BENCH_STEPS = 1000      # serve-bench --steps: timed steps per setting
PROFILE_CONTEXT = 64        # profile's context, or the model's context - 1 where that is shorter
# profile --steps: the profiler holds every event of every step in memory, about 4.7 MB a step of small and 34 MB
# of smollm2 (max RSS measured on CPU: small 490 MB at 20 steps, 1,336 MB at 200; smollm2 1.8 GB at 10, 3.2 GB at 50)
MAX_PROFILE_STEPS = 50


@dataclass(frozen=True)
class Machine:
    device: str
    threads: int
    copy_gb_s: float       # copy_bandwidth: a 256 MiB float32 copy, read + write
    matmul_gflops: float   # matmul_peak in `dtype`: 1024 × 1024 · 1024 × 1024 (int8 weights: 64 rows of it)
    dtype: str = "float32"

    @property
    def how(self) -> str:
        product = (f"{INT8_PEAK_ROWS}×1024 float32 by 1024×1024 int8 weight-only matmul" if self.dtype == "int8"
                   else f"1024×1024 {self.dtype} matmul")
        return (f"copy of a 256 MiB float32 tensor (read + write counted), {product}; median of 5 after a warm-up, "
                f"{self.threads} thread(s) on {self.device}")


def measure_machine(device: torch.device) -> Machine:
    return Machine(str(device), torch.get_num_threads(), copy_bandwidth(device) / 1e9, matmul_peak(device) / 1e9)


def with_matmul_peak(machine: Machine, dtype: str) -> Machine:
    """The same machine's roofs with the compute roof of `dtype`'s kernel (the memory roof is bytes, whatever they
    hold)."""
    if dtype == machine.dtype:
        return machine
    peak = matmul_peak(torch.device(machine.device), dtype=dtype) / 1e9
    return dataclasses.replace(machine, matmul_gflops=peak, dtype=dtype)


@dataclass
class Work:
    """One step's measured time and its counted work, and what they give on the roofline."""
    ms: list[float]
    bytes_read: int
    flops: int
    tokens: int    # tokens the step produces (decode: one per row; a prefill: the first token)

    @property
    def p50(self) -> float:
        return percentile(self.ms, 50)

    @property
    def intensity(self) -> float:
        """FLOPs per byte read: the roofline's x."""
        return self.flops / self.bytes_read

    @property
    def gb_s(self) -> float:
        return self.bytes_read / (self.p50 / 1000) / 1e9

    @property
    def gflops(self) -> float:
        return self.flops / (self.p50 / 1000) / 1e9

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.p50 / 1000)


def checked_batch(model: NativeModel, batch: int, context: int) -> None:
    """Refuse a batch the session could not hold, and a context past the model's, in one sentence."""
    if not 1 <= context < model.info.context_length:
        raise InputError("serving_context", context=context, most=model.info.context_length - 1)
    check_batch(model, batch, context + 1, session_budget_bytes())


@torch.inference_mode()
def filled_slots(model: NativeModel, batch: int, context: int, tick: Callable[[], None] | None = None) -> SlotCache:
    """`batch` slots each holding the same `context` prefilled positions of filler ids; tick() runs after each layer
    of the prefill (a caller that may stop there)."""
    solo = model.new_cache()
    model.forward(filler_ids(model, context), solo, output_attentions=False,
                  after_layer=None if tick is None else lambda _: tick())
    cache = SlotCache(model.info.n_layers, batch, model.info.layer_windows)
    for slot in range(batch):
        cache.load(slot, solo)
    return cache


def row_requests(batch: int, settings: SamplingSettings) -> list[Request]:
    """One request per row, drawing with `settings`, row r with seed settings.seed + r."""
    return [Request(r, [], 0, settings=dataclasses.replace(settings, seed=settings.seed + r)) for r in range(batch)]


def decode_work(model: NativeModel, batch: int, context: int, repeats: int,
                settings: SamplingSettings = GREEDY, tick: Callable[[], None] | None = None) -> Work:
    """A decode step of `batch` rows over `context` cached positions each (each repeat rewinds the rows, so every
    repeat sees the same lengths), each row's token then drawn with `settings` (greedy: the argmax): its times, the
    bytes it reads (every weight once + each row's cache) and FLOPs. tick() runs between the untimed prefill's
    layers and between the timed steps (a caller that may stop there)."""
    checked_batch(model, batch, context)
    check_settings_or_refuse(settings)
    cache = filled_slots(model, batch, context, tick)
    tokens = filler_ids(model, batch, seed=1)
    rows = row_requests(batch, settings)

    def one_step():
        logits = decode_rows(model.module, cache, tokens)
        [row.choose(row_logits) for row, row_logits in zip(rows, logits)]
        cache.lengths[:batch] = [context] * batch

    ms = timed(model.device, one_step, repeats, tick)
    cache_bytes = [model.info.cache_bytes_formula(context + 1)] * batch
    return Work(ms, step_bytes(weight_bytes(model.module, batch), cache_bytes),
                flops(model.module, [(1, context + 1)] * batch), batch)


def prefill_work(model: NativeModel, n: int, repeats: int) -> Work:
    """A prefill of n positions, timed, with its counts."""
    ids = filler_ids(model, n)
    ms = timed(model.device, lambda: model.forward(ids, model.new_cache(), output_attentions=False), repeats)
    return Work(ms, *prefill_counts(model, n), 1)


@dataclass(frozen=True)
class Accuracy:
    dtype: str
    max_abs_logit_diff: float  # over every predicted position of every prompt, against float32
    greedy_agree: int          # positions where the argmax equals float32's
    greedy_total: int
    prompt_len: int            # ids of each prompt, and the tokens float32 wrote after it (fewer on a short context)
    new_tokens: int

    @property
    def agreement(self) -> float:
        return self.greedy_agree / self.greedy_total


@torch.inference_mode()
def accuracy(reference: NativeModel, other: NativeModel, dtype: str) -> Accuracy:
    """float32 writes ACCURACY_NEW_TOKENS greedy tokens after each of ACCURACY_PROMPTS fixed prompts (fewer where the
    context is shorter); both models then read that same text in one pass, and at every position that predicted a new
    token their logits are compared (max |Δ|) and their argmax (the greedy choice) checked for agreement."""
    context = reference.info.context_length
    prompt_len = min(ACCURACY_PROMPT_LEN, context // 4)
    new_tokens = min(ACCURACY_NEW_TOKENS, context - prompt_len)
    worst, agree, total = 0.0, 0, 0
    for seed in range(ACCURACY_PROMPTS):
        ids = filler_ids(reference, prompt_len, seed=seed)
        cache = reference.new_cache()
        for _ in range(new_tokens - 1):
            logits, _ = reference.forward(ids[len(ids) - 1:] if cache.length else ids, cache, output_attentions=False)
            ids.append(int(logits.argmax()))
        x = torch.tensor([ids], device=reference.device)                          # (1, T)
        predicting = slice(prompt_len - 1, len(ids))                               # each new token, and the next
        ref = reference.module(x).logits[0, predicting].float()                     # (new tokens, vocab)
        low = other.module(x).logits[0, predicting].float()
        worst = max(worst, float((ref - low).abs().max()))
        agree += int((ref.argmax(-1) == low.argmax(-1)).sum())
        total += ref.shape[0]
    return Accuracy(dtype, worst, agree, total, prompt_len, new_tokens)


def parse_list(text: str, convert, what: str) -> list:
    try:
        values = [convert(part) for part in text.split(",") if part.strip()]
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
        "machine": asdict(machine) | {"how": machine.how},
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
    print(f"machine: {machine['copy_gb_s']:.2f} GB/s copy, {machine['matmul_gflops']:.1f} GFLOP/s matmul "
          f"({machine['how']})")
    print(f"{'dtype':<9}{'batch':>6}{'context':>8}{'p50 ms':>9}{'p95':>8}{'p99':>8}{'tok/s':>9}{'MB read':>9}"
          f"{'GB/s':>7}{'of machine':>11}{'GFLOP/s':>9}")
    for r in report["rows"]:
        s = r["step_ms"]
        print(f"{r['dtype']:<9}{r['batch']:>6}{r['context']:>8}{s['p50']:>9.2f}{s['p95']:>8.2f}{s['p99']:>8.2f}"
              f"{r['tokens_per_s']:>9.1f}{r['bytes_read'] / 1e6:>9.1f}{r['achieved_gb_s']:>7.2f}"
              f"{r['achieved_gb_s'] / r['machine_gb_s']:>10.0%} {r['achieved_gflops']:>8.2f}")
    p = report["prefill"]
    print(f"prefill of {p['positions']} positions (float32): {p['ms_p50']:.1f} ms, {p['achieved_gflops']:.2f} GFLOP/s, "
          f"{p['intensity']:.1f} FLOP/byte")
    for a in report["accuracy"]:
        print(f"{a['dtype']}: max |Δlogit| vs float32 {a['max_abs_logit_diff']:.4f}, greedy tokens agreeing "
              f"{a['greedy_agree']}/{a['greedy_total']} ({a['agreement']:.1%})")
    print(report["conditions"])


def run_cli(args) -> int:
    check_option("--steps", args.steps, 1, MAX_BENCH_STEPS)
    batches = parse_list(args.batch, int, "--batch")
    contexts = None if args.context is None else parse_list(args.context, int, "--context")
    dtypes = parse_list(args.dtype, str.strip, "--dtype")
    for option, values in (("--batch", batches), ("--context", contexts), ("--dtype", dtypes)):
        if values is not None:
            check_list(option, values)
    for batch in batches:
        check_option("--batch", batch, 1, MAX_SLOTS)
    check_option("--seed", args.seed, 0, MAX_SEED - (max(batches) - 1))  # row r draws with seed + r
    settings = SamplingSettings(args.temperature, args.top_k, args.top_p, args.seed)
    report = run_serve_bench(args.model, batches, contexts, dtypes, args.device, args.steps, settings)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


# -- the timeline -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OpShare:
    name: str
    ms_per_step: float  # the op's own time (its children's not included) on `clock`, averaged over the steps
    share: float        # of the step's time there: the sum of every op's own time
    calls_per_step: float
    clock: str = "cpu"  # "cpu": time on the CPU; "device": time on the GPU (the CPU's time launching it not counted)


def profile_steps(model: NativeModel, batch: int, context: int, steps: int,
                  trace_file: str | None = None, tick: Callable[[], None] | None = None) -> list[OpShare]:
    """torch.profiler over `steps` decode steps of `batch` rows at `context` positions (CPU, and CUDA when the model
    is there); each step is a record_function "decode step i" on the timeline. Returns the TOP_OPS ops by their own
    time; trace_file gets the Chrome-trace JSON (Perfetto and chrome://tracing open it). tick() runs between the
    layers of the unprofiled prefill and warm-up, and between the profiled steps (a caller that may stop there)."""
    checked_batch(model, batch, context)
    cache = filled_slots(model, batch, context, tick)
    tokens = filler_ids(model, batch, seed=1)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if model.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    decode_rows(model.module, cache, tokens, None if tick is None else lambda _: tick())  # warm-up, not profiled
    cache.lengths[:batch] = [context] * batch
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(steps):
            with torch.profiler.record_function(f"decode step {i}"):
                decode_rows(model.module, cache, tokens)
                synchronize(model.device)
            cache.lengths[:batch] = [context] * batch
            if tick is not None:
                tick()
    if trace_file:
        prof.export_chrome_trace(trace_file)
    return op_shares(prof.key_averages(), steps, "device" if model.device.type == "cuda" else "cpu")


def op_shares(events, steps: int, clock: str) -> list[OpShare]:
    """The TOP_OPS events of the profiler's key_averages by their own time on `clock`, as torch's own table adds them
    up: "cpu", every op by its own CPU time; "device" (a GPU), every kernel and copy by its time on the device, what a
    step waits for (an op's CPU time there is its launch, and the step's synchronize soaks up the wait)."""
    if clock == "device":
        kept = [e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    else:
        kept = [e for e in events if not e.is_user_annotation]   # the "decode step i" marks hold every op

    def own_us(e) -> float:
        return e.self_device_time_total if clock == "device" else e.self_cpu_time_total

    total_us = sum(own_us(e) for e in kept)
    top = sorted(kept, key=own_us, reverse=True)[:TOP_OPS]
    return [OpShare(e.key, own_us(e) / 1000 / steps, own_us(e) / total_us, e.count / steps, clock) for e in top]


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

def queue_lengths(requests: int, prompt_lengths: tuple[int, int], new_tokens: tuple[int, int],
                  seed: int = 0) -> tuple[list[int], list[int]]:
    """Each request's prompt length and token budget, drawn (seeded) from the two ranges."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt_lengths[0], prompt_lengths[1] + 1, size=requests).tolist()
    budgets = rng.integers(new_tokens[0], new_tokens[1] + 1, size=requests).tolist()
    return lengths, budgets


def queue(model: NativeModel, requests: int, prompt_lengths: tuple[int, int], new_tokens: tuple[int, int],
          seed: int = 0, settings: SamplingSettings = GREEDY) -> list[Request]:
    """`requests` requests of filler ids, each with its own prompt length and token budget (queue_lengths), so that
    they finish at different steps and the waiting ones join as slots free; request i draws with `settings` and its
    own seed, settings.seed + i."""
    lengths, budgets = queue_lengths(requests, prompt_lengths, new_tokens, seed)
    return [Request(i, filler_ids(model, n, seed=seed + i), budget,
                    settings=dataclasses.replace(settings, seed=settings.seed + i))
            for i, (n, budget) in enumerate(zip(lengths, budgets))]


def most_lengths(context_length: int) -> tuple[int, int]:
    """The Serving page's longest prompt and most new tokens on a model of `context_length` positions: a prompt of
    up to half the context (256 at most), new tokens up to 64 within what is left, so that any pair fits."""
    prompt = max(1, min(256, context_length // 2))
    return prompt, max(1, min(64, context_length - 1 - prompt))


PROBE_ROWS = 4


@dataclass(frozen=True)
class PassCosts:
    """A model's passes on this machine, timed once each: a prefill of 1 and of PROBE_ROWS positions, a decode step
    of 1 and of PROBE_ROWS rows (ms); a longer pass is told by the straight line through the two (never falling)."""
    prefill_ms: tuple[float, float]
    decode_ms: tuple[float, float]

    @staticmethod
    def _line(ms: tuple[float, float], n: int) -> float:
        one, probe = ms
        return one + max(0.0, probe - one) * (n - 1) / (PROBE_ROWS - 1)

    def prefill(self, positions: int) -> float:
        return self._line(self.prefill_ms, positions)

    def decode(self, rows: int) -> float:
        return self._line(self.decode_ms, rows)


def pass_costs(model: NativeModel) -> PassCosts:
    """PassCosts of `model` in its own weights (each pass timed once after a warm-up)."""
    return PassCosts((prefill_work(model, 1, 1).p50, prefill_work(model, PROBE_ROWS, 1).p50),
                     (decode_work(model, 1, 1, 1).p50, decode_work(model, PROBE_ROWS, 1, 1).p50))


@dataclass(frozen=True)
class StepEstimate:
    prompts: int       # prompts the first step prefills
    positions: int     # their positions together
    first_ms: float    # the first step: those prefills
    rows: int          # the most rows a decode step has
    decode_ms: float   # a decode step of that many rows


def estimate_steps(costs: PassCosts, slots: int, requests: int, prompt_lengths: tuple[int, int],
                   new_tokens: tuple[int, int]) -> StepEstimate:
    """What start_serving's queue would cost by `costs`: its first step prefills the first `slots` prompts; a decode
    step has at most min(slots, requests) rows."""
    first = queue_lengths(requests, prompt_lengths, new_tokens)[0][:slots]
    rows = min(slots, requests)
    return StepEstimate(len(first), sum(first), sum(costs.prefill(n) for n in first), rows, costs.decode(rows))


# the Serving page's controls, as its refusals name them
PAGE_LABELS = {"slots_label_text": "serving.slots", "prompt_label_text": "serving.prompt_lengths",
               "new_label_text": "serving.new_tokens"}


def start_serving(model: NativeModel, slots: int, requests: int, prompt_lengths: tuple[int, int],
                  new_tokens: tuple[int, int], settings: SamplingSettings = GREEDY) -> Server:
    """The Serving page's run, refused in the page's own terms (its controls' names)."""
    if requests < 1:
        raise InputError("serving_requests", requests=requests)
    if prompt_lengths[1] + new_tokens[1] >= model.info.context_length:
        raise InputError("serving_lengths", prompt=prompt_lengths[1], new=new_tokens[1],
                         context=model.info.context_length, **PAGE_LABELS)
    check_settings_or_refuse(settings)
    try:
        return Server(model, slots, queue(model, requests, prompt_lengths, new_tokens, settings=settings),
                      session_budget_bytes())
    except InputError as bad:
        if bad.code != "serving_budget":
            raise
        raise InputError("serving_queue_budget", **bad.details, **PAGE_LABELS) from None


@dataclass(frozen=True)
class RequestTiming:
    id: int
    prompt_len: int
    tokens: int
    ttft_ms: float | None
    itl_ms: dict[str, float | None]   # p50, p95, p99
    stop_reason: str | None


def request_timings(server: Server) -> list[RequestTiming]:
    rows = []
    for r in server.requests.values():
        itl = r.itl_ms
        rows.append(RequestTiming(r.id, len(r.prompt_ids), len(r.new_ids), r.ttft_ms,
                                  {f"p{q}": percentile(itl, q) if itl else None for q in (50, 95, 99)},
                                  r.stop_reason))
    return rows


@dataclass(frozen=True)
class RooflinePoint:
    label: str        # "B=4", "prefill 64"
    intensity: float  # FLOPs per byte read
    gflops: float     # achieved
    gb_s: float       # achieved
    ms: float
    rows: int | None = None  # a decode pass's batch size; None for a prefill


def roofline_points(server: Server) -> list[RooflinePoint]:
    """One point per batch size the run's decode passes had (their median step), one for its longest prefill."""
    by_rows: dict[int, list[ServeStep]] = {}
    for step in server.steps:
        if step.decode_lengths:
            by_rows.setdefault(len(step.decode_lengths), []).append(step)
    points = []
    for rows, steps in sorted(by_rows.items()):
        typical = sorted(steps, key=lambda s: s.decode_ms)[len(steps) // 2]
        points.append(point(f"B={rows}", typical.decode_flops, typical.decode_bytes, typical.decode_ms, rows))
    longest = longest_prefill(server)
    if longest is not None:
        points.append(point(f"prefill {longest.positions}", longest.flops, longest.bytes_read, longest.ms))
    return points


@dataclass(frozen=True)
class TimedPrefill:
    positions: int
    ms: float
    bytes_read: int
    flops: int

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes_read


def longest_prefill(server: Server) -> TimedPrefill | None:
    """The run's longest prefill, the first of them when several are as long, with its own time (each joiner's
    prefill runs and is timed alone) and counts; None before any."""
    prefills = [(n, ms) for step in server.steps for n, ms in zip(step.prefill_lengths, step.prefill_each_ms)]
    if not prefills:
        return None
    n, ms = max(prefills, key=lambda p: p[0])
    return TimedPrefill(n, ms, *prefill_counts(server.model, n))


def prefill_intensity(model: NativeModel, n: int) -> float:
    """FLOPs per byte of a prefill of n positions (prefill_counts)."""
    bytes_read, prefill_flops = prefill_counts(model, n)
    return prefill_flops / bytes_read


def positions_to_pass(model: NativeModel, ridge: float) -> int | None:
    """The fewest prompt positions whose prefill does at least `ridge` FLOPs per byte (its intensity grows with
    n); None when no prefill within the model's context does."""
    low, high = 1, model.info.context_length
    if prefill_intensity(model, high) < ridge:
        return None
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if prefill_intensity(model, middle) < ridge else (low, middle)
    return low


def point(label: str, flops: int, bytes_read: int, ms: float, rows: int | None = None) -> RooflinePoint:
    return RooflinePoint(label, flops / bytes_read, flops / (ms / 1000) / 1e9, bytes_read / (ms / 1000) / 1e9, ms,
                         rows)


def sweep(model: NativeModel, batches: list[int], contexts: list[int], repeats: int = 5,
          report: Callable[[int, int, int, int], None] | None = None) -> dict[int, list[Work]]:
    """Per context, a decode step's Work at each batch size: ITL and throughput against B and context length.
    report(done, total, batch, context) runs before each measurement and between its passes (decode_work's tick),
    where a caller may stop the sweep by raising."""
    settings = [(c, b) for c in contexts for b in batches]
    works: dict[int, list[Work]] = {c: [] for c in contexts}
    for done, (c, b) in enumerate(settings):
        tick = None if report is None else functools.partial(report, done, len(settings), b, c)
        if tick is not None:
            tick()
        works[c].append(decode_work(model, b, c, repeats, tick=tick))
    return works
