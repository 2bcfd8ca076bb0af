"""How much work the KV cache saves, counted in positions processed, and how big it gets."""

from __future__ import annotations


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
