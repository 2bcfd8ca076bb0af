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
The sampling filters (temperature → top-k → top-p, model/engine/sampling.py) shape p and q alike.

Drafts: a small model with the target's tokenizer (`small-draft` for `small`), prompt lookup (copy what followed
an earlier occurrence of the last tokens; no model), and early exit (the target's own first K layers, then its
final norm and LM head).
"""


from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from model.engine.generate import check_request
from model.engine.runtime import LoadedModel, synchronize
from model.engine.sampling import SamplingSettings, draw_from, sample, uniform
from model.engine.steps import rewind
from model.engine.stopping import stop_reason
from model.errors import InputError
from model.speculative.drafts import Proposal, make_draft
from model.speculative.rules import acceptance_probability, residual, shown_probs

RESIDUAL_TOP = 6  # tokens of max(0, p − q) kept for the page at a rejection
MAX_GAMMA = 16    # proposals per round (the page offers 1 to 8; a round near the end proposes fewer)


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
    settings: SamplingSettings     # the round's own: the Speculative page applies a change from the next round on

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
    if not 1 <= gamma <= MAX_GAMMA:
        raise InputError("speculative_gamma", gamma=gamma, most=MAX_GAMMA)
    check_request(target, prompt_ids, settings, max_new_tokens)
    draft = make_draft(target, draft_spec)
    return SpeculativeRun(target, draft, list(prompt_ids), gamma, settings, max_new_tokens, target.new_cache())


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
        logits = target.every_logits(ids[before:] + proposal.ids, run.cache)  # (pending + γ', vocab)
        logits = logits.float().cpu().numpy()
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
    rewind(target, run.cache, run.ids, len(run.ids) - 1)
    run.draft.keep(len(run.ids) - 1)
    t3 = time.perf_counter()
    round_ = Round(
        index=len(run.rounds), gamma=gamma, checks=checks, next_id=next_id, next_kind=kind, new_ids=new_ids,
        residual_top=residual_top, target_len_before=before, target_len_checked=checked,
        target_len_after=run.cache.length, draft_len_before=draft_before, draft_len_proposed=draft_proposed,
        draft_len_after=_length(run.draft), draft_passes=proposal.passes, draft_ms=(t1 - t0) * 1000,
        target_ms=(t2 - t1) * 1000, total_ms=(t3 - t0) * 1000, settings=run.settings)
    run.rounds.append(round_)
    run.stop_reason = _stop(run)
    return round_


def _length(draft) -> int | None:
    return draft.cache.length if draft.cache is not None else None


def _stop(run: SpeculativeRun) -> str | None:
    """The stop reasons of plain decoding (model/engine/stopping.py)."""
    return stop_reason(run.new_ids[-1], run.target.info.eos_id, run.cache.length, run.target.info.context_length,
                       len(run.new_ids), run.max_new_tokens)


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
