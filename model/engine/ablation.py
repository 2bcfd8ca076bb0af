"""Switching heads off: the current step recomputed with some heads' attention output set to zero, beside the real
step (steps.side_step: the run's cache, tokens and trace stay as they were), and what that changes in the
next-token distribution."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from model.engine.cache import KVCache
from model.engine.lens import LENS_TOP, top_ids
from model.engine.llama import Probe
from model.engine.runtime import ModelInfo, NativeModel
from model.engine.sampling import SamplingSettings, draw, softmax
from model.engine.steps import StepTrace, side_step
from model.errors import InputError

HEAD = re.compile(r"\s*([0-9]+)\.([0-9]+)\s*")  # "L.H": layer L's query head H


def parse_heads(text: str, info: ModelInfo) -> list[tuple[int, int]]:
    """"0.1, 2.3" -> [(0, 1), (2, 3)]: (layer, head) pairs, each inside the model, in the order typed."""
    pairs = []
    for part in text.split(","):
        match = HEAD.fullmatch(part)
        if match is None or not (int(match[1]) < info.n_layers and int(match[2]) < info.n_heads):
            raise InputError("bad_heads", heads=text, example="0.1,2.3", layers=info.n_layers - 1,
                             heads_last=info.n_heads - 1)
        pairs.append((int(match[1]), int(match[2])))
    return pairs


def by_layer(heads: list[tuple[int, int]]) -> dict[int, tuple[int, ...]]:
    """(layer, head) pairs as the forward takes them: layer -> its heads switched off."""
    layers: dict[int, tuple[int, ...]] = {}
    for layer, head in sorted(set(heads)):
        layers[layer] = layers.get(layer, ()) + (head,)
    return layers


@dataclass(frozen=True)
class Ablation:
    heads: list[tuple[int, int]]  # (layer, head) switched off
    logits: np.ndarray            # (vocab,) the step's logits with them off, float32
    top_before: list[tuple[int, float]]  # (id, probability) of the LENS_TOP most probable, the real step
    top_after: list[tuple[int, float]]   # the same with the heads off
    kl: float                     # KL(real ‖ heads off) of the next-token distributions, in nats
    chosen_before: int            # the run's token at this step
    chosen_after: int             # the token the same sampling settings and seed draw with the heads off

    @property
    def changed(self) -> bool:
        return self.chosen_after != self.chosen_before


def top_with_probs(logits: np.ndarray, probs: np.ndarray) -> list[tuple[int, float]]:
    return [(int(i), float(probs[i])) for i in top_ids(logits, LENS_TOP)]


def kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p ‖ q) = Σ p·ln(p / q) over the ids where p > 0, in nats: 0 when the distributions are the same."""
    seen = p > 0
    return float(np.sum(p[seen] * (np.log(p[seen]) - np.log(q[seen]))))


def ablate(model: NativeModel, cache: KVCache, trace: StepTrace, heads: list[tuple[int, int]],
                     settings: SamplingSettings, step_index: int, chosen_id: int) -> Ablation:
    """The step `trace` (the run's step `step_index`, which drew chosen_id) again with `heads` switched off."""
    logits = side_step(model, cache, trace, Probe(heads_off=by_layer(heads))).logits[0, -1].float().cpu().numpy()
    before, after = softmax(trace.logits.astype(np.float64)), softmax(logits.astype(np.float64))
    return Ablation(list(heads), logits, top_with_probs(trace.logits, before), top_with_probs(logits, after),
                    kl_divergence(before, after), chosen_id, draw(logits, settings, step_index).chosen_id)
