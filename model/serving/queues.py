"""The three built-in queues that serve-bench --queue and the Paged KV page run, each made for one comparison:

- mixed: MIXED_REQUESTS requests there from the start, prompt lengths and token budgets spread as a class's are (many
  short, a few long: drawn log-uniformly, seeded), for padded against paged under one budget; each runs to its
  budget (an eos does not end it: vLLM's benchmarks' ignore_eos), so that the lengths are the drawn ones;
- shared-prefix: SHARED_REQUESTS questions arriving one a step, all after the same system prompt (SmolLM2's chat
  template puts its own before every question; a model without a template gets SHARED_FILLER filler ids before its
  own few), for the prefix cache;
- long-join: LONG_JOIN_SHORT short requests decoding from the start, and one long prompt arriving at step
  LONG_JOIN_STEP, for chunked prefill; each to its budget, as in mixed.
"""

from __future__ import annotations

import numpy as np

from model.engine.runtime import NativeModel
from model.engine.tokenizer import encode_chat
from model.serving.engine import MIN_CHUNK
from model.serving.request import Request
from model.serving.timing import filler_ids

QUEUES = ("mixed", "shared-prefix", "long-join")

MIXED_REQUESTS = 16
SHARED_REQUESTS = 12
SHARED_NEW_TOKENS = 12
SHARED_FILLER = 48
LONG_JOIN_SHORT = 6
LONG_JOIN_STEP = 4
LONG_JOIN_NEW_TOKENS = 8
QUESTIONS = ("What is the capital of France?", "Name three colours of the rainbow.",
             "How many legs does a spider have?", "Why is the sky blue?", "Write a haiku about the sea.",
             "What is 12 times 7?", "Who wrote Romeo and Juliet?", "Give me a word that means happy.",
             "What do bees make?", "How do you say good morning in French?",
             "At what temperature does water boil?", "Suggest a name for a cat.")


def mixed_lengths(context_length: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The mixed queue's prompt and token-budget ranges on a model of `context_length` positions: prompts from 16 up
    to half the context (512 at most), budgets from 16 up to a quarter (256 at most)."""
    return (16, max(16, min(512, context_length // 2))), (16, max(16, min(256, context_length // 4)))


def log_uniform(rng: np.random.Generator, low: int, high: int, n: int) -> list[int]:
    return np.exp(rng.uniform(np.log(low), np.log(high + 1), size=n)).astype(int).clip(low, high).tolist()


def mixed_queue(model: NativeModel, seed: int = 0) -> list[Request]:
    (p_low, p_high), (n_low, n_high) = mixed_lengths(model.info.context_length)
    rng = np.random.default_rng(seed)
    prompts, budgets = log_uniform(rng, p_low, p_high, MIXED_REQUESTS), log_uniform(rng, n_low, n_high, MIXED_REQUESTS)
    return [Request(i, filler_ids(model, n, seed=seed + i), budget, ignore_eos=True)
            for i, (n, budget) in enumerate(zip(prompts, budgets))]


def shared_prefix_queue(model: NativeModel, seed: int = 0) -> list[Request]:
    """SmolLM2 (a chat template): each question in the template after its own system prompt; otherwise
    SHARED_FILLER filler ids shared, then 4 to 19 of the request's own."""
    if getattr(model.tokenizer, "chat_template", None) is not None:
        prompts = [encode_chat(model, question).ids for question in QUESTIONS[:SHARED_REQUESTS]]
    else:
        shared = filler_ids(model, SHARED_FILLER, seed=seed + 1000)
        prompts = [shared + filler_ids(model, 4 + 5 * i % 16, seed=seed + i) for i in range(SHARED_REQUESTS)]
    return [Request(i, ids, SHARED_NEW_TOKENS, arrival_step=i) for i, ids in enumerate(prompts)]


def long_prompt_length(context_length: int) -> int:
    """The long-join queue's long prompt: 560 positions (past Gemma 3's 512-position window, whose sliding groups
    then give back their first blocks), or 3/4 of a shorter context."""
    return min(560, context_length * 3 // 4)


def long_join_queue(model: NativeModel, seed: int = 0) -> list[Request]:
    context = model.info.context_length
    long = long_prompt_length(context)
    short_new = min(48, context - 16 - 1)
    requests = [Request(i, filler_ids(model, 8 + i, seed=seed + i), short_new, ignore_eos=True)
                for i in range(LONG_JOIN_SHORT)]
    requests.append(Request(LONG_JOIN_SHORT, filler_ids(model, long, seed=seed + LONG_JOIN_SHORT),
                            min(LONG_JOIN_NEW_TOKENS, context - long), arrival_step=LONG_JOIN_STEP, ignore_eos=True))
    return requests


def compared_chunks(context_length: int) -> tuple[int, int]:
    """The two chunk sizes the long-join queue is compared at: an eighth and a half of its long prompt (MIN_CHUNK
    at least)."""
    long = long_prompt_length(context_length)
    return tuple(max(MIN_CHUNK, long // part) for part in (8, 2))


def queue_size(name: str) -> int:
    """Requests in the built-in queue `name`, on any model."""
    return {"mixed": MIXED_REQUESTS, "shared-prefix": SHARED_REQUESTS, "long-join": LONG_JOIN_SHORT + 1}[name]


def built_in_queue(model: NativeModel, name: str, seed: int = 0) -> list[Request]:
    return {"mixed": mixed_queue, "shared-prefix": shared_prefix_queue, "long-join": long_join_queue}[name](model,
                                                                                                         seed)
