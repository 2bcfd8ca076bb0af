"""4D supervised fine-tuning: the pretraining loop on (question, answer) pairs, the loss counted on the answer only.

Each row is prompt ids + answer ids + <eos>; its labels are the ids shifted by one, with -100 (IGNORE) wherever the
next id still belongs to the prompt (TRL's completion-only convention). token_losses gives 0 at those positions,
so the prompt shapes the context the model reads but is never itself learned.
"""

from __future__ import annotations

from functools import cache

import torch

from model.training.posttrain import FinetuneSettings, PostTrainer, Rows, completion_loss, completion_rows, tensors
from model.training.posttrain_data import SFT_DATA

# gemma3's tied 262,144 × 640 embedding (its LM head too) holds 167,772,160 of its 268,098,176 parameters: frozen,
# it needs no gradient and no AdamW moments, so that a step fits a few seconds and a few GB on a CPU
FROZEN_IN_SFT = {"gemma3": ("model.embed_tokens.weight",)}


class SFT(PostTrainer):
    method = "sft"

    def setup(self) -> None:
        self.pairs = SFT_DATA[self.settings.model][0](self.settings.seed)
        self.encoded = [self.encode(p.prompt, p.answer) for p in self.pairs]
        self.module = self.base.requires_grad_(True).train()  # the loaded copy is this trainer's own
        for name in FROZEN_IN_SFT.get(self.settings.model, ()):
            self.module.get_parameter(name).requires_grad_(False)
        # a tied LM head appears once
        self.named_params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.last: Rows | None = None

    def batch(self, index: int) -> tuple[list[int], Rows]:
        picks = [int(i) for i in self.rng(index).integers(0, len(self.pairs), self.settings.batch_size)]
        return picks, completion_rows([self.encoded[i] for i in picks], self.pad_id)

    def _step(self, index: int) -> dict:
        picks, rows = self.batch(index)
        inputs, labels = tensors(rows, self.device)             # (B, T) each
        logits = self.module(inputs).logits                      # (B, T, vocab): every position, no cache
        loss, learned = completion_loss(logits, labels)
        grad_norm = self.optimize(loss)
        self.last, self.last_picks = rows, picks
        return {"loss": loss.item(), "learned_tokens": learned, "ignored_tokens": rows.ignored_prompt,
                "padding": rows.padding, "grad_norm": grad_norm}


@cache
def sft_start(seed: int, steps: int) -> dict[str, torch.Tensor]:
    """`small` after `steps` SFT steps, on the CPU, computed once per process and seed."""
    trainer = SFT(FinetuneSettings(method="sft", model="small", seed=seed), "cpu")
    for _ in range(steps):
        trainer.step()
    return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}
