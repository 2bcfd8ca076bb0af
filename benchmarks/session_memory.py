"""What one session's run costs in server memory, measured against the formula in docs/deploy.md.

A random Llama with GPT-2's vocabulary (50,257 ids: the vocabulary size is what made the per-step sampling
arrays expensive) runs a 1000-step greedy decode; the process's resident memory is read before and after, and
again after the run is dropped. Prints the formula's bytes, the bytes the run counts (Generation.nbytes, KV
cache reserved) and the RSS growth.

With --model smollm2 or gemma3 (fetched): a 200-token prompt, the bytes a session holds per step as it runs (the real
model, --steps of them), then the same run to the budget with a stand-in forward pass that gives the real model's
shapes (uniform causal attention, K and V of zeros in the real cache; the bytes depend on the shapes alone), to tell
when old steps start keeping only the viewed layer and head, when they start losing their rows, and where the run
stops.

    .venv/bin/python benchmarks/session_memory.py [--steps 1000] [--budget-mb 128]
    .venv/bin/python benchmarks/session_memory.py --model smollm2 [--steps 40] [--budget-mb 256]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model.engine.generate import LOGITS_KEPT, context_room, run_to_end, start, step  # noqa: E402
from model.engine.llama import Llama, LlamaConfig  # noqa: E402
from model.engine.loading import load_model  # noqa: E402
from model.engine.runtime import NativeModel  # noqa: E402
from model.engine.sampling import SHOWN_CANDIDATES, SamplingSettings  # noqa: E402
from model.engine.tokenizer import WordTokenizer, build_word_tokenizer  # noqa: E402

VOCAB = 50_257


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def give_back_freed_memory() -> None:
    """glibc keeps freed small blocks for reuse; malloc_trim returns them so RSS shows what is really held."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


PROMPT_LEN = 200


def shapes_only(model):
    """The model's forward pass replaced by one that costs nothing but gives the same shapes: uniform causal
    attention (layers, heads, T, S), K and V of zeros appended to every layer of the real cache, logits whose
    largest is never <eos>."""
    info = model.info

    def forward(ids, cache, output_attentions):
        start, n = cache.length, len(ids)
        zeros = torch.zeros(1, info.n_kv_heads, n, info.d_head, dtype=torch.float32)
        for layer in range(info.n_layers):
            cache.append(layer, zeros, zeros)
        keys = start + n
        attention = torch.tril(torch.ones(n, keys), diagonal=start) / torch.arange(start + 1, keys + 1)[:, None]
        logits = torch.zeros(info.vocab_size)
        logits[(info.eos_id or 0) + 1] = 1.0
        return logits, attention.expand(info.n_layers, info.n_heads, n, keys)

    model.forward = forward
    return model


def real_model(args) -> None:
    model = load_model(args.model, "cpu")
    info = model.info
    L, H, n = info.n_layers, info.n_heads, PROMPT_LEN
    prompt = model.tokenizer.encode(" ".join(str(i) for i in range(1, 400))).ids[:n]
    budget = int(args.budget_mb * 2**20)
    print(f"conditions: CPU {info.dtype}, {info.name} ({L} layers × {H} heads, vocabulary {info.vocab_size:,}), "
          f"a {n}-token counting prompt, greedy, session budget {args.budget_mb:g} MiB")
    gen = start(model, prompt, SamplingSettings(), args.steps, budget_bytes=budget)
    prefill = gen.steps[0]
    print(f"prefill attention: kept {prefill.attention.nbytes:,} B (its lower triangle, L·H·N(N+1)); the whole square "
          f"would be {2 * L * H * n * n:,} B (2·L·H·N²); held after the prefill {gen.memory_bytes / 1e6:.1f} MB")
    held = [gen.memory_bytes]
    rows = []
    while not gen.finished:
        rows.append(step(model, gen).attention.nbytes)
        held.append(gen.memory_bytes)
    growth = [b - a for a, b in itertools.pairwise(held)]
    print(f"{len(rows)} real decode steps, at {prefill.cache_len + 1}–{gen.cache.length} positions: attention rows "
          f"{min(rows):,}–{max(rows):,} B per step (2·L·H·positions), held memory grew "
          f"{min(growth):,}–{max(growth):,} B per step, median {sorted(growth)[len(growth) // 2]:,} "
          "(with the draws and "
          "the KV cache's buffers, which double when full)")

    gen = start(shapes_only(model), prompt, SamplingSettings(), context_room(model, n), budget_bytes=budget)
    first_thin = first_drop = None
    while not gen.finished:
        step(model, gen)
        oldest = gen.steps[1]  # the first to keep one layer and head, and the first to lose its rows
        if first_thin is None and oldest.attention_view is not None:
            first_thin = len(gen.steps) - 1
        if first_drop is None and oldest.attention is None:
            first_drop = len(gen.steps) - 1
    last = gen.steps[-1]
    print(f"to the budget (stand-in forward pass, the real shapes): old steps keep only the viewed layer and head "
          f"from step {first_thin} on ({2 * (n + first_thin):,} B per such step instead of "
          f"{2 * L * H * (n + first_thin):,}); old steps lose their rows from step {first_drop} on; the run stops at "
          f"step {len(gen.steps) - 1} ({gen.stop_reason}, {last.cache_len} positions) holding "
          f"{gen.memory_bytes / 2**20:.1f} MiB: attention, logits and draws {gen.nbytes / 2**20:.1f} MiB, KV cache "
          f"buffers {gen.cache.nbytes_reserved() / 2**20:.1f} MiB ({gen.cache.nbytes() / 2**20:.1f} MiB held)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="decode steps (default 1000; 40 on a real model)")
    parser.add_argument("--budget-mb", type=float, default=256)
    parser.add_argument("--model", default=None, help="smollm2 or gemma3 (fetched): the real model's bytes per step")
    args = parser.parse_args()
    if args.model is not None:
        args.steps = args.steps or 40
        real_model(args)
        return
    args.steps = args.steps or 1000
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, head_dim=16,
                      max_position_embeddings=args.steps + 256)
    tokenizer = WordTokenizer(build_word_tokenizer(["<pad>", "<bos>"] + [f"w{i}" for i in range(VOCAB - 2)]))
    model = NativeModel("random-50257", Llama(cfg).eval().requires_grad_(False), tokenizer, torch.device("cpu"))
    prompt = [1] + list(range(100, 299))  # 200 positions
    warm = start(model, prompt, SamplingSettings(), 2)
    run_to_end(model, warm)
    del warm
    give_back_freed_memory()
    before = rss_bytes()
    gen = start(model, prompt, SamplingSettings(), args.steps, budget_bytes=int(args.budget_mb * 2**20))
    run_to_end(model, gen)
    give_back_freed_memory()
    during = rss_bytes()
    n, t = len(gen.prompt_ids), len(gen.samples)
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    unbounded = L * H * n * (n + 1) + 2 * L * H * sum(n + k for k in range(1, t)) + 4 * VOCAB * LOGITS_KEPT \
        + 8 * SHOWN_CANDIDATES * t
    print(f"conditions: CPU float32, random Llama {L} layers × {H} heads, vocabulary {VOCAB:,}, prompt {n}, "
          f"{t} greedy steps, stop: {gen.stop_reason}, session budget {args.budget_mb:g} MiB")
    print(f"formula without a budget (float16 attention + {LOGITS_KEPT} logits + draws): {unbounded / 2**20:8.1f} MiB")
    thinned = sum(trace.attention_view is not None for trace in gen.steps)
    print(f"kept by the run (Generation.nbytes), {thinned} old steps keeping one layer and head, "
          f"{gen.attention_dropped} oldest rows dropped: "
          f"{gen.nbytes / 2**20:8.1f} MiB")
    held, reserved = gen.cache.nbytes() / 2**20, gen.cache.nbytes_reserved() / 2**20
    print(f"KV cache: held {held:.1f} MiB, reserved {reserved:.1f} MiB (both counted by the budget)")
    print(f"RSS growth while the run is held: {(during - before) / 2**20:8.1f} MiB")
    del gen
    give_back_freed_memory()
    print(f"RSS growth after the run is dropped: {(rss_bytes() - before) / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
