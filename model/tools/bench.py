"""Time per output token, with and without the KV cache, and the engine against transformers.

Timings synchronise the device and drop a warm-up step. Ratios are measured side by side in one run,
because these machines are shared and noisy: compare the ratios, not absolute numbers across runs.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model.engine.llama import Llama, LlamaConfig
from model.engine.loading import load_shared_native
from model.engine.runtime import LoadedModel, NativeModel, pick_device
from model.engine.steps import decode, prefill
from model.serving.timing import filler_ids, percentile, read_bandwidth, time_per_token, timed
from model.weights.catalog import resolve_path

# -- python -m model bench ---------------------------------------------------------------------------------

def gpt2_small_llama_config() -> LlamaConfig:
    """A Llama the size of GPT-2 small (~124M parameters): 12 layers, 12 heads of 64, 768 wide."""
    return LlamaConfig(vocab_size=50257, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=12, head_dim=64, max_position_embeddings=1024,
                       tie_word_embeddings=True)


@dataclass
class EngineTiming:
    prefill_ms: list[float]
    step_ms: list[float]  # decode steps with attention capture, as a session runs them


def engine_steps(model: LoadedModel, prompt: list[int], new_tokens: int) -> Iterator[float]:
    """One prefill and `new_tokens` greedy decode steps through the same StepTrace path the app uses, run one at a
    time as they are asked for: the wall time of each in ms, trace building included (the steps synchronise the
    device before they return)."""
    cache, token = model.new_cache(), None
    for index in range(new_tokens + 1):
        t0 = time.perf_counter()
        trace = prefill(model, cache, prompt) if index == 0 else decode(model, cache, token)
        token = int(np.argmax(trace.logits))
        yield (time.perf_counter() - t0) * 1000


def time_engine(model: LoadedModel, prompt: list[int], new_tokens: int) -> EngineTiming:
    """engine_steps run to the end: the prefill's time and the decode steps'."""
    times = list(engine_steps(model, prompt, new_tokens))
    return EngineTiming(times[:1], times[1:])


def native_and_transformers(folder: Path, label: str, device: torch.device) -> tuple[NativeModel, LoadedModel]:
    """The same checkpoint on both engines (the native architecture its config names: Llama or Gemma 3), ids
    only."""
    from transformers import AutoModelForCausalLM

    from model.engine.hf import HFModel

    native = NativeModel(label, load_shared_native(folder, device), None, device)
    theirs = HFModel(label, AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                                 dtype=torch.float32).to(device).eval(), None, device)
    return native, theirs


@dataclass(frozen=True)
class StepComparison:
    prompt_len: int
    native_ms: list[float]        # decode steps, attention captured
    transformers_ms: list[float]

    def ratio(self, q: int) -> float:
        """native / transformers of the q-th percentile step."""
        return percentile(self.native_ms, q) / percentile(self.transformers_ms, q)


def compare_with_transformers(models: tuple[NativeModel, LoadedModel], label: str, prompt_len: int,
                              new_tokens: int, repeats: int) -> StepComparison:
    """Prefill and decode steps with attention capture on both engines (native_and_transformers), interleaved step
    by step (native's prefill, transformers' prefill, native's first step, transformers' first step…), so that a
    burst of load on this shared machine hits both; prints the table and returns both engines' decode steps."""
    native, theirs = models
    prompt = filler_ids(native, prompt_len)
    engines = {"native": native, "transformers": theirs}
    for model in engines.values():
        time_engine(model, prompt, 2)  # warm-up, dropped
    runs = {name: EngineTiming([], []) for name in engines}
    for _ in range(repeats):
        running = {name: engine_steps(model, prompt, new_tokens) for name, model in engines.items()}
        for step in range(new_tokens + 1):
            for name, steps in running.items():
                (runs[name].prefill_ms if step == 0 else runs[name].step_ms).append(next(steps))
    n, h = runs["native"], runs["transformers"]
    info = native.info
    print(f"\n{label}: {info.n_layers} layers, {info.n_heads} heads ({info.n_kv_heads} KV), d_head {info.d_head}, "
          f"{info.dtype} on {info.device}, {torch.get_num_threads()} threads, batch 1, prompt {prompt_len}, "
          f"{new_tokens} steps × {repeats}, attention captured, the engines' steps interleaved one by one; torch "
          f"{torch.__version__}, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'':<14}{'prefill p50':>12}{'ITL p50':>10}{'ITL p95':>10}   (ms)")
    for name, t in runs.items():
        print(f"{name:<14}{percentile(t.prefill_ms, 50):>12.2f}{percentile(t.step_ms, 50):>10.2f}"
              f"{percentile(t.step_ms, 95):>10.2f}")
    steps = StepComparison(prompt_len, n.step_ms, h.step_ms)
    print(f"{'native / tf':<14}{percentile(n.prefill_ms, 50) / percentile(h.prefill_ms, 50):>11.2f}×"
          f"{steps.ratio(50):>9.2f}×{steps.ratio(95):>9.2f}×")
    return steps


def print_cache_vs_recompute(model: LoadedModel, contexts: list[int], repeats: int) -> None:
    info = model.info
    print(f"\ncached vs recomputed step, {info.name}, {info.dtype} on {info.device}, batch 1, {repeats} repeats")
    print(f"{'positions':>9}{'cached p50':>12}{'p95':>8}{'recompute p50':>15}{'p95':>8}{'ratio':>8}   (ms)")
    for r in time_per_token(model, contexts, repeats):
        print(f"{r.context:>9}{percentile(r.cached_ms, 50):>12.2f}{percentile(r.cached_ms, 95):>8.2f}"
              f"{percentile(r.recompute_ms, 50):>15.2f}{percentile(r.recompute_ms, 95):>8.2f}{r.speedup:>7.1f}×")


def generate_ms_per_token(module, prompt: list[int], new_tokens: int, device: torch.device) -> float:
    """`model.generate`'s decode steps only: (new_tokens + 1 tokens) − (1 token, the prefill), per decode step."""
    x = torch.tensor([prompt], device=device)

    def run(tokens: int) -> float:
        [ms] = timed(device, lambda: module.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
            pad_token_id=0), repeats=1)
        return ms

    return (run(new_tokens + 1) - run(1)) / new_tokens


def compare_with_generate(device: torch.device, quick: bool, tiny: bool = False) -> None:
    """A GPT-2-small-shaped random model (12 layers, 12 heads, 768 wide, vocab 50257): ms per output token of
    the transformers backend's decode step with attention capture vs `model.generate`, same weights, greedy.
    tiny: 2 layers, 64 wide, vocab 512, prompt 16 (a smoke test of the code path, not a measurement)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from model.engine.hf import HFModel

    torch.manual_seed(0)
    config = (GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=128, bos_token_id=0,
                         eos_token_id=0) if tiny else
              GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024))
    module = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(device).eval()
    model = HFModel("gpt2-small (random)" if not tiny else "gpt2-tiny (random)", module, None, device)
    prompt = filler_ids(model, 16 if tiny else 128)
    new_tokens, repeats = (4, 1) if tiny else (16, 1) if quick else (64, 3)
    time_engine(model, prompt, 2)  # warm-up, dropped
    ours, theirs = [], []
    for _ in range(repeats):  # interleaved, so that both see the same machine load
        ours.append(float(np.mean(time_engine(model, prompt, new_tokens).step_ms)))
        theirs.append(generate_ms_per_token(module, prompt, new_tokens, device))
    step_ms, generate_ms = float(np.median(ours)), float(np.median(theirs))
    shape = "GPT-2-tiny" if tiny else "GPT-2-small"
    print(f"\n{shape} shape, random weights, {device} {model.info.dtype}, {torch.get_num_threads()} threads, "
          f"prompt {len(prompt)}, {new_tokens} new tokens, greedy, median of {repeats}")
    print(f"{'path':<40} {'ms/token':>9}")
    print(f"{'decode step + attention capture':<40} {step_ms:>9.2f}")
    print(f"{'model.engine.generate':<40} {generate_ms:>9.2f}")
    print(f"{'ratio':<40} {step_ms / generate_ms:>9.2f}")


def tiny_llama_config() -> LlamaConfig:
    """2 layers, 4 heads over 2 KV heads of 16, vocab 512: the benchmark's code paths in a fraction of a second."""
    return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                       tie_word_embeddings=True)


def run_bench(device: str = "auto", quick: bool = False, tiny: bool = False) -> None:
    """tiny: every table of the benchmark on tiny shapes (micro and a 2-layer random Llama), one repeat."""
    dev = pick_device(device)
    repeats = 1 if quick or tiny else 3
    bundled = "micro" if tiny else "small"
    compare_with_transformers(native_and_transformers(resolve_path(bundled), bundled, dev), bundled,
                              2 if tiny else 24, 2 if tiny else 32, repeats)
    torch.manual_seed(0)
    label = "llama-tiny (random)" if tiny else "llama-124M (random)"
    with tempfile.TemporaryDirectory() as tmp:
        Llama(tiny_llama_config() if tiny else gpt2_small_llama_config()).save(tmp)
        compare_with_transformers(native_and_transformers(Path(tmp), label, dev), label, 16 if tiny else 128,
                                  4 if tiny else 16 if quick else 32, repeats)
        big = NativeModel(label, load_shared_native(Path(tmp), dev), None, dev)
        print_cache_vs_recompute(big, [16, 32] if tiny else [64, 256, 512], 1 if tiny else 3 if quick else 10)
    compare_with_generate(dev, quick, tiny)


STEP_RATIO_GOAL = 0.8  # a native step with attention capture against transformers' step with attentions


def run_model_bench(name: str, device: str = "auto", quick: bool = False) -> None:
    """One listed model (smollm2, gemma3): the native engine's step against transformers' on the same weights, at a
    short and a long context (and past a sliding window), the memory-bound limit, then cached against recomputed
    steps."""
    from model.weights.catalog import locate

    dev = pick_device(device)
    location = locate(name, operator=True)
    t0 = time.perf_counter()
    models = native_and_transformers(Path(location.where), name, dev)
    print(f"{name}: both engines loaded in {time.perf_counter() - t0:.1f} s")
    repeats, new_tokens = (1, 8) if quick else (3, 16)
    native = models[0].info
    # past the window too, where the sliding layers' caches stop growing
    prompt_lens = (30, 200) if native.window is None else (30, 200, native.window + 100)
    runs = [compare_with_transformers(models, name, prompt_len, new_tokens, repeats) for prompt_len in prompt_lens]
    print()
    for q in (50, 95):
        ratios = [r.ratio(q) for r in runs]
        verdict = "meets" if max(ratios) <= STEP_RATIO_GOAL else "misses"
        print(f"decode step native / transformers (p{q}): "
              f"{', '.join(f'{r:.2f}' for r in ratios)} at {', '.join(map(str, prompt_lens))} positions; "
              f"goal ≤ {STEP_RATIO_GOAL}: {verdict}")
    print_memory_bound(models[0], runs[-1], dev)
    print_cache_vs_recompute(models[0], [64, 256, 1024] if not quick else [64, 256], 3 if quick else 5)


def print_memory_bound(model: NativeModel, steps: StepComparison, device: torch.device) -> None:
    """A decode step reads every weight once (the LM head the whole embedding) and the cache's held K and V:
    those bytes over the measured read bandwidth are the fastest a step can be on this machine."""
    info = model.info
    positions = steps.prompt_len  # the cache the first step reads; the later steps add a few positions
    weights = sum(p.numel() * p.element_size() for p in model.module.parameters())
    cache = info.cache_bytes_formula(positions)
    bandwidth = read_bandwidth(device)
    limit_ms = (weights + cache) / bandwidth * 1000
    step_ms = percentile(steps.native_ms, 50)
    print(f"\nmemory-bound limit at ~{positions} positions: the step reads {weights / 1e6:,.0f} MB of weights + "
          f"{cache / 1e6:,.1f} MB of KV cache; this machine reads {bandwidth / 1e9:.1f} GB/s (sum over 1 GiB, "
          f"{torch.get_num_threads()} threads) -> at least {limit_ms:.1f} ms; the native step's p50 {step_ms:.1f} ms "
          f"is {step_ms / limit_ms:.2f}× that")


