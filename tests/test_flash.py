import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.engine.flash import (
    attention_scores,
    default_block_size,
    naive_attention,
    naive_traffic_bytes,
    score_matrix_bytes,
    tile_buffer_bytes,
    tiled_attention,
    tiled_traffic_bytes,
)

TOLERANCE = 1e-5  # float32 in, float32 out: the two paths differ only by rounding


def random_head(n_q, n_k, d_head, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_q, d_head), dtype=np.float32)
    k = rng.standard_normal((n_k, d_head), dtype=np.float32)
    v = rng.standard_normal((n_k, d_head), dtype=np.float32)
    return q, k, v


def max_abs_diff(a, b):
    return float(np.max(np.abs(a - b)))


# -----------------------------------------------------------------------------
# the tiled walk gives the naive answer


@pytest.mark.parametrize(
    "n, d_head, block_q, block_k, causal",
    [
        (16, 8, 4, 4, True),
        (16, 8, 4, 4, False),
        (13, 8, 4, 4, True),  # N not a multiple of the block
        (13, 8, 4, 4, False),
        (13, 4, 1, 1, True),  # block size 1: the plain online softmax
        (10, 4, 16, 32, True),  # block >= N: one tile
        (10, 4, 10, 10, False),
        (20, 8, 8, 3, True),  # block_q != block_k
        (20, 8, 3, 8, True),
        (20, 8, 3, 8, False),
        (1, 4, 1, 1, True),  # a single token
    ],
)
def test_tiled_matches_naive(n, d_head, block_q, block_k, causal):
    q, k, v = random_head(n, n, d_head, seed=n * 100 + block_q)
    walk = tiled_attention(q, k, v, block_q, block_k, causal)
    expected = naive_attention(q, k, v, causal)
    assert walk.output.shape == (n, d_head)
    assert walk.output.dtype == np.float32 and expected.dtype == np.float32
    assert max_abs_diff(walk.output, expected) <= TOLERANCE


@pytest.mark.parametrize("n_q, n_k", [(1, 9), (3, 9), (9, 9)])
def test_fewer_queries_than_keys_align_with_the_last_key(n_q, n_k):
    # a decode step: the new queries are the last positions and see the whole cache before them
    q, k, v = random_head(n_q, n_k, 4, seed=n_q)
    walk = tiled_attention(q, k, v, block_q=2, block_k=4)
    assert max_abs_diff(walk.output, naive_attention(q, k, v)) <= TOLERANCE
    scores = attention_scores(q, k)  # (Nq, Nk)
    assert np.isfinite(scores[-1]).all()  # the last query sees every key
    assert np.isneginf(scores[0, n_k - n_q + 1 :]).all()  # the first one sees up to its own position


@settings(max_examples=50, deadline=None)
@given(
    n_q=st.integers(1, 40),
    extra_keys=st.integers(0, 8),
    d_head=st.integers(1, 16),
    block_q=st.integers(1, 48),
    block_k=st.integers(1, 48),
    causal=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_tiled_matches_naive_on_random_shapes(n_q, extra_keys, d_head, block_q, block_k, causal, seed):
    q, k, v = random_head(n_q, n_q + extra_keys, d_head, seed)
    walk = tiled_attention(q, k, v, block_q, block_k, causal)
    assert max_abs_diff(walk.output, naive_attention(q, k, v, causal)) <= TOLERANCE


def test_causal_needs_at_least_as_many_keys_as_queries():
    q, k, v = random_head(4, 3, 2)
    with pytest.raises(ValueError, match=r"causal attention needs Nq <= Nk; got Nq=4, Nk=3"):
        tiled_attention(q, k, v, 2, 2)
    with pytest.raises(ValueError, match=r"causal attention needs Nq <= Nk; got Nq=4, Nk=3"):
        naive_attention(q, k, v)
    with pytest.raises(ValueError, match=r"expected q \(Nq, d\) and k, v \(Nk, d\)"):
        naive_attention(q, k, v[:, :1], causal=False)


# -----------------------------------------------------------------------------
# what each step records


def test_steps_walk_query_blocks_outside_key_blocks_inside():
    q, k, v = random_head(10, 10, 4)
    walk = tiled_attention(q, k, v, block_q=4, block_k=3, causal=False)
    assert (walk.n_q_blocks, walk.n_k_blocks) == (3, 4)
    assert [(s.q_block, s.k_block) for s in walk.steps] == [(i, j) for i in range(3) for j in range(4)]
    assert walk.steps[-1].q_rows == (8, 10) and walk.steps[-1].k_cols == (9, 10)  # ragged edge tiles
    assert walk.steps[-1].scores.shape == (2, 1)


@pytest.mark.parametrize(
    "block_q, block_k, causal", [(4, 4, True), (3, 5, True), (4, 2, False), (1, 1, True)]
)
def test_running_stats_end_as_the_true_row_max_and_sum(block_q, block_k, causal):
    q, k, v = random_head(11, 11, 4, seed=7)
    walk = tiled_attention(q, k, v, block_q, block_k, causal)
    scores = attention_scores(q, k, causal)  # (N, N)
    true_max = scores.max(axis=1)  # (N,)
    true_sum = np.exp(scores - true_max[:, None]).sum(axis=1)  # (N,)
    last_steps = [s for s in walk.steps if s.k_block == walk.n_k_blocks - 1]
    assert len(last_steps) == walk.n_q_blocks
    for step in last_steps:
        rows = slice(*step.q_rows)
        np.testing.assert_allclose(step.row_max, true_max[rows], rtol=TOLERANCE)
        np.testing.assert_allclose(step.row_sum, true_sum[rows], rtol=TOLERANCE)
        np.testing.assert_allclose(step.partial_output, walk.output[rows], atol=TOLERANCE)


def test_tile_scores_are_slices_of_the_full_score_matrix():
    q, k, v = random_head(9, 9, 4, seed=3)
    walk = tiled_attention(q, k, v, block_q=4, block_k=3)
    scores = attention_scores(q, k)  # (N, N)
    for step in walk.steps:
        tile = scores[slice(*step.q_rows), slice(*step.k_cols)]
        np.testing.assert_allclose(step.scores, tile, atol=1e-6)


@pytest.mark.parametrize("n, block_q, block_k", [(8, 2, 2), (13, 4, 3), (7, 1, 1), (6, 8, 8), (10, 3, 4)])
def test_skipped_tiles_are_exactly_those_above_the_diagonal(n, block_q, block_k):
    q, k, v = random_head(n, n, 4)
    scores = attention_scores(q, k)  # (N, N), -inf above the diagonal
    for step in tiled_attention(q, k, v, block_q, block_k).steps:
        fully_masked = np.isneginf(scores[slice(*step.q_rows), slice(*step.k_cols)]).all()
        assert step.skipped == fully_masked
    assert not any(s.skipped for s in tiled_attention(q, k, v, block_q, block_k, causal=False).steps)


def test_skipped_tile_count_on_a_worked_example():
    # N=8, blocks of 2: a 4 x 4 grid of tiles; the 3 + 2 + 1 = 6 tiles right of the diagonal are skipped
    q, k, v = random_head(8, 8, 4)
    walk = tiled_attention(q, k, v, 2, 2)
    assert len(walk.steps) == 16
    assert sum(s.skipped for s in walk.steps) == 6


def test_rows_fully_masked_inside_a_tile_stay_finite():
    # block_q=4, block_k=2: tile (q rows 0-3, k cols 2-3) hides every key from rows 0 and 1
    q, k, v = random_head(8, 8, 4, seed=5)
    walk = tiled_attention(q, k, v, block_q=4, block_k=2)
    step = next(s for s in walk.steps if s.q_block == 0 and s.k_block == 1)
    assert not step.skipped
    assert np.isneginf(step.scores[:2]).all()
    for s in walk.steps:
        for array in (s.row_max, s.row_sum, s.acc, s.partial_output):
            assert np.isfinite(array).all()
    assert np.isfinite(walk.output).all()


def test_a_skipped_tile_leaves_the_running_state_unchanged():
    q, k, v = random_head(8, 8, 4)
    steps = tiled_attention(q, k, v, 2, 2).steps
    for before, step in itertools.pairwise(steps):
        if step.skipped:
            assert np.isneginf(step.scores).all()
            np.testing.assert_array_equal(step.acc, before.acc)
            np.testing.assert_array_equal(step.row_sum, before.row_sum)


def test_bad_block_size_or_no_keys_is_refused():
    q, k, v = random_head(4, 4, 2)
    with pytest.raises(ValueError, match=r"block sizes must be >= 1; got 0, 2"):
        tiled_attention(q, k, v, 0, 2)
    with pytest.raises(ValueError, match=r"attention needs at least one key"):
        tiled_attention(q, k[:0], v[:0], 2, 2, causal=False)


# -----------------------------------------------------------------------------
# block size for the page


@pytest.mark.parametrize(
    "n, expected", [(0, 1), (1, 1), (2, 1), (3, 2), (5, 2), (6, 2), (13, 4), (64, 16), (512, 128), (10**5, 128)]
)
def test_default_block_size(n, expected):
    assert default_block_size(n) == expected


def test_default_block_size_gives_a_handful_of_blocks():
    for n in range(1, 513):
        block = default_block_size(n)
        assert block & (block - 1) == 0  # a power of two
        assert 1 <= math.ceil(n / block) <= 6


# -----------------------------------------------------------------------------
# memory and traffic formulas


def test_score_matrix_bytes():
    # 32768² = 2³⁰ scores: 2 GiB in fp16, 4 GiB in fp32, for one head
    assert score_matrix_bytes(32768, 2) == 2 * 1024**3 == 2147483648
    assert score_matrix_bytes(32768, 4) == 4 * 1024**3
    assert score_matrix_bytes(3, 4) == 36


def test_tile_buffer_bytes():
    # Bq=Bk=128, d=64, fp16:
    # Q 128·64 = 8192, K 8192, V 8192, scores 128·128 = 16384, acc 8192, m and ℓ 2·128 = 256
    # 8192·4 + 16384 + 256 = 49408 elements · 2 bytes = 98816 bytes (~96.5 KiB, fits in one SM's SRAM)
    assert tile_buffer_bytes(128, 128, 64, 2) == 98816
    # Bq=2, Bk=3, d=4, fp32: Q 8 + K 12 + V 12 + scores 6 + acc 8 + m, ℓ 4 = 50 elements · 4 = 200
    assert tile_buffer_bytes(2, 3, 4, 4) == 200


def test_naive_traffic_bytes():
    # n=4, d=2, fp32 (nd = 8, n² = 16):
    # reads  Q 8 + K 8 + S 16 + P 16 + V 8 = 56 elements · 4 = 224 bytes
    # writes S 16 + P 16 + O 8             = 40 elements · 4 = 160 bytes
    # total (4·8 + 4·16) · 4 = 384 bytes
    traffic = naive_traffic_bytes(4, 2, 4)
    assert (traffic.read_bytes, traffic.written_bytes, traffic.total) == (224, 160, 384)


def test_tiled_traffic_bytes():
    # n=4, d=2, Bq=2, fp32 (nd = 8, ⌈4/2⌉ = 2 query blocks):
    # reads  Q 8 + (K 8 + V 8) · 2 = 40 elements · 4 = 160 bytes
    # writes O 8 + L = m + log ℓ 4  = 12 elements · 4 = 48 bytes (FlashAttention-2 keeps one number per row)
    # total (8 + 2·8·2 + 8 + 4) · 4 = 208 bytes
    traffic = tiled_traffic_bytes(4, 2, 2, 4)
    assert (traffic.read_bytes, traffic.written_bytes, traffic.total) == (160, 48, 208)
    # one query block (Bq >= n): K and V are read only once: reads (8 + 16) · 4 = 96
    assert tiled_traffic_bytes(4, 2, 8, 4).read_bytes == 96


def test_tiled_moves_less_than_naive_on_a_long_prompt():
    # n = 32768, fp16, 128-row tiles: naive moves about 4n² elements, tiled about 2nd·n/Bq = n²·2d/Bq,
    # so the saving is about 2·Bq/d: 4x for d = 64, 2x for d = 128
    n = 32768
    assert tiled_traffic_bytes(n, 64, 128, 2).total < naive_traffic_bytes(n, 64, 2).total / 3.9
    assert tiled_traffic_bytes(n, 128, 128, 2).total < naive_traffic_bytes(n, 128, 2).total / 1.9


def test_tiled_traffic_still_grows_with_n_squared():
    # S and P stay on chip, but K and V are read once per query block: doubling n about quadruples the reads
    # n = 4096, d = 64, Bq = 128, fp16: (4096·64 + 2·4096·64·32) · 2 = 34 078 720 bytes
    small, large = tiled_traffic_bytes(4096, 64, 128, 2), tiled_traffic_bytes(8192, 64, 128, 2)
    assert small.read_bytes == 34_078_720
    assert 3.9 < large.read_bytes / small.read_bytes < 4.0
