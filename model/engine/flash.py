"""Flash Attention in numpy, one head at a time: the tile walk with an online softmax, and the byte
arithmetic that says why it pays off.

The walk follows FlashAttention-2's loop order (Dao, 2023): query blocks in the outer loop, key/value
blocks in the inner one, so each query block's output is written once and K, V are read once per query
block. Algorithm 1 of the first FlashAttention paper (Dao et al., 2022) nests the loops the other way:
K, V blocks outside, and Q, O, m, ℓ read and written again for every key block.

q is (Nq, d_head), k and v are (Nk, d_head). Under the causal mask the last query lines up with the
last key, so query i may see keys j <= i + Nk - Nq (prefill: Nq == Nk; one decode step: Nq == 1).
Everything is computed in the input dtype (float32 in the app), so the tiled result is compared with
the naive one at the precision the model really runs at.
"""

import math
from dataclasses import dataclass

import numpy as np

# -----------------------------------------------------------------------------
# the standard path: the whole (Nq, Nk) score matrix at once


def _check_head(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> None:
    if q.ndim != 2 or k.ndim != 2 or v.shape != k.shape or q.shape[1] != k.shape[1]:
        raise ValueError(f"expected q (Nq, d) and k, v (Nk, d); got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[0] == 0:
        raise ValueError("attention needs at least one key")
    if causal and q.shape[0] > k.shape[0]:
        # with more queries than keys the first queries would see no key at all
        raise ValueError(f"causal attention needs Nq <= Nk; got Nq={q.shape[0]}, Nk={k.shape[0]}")


def _masked_scores(q_tile, k_tile, q_rows, k_cols, causal_offset, causal) -> np.ndarray:
    """Scaled scores q kᵀ/√d for rows q_rows × columns k_cols, -inf where the causal mask hides a key."""
    scores = q_tile @ k_tile.T / math.sqrt(q_tile.shape[1])  # (Bq, Bk)
    if causal:
        rows = np.arange(*q_rows)[:, None]  # (Bq, 1) query positions
        cols = np.arange(*k_cols)[None, :]  # (1, Bk) key positions
        scores = np.where(cols <= rows + causal_offset, scores, -np.inf)
    return scores


def attention_scores(q: np.ndarray, k: np.ndarray, causal: bool = True) -> np.ndarray:
    """The full (Nq, Nk) matrix q kᵀ/√d_head, -inf above the causal diagonal."""
    n_q, n_k = q.shape[0], k.shape[0]
    return _masked_scores(q, k, (0, n_q), (0, n_k), n_k - n_q, causal)


def naive_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = True) -> np.ndarray:
    """softmax(q kᵀ/√d_head + mask) v, materialising every score. Returns (Nq, d_head)."""
    _check_head(q, k, v, causal)
    scores = attention_scores(q, k, causal)  # (Nq, Nk)
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))  # (Nq, Nk), 0 where masked
    weights /= weights.sum(axis=1, keepdims=True)
    return weights @ v  # (Nq, d_head)


# -----------------------------------------------------------------------------
# the tiled path: one (Bq, Bk) tile at a time, with a running (online) softmax


@dataclass(frozen=True)
class TileStep:
    """One tile of the walk, and the running statistics of its query rows after it."""

    q_block: int
    k_block: int
    q_rows: tuple[int, int]  # (start, stop) query positions of the tile
    k_cols: tuple[int, int]  # (start, stop) key positions of the tile
    skipped: bool  # entirely above the causal diagonal: this query block does not read this key block's K, V
    scores: np.ndarray  # (Bq, Bk) q kᵀ/√d of the tile, -inf where masked (all -inf when skipped)
    row_max: np.ndarray  # (Bq,) m: the largest score each row has seen so far
    row_sum: np.ndarray  # (Bq,) ℓ: sum of exp(score - row_max) over the keys seen so far
    acc: np.ndarray  # (Bq, d_head) sum of exp(score - row_max) · v, not yet divided by row_sum
    partial_output: np.ndarray  # (Bq, d_head) acc / row_sum: the answer if the keys stopped here


@dataclass(frozen=True)
class TiledAttention:
    steps: list[TileStep]  # in walk order: query block by query block, key blocks left to right
    output: np.ndarray  # (Nq, d_head)
    block_q: int
    block_k: int
    n_q_blocks: int
    n_k_blocks: int


def _online_softmax_update(row_max, row_sum, acc, scores, v_tile):
    """Fold one tile of scores into the running max, sum and output of its rows."""
    new_max = np.maximum(row_max, scores.max(axis=1))  # (Bq,)
    # sums taken against the old max are worth exp(old - new) against the new one
    rescale = np.exp(row_max - new_max)  # (Bq,), 0 on the first tile where row_max is -inf
    weights = np.exp(scores - new_max[:, None])  # (Bq, Bk) un-normalised, 0 where masked
    row_sum = row_sum * rescale + weights.sum(axis=1)
    acc = acc * rescale[:, None] + weights @ v_tile  # (Bq, d_head)
    return new_max, row_sum, acc


def tiled_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, block_q: int, block_k: int, causal: bool = True
) -> TiledAttention:
    """The same result as naive_attention, never holding more than one (block_q, block_k) score tile.

    For each query block the key/value blocks are visited in order, keeping per row the running
    max m, the running sum ℓ and the un-normalised output acc; the output acc / ℓ is written once,
    at the end of the query block. Key 0 is visible to every query (Nq <= Nk), so after the first
    key block every row has a finite max and ℓ >= 1: later tiles never divide by 0 or meet inf - inf.
    """
    _check_head(q, k, v, causal)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be >= 1; got {block_q}, {block_k}")
    n_q, n_k = q.shape[0], k.shape[0]
    causal_offset = n_k - n_q  # the last query sits on the last key
    output = np.empty_like(q)  # (Nq, d_head)
    steps = []
    for q_block, q_start in enumerate(range(0, n_q, block_q)):
        q_stop = min(q_start + block_q, n_q)
        q_tile = q[q_start:q_stop]  # (Bq, d_head)
        row_max = np.full(len(q_tile), -np.inf, dtype=q.dtype)  # (Bq,)
        row_sum = np.zeros(len(q_tile), dtype=q.dtype)  # (Bq,)
        acc = np.zeros_like(q_tile)  # (Bq, d_head)
        for k_block, k_start in enumerate(range(0, n_k, block_k)):
            k_stop = min(k_start + block_k, n_k)
            # even the tile's last query may not see its first key: nothing to read or compute
            skipped = causal and k_start > q_stop - 1 + causal_offset
            if skipped:
                scores = np.full((len(q_tile), k_stop - k_start), -np.inf, dtype=q.dtype)  # (Bq, Bk)
            else:
                scores = _masked_scores(
                    q_tile, k[k_start:k_stop], (q_start, q_stop), (k_start, k_stop), causal_offset, causal
                )  # (Bq, Bk)
                row_max, row_sum, acc = _online_softmax_update(
                    row_max, row_sum, acc, scores, v[k_start:k_stop]
                )
            step = TileStep(
                q_block=q_block,
                k_block=k_block,
                q_rows=(q_start, q_stop),
                k_cols=(k_start, k_stop),
                skipped=skipped,
                scores=scores,
                row_max=row_max,
                row_sum=row_sum,
                acc=acc,
                partial_output=acc / row_sum[:, None],
            )
            steps.append(step)
        output[q_start:q_stop] = step.partial_output
    return TiledAttention(
        steps=steps,
        output=output,
        block_q=block_q,
        block_k=block_k,
        n_q_blocks=math.ceil(n_q / block_q),
        n_k_blocks=math.ceil(n_k / block_k),
    )


def default_block_size(n: int) -> int:
    """A power of two near n/4, between 1 and 128, so a prompt of n tokens walks a handful of tiles; at least 2
    from 3 tokens on, so a tile groups several scores (two tokens keep 1 × 1 tiles: a 2 × 2 one would be all)."""
    return min(128, 2 ** round(math.log2(max(n / 4, 1 if n <= 2 else 2))))


# -----------------------------------------------------------------------------
# memory and traffic arithmetic, in bytes, for one head


@dataclass(frozen=True)
class Traffic:
    """Bytes moved between main memory (GPU HBM / DRAM) and the chip."""

    read_bytes: int
    written_bytes: int

    @property
    def total(self) -> int:
        return self.read_bytes + self.written_bytes


def score_matrix_bytes(n: int, bytes_per_element: int) -> int:
    """The full score matrix S = Q Kᵀ of one head: n · n · bytes."""
    return n * n * bytes_per_element


def tile_buffer_bytes(block_q: int, block_k: int, d_head: int, bytes_per_element: int) -> int:
    """What one tiled step keeps on chip (SRAM):
    (Bq·d [Q tile] + Bk·d [K tile] + Bk·d [V tile] + Bq·Bk [scores] + Bq·d [acc] + 2·Bq [m, ℓ]) · bytes.
    """
    elements = block_q * d_head + 2 * block_k * d_head + block_q * block_k + block_q * d_head + 2 * block_q
    return elements * bytes_per_element


def naive_traffic_bytes(n: int, d_head: int, bytes_per_element: int) -> Traffic:
    """Standard attention, each intermediate going through main memory:
    read Q, K (2nd), write S (n²), read S (n²), write P (n²), read P (n²) and V (nd), write O (nd).
    Reads (3nd + 2n²) · bytes, writes (nd + 2n²) · bytes, total (4nd + 4n²) · bytes.
    """
    read = 3 * n * d_head + 2 * n * n
    written = n * d_head + 2 * n * n
    return Traffic(read * bytes_per_element, written * bytes_per_element)


def tiled_traffic_bytes(n: int, d_head: int, block_q: int, bytes_per_element: int) -> Traffic:
    """Tiled (Flash) attention in FlashAttention-2's loop order: read Q once (nd), read K and V once per
    query block (2nd · ⌈n/Bq⌉), write O once (nd) and one log-sum-exp L = m + log ℓ per row, kept for the
    backward pass (n).
    Reads (nd + 2nd·⌈n/Bq⌉) · bytes, writes (nd + n) · bytes. S and P never leave the chip, but the K, V
    re-reads still grow as n²: about 2n²d/Bq elements, against the 4n² of S and P in the naive path.
    This is the non-causal upper bound; with the causal mask the tiles above the diagonal are skipped,
    which saves roughly half of the K, V reads.
    """
    read = n * d_head + 2 * n * d_head * math.ceil(n / block_q)
    written = n * d_head + n
    return Traffic(read * bytes_per_element, written * bytes_per_element)


# -----------------------------------------------------------------------------
# one head of a real model, for the live page

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
RELATIVE_TOLERANCE = 1e-5  # 128 × 128 is the usual tile on a GPU


def block_size_choices(n: int) -> list[int]:
    """The block sizes worth offering for n tokens: up to the first one that holds all n in one tile."""
    return [b for b in BLOCK_SIZES if b == 1 or b // 2 < n]


@dataclass(frozen=True)
class HeadWalk:
    """The tiled walk over one head of a real prefill, beside the naive answer it must equal."""

    kv_head: int  # the KV head the chosen query head reads
    walk: TiledAttention
    naive: np.ndarray  # (N, d_head) softmax(q kᵀ/√d_head + causal mask) v
    max_abs_diff: float  # max |tiled − naive| over the whole output

    @property
    def tolerance(self) -> float:
        """The largest max |Δ| that is float32 rounding: 1e-5 of the output's largest value, at least 1e-5
        (Gemma 3's values reach 70, so its rounding reaches 2e-5 where a small model's stays under 1e-6)."""
        return RELATIVE_TOLERANCE * max(1.0, float(np.max(np.abs(self.naive))))

    @property
    def read_steps(self) -> list[int]:
        """Indices of the steps whose tile is really read, in walk order: the causal loop of a real kernel
        stops at the diagonal, so the skipped tiles are never visited."""
        return [i for i, step in enumerate(self.walk.steps) if not step.skipped]

    def before(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """m, ℓ of the rows of step `index` before it, and α = e^(m before − m after) that rescales them;
        (Bq,) each. On the first tile of a query block m is -inf and ℓ is 0, so α is 0."""
        step = self.walk.steps[index]
        if step.k_block == 0:
            row_max, row_sum = np.full_like(step.row_max, -np.inf), np.zeros_like(step.row_sum)
        else:  # the previous step is the same query block, one key block to the left
            row_max, row_sum = self.walk.steps[index - 1].row_max, self.walk.steps[index - 1].row_sum
        return row_max, row_sum, np.exp(row_max - step.row_max)

    def gap(self, step: TileStep) -> float:
        """max |running output − final output| over the rows of one step: 0 once its query block is done."""
        return float(np.max(np.abs(step.partial_output - self.naive[slice(*step.q_rows)])))


def walk_head(model, ids: list[int], layer: int, head: int, block: int) -> HeadWalk:
    """Prefill ids through `model` (a NativeModel: it has attention_inputs), take query head `head` of
    `layer` and the KV head it reads under GQA (h // (n_heads / n_kv_heads)), and attend tile by tile
    with block × block tiles, in float32."""
    q, k, v = model.attention_inputs(ids, layer)  # (n_heads, N, d), (n_kv, N, d), (n_kv, N, d) tensors
    kv_head = model.info.kv_head(head)
    q, k, v = (x.float().cpu().numpy() for x in (q[head], k[kv_head], v[kv_head]))  # (N, d_head) each
    walk = tiled_attention(q, k, v, block, block)
    naive = naive_attention(q, k, v)
    return HeadWalk(kv_head, walk, naive, float(np.max(np.abs(walk.output - naive))))


def human_bytes(n: int, decimal: str = ".") -> str:
    """1536 -> '1.5 KiB', 2**31 -> '2 GiB' (binary units, at most three significant digits)."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    shown = f"{value:.3g}" if unit != "B" else str(n)
    if "e" in shown:  # 1000 ≤ value < 1024 would print as 1e+03
        shown = f"{value:.0f}"
    return f"{shown.replace('.', decimal)} {unit}"
