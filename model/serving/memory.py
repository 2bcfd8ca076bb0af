"""Where a server keeps its requests' keys and values, behind one protocol (vLLM v1's KVCacheManager, nano-vllm's
BlockManager): may a request be admitted, grow it to n positions, free it, what the prefix cache already holds of
it, and the bytes reserved and held. BlockMemory answers it, the paged pool (paged.PagedCache): blocks handed out as
a request's positions need them, a prefix cache of full prompt blocks, a sliding group's blocks given back once its
window passes them.

The engine's two memories are both BlockMemory: "paged", blocks of block_size positions; "padded", the vLLM paper's
"reserve the maximum" baseline under the same scheduler, one block per request and layer group holding the queue's
longest request whole (a one-entry block table, the Serving page's slot), so a request reserves its whole length at
admission and never grows. memory_layout, memory_blocks and memory_slots are the one place that tells the two apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from model.engine.runtime import ModelInfo
from model.errors import InputError
from model.serving.blocks import block_hash
from model.serving.paged import ALIGN, FP8, PagedCache, PagedLayout, first_seen
from model.serving.request import Request

MEMORIES = ("paged", "padded")
MAX_SLOTS = 32  # padded slots at most


class KVMemory(Protocol):
    def can_admit(self, request: Request, hit: list[list[int]]) -> bool: ...
    def grow(self, request: Request, positions: int) -> bool: ...
    def free(self, request: Request) -> None: ...
    def usage(self, running: list[Request]) -> tuple[int, int]: ...


class BlockMemory(PagedCache):
    """A PagedCache that hands its blocks to requests: per request one table per layer group, grown as its
    positions need blocks, shared through the prefix cache, given back the last first."""

    def tables_of(self, request: Request) -> list[list[int | None]]:
        return self.tables.setdefault(request.id, [[] for _ in self.layout.groups])

    def grow(self, request: Request, positions: int) -> bool:
        """Blocks for `positions` positions in every group's table; False (nothing taken) when too few are free."""
        tables = self.tables_of(request)
        needed = sum(max(0, self.layout.blocks(positions) - len(table)) for table in tables)
        if needed > self.pool.n_free:
            return False
        for g, table in enumerate(tables):
            while len(table) < self.layout.blocks(positions):
                table.append(self.pool.allocate(g))
        return True

    def free(self, request: Request) -> None:
        """Every block of the request given back, the last first (vLLM's KVCacheManager.free frees in reverse: a
        prefix's later blocks are handed out again before its first ones)."""
        for table in self.tables.pop(request.id, []):
            self.pool.free([b for b in reversed(table) if b is not None])
        request.hashes = []

    def prefix_hit(self, request: Request) -> list[list[int]]:
        """Per group, the cached blocks that hold the longest prefix of its tokens: full prompt blocks, found in
        every group, a multiple of ALIGN positions and at least one position short of its tokens (the last one's
        logits are computed: vLLM's get_computed_blocks caps a hit at num_tokens − 1, kv_cache_manager.py)."""
        size, tokens = self.layout.block_size, request.tokens
        most = min(request.prompt_len, len(tokens) - 1) // size
        found: list[list[int]] = [[] for _ in self.layout.groups]
        previous = None
        for j in range(most):
            block_tokens = tokens[j * size:(j + 1) * size]
            previous = block_hash(previous, block_tokens)
            ids = [self.pool.lookup(g, previous, block_tokens) for g in range(len(self.layout.groups))]
            if None in ids:
                break
            for table, block_id in zip(found, ids):
                table.append(block_id)
        keep = len(found[0]) * size // ALIGN * ALIGN // size  # a hit of a multiple of ALIGN positions
        if keep * size == request.prompt_len - 1:
            keep = (keep * size - 1) // ALIGN * ALIGN // size  # two positions of the prompt at least (_chunk_end)
        return [table[:keep] for table in found]

    def can_admit(self, request: Request, hit: list[list[int]]) -> bool:
        """Whether the blocks of every position the request has are free, less those the hit gives it (a hit's
        block no one holds is counted: taking it takes it out of the free ones)."""
        revived = sum(self.pool.blocks[b].refs == 0 for table in hit for b in table)
        new = sum(self.layout.blocks(len(request.tokens)) - len(table) for table in hit)
        return new + revived <= self.pool.n_free

    def admit(self, request: Request, hit: list[list[int]]) -> None:
        """The hit's blocks at the head of its tables, then blocks for every position it has."""
        for table, ids in zip(self.tables_of(request), hit):
            for block_id in ids:
                self.pool.touch(block_id)
                table.append(block_id)
        request.hashes = []
        self.grow(request, len(request.tokens))

    def cache_blocks(self, request: Request) -> None:
        """Let the prefix cache find the request's prompt blocks that are full and computed."""
        size, tokens = self.layout.block_size, request.prompt_ids
        tables = self.tables_of(request)
        for j in range(len(request.hashes), min(request.computed, request.prompt_len) // size):
            block_tokens = tokens[j * size:(j + 1) * size]
            request.hashes.append(block_hash(request.hashes[-1] if request.hashes else None, block_tokens))
            for table in tables:
                self.pool.cache(table[j], request.hashes[-1], block_tokens)

    def free_out_of_window(self, request: Request) -> None:
        """A sliding group's blocks that every later query passes (its prompt done: no chunk reads from 0 again)."""
        if request.computed < request.prompt_len:
            return
        size = self.layout.block_size
        for group, table in zip(self.layout.groups, self.tables_of(request)):
            if group.window is None:
                continue
            for j in range(first_seen(group.window, request.computed) // size):
                if table[j] is not None:
                    self.pool.free([table[j]])
                    table[j] = None

    def slot_holders(self, running: list[Request], slots: int) -> list[int | None]:
        """The padded memory's slots: per slot the request holding it (None: free). A request's block of group 0
        tells its slot: a padded request takes one block per group, in group order, from the head of the free queue
        and gives them back in the same order to its end, so the queue always holds whole slots (block ids s × groups
        + g)."""
        holders: list[int | None] = [None] * slots
        for request in running:
            holders[self.tables[request.id][0][0] // len(self.layout.groups)] = request.id
        return holders

    def view(self, running: list[Request]) -> PoolView:
        """The pool as a page draws it: per block its first holder, holders, whether the prefix cache finds it,
        its kind and the positions it holds; each request's tables."""
        n, size = self.n_blocks, self.layout.block_size
        holder, filled = np.full(n, -1), np.zeros(n, dtype=int)
        sliding = np.zeros(n, dtype=bool)
        for seq in sorted(running, key=lambda s: s.id):
            for group, table in zip(self.layout.groups, self.tables.get(seq.id, [])):
                for j, block in enumerate(table):
                    if block is None:
                        continue
                    if holder[block] < 0:
                        holder[block] = seq.id
                    sliding[block] = group.window is not None
                    filled[block] = max(filled[block], min(size, max(0, seq.computed - j * size)))
        blocks = self.pool.blocks
        cached = np.array([(b.group, b.hash) in self.pool.cached and self.pool.cached[(b.group, b.hash)]
                           == b.id for b in blocks], dtype=bool)
        tables = {rid: [[-1 if b is None else b for b in table] for table in tables]
                  for rid, tables in self.tables.items()}
        return PoolView(holder, np.array([b.refs for b in blocks]), cached, sliding, filled, size, tables,
                        [g.window for g in self.layout.groups])

    def usage(self, running: list[Request]) -> tuple[int, int]:
        """(bytes of the blocks held, bytes of the positions they hold): a block holds its positions up to its
        owners' computed length; the rest of a last block is the waste."""
        size = self.layout.block_size
        filled: dict[int, int] = {}
        for request in running:
            for table in self.tables.get(request.id, []):
                for j, block_id in enumerate(table):
                    if block_id is not None:
                        filled[block_id] = max(filled.get(block_id, 0), min(size, request.computed - j * size))
        return (len(filled) * self.layout.block_bytes,
                sum(max(0, n) for n in filled.values()) * self.layout.position_bytes)


@dataclass(frozen=True)
class PoolView:
    """The pool as a page draws it, block by block (numpy arrays of n_blocks), and each request's tables."""
    holder: np.ndarray    # the first request (lowest id) holding the block, −1 when free
    refs: np.ndarray      # requests holding it
    cached: np.ndarray    # the prefix cache can find it (held, or free and not handed out again yet)
    sliding: np.ndarray   # a sliding group holds it
    filled: np.ndarray    # positions it holds (its holders' computed positions in it), of block_size
    block_size: int
    tables: dict[int, list[list[int]]]   # per request, per group its block ids, −1 where its window let one go
    windows: list[int | None]            # per group, its kind


POOL_DTYPES = ("float32", "fp8")  # what a pool holds: the model's own K and V, or e4m3 (paged.FP8)


def memory_layout(info: ModelInfo, memory: str, block_size: int, longest: int,
                  kv_dtype: str = "float32") -> PagedLayout:
    """paged: blocks of block_size positions; padded: one block of the longest request's whole length (its prompt
    and every token it may write); an fp8 pool's numbers a byte each (its two scales a layer are not in a block)."""
    layout = PagedLayout.of(info, longest if memory == "padded" else block_size)
    return dataclasses.replace(layout, bytes_per_element=1) if kv_dtype == "fp8" else layout


def padded_bytes(info: ModelInfo, slots: int, longest: int) -> int:
    """The bytes of `slots` padded slots of `longest` positions: a block per layer group each."""
    layout = memory_layout(info, "padded", 0, longest)
    return slots * len(layout.groups) * layout.block_bytes


def pool_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The tensor dtype of a pool of `kv_dtype` ("float32": the model's own keys' dtype)."""
    return FP8 if kv_dtype == "fp8" else model_dtype


def check_memory(memory: str, *, prefix_cache: bool, chunk: int | None, offload: str | None,
                 prefill_worker: bool, kv_dtype: str = "float32") -> None:
    """What the padded baseline does not have, refused in one sentence: it shares no block (no prefix cache), holds
    a whole request from its admission (no chunks to make room for) and moves none out. A pool in fewer bits holds
    float32 or fp8 (KIVI's int8 keeps a float residual per group, which blocks do not hold), and takes no prompt
    from a prefill worker (the worker sends float keys and values)."""
    if kv_dtype not in POOL_DTYPES:
        raise InputError("pool_kv_dtype", kv_dtype=kv_dtype)
    if kv_dtype != "float32" and prefill_worker:
        raise InputError("pool_kv_dtype_workers")
    if memory == "padded":
        if prefill_worker:
            raise InputError("padded_no_workers")
        if prefix_cache or chunk is not None or offload is not None:
            raise InputError("padded_no_paging")


def too_small(memory: str, budget_bytes: int, least_mib: float) -> InputError:
    """The refusal of a budget under what the queue's longest request holds: one padded slot of it, or its blocks."""
    return InputError("padded_budget" if memory == "padded" else "paged_budget",
                      budget_number=round(budget_bytes / 2**20, 2), least_number=least_mib)


def memory_blocks(info: ModelInfo, memory: str, layout: PagedLayout, budget_bytes: int) -> int:
    """The blocks the budget holds: padded, whole slots (a block per layer group each), MAX_SLOTS at most, refused
    under one."""
    n_blocks = budget_bytes // layout.block_bytes
    if memory == "padded":
        groups = len(layout.groups)
        if n_blocks < groups:
            raise InputError("padded_budget", budget_number=round(budget_bytes / 2**20, 2),
                             least_number=-(-groups * layout.block_bytes * 100 // 2**20) / 100)
        n_blocks = min(MAX_SLOTS, n_blocks // groups) * groups
    return n_blocks


def memory_slots(memory: str, layout: PagedLayout, n_blocks: int) -> int | None:
    """The padded memory's slots (requests it holds at once at most); None for blocks."""
    return n_blocks // len(layout.groups) if memory == "padded" else None


def make_memory(layout: PagedLayout, n_blocks: int, dtype: torch.dtype, device: torch.device) -> KVMemory:
    """A pool of `n_blocks` blocks of `layout` (dtype, device)."""
    return BlockMemory(layout, n_blocks, dtype, device)
