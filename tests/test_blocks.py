"""The paged cache's block pool (model/serving/blocks.py) and its layer groups (paged.py): allocate, share, reference
counts, free in eviction order, the hash chain, a cached block found again after its last user left, reset."""

import pytest

from model.serving.blocks import BlockPool, block_hash
from model.serving.paged import LayerGroup, PagedLayout, layer_groups


def test_allocate_takes_the_least_recently_freed_block_first():
    pool = BlockPool(4)
    first = [pool.allocate(0) for _ in range(3)]
    assert first == [0, 1, 2] and pool.n_free == 1
    pool.free([2, 0])             # a request's blocks, its last first
    assert pool.n_free == 3
    assert [pool.allocate(0) for _ in range(3)] == [3, 2, 0]


def test_a_shared_block_is_freed_when_its_last_holder_leaves():
    pool = BlockPool(2)
    block = pool.allocate(0)
    pool.cache(block, block_hash(None, [5, 6]), [5, 6])
    pool.touch(block)             # a second request takes it from the prefix cache
    assert pool.blocks[block].refs == 2 and pool.shared() == 1 and pool.n_free == 1
    pool.free([block])
    assert pool.blocks[block].refs == 1 and pool.n_free == 1 and pool.shared() == 0
    pool.free([block])
    assert pool.blocks[block].refs == 0 and pool.n_free == 2


def test_a_freed_cached_block_is_found_and_taken_back_until_it_is_handed_out_again():
    pool = BlockPool(2)
    h = block_hash(None, [1, 2, 3])
    block = pool.allocate(0)
    pool.cache(block, h, [1, 2, 3])
    pool.free([block])
    assert pool.n_free == 2 and pool.lookup(0, h, [1, 2, 3]) == block  # free, and still findable
    pool.touch(block)
    assert pool.n_free == 1 and pool.blocks[block].refs == 1
    pool.free([block])
    other = pool.allocate(0)      # the other free block first (it waited longer)
    assert other != block and pool.lookup(0, h, [1, 2, 3]) == block
    assert pool.allocate(0) == block and pool.lookup(0, h, [1, 2, 3]) is None  # handed out: evicted


def test_a_hit_needs_the_same_group_and_the_same_tokens():
    pool = BlockPool(2)
    h = block_hash(None, [1, 2])
    block = pool.allocate(1)
    pool.cache(block, h, [1, 2])
    assert pool.lookup(1, h, [1, 2]) == block
    assert pool.lookup(0, h, [1, 2]) is None      # another group's layers: another block
    assert pool.lookup(1, h, [1, 3]) is None      # a hash that collided on other tokens is no hit


def test_the_hash_chains_each_block_to_the_ones_before():
    a, b = block_hash(None, [1, 2]), block_hash(None, [9, 9])
    assert block_hash(a, [3, 4]) == block_hash(a, [3, 4])       # reproducible (no per-process salt)
    assert block_hash(a, [3, 4]) != block_hash(b, [3, 4])       # same tokens after another prefix
    assert block_hash(None, [3, 4]) != block_hash(a, [3, 4])


def test_a_duplicate_block_stays_uncached_and_the_first_stays_found():
    pool = BlockPool(3)
    h = block_hash(None, [7])
    first, second = pool.allocate(0), pool.allocate(0)
    pool.cache(first, h, [7])
    pool.cache(second, h, [7])
    assert pool.lookup(0, h, [7]) == first
    pool.free([second])
    pool.allocate(0)
    pool.allocate(0)              # hands out `second` again: `first` stays cached
    assert pool.lookup(0, h, [7]) == first


def test_reset_frees_every_block_and_forgets_the_cache():
    pool = BlockPool(3)
    for _ in range(3):
        pool.cache(pool.allocate(0), block_hash(None, [1]), [1])
    pool.reset()
    assert pool.n_free == 3 and pool.cached == {} and all(b.refs == 0 for b in pool.blocks)


@pytest.mark.parametrize(("windows", "groups"), [
    ((None,) * 4, [(None, (0, 1, 2, 3))]),
    # Gemma 3 270M: 5 sliding then 1 full, three times: groups of 3 (gcd of 15 and 3)
    ((512,) * 5 + (None,) + (512,) * 5 + (None,) + (512,) * 5 + (None,),
     [(512, (0, 1, 2)), (512, (3, 4, 6)), (None, (5, 11, 17)), (512, (7, 8, 9)), (512, (10, 12, 13)),
      (512, (14, 15, 16))]),
    ((4, 4, None, 4, 4, None), [(4, (0, 1)), (None, (2, 5)), (4, (3, 4))]),
])
def test_layers_fall_in_groups_of_one_kind_and_one_size(windows, groups):
    assert layer_groups(windows) == tuple(LayerGroup(w, layers) for w, layers in groups)


def test_a_block_is_its_positions_of_one_group_s_layers():
    layout = PagedLayout(layer_groups((None,) * 4), 16, n_kv_heads=2, d_head=32, bytes_per_element=4)
    assert layout.position_bytes == 2 * 4 * 2 * 32 * 4 and layout.block_bytes == 16 * layout.position_bytes
    assert [layout.blocks(n) for n in (1, 16, 17)] == [1, 1, 2]
