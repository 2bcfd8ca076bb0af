"""Who proposes the γ tokens: a small model with the target's tokenizer, prompt lookup, or early exit."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from model.engine.gemma3 import Gemma3
from model.engine.llama import Llama, Probe
from model.engine.loading import load_shared_native
from model.engine.runtime import LoadedModel, NativeModel, warmed_up
from model.engine.sampling import SamplingSettings, draw_from
from model.engine.tokenizer import load_tokenizer
from model.errors import InputError
from model.speculative.rules import shown_probs
from model.weights.catalog import DRAFT_MODELS, ROOT

LOOKUP = "lookup"
EARLY_EXIT = "early-exit:"
# transformers' prompt lookup tries the last 2 tokens, then the last one (max_matching_ngram_size=2)
LOOKUP_MAX_NGRAM = 2


# -- the drafts ----------------------------------------------------------------------------------------------

@dataclass
class Proposal:
    ids: list[int]
    q: np.ndarray | None   # (len(ids), vocab) the draft's distributions; None: a deterministic draft (q = 1)
    passes: int            # draft forward passes it took


class ModelDraft:
    """A native model run for n_layers blocks on its own cache: a small model, or the target's first layers."""

    def __init__(self, name: str, module: Llama | Gemma3, device: torch.device, n_layers: int):
        self.name, self.module, self.device, self.n_layers = name, module, device, n_layers
        self.cache = module.new_cache(n_layers)

    @torch.inference_mode()
    def _last_logits(self, ids: list[int]) -> np.ndarray:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        out = self.module(x, self.cache, probe=Probe(n_layers=self.n_layers), last_logits_only=True)
        return out.logits[0, -1].float().cpu().numpy()                # (vocab,)

    def propose(self, ids: list[int], gamma: int, settings: SamplingSettings, next_draw, eos_id) -> Proposal:
        """Feed what the cache lacks of `ids`, then draw up to γ tokens, feeding each one back but the last;
        an end-of-sequence token ends the proposal (nothing can follow it)."""
        feed, proposed, dists = ids[self.cache.length:], [], []
        while len(proposed) < gamma and (not proposed or proposed[-1] != eos_id):
            logits = self._last_logits(feed)
            q = shown_probs(logits, settings)
            token = int(np.argmax(logits)) if settings.greedy else draw_from(q, next_draw())
            proposed.append(token)
            dists.append(q)
            feed = [token]
        return Proposal(proposed, np.stack(dists) if dists else None, len(proposed))

    def keep(self, n: int) -> None:
        n = min(n, self.cache.length)
        # past a sliding window's margin the cache starts again empty: the next proposal feeds what it lacks
        self.cache.crop(n if self.cache.can_crop(n) else 0)


class LookupDraft:
    """Prompt lookup: find the last n tokens earlier in the context and propose what followed them.
    As transformers' PromptLookupCandidateGenerator: n from LOOKUP_MAX_NGRAM down to 1, the first match from
    the left that has a continuation. Deterministic, so q(x) = 1 for each proposed x."""

    name, cache = LOOKUP, None

    def propose(self, ids: list[int], gamma: int, settings: SamplingSettings, next_draw, eos_id) -> Proposal:
        copied = lookup_continuation(ids, gamma)
        if eos_id in copied:  # nothing can follow an end-of-sequence token
            copied = copied[: copied.index(eos_id) + 1]
        return Proposal(copied, None, 0)

    def keep(self, n: int) -> None:
        pass


def lookup_continuation(ids: list[int], gamma: int, max_ngram: int = LOOKUP_MAX_NGRAM) -> list[int]:
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        tail = ids[-n:]
        for start in range(len(ids) - n):
            if ids[start:start + n] == tail:
                return ids[start + n:start + n + gamma]
    return []


@cache
def load_draft_model(name: str, device: str) -> NativeModel:
    """A bundled draft model, loaded once per process and device."""
    folder = ROOT / DRAFT_MODELS[name]
    dev = torch.device(device)
    return warmed_up(NativeModel(name, load_shared_native(folder, dev), load_tokenizer(folder), dev))


def same_tokenizer(a: LoadedModel, b: LoadedModel) -> bool:
    n = a.info.vocab_size
    return (n == b.info.vocab_size and a.tokenizer is not None and b.tokenizer is not None
            and all(a.tokenizer.token(i) == b.tokenizer.token(i) for i in range(n)))


def _vocab_size(config: Path) -> int | None:
    return json.loads(config.read_text())["vocab_size"] if config.is_file() else None


def make_draft(target: LoadedModel, spec: str):
    """"small-draft" (a bundled draft model), "lookup", or "early-exit:K" (the target's first K layers)."""
    if spec == LOOKUP:
        return LookupDraft()
    if spec.startswith(EARLY_EXIT):
        if not isinstance(target, NativeModel):
            raise InputError("speculative_early_exit_native")
        layers = spec.removeprefix(EARLY_EXIT)
        last = target.info.n_layers - 1
        if not layers.isdigit() or not 1 <= int(layers) <= last:
            raise InputError("speculative_early_exit_layers", k=layers, last=last)
        return ModelDraft(spec, target.module, target.device, int(layers))
    if spec not in DRAFT_MODELS:
        raise InputError("speculative_unknown_draft", draft=spec, drafts=", ".join(draft_choices(target)))
    model = load_draft_model(spec, str(target.device))
    if not same_tokenizer(target, model):
        raise InputError("speculative_tokenizer", draft=spec, target=target.info.name)
    return ModelDraft(spec, model.module, model.device, model.info.n_layers)


def draft_choices(target: LoadedModel) -> list[str]:
    """The drafts that can serve this target: a draft model where it is built (`python -m model build small-draft`)
    and has the target's vocabulary size, prompt lookup always, early exit on the native model only."""
    drafts = [name for name, folder in DRAFT_MODELS.items()
              if _vocab_size(ROOT / folder / "config.json") == target.info.vocab_size]
    drafts.append(LOOKUP)
    if isinstance(target, NativeModel) and target.info.n_layers > 1:
        drafts.append(EARLY_EXIT + str(suggested_exit_layers(target)))
    return drafts


def suggested_exit_layers(target: LoadedModel) -> int:
    """Two thirds of the layers: a model not trained for early exit predicts poorly from fewer
    (measured on SmolLM2-135M, greedy, one chat prompt: α = 0 at 8 of 30 layers, 0.38 at 20)."""
    return max(1, 2 * target.info.n_layers // 3)
