"""What fewer bits cost in accuracy, measured as the field measures it, each dtype against the float32 model:

- perplexity on a held-out text: exp of the mean negative log-likelihood of every token given the tokens before it
  (the first token is given, not scored), in one window when the text fits the model's context, as transformers'
  perplexity guide scores it; a longer text in windows of the context, each moved on by half of it, each token scored
  once with the most tokens before it that a window holds;
- greedy agreement: float32 writes NEW_TOKENS greedy tokens after each of the text's fixed prompts; each dtype reads
  that same text through its cache, CHUNK positions a pass, and at every position that predicted a new token its
  argmax is checked against float32's;
- mean KL: KL(float32 ‖ dtype) of the next-token distributions at every scored position of the held-out text, in nats.

The held-out texts (assets/quality/, their source and licence in sources.json) were written for this project, so no
model here was trained on them: English for a model that writes English, Vietnamese for one that writes Vietnamese.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from model.engine.generate import context_room
from model.engine.runtime import LoadedModel, NativeModel, synchronize
from model.engine.tokenizer import UnknownWordsError
from model.errors import InputError
from model.texts import ASSETS

QUALITY_DIR = ASSETS / "quality"
MIN_TOKENS = 16      # a held-out text's tokens: fewer say little about a model's perplexity
MAX_TOKENS = 8192    # and at most: every dtype reads the text once more (a minute or so of SmolLM2 on one thread)
CHUNK = 32           # positions per pass: every dtype's log-probabilities of a chunk (CHUNK × vocabulary) at once
NEW_TOKENS = 24      # greedy tokens float32 writes after each prompt
STEP_CONTEXT = 256   # positions cached before the timed decode steps (fewer where the text or context is shorter)
STEP_REPEATS = 20    # timed decode steps per model, after one dropped warm-up step


@dataclass(frozen=True)
class HeldOut:
    """A held-out text and the prompts for greedy agreement, with where the text comes from."""
    language: str
    path: Path
    title: str
    source: str
    licence: str
    prompts: tuple[str, ...]

    @property
    def name(self) -> str:
        """The file from the project's root, as reports name it."""
        return str(self.path.relative_to(QUALITY_DIR.parent.parent))

    @property
    def text(self) -> str:
        return self.path.read_text(encoding="utf-8")


def held_out(language: str | None) -> HeldOut:
    """The project's held-out text in a model's language: Vietnamese for a model that writes it ("vi", "vi+en":
    Gemma 3, small), else English."""
    key = "vi" if "vi" in (language or "").split("+") else "en"
    entry = json.loads((QUALITY_DIR / "sources.json").read_text(encoding="utf-8"))[key]
    return HeldOut(key, QUALITY_DIR / entry["file"], entry["title"], entry["source"], entry["licence"],
                   tuple(entry["prompts"]))


def unknown_tokens(model: LoadedModel, first: int | None = None) -> int:
    """How many of the held-out text's scored tokens (all but the first; of its first `first` tokens when given) the
    model's tokenizer writes as <unk>: a word-level vocabulary that lacks the text's words (small's)."""
    unk = getattr(model.tokenizer, "unk_id", None)
    if unk is None:
        return 0
    return model.tokenizer.encode(held_out(model.info.language).text).ids[1:first].count(unk)


@dataclass(frozen=True)
class DtypeQuality:
    dtype: str
    perplexity: float
    nll: float                 # mean negative log-likelihood, nats a token
    greedy_agree: int          # positions where the argmax equals float32's
    greedy_total: int
    mean_kl: float             # nats, over the scored positions of the held-out text

    @property
    def greedy_agreement(self) -> float:
        return self.greedy_agree / self.greedy_total


@dataclass(frozen=True)
class Quality:
    model: str
    text: str                  # the held-out text's file, from the project's root
    tokens: int                # tokens scored: the text's tokens but the first
    windows: int               # 1 when the text fits the context
    context: int
    prompts: int
    new_tokens: int
    rows: list[DtypeQuality]


SAID_WORDS = 8  # unknown words a refusal names


def encode(model: NativeModel, text: str) -> list[int]:
    """The text's ids as the model's tokenizer writes it (its start token where its tokenizer adds one); a
    vocabulary without <unk> (micro's) refuses words it lacks in one sentence naming the first few."""
    try:
        return model.tokenizer.encode(text).ids
    except UnknownWordsError as unknown:
        words = list(dict.fromkeys(unknown.words))
        said = ", ".join(words[:SAID_WORDS]) + (f" (+{len(words) - SAID_WORDS})" if len(words) > SAID_WORDS else "")
        raise InputError("model_unknown_words", model=model.info.name, words=said) from None


def text_ids(model: NativeModel, text: str, name: str) -> list[int]:
    """encode(text), refused in one sentence outside MIN_TOKENS .. MAX_TOKENS."""
    ids = encode(model, text)
    if not MIN_TOKENS <= len(ids) <= MAX_TOKENS:
        raise InputError("quality_text_length", text=name, tokens=len(ids), least=MIN_TOKENS, most=MAX_TOKENS)
    return ids


def windows(n: int, context: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored) of each window over n tokens: one window when they fit the context, else windows of
    `context` tokens moved on by half of it; token t (from 1) is scored in the first window that holds it, at
    position t − 1 of it."""
    if n <= context:
        return [(0, n, 1)]
    stride, spans, done = context // 2, [], 1
    for start in range(0, n, stride):
        end = min(start + context, n)
        spans.append((start, end, done))
        done = end
        if end == n:
            break
    return spans


@torch.inference_mode()
def log_probs(model: NativeModel, ids: list[int], tick: Callable[[], None] | None = None
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(targets (n,), log-probabilities (n, vocab) in float32 of each target given the tokens before it), CHUNK
    positions at a time, every scored token once, in order; each window is fed through the KV cache CHUNK positions
    a pass (the same sums as one pass of the window, up to float rounding)."""
    for start, end, first in windows(len(ids), model.info.context_length):
        cache = model.new_cache()
        for at in range(start, end, CHUNK):
            stop = min(end, at + CHUNK)
            logits = model.every_logits(ids[at:stop], cache).float()        # (stop − at, vocab)
            # position p predicts token p + 1: keep those whose target is scored in this window
            keep = [p for p in range(at, stop) if first <= p + 1 < end]
            if keep:
                rows = torch.tensor([p - at for p in keep])
                yield torch.tensor([ids[p + 1] for p in keep]), torch.log_softmax(logits[rows], dim=-1)
            if tick is not None:
                tick()


@torch.inference_mode()
def greedy_texts(reference: NativeModel, prompts: tuple[str, ...], new_tokens: int) -> list[tuple[list[int], int]]:
    """Each prompt's ids followed by float32's greedy tokens (fewer where the context ends), and the prompt's length."""
    texts = []
    for prompt in prompts:
        ids = encode(reference, prompt)
        prompt_len, cache = len(ids), reference.new_cache()
        count = min(new_tokens, context_room(reference, prompt_len))
        logits, _ = reference.forward(ids, cache, output_attentions=False)
        for n in range(count):
            ids.append(int(logits.argmax()))
            if n + 1 < count:
                logits, _ = reference.forward(ids[-1:], cache, output_attentions=False)
        texts.append((ids, prompt_len))
    return texts


@torch.inference_mode()
def greedy_choices(model: NativeModel, texts: list[tuple[list[int], int]]) -> torch.Tensor:
    """The model's argmax at every position of the texts that predicted a new token, each text read through its
    cache CHUNK positions a pass (a cache in fewer bits is then read as a decode step reads it: kv_quant)."""
    picks = []
    for ids, prompt_len in texts:
        cache = model.new_cache()
        logits = torch.cat([model.every_logits(ids[at:min(at + CHUNK, len(ids) - 1)], cache)
                            for at in range(0, len(ids) - 1, CHUNK)])      # (len − 1, vocab)
        picks.append(logits[prompt_len - 1:].argmax(dim=-1))
    return torch.cat(picks)


def measure_quality(models: dict[str, NativeModel], name: str, text_name: str, ids: list[int],
                    prompts: tuple[str, ...], tick: Callable[[], None] | None = None) -> Quality:
    """Every dtype of `models` (float32 among them: the reference) on the held-out text's ids and the prompts; the
    text named text_name in the report. tick() runs between the passes (a caller that may stop there)."""
    reference = models["float32"]
    nll = dict.fromkeys(models, 0.0)
    kl = dict.fromkeys(models, 0.0)
    scored = 0
    for chunks in zip(*(log_probs(m, ids, tick) for m in models.values())):
        targets, ref = chunks[0][0], chunks[list(models).index("float32")][1]
        for dtype, (_, logp) in zip(models, chunks):
            nll[dtype] += float(-logp.gather(1, targets[:, None]).sum())
            kl[dtype] += float((ref.exp() * (ref - logp)).sum())
        scored += len(targets)
    texts = greedy_texts(reference, prompts, NEW_TOKENS)
    expected = greedy_choices(reference, texts)
    rows = []
    for dtype, model in models.items():
        agree = len(expected) if model is reference else int((greedy_choices(model, texts) == expected).sum())
        if tick is not None:
            tick()
        rows.append(DtypeQuality(dtype, math.exp(nll[dtype] / scored), nll[dtype] / scored, agree, len(expected),
                                 kl[dtype] / scored))
    return Quality(name, text_name, scored, len(windows(len(ids), reference.info.context_length)),
                   reference.info.context_length, len(prompts), NEW_TOKENS, rows)


@dataclass
class StepTime:
    context: int             # positions cached before the first timed step
    ms: dict[str, list[float]]  # per model: each timed decode step, in ms


@torch.inference_mode()
def decode_step_times(models: dict[str, NativeModel], ids: list[int], repeats: int = STEP_REPEATS) -> StepTime:
    """One decode step's time per model after the same positions of `ids` are cached: the models' steps taken in
    turn (one of each, then the next round), so a load on the machine falls on every model alike, and each step
    feeds the text's next token (the cache grows by one a step)."""
    reference = next(iter(models.values()))
    context = min(STEP_CONTEXT, len(ids) - repeats - 1, reference.info.context_length - repeats - 1)
    caches = {name: model.new_cache() for name, model in models.items()}
    for name, model in models.items():
        for at in range(0, context, CHUNK):
            model.every_logits(ids[at:min(context, at + CHUNK)], caches[name])
    ms = {name: [] for name in models}
    for step in range(repeats + 1):
        for name, model in models.items():
            synchronize(model.device)
            t0 = time.perf_counter()
            model.every_logits([ids[context + step]], caches[name])
            synchronize(model.device)
            if step:  # the first step of each is a warm-up
                ms[name].append((time.perf_counter() - t0) * 1000)
    return StepTime(context, ms)
