"""A readable decoder-only Transformer in the Llama architecture, top to bottom in the order data flows.

RMSNorm -> grouped-query attention with RoPE -> RMSNorm -> SwiGLU MLP, no biases. Attention is written
out as softmax(Q·Kᵀ/√d_head + mask)·V so that the weights can be returned for the views.
Parameter names follow Hugging Face's LlamaForCausalLM, so the same config.json + model.safetensors
load in transformers and give the same logits. The model never holds a KV cache: the caller passes one.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.engine import kernels
from model.engine.cache import KVCache


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def window(self, layer: int) -> int | None:
        """No sliding window: every layer attends over the whole sequence."""
        return None

    def to_hf_dict(self) -> dict:
        hf = asdict(self)
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": hf.pop("rope_theta")}
        hf.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  attention_bias=False, mlp_bias=False, dtype="float32")
        return hf

    @classmethod
    def from_hf_dict(cls, hf: dict) -> LlamaConfig:
        rope = hf.get("rope_parameters") or {}
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in hf.items() if k in known}
        values["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        values.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
        values.setdefault("num_key_value_heads", hf["num_attention_heads"])
        return cls(**values)


@dataclass
class ForwardOutput:
    logits: torch.Tensor                    # (B, T, vocab), or (B, 1, vocab) with last_logits_only
    attentions: list[torch.Tensor] | None   # per layer (B, n_heads, T, S), S = cached + new positions
    # one layer's q (B, n_heads, T, d_head), k and v (B, n_kv, S, d_head)
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # the last block's output after the final norm, (B, T or 1, hidden): what the LM head reads (and a reward
    # model's scalar head, model/training/rlhf.py)
    hidden: torch.Tensor | None = None
    # per layer the residual stream after the block (B, T or 1, hidden), before the final norm (the logit lens)
    hidden_states: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class Probe:
    """What a forward pass keeps beside the logits for the lessons, and the lessons' changes to the pass."""
    attentions: bool = False            # every layer's attention weights
    qkv_layer: int | None = None        # this layer's q, k and v after RoPE
    hidden_states: bool = False         # the residual stream after each block (the logit lens)
    # layer -> query heads whose attention output is set to zero in that layer (switching heads off)
    heads_off: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # run only the first n blocks, then the final norm and the LM head (early exit: the model's own shallow part as
    # a cheap draft for speculative decoding); the cache then needs only n layers
    n_layers: int | None = None


class RMSNorm(nn.Module):
    """x / rms(x) · w. The shared inference model (pack_linears sets `fused`) normalises float32 rows in one op of the
    decode kernels (kernels.rms_norm), each row the same bits beside any others; every other model in torch's ops
    (eager)."""

    fused = False
    plus_one = False  # the kernel's gain is 1 + w (Gemma's), not w

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if self.fused and x.dtype == self.weight.dtype == torch.float32:
            return kernels.rms_norm(x, self.weight, self.eps, self.plus_one)
        return self.eager(x)

    def eager(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """(d_head/2,) the rotation speed of each pair of dimensions: θ^(−2i/d_head), float32 like transformers."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles at `positions` (…, n), (…, n, d_head) each, the sin's first half negated
    (what apply_rope multiplies the half-turned input by)."""
    angles = positions.float()[..., None] * inv_freq         # (…, n, d_head/2)
    angles = torch.cat((angles, angles), dim=-1)             # (…, n, d_head)
    half = inv_freq.shape[0]
    sign = torch.cat((-torch.ones(half), torch.ones(half))).to(angles.device)
    return angles.cos(), angles.sin() * sign


def over_heads(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """cos or sin (T, d_head) of one sequence as they are, (B, T, d_head) of per-row positions as (B, 1, T, d_head):
    broadcast over the heads of q and k (B, heads, T, d_head)."""
    return table.unsqueeze(-3) if positions.dim() == 2 else table


def rope_tables(n_positions: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, (n_positions, d_head) each."""
    return rope_cos_sin(torch.arange(n_positions), inverse_frequencies(head_dim, theta))


def apply_rope(x, cos, sin):
    """Each pair (i, i + d_head/2) of x turned by its angle: x·cos + rotate_half(x)·sin, rotate_half(x) = (−x₂, x₁)
    as transformers writes it. Here the halves swap places (roll) and sin's first half carries the minus sign
    (rope_cos_sin): (−a)·b = a·(−b) exactly, so the same bits in two ops fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


@dataclass(frozen=True)
class RowKeys:
    """The keys each row of a flattened pass reads (model/serving/paged.py): the rows lie side by side in one
    sequence, row r with queries[r] new positions from buffer index starts[r] of its own keys, which it reads from
    first[r] .. end[r] − 1 and nothing else (a prompt's chunk reads as many keys as its whole prompt's prefill, the
    later ones masked), exactly the keys its solo run attends over. Given in place of a mask, so that each row is
    attended over those keys alone: over a padded buffer with −∞ beyond a row's end, the products and the softmax run
    over a longer row of keys and round differently, and a row's logits would depend on how long the others are."""
    first: tuple[int, ...]
    end: tuple[int, ...]
    queries: tuple[int, ...]
    starts: tuple[int, ...]
    window: int | None = None  # of the pass's sliding layers, for their masks

    def last_queries(self) -> list[int]:
        """Where each row's last query lies in a flattened pass."""
        return list(itertools.accumulate(self.queries, initial=-1))[1:]


@dataclass(frozen=True)
class BlockKeys:
    """One layer's keys and values of a flattened pass read in place through the requests' block tables
    (model/serving/paged.py, on the decode kernels: float32 on a CPU): what the pass's append gives for k and v in
    place of a copy per row. Query t of the pass reads positions first[t] .. end[t] − 1 of its request, row[t] of
    `tables` (block ids by position // block_size): exactly the keys its solo run's pass reads."""
    keys: torch.Tensor      # (n_kv, n_blocks, block_size, d_head): the layer's store
    values: torch.Tensor
    tables: torch.Tensor    # (requests, width) int64
    row: torch.Tensor       # (N,) int64
    first: torch.Tensor     # (N,) int64
    end: torch.Tensor       # (N,) int64


def attend(q, k, v, keys: torch.Tensor | RowKeys | None, scale: float, fused: bool = False):
    """softmax(Q·Kᵀ / scale + mask)·V, written out so that the weights exist to show.
    q (B, n_heads, T, d_head), k and v (B, n_kv, S, d_head) -> out (B, T, n_heads·d_head), weights (B, n_heads, T, S).
    keys: which keys each query sees: the additive mask (T, S) of one sequence (None: every key), or RowKeys.
    GQA: query head h reads KV head h // groups. The queries of a group's heads are stacked as the rows of one
    matrix per KV head, so each KV head's K and V are read once, as they lie in the cache (a view of its buffer):
    a matmul that broadcast K over the groups would copy it first.
    fused (the shared inference model, pack_linears): float32 attention runs in the decode kernels, each query over
    exactly the keys it sees, in the kernels' own order of sums (kernels.attend_one for one query per row over every
    key, kernels.attend_spans for a causal or sliding mask): a position then has the same bits in a prefill, a chunk
    of it, a decode step, beside any other rows, on any CPU, which torch's product (MKL's blocking, chosen per CPU
    and per shape) does not give."""
    if isinstance(keys, RowKeys):
        return attend_flat(q, k, v, keys, scale, fused)
    if fused and q.dtype == k.dtype == v.dtype == torch.float32 and q.stride(-1) == 1:
        if k.stride(-1) != 1 or k.stride() != v.stride():
            k, v = k.contiguous(), v.contiguous()
        if keys is None and q.shape[2] == 1:
            return kernels.attend_one(q, k, v, scale)
        spans = visible_spans(keys, q.shape[2], k.shape[2])
        if spans is not None:
            return kernels.attend_spans(q, k, v, *spans, scale)
    B, n_heads, T, d_head = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    groups = n_heads // n_kv
    q_grouped = q.reshape(B, n_kv, groups * T, d_head)                         # (B, n_kv, groups·T, d_head)
    scores = q_grouped @ k.transpose(-2, -1) / scale                           # (B, n_kv, groups·T, S)
    scores = scores.view(B, n_heads, T, S)                                     # (B, n_heads, T, S)
    if keys is not None:
        scores = scores + keys
    weights = F.softmax(scores.float(), dim=-1).to(q.dtype)                   # (B, n_heads, T, S)
    out = weights.reshape(B, n_kv, groups * T, S) @ v                         # (B, n_kv, groups·T, d_head)
    return out.view(B, n_heads, T, d_head).transpose(1, 2).reshape(B, T, -1), weights  # (B, T, n_heads·d_head)


def visible_spans(mask: torch.Tensor | None, T: int, S: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per query, the first key it sees and the one after its last, (T,) int64 each, from an additive mask (T, S) of
    0 and −∞ whose seen keys are one run per query (a causal or sliding-window mask; None: every key); None for any
    other mask."""
    if mask is None:
        return torch.zeros(T, dtype=torch.int64), torch.full((T,), S, dtype=torch.int64)
    if mask.shape != (T, S) or mask.device.type != "cpu":
        return None
    seen = mask == 0
    first = seen.to(torch.int8).argmax(-1)
    end = S - seen.flip(-1).to(torch.int8).argmax(-1)
    if not bool((seen | (mask == float("-inf"))).all()) or not bool((seen.sum(-1) == end - first).all()):
        return None
    return first.contiguous(), end.contiguous()


def attend_flat(q, k, v, rows: RowKeys, scale: float, fused: bool = False):
    """attend for a flattened pass (RowKeys.queries): q (1, n_heads, N, d_head), N = Σ queries, and per row its own
    keys and values k[r], v[r] (1, n_kv, S_r, d_head), of which it reads first[r] .. end[r] − 1, exactly those its
    solo run's pass reads, masked as there: a prompt's chunk as rows of its prompt's one prefill, a decode over its
    keys alone. -> out (1, N, n_heads·d_head), no weights (no view draws such a pass). With k a BlockKeys (the pass
    on the decode kernels) every row's queries in one op over the keys where they lie (kernels.attend_paged), each
    query over the span its row's mask would leave it, as attend_one and attend_spans attend them: the same bits, no
    copy of a row's keys and no Python call per row."""
    if isinstance(k, BlockKeys):  # a bfloat16 model with tile products attends its float32 pool in float32
        dtype = q.dtype
        q = q.float() if dtype != torch.float32 else q if q.stride(-1) == 1 else q.contiguous()
        return kernels.attend_paged(q, k.keys, k.values, k.tables, k.row, k.first, k.end, scale).to(dtype), None
    out = q.new_empty(1, q.shape[2], q.shape[1] * q.shape[3])
    at = 0
    for n, start, first, end, k_row, v_row in zip(rows.queries, rows.starts, rows.first, rows.end, k, v):
        mask = causal_mask(n, start, q.device, q.dtype, rows.window, first, end)
        out[:, at:at + n] = attend(q[:, :, at:at + n], k_row[:, :, first:end], v_row[:, :, first:end], mask,
                                   scale, fused)[0]
        at += n
    return out, None


# From how many rows a product is faster in bfloat16 on oneDNN's AMX tiles than in the kernels (llama.on_tiles),
# per the inputs' dtype: SmolLM2's product shapes at one thread on a Xeon with AMX, torch's bfloat16 product against
# the kernels' time. bfloat16 weights: 1.6–3.7× at 1 row, 0.88–1.02× at 8, 0.49–0.60× at 16, 0.28–0.36× at 32
# (1,112 GFLOP/s at 1,024 rows, the kernels 106). float32 weights, the inputs rounded to bfloat16 first: 0.88–1.0× at
# 8 rows, 0.75–1.35× at 16 (the kernels read the float32 weights once for up to 16 rows), 0.37–0.48× at 64 rows;
# and at fewer than 64 a Llama layer also loses the decode kernels' two calls (Block.forward_ops instead).
TILE_ROWS = {torch.bfloat16: 8, torch.float32: 64}


class PackedWeight:
    """The weights of one product in the decode kernels' layout (model/engine/kernels.py): one Linear's matrix, or
    several stacked along the outputs (q, k and v; gate and up) so that one product reads them all, in float32,
    bfloat16 or int8 (a scale per output); a view into the model's arena. The shared model holds its linears' weights
    only here (pack_linears): a dense matrix is made from it when something needs one (dense_weight)."""

    # with_tile_products: the stacked matrix dense, (sum of outputs, inputs) bfloat16, which products of TILE_ROWS
    # rows or more multiply on torch's own product (oneDNN, on AMX tiles where the CPU has them)
    tiles: torch.Tensor | None = None

    def __init__(self, weights: list[torch.Tensor], dtype: torch.dtype, arena: kernels.Arena):
        stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
        self.outputs = tuple(w.shape[0] for w in weights)      # each stacked matrix's outputs, in order
        self.inputs, self.dtype = stacked.shape[1], dtype
        self.matrix = kernels.pack(stacked, dtype, arena)
        self.padded = self.matrix.shape.blocks * kernels.LANES != stacked.shape[0]  # outputs filled up to a block

    @staticmethod
    def nbytes_of(weights: list[torch.Tensor], dtype: torch.dtype) -> int:
        return kernels.packed_nbytes(sum(w.shape[0] for w in weights), weights[0].shape[1], dtype)

    @property
    def nbytes(self) -> int:
        """What the process holds for these weights (int8's scales and weight sums included)."""
        return self.matrix.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (…, inputs) -> (…, sum of outputs), the stacked matrices' outputs side by side."""
        if self.tiles is not None and x.numel() >= TILE_ROWS[x.dtype] * self.inputs:  # on_tiles
            started = time.perf_counter()
            y = F.linear(x.to(self.tiles.dtype), self.tiles).to(x.dtype)
            kernels.add_tile_seconds(time.perf_counter() - started)  # the products' share of a pass's time
            return y
        y = kernels.matmul(x.contiguous(), self.matrix)  # (…, outputs filled up to a block)
        return y[..., :sum(self.outputs)] if self.padded else y

    def dense(self, member: int = 0) -> torch.Tensor:
        """The member-th stacked matrix as a dense (outputs, inputs) tensor of its own (int8: its values q · s)."""
        start = sum(self.outputs[:member])
        return kernels.unpack(self.matrix, start, start + self.outputs[member])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the first matrix (…, inputs): a tied embedding's lookup in its LM head's weights."""
        return kernels.gather_rows(self.matrix, ids)

    def __deepcopy__(self, memo):
        raise TypeError("a model whose weights are packed is copied with llama.dense_copy")


class Linear(nn.Linear):
    """A bias-free nn.Linear: every projection and the LM head. The shared inference model on a CPU holds its weight
    packed for the decode kernels (pack_linears), alone or stacked with its siblings' (member: its place there), its
    own weight then a stand-in on the meta device (a shape, no memory). A packed row comes out with the same bits
    however many rows are multiplied beside it (1 in a solo decode, 8 in a batched one, N in a prefill), which
    torch's default product on a CPU (MKL's sgemm) does not give, and the rows of a batched decode share one read
    of the weights (docs/serving.md)."""

    packed: PackedWeight | None = None
    member: int = 0

    def __init__(self, d_in: int, d_out: int):
        super().__init__(d_in, d_out, bias=False)

    def forward(self, x):
        if self.packed is None:
            return F.linear(x, self.weight)
        if len(self.packed.outputs) == 1:
            return self.packed(x)
        start = sum(self.packed.outputs[:self.member])
        return self.packed(x)[..., start:start + self.out_features]

    def dense_weight(self) -> torch.Tensor:
        """The weight as a dense (out, in) tensor: the module's own, or made from the packed one."""
        return self.packed.dense(self.member) if self.packed is not None else self.weight


class Embedding(nn.Embedding):
    """nn.Embedding whose table may be its tied LM head's packed weights (pack_linears): a lookup reads the rows there,
    so the process holds the matrix once."""

    packed: PackedWeight | None = None

    def reset_parameters(self):
        # on the meta device (the loader's shapes) there is nothing to draw, and torch's meta normal_ imports sympy
        # (66 MiB resident) the first time
        if self.weight.device.type != "meta":
            super().reset_parameters()

    def forward(self, ids):  # bfloat16 rows widened for a model whose activations are float32 (the stand-in's dtype)
        return self.packed.rows(ids).to(self.weight.dtype) if self.packed is not None else super().forward(ids)


def stacked_linears(model: nn.Module) -> list[list[tuple[str, Linear]]]:
    """The model's linears as the products that read them: q, k and v in one, gate and up in one, every other
    Linear alone (fewer, larger products: one call and one pass of the input instead of three or two); in the order
    a forward reads them (block by block: q/k/v, o, gate/up, down; the LM head last), which is the order pack_linears
    lays them out in memory (a step then reads its weights front to back: about 3 % faster here than jumping between
    the attention and the MLP halves)."""
    named = {module: name for name, module in model.named_modules()}
    position = {id(module): i for i, module in enumerate(model.modules())}
    groups = []
    for module in model.modules():
        if isinstance(module, Attention):
            groups.append([module.q_proj, module.k_proj, module.v_proj])
        elif isinstance(module, MLP):
            groups.append([module.gate_proj, module.up_proj])
    grouped = {id(linear) for group in groups for linear in group}
    groups += [[m] for m in model.modules() if isinstance(m, Linear) and id(m) not in grouped]
    groups.sort(key=lambda group: position[id(group[0])])
    return [[(named[linear], linear) for linear in group] for group in groups]


def can_pack(model: nn.Module) -> bool:
    """Whether the decode kernels can hold this model's linears: on a CPU, where the kernels build."""
    return (all(t.device.type in ("cpu", "meta") for t in (*model.parameters(), *model.buffers()))
            and kernels.unavailable_reason() is None)


def pack_linears(model: nn.Module, dtype: torch.dtype = torch.float32,
                 weight_of: Callable[[str], torch.Tensor] | None = None,
                 activations: torch.dtype | None = None) -> bool:
    """Give every Linear of a model that will never change again (a shared inference model) its weights packed in
    `dtype` for the decode kernels, in one arena, and drop its own dense weight for a stand-in on the meta device; a
    tied embedding then looks its rows up in the LM head's packed weights. weight_of(name) gives the dense float32
    weight of the Linear called `name` (default: its own): the loader reads them from the file one by one, lowbit from
    the shared model's packed ones. `activations`: what the products take and give (default: bfloat16 for bfloat16
    weights, else float32; float32 with bfloat16 weights: lowbit's "bfloat16-weights"). False (nothing changed) where
    the kernels cannot run: off a CPU, or where they do not build (the model then multiplies with torch's own
    product)."""
    if not can_pack(model):
        return False
    weight_of = weight_of or (lambda name: model.get_submodule(name).weight.detach())
    groups = stacked_linears(model)
    shapes = [[torch.empty((m.out_features, m.in_features), device="meta") for _, m in group] for group in groups]
    arena = kernels.Arena(sum(PackedWeight.nbytes_of(s, dtype) for s in shapes))
    for group in groups:
        packed = PackedWeight([weight_of(name).float() for name, _ in group], dtype, arena)
        for member, (_, linear) in enumerate(group):
            linear.packed, linear.member = packed, member
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    activations = activations or (torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    for _, linear in (pair for group in groups for pair in group):  # the stand-in's dtype: the activations'
        linear.weight = nn.Parameter(torch.empty(linear.weight.shape, dtype=activations, device="meta"),
                                     requires_grad=False)
    if tied:
        model.model.embed_tokens.weight = model.lm_head.weight
        model.model.embed_tokens.packed = model.lm_head.packed
    for module in model.modules():
        if isinstance(module, RMSNorm | Attention | MLP):
            module.fused = True
        if isinstance(module, Block):
            module.decode_layer = module.decode_weights()
    return True


def is_packed(model: nn.Module) -> bool:
    """Whether every Linear of the model multiplies with packed weights (pack_linears took; a model on a GPU, or
    where the kernels do not build, does not)."""
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    return bool(linears) and all(module.packed is not None for module in linears)


def with_tile_products(model: nn.Module) -> nn.Module:
    """A copy of a packed model (float32 or bfloat16) whose products of TILE_ROWS rows or more take their inputs in
    bfloat16 and multiply on torch's product (oneDNN: AMX tiles on a CPU that has them, ~10× the kernels at a
    prefill's rows), fewer rows staying in the kernels; a Llama layer of that many rows then runs torch's ops, not the
    decode kernels' two calls. A row's numbers depend on how many rows share its product, so a request's logits are
    its solo run's within bfloat16 rounding, no longer bit for bit. The copy shares the packed weights (nothing of
    them copied) and holds a dense bfloat16 copy beside them; the model given is not changed."""
    weights = packed_weights(model)
    memo = {id(weight.matrix): weight.matrix for weight in weights}
    memo.update({id(weight): copy.copy(weight) for weight in weights})  # its own object, the same matrix
    copied = copy.deepcopy(model, memo)
    for weight in weights:
        memo[id(weight)].tiles = kernels.unpack(weight.matrix, 0, sum(weight.outputs)).to(torch.bfloat16)
    for block in (m for m in copied.modules() if isinstance(m, Block)):  # a decode step's few rows stay in its layers
        block.decode_layer = block.decode_weights()
    return copied


def on_tiles(linear: Linear, x: torch.Tensor) -> bool:
    """Whether x's rows (…, inputs) multiply on the tiles in this Linear's product."""
    packed = linear.packed
    return packed is not None and packed.tiles is not None and x.numel() >= TILE_ROWS[x.dtype] * packed.inputs


def has_tile_products(model: nn.Module) -> bool:
    return any(weight.tiles is not None for weight in packed_weights(model))


def packed_weights(model: nn.Module) -> list[PackedWeight]:
    """The model's packed products, each once."""
    return list({id(m.packed): m.packed for m in model.modules() if isinstance(m, Linear) and m.packed}.values())


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict with every packed weight made dense from its packed form (a tied embedding from its LM
    head's): what save writes."""
    tensors = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.packed is not None:
            tensors[f"{name}.weight"] = module.dense_weight()
    if model.lm_head.packed is not None and model.lm_head.weight is model.model.embed_tokens.weight:
        tensors["model.embed_tokens.weight"] = tensors["lm_head.weight"]
    return tensors


def dense_copy(model: nn.Module) -> nn.Module:
    """A copy of the model with dense weights of its own, never packed (a benchmark's torch products; lowbit's
    bfloat16 copy where the kernels do not run): the packed weights are not copied but made dense, matrix by
    matrix."""
    memo = {id(p): None for p in packed_weights(model)}
    copied = copy.deepcopy(model, memo)
    for name, module in copied.named_modules():
        if isinstance(module, Linear | Embedding):
            module.packed = None
            if isinstance(module, Linear) and model.get_submodule(name).packed is not None:
                module.weight = nn.Parameter(model.get_submodule(name).dense_weight(), requires_grad=False)
        if isinstance(module, RMSNorm | Attention | MLP):
            module.fused = False
    if model.lm_head.weight is model.model.embed_tokens.weight:
        copied.model.embed_tokens.weight = copied.lm_head.weight
    return copied


def switch_heads_off(out: torch.Tensor, heads: tuple[int, ...], head_dim: int) -> torch.Tensor:
    """out (B, T, n_heads·d_head), the heads' outputs side by side, with the given heads' parts set to zero: what
    the layer's output projection would get if those heads said nothing. No heads: out itself, untouched."""
    if not heads:
        return out
    B, T, _ = out.shape
    per_head = out.view(B, T, -1, head_dim).clone()  # (B, T, n_heads, d_head)
    per_head[:, :, list(heads)] = 0
    return per_head.view(B, T, -1)


class Attention(nn.Module):
    fused = False  # attend in the decode kernels where it can (pack_linears)

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = math.sqrt(self.head_dim)
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size)

    def project(self, x):
        """The heads of q and k side by side, (B, n_heads + n_kv, T, d_head) (one RoPE turns them all), and v (B, n_kv,
        T, d_head)."""
        B, T, _ = x.shape
        packed = getattr(self.q_proj, "packed", None)  # (a trainer's LoRA layer has none)
        if packed is not None and packed is self.k_proj.packed is self.v_proj.packed:  # one product (pack_linears)
            heads = packed(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_heads + 2·n_kv, T, d_head)
            return heads.split((self.n_heads + self.n_kv_heads, self.n_kv_heads), dim=1)
        qk = torch.cat((self.q_proj(x), self.k_proj(x)), dim=-1)
        return (qk.view(B, T, -1, self.head_dim).transpose(1, 2),
                self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2))

    def forward(self, x, cos, sin, keys, cache: KVCache | None, layer: int, heads_off: tuple[int, ...] = ()):
        """keys: what attend() takes, built once per layer kind by the model's forward."""
        qk, v = self.project(x)
        q, k = apply_rope(qk, cos, sin).split((self.n_heads, self.n_kv_heads), dim=1)
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (B, n_kv, S, d_head): from the first key the queries see
        out, weights = attend(q, k, v, keys, self.scale, self.fused)
        return self.o_proj(switch_heads_off(out, heads_off, self.head_dim)), weights, (q, k, v)


class MLP(nn.Module):
    """The gated MLP down(act(gate(x)) * up(x)): SwiGLU with SiLU here, GeGLU with tanh-GELU in Gemma 3. The shared
    inference model (pack_linears sets `fused`) takes SiLU · up of float32 rows in one op of the decode kernels
    (kernels.silu_mul), each number the same bits wherever it lies, so a decode step's layer in the kernels
    (Block.decode) gives the bits of these ops."""

    fused = False

    def __init__(self, cfg, activation=F.silu):
        super().__init__()
        self.activation = activation
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        packed = getattr(self.gate_proj, "packed", None)  # (a trainer's LoRA layer has none)
        if packed is not None and packed is self.up_proj.packed:  # one product (pack_linears)
            gate_up = packed(x)
            if self.fused and self.activation is F.silu and gate_up.dtype == torch.float32:
                return self.down_proj(kernels.silu_mul(gate_up, packed.outputs[0]))
            gate, up = gate_up.split(packed.outputs, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.activation(gate) * up)


class Block(nn.Module):
    # the block's weights as the decode kernels' decode_in and decode_out read them (pack_linears, where every product
    # is float32 or int8 and fills its blocks): a decode step's layer then runs as Block.decode
    decode_layer: kernels.DecodeLayer | None = None

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, keys, cache, layer, heads_off=()):
        if self.decode_layer is not None and on_tiles(self.self_attn.o_proj, x):  # torch's ops, products on tiles
            return self.forward_ops(x, cos, sin, keys, cache, layer, heads_off)
        if (self.decode_layer is not None and x.shape[1] == 1 and x.dtype == torch.float32 and cache is not None
                and not heads_off and keys is None):
            return self.decode(x, cos, sin, cache, layer)
        if (self.decode_layer is not None and getattr(cache, "reads_in_place", False) and x.dtype == torch.float32
                and not heads_off):
            return self.pass_in_place(x, cos, sin, cache, layer)
        return self.forward_ops(x, cos, sin, keys, cache, layer, heads_off)

    def forward_ops(self, x, cos, sin, keys, cache, layer, heads_off=()):
        attn_out, weights, qkv = self.self_attn(self.input_layernorm(x), cos, sin, keys, cache, layer, heads_off)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, weights, qkv

    def decode(self, x, cos, sin, cache, layer):
        """forward for one new position per row, in two calls of the decode kernels where forward makes some twenty
        torch ops: the same functions in the same order (kernels.cpp, decode_in and decode_out), so the same bits
        (tests/test_engine.py); what it saves is timed in docs/benchmarks.md."""
        attn, x = self.self_attn, x.contiguous()
        qkv = kernels.decode_in(self.decode_layer, x, cos, sin)                  # (B, 1, n_heads + 2·n_kv, d_head)
        q, k, v = qkv.transpose(1, 2).split((attn.n_heads, attn.n_kv_heads, attn.n_kv_heads), dim=1)
        k, v = cache.append(layer, k, v)                                          # (B, n_kv, S, d_head)
        first, end = every_key(x.shape[0], k.shape[2])
        out, weights = kernels.decode_out(self.decode_layer, x, qkv, k, v, first, end)
        return out, weights, (q, k, v)

    def pass_in_place(self, x, cos, sin, cache, layer):
        """forward for a flattened pass over a paged pool whose keys are read in place (paged.PagedPassInPlace), in
        one call of the decode kernels (kernels.layer_paged): the pass's N positions as decode_in's rows, their keys
        and values written into their blocks, then decode_out's rest of the layer after attend_paged's attention; the
        ops Block.decode runs, so the bits of forward's."""
        N = x.shape[1]
        read, blocks, offsets = cache.in_place(layer)
        out = kernels.layer_paged(self.decode_layer, x.contiguous().view(N, 1, -1), cos, sin, read.keys, read.values,
                                  blocks, offsets, read.tables, read.row, read.first, read.end)
        return out.view(1, N, -1), None, None

    def decode_weights(self) -> kernels.DecodeLayer | None:
        """decode_layer for this block's packed weights, None where its activations are bfloat16 (the kernels' layers
        run in float32), a product leaves a block part empty (the kernels add the residual and read the heads block
        by block), or the MLP's activation is not SiLU."""
        attn, mlp = self.self_attn, self.mlp
        products = (attn.q_proj.packed, attn.o_proj.packed, mlp.gate_proj.packed, mlp.down_proj.packed)
        stacked = (attn.q_proj.packed is attn.k_proj.packed is attn.v_proj.packed
                   and mlp.gate_proj.packed is mlp.up_proj.packed)
        if (not stacked or mlp.activation is not F.silu or attn.q_proj.weight.dtype != torch.float32  # the activations'
                or any(p is None or p.padded for p in products)):
            return None
        qkv, o, gate_up, down = products
        norm_in, norm_out = self.input_layernorm, self.post_attention_layernorm
        return kernels.DecodeLayer(norm_in.weight, norm_out.weight, norm_in.plus_one, norm_in.eps, qkv.matrix,
                                   o.matrix, gate_up.matrix, down.matrix, attn.n_heads, attn.n_kv_heads,
                                   attn.head_dim, attn.scale)


@functools.lru_cache(maxsize=64)
def every_key(rows: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffer indices each row's query reads, first[r] .. end[r] − 1, as two int64 tensors: every one of the S
    keys. Made once per shape (a step's layers share them)."""
    return torch.zeros(rows, dtype=torch.int64), torch.full((rows,), S, dtype=torch.int64)


def causal_mask(n_new: int, n_past: int, device, dtype, window: int | None = None,
                first_key: int = 0, end: int | None = None) -> torch.Tensor | None:
    """(n_new, end − first_key) additive mask over the keys at positions first_key .. end − 1 (by default up to the
    last new one, n_past + n_new − 1): new position i sees the keys at positions ≤ i; with a sliding window only the
    `window` latest (its own included). None where every query sees every key (one new query over a full cache)."""
    total = n_past + n_new
    if n_new == 1 and window is None and end in (None, total):
        return None
    queries = torch.arange(n_past, total, device=device)[:, None]  # (n_new, 1)
    keys = torch.arange(first_key, total if end is None else end, device=device)[None, :]  # (1, keys)
    allowed = keys <= queries
    if window is not None:
        allowed &= keys > queries - window
    if bool(allowed.all()):
        return None
    return torch.zeros(allowed.shape, device=device, dtype=dtype).masked_fill(~allowed, float("-inf"))


class DecoderOnly(nn.Module):
    """What Llama and Gemma 3 share: embedding -> blocks -> final norm -> LM head, one forward for every caller
    (a prefill, a decode step, a batched decode step, a speculative verify, a training step), the cache's layer kinds
    and the Hugging Face checkpoint layout. A model says how it embeds (embed), how it turns positions (rope) and
    which blocks and norm it has."""

    architecture: str        # the config's model_type
    config_class: type
    block_class: type        # built as block_class(cfg)
    norm_class: type         # built as norm_class(hidden_size, rms_norm_eps)

    def __init__(self, cfg):
        super().__init__()
        assert cfg.num_attention_heads % cfg.num_key_value_heads == 0, "n_heads must be a multiple of n_kv_heads"
        self.config = cfg
        self.model = nn.ModuleDict(dict(
            embed_tokens=Embedding(cfg.vocab_size, cfg.hidden_size),
            layers=nn.ModuleList(self.block_class(cfg) for _ in range(cfg.num_hidden_layers)),
            norm=self.norm_class(cfg.hidden_size, cfg.rms_norm_eps),
        ))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if self.device.type != "meta":  # a model of shapes only gets them where its weights land (the loader)
            for name, value in self.computed_buffers().items():
                self.register_buffer(name, value, persistent=False)

    def computed_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers made from the config alone, not saved (checkpoints hold only the weights)."""
        return {}

    @property
    def device(self) -> torch.device:
        """Where the model runs (its final norm's weight is always a tensor of its own, never packed)."""
        return self.model.norm.weight.device

    @property
    def windows(self) -> list[int | None]:
        """Per layer, the sliding window its queries see (None: the whole sequence): the layer kinds."""
        return [self.config.window(i) for i in range(self.config.num_hidden_layers)]

    def new_cache(self, n_layers: int | None = None) -> KVCache:
        """A cache for the first n_layers blocks (all of them by default), each layer of its own kind."""
        return KVCache(n_layers or self.config.num_hidden_layers, self.windows[:n_layers])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)                      # (B, T, hidden)

    def rope(self, positions: torch.Tensor, dtype) -> dict[int | None, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer kind (window), cos and sin at `positions`, shaped for q and k (over_heads)."""
        raise NotImplementedError

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, positions: torch.Tensor | None = None,
                keys: dict[int | None, RowKeys] | None = None, probe: Probe | None = None,
                last_logits_only: bool = False, activation_checkpointing: bool = False,
                after_layer: Callable[[int], None] | None = None) -> ForwardOutput:
        """ids (B, T) at `positions`, appended to `cache` (None: no cache, nothing kept).
        One sequence: positions (T,), by default the T positions after what the cache holds; each layer kind's
        causal mask is built once (a sliding kind from the first key its cache layer still holds).
        A flattened pass over a paged cache (model/serving/paged.py): ids (1, N) and positions (N,) of rows of
        different lengths side by side, and `keys`, per layer kind, RowKeys with each row's query count and the keys
        it reads, in place of the mask; the cache gives each row its own keys.
        last_logits_only: the LM head runs on the last position alone (inference needs no other), which saves T − 1
        rows of vocab-sized logits; in a flattened pass on each row's last. activation_checkpointing (training, no
        cache): each block's inner activations are not kept for backward but recomputed there, block by block; the
        outputs are the same.
        probe: what to keep for the lessons (attention weights, one layer's q, k, v, the residual stream) and the
        lessons' changes (heads switched off, only the first n blocks).
        after_layer: called with each block's index once it has run: a caller may stop a long pass there by raising
        (the Serving page's Stop); the cache then holds the new positions in some layers only, and is to be dropped."""
        probe = probe or Probe()
        T = ids.shape[1]
        if positions is None:
            n_past = cache.length if cache is not None else 0
            positions = torch.arange(n_past, n_past + T, device=ids.device)
        x = self.embed(ids)                                      # (B, T, hidden)
        rope = self.rope(positions, x.dtype)                     # per layer kind: (T or B×1×T, d_head) each
        # (a ModuleList's slice is a new ModuleList, built module by module: a few µs a layer at every step)
        blocks = self.model.layers if probe.n_layers is None else self.model.layers[:probe.n_layers]
        windows = self.windows[:len(blocks)]
        first_key = dict.fromkeys(windows, 0)  # per layer kind, the position of the first key its queries see
        if keys is None:
            n_past = int(positions[0])
            if cache is not None:
                first_key = {window: cache.first_seen(windows.index(window), n_past) for window in first_key}
            keys = {window: causal_mask(T, n_past, ids.device, x.dtype, window, first)
                    for window, first in first_key.items()}
        attentions, qkv = [] if probe.attentions else None, None
        hidden_states = [] if probe.hidden_states else None
        for i, block in enumerate(blocks):
            window = windows[i]
            cos, sin = rope[window]
            inputs = (x, cos, sin, keys[window], cache, i, probe.heads_off.get(i, ()))
            if activation_checkpointing:
                x, weights, layer_qkv = checkpoint(block, *inputs, use_reentrant=False)
            else:
                x, weights, layer_qkv = block(*inputs)
            if probe.attentions:  # the views index keys by position: those before a window get weight 0
                attentions.append(F.pad(weights, (first_key[window], 0)) if first_key[window] else weights)
            if i == probe.qkv_layer:
                qkv = layer_qkv
            if probe.hidden_states:
                hidden_states.append(x[:, -1:] if last_logits_only else x)
            if after_layer is not None:
                after_layer(i)
        if last_logits_only:
            flat = next((k for k in keys.values() if isinstance(k, RowKeys)), None)
            x = x[:, -1:] if flat is None else x[:, flat.last_queries()]
        hidden = self.model.norm(x)                              # (B, T or 1, hidden)
        logits = self.lm_head(hidden)                            # (B, T or 1, vocab)
        return ForwardOutput(logits, attentions, qkv, hidden, hidden_states)

    # -- Hugging Face checkpoint layout: config.json + model.safetensors --------------------------------

    def save(self, folder: str | Path) -> None:
        save_weights(self, Path(folder))

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu", dtype=torch.float32):
        folder = Path(folder)
        cfg = cls.config_class.from_hf_dict(json.loads((folder / "config.json").read_text()))
        return load_weights(cls(cfg), folder, device, dtype)


class Llama(DecoderOnly):
    architecture = "llama"
    config_class, block_class, norm_class = LlamaConfig, Block, RMSNorm

    def computed_buffers(self) -> dict[str, torch.Tensor]:
        """RoPE's cos and sin of every position, computed once."""
        cos, sin = rope_tables(self.config.max_position_embeddings, self.config.head_dim, self.config.rope_theta)
        return {"rope_cos": cos, "rope_sin": sin}

    def rope(self, positions, dtype):
        """Every layer turns alike: the precomputed tables' rows at `positions`."""
        return {None: tuple(over_heads(table[positions].to(dtype), positions)
                            for table in (self.rope_cos, self.rope_sin))}


def save_weights(model: nn.Module, folder: Path) -> None:
    """config.json (the config's to_hf_dict) + model.safetensors, a tied LM head left out as transformers saves it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in dense_state_dict(model).items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def load_weights(model: nn.Module, folder: Path, device, dtype) -> nn.Module:
    """model.safetensors into a model built from its config (a tied LM head is not in the file), ready to run."""
    tensors = load_file(folder / "model.safetensors")
    model.load_state_dict(tensors, strict=not model.config.tie_word_embeddings)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
