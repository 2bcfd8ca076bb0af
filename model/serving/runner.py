"""The room's pass over a paged memory (nano-vllm's ModelRunner.run_model): the rows of a step, prompt chunks and
decodes side by side, through one call of the model's own forward, each row reading its request's block tables;
and the same pass for one prompt alone in a private pool, which the prefill worker and the tier's crossover run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.engine.llama import DecoderOnly
from model.serving.paged import PagedCache, PagedPass, PagedPassInPlace, Row


def prompt_alone(cache: PagedCache, n: int) -> list[Row]:
    """Every block of `cache` back in its pool, blocks for request 0's n-position prompt in every group, and the
    pass's one masked row over it (the prompt's solo prefill)."""
    cache.reset()
    layout = cache.layout
    cache.tables[0] = [[cache.pool.allocate(g) for _ in range(layout.blocks(n))] for g in range(len(layout.groups))]
    return [Row(0, 0, n, True, n)]


def reads_in_place(module: DecoderOnly, cache: PagedCache) -> bool:
    """Whether a pass reads its keys where they lie (PagedPassInPlace): the model attends in the decode kernels
    (pack_linears) and the pool is float32 on a CPU, what kernels.attend_paged reads."""
    attention = module.model.layers[0].self_attn
    return (bool(getattr(attention, "fused", False)) and cache.keys.dtype == torch.float32
            and cache.keys.device.type == "cpu")


def run_rows(module: DecoderOnly, cache: PagedCache, rows: list[Row], ids: torch.Tensor,
             after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
    """The rows' token ids (1, N) through the model over `cache` (their blocks allocated): per row the logits of
    its last position, (rows, vocab). after_layer(i) runs once block i has; a caller may stop the pass there by
    raising, and the same pass can run again whole (it writes the same positions)."""
    paged = (PagedPassInPlace if reads_in_place(module, cache) else PagedPass)(cache, rows, ids.device)
    return module(ids, paged, positions=paged.positions, keys=paged.row_keys, last_logits_only=True,
                  after_layer=after_layer).logits[0]
