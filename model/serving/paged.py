"""The paged KV cache (vLLM's PagedAttention): one pool of fixed-size blocks holding the keys and values of a group
of layers of one kind (layer_groups), a block table per request and group, and one forward pass over rows of
different lengths side by side, each row reading its keys through its tables: gathered into a copy (PagedPass), or
where they lie (PagedPassInPlace, the decode kernels over a float32 pool on a CPU). docs/serving.md (Serving II, and
"Every request's tokens are its solo run's") says how, and why each row keeps its solo run's bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from model.engine.llama import BlockKeys, RowKeys
from model.engine.runtime import ModelInfo
from model.serving.blocks import BlockPool

# positions: a prefix-cache hit is a multiple of this, 16 float32 filling one AVX-512 vector, so that torch's
# softmax (off the kernels) sums a hit's keys in its vector loop as the prompt's one prefill did
ALIGN = 16
FP8 = torch.float8_e4m3fn  # an fp8 pool's numbers (vLLM's --kv-cache-dtype fp8)
FP8_MAX = 448.0            # e4m3's largest finite number


@dataclass(frozen=True)
class LayerGroup:
    window: int | None       # the kind: its sliding window, None for full attention
    layers: tuple[int, ...]


def layer_groups(windows: tuple[int | None, ...]) -> tuple[LayerGroup, ...]:
    """The model's layers in groups of one kind, all of the same size (the kinds' layer counts' greatest common
    divisor: a block has the same bytes whichever kind holds it), in the order of their first layers."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    groups = [LayerGroup(window, tuple(layers[i:i + size])) for window, layers in kinds.items()
              for i in range(0, len(layers), size)]
    return tuple(sorted(groups, key=lambda g: g.layers[0]))


def first_seen(window: int | None, position: int) -> int:
    """The first key a query at `position` reads (cache.FullLayer / SlidingLayer.first_seen from position 0)."""
    return 0 if window is None else max(0, position - window + 1)


@dataclass(frozen=True)
class PagedLayout:
    groups: tuple[LayerGroup, ...]
    block_size: int
    n_kv_heads: int
    d_head: int
    bytes_per_element: int

    @classmethod
    def of(cls, info: ModelInfo, block_size: int) -> PagedLayout:
        return cls(layer_groups(info.layer_windows), block_size, info.n_kv_heads, info.d_head, info.bytes_per_element)

    @property
    def group_layers(self) -> int:
        return len(self.groups[0].layers)

    @property
    def position_bytes(self) -> int:
        """One position of one group: K and V of each of its layers, 2 × g × n_kv × d_head × bytes."""
        return 2 * self.group_layers * self.n_kv_heads * self.d_head * self.bytes_per_element

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.position_bytes

    def blocks(self, positions: int) -> int:
        """Blocks one group's table needs for `positions` positions."""
        return -(-positions // self.block_size)

    def request_blocks(self, positions: int) -> int:
        """The most blocks a request of `positions` positions holds at once: every group's table, sliding ones too."""
        return len(self.groups) * self.blocks(positions)


@dataclass(frozen=True)
class Row:
    """One row of a pass: `queries` new positions of one request from `start`, reading keys up to `keys_end`. A
    prompt's chunk (`masked`) reads its whole prompt's keys from position 0, those it does not see masked, as the
    prompt's one prefill does; any other row is one query over exactly the keys it sees, as a decode step does."""
    request: int
    start: int
    queries: int
    masked: bool
    keys_end: int

    @property
    def end(self) -> int:
        return self.start + self.queries


class PagedCache:
    """The pool's memory and bookkeeping: per layer of a group (its index i there), K and V (n_kv, n_blocks,
    block_size, d_head) in keys[i] and values[i], block b holding block_size positions of the layers of the group
    that holds it; the BlockPool; and each request's tables, per group a list of block ids by position // block_size
    (None where a sliding group freed a block its window passed)."""

    def __init__(self, layout: PagedLayout, n_blocks: int, dtype: torch.dtype, device: torch.device):
        self.layout, self.n_blocks = layout, n_blocks
        shape = (layout.group_layers, layout.n_kv_heads, n_blocks, layout.block_size, layout.d_head)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.pool = BlockPool(n_blocks)
        self.tables: dict[int, list[list[int | None]]] = {}
        self.where = {layer: (g, i) for g, group in enumerate(layout.groups) for i, layer in enumerate(group.layers)}
        # an fp8 pool: per layer, K's and V's scale, set by the layer's first write and kept (vLLM's
        # calculate_kv_scales: the first forward's largest |x| over e4m3's largest number)
        self.scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = {} if dtype == FP8 else None

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """New positions' K and V (n_kv, N, d_head) of `layer` into their blocks at their offsets (fp8: scaled, each
        number clamped to e4m3's range)."""
        i = self.where[layer][1]
        if self.scales is not None:
            if layer not in self.scales:  # the first write only: the scales are kept, not measured each pass
                self.scales[layer] = tuple(x.abs().amax().float().clamp_min(1e-12) / FP8_MAX for x in (k, v))
            k_scale, v_scale = self.scales[layer]
            k, v = ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX) for x, scale in ((k, k_scale), (v, v_scale)))
        self.keys[i][:, blocks, offsets] = k.to(self.keys.dtype)
        self.values[i][:, blocks, offsets] = v.to(self.values.dtype)

    def read(self, layer: int, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` in blocks `ids`, (n_kv, len(ids), block_size, d_head), in `dtype` (fp8: times their
        scales)."""
        i = self.where[layer][1]
        keys, values = self.keys[i][:, ids], self.values[i][:, ids]
        if self.scales is None:
            return keys, values
        k_scale, v_scale = self.scales[layer]
        return (keys.float() * k_scale).to(dtype), (values.float() * v_scale).to(dtype)

    @property
    def nbytes_reserved(self) -> int:
        """The pool's memory, every block: what the budget bought."""
        return 2 * self.keys.numel() * self.keys.element_size()

    def held_blocks(self) -> list[int]:
        """Blocks some request holds."""
        return [b.id for b in self.pool.blocks if b.refs > 0]

    def reset(self) -> None:
        self.pool.reset()
        self.tables.clear()

    def release(self) -> None:
        """The pool's memory let go now, not at a garbage collection: the cache takes no more steps."""
        self.keys, self.values = (store.new_empty(*store.shape[:2], 0, *store.shape[3:])
                                  for store in (self.keys, self.values))
        self.tables.clear()


class PagedPass:
    """One forward's writes and reads over a PagedCache: `rows` side by side, each request's rows reading its own
    tables (the blocks of every position a row writes are in them already)."""

    def __init__(self, cache: PagedCache, rows: list[Row], device: torch.device):
        self.cache, self.rows = cache, rows
        layout, size = cache.layout, cache.layout.block_size
        positions = [p for row in rows for p in range(row.start, row.end)]
        self.owners = [row.request for row in rows for _ in range(row.queries)]
        self.positions = torch.tensor(positions, device=device)                               # (N,)
        self.offsets = torch.tensor([p % size for p in positions], device=device)             # (N,)
        self.write_blocks = [torch.tensor([cache.tables[r][g][p // size] for r, p in zip(self.owners, positions)],
                                          device=device) for g in range(len(layout.groups))]  # per group (N,)
        # per request and kind, the first block its rows read (0 under a prompt's chunk) and the blocks up to its last
        # row's end: each request's keys are gathered once per layer for all its rows
        self.spans: dict[tuple[int, int | None], tuple[int, int]] = {}
        for row in rows:
            for window in {g.window for g in layout.groups}:
                first = 0 if row.masked else first_seen(window, row.start) // size
                low, high = self.spans.get((row.request, window), (first, 0))
                self.spans[(row.request, window)] = (min(low, first), max(high, layout.blocks(row.keys_end)))

        def at(row: Row, window: int | None, position: int) -> int:  # a position's index among the gathered keys
            return position - self.spans[(row.request, window)][0] * size

        self.row_keys = {window: RowKeys(
            tuple(at(row, window, 0 if row.masked else first_seen(window, row.start)) for row in rows),
            tuple(at(row, window, row.keys_end) for row in rows), tuple(row.queries for row in rows),
            tuple(at(row, window, row.start) for row in rows), window) for window in {g.window for g in layout.groups}}

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], ...]:
        """The new positions' K, V (1, n_kv, N, d_head) into their blocks; returns per row its request's keys and
        values (1, n_kv, positions, d_head), from the first block its rows read: what row_keys index."""
        group = self.cache.where[layer][0]
        window = self.cache.layout.groups[group].window
        self.cache.write(layer, self.write_blocks[group], self.offsets, k[0], v[0])  # (n_kv, N, d_head)
        n_kv, d_head = k.shape[1], k.shape[-1]
        gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for request in dict.fromkeys(row.request for row in self.rows):
            low, high = self.spans[(request, window)]
            ids = torch.tensor(self.cache.tables[request][group][low:high], device=k.device)
            gathered[request] = tuple(store.view(1, n_kv, -1, d_head)
                                      for store in self.cache.read(layer, ids, k.dtype))
        return (tuple(gathered[row.request][0] for row in self.rows),
                tuple(gathered[row.request][1] for row in self.rows))


class PagedPassInPlace(PagedPass):
    """A PagedPass whose layers read their keys where they lie, through the tables (BlockKeys for
    kernels.attend_paged), instead of a gathered copy (runner.reads_in_place). Each query reads exactly the positions
    its row's mask leaves it, so its bits are those of the copy's path."""

    def __init__(self, cache: PagedCache, rows: list[Row], device: torch.device):
        super().__init__(cache, rows, device)
        layout = cache.layout
        requests = list(dict.fromkeys(self.owners))
        index = {request: i for i, request in enumerate(requests)}
        self.query_row = torch.tensor([index[owner] for owner in self.owners], dtype=torch.int64, device=device)
        # per group each request's table, padded to one width; None (a block a sliding window passed) as 0, never read
        width = max(len(cache.tables[request][g]) for request in requests for g in range(len(layout.groups)))
        self.tables = [torch.tensor([[0 if b is None else b for b in cache.tables[request][g]]
                                     + [0] * (width - len(cache.tables[request][g])) for request in requests],
                                    dtype=torch.int64, device=device) for g in range(len(layout.groups))]
        # per kind each query's positions: a prompt's chunk causal (within the window), a decode row its keys
        self.query_spans: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}
        for window in {g.window for g in layout.groups}:
            first, end = [], []
            for row in rows:
                row_first = 0 if row.masked else first_seen(window, row.start)
                for p in range(row.start, row.end):
                    first.append(max(row_first, first_seen(window, p)))
                    end.append(min(row.keys_end, p + 1))
            self.query_spans[window] = (torch.tensor(first, dtype=torch.int64, device=device),
                                        torch.tensor(end, dtype=torch.int64, device=device))

    reads_in_place = True  # llama.Block.pass_in_place: a Llama layer then runs in one call of the decode kernels

    def in_place(self, layer: int) -> tuple[BlockKeys, torch.Tensor, torch.Tensor]:
        """The layer's stores and the tables as one BlockKeys, and where the pass's new positions go in those stores
        (their blocks and offsets, (N,) each): for llama.Block.pass_in_place, whose one kernel call writes them."""
        group, i = self.cache.where[layer]
        read = BlockKeys(self.cache.keys[i], self.cache.values[i], self.tables[group], self.query_row,
                         *self.query_spans[self.cache.layout.groups[group].window])
        return read, self.write_blocks[group], self.offsets

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[BlockKeys, BlockKeys]:
        """The new positions' K, V (1, n_kv, N, d_head) into their blocks; returns the layer's stores and the tables
        as one BlockKeys (for k and v alike), nothing copied."""
        read, blocks, offsets = self.in_place(layer)
        self.cache.write(layer, blocks, offsets, k[0], v[0])  # (n_kv, N, d_head)
        return read, read
