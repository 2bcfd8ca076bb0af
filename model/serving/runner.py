"""The room's one call of the model's forward (nano-vllm's ModelRunner.run_model): a step's rows over a paged
memory, or one prompt alone in a private pool (the prefill worker's and the tier's crossover's pass).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.engine.llama import DecoderOnly
from model.serving.paged import PagedCache, PagedPass, PagedPassInPlace, Row


def prompt_alone(cache: PagedCache, n: int) -> list[Row]:
    """`cache` emptied, blocks for request 0's n-position prompt, and its one masked row (its solo prefill)."""
    cache.reset()
    layout = cache.layout
    cache.tables[0] = [[cache.pool.allocate(g) for _ in range(layout.blocks(n))] for g in range(len(layout.groups))]
    return [Row(0, 0, n, True, n)]


def reads_in_place(module: DecoderOnly, cache: PagedCache) -> bool:
    """Whether a pass reads its keys where they lie (PagedPassInPlace): the model attends in the decode kernels over
    a float32 pool on a CPU."""
    attention = module.model.layers[0].self_attn
    return (bool(getattr(attention, "fused", False)) and cache.keys.dtype == torch.float32
            and cache.keys.device.type == "cpu")


def run_rows(module: DecoderOnly, cache: PagedCache, rows: list[Row], ids: torch.Tensor,
             after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
    """The rows' token ids (1, N) through the model over `cache` (their blocks allocated): per row its last
    position's logits, (rows, vocab). after_layer(i) runs once block i has, and may stop the pass by raising."""
    paged = (PagedPassInPlace if reads_in_place(module, cache) else PagedPass)(cache, rows, ids.device)
    return module(ids, paged, positions=paged.positions, keys=paged.row_keys, last_logits_only=True,
                  after_layer=after_layer).logits[0]
