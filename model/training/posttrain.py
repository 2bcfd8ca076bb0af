"""Post-training, one optimizer step at a time (cells 4D SFT, 4E LoRA, 4F RLHF, 4G DPO): what the four methods
share. Each method lives in its own file (sft.py, lora.py, dpo.py, rlhf.py) as a subclass of PostTrainer.

Every method calls the model's own forward (Llama.forward or Gemma3.forward, cache=None: logits for every
position) and reuses the pretraining pieces of train.py: token_losses, AdamW, clip_gradients and the session
limits. A trainer belongs to one session and trains its own copy of the weights, never the app's shared model.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from model.engine import generate
from model.engine.gemma3 import Gemma3
from model.engine.llama import Llama
from model.engine.loading import load_native
from model.engine.runtime import NativeModel, pick_device, synchronize
from model.engine.sampling import SamplingSettings
from model.engine.tokenizer import chat_messages, load_tokenizer
from model.errors import InputError
from model.training.posttrain_data import CHAT_MODELS, SFT_DATA
from model.training.train import IGNORE, MAX_SEED, AdamW, Limits, clip_gradients, limits, token_losses
from model.weights.catalog import resolve_path

METHODS = ("sft", "lora", "dpo", "rlhf")
MODELS = {"sft": ("small", "smollm2", "gemma3"), "lora": ("small", "smollm2", "gemma3"), "dpo": ("small",),
          "rlhf": ("small",)}
# the learning rate each method starts with, per model: full fine-tuning of SmolLM2 wants a much smaller one
DEFAULT_LR = {("sft", "small"): 1e-3, ("lora", "small"): 1e-2, ("dpo", "small"): 3e-4, ("rlhf", "small"): 3e-4,
              ("sft", "smollm2"): 2e-5, ("lora", "smollm2"): 2e-3, ("sft", "gemma3"): 2e-5, ("lora", "gemma3"): 2e-3}
GREEDY = SamplingSettings(temperature=0.0)
MAX_ANSWER = {"small": 16, "smollm2": 24, "gemma3": 16}  # new tokens of each before/after answer
# pairs per step each model starts with: gemma3's step at 16 took 4–5 times as long and 1.7 GB more RSS on a
# 2-core CPU (measured: 4 pairs ≈ 1.5–2 s and 2.9 GB RSS in SFT)
DEFAULT_BATCH = {"small": 16, "smollm2": 16, "gemma3": 4}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# what the starting weights and the data come from: a change of any needs a new trainer
IDENTITY_FIELDS = ("method", "model", "seed", "rank", "alpha", "targets", "warmup_sft_steps")


@dataclass(frozen=True)
class FinetuneSettings:
    method: str = "sft"        # "sft" | "lora" | "dpo" | "rlhf"
    model: str = "small"       # the bundled `small`, or the fetched `smollm2` or `gemma3` (SFT and LoRA)
    seed: int = 0              # batches, LoRA's A, the reward head, RLHF's samples
    batch_size: int = 16       # pairs (SFT, LoRA, DPO, the reward model) or prompts × group (RLHF) per step
    lr: float = 0.0            # 0: DEFAULT_LR of the method and model; constant over the steps
    clip: float = 1.0          # max global gradient norm
    rank: int = 4              # LoRA r
    alpha: float = 8.0         # LoRA alpha: the update is (alpha / r) · B A x
    targets: str = "qv"        # LoRA: "qv" = q_proj, v_proj | "all" = every linear layer of the blocks
    beta: float = 0.1          # DPO's β (> 0) | RLHF's weight of the KL penalty (0 allowed: no leash, TRL's default)
    group_size: int = 8        # RLHF: answers sampled per prompt (G)
    reward_steps: int = 40     # RLHF (command line): reward-model steps before the policy's first step
    length_bonus: float = 0.0  # RLHF: reward += bonus × answer length, a reward that likes length (hacking demo)
    warmup_sft_steps: int = 40  # RLHF: the policy starts from `small` after this many SFT steps

    @property
    def init(self) -> str:
        """The checkpoint name's middle part (CheckpointStore names a save model-init-seed-step)."""
        return self.method

    @property
    def identity(self) -> tuple:
        """What the starting weights and the data come from: a change of any needs a new trainer."""
        return tuple(getattr(self, name) for name in IDENTITY_FIELDS)

    @property
    def learning_rate(self) -> float:
        return self.lr or DEFAULT_LR[(self.method, self.model)]

    def check(self, bound: Limits) -> FinetuneSettings:
        """InputError for the first setting out of range (NaN and infinities are out of every range)."""
        if self.method not in METHODS:
            raise InputError("finetune_method", method=self.method)
        if self.model not in MODELS[self.method]:
            raise InputError("finetune_model", model=self.model, method=self.method.upper(),
                             models=", ".join(MODELS[self.method]))
        closed = {"seed": (self.seed, 0, MAX_SEED), "batch": (self.batch_size, 1, bound.max_batch),
                  "rank": (self.rank, 1, 256), "group": (self.group_size, 2, 32),
                  "reward_steps": (self.reward_steps, 1, 1000), "length_bonus": (self.length_bonus, 0, 10),
                  "warmup": (self.warmup_sft_steps, 0, 1000), "alpha": (self.alpha, 0.01, 1024),
                  "lr": (self.learning_rate, 1e-7, 1.0), "clip": (self.clip, 1e-3, 100.0),
                  "beta": (self.beta, 0 if self.method == "rlhf" else 1e-4, 100)}
        for name, (value, low, high) in closed.items():
            if not low <= value <= high:
                raise InputError("finetune_setting", setting_text="finetune." + name, low=low, high=high, value=value)
        if self.targets not in ("qv", "all"):
            raise InputError("finetune_setting", setting_text="finetune.targets", low="qv", high="all",
                             value=self.targets)
        return self


# -- data → rows ------------------------------------------------------------------------------------------------

def encode_pair(tokenizer, prompt: str, answer: str, chat: bool) -> tuple[list[int], int]:
    """(prompt ids + answer ids, number of prompt ids). small: <bos> words of the prompt, then the answer's words
    and <eos>. smollm2: the prompt in its chat template (ending where the assistant's turn begins), then the answer
    and <|im_end|>."""
    if chat:
        prompt_ids = tokenizer.encode_chat(chat_messages(prompt)).ids
        answer_ids = tokenizer.encode(answer).ids
        answer_ids = [i for i in answer_ids if i != tokenizer.bos_id] + [tokenizer.eos_id]
    else:
        prompt_ids = tokenizer.encode(prompt).ids
        answer_ids = tokenizer.encode(answer).ids[1:] + [tokenizer.eos_id]  # without its <bos>
    return prompt_ids + answer_ids, len(prompt_ids)


@dataclass
class Rows:
    ids: list[list[int]]   # each row's prompt + answer ids, unpadded
    n_prompt: list[int]    # each row's prompt length
    inputs: np.ndarray     # (B, T) ids[:-1], right-padded with pad_id
    labels: np.ndarray     # (B, T) ids[1:]: IGNORE where the next id is a prompt id or padding

    @property
    def learned(self) -> int:
        return int((self.labels != IGNORE).sum())

    @property
    def ignored_prompt(self) -> int:
        """Positions whose label is a prompt token: -100, TRL's completion-only convention."""
        return sum(n - 1 for n in self.n_prompt)

    @property
    def padding(self) -> int:
        return int(self.labels.size) - self.learned - self.ignored_prompt


def completion_labels(ids: list[int], n_prompt: int) -> list[int]:
    """The next id at each position, IGNORE where that id belongs to the prompt: only answer ids are learned."""
    return [ids[j + 1] if j + 1 >= n_prompt else IGNORE for j in range(len(ids) - 1)]


def completion_rows(seqs: list[tuple[list[int], int]], pad_id: int) -> Rows:
    if not seqs or any(len(ids) <= n for ids, n in seqs):  # no rows, or a row without an answer token
        raise InputError("finetune_empty")
    width = max(len(ids) for ids, _ in seqs) - 1
    inputs = np.full((len(seqs), width), pad_id, dtype=np.int64)
    labels = np.full((len(seqs), width), IGNORE, dtype=np.int64)
    for r, (ids, n_prompt) in enumerate(seqs):
        inputs[r, : len(ids) - 1] = ids[:-1]
        labels[r, : len(ids) - 1] = completion_labels(ids, n_prompt)
    return Rows([ids for ids, _ in seqs], [n for _, n in seqs], inputs, labels)


def tensors(rows: Rows, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(rows.inputs).to(device), torch.from_numpy(rows.labels).to(device)


def completion_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """SFT's loss: the mean cross-entropy over the answer tokens only (labels IGNORE elsewhere) and their count."""
    per_position = token_losses(logits, labels)          # (B, T), 0 where ignored
    n = int((labels != IGNORE).sum())
    return per_position.sum() / max(1, n), n


def completion_logprobs(module: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log π(answer | prompt) of each row: the summed log-probabilities of its answer tokens. (B,)"""
    logits = module(inputs).logits                       # (B, T, vocab)
    return -token_losses(logits, labels).sum(-1)         # (B,)


# -- the trainer every method shares ----------------------------------------------------------------------------

def load_base(name: str, device: torch.device) -> tuple[Llama | Gemma3, object, Path]:
    """A fresh copy of a listed model's weights (frozen), in the native architecture its config names, and its
    tokenizer; InputError if it is missing."""
    folder = resolve_path(name)
    if not (folder / "model.safetensors").is_file():
        raise InputError("finetune_missing", model=name)
    return load_native(folder, device), load_tokenizer(folder), folder


def greedy_answer(module: Llama | Gemma3, tokenizer, prompt_ids: list[int], max_new: int, device) -> str:
    """The module's greedy answer through the inference engine (its KV cache), as Decode would give it."""
    model = NativeModel("post-training", module, tokenizer, device)
    was_training = module.training
    module.eval()
    gen = generate.start(model, prompt_ids, GREEDY, min(max_new, generate.context_room(model, len(prompt_ids))))
    generate.run_to_end(model, gen)
    module.train(was_training)
    return tokenizer.decode(gen.new_ids)


class PostTrainer:
    """Subclasses set up `self.module` (the model whose answers are shown and saved), `self.named_params` (what
    the optimizer updates) and implement _step(index) -> the step's record (a dict of plain numbers)."""
    method = ""

    def __init__(self, settings: FinetuneSettings, device: str = "cpu", bound: Limits | None = None):
        self.limits = bound or limits()
        self.settings = replace(settings, method=self.method).check(self.limits)
        self.device = pick_device(device)
        self.base, self.tokenizer, self.folder = load_base(settings.model, self.device)
        self.chat = settings.model in CHAT_MODELS
        self.pad_id = self.base.config.pad_token_id or 0
        self.history: list[dict] = []
        self.prompts = SFT_DATA[settings.model][1]
        self.optimizer: AdamW | None = None
        self.setup()
        self.optimizer = AdamW(self.named_params, weight_decay=0.0)
        self.before = self.answers()

    # subclasses
    module: Llama | Gemma3
    named_params: list[tuple[str, torch.Tensor]]

    def setup(self) -> None:
        raise NotImplementedError

    def _step(self, index: int) -> dict:
        raise NotImplementedError

    @property
    def steps_done(self) -> int:
        return len(self.history)

    @property
    def identity(self) -> tuple:
        return self.settings.identity

    @property
    def config(self):
        return self.base.config

    def update_settings(self, settings: FinetuneSettings) -> FinetuneSettings:
        """lr, clip, β, batch and the length bonus change from the next step on; the rest needs a new trainer."""
        assert settings.identity == self.identity
        self.settings = replace(settings, method=self.method).check(self.limits)
        return self.settings

    def encode(self, prompt: str, answer: str) -> tuple[list[int], int]:
        return encode_pair(self.tokenizer, prompt, answer, self.chat)

    def prompt_ids(self, prompt: str) -> list[int]:
        return self.encode(prompt, "")[0][: self.encode(prompt, "")[1]]

    def rng(self, index: int) -> np.random.Generator:
        """The draws of step `index` (0 = the first), from (seed, step) alone: the same seed gives the same steps."""
        return np.random.default_rng([self.settings.seed, index])

    def optimize(self, loss: torch.Tensor) -> float:
        """backward → clipping → AdamW, the pretraining pieces; the gradient's global norm before clipping."""
        loss.backward()
        params = [p for _, p in self.named_params]
        if not all(p.grad is not None for p in params):
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        norm, _ = clip_gradients(params, self.settings.clip)
        if not math.isfinite(norm) or not math.isfinite(loss.item()):
            self.zero_grad()
            raise InputError("finetune_not_finite", step=self.steps_done + 1, loss=loss.item(),
                             lr=f"{self.settings.learning_rate:.2e}")
        self.optimizer.step(self.settings.learning_rate)
        return norm

    def zero_grad(self) -> None:
        for _, p in self.named_params:
            p.grad = None

    def step(self) -> dict:
        index = self.steps_done
        if self.steps_used >= self.limits.max_steps:
            raise InputError("finetune_step_limit", steps=self.limits.max_steps)
        synchronize(self.device)
        t0 = time.perf_counter()
        self.zero_grad()
        try:
            record = self._step(index)
        except torch.OutOfMemoryError:
            self.zero_grad()
            raise InputError("finetune_out_of_memory", device=str(self.device)) from None
        synchronize(self.device)
        record = {"step": index + 1, **record, "lr": self.settings.learning_rate,
                  "ms": round((time.perf_counter() - t0) * 1000, 3)}
        self.history.append(record)
        return record

    @property
    def steps_used(self) -> int:
        """Optimizer steps that count against the session's limit (RLHF adds its reward model's)."""
        return self.steps_done

    def answers(self) -> list[tuple[str, str]]:
        """(prompt, greedy answer) of the model as it is now, for the before/after view."""
        module = self.answer_module()
        return [(p, greedy_answer(module, self.tokenizer, self.prompt_ids(p), MAX_ANSWER[self.settings.model],
                                  self.device)) for p in self.prompts]

    def answer_module(self) -> Llama | Gemma3:
        return self.module

    def trainable_count(self) -> int:
        return sum(p.numel() for _, p in self.named_params)

    def total_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def held_bytes(self) -> int:
        """What this trainer holds of its own, every storage once: its models' tensors (the one it trains, and a
        frozen reference or reward model where it has one), their gradients and its optimizers' moments. Its weights
        are its own, read from the file (load_base), never the shared model's: Reset frees all of it."""
        tensors = []
        for value in vars(self).values():
            if isinstance(value, torch.nn.Module):
                tensors += [*value.parameters(), *value.buffers(), *(p.grad for p in value.parameters()
                                                                    if p.grad is not None)]
            elif isinstance(value, AdamW):
                tensors += [*value.m, *value.v]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    # -- 3E: a checkpoint that trace --model DIR, the app and transformers load --------------------------------

    def save(self, folder: str | Path) -> list[tuple[str, int]]:
        folder = Path(folder)
        self.answer_module().save(folder)
        for name in TOKENIZER_FILES:
            if (self.folder / name).is_file():
                shutil.copyfile(self.folder / name, folder / name)
        (folder / "finetune.json").write_text(json.dumps(
            {"method": self.method, "base": self.settings.model, "steps": self.steps_done}, indent=2) + "\n")
        return [(str(p.relative_to(folder)), p.stat().st_size) for p in sorted(folder.rglob("*")) if p.is_file()]
