"""4E LoRA: the base weights frozen, a low-rank update learned beside chosen linear layers.

y = W x + (alpha / r) · B (A x),  A (r, d_in) Kaiming-uniform as PEFT draws it, B (d_out, r) zeros, so that the
model before the first step is exactly the base model. Only A and B get gradients and AdamW moments:
r · (d_in + d_out) parameters per target instead of d_in · d_out. "merge" folds the update into W:
W' = W + (alpha / r) · B A, a plain Llama (or Gemma 3) again whose logits equal the adapter's.

The adapter is saved in PEFT's format (adapter_config.json + adapter_model.safetensors with PEFT's key names), so
peft.PeftModel.from_pretrained on the base model loads it.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from model.engine.gemma3 import Gemma3
from model.engine.llama import Llama
from model.training.sft import SFT

TARGETS = {"qv": ("q_proj", "v_proj"),
           "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus its low-rank update; parameter names as PEFT's (lora_A, lora_B)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base = base.requires_grad_(False)
        d_out, d_in = base.weight.shape
        self.lora_A = nn.Parameter(torch.empty(r, d_in, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(d_out, r, device=base.weight.device))
        # nn.init.kaiming_uniform_(a=sqrt(5)), as PEFT (and nn.Linear) initialise A: U(-1/sqrt(d_in), 1/sqrt(d_in))
        bound = 1 / math.sqrt(d_in)
        with torch.no_grad():
            self.lora_A.copy_(torch.rand(r, d_in, generator=generator) * 2 * bound - bound)
        self.scaling = alpha / r

    def forward(self, x):                                       # x (B, T, d_in)
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling  # (B, T, d_out)

    def merged_weight(self) -> torch.Tensor:
        return self.base.weight + self.scaling * self.lora_B @ self.lora_A   # (d_out, d_in)


def lora_formula(module: Llama | Gemma3, r: int, targets: tuple[str, ...]) -> list[tuple[str, int, int, int]]:
    """(target, d_in, d_out, r·(d_in + d_out)) per target kind, counted over the layers."""
    rows = []
    for kind in targets:
        layer = next(m for n, m in module.named_modules() if n.endswith("." + kind))
        d_out, d_in = layer.weight.shape if isinstance(layer, nn.Linear) else layer.base.weight.shape
        rows.append((kind, d_in, d_out, r * (d_in + d_out) * module.config.num_hidden_layers))
    return rows


class LoRA(SFT):
    method = "lora"

    def setup(self) -> None:
        super().setup()  # the SFT data and loss
        s = self.settings
        self.targets = TARGETS[s.targets]
        self.module = self.base.requires_grad_(False).train()
        self.formula = lora_formula(self.module, s.rank, self.targets)
        generator = torch.Generator().manual_seed(s.seed)
        self.wrapped: dict[str, LoRALinear] = {}
        for name, parent in list(self.module.named_modules()):
            for kind in self.targets:
                child = getattr(parent, kind, None)
                if isinstance(child, nn.Linear):
                    setattr(parent, kind, LoRALinear(child, s.rank, s.alpha, generator))
                    self.wrapped[f"{name}.{kind}"] = getattr(parent, kind)
        self.named_params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def total_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def base_count(self) -> int:
        return self.total_count() - self.trainable_count()

    def adapter_bytes(self) -> int:
        return sum(p.nbytes for _, p in self.named_params)

    def merged(self) -> Llama | Gemma3:
        """A plain model of the base's architecture with W + (alpha / r) B A in every target: no adapter left, no
        slower at inference."""
        plain = copy.deepcopy(self.module)
        with torch.no_grad():
            for name, lora in self.wrapped.items():
                parent_name, kind = name.rsplit(".", 1)
                linear = copy.deepcopy(lora.base)
                linear.weight.copy_(lora.merged_weight())
                setattr(plain.get_submodule(parent_name), kind, linear)
        return plain.requires_grad_(False).eval()

    def answer_module(self) -> Llama | Gemma3:
        return self.module

    @torch.no_grad()
    def merge_difference(self) -> float:
        """max |Δlogit| between the model with its adapters and the merged one, on the first prompt: rounding only."""
        ids = torch.tensor([self.prompt_ids(self.prompts[0])], device=self.device)
        return float((self.module(ids).logits - self.merged()(ids).logits).abs().max())

    def save_adapter(self, folder: str | Path, base_path: str) -> list[tuple[str, int]]:
        """PEFT's format: adapter_config.json, and adapter_model.safetensors with keys
        base_model.model.<module>.lora_A.weight / .lora_B.weight (the adapter's name "default" left out)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        s = self.settings
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
                  "r": s.rank, "lora_alpha": s.alpha, "lora_dropout": 0.0, "target_modules": list(self.targets),
                  "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
                  "modules_to_save": None, "use_rslora": False, "use_dora": False}
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {}
        for name, lora in self.wrapped.items():
            tensors[f"base_model.model.{name}.lora_A.weight"] = lora.lora_A.detach().contiguous().cpu()
            tensors[f"base_model.model.{name}.lora_B.weight"] = lora.lora_B.detach().contiguous().cpu()
        save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
        return [(p.name, p.stat().st_size) for p in sorted(folder.iterdir())]

    def save(self, folder: str | Path) -> list[tuple[str, int]]:
        """The merged model (a folder trace --model DIR and transformers load) and the adapter in DIR/adapter."""
        folder = Path(folder)
        plain, self.module = self.module, self.merged()
        try:
            files = super().save(folder)
        finally:
            self.module = plain
        self.save_adapter(folder / "adapter", str(self.folder))
        return files + [(f"adapter/{n}", b) for n, b in sorted((p.name, p.stat().st_size)
                                                              for p in (folder / "adapter").iterdir())]
