"""The logit lens: what each layer already "thinks" the next token is, on the current step.

The residual stream after layer i goes through the model's own final norm and LM head, as if the model ended
there: a distribution over the vocabulary per layer. After the last layer that is the step's real logits. A side
computation (steps.side_step): the run's cache, tokens and trace stay as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model.engine.cache import KVCache
from model.engine.llama import Probe
from model.engine.runtime import NativeModel
from model.engine.sampling import softmax
from model.engine.steps import StepTrace, side_step

LENS_TOP = 5


@dataclass(frozen=True)
class LensLayer:
    layer: int
    top_ids: list[int]       # the LENS_TOP most probable ids at this layer, most probable first
    top_probs: list[float]
    chosen_rank: int         # where the step's chosen token stands at this layer: 1 = the most probable
    chosen_prob: float


@dataclass(frozen=True)
class LogitLens:
    chosen_id: int
    layers: list[LensLayer]
    last_logits: np.ndarray  # (vocab,) float32, the last layer's row: the step's real logits

    @property
    def settled_at(self) -> int | None:
        """The first layer from which the chosen token is the most probable at every later layer (the start of the
        last unbroken run of rank 1); None when it is not even at the last one (a sampled token that was not the
        argmax)."""
        settled = None
        for row in self.layers:
            settled = (row.layer if settled is None else settled) if row.chosen_rank == 1 else None
        return settled

    @property
    def first_at(self) -> int | None:
        """The first layer at which the chosen token is the most probable, whether or not it stays first there
        after; None when no layer has it first."""
        return next((row.layer for row in self.layers if row.chosen_rank == 1), None)


def top_ids(logits: np.ndarray, n: int) -> np.ndarray:
    """The n largest logits' ids, largest first."""
    best = np.argpartition(-logits, n)[:n]
    return best[np.argsort(-logits[best], kind="stable")]


def lens_layer(layer: int, logits: np.ndarray, chosen_id: int) -> LensLayer:
    probs = softmax(logits.astype(np.float64))
    top = top_ids(logits, LENS_TOP)
    return LensLayer(layer, [int(i) for i in top], [float(probs[i]) for i in top],
                     int(np.sum(logits > logits[chosen_id])) + 1, float(probs[chosen_id]))


@torch.inference_mode()
def logit_lens(model: NativeModel, cache: KVCache, trace: StepTrace, chosen_id: int) -> LogitLens:
    """Every layer's view of the step `trace`, whose drawn token is chosen_id."""
    out = side_step(model, cache, trace, Probe(hidden_states=True))
    # the layers before the last in one pass through the norm and the head; the last layer's row is the forward's
    # own, the same norm and head on the same stream in the step's shape (stacked, the matmul rounds otherwise:
    # up to 2.6e-5 on SmolLM2's logits)
    stream = torch.cat([h[0, -1:] for h in out.hidden_states[:-1]])          # (layers − 1, hidden)
    logits = torch.cat((model.module.lm_head(model.module.model.norm(stream)), out.logits[0, -1:]))
    logits = logits.float().cpu().numpy()                                   # (layers, vocab)
    return LogitLens(chosen_id, [lens_layer(i, row, chosen_id) for i, row in enumerate(logits)], logits[-1])
