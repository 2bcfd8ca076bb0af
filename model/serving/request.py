"""One request (nano-vllm's Sequence, vLLM v1's Request): what was asked, what it has drawn, and where its keys and
values are: blocks of the pool, a tier it was moved out to, or a prefill worker that computes its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.engine.sampling import SamplingSettings, sample
from model.engine.stopping import stop_reason


@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    max_new_tokens: int
    # greedy by default; otherwise temperature → top-k → top-p with the request's own seed, as its solo run draws
    settings: SamplingSettings = field(default_factory=SamplingSettings)
    arrival_step: int = 0                                 # the step it reaches the server at: none before waits for it
    ignore_eos: bool = False                              # run to its token budget (a benchmark's fixed lengths)
    logprobs: int | None = None                           # per token, its log-probability and the top n (an API's)
    # what it has drawn
    new_ids: list[int] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)  # the step each new token came out of
    token_ms: list[float] = field(default_factory=list)   # the engine clock (ms since the run began) at each token
    arrived_ms: float | None = None                       # the engine clock when its arrival step began
    joined_step: int | None = None
    left_step: int | None = None
    stop_reason: str | None = None                        # "eos" | "context_full" | "max_new_tokens" | "abort"
    token_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # (lp, top n (id, lp))
    cached_positions: int = 0                             # positions its first admission found in the prefix cache
    # where its keys and values are
    computed: int = 0                                     # positions whose keys and values its blocks hold
    hashes: list[int] = field(default_factory=list)       # chained hashes of its prompt's full blocks cached so far
    preemptions: int = 0
    kv_at: str = "here"                                   # "here" | "tier" (moved out) | "remote" (a prefill worker)
    # its prompt computed by a prefill worker, its first token not drawn yet
    first_logits: torch.Tensor | None = None              # (vocab,) of the prompt's last position
    received_kv: list[torch.Tensor] | None = None         # per group (2, group layers, n_kv, positions, d_head)

    def restart(self) -> Request:
        """Back to not served: no tokens, no keys and values anywhere, not arrived."""
        self.joined_step = self.left_step = self.stop_reason = self.arrived_ms = None
        self.new_ids, self.token_steps, self.token_ms, self.hashes = [], [], [], []
        self.token_logprobs = []
        self.computed, self.preemptions, self.kv_at, self.cached_positions = 0, 0, "here", 0
        self.first_logits = self.received_kv = None
        return self

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.new_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def emit(self, token: int, step: int, clock_ms: float, eos_id: int | None, context_length: int) -> None:
        """A new token, the step it came out of and the clock; whether that ends the request (the one stop rule)."""
        self.new_ids.append(token)
        self.token_steps.append(step)
        self.token_ms.append(clock_ms)
        # every token but the one just chosen has been fed
        self.stop_reason = stop_reason(token, None if self.ignore_eos else eos_id,
                                       len(self.prompt_ids) + len(self.new_ids) - 1, context_length, len(self.new_ids),
                                       self.max_new_tokens)

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from this request's logits (vocab,), drawn as its solo run draws it (generate.py); with
        `logprobs`, its log-probability and the top ones before temperature and filters (as vLLM returns them)."""
        if self.settings.greedy:
            chosen = int(torch.argmax(logits))
        else:
            chosen = sample(logits.float().cpu().numpy(), self.settings, len(self.new_ids)).chosen_id
        if self.logprobs is not None:
            log_p = torch.log_softmax(logits.float(), dim=-1)
            top = torch.topk(log_p, self.logprobs) if self.logprobs else None
            self.token_logprobs.append((float(log_p[chosen]), [] if top is None else
                                        list(zip(top.indices.tolist(), top.values.tolist()))))
        return chosen

    @property
    def ttft_ms(self) -> float | None:
        """Time to first token, from its arrival."""
        return self.token_ms[0] - (self.arrived_ms or 0.0) if self.token_ms else None

    @property
    def itl_ms(self) -> list[float]:
        """Inter-token latencies: the clock between one token and the next."""
        return [b - a for a, b in zip(self.token_ms, self.token_ms[1:])]
