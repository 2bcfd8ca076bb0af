"""Training the native model one step at a time: corpus -> batch -> forward -> loss -> backward -> clipping
-> AdamW -> checkpoint, each stage written out so that its numbers can be shown.

The loss, the clipping and the optimizer are spelled out here rather than called from PyTorch; the tests hold
each equal to PyTorch's own (F.cross_entropy, clip_grad_norm_, torch.optim.AdamW).
A Trainer belongs to one session: it trains its own copy of the weights, never the app's shared model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from model.engine.llama import Llama, LlamaConfig
from model.engine.runtime import pick_device, synchronize
from model.engine.sampling import MAX_SEED
from model.engine.tokenizer import WordTokenizer
from model.errors import InputError
from model.training.corpus import MICRO_SENTENCES, generate_corpus
from model.weights.catalog import resolve_path

IGNORE = -100  # the label value F.cross_entropy skips by default (its ignore_index)
BETAS, EPS = (0.9, 0.999), 1e-8  # torch.optim.AdamW's defaults
CLIP_EPS = 1e-6                  # clip_grad_norm_ divides by (norm + 1e-6)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else default


@dataclass(frozen=True)
class Limits:
    """Server settings that bound what one session may use (environment variables, read when a trainer starts)."""
    max_steps: int        # DECODE_LAB_TRAIN_MAX_STEPS: optimizer steps of one trainer, until Reset
    max_checkpoints: int  # DECODE_LAB_TRAIN_MAX_CHECKPOINTS: saved checkpoints kept per session, oldest dropped
    max_batch: int = 64   # rows per micro-batch
    max_accum: int = 8    # micro-batches per step
    max_seq_len: int = 32  # positions per row (the longest corpus sentence is 14 ids)


def limits() -> Limits:
    return Limits(_env_int("DECODE_LAB_TRAIN_MAX_STEPS", 2000), _env_int("DECODE_LAB_TRAIN_MAX_CHECKPOINTS", 3))


MAX_STEPS = 10_000     # warm-up and schedule lengths, and the steps of one command
MAX_LR = 1.0           # a peak learning rate above this only blows the weights up
MAX_CLIP = 100.0


@dataclass(frozen=True)
class TrainSettings:
    model: str = "small"           # "small" | "micro": the architecture, its tokenizer and its corpus
    init: str = "random"           # "random": Normal(0, 0.02) weights | "bundled": the shipped weights
    seed: int = 0                  # initial weights and the batch sampler
    batch_size: int = 16           # rows per micro-batch
    seq_len: int = 16              # input positions per row: sentences are cut or padded to seq_len + 1 ids
    lr: float = 3e-3               # peak learning rate, reached at the end of the warm-up
    warmup_steps: int = 20
    schedule_steps: int = 200      # the cosine reaches min_lr_ratio × lr at this step
    min_lr_ratio: float = 0.1
    clip: float = 1.0              # max global gradient norm
    weight_decay: float = 0.01
    accum_steps: int = 1           # micro-batches whose gradients add up to one optimizer step
    bf16_autocast: bool = False
    activation_checkpointing: bool = False

    @property
    def identity(self) -> tuple[str, str, int]:
        """What the initial weights and the batches come from: a change of any of them needs a new Trainer."""
        return self.model, self.init, self.seed

    def check(self, context_length: int, bound: Limits) -> None:
        """InputError naming the first setting outside its range, the range and the value given (NaN and
        infinities are outside every range)."""
        if self.model not in ("small", "micro") or self.init not in ("random", "bundled"):
            raise InputError("train_model", model=self.model, init=self.init)
        closed = {"seed": (self.seed, 0, MAX_SEED), "batch": (self.batch_size, 1, bound.max_batch),
                  "seq_len": (self.seq_len, 1, min(bound.max_seq_len, context_length)),
                  "accum": (self.accum_steps, 1, bound.max_accum), "warmup": (self.warmup_steps, 0, MAX_STEPS),
                  "schedule": (self.schedule_steps, 1, MAX_STEPS), "wd": (self.weight_decay, 0, 1),
                  "min_lr_ratio": (self.min_lr_ratio, 0, 1)}
        for name, (value, low, high) in closed.items():
            if not low <= value <= high:
                raise InputError("train_setting", setting_text="train." + name, low=low, high=high, value=value)
        for name, value, high in (("lr", self.lr, MAX_LR), ("clip", self.clip, MAX_CLIP)):
            if not 0 < value <= high:
                raise InputError("train_setting_positive", setting_text="train." + name, high=high, value=value)


# -- 1A corpus, 1B tokenizer, 1C batches ---------------------------------------------------------------------

@dataclass
class Corpus:
    sentences: list[str]
    n_vietnamese: int
    n_english: int
    encoded: list[list[int]]  # per sentence: <bos> word ids <eos>
    n_tokens: int


@cache
def load_corpus(model_name: str) -> Corpus:
    """small: the bilingual corpus it was built from (generate_corpus alternates Vietnamese and English);
    micro: the course example's four Vietnamese sentences. Read-only, so one copy serves every session."""
    tokenizer = WordTokenizer.load(resolve_path(model_name))
    if model_name == "micro":
        sentences, n_vi = list(MICRO_SENTENCES), len(MICRO_SENTENCES)
    else:
        sentences = generate_corpus(seed=0)
        n_vi = (len(sentences) + 1) // 2
    encoded = [tokenizer.encode(s).ids + [tokenizer.eos_id] for s in sentences]
    return Corpus(sentences, n_vi, len(sentences) - n_vi, encoded, sum(map(len, encoded)))


@dataclass
class Batch:
    rows: np.ndarray     # (B·k, T + 1) sentence ids, cut or right-padded
    inputs: np.ndarray   # (B·k, T) rows[:, :-1]
    labels: np.ndarray   # (B·k, T) rows[:, 1:], IGNORE where the next id is padding
    sentence_ids: list[int]


def sample_batch(corpus: Corpus, n_rows: int, seq_len: int, pad_id: int, seed: int, step: int) -> Batch:
    """The batch of optimizer step `step`: drawn from (seed, step) alone, so any step can be drawn again."""
    picks = np.random.default_rng([seed, step]).integers(0, len(corpus.sentences), n_rows)
    width = seq_len + 1
    rows = np.full((n_rows, width), pad_id, dtype=np.int64)
    for r, index in enumerate(picks):
        ids = corpus.encoded[index][:width]
        rows[r, : len(ids)] = ids
    labels = rows[:, 1:].copy()
    labels[labels == pad_id] = IGNORE  # padding is no next token to predict
    return Batch(rows, rows[:, :-1], labels, [int(i) for i in picks])


def init_weights(model: Llama) -> Llama:
    """Normal(0, 0.02) like transformers' Llama: PyTorch's defaults make the first logits huge."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)
    return model


# -- 2A–2D forward, 3A loss ----------------------------------------------------------------------------------

def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy at each position, -log p(label), in float32; 0 where the label is IGNORE. (B, T)"""
    log_probs = F.log_softmax(logits.float(), dim=-1)                        # (B, T, vocab)
    real = labels != IGNORE
    picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1))[..., 0]  # (B, T)
    return -picked * real


# -- 3C clipping, 3D optimizer --------------------------------------------------------------------------------

def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sqrt of the sum of squares of every element of every tensor."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))


def clip_gradients(params: list[torch.Tensor], max_norm: float) -> tuple[float, float]:
    """Scale all gradients by one factor so that their global norm is at most max_norm; direction unchanged.
    Returns the norm before and after."""
    grads = [p.grad for p in params]
    before = global_norm(grads)
    scale = (max_norm / (before + CLIP_EPS)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale)
    return float(before), float(global_norm(grads))


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter): the decay shrinks the weights directly,
    outside the adaptive gradient step, as torch.optim.AdamW does. Decay applies to the weight matrices,
    not to the RMSNorm gains."""

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], weight_decay: float):
        self.named_params = named_params
        self.weight_decay = weight_decay
        self.m = [torch.zeros_like(p) for _, p in named_params]  # first moment: running mean of gradients
        self.v = [torch.zeros_like(p) for _, p in named_params]  # second moment: running mean of squared gradients
        self.t = 0

    def decays(self, p: torch.Tensor) -> bool:
        return p.dim() >= 2

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.t += 1
        (b1, b2), t = BETAS, self.t
        for (_, p), m, v in zip(self.named_params, self.m, self.v):
            g = p.grad
            if self.decays(p):
                p.mul_(1 - lr * self.weight_decay)
            m.lerp_(g, 1 - b1)                          # m = b1·m + (1 − b1)·g
            v.mul_(b2).addcmul_(g, g, value=1 - b2)     # v = b2·v + (1 − b2)·g²
            denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(EPS)  # sqrt(v̂) + eps, v̂ = v / (1 − b2^t)
            p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))         # θ -= lr · m̂ / (sqrt(v̂) + eps)

    def nbytes(self) -> int:
        return sum(m.nbytes + v.nbytes for m, v in zip(self.m, self.v))


def lr_at(step: int, s: TrainSettings) -> float:
    """Learning rate of optimizer step `step` (0 = the first): linear warm-up to s.lr, then a cosine down to
    s.min_lr_ratio × s.lr at s.schedule_steps, flat after that."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    lowest = s.lr * s.min_lr_ratio
    progress = min(1.0, (step - s.warmup_steps) / max(1, s.schedule_steps - s.warmup_steps))
    return lowest + (s.lr - lowest) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_curve(s: TrainSettings, n_steps: int) -> list[float]:
    """The learning rate of optimizer steps 1..n_steps."""
    return [lr_at(i, s) for i in range(n_steps)]


# -- parameter groups for the views ---------------------------------------------------------------------------

def group_of(name: str) -> tuple[str, int | None]:
    """("embed"|"attention"|"mlp"|"norms"|"final_norm"|"lm_head", layer or None) of a parameter name."""
    parts = name.split(".")
    if parts[1] == "layers":
        kind = {"self_attn": "attention", "mlp": "mlp"}.get(parts[3], "norms")
        return kind, int(parts[2])
    return {"embed_tokens": "embed", "norm": "final_norm"}.get(parts[1], "lm_head"), None


# -- one step ---------------------------------------------------------------------------------------------------

@dataclass
class StepReport:
    step: int                          # optimizer steps done, this one included
    batch: Batch
    micro_batch: int                   # rows per micro-batch B; batch.rows holds k of them
    logits_shape: tuple[int, int, int]  # (B, T, vocab) of one micro-batch
    token_loss: np.ndarray             # (B·k, T) -log p(label), nan where the label is ignored
    prob_right: np.ndarray             # (B·k, T) p(label), nan where the label is ignored
    loss: float                        # mean over the real labels of all k micro-batches
    micro_losses: list[float]          # each micro-batch's mean loss
    micro_tokens: list[int]            # each micro-batch's count of real labels
    groups: list[tuple[str, int | None]]
    group_grad_norms: list[float]      # per group, before clipping
    grad_norm: float                   # global, before clipping
    grad_norm_clipped: float
    clip: float
    lr: float
    weight_decay: float
    update_ratios: list[float]         # per group ||Δθ|| / ||θ|| of this step
    ms: float                          # wall time of the whole step, device synchronised


@dataclass
class HistoryPoint:
    step: int
    loss: float
    grad_norm: float
    grad_norm_clipped: float
    lr: float
    ms: float


class Trainer:
    def __init__(self, settings: TrainSettings, device: str = "cpu", bound: Limits | None = None):
        """bound: the server's limits() unless given (the command line sets its own)."""
        self.settings, self.limits = settings, bound or limits()
        self.device = pick_device(device)
        if settings.model not in ("small", "micro"):
            raise InputError("train_model", model=settings.model, init=settings.init)
        folder = resolve_path(settings.model)
        config = LlamaConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
        settings.check(config.max_position_embeddings, self.limits)  # before any weight is made
        self.tokenizer = WordTokenizer.load(folder)
        self.module = self._initial_weights(folder, config).to(self.device).train()
        self.corpus = load_corpus(settings.model)
        self.named_params = list(self.module.named_parameters())  # the tied LM head appears once, as embed_tokens
        self.optimizer = AdamW(self.named_params, settings.weight_decay)
        self.groups = list(dict.fromkeys(group_of(n) for n, _ in self.named_params))
        self.group_params = [[p for n, p in self.named_params if group_of(n) == g] for g in self.groups]
        self.history: list[HistoryPoint] = []
        self.last: StepReport | None = None

    def _initial_weights(self, folder: Path, config: LlamaConfig) -> Llama:
        if self.settings.init == "bundled":
            return Llama.load(folder).requires_grad_(True)
        torch.manual_seed(self.settings.seed)
        return init_weights(Llama(config))

    @property
    def steps_done(self) -> int:
        return self.optimizer.t

    @property
    def identity(self) -> tuple[str, str, int]:
        return self.settings.identity

    @property
    def config(self) -> LlamaConfig:
        return self.module.config

    @property
    def ln_vocab(self) -> float:
        """The loss of a model that gives every token of the vocabulary the same probability 1/V."""
        return math.log(self.config.vocab_size)

    def update_settings(self, settings: TrainSettings) -> TrainSettings:
        """Hyper-parameters change from the next step on; model, init and seed need a new Trainer."""
        assert settings.identity == self.identity
        settings.check(self.config.max_position_embeddings, self.limits)
        self.settings = settings
        self.optimizer.weight_decay = settings.weight_decay
        return settings

    def batch(self, step: int) -> Batch:
        s = self.settings
        return sample_batch(self.corpus, s.batch_size * s.accum_steps, s.seq_len, self.config.pad_token_id,
                            s.seed, step)

    def forward_backward(self, batch: Batch, s: TrainSettings) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Gradients of the whole batch's mean loss, accumulated over k micro-batches. Each micro-batch's summed
        loss is divided by the count of real labels in the whole batch, so the k gradients add up to the
        big batch's gradient (a mean of k micro-batch means would weigh tokens unequally when padding differs).
        Returns the loss at each position (B·k, T), 0 where ignored, the labels, and each micro-batch's count of
        real labels."""
        inputs = torch.from_numpy(batch.inputs).to(self.device)
        labels = torch.from_numpy(batch.labels).to(self.device)
        n_real = int((labels != IGNORE).sum())
        losses, counts = [], []
        for part_inputs, part_labels in zip(inputs.split(s.batch_size), labels.split(s.batch_size)):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=s.bf16_autocast):
                logits = self.module(part_inputs, activation_checkpointing=s.activation_checkpointing).logits
            per_position = token_losses(logits, part_labels)                                    # (B, T)
            (per_position.sum() / n_real).backward()
            losses.append(per_position.detach())
            counts.append(int((part_labels != IGNORE).sum()))
        return torch.cat(losses), labels, counts

    def step(self) -> StepReport:
        s, index = self.settings, self.steps_done
        if index >= self.limits.max_steps:
            raise InputError("train_step_limit", steps=self.limits.max_steps)
        batch = self.batch(index)
        lr = lr_at(index, s)
        synchronize(self.device)
        t0 = time.perf_counter()
        self.module.zero_grad(set_to_none=True)
        try:
            per_position, labels, counts = self.forward_backward(batch, s)
        except torch.OutOfMemoryError:
            self.module.zero_grad(set_to_none=True)  # nothing was updated: the session keeps its step
            raise InputError("train_out_of_memory", device=str(self.device)) from None
        params = [p for _, p in self.named_params]
        group_norms = [float(global_norm([p.grad for p in ps])) for ps in self.group_params]
        loss = float(per_position.sum() / (labels != IGNORE).sum())
        if not math.isfinite(loss) or not all(map(math.isfinite, group_norms)):
            # an update from it would make every weight NaN: refuse the step, the weights stay as they were
            self.module.zero_grad(set_to_none=True)
            raise InputError("train_not_finite", step=index + 1, loss=loss, lr=f"{lr:.2e}")
        before, after = clip_gradients(params, s.clip)
        old = [p.detach().clone() for p in params]
        self.optimizer.step(lr)
        synchronize(self.device)
        ms = (time.perf_counter() - t0) * 1000
        with torch.no_grad():
            change = {id(p): p - o for p, o in zip(params, old)}
            ratios = [float(global_norm([change[id(p)] for p in ps]) / global_norm(ps)) for ps in self.group_params]
        real = (labels != IGNORE).cpu().numpy()
        loss_np = per_position.cpu().numpy()
        token_loss = np.where(real, loss_np, np.nan)
        micro_rows = [slice(i * s.batch_size, (i + 1) * s.batch_size) for i in range(s.accum_steps)]
        report = StepReport(
            step=self.steps_done, batch=batch, micro_batch=s.batch_size,
            logits_shape=(s.batch_size, s.seq_len, self.config.vocab_size),
            token_loss=token_loss, prob_right=np.exp(-token_loss), loss=loss,
            micro_losses=[float(loss_np[r].sum() / max(1, c)) for r, c in zip(micro_rows, counts)],
            micro_tokens=counts, groups=self.groups, group_grad_norms=group_norms, grad_norm=before,
            grad_norm_clipped=after, clip=s.clip, lr=lr, weight_decay=s.weight_decay,
            update_ratios=ratios, ms=ms)
        self.history.append(HistoryPoint(report.step, report.loss, before, after, lr, ms))
        self.last = report
        return report

    # -- 3E checkpoint, load weights --------------------------------------------------------------------------

    def save(self, folder: str | Path) -> list[tuple[str, int]]:
        """The Hugging Face Llama layout: config.json, model.safetensors, tokenizer.json; (file, bytes) each."""
        folder = Path(folder)
        self.module.save(folder)
        shutil.copyfile(resolve_path(self.settings.model) / "tokenizer.json", folder / "tokenizer.json")
        return [(p.name, p.stat().st_size) for p in sorted(folder.iterdir())]

    def weight_bytes(self) -> int:
        return sum(p.nbytes for _, p in self.named_params)


class CheckpointStore:
    """One session's saved checkpoints under its own temporary folder: at most `limit`, the oldest removed
    first; the folder is deleted when the store is garbage-collected (the session ended)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.root = Path(tempfile.mkdtemp(prefix="decode-lab-train-"))
        self.saved: dict[str, Path] = {}
        self.bases: dict[str, str] = {}  # name -> the bundled model it was trained from (its architecture)
        self.saves = 0
        weakref.finalize(self, shutil.rmtree, str(self.root), True)

    def save(self, trainer: Trainer, in_use: str | None = None) -> tuple[str, list[tuple[str, int]]]:
        """Save under a name no earlier save of this store had (a loaded checkpoint is always the one on disk);
        past the limit the oldest goes, except `in_use`, the one the session is running."""
        s = trainer.settings
        self.saves += 1
        name = f"ckpt{self.saves}-{s.model}-{s.init}-seed{s.seed}-step{trainer.steps_done}"
        folder = self.root / name
        files = trainer.save(folder)
        self.saved[name], self.bases[name] = folder, s.model
        evictable = [n for n in self.saved if n not in (name, in_use)]  # oldest first
        while len(self.saved) > self.limit and evictable:
            shutil.rmtree(self.saved.pop(evictable.pop(0)), ignore_errors=True)
        return name, files


# -- 4A mixed precision, 4B activation checkpointing: measured side by side ------------------------------------

@dataclass
class MemoryRun:
    bf16_autocast: bool
    activation_checkpointing: bool
    loss: float
    peak_bytes: int        # tensors alive at the peak of forward + backward, weights excluded
    activation_bytes: int  # of which activations (saved for backward, or recomputed)
    ms: float              # median of REPEATS timed runs, outside the memory tracker


MEMORY_VARIANTS = ((False, False), (True, False), (False, True))
REPEATS = 3


def measure_memory(trainer: Trainer) -> list[MemoryRun]:
    """Forward + backward of the next step's first micro-batch in float32, under bfloat16 autocast, and with
    activation checkpointing; no optimizer step, the gradients are dropped afterwards. Memory comes from PyTorch's
    MemTracker, a dispatch mode that follows every tensor the pass creates: the CPU allocator keeps no
    statistics of its own."""
    from torch.distributed._tools.mem_tracker import MemTracker

    one = replace(trainer.settings, accum_steps=1)  # one micro-batch: MemTracker follows one call per module
    batch = sample_batch(trainer.corpus, one.batch_size, one.seq_len, trainer.config.pad_token_id, one.seed,
                         trainer.steps_done)
    runs = []
    for bf16, ckpt in MEMORY_VARIANTS:
        s = replace(one, bf16_autocast=bf16, activation_checkpointing=ckpt)
        times = []
        for _ in range(REPEATS + 1):  # the first one warms up
            trainer.module.zero_grad(set_to_none=True)
            synchronize(trainer.device)
            t0 = time.perf_counter()
            per_position, labels, _ = trainer.forward_backward(batch, s)
            synchronize(trainer.device)
            times.append((time.perf_counter() - t0) * 1000)
        trainer.module.zero_grad(set_to_none=True)
        tracker = MemTracker()
        tracker.track_external(trainer.module)
        with tracker:
            trainer.forward_backward(batch, s)
        # keys: _MemRefType members (PARAM, BUFFER, GRAD, ACT, TEMP, ...) and "Total"
        peak = {str(k).rsplit(".", 1)[-1]: v for k, v in tracker.get_tracker_snapshot("peak")[trainer.device].items()}
        trainer.module.zero_grad(set_to_none=True)
        loss = float(per_position.sum() / (labels != IGNORE).sum())
        runs.append(MemoryRun(bf16, ckpt, loss, peak["Total"] - peak["PARAM"] - peak["BUFFER"], peak["ACT"],
                              float(np.median(times[1:]))))
    return runs
