"""The arithmetic of one proposal (pure numpy): the acceptance rule, the residual, the exact output
distribution, and the expected tokens per pass and speed-up (Leviathan et al. 2023)."""

from __future__ import annotations

import numpy as np

from model.engine.sampling import SamplingSettings, sample

# -- the arithmetic of one proposal: pure numpy -------------------------------------------------------------

def acceptance_probability(p: float, q: float) -> float:
    """min(1, p/q): a token the draft over-proposes (q > p) is kept only part of the time."""
    return 1.0 if q <= p else p / q


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """max(0, p − q) normalised: where the target wants more than the draft gave. All zero only when p == q,
    and then no proposal is ever rejected."""
    extra = np.maximum(p - q, 0.0)
    return extra / extra.sum()


def output_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Exact distribution of the token that one accept-or-resample step emits: draw x ~ q, keep it with
    probability min(1, p(x)/q(x)), otherwise draw from the residual. Equals p (Leviathan et al., appendix A.1)."""
    kept = np.array([q[x] * acceptance_probability(p[x], q[x]) for x in range(p.size)])
    rejected = 1.0 - kept.sum()  # = 1 − Σ min(p, q)
    return kept + rejected * residual(p, q) if rejected > 0 else kept


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    """(1 − α^(γ+1)) / (1 − α): tokens per target pass when each proposal is kept with probability α
    independently (Leviathan et al., equation 1); γ + 1 when every proposal is kept."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Expected wall-time gain over plain decoding when a draft pass costs `cost_ratio` target passes:
    (1 − α^(γ+1)) / ((1 − α)(γc + 1)) (Leviathan et al., theorem 3.8)."""
    return expected_tokens_per_pass(alpha, gamma) / (gamma * cost_ratio + 1)


def shown_probs(logits: np.ndarray, settings: SamplingSettings) -> np.ndarray:
    """(vocab,) the distribution the round works with: after the sampling filters, or for greedy the plain
    softmax (its argmax decides; the numbers are shown)."""
    drawn = sample(logits, settings)
    return drawn.probs if drawn.greedy else drawn.final_probs
