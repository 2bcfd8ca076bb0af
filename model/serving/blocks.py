"""The block pool of a paged KV cache: fixed-size blocks handed out one at a time, reference-counted, and a prefix
cache of full prompt blocks found by a hash of their tokens chained to the previous block's.

After nano-vllm's BlockManager (nanovllm/engine/block_manager.py: the chained hash, a hit checked against the
block's tokens, a freed block kept findable until it is handed out again) and vLLM's BlockPool
(vllm/v1/core/block_pool.py: the free queue in eviction order, a cached block "touched" back out of it, one cache of
hashes per group of layers). Only block ids and counts live here; the K and V they stand for are paged.PagedCache's.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass

import numpy as np


def block_hash(previous: int | None, tokens: list[int]) -> int:
    """A full block's identity: its tokens hashed together with the previous block's hash, so that two blocks with
    the same tokens after different prefixes differ (their keys and values do), as vLLM's hash_block_tokens."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update((-1 if previous is None else previous).to_bytes(8, "little", signed=True))
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)


@dataclass
class Block:
    id: int
    refs: int = 0                 # requests whose block table holds it; 0: free
    hash: int | None = None       # while the prefix cache can find it
    tokens: tuple[int, ...] = ()  # the tokens it holds, checked on a hit
    group: int | None = None      # the layer group whose keys and values it holds (paged.LayerGroup)


class BlockPool:
    """`n_blocks` blocks. A free block waits in `free_ids`, the least recently freed first: allocate() takes the
    first, and if the prefix cache could still find it, forgets it there (evicted). A cached block whose last user
    left is free (counted free, handed out when its turn comes), but until then a request with the same prefix takes
    it back (touch) instead of computing it again."""

    def __init__(self, n_blocks: int):
        self.blocks = [Block(i) for i in range(n_blocks)]
        self.free_ids: deque[int] = deque(range(n_blocks))
        self.cached: dict[tuple[int, int], int] = {}  # (group, hash) -> block id

    @property
    def n_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, group: int) -> int:
        """A free block for `group`, its refs at 1; the caller checked n_free first."""
        block = self.blocks[self.free_ids.popleft()]
        if block.hash is not None and self.cached.get((block.group, block.hash)) == block.id:
            del self.cached[(block.group, block.hash)]
        block.refs, block.hash, block.tokens, block.group = 1, None, (), group
        return block.id

    def touch(self, block_id: int) -> None:
        """One more request holds a cached block: out of the free queue if nobody held it."""
        block = self.blocks[block_id]
        if block.refs == 0:
            self.free_ids.remove(block_id)
        block.refs += 1

    def free(self, block_ids: list[int]) -> None:
        """Each block loses one holder; one nobody holds goes to the end of the free queue (pass a request's blocks
        last first, as vLLM does, so that a prefix's later blocks are handed out before its first ones)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.refs -= 1
            if block.refs == 0:
                self.free_ids.append(block_id)

    def cache(self, block_id: int, block_hash_: int, tokens: list[int]) -> None:
        """Let the prefix cache find a full block by its hash (a block already cached for the same hash and group
        stays the one found: the new one is freed as any other, as vLLM leaves duplicates uncached)."""
        block = self.blocks[block_id]
        block.hash, block.tokens = block_hash_, tuple(tokens)
        self.cached.setdefault((block.group, block_hash_), block_id)

    def lookup(self, group: int, block_hash_: int, tokens: list[int]) -> int | None:
        """The cached block of `group` with this hash and these tokens, None on a miss."""
        block_id = self.cached.get((group, block_hash_))
        if block_id is None or self.blocks[block_id].tokens != tuple(tokens):
            return None
        return block_id

    def shared(self) -> int:
        """Blocks held by more than one request."""
        return sum(block.refs > 1 for block in self.blocks)

    def reset(self) -> None:
        """Every block free, the prefix cache empty."""
        self.__init__(len(self.blocks))
