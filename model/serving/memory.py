"""Where the engine keeps its requests' keys and values (vLLM v1's KVCacheManager, nano-vllm's BlockManager): may a
request be admitted, grow it, free it, what the prefix cache holds of it, the bytes reserved and held. Both memories
are a BlockMemory: "paged", blocks of block_size positions; "padded", the vLLM paper's "reserve the maximum" baseline,
one block per layer group holding the queue's longest request whole (the Serving page's slot). memory_layout,
memory_blocks and memory_slots are the one place that tells the two apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from model.engine.runtime import ModelInfo
from model.errors import InputError
from model.serving.blocks import block_hash
from model.serving.paged import ALIGN, FP8, PagedCache, PagedLayout, first_seen
from model.serving.request import Request

MEMORIES = ("paged", "padded")
MAX_SLOTS = 32  # padded slots at most


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
        """Every block of the request given back, the last first (as vLLM's KVCacheManager.free)."""
        for table in self.tables.pop(request.id, []):
            self.pool.free([b for b in reversed(table) if b is not None])
        request.hashes = []

    def prefix_hit(self, request: Request) -> list[list[int]]:
        """Per group, the cached blocks that hold the longest prefix of its tokens: full prompt blocks, found in
        every group, a multiple of ALIGN positions and at least one position short of its tokens."""
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
        """The padded memory's slots: per slot the request holding it (None: free). A padded request takes and gives
        back one block per group in group order, so its block of group 0 is block slot × groups."""
        holders: list[int | None] = [None] * slots
        for request in running:
            holders[self.tables[request.id][0][0] // len(self.layout.groups)] = request.id
        return holders

    def filled(self, running: list[Request]) -> dict[int, int]:
        """Per held block, the positions it holds: up to its holders' computed length (the rest is the waste)."""
        size = self.layout.block_size
        filled: dict[int, int] = {}
        for request in running:
            for table in self.tables.get(request.id, []):
                for j, block_id in enumerate(table):
                    if block_id is not None:
                        filled[block_id] = max(filled.get(block_id, 0), min(size, request.computed - j * size))
        return filled

    def view(self, running: list[Request]) -> PoolView:
        """The pool as a page draws it: per block its first holder, holders, whether the prefix cache finds it,
        its kind and the positions it holds; each request's tables."""
        n = self.n_blocks
        holder, filled = np.full(n, -1), np.zeros(n, dtype=int)
        sliding = np.zeros(n, dtype=bool)
        for seq in sorted(running, key=lambda s: s.id):
            for group, table in zip(self.layout.groups, self.tables.get(seq.id, [])):
                for block in table:
                    if block is None:
                        continue
                    if holder[block] < 0:
                        holder[block] = seq.id
                    sliding[block] = group.window is not None
        for block, positions in self.filled(running).items():
            filled[block] = positions
        blocks = self.pool.blocks
        cached = np.array([(b.group, b.hash) in self.pool.cached and self.pool.cached[(b.group, b.hash)]
                           == b.id for b in blocks], dtype=bool)
        tables = {rid: [[-1 if b is None else b for b in table] for table in tables]
                  for rid, tables in self.tables.items()}
        return PoolView(holder, np.array([b.refs for b in blocks]), cached, sliding, filled, self.layout.block_size,
                        tables, [g.window for g in self.layout.groups])

    def usage(self, running: list[Request]) -> tuple[int, int]:
        """(bytes of the blocks held, bytes of the positions they hold)."""
        filled = self.filled(running)
        return len(filled) * self.layout.block_bytes, sum(filled.values()) * self.layout.position_bytes


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
    """What the padded baseline does not have (a shared block, chunks, a tier, a prefill worker), a pool in another
    dtype than float32 and fp8 or an fp8 pool with a prefill worker, and a prefill worker beside a prefix cache,
    chunks or a tier, refused in one sentence."""
    if kv_dtype not in POOL_DTYPES:
        raise InputError("pool_kv_dtype", kv_dtype=kv_dtype)
    if kv_dtype != "float32" and prefill_worker:
        raise InputError("pool_kv_dtype_workers")
    if memory == "padded":
        if prefill_worker:
            raise InputError("padded_no_workers")
        if prefix_cache or chunk is not None or offload is not None:
            raise InputError("padded_no_paging")
    if prefill_worker and (prefix_cache or chunk is not None or offload is not None):
        raise InputError("disaggregate_alone")


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
            raise too_small(memory, budget_bytes, mib_up(groups * layout.block_bytes))
        n_blocks = min(MAX_SLOTS, n_blocks // groups) * groups
    return n_blocks


def memory_slots(memory: str, layout: PagedLayout, n_blocks: int) -> int | None:
    """The padded memory's slots (requests it holds at once at most); None for blocks."""
    return n_blocks // len(layout.groups) if memory == "padded" else None


def mib_up(n_bytes: int) -> float:
    """Bytes as MiB, rounded up to 2 decimals (a budget of that many MiB holds them)."""
    return -(-n_bytes * 100 // 2**20) / 100
