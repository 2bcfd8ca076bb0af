"""Logits -> probabilities -> filters -> one token. Pure numpy functions, no model involved.

The filters run in the order transformers applies them: temperature, then top-k, then top-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from model.errors import InputError

MAX_SEED = 2**31 - 1  # the largest seed a draw takes (the seed boxes of Decode, Train and Fine-tune stop here too)


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0   # 0 = greedy (argmax)
    top_k: int | None = None   # None = off
    top_p: float = 1.0         # 1.0 = off
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_settings(settings: SamplingSettings) -> None:
    """Raise ValueError with the setting's name when a value cannot be used (NaN and an infinite temperature are
    outside every range)."""
    if not 0 <= settings.temperature < math.inf:
        raise ValueError("temperature")
    if settings.top_k is not None and settings.top_k < 1:
        raise ValueError("top_k")
    if not 0 < settings.top_p <= 1:
        raise ValueError("top_p")
    if not 0 <= settings.seed <= MAX_SEED:
        raise ValueError("seed")


def check_settings_or_refuse(settings: SamplingSettings) -> None:
    """check_settings, refused with the user's sentence (errors.InputError "bad_temperature", …)."""
    try:
        check_settings(settings)
    except ValueError as bad:
        name = str(bad)
        details = {"value": getattr(settings, name)} | ({"most": MAX_SEED} if name == "seed" else {})
        raise InputError("bad_" + name, **details) from None


@dataclass
class SampleResult:
    probs: np.ndarray        # (vocab,) softmax(logits / temperature), before any filter
    kept_by_top_k: np.ndarray  # ids that survive top-k (all ids when off), ascending
    kept_by_top_p: np.ndarray  # ids that survive top-k then top-p, ascending
    final_probs: np.ndarray  # (vocab,) renormalised over kept_by_top_p, 0 elsewhere
    chosen_id: int
    greedy: bool


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max())
    return z / z.sum()


def top_k_ids(scores: np.ndarray, k: int | None) -> np.ndarray:
    """Ids whose score is at least the k-th largest (ties at the boundary stay, as in transformers)."""
    if k is None or k >= scores.size:
        return np.arange(scores.size)
    kth = np.sort(scores)[-k]
    return np.flatnonzero(scores >= kth)


def top_p_ids(probs: np.ndarray, candidates: np.ndarray, p: float) -> np.ndarray:
    """Smallest set of the most probable candidates whose probability adds up to at least p."""
    if p >= 1.0:
        return candidates
    renormalised = probs[candidates] / probs[candidates].sum()
    order = np.argsort(-renormalised, kind="stable")
    mass_before = np.cumsum(renormalised[order]) - renormalised[order]
    return np.sort(candidates[order[mass_before < p]])


def uniform(seed: int, draw: int) -> float:
    """The draw-th uniform number in [0, 1): one stream per (seed, draw), so a seed replays the same run."""
    return float(np.random.default_rng([seed, draw]).random())


def draw_from(probs: np.ndarray, u: float) -> int:
    """The first id whose cumulative probability passes u, for u uniform in [0, 1): an id drawn with probability
    probs[id]. Rounding can leave u past the end: then the last id with a probability above zero."""
    return int(min(np.searchsorted(np.cumsum(probs), u, side="right"), np.flatnonzero(probs)[-1]))


def sample(logits: np.ndarray, settings: SamplingSettings, step: int = 0) -> SampleResult:
    """Choose the next id from one position's logits (vocab,). Same settings and step -> same draw."""
    check_settings(settings)
    logits = logits.astype(np.float64)
    if settings.greedy:
        probs = softmax(logits)
        chosen = int(np.argmax(logits))
        kept = np.array([chosen])
        final = np.zeros_like(probs)
        final[chosen] = 1.0
        return SampleResult(probs, kept, kept, final, chosen, greedy=True)
    scaled = logits / settings.temperature
    probs = softmax(scaled)
    kept_k = top_k_ids(scaled, settings.top_k)
    kept_p = top_p_ids(probs, kept_k, settings.top_p)
    final = np.zeros_like(probs)
    final[kept_p] = probs[kept_p] / probs[kept_p].sum()
    # one uniform number per (seed, step): the draw does not depend on what was sampled before
    chosen = draw_from(final, uniform(settings.seed, step))
    return SampleResult(probs, kept_k, kept_p, final, chosen, greedy=False)


# -----------------------------------------------------------------------------
# what a session keeps of each draw: a few numbers, not four vocabulary-sized arrays

SHOWN_CANDIDATES = 20  # the most probable ids kept per step for the views (the page draws 12, the CLI 5)


@dataclass(frozen=True)
class Draw:
    chosen_id: int
    greedy: bool
    chosen_prob: float        # softmax(logits / temperature) at the chosen id, before the filters (greedy: T = 1)
    chosen_final_prob: float  # the probability it was drawn with: renormalised after top-k and top-p
    n_kept_top_k: int
    n_kept_top_p: int
    top_ids: np.ndarray       # (SHOWN_CANDIDATES,) int32, most probable first (ties by id)
    top_probs: np.ndarray     # (SHOWN_CANDIDATES,) float32, before the filters
    top_status: tuple[str, ...]  # per top id: chosen, kept, cut_p, cut_k, or other (greedy: no filter ran)
    settings: SamplingSettings  # what it was drawn with: a run's settings can change between its steps

    @property
    def nbytes(self) -> int:
        return self.top_ids.nbytes + self.top_probs.nbytes


def status_of(result: SampleResult, token_id: int) -> str:
    """chosen, kept (survived both filters), cut_p (survived top-k, not top-p), cut_k; other when greedy."""
    if token_id == result.chosen_id:
        return "chosen"
    if result.greedy:
        return "other"
    if np.isin(token_id, result.kept_by_top_p):
        return "kept"
    return "cut_p" if np.isin(token_id, result.kept_by_top_k) else "cut_k"


def most_probable(probs: np.ndarray, k: int) -> np.ndarray:
    """The k most probable ids, most probable first, ties by id: np.argsort(-probs, kind="stable")[:k] without
    sorting the whole vocabulary (Gemma 3's 262,144 ids took milliseconds of every step)."""
    if k >= probs.size:
        return np.argsort(-probs, kind="stable")
    kth = np.partition(probs, probs.size - k)[probs.size - k]  # the k-th largest probability
    candidates = np.flatnonzero(probs >= kth)                 # ascending ids: every tie at the boundary too
    return candidates[np.argsort(-probs[candidates], kind="stable")][:k]


def summarize(result: SampleResult, settings: SamplingSettings, shown: int = SHOWN_CANDIDATES) -> Draw:
    top = most_probable(result.probs, shown)
    return Draw(
        chosen_id=result.chosen_id, greedy=result.greedy, chosen_prob=float(result.probs[result.chosen_id]),
        chosen_final_prob=float(result.final_probs[result.chosen_id]),
        n_kept_top_k=int(result.kept_by_top_k.size), n_kept_top_p=int(result.kept_by_top_p.size),
        top_ids=top.astype(np.int32), top_probs=result.probs[top].astype(np.float32),
        top_status=tuple(status_of(result, int(i)) for i in top), settings=settings,
    )


def draw(logits: np.ndarray, settings: SamplingSettings, step: int = 0) -> Draw:
    """sample() reduced to what the views show."""
    return summarize(sample(logits, settings, step), settings)
