"""Measurements of batched decode on this machine (serve-bench, profile and the Serving page's sweep): decode and
prefill steps timed against their bytes and FLOPs, the roofs of the machine in each dtype, the accuracy of fewer
bits, and the profiler's ops of one step."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType

from model.engine import kernels
from model.engine.counting import step_bytes
from model.engine.generate import session_budget_bytes
from model.engine.runtime import NativeModel, synchronize
from model.engine.sampling import SamplingSettings, check_settings_or_refuse
from model.errors import InputError
from model.serving.costs import flops, prefill_counts, weight_bytes
from model.serving.memory import MAX_SLOTS, BlockMemory, memory_layout, padded_bytes
from model.serving.paged import Row
from model.serving.quality import Quality, held_out, measure_quality, text_ids
from model.serving.request import Request
from model.serving.runner import run_rows
from model.serving.timing import (
    KERNEL_PEAK_ROWS,
    copy_bandwidth,
    filler_ids,
    matmul_peak,
    percentile,
    read_bandwidth,
    timed,
)

ACCURACY_PROMPTS = 4       # prompts of filler ids, seeds 0 .. 3

ACCURACY_PROMPT_LEN = 16

ACCURACY_NEW_TOKENS = 24

TOP_OPS = 12

GREEDY = SamplingSettings()

@dataclass(frozen=True)
class Machine:
    device: str
    threads: int
    copy_gb_s: float       # copy_bandwidth: a 256 MiB float32 copy, read + write
    read_gb_s: float       # read_bandwidth: a sum over 1 GiB, held as the packed weights are (huge pages)
    matmul_gflops: float   # matmul_peak in `dtype`: 1024 × 1024 · 1024 × 1024 (the kernels' peaks: 64 rows of it)
    dtype: str = "float32"

    @property
    def how(self) -> str:
        product = {"int8": f"{KERNEL_PEAK_ROWS}×1024 float32 (rounded to int16 per row) by 1024×1024 int8 matmul",
                   "bfloat16-weights": f"{KERNEL_PEAK_ROWS}×1024 float32 by 1024×1024 bfloat16 (widened) matmul",
                   }.get(self.dtype, f"1024×1024 {self.dtype} matmul")
        return (f"copy of a 256 MiB float32 tensor (read + write counted), sum over a 1 GiB float32 tensor held as the "
                f"packed weights are, {product}; median of 5 after a warm-up, {self.threads} thread(s) on "
                f"{self.device}")

def measure_machine(device: torch.device) -> Machine:
    return Machine(str(device), torch.get_num_threads(), copy_bandwidth(device) / 1e9, read_bandwidth(device) / 1e9,
                   matmul_peak(device) / 1e9)

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

def check_batch(model: NativeModel, slots: int, longest: int, budget_bytes: int) -> None:
    """A batch the engine's padded memory can hold within the session's memory budget, else one sentence: the native
    engine (Llama or Gemma 3), 1 to MAX_SLOTS slots, each of `longest` positions, within `budget_bytes`."""
    if not isinstance(model, NativeModel):
        raise InputError("serving_needs_native", model=model.info.name)
    if not 1 <= slots <= MAX_SLOTS:
        raise InputError("serving_slots", slots=slots)
    needed = padded_bytes(model.info, slots, longest)
    if needed > budget_bytes:
        raise InputError("serving_budget", slots=slots, mb=round(needed / 2**20), budget=round(budget_bytes / 2**20))

def checked_batch(model: NativeModel, batch: int, context: int) -> None:
    """Refuse a batch the session could not hold, and a context past the model's, in one sentence."""
    if not 1 <= context < model.info.context_length:
        raise InputError("serving_context", context=context, most=model.info.context_length - 1)
    check_batch(model, batch, context + 1, session_budget_bytes())

@torch.inference_mode()
def filled_memory(model: NativeModel, batch: int, context: int,
                  tick: Callable[[], None] | None = None) -> BlockMemory:
    """The engine's padded memory (the Serving page's) with `batch` requests, request r in slot r, each holding the
    same `context` prefilled positions of filler ids and room for one more: request 0's prompt through the runner,
    its blocks copied into the others'. tick() runs after each layer of the prefill (a caller that may stop there)."""
    layout = memory_layout(model.info, "padded", 0, context + 1)
    memory = BlockMemory(layout, batch * len(layout.groups), model.kv_dtype, model.device)
    ids = filler_ids(model, context)
    requests = [Request(r, ids, 1) for r in range(batch)]
    for request in requests:
        memory.grow(request, context + 1)
    run_rows(model.module, memory, [Row(0, 0, context, True, context)], torch.tensor([ids], device=model.device),
             None if tick is None else lambda _: tick())
    source = [block for table in memory.tables[0] for block in table]
    for request in requests[1:]:
        copies = [block for table in memory.tables[request.id] for block in table]
        for store in (memory.keys, memory.values):
            store[:, :, copies] = store[:, :, source]
    return memory

@torch.inference_mode()
def decode_pass(model: NativeModel, memory: BlockMemory, lengths: list[int], tokens: list[int],
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
    """One decode step over requests 0 .. len(lengths) − 1 of `memory` through the runner (the engine's step), row r
    feeding tokens[r] at position lengths[r] over the keys before it: the logits (rows, vocab). Nothing moves on, so
    the next call writes the same positions (a timed step repeated sees the same lengths)."""
    rows = [Row(r, n, 1, False, n + 1) for r, n in enumerate(lengths)]
    return run_rows(model.module, memory, rows, torch.tensor([tokens], device=model.device), after_layer)

def row_requests(batch: int, settings: SamplingSettings) -> list[Request]:
    """One request per row, drawing with `settings`, row r with seed settings.seed + r."""
    return [Request(r, [], 0, settings=dataclasses.replace(settings, seed=settings.seed + r)) for r in range(batch)]

def decode_work(model: NativeModel, batch: int, context: int, repeats: int,
                settings: SamplingSettings = GREEDY, tick: Callable[[], None] | None = None) -> Work:
    """A decode step of `batch` rows over `context` cached positions each (every repeat writes the same positions),
    each row's token then drawn with `settings` (greedy: the argmax): its times, the bytes it reads (every weight
    once + each row's cache) and FLOPs. tick() runs between the untimed prefill's layers and between the timed steps
    (a caller that may stop there)."""
    checked_batch(model, batch, context)
    check_settings_or_refuse(settings)
    memory = filled_memory(model, batch, context, tick)
    tokens = filler_ids(model, batch, seed=1)
    rows = row_requests(batch, settings)

    def one_step():
        logits = decode_pass(model, memory, [context] * batch, tokens)
        [row.choose(row_logits.float()) for row, row_logits in zip(rows, logits)]

    ms = timed(model.device, one_step, repeats, tick)
    cache_bytes = [model.info.cache_bytes_formula(context + 1)] * batch
    return Work(ms, step_bytes(weight_bytes(model.module, batch), cache_bytes),
                flops(model.module, [(1, context + 1)] * batch), batch)

@dataclass(frozen=True)
class DtypeCost:
    """One dtype's decode step at B = 1 (its time, the bytes it reads, the bandwidth that gives) beside what its
    fewer bits cost in accuracy against float32 (model/serving/quality.py, on the held-out text)."""
    dtype: str
    step_ms: float             # p50
    bytes_read: int
    gb_s: float
    perplexity: float
    greedy_agreement: float
    mean_kl: float


def dtype_costs(models: dict[str, NativeModel], context: int, repeats: int,
                tick: Callable[[], None] | None = None) -> tuple[list[DtypeCost], Quality]:
    """Each of `models` (by dtype, float32 among them: the reference): a B = 1 decode step over `context` cached
    positions, timed, and the quality of its dtype on the project's held-out text in the model's language; tick()
    runs between the passes (a caller that may stop there)."""
    reference = models["float32"]
    text = held_out(reference.info.language)
    quality = measure_quality(models, reference.info.name, text.name, text_ids(reference, text.text, text.name),
                              text.prompts, tick)
    works = {dtype: decode_work(model, 1, context, repeats, tick=tick) for dtype, model in models.items()}
    return [DtypeCost(row.dtype, works[row.dtype].p50, works[row.dtype].bytes_read, works[row.dtype].gb_s,
                      row.perplexity, row.greedy_agreement, row.mean_kl) for row in quality.rows], quality


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
        predicting = slice(prompt_len - 1, len(ids))                               # each new token, and the next
        ref = reference.every_logits(ids, None)[predicting].float()                 # (new tokens, vocab)
        low = other.every_logits(ids, None)[predicting].float()
        worst = max(worst, float((ref - low).abs().max()))
        agree += int((ref.argmax(-1) == low.argmax(-1)).sum())
        total += ref.shape[0]
    return Accuracy(dtype, worst, agree, total, prompt_len, new_tokens)

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
    memory = filled_memory(model, batch, context, tick)
    tokens, lengths = filler_ids(model, batch, seed=1), [context] * batch
    activities = [torch.profiler.ProfilerActivity.CPU]
    if model.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    decode_pass(model, memory, lengths, tokens, None if tick is None else lambda _: tick())  # warm-up, not profiled
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(steps):
            with torch.profiler.record_function(f"decode step {i}"):
                decode_pass(model, memory, lengths, tokens)
                synchronize(model.device)
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
    else:  # the "decode step i" marks hold every op; the decode kernels' ops are marks of ops of their own
        kept = [e for e in events if not e.is_user_annotation or e.key.startswith(kernels.PROFILED)]

    def own_us(e) -> float:
        return e.self_device_time_total if clock == "device" else e.self_cpu_time_total

    total_us = sum(own_us(e) for e in kept)
    top = sorted(kept, key=own_us, reverse=True)[:TOP_OPS]
    return [OpShare(e.key, own_us(e) / 1000 / steps, own_us(e) / total_us, e.count / steps, clock) for e in top]

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
