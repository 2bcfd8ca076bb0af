"""What one session's run costs in server memory, measured against the README's formula.

A random Llama with GPT-2's vocabulary (50,257 ids: the vocabulary size is what made the per-step sampling
arrays expensive) runs a 1000-step greedy decode; the process's resident memory is read before and after, and
again after the run is dropped. Prints the formula's bytes, the bytes the run counts (Generation.nbytes, KV
cache reserved) and the RSS growth.

    .venv/bin/python benchmarks/session_memory.py [--steps 1000] [--budget-mb 128]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model.engine.generate import LOGITS_KEPT, run_to_end, start  # noqa: E402
from model.engine.llama import Llama, LlamaConfig  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--budget-mb", type=float, default=256)
    args = parser.parse_args()
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
    unbounded = 2 * L * H * (n * n + sum(n + k for k in range(1, t))) + 4 * VOCAB * LOGITS_KEPT \
        + 8 * SHOWN_CANDIDATES * t
    print(f"conditions: CPU float32, random Llama {L} layers × {H} heads, vocabulary {VOCAB:,}, prompt {n}, "
          f"{t} greedy steps, stop: {gen.stop_reason}, session budget {args.budget_mb:g} MiB")
    print(f"formula without a budget (float16 attention + {LOGITS_KEPT} logits + draws): {unbounded / 2**20:8.1f} MiB")
    print(f"kept by the run (Generation.nbytes), {gen.attention_dropped} oldest rows dropped: "
          f"{gen.nbytes / 2**20:8.1f} MiB")
    held, reserved = gen.cache.nbytes() / 2**20, gen.cache.nbytes_reserved() / 2**20
    print(f"KV cache: held {held:.1f} MiB, reserved {reserved:.1f} MiB (both counted by the budget)")
    print(f"RSS growth while the run is held: {(during - before) / 2**20:8.1f} MiB")
    del gen
    give_back_freed_memory()
    print(f"RSS growth after the run is dropped: {(rss_bytes() - before) / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
