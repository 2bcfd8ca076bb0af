"""Why GQA exists: a grouped-query model beside its multi-head equivalent, and the cache each one keeps.

In grouped-query attention (GQA, arXiv 2305.13245; multi-query attention is its one-KV-head case, arXiv 1911.02150)
a group of query heads reads one key head and one value head. Repeating each KV head once per query of its group
gives a multi-head model (n_kv = n_heads) that computes the same thing: each query head reads the same keys and
values as before, only the cache now stores each of them `group` times. So the two models' logits are the same, and
the multi-head one's cache is `group` times larger: SmolLM2 (9 query heads, 3 KV heads) 3×, Gemma 3 270M (4 and 1)
4×. The lesson is the cheapest and most exact one about cache size: the bytes saved cost nothing in what this
model computes (the quality cost GQA has is paid in training, where the shared heads are learnt as such).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from model.engine.llama import Attention, dense_copy, is_packed, pack_linears
from model.engine.runtime import NativeModel


def as_multi_head(model: NativeModel) -> NativeModel:
    """The multi-head equivalent of a grouped-query model: every KV head's rows of k_proj and v_proj repeated for
    each query head of its group (query head h read KV head h // group; it now reads its own copy, number h). The
    shared model is not touched; the copy is packed for the decode kernels as the shared one is."""
    module = dense_copy(model.module)
    group = module.config.num_attention_heads // module.config.num_key_value_heads
    for attention in (m for m in module.modules() if isinstance(m, Attention)):
        for name in ("k_proj", "v_proj"):
            linear = getattr(attention, name)
            heads = linear.weight.detach().view(attention.n_kv_heads, attention.head_dim, -1)  # (n_kv, d_head, hidden)
            repeated = heads.repeat_interleave(group, dim=0).reshape(attention.n_heads * attention.head_dim, -1)
            linear.weight = torch.nn.Parameter(repeated.clone(), requires_grad=False)
            linear.out_features = repeated.shape[0]
        attention.n_kv_heads = attention.n_heads
    module.config = dataclasses.replace(module.config, num_key_value_heads=module.config.num_attention_heads)
    if is_packed(model.module):
        pack_linears(module)
    widened = NativeModel(model.info.name, module, model.tokenizer, model.device, model.info.language)
    widened.facts = model.facts
    return widened


@dataclass(frozen=True)
class CacheFormula:
    """Bytes one position of the cache takes, by the formula 2 × layers × KV heads × d_head × bytes."""
    name: str
    n_layers: int
    n_kv_heads: int
    d_head: int
    bytes_per_element: int

    @property
    def bytes_per_position(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.d_head * self.bytes_per_element


def cache_formulas(model: NativeModel) -> list[CacheFormula]:
    """The model as it is (GQA or MQA where n_kv < n_heads) and its multi-head equivalent."""
    info = model.info
    shipped = CacheFormula("shipped", info.n_layers, info.n_kv_heads, info.d_head, info.bytes_per_element)
    return [shipped, dataclasses.replace(shipped, name="multi_head", n_kv_heads=info.n_heads)]


def mla_bytes_per_position(n_layers: int, latent: int, rope_dim: int, bytes_per_element: int) -> int:
    """Multi-head latent attention's cache (DeepSeek-V2, arXiv 2405.04434, its equation for the KV cache): per layer
    one compressed latent of `latent` numbers (d_c) and one decoupled RoPE key of `rope_dim` (d_h^R) shared by all
    heads, (d_c + d_h^R) × layers elements a position. A formula only: no model this project ships uses MLA."""
    return n_layers * (latent + rope_dim) * bytes_per_element
