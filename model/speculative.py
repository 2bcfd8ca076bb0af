"""Speculative decoding: a cheap draft proposes γ tokens, the target checks them all in one forward pass.

Each round (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", algorithm 1;
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling", algorithm 2):

1. the draft proposes x1..xγ one at a time, each drawn from its distribution q;
2. the target runs ONE forward pass over the last accepted token and x1..xγ on top of its KV cache, which gives
   its distribution p at every one of those γ + 1 positions;
3. left to right, x_i is kept while a uniform draw r < min(1, p(x_i) / q(x_i));
4. at the first rejection the target draws from max(0, p − q), normalised, and the later proposals are dropped;
   if all γ were kept, the target's extra position gives one more token (the bonus) for free;
5. both caches are cropped to the tokens kept, so the next round continues from exactly where plain decoding
   of the same tokens would be.

Accept-or-resample yields exactly p (`output_distribution` computes it), so the text follows the target's own
distribution whatever the draft. Greedy (temperature 0): keep x_i while it is the target's argmax; the first
mismatch is replaced by the target's argmax, so the output is plain greedy decoding's, token for token.
The sampling filters (temperature → top-k → top-p, model/sampling.py) shape p and q alike.

Drafts: a small model with the target's tokenizer (`small-draft` for `small`), prompt lookup (copy what followed
an earlier occurrence of the last tokens; no model), and early exit (the target's own first K layers, then its
final norm and LM head).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
import torch

from model.cache import KVCache
from model.catalog import ROOT
from model.errors import InputError
from model.generate import check_request, context_room, encode_prompt, parse_prompt_ids
from model.llama import Llama
from model.runtime import LoadedModel, NativeModel, synchronize, warmed_up
from model.sampling import SamplingSettings, draw_from, sample, uniform
from model.tokenizer import encode_chat, load_tokenizer

DRAFT_MODELS = {"small-draft": "assets/models/small-draft"}
LOOKUP = "lookup"
EARLY_EXIT = "early-exit:"
# transformers' prompt lookup tries the last 2 tokens, then the last one (max_matching_ngram_size=2)
LOOKUP_MAX_NGRAM = 2
RESIDUAL_TOP = 6  # tokens of max(0, p − q) kept for the page at a rejection


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


# -- the drafts ----------------------------------------------------------------------------------------------

@dataclass
class Proposal:
    ids: list[int]
    q: np.ndarray | None   # (len(ids), vocab) the draft's distributions; None: a deterministic draft (q = 1)
    passes: int            # draft forward passes it took


class ModelDraft:
    """A Llama run for n_layers blocks on its own cache: a small model, or the target's first layers."""

    def __init__(self, name: str, module: Llama, device: torch.device, n_layers: int):
        self.name, self.module, self.device, self.n_layers = name, module, device, n_layers
        self.cache = KVCache(n_layers)

    @torch.inference_mode()
    def _last_logits(self, ids: list[int]) -> np.ndarray:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        out = self.module(x, self.cache, last_logits_only=True, n_layers=self.n_layers)
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
        self.cache.crop(min(n, self.cache.length))


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
    return warmed_up(NativeModel(name, Llama.load(folder, dev), load_tokenizer(folder), dev))


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


# -- one round --------------------------------------------------------------------------------------------------

@dataclass
class Check:
    """One proposed token as the target judged it."""
    id: int
    q: float                # the draft's probability of it (1 for prompt lookup)
    p: float                # the target's
    r: float | None         # the uniform draw compared with p/q; None in greedy rounds and after a rejection
    accepted: bool | None   # None: never looked at, an earlier proposal was rejected

    @property
    def threshold(self) -> float:
        """min(1, p/q): the proposal is kept when r falls below it."""
        return acceptance_probability(self.p, self.q)


@dataclass
class Round:
    index: int
    gamma: int                     # proposals asked for (γ, or fewer near the end)
    checks: list[Check]
    next_id: int | None            # the target's own token after the kept proposals; None after an accepted eos
    next_kind: str  # "bonus" (all kept) | "resampled" | "corrected" (greedy) | "target" (no proposal) | "eos"
    new_ids: list[int]             # what this round added: the kept proposals, then next_id
    residual_top: list[tuple[int, float, float, float]]  # at a sampled rejection: (id, p, q, max(0,p−q) normalised)
    target_len_before: int         # target cache positions before the pass
    target_len_checked: int        # after the pass over the pending tokens and every proposal
    target_len_after: int          # after the crop
    draft_len_before: int | None   # None: the draft keeps no cache (prompt lookup)
    draft_len_proposed: int | None
    draft_len_after: int | None
    draft_passes: int
    draft_ms: float
    target_ms: float
    total_ms: float                # the whole round, draws and crops included

    @property
    def accepted(self) -> int:
        return sum(1 for c in self.checks if c.accepted)

    @property
    def judged(self) -> int:
        return sum(1 for c in self.checks if c.accepted is not None)


@dataclass
class SpeculativeRun:
    target: LoadedModel
    draft: object                 # ModelDraft | LookupDraft
    prompt_ids: list[int]
    gamma: int
    settings: SamplingSettings
    max_new_tokens: int
    cache: object                 # the target's KV cache, owned by this run
    new_ids: list[int] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    stop_reason: str | None = None
    draws: int = 0                # uniform numbers used so far: the next one is uniform(seed, draws)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.new_ids

    def next_draw(self) -> float:
        self.draws += 1
        return uniform(self.settings.seed, self.draws - 1)

    # counts over the rounds so far
    @property
    def target_passes(self) -> int:
        return len(self.rounds)

    @property
    def draft_passes(self) -> int:
        return sum(r.draft_passes for r in self.rounds)

    @property
    def proposed(self) -> int:
        return sum(len(r.checks) for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def judged(self) -> int:
        """Proposals the target looked at: those after a rejection were dropped unjudged."""
        return sum(r.judged for r in self.rounds)

    @property
    def alpha(self) -> float | None:
        """Acceptance rate: proposals kept / proposals judged."""
        return self.accepted / self.judged if self.judged else None

    @property
    def tokens_per_pass(self) -> float | None:
        return len(self.new_ids) / self.target_passes if self.rounds else None

    @property
    def cost_ratio(self) -> float | None:
        """c: the draft's time per pass over the target's (0 for prompt lookup, which runs no model)."""
        target_ms = sum(r.target_ms for r in self.rounds)
        if not self.draft_passes:
            return 0.0 if target_ms else None
        return (sum(r.draft_ms for r in self.rounds) / self.draft_passes) / (target_ms / self.target_passes)

    @property
    def ms_per_token(self) -> float | None:
        return sum(r.total_ms for r in self.rounds) / len(self.new_ids) if self.new_ids else None


def start(target: LoadedModel, draft_spec: str, prompt_ids: list[int], gamma: int, settings: SamplingSettings,
          max_new_tokens: int) -> SpeculativeRun:
    """Check the request, then an empty run: its first round feeds the whole prompt with the first proposals."""
    if gamma < 1:
        raise InputError("speculative_gamma", gamma=gamma)
    check_request(target, prompt_ids, settings, max_new_tokens)
    draft = make_draft(target, draft_spec)
    return SpeculativeRun(target, draft, list(prompt_ids), gamma, settings, max_new_tokens, target.new_cache())


@torch.inference_mode()
def target_logits(model: LoadedModel, ids: list[int], cache) -> np.ndarray:
    """(len(ids), vocab) logits at every fed position: the check needs all of them, not only the last."""
    x = torch.tensor([ids], dtype=torch.long, device=model.device)  # (1, T)
    if isinstance(model, NativeModel):
        logits = model.module(x, cache).logits
    else:
        from model.hf import cache_argument

        logits = model.module(input_ids=x, use_cache=True, **{cache_argument(model.module): cache.dynamic}).logits
    return logits[0].float().cpu().numpy()


def _q(proposal: Proposal, i: int) -> float:
    return float(proposal.q[i][proposal.ids[i]]) if proposal.q is not None else 1.0


def _judge(proposal: Proposal, p_rows: np.ndarray, settings: SamplingSettings, next_draw, eos_id):
    """Accept left to right; returns the checks, the next token (None after an accepted end of sequence), its
    kind and the residual at a rejection.
    p_rows (γ + 1, vocab): the target's distribution before each proposal, and after the last one."""
    checks, residual_top = [], []
    for i, token in enumerate(proposal.ids):
        p_row = p_rows[i]
        q_row = proposal.q[i] if proposal.q is not None else np.eye(1, p_row.size, token)[0]  # (vocab,)
        p, q = float(p_row[token]), _q(proposal, i)
        if settings.greedy:
            keep, r = token == int(np.argmax(p_row)), None
        else:
            r = next_draw()
            keep = r < acceptance_probability(p, q)
        checks.append(Check(token, q, p, r, keep))
        if keep and token == eos_id:
            return checks, None, "eos", []
        if keep:
            continue
        checks += [Check(t, _q(proposal, j), float(p_rows[j][t]), None, None)
                   for j, t in enumerate(proposal.ids[i + 1:], start=i + 1)]
        if settings.greedy:
            return checks, int(np.argmax(p_row)), "corrected", []
        rest = residual(p_row, q_row)
        top = np.argsort(-rest, kind="stable")[:RESIDUAL_TOP]
        residual_top = [(int(x), float(p_row[x]), float(q_row[x]), float(rest[x])) for x in top if rest[x] > 0]
        return checks, draw_from(rest, next_draw()), "resampled", residual_top
    last = p_rows[len(proposal.ids)]
    token = int(np.argmax(last)) if settings.greedy else draw_from(last, next_draw())
    return checks, token, "bonus" if proposal.ids else "target", residual_top


def next_round(run: SpeculativeRun) -> Round | None:
    """Propose, check in one target pass, accept, crop both caches. None once the run has stopped."""
    if run.stop_reason is not None:
        return None
    target, ids = run.target, run.ids
    # never propose past the token budget (a round yields at most γ + 1) or the context window
    room = min(run.max_new_tokens - len(run.new_ids) - 1, target.info.context_length - len(ids))
    gamma = max(0, min(run.gamma, room))
    synchronize(target.device)
    t0 = time.perf_counter()
    draft_before = _length(run.draft)
    eos = target.info.eos_id
    proposal = run.draft.propose(ids, gamma, run.settings, run.next_draw, eos)
    synchronize(target.device)
    t1 = time.perf_counter()
    draft_proposed = _length(run.draft)
    before = run.cache.length
    try:
        logits = target_logits(target, ids[before:] + proposal.ids, run.cache)  # (pending + γ', vocab)
        synchronize(target.device)
    except torch.OutOfMemoryError:
        run.cache.crop(before)
        raise InputError("out_of_memory", device=str(target.device)) from None
    t2 = time.perf_counter()
    checked = run.cache.length
    p_rows = np.stack([shown_probs(row, run.settings) for row in logits[-(len(proposal.ids) + 1):]])
    checks, next_id, kind, residual_top = _judge(proposal, p_rows, run.settings, run.next_draw, eos)
    new_ids = [c.id for c in checks if c.accepted] + ([] if next_id is None else [next_id])
    run.new_ids += new_ids
    # both caches keep every token but the newest, which the next round feeds: plain decoding's state
    run.cache.crop(len(run.ids) - 1)
    run.draft.keep(len(run.ids) - 1)
    t3 = time.perf_counter()
    round_ = Round(
        index=len(run.rounds), gamma=gamma, checks=checks, next_id=next_id, next_kind=kind, new_ids=new_ids,
        residual_top=residual_top, target_len_before=before, target_len_checked=checked,
        target_len_after=run.cache.length, draft_len_before=draft_before, draft_len_proposed=draft_proposed,
        draft_len_after=_length(run.draft), draft_passes=proposal.passes, draft_ms=(t1 - t0) * 1000,
        target_ms=(t2 - t1) * 1000, total_ms=(t3 - t0) * 1000)
    run.rounds.append(round_)
    run.stop_reason = _stop(run)
    return round_


def _length(draft) -> int | None:
    return draft.cache.length if draft.cache is not None else None


def _stop(run: SpeculativeRun) -> str | None:
    """The stop reasons of plain decoding, checked in the same order (model/generate.find_stop)."""
    if run.new_ids[-1] == run.target.info.eos_id:
        return "eos"
    if run.cache.length >= run.target.info.context_length:
        return "context_full"
    if len(run.new_ids) >= run.max_new_tokens:
        return "max_new_tokens"
    return None


def run_to_end(run: SpeculativeRun) -> None:
    while next_round(run) is not None:
        pass


# -- speed against plain decoding ------------------------------------------------------------------------------

@dataclass
class SpeedComparison:
    plain_ms_per_token: float
    speculative_ms_per_token: float
    plain_tokens: int
    speculative_tokens: int
    target_passes: int
    alpha: float | None        # of the last timed speculative run
    cost_ratio: float | None   # c, median over the timed runs: a draft pass's time over a target pass's
    repeats: int
    device: str
    dtype: str
    threads: int

    @property
    def speedup(self) -> float:
        return self.plain_ms_per_token / self.speculative_ms_per_token


def plain_decode(model: LoadedModel, prompt_ids: list[int], settings: SamplingSettings,
                 max_new_tokens: int) -> list[int]:
    """Plain decoding with the same forward pass the rounds use (no attention weights kept, unlike the
    Decode page's steps): prefill, then one token per pass, the same stop rules."""
    cache = model.new_cache()
    logits, _ = model.forward(prompt_ids, cache, output_attentions=False)
    new_ids = []
    while True:
        new_ids.append(sample(logits.float().cpu().numpy(), settings, len(new_ids)).chosen_id)
        if (new_ids[-1] == model.info.eos_id or cache.length >= model.info.context_length
                or len(new_ids) >= max_new_tokens):
            return new_ids
        logits, _ = model.forward(new_ids[-1:], cache, output_attentions=False)


def compare_speed(target: LoadedModel, draft_spec: str, prompt_ids: list[int], gamma: int,
                  settings: SamplingSettings, max_new_tokens: int, repeats: int = 3) -> SpeedComparison:
    """Wall time per token of plain and speculative decoding of the same prompt, alternated `repeats` times
    in this process after one warm-up of each; the median of each."""
    plain_ms, spec_ms, cost_ratios = [], [], []
    for i in range(repeats + 1):
        synchronize(target.device)
        t0 = time.perf_counter()
        plain = plain_decode(target, prompt_ids, settings, max_new_tokens)
        synchronize(target.device)
        t1 = time.perf_counter()  # the speculative side pays for its own setup (draft, cache), as plain does
        run = start(target, draft_spec, prompt_ids, gamma, settings, max_new_tokens)
        run_to_end(run)
        synchronize(target.device)
        t2 = time.perf_counter()
        if i > 0:  # the first of each warms up
            plain_ms.append((t1 - t0) * 1000 / len(plain))
            spec_ms.append((t2 - t1) * 1000 / len(run.new_ids))
            cost_ratios.append(run.cost_ratio)
    return SpeedComparison(
        plain_ms_per_token=float(np.median(plain_ms)), speculative_ms_per_token=float(np.median(spec_ms)),
        plain_tokens=len(plain), speculative_tokens=len(run.new_ids), target_passes=run.target_passes,
        alpha=run.alpha, cost_ratio=None if None in cost_ratios else float(np.median(cost_ratios)),
        repeats=repeats, device=target.info.device, dtype=target.info.dtype, threads=torch.get_num_threads())


# -- the command line: python -m model speculate ---------------------------------------------------------------

def report(run: SpeculativeRun, speed: SpeedComparison | None) -> dict:
    """The run as one JSON-ready object. q and p are after the sampling filters (greedy: the plain softmax)."""
    target, tok = run.target, run.target.tokenizer
    rounds = [{
        "index": r.index, "gamma": r.gamma,
        "proposed": [{"id": c.id, "token": tok.token(c.id), "q": round(c.q, 6), "p": round(c.p, 6),
                      "r": None if c.r is None else round(c.r, 6), "accepted": c.accepted} for c in r.checks],
        "next_id": r.next_id, "next_token": None if r.next_id is None else tok.token(r.next_id),
        "next_kind": r.next_kind, "new_ids": r.new_ids,
        "target_cache_len": r.target_len_after, "target_cache_len_checked": r.target_len_checked,
        "draft_cache_len": r.draft_len_after, "ms": round(r.total_ms, 3),
    } for r in run.rounds]
    alpha = run.alpha
    timing = {"ms_per_token": round(run.ms_per_token, 3)}
    if speed is not None:
        timing.update(plain_ms_per_token=round(speed.plain_ms_per_token, 3),
                      speculative_ms_per_token=round(speed.speculative_ms_per_token, 3),
                      speedup=round(speed.speedup, 3), cost_ratio=speed.cost_ratio, repeats=speed.repeats,
                      threads=speed.threads)
    return {
        "model": {"name": target.info.name, "n_layers": target.info.n_layers, "dtype": target.info.dtype,
                  "device": target.info.device},
        "draft": run.draft.name, "gamma": run.gamma,
        "settings": {"temperature": run.settings.temperature, "top_k": run.settings.top_k,
                     "top_p": run.settings.top_p, "seed": run.settings.seed},
        "prompt": {"ids": run.prompt_ids, "tokens": [tok.token(i) for i in run.prompt_ids]},
        "output": {"ids": run.new_ids, "text": tok.decode(run.new_ids), "stop_reason": run.stop_reason},
        "counts": {"new_tokens": len(run.new_ids), "target_passes": run.target_passes,
                   "draft_passes": run.draft_passes, "proposed": run.proposed, "judged": run.judged,
                   "accepted": run.accepted},
        "acceptance": {"alpha": None if alpha is None else round(alpha, 6),
                       "expected_tokens_per_pass": None if alpha is None
                       else round(expected_tokens_per_pass(alpha, run.gamma), 6),
                       "tokens_per_pass": round(run.tokens_per_pass, 6)},
        "rounds": rounds,
        "timing": timing,
    }


def print_rounds(rep: dict) -> None:
    m, c, a = rep["model"], rep["counts"], rep["acceptance"]
    print(f"target {m['name']} ({m['n_layers']} layers, {m['dtype']} on {m['device']}), draft {rep['draft']}, "
          f"γ = {rep['gamma']}")
    for r in rep["rounds"]:
        verdicts = " ".join(f"{p['token']}{'✓' if p['accepted'] else '✗' if p['accepted'] is False else '·'}"
                            for p in r["proposed"])
        print(f"round {r['index']:>3}: {verdicts or '(no proposal)'} -> {r['next_kind']} {r['next_token'] or ''!r}  "
              f"cache {r['target_cache_len_checked']} -> {r['target_cache_len']}  {r['ms']:.2f} ms")
    print(f"output {rep['output']['text']!r} stop: {rep['output']['stop_reason']}")
    print(f"{c['new_tokens']} tokens in {c['target_passes']} target passes ({c['draft_passes']} draft passes); "
          f"accepted {c['accepted']} of {c['judged']} judged ({c['proposed']} proposed); α = {a['alpha']}, "
          f"tokens per pass {a['tokens_per_pass']} (expected {a['expected_tokens_per_pass']})")
    t = rep["timing"]
    if "speedup" in t:
        print(f"ms per token: plain {t['plain_ms_per_token']}, speculative {t['speculative_ms_per_token']} "
              f"(×{t['speedup']}; median of {t['repeats']}, {m['device']}, {m['dtype']}, {t['threads']} threads)")


def run_cli(args) -> int:
    from model.cli import DEFAULT_NEW_TOKENS
    from model.loading import load_model

    target = load_model(args.model, args.device)
    if args.prompt_ids is not None:
        ids = parse_prompt_ids(target, args.prompt_ids)
    elif args.chat is not None:
        ids = encode_chat(target, args.chat).ids
    else:
        ids = encode_prompt(target, args.prompt).ids
    settings = SamplingSettings(args.temperature, args.top_k, args.top_p, args.seed)
    max_new_tokens = (min(DEFAULT_NEW_TOKENS, context_room(target, len(ids))) if args.max_new_tokens is None
                      else args.max_new_tokens)
    run = start(target, args.draft, ids, args.gamma, settings, max_new_tokens)
    run_to_end(run)
    speed = compare_speed(target, args.draft, ids, args.gamma, settings, max_new_tokens) if args.compare else None
    rep = report(run, speed)
    if args.json:
        print(json.dumps(rep, ensure_ascii=False))
    else:
        print_rounds(rep)
    return 0
