"""Re-create the bundled models from scratch with a fixed seed: `python -m model build micro|small|small-draft`.

micro is the course's worked example (8-word vocabulary, "<bos> ăn" -> "cá", <eos>);
small is trained on the bilingual corpus that model/training/corpus.py generates;
small-draft is a one-layer model on the same corpus with the same tokenizer: small's draft for speculative decoding.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from model.engine.llama import Llama, LlamaConfig
from model.engine.tokenizer import SPECIAL_TOKENS, WordTokenizer, build_word_tokenizer
from model.training.corpus import MICRO_SENTENCES, MICRO_VOCAB
from model.training.train import init_weights
from model.weights.catalog import BUNDLED, DRAFT_MODELS, ROOT


def micro_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=4, max_position_embeddings=16,
                       bos_token_id=1, eos_token_id=6, pad_token_id=0)


def small_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)


def small_draft_config(vocab_size: int) -> LlamaConfig:
    """small's width and heads in one layer instead of four."""
    return dataclasses.replace(small_config(vocab_size), num_hidden_layers=1)


def encode_sentences(tokenizer, sentences: list[str], pad_id: int, eos_id: int) -> torch.Tensor:
    """(n, longest + 2) rows of <bos> words <eos>, right-padded."""
    rows = [tokenizer.encode(s).ids + [eos_id] for s in sentences]
    longest = max(map(len, rows))
    return torch.tensor([r + [pad_id] * (longest - len(r)) for r in rows])


def train(model: Llama, data: torch.Tensor, steps: int, batch_size: int, lr: float, pad_id: int, log_every: int):
    """Next-token cross-entropy over non-pad labels, AdamW with a cosine schedule."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    for i in range(steps):
        batch = data[torch.randint(len(data), (batch_size,))]
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = model(inputs).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        if log_every and (i % log_every == 0 or i == steps - 1):
            print(f"step {i:5d}  loss {loss.item():.3f}")
    model.eval()


def build_micro(folder: Path) -> None:
    cfg = micro_config()
    tokenizer = build_word_tokenizer(MICRO_VOCAB)
    model = Llama(cfg)
    data = encode_sentences(WordTokenizer(tokenizer), MICRO_SENTENCES, cfg.pad_token_id, cfg.eos_token_id)
    train(model, data, steps=400, batch_size=4, lr=0.05, pad_id=cfg.pad_token_id, log_every=100)
    _save(model, tokenizer, folder)


def build_on_corpus(folder: Path, config: Callable[[int], LlamaConfig], steps: int) -> None:
    """A model trained on the bilingual corpus with its word-level tokenizer (the same for every seed-0 build)."""
    from model.training.corpus import generate_corpus, vocabulary

    sentences = generate_corpus(seed=0)
    vocab = list(SPECIAL_TOKENS) + vocabulary(sentences)
    tokenizer = build_word_tokenizer(vocab)
    cfg = config(len(vocab))
    model = init_weights(Llama(cfg))
    data = encode_sentences(WordTokenizer(tokenizer), sentences, cfg.pad_token_id, cfg.eos_token_id)
    print(f"{len(sentences)} sentences, vocabulary {len(vocab)}, {sum(p.numel() for p in model.parameters()):,} "
          "parameters")
    train(model, data, steps=steps, batch_size=48, lr=5e-3, pad_id=cfg.pad_token_id, log_every=100)
    _save(model, tokenizer, folder)


def build_small(folder: Path) -> None:
    build_on_corpus(folder, small_config, steps=1200)


def build_small_draft(folder: Path) -> None:
    build_on_corpus(folder, small_draft_config, steps=1200)


def _save(model: Llama, tokenizer, folder: Path) -> None:
    model.save(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    print(f"saved {folder}")


def build(name: str) -> None:
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    # the matrices are tiny: OpenMP threads spend their time waiting on each other, not computing
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    folder = ROOT / {**BUNDLED, **DRAFT_MODELS}[name]
    {"micro": build_micro, "small": build_small, "small-draft": build_small_draft}[name](folder)
    print(f"built {name} in {time.perf_counter() - t0:.0f} s")
