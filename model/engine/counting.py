"""How much work the KV cache saves, counted in positions processed, and how big it gets."""

from __future__ import annotations

from dataclasses import dataclass


def positions_with_cache(prompt_len: int, new_tokens: int) -> int:
    """The prompt once, then every new token but the last fed back once: N + (T − 1)."""
    return prompt_len + max(new_tokens - 1, 0)


def positions_without_cache(prompt_len: int, new_tokens: int) -> int:
    """Step k re-reads the whole sequence so far, N + k − 1 positions: Σ_{k=1..T} (N + k − 1)."""
    return new_tokens * prompt_len + new_tokens * (new_tokens - 1) // 2


def cumulative_positions(prompt_len: int, new_tokens: int) -> tuple[list[int], list[int]]:
    """Running totals after each output token k = 1..T: (with cache, without cache)."""
    with_cache = [positions_with_cache(prompt_len, k) for k in range(1, new_tokens + 1)]
    without_cache = [positions_without_cache(prompt_len, k) for k in range(1, new_tokens + 1)]
    return with_cache, without_cache


def cache_bytes_formula(n_layers: int, n_kv_heads: int, positions: int, d_head: int, bytes_per_element: int,
                        sliding_layers: int = 0, window: int | None = None) -> int:
    """K and V (the 2) for every layer, KV head, position and dimension. Of the n_layers, `sliding_layers` attend
    over a sliding window and hold at most `window` positions (Gemma 3 270M: 3 × n + 15 × min(n, 512) positions)."""
    held = (n_layers - sliding_layers) * positions + sliding_layers * min(positions, window or positions)
    return 2 * n_kv_heads * held * d_head * bytes_per_element


@dataclass(frozen=True)
class CacheShape:
    """What a model's KV cache bytes depend on: a loaded model's (ModelInfo.cache_shape) or a recording's."""
    n_layers: int
    n_kv_heads: int
    d_head: int
    bytes_per_element: int
    sliding_layers: int = 0        # of the n_layers, those that keep only a window (Gemma 3 270M: 15 of 18)
    window: int | None = None

    def bytes(self, positions: int) -> int:
        """cache_bytes_formula: what the cache holds after `positions` positions."""
        return cache_bytes_formula(self.n_layers, self.n_kv_heads, positions, self.d_head, self.bytes_per_element,
                                   self.sliding_layers, self.window)

    def held(self, positions: int) -> int:
        """The positions a sliding layer holds after `positions`: its window at most."""
        return min(positions, self.window or positions)

    def bytes_by_kind(self, positions: int) -> tuple[int, int]:
        """(the full layers' bytes, the sliding layers' bytes) after `positions` positions."""
        full = cache_bytes_formula(self.n_layers - self.sliding_layers, self.n_kv_heads, positions, self.d_head,
                                   self.bytes_per_element)
        sliding = cache_bytes_formula(self.sliding_layers, self.n_kv_heads, self.held(positions), self.d_head,
                                      self.bytes_per_element)
        return full, sliding


# -- one step's work, the roofline's two axes ------------------------------------------------------------------
# A step feeds `new` positions to a row whose attention then reads `keys` positions (decode: 1 new, keys = the row's
# length after the step; a prefill of N: N new over N keys). Norms, RoPE, softmax and the residual adds are left out:
# they are a few operations per element of the hidden state, against ~2 per weight in the matmuls.

def step_flops(layer_matmul_params: int, head_params: int, n_layers: int, n_heads: int, d_head: int,
               rows: list[tuple[int, int]], sliding_layers: int = 0, window: int | None = None) -> int:
    """Floating-point operations of one step over `rows` = [(new positions, keys attended), ...]: every new position
    multiplies-and-adds each weight of the layers' matmuls once (2 × layer_matmul_params), the LM head runs on each
    row's last position only (2 × head_params: inference needs no other logits), and per layer each query head does
    Q·Kᵀ and weights·V over the keys, 2 × d_head operations per key each (4 × n_heads × d_head × keys).
    A prefill's N × N scores count whole: the engine computes the masked half too, then adds −∞. Of the n_layers,
    `sliding_layers` read at most window + new − 1 keys (a decode step: its window; a prefill from an empty cache
    still scores every key, the mask hides those outside the window)."""
    per_key = 4 * n_heads * d_head
    full = n_layers - sliding_layers
    return sum(2 * layer_matmul_params * new + 2 * head_params
               + per_key * new * (full * keys + sliding_layers * min(keys, (window or keys) + new - 1))
               for new, keys in rows)


def step_bytes(weight_bytes: int, row_cache_bytes: list[int]) -> int:
    """Bytes one step reads from memory at the least: every weight once, however many rows share it, plus each
    row's own K and V cache (cache_bytes_formula of its length)."""
    return weight_bytes + sum(row_cache_bytes)
