"""What a step over this module costs, from the formulas in model/engine/counting.py: the bytes it reads (every
weight once, each row's cache), its FLOPs, and a prefill's arithmetic intensity against the machine's ridge."""

from __future__ import annotations

import torch

from model.engine.counting import step_bytes, step_flops
from model.engine.llama import Embedding, Linear, Llama, packed_weights
from model.engine.runtime import NativeModel


def weight_bytes(module: Llama, rows: int) -> int:
    """Bytes of the weights one step over `rows` rows reads: every matmul's weights once, as the model holds them
    (packed for the decode kernels, int8's scales included, or dense), and every norm once, however many rows share
    them; and the `rows` rows of the embedding that the lookup reads (a tied LM head reads the whole matrix, as a
    matmul weight)."""
    linears = [m for m in module.modules() if isinstance(m, Linear)]
    embedding = module.model.embed_tokens
    matmul = {id(p) for m in linears for p in m.parameters()}
    dense = {id(p): p for m in linears if m.packed is None for p in m.parameters()}
    rest = {id(p): p for p in module.parameters() if id(p) not in matmul and p is not embedding.weight}
    held = sum(p.nbytes for p in packed_weights(module))
    held += sum(t.numel() * t.element_size() for t in (*dense.values(), *rest.values()))
    return held + rows * lookup_bytes(embedding)


def lookup_bytes(embedding: Embedding) -> int:
    """Bytes the lookup of one token reads: its row of the table, or of a tied LM head's packed weights (int8: and
    its scale)."""
    if embedding.packed is None:
        return embedding.weight.shape[1] * embedding.weight.element_size()
    packed = embedding.packed
    return packed.inputs * packed.dtype.itemsize + (4 if packed.dtype == torch.int8 else 0)


def matmul_params(module: torch.nn.Module) -> int:
    """Weights that take part in a matmul: every Linear (the LM head included), not the embedding (a lookup of one
    row) nor the norms."""
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, Linear))

def flops(module: Llama, rows: list[tuple[int, int]]) -> int:
    """counting.step_flops for this module's shapes, rows = [(new positions, keys attended), ...]."""
    cfg, head = module.config, module.lm_head.in_features * module.lm_head.out_features
    windows = [w for w in module.windows if w is not None]
    return step_flops(matmul_params(module) - head, head, cfg.num_hidden_layers, cfg.num_attention_heads,
                      cfg.head_dim, rows, len(windows), windows[0] if windows else None)

def prefill_counts(model: NativeModel, n: int) -> tuple[int, int]:
    """Bytes read and FLOPs of a prefill of n positions: it reads every weight once and writes n positions of
    cache; every position multiplies through the layers, the LM head runs on the last."""
    return (step_bytes(weight_bytes(model.module, n), [model.info.cache_bytes_formula(n)]),
            flops(model.module, [(n, n)]))


def prefill_intensity(model: NativeModel, n: int) -> float:
    """FLOPs per byte of a prefill of n positions (prefill_counts)."""
    bytes_read, prefill_flops = prefill_counts(model, n)
    return prefill_flops / bytes_read

def positions_to_pass(model: NativeModel, ridge: float) -> int | None:
    """The fewest prompt positions whose prefill does at least `ridge` FLOPs per byte (its intensity grows with
    n); None when no prefill within the model's context does."""
    low, high = 1, model.info.context_length
    if prefill_intensity(model, high) < ridge:
        return None
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if prefill_intensity(model, middle) < ridge else (low, middle)
    return low
