"""Gemma 3 (text), a second readable architecture beside the Llama of llama.py, top to bottom in data-flow order.

What differs from Llama, in the order data meets it:
- the token embeddings are multiplied by √hidden_size;
- RMSNorm scales by (1 + w), and every block normalises four times: before and after attention, before and after
  the MLP (the residual adds the normalised output);
- q and k are RMS-normalised per head before RoPE; the scores are divided by √query_pre_attn_scalar;
- the MLP is GeGLU: down(gelu_tanh(gate(x)) * up(x));
- two kinds of layers, five sliding-window layers then one full-attention layer: a sliding layer's query sees only
  the `sliding_window` latest positions (its own included) and rotates with RoPE base 10,000, a full layer sees
  every position and rotates with base 1,000,000. The caller's KVCache keeps only the window on sliding layers.
Shared with llama.py: RoPE, the written-out attention, the causal mask, the forward's output and the loading.
Parameter names follow Hugging Face's Gemma3ForCausalLM, which loads the same folder and gives the same logits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from model.engine.cache import KVCache
from model.engine.llama import (
    MLP,
    ForwardOutput,
    Linear,
    RowKeys,
    apply_rope,
    attend,
    causal_mask,
    inverse_frequencies,
    load_weights,
    rope_cos_sin,
    save_weights,
    switch_heads_off,
)

SLIDING, FULL = "sliding_attention", "full_attention"


def gelu_tanh(x):
    """GELU with its tanh approximation, as Gemma 3 (hidden_activation gelu_pytorch_tanh)."""
    return F.gelu(x, approximate="tanh")


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: tuple[str, ...]   # per layer, "sliding_attention" or "full_attention"
    rope_theta: float              # RoPE base of the full-attention layers
    rope_local_theta: float        # of the sliding-window layers
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_hf_dict(cls, hf: dict) -> Gemma3Config:
        """From a Gemma3TextConfig's config.json: the RoPE bases as transformers 5 writes them (rope_parameters per
        layer kind), else under their older names."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in hf.items() if k in known}
        rope = hf.get("rope_parameters") or {}
        values["rope_theta"] = (rope.get(FULL) or {}).get("rope_theta", hf.get("rope_theta", 1_000_000.0))
        values["rope_local_theta"] = (rope.get(SLIDING) or {}).get("rope_theta",
                                                                   hf.get("rope_local_base_freq", 10_000.0))
        values["layer_types"] = tuple(hf["layer_types"])
        return cls(**values)

    def to_hf_dict(self) -> dict:
        """A Gemma3TextConfig's config.json, the RoPE bases under both names (see from_hf_dict)."""
        hf = asdict(self)
        hf["layer_types"] = list(self.layer_types)
        local = hf.pop("rope_local_theta")
        hf["rope_parameters"] = {FULL: {"rope_type": "default", "rope_theta": self.rope_theta},
                                 SLIDING: {"rope_type": "default", "rope_theta": local}}
        hf.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
                  rope_local_base_freq=local, final_logit_softcapping=None, attn_logit_softcapping=None,
                  attention_bias=False, dtype="float32")
        return hf

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer, None on a full-attention layer."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


class GemmaRMSNorm(nn.Module):
    """x / rms(x) · (1 + w): w starts at 0, so an untrained norm is the identity. Computed in float32, like
    transformers' Gemma3RMSNorm (the product is taken before the cast back, unlike Llama's)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: Gemma3Config, layer: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.window(layer)
        self.scale = math.sqrt(cfg.query_pre_attn_scalar)
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, n_past: int, cache: KVCache | None, layer: int, heads_off: tuple[int, ...] = (),
                mask: RowKeys | None = None):
        """mask: the keys each row reads, from a caller that batches requests of different lengths
        (model/engine/batch.py: a row per request, each over its own slot, n_past unused); without it, the causal
        mask of one sequence at n_past."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)     # (B, n_heads, T, d_head)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv, T, d_head)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv, T, d_head)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (B, n_kv, S, d_head): on a sliding layer only the window's keys
        first_key = 0 if mask is not None else n_past + T - k.shape[2]  # the position of the first key
        if mask is None:
            mask = causal_mask(T, n_past, x.device, x.dtype, self.window, first_key)
        out, weights = attend(q, k, v, mask, self.scale)  # weights (B, n_heads, T, S)
        if first_key > 0:  # the views index keys by position: the positions before the window get weight 0
            weights = F.pad(weights, (first_key, 0))      # (B, n_heads, T, n_past + T)
        return self.o_proj(switch_heads_off(out, heads_off, self.head_dim)), weights, (q, k, v)


class Gemma3Block(nn.Module):
    def __init__(self, cfg: Gemma3Config, layer: int):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Gemma3Attention(cfg, layer)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, activation=gelu_tanh)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, n_past, cache, layer, heads_off=(), mask=None):
        attn_out, weights, qkv = self.self_attn(self.input_layernorm(x), cos, sin, n_past, cache, layer, heads_off,
                                                mask)
        x = x + self.post_attention_layernorm(attn_out)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, weights, qkv


class Gemma3(nn.Module):
    architecture = "gemma3_text"  # the config's model_type

    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        assert cfg.num_attention_heads % cfg.num_key_value_heads == 0, "n_heads must be a multiple of n_kv_heads"
        self.config = cfg
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
            layers=nn.ModuleList(Gemma3Block(cfg, i) for i in range(cfg.num_hidden_layers)),
            norm=GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        ))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # only the rotation speeds, not cos/sin tables: over a 32,768-position context two kinds of tables would
        # take 134 MB; a step computes its own positions' angles
        self.register_buffer("inv_freq_full", inverse_frequencies(cfg.head_dim, cfg.rope_theta), persistent=False)
        self.register_buffer("inv_freq_sliding", inverse_frequencies(cfg.head_dim, cfg.rope_local_theta),
                             persistent=False)
        # a float32 number, as transformers keeps it (its bfloat16 rounding is what the model was trained with)
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5), persistent=False)

    @property
    def windows(self) -> list[int | None]:
        return [self.config.window(i) for i in range(self.config.num_hidden_layers)]

    def new_cache(self, n_layers: int | None = None) -> KVCache:
        """A cache for the first n_layers blocks (all of them by default), sliding layers windowed."""
        n = n_layers or self.config.num_hidden_layers
        return KVCache(n, self.windows[:n])

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, output_attentions: bool = False,
                output_qkv_layer: int | None = None, last_logits_only: bool = False,
                n_layers: int | None = None, output_hidden_states: bool = False,
                heads_off: dict[int, tuple[int, ...]] | None = None,
                after_layer: Callable[[int], None] | None = None) -> ForwardOutput:
        """As Llama.forward: ids (B, T) continue the sequence held in `cache`, or start one when cache is None;
        the attention weights per layer are (B, n_heads, T, n_past + T), zero outside a sliding layer's window."""
        T = ids.shape[1]
        n_past = cache.length if cache is not None else 0
        x = self.model.embed_tokens(ids) * self.embed_scale.to(self.model.embed_tokens.weight.dtype)  # (B, T, hidden)
        positions = torch.arange(n_past, n_past + T, device=ids.device)
        rope = {kind: tuple(t.to(x.dtype) for t in rope_cos_sin(positions, inv_freq))  # (T, d_head) each
                for kind, inv_freq in ((FULL, self.inv_freq_full), (SLIDING, self.inv_freq_sliding))}
        attentions, qkv = [] if output_attentions else None, None
        hidden_states = [] if output_hidden_states else None
        heads_off = heads_off or {}
        for i, block in enumerate(self.model.layers[:n_layers]):
            cos, sin = rope[self.config.layer_types[i]]
            x, weights, layer_qkv = block(x, cos, sin, n_past, cache, i, heads_off.get(i, ()))
            if output_attentions:
                attentions.append(weights)
            if i == output_qkv_layer:
                qkv = layer_qkv
            if output_hidden_states:
                hidden_states.append(x[:, -1:] if last_logits_only else x)
            if after_layer is not None:
                after_layer(i)
        if last_logits_only:
            x = x[:, -1:]
        logits = self.lm_head(self.model.norm(x))  # (B, T or 1, vocab)
        return ForwardOutput(logits, attentions, qkv, hidden_states=hidden_states)

    def save(self, folder: str | Path) -> None:
        save_weights(self, Path(folder))

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu", dtype=torch.float32) -> Gemma3:
        folder = Path(folder)
        cfg = Gemma3Config.from_hf_dict(json.loads((folder / "config.json").read_text()))
        return load_weights(cls(cfg), folder, device, dtype)
