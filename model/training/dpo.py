"""4G DPO (Rafailov et al., 2023): learn from (prompt, chosen, rejected) directly, against a frozen reference.

Per pair, with π and ref the summed log-probabilities of an answer under the policy and under the reference:
    reward_chosen   = β · (π_c − ref_c)        reward_rejected = β · (π_r − ref_r)
    margin          = reward_chosen − reward_rejected
    loss            = −log σ(margin)
At step 0 the policy is the reference, every margin is 0 and the loss is ln 2 = 0.6931 for every pair.
The formula is TRL's DPOTrainer "sigmoid" loss without label smoothing (tests/test_finetune.py holds it equal).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from model.training.posttrain import PostTrainer, completion_logprobs, completion_rows, tensors
from model.training.posttrain_data import preference_pairs
from model.training.sft import sft_start


def dpo_loss(pi_c: torch.Tensor, pi_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair loss, reward_chosen, reward_rejected, margin; every input (P,) summed log-probabilities."""
    reward_chosen = beta * (pi_c - ref_c)
    reward_rejected = beta * (pi_r - ref_r)
    margin = reward_chosen - reward_rejected
    return -F.logsigmoid(margin), reward_chosen, reward_rejected, margin


class DPO(PostTrainer):
    method = "dpo"

    def setup(self) -> None:
        s = self.settings
        self.pairs = preference_pairs(s.seed)
        # DPO starts from an SFT model (a few SFT steps of `small`), as in production
        self.base.load_state_dict({k: v.to(self.device) for k, v in sft_start(s.seed, s.warmup_sft_steps).items()})
        self.module = self.base.requires_grad_(True).train()
        self.reference = copy.deepcopy(self.base).requires_grad_(False).eval()  # frozen: never stepped
        self.named_params = list(self.module.named_parameters())
        self.last_pairs: list[int] = []
        self.last_margins: list[float] = []

    def logprobs(self, picks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """π_c, π_r (with gradients) and ref_c, ref_r of the picked pairs, (P,) each: chosen and rejected rows go
        through each model in one batch of 2P."""
        seqs = [self.encode(self.pairs[i].prompt, self.pairs[i].chosen) for i in picks]
        seqs += [self.encode(self.pairs[i].prompt, self.pairs[i].rejected) for i in picks]
        inputs, labels = tensors(completion_rows(seqs, self.pad_id), self.device)   # (2P, T)
        pi = completion_logprobs(self.module, inputs, labels)                       # (2P,)
        with torch.no_grad():
            ref = completion_logprobs(self.reference, inputs, labels)
        P = len(picks)
        return pi[:P], pi[P:], ref[:P], ref[P:]

    def _step(self, index: int) -> dict:
        picks = [int(i) for i in self.rng(index).integers(0, len(self.pairs), self.settings.batch_size)]
        pi_c, pi_r, ref_c, ref_r = self.logprobs(picks)
        losses, r_c, r_r, margin = dpo_loss(pi_c, pi_r, ref_c, ref_r, self.settings.beta)
        r_c, r_r = r_c.detach(), r_r.detach()
        loss = losses.mean()
        grad_norm = self.optimize(loss)
        margin = margin.detach()
        self.last_pairs, self.last_margins = picks, margin.tolist()
        return {"loss": loss.item(), "reward_chosen": float(r_c.mean()), "reward_rejected": float(r_r.mean()),
                "margin": float(margin.mean()), "accuracy": float((margin > 0).float().mean()),
                "beta": self.settings.beta, "grad_norm": grad_norm}
