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
Shared with llama.py (DecoderOnly): the forward and its layer loop, the projections, RoPE, the written-out
attention, the causal mask per layer kind, the saving and the loading.
Parameter names follow Hugging Face's Gemma3ForCausalLM, which loads the same folder and gives the same logits.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from model.engine.llama import MLP, Attention, DecoderOnly, RMSNorm, inverse_frequencies, over_heads, rope_cos_sin

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


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) · (1 + w): w starts at 0, so an untrained norm is the identity. Computed in float32, like
    transformers' Gemma3RMSNorm (the product is taken before the cast back, unlike Llama's)."""

    plus_one = True

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.zeros(dim))

    def eager(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(Attention):
    """Llama's attention with q and k RMS-normalised per head before RoPE, and scores divided by
    √query_pre_attn_scalar."""

    def __init__(self, cfg: Gemma3Config):
        super().__init__(cfg)
        self.scale = math.sqrt(cfg.query_pre_attn_scalar)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project(self, x):
        qk, v = super().project(x)
        q, k = qk.split((self.n_heads, self.n_kv_heads), dim=1)
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1), v


class Gemma3Block(nn.Module):
    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Gemma3Attention(cfg)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, activation=gelu_tanh)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, keys, cache, layer, heads_off=()):
        attn_out, weights, qkv = self.self_attn(self.input_layernorm(x), cos, sin, keys, cache, layer, heads_off)
        x = x + self.post_attention_layernorm(attn_out)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, weights, qkv


class Gemma3(DecoderOnly):
    architecture = "gemma3_text"
    config_class, block_class, norm_class = Gemma3Config, Gemma3Block, GemmaRMSNorm

    def computed_buffers(self) -> dict[str, torch.Tensor]:
        cfg = self.config
        # only the rotation speeds, not cos/sin tables: over a 32,768-position context two kinds of tables would
        # take 134 MB; a step computes its own positions' angles. The embedding scale is a float32 number, as
        # transformers keeps it (its bfloat16 rounding is what the model was trained with)
        return {"inv_freq_full": inverse_frequencies(cfg.head_dim, cfg.rope_theta),
                "inv_freq_sliding": inverse_frequencies(cfg.head_dim, cfg.rope_local_theta),
                "embed_scale": torch.tensor(cfg.hidden_size ** 0.5)}

    def embed(self, ids):
        return self.model.embed_tokens(ids) * self.embed_scale.to(self.model.embed_tokens.weight.dtype)

    def rope(self, positions, dtype):
        """The full layers turn with base rope_theta, the sliding ones with rope_local_theta."""
        speeds = ((None, self.inv_freq_full), (self.config.sliding_window, self.inv_freq_sliding))
        return {window: tuple(over_heads(t.to(dtype), positions) for t in rope_cos_sin(positions, inv_freq))
                for window, inv_freq in speeds}
