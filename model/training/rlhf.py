"""4F RLHF in miniature: (a) a reward model learns people's preferences, (b) the policy is pushed towards answers
it scores high, on a KL leash to where it started.

(a) The reward model is `small` itself with a scalar head reading the final hidden state of an answer's last token
    (its <eos>). Bradley–Terry: loss = −log σ(r_chosen − r_rejected) on preference pairs; its accuracy is measured
    on held-out pairs (no (chosen, rejected) pair of them is in the training pairs).
(b) GRPO-style policy gradient (Shao et al., 2024): per prompt a group of G answers sampled at temperature 1,
    rewarded by (a); advantage A = (r − mean) / (std + 1e-4) within the group (std with Bessel's correction); per
    answer token
        loss = −(A · ratio − β · KL),  ratio = π/π_old (= 1, its gradient is A·∇log π),
        KL ≈ ref/π − log(ref/π) − 1 (the "k3" estimator, ≥ 0, exactly 0 while π = ref),
    averaged over each answer's tokens, then over the answers. These are TRL's GRPOTrainer formulas with
    loss_type="grpo" and scale_rewards="group" (trl/trainer/grpo_trainer.py, v1.9.0: the advantages in
    _generate_and_score_completions, the loss in _compute_loss); two of TRL's defaults differ: loss_type="dapo"
    (the mean over every answer token of the batch, so a long answer weighs more) and β = 0 (no KL term, no
    reference model loaded; here β starts at 0.1 and at 0 the KL is still measured). The KL logged is TRL's: k3's
    mean over every answer token of the batch.
The policy starts from `small` after a few SFT steps (production RLHF starts from an SFT model; the bundled
`small`, never taught to answer, ends every question at once and all its answers would score the same).

What is simplified against production RLHF: one update per batch of samples (PPO reuses them for several
clipped updates, so its ratio moves away from 1 and is clipped); no value model (the group mean is the baseline,
as in GRPO); a reward model of a few hundred pairs, easy to game.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from model.engine.llama import Llama
from model.training.posttrain import PostTrainer, completion_rows, tensors, token_losses
from model.training.posttrain_data import preference_pairs, sft_pairs
from model.training.sft import sft_start
from model.training.train import IGNORE, AdamW, clip_gradients

MAX_SAMPLE = 14   # new tokens per sampled answer
HELD_OUT = 96     # held-out preference pairs
SHOWN_SAMPLES = 6
RM_BATCH = 32     # preference pairs per reward-model step
RM_LR = 1e-3


class RewardModel(nn.Module):
    """r(prompt + answer): a Llama body and a scalar head on the last token's final hidden state."""

    def __init__(self, body: Llama, generator: torch.Generator):
        super().__init__()
        self.body = body
        self.head = nn.Linear(body.config.hidden_size, 1, device=body.lm_head.weight.device)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(self.head.weight.shape, generator=generator) * 0.02)
            self.head.bias.zero_()

    def forward(self, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """ids (B, T) right-padded, last (B,) the index of each row's last real token → rewards (B,)."""
        hidden = self.body(ids).hidden                          # (B, T, hidden)
        picked = hidden[torch.arange(ids.shape[0]), last]       # (B, hidden)
        return self.head(picked).squeeze(-1)                    # (B,)


def bradley_terry(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    return -F.logsigmoid(r_chosen - r_rejected)


def questions_per_step(settings) -> int:
    """The questions a policy step samples G answers to: its batch (sampled answers) in whole groups, at least one."""
    return max(1, settings.batch_size // settings.group_size)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ ref) from samples of π: e^(ref−π) − (ref−π) − 1."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r − mean) / (std + 1e-4) within each group of G consecutive answers, std with Bessel's correction. (P·G,)"""
    grouped = rewards.view(-1, group_size)                                # (P, G)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)


def grpo_loss(advantages: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
              beta: float) -> tuple[torch.Tensor, float]:
    """The policy's loss and the KL logged, from each answer's advantage (B,) and the log-probabilities of its
    tokens under the policy and the reference (B, T; mask 1 on answer tokens, 0 on prompt and padding)."""
    ratio = torch.exp(logp - logp.detach())                               # 1, with the gradient of log π
    kl = k3_kl(logp, ref_logp)
    per_token = (-(advantages[:, None] * ratio) + beta * kl) * mask
    loss = (per_token.sum(1) / mask.sum(1)).mean()                        # each answer's mean, then over answers
    return loss, float((kl.detach() * mask).sum() / mask.sum())


class RLHF(PostTrainer):
    method = "rlhf"

    def setup(self) -> None:
        s = self.settings
        self.base.load_state_dict({k: v.to(self.device) for k, v in sft_start(s.seed, s.warmup_sft_steps).items()})
        self.module = self.base.requires_grad_(True).train()
        self.reference = copy.deepcopy(self.base).requires_grad_(False).eval()
        self.named_params = list(self.module.named_parameters())
        # the questions of the SFT data, each once
        self.questions = list(dict.fromkeys(p.prompt for p in sft_pairs(s.seed)))
        pairs = preference_pairs(s.seed)
        seen = {(p.chosen, p.rejected) for p in pairs}
        self.train_pairs = pairs
        unseen = [p for p in preference_pairs(s.seed + 1000, 600) if (p.chosen, p.rejected) not in seen]
        self.held_out = unseen[:HELD_OUT]
        generator = torch.Generator().manual_seed(s.seed)
        self.reward_model = RewardModel(copy.deepcopy(self.reference).requires_grad_(True).train(), generator)
        self.rm_params = list(self.reward_model.named_parameters())
        self.rm_optimizer = AdamW(self.rm_params, weight_decay=0.0)
        self.rm_history: list[dict] = []
        self.last_samples: list[dict] = []

    @property
    def steps_used(self) -> int:
        return self.steps_done + len(self.rm_history)

    # -- (a) the reward model ---------------------------------------------------------------------------------

    def score(self, seqs: list[list[int]]) -> torch.Tensor:
        """Rewards (B,) of full id sequences (prompt + answer + <eos>)."""
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s)
        last = torch.tensor([len(s) - 1 for s in seqs])
        return self.reward_model(ids.to(self.device), last.to(self.device))

    def pair_rewards(self, pairs) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = [self.encode(p.prompt, p.chosen)[0] for p in pairs]
        rejected = [self.encode(p.prompt, p.rejected)[0] for p in pairs]
        r = self.score(chosen + rejected)
        return r[: len(pairs)], r[len(pairs):]

    @torch.no_grad()
    def held_out_accuracy(self) -> float:
        self.reward_model.eval()
        r_c, r_r = self.pair_rewards(self.held_out)
        self.reward_model.train()
        return float((r_c > r_r).float().mean())

    def reward_step(self) -> dict:
        from model.errors import InputError

        if self.steps_used >= self.limits.max_steps:
            raise InputError("finetune_step_limit", steps=self.limits.max_steps)
        index = len(self.rm_history)
        picks = self.rng(10_000 + index).integers(0, len(self.train_pairs), RM_BATCH)
        for _, p in self.rm_params:
            p.grad = None
        r_c, r_r = self.pair_rewards([self.train_pairs[int(i)] for i in picks])
        loss = bradley_terry(r_c, r_r).mean()
        loss.backward()
        params = [p for _, p in self.rm_params]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        clip_gradients(params, self.settings.clip)
        self.rm_optimizer.step(RM_LR)
        record = {"step": index + 1, "loss": loss.item(), "train_accuracy": float((r_c > r_r).float().mean().detach()),
                  "held_out_accuracy": self.held_out_accuracy()}
        self.rm_history.append(record)
        return record

    # -- (b) the policy --------------------------------------------------------------------------------------

    @torch.no_grad()
    def sample(self, prompt_ids: list[int], g: int, generator: torch.Generator) -> list[list[int]]:
        """G answers to one prompt at temperature 1, each up to and with its <eos> (or MAX_SAMPLE tokens). The
        group shares one prompt, so its rows have one length: each new token is one forward of (G, T)."""
        x = torch.tensor([prompt_ids] * g, device=self.device)           # (G, T)
        done = torch.zeros(g, dtype=torch.bool)
        answers = [[] for _ in range(g)]
        for _ in range(MAX_SAMPLE):
            logits = self.module(x).logits[:, -1].float()                # (G, vocab)
            probs = F.softmax(logits, dim=-1).cpu()
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]  # (G,)
            for r in range(g):
                if not done[r]:
                    answers[r].append(int(nxt[r]))
            done |= nxt == self.tokenizer.eos_id
            if done.all():
                break
            x = torch.cat([x, nxt[:, None].to(self.device)], dim=1)
        return answers

    def policy_loss(self, seqs: list[tuple[list[int], int]], rewards: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """GRPO on sampled answers, each (prompt ids + answer ids, prompt length), G consecutive ones to a prompt,
        and their rewards (P·G,): the loss, each answer's advantage and the KL logged."""
        advantages = group_advantages(rewards, self.settings.group_size)
        inputs, labels = tensors(completion_rows(seqs, self.pad_id), self.device)  # (P·G, T)
        mask = (labels != IGNORE).float()
        logp = -token_losses(self.module(inputs).logits, labels)          # (P·G, T) log π of each answer token
        with torch.no_grad():
            ref_logp = -token_losses(self.reference(inputs).logits, labels)
        loss, kl = grpo_loss(advantages, logp, ref_logp, mask, self.settings.beta)
        return loss, advantages, kl

    def _step(self, index: int) -> dict:
        from model.errors import InputError

        if not self.rm_history:
            raise InputError("finetune_reward_first")
        s = self.settings
        n_prompts = questions_per_step(s)
        picks = self.rng(index).integers(0, len(self.questions), n_prompts)
        generator = torch.Generator().manual_seed(int(self.rng(index).integers(0, 2**31)))
        seqs, groups = [], []
        self.module.eval()
        for q in (self.questions[int(i)] for i in picks):
            prompt = self.prompt_ids(q)
            for answer in self.sample(prompt, s.group_size, generator):
                seqs.append((prompt + answer, len(prompt)))
            groups.append(q)
        self.module.train()
        with torch.no_grad():
            self.reward_model.eval()
            scored = self.score([ids for ids, _ in seqs])                 # (P·G,)
            self.reward_model.train()
        lengths = torch.tensor([len(ids) - n for ids, n in seqs], dtype=torch.float32, device=self.device)
        rewards = scored + s.length_bonus * lengths                       # what the policy is pushed by
        loss, advantages, kl_mean = self.policy_loss(seqs, rewards)
        grad_norm = self.optimize(loss)
        self.last_samples = [{"prompt": groups[i // s.group_size],
                              "answer": self.tokenizer.decode(ids[n:]), "reward": float(rewards[i]),
                              "advantage": float(advantages[i])}
                             for i, (ids, n) in enumerate(seqs)]
        return {"loss": loss.item(), "reward": float(rewards.mean()), "rm_reward": float(scored.mean()),
                "kl": kl_mean, "length": float(lengths.mean()), "beta": s.beta, "grad_norm": grad_norm}
