"""A second, slower tier for the pool's blocks (vLLM V0's preemption by swap, vLLM V1's OffloadingConnector, LMCache);
docs/serving.md, "Serving III", says how (model/serving/crossover.py measures when a move beats a recompute).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import os
import secrets
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model.engine.runtime import NativeModel, synchronize
from model.errors import InputError
from model.serving.paged import PagedCache, PagedLayout
from model.serving.request import Request
from model.weights.catalog import env_megabytes

log = logging.getLogger(__name__)

TIER_KINDS = ("disk", "host")
TIER_FILE_PREFIX = "decode-lab-kv-"
# why a disk tier could not be made, by the OS's error: the text key that says it
UNWRITABLE = {errno.ENOENT: "tier.missing", errno.ENOTDIR: "tier.missing", errno.EACCES: "tier.read_only",
              errno.EPERM: "tier.read_only", errno.EROFS: "tier.read_only", errno.ENOSPC: "tier.full",
              errno.EDQUOT: "tier.full", errno.EFBIG: "tier.full"}
DEFAULT_TIER_MB = 1024
_live_bytes: dict[int, int] = {}  # the bytes of every tier alive in this process: tier_cap_bytes() at most


def block_shape(layout: PagedLayout) -> tuple[int, ...]:
    """One slot: K and V of a block, (2, group layers, KV heads, block size, head dim)."""
    return 2, layout.group_layers, layout.n_kv_heads, layout.block_size, layout.d_head


def held(tables: list[list[int | None]]) -> list[int]:
    """The blocks (or slots) of a request's tables in order, without the places a sliding window let go."""
    return [b for table in tables for b in table if b is not None]


def slot_bytes(layout: PagedLayout, dtype: torch.dtype) -> int:
    return math.prod(block_shape(layout)) * dtype.itemsize


def as_bytes(block: torch.Tensor) -> memoryview:
    """A contiguous block's bytes, in place (a write reads them, a read fills them; any dtype, bfloat16's too)."""
    return memoryview(block.view(torch.uint8).numpy()).cast("B")


def digest(block: torch.Tensor) -> bytes:
    return hashlib.blake2b(as_bytes(block.contiguous()), digest_size=16).digest()


class Tier:
    """`n_slots` slots of block_shape in the pool's dtype, handed out from a free queue, each held slot's bytes
    hashed. A disk tier's slots lie in its file, read and written through its descriptor, never a memory mapping (a
    file cut short is then a damaged block, not a SIGBUS); a host tier's in `store`."""

    def __init__(self, kind: str, n_slots: int, layout: PagedLayout, dtype: torch.dtype,
                 store: torch.Tensor | None = None, path: Path | None = None, fd: int | None = None):
        self.kind, self.n_slots, self.shape, self.dtype = kind, n_slots, block_shape(layout), dtype
        self.store, self.path, self.fd = store, path, fd
        self.slot_bytes = slot_bytes(layout, dtype)
        self.free_slots: deque[int] = deque(range(n_slots))
        self.hashes: dict[int, bytes] = {}
        # the file closed and deleted by close(), or when the tier is dropped without it
        self._deleted = weakref.finalize(self, release_file, fd, path) if path is not None else None
        _live_bytes[id(self)] = self.nbytes
        weakref.finalize(self, _live_bytes.pop, id(self), None)

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.slot_bytes

    @property
    def n_free(self) -> int:
        return len(self.free_slots)

    def write(self, blocks: torch.Tensor) -> list[int]:
        """blocks (k, *block_shape) on the host into k free slots (the caller checked n_free); their slots. OSError
        when the file cannot take them."""
        slots = [self.free_slots.popleft() for _ in range(blocks.shape[0])]
        try:
            for slot, block in zip(slots, blocks):
                self.hashes[slot] = digest(block)
                if self.fd is None:
                    self.store[slot] = block
                elif os.pwrite(self.fd, as_bytes(block), slot * self.slot_bytes) != self.slot_bytes:
                    raise OSError(errno.EIO, "short write")
        except OSError:
            self.free(slots)
            raise
        return slots

    def read(self, slots: list[int]) -> tuple[torch.Tensor, list[int]]:
        """A copy of the slots' blocks, and the slots whose bytes no longer match their hash or could not be read."""
        if self.fd is None:
            blocks = self.store[torch.tensor(slots, dtype=torch.long)]
            return blocks, [slot for slot, block in zip(slots, blocks) if digest(block) != self.hashes[slot]]
        blocks = torch.zeros((len(slots), *self.shape), dtype=self.dtype)
        damaged = []
        for slot, block in zip(slots, blocks):
            try:
                whole = os.preadv(self.fd, [as_bytes(block)], slot * self.slot_bytes) == self.slot_bytes
            except OSError:
                whole = False
            if not whole or digest(block) != self.hashes[slot]:
                damaged.append(slot)
        return blocks, damaged

    def free(self, slots: list[int]) -> None:
        for slot in slots:
            self.hashes.pop(slot, None)
            self.free_slots.append(slot)

    def close(self) -> None:
        """The memory let go, and the disk tier's file closed and deleted."""
        self.store = None
        _live_bytes.pop(id(self), None)
        if self._deleted is not None:
            self._deleted()


def tier_cap_bytes() -> int:
    """The most bytes the tiers of this process may hold together (DECODE_LAB_TIER_MB)."""
    return env_megabytes("DECODE_LAB_TIER_MB", DEFAULT_TIER_MB)


def release_file(fd: int | None, path: Path) -> None:
    """Close the tier's file and delete it; a folder that no longer lets it go is logged (sweep_stale_tiers)."""
    if fd is not None:
        with suppress(OSError):
            os.close(fd)
    try:
        path.unlink(missing_ok=True)
    except OSError as failed:
        log.warning("the tier file %s could not be deleted: %s", path, failed)


def sweep_stale_tiers(folder: Path) -> list[Path]:
    """Delete the tier files in `folder` of processes no longer alive; the ones deleted."""
    swept = []
    for path in folder.glob(f"{TIER_FILE_PREFIX}*.tier"):
        pid = path.name.removeprefix(TIER_FILE_PREFIX).partition("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            with suppress(OSError):
                path.unlink()
                swept.append(path)
    return swept


def unwritable(folder: str, n_bytes: int, reason: str) -> InputError:
    return InputError("tier_unwritable", folder=folder, mib_number=round(n_bytes / 2**20, 2), reason_text=reason)


def disk_tier(folder: str, slots: int, layout: PagedLayout, dtype: torch.dtype) -> Tier:
    """A new file of `slots` blocks in `folder`, reserved whole; InputError when the folder cannot take it (nothing is
    left behind) or this process's tiers would pass tier_cap_bytes."""
    n_bytes = slots * slot_bytes(layout, dtype)
    cap, live = tier_cap_bytes(), sum(_live_bytes.values())
    if live + n_bytes > cap:
        raise InputError("tier_cap", mib_number=round(n_bytes / 2**20, 2), cap_number=round(cap / 2**20, 2),
                         live_number=round(live / 2**20, 2))
    place = Path(folder)
    if place.exists() and not place.is_dir():
        raise unwritable(folder, n_bytes, "tier.not_folder")
    if place.is_dir():
        sweep_stale_tiers(place)
    path = place / f"{TIER_FILE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}.tier"
    handle = None
    try:
        handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.posix_fallocate(handle, 0, n_bytes)
    except OSError as failed:
        if handle is not None:
            release_file(handle, path)
        reason = UNWRITABLE.get(failed.errno, "tier.other")
        if reason == "tier.missing" and place.is_dir():  # a folder that takes no new file (/proc): not "missing"
            reason = "tier.no_files"
        raise unwritable(folder, n_bytes, reason) from None
    return Tier("disk", slots, layout, dtype, path=path, fd=handle)


def host_tier(slots: int, layout: PagedLayout, dtype: torch.dtype) -> Tier:
    """`slots` blocks of host memory, pinned where a GPU is there (its copies then run at the link's speed)."""
    store = torch.empty((slots, *block_shape(layout)), dtype=dtype, pin_memory=torch.cuda.is_available())
    return Tier("host", slots, layout, dtype, store=store)


def tier_maker(kind: str, folder: str | None, slots: int, layout: PagedLayout,
               dtype: torch.dtype) -> Callable[[], Tier]:
    """What makes the tier (again after a reset); the disk tier's folder by default the system's temporary one."""
    if kind == "disk":
        return lambda: disk_tier(folder or tempfile.gettempdir(), slots, layout, dtype)
    return lambda: host_tier(slots, layout, dtype)


def tier_slots(layout: PagedLayout, budget_bytes: int, tier_bytes: int | None) -> int:
    """The slots of the tier an Engine makes: as many as its pool has blocks, or `tier_bytes`' worth."""
    return (budget_bytes if tier_bytes is None else tier_bytes) // layout.block_bytes


def tier_file_bytes(model: NativeModel, block_size: int, budget_bytes: int, tier_bytes: int | None = None) -> int:
    """The bytes of that tier's file (what its folder's refusal names)."""
    layout = PagedLayout.of(model.info, block_size)
    return tier_slots(layout, budget_bytes, tier_bytes) * slot_bytes(layout, model.kv_dtype)


def check_tier_folder(model: NativeModel, settings) -> None:
    """The tier an Engine under `settings` makes, made and deleted at once: its folder's refusal names its own size,
    before the crossover's smaller scratch tier is made."""
    layout = PagedLayout.of(model.info, settings.block_size)
    slots = tier_slots(layout, settings.budget_bytes, settings.tier_bytes)
    check_tier(settings.offload, model.device)
    if slots == 0:
        return  # Engine refuses it (tier_budget)
    tier_maker(settings.offload, settings.tier_folder, slots, layout, model.kv_dtype)().close()


def tier_kind(device: torch.device) -> str:
    """The second tier below a pool on `device`: host memory below a GPU's, a file on disk below a CPU's."""
    return "host" if device.type == "cuda" else "disk"


def check_tier(kind: str, device: torch.device) -> None:
    """Host memory is a tier only below a GPU's memory: on a CPU the pool is in it already."""
    if kind == "host" and device.type != "cuda":
        raise InputError("offload_host_on_cpu")


@dataclass(frozen=True)
class TierView:
    """The tier as a page draws it, slot by slot."""
    holder: np.ndarray      # the request whose block the slot holds, −1 when free
    went_out: np.ndarray    # written in the last step
    came_back: np.ndarray   # the request the slot's block went back to in the last step (the slot now free), −1


@dataclass
class Moves:
    """What went through the tier, counted since the run began."""
    blocks_out: int = 0
    blocks_in: int = 0
    ms_out: float = 0.0
    ms_in: float = 0.0


class Offload:
    """A pool's second tier (made at once, so that a folder that cannot take it is said before any step, and again
    after a reset at the first move out), the slots each moved-out request holds there, and the moves."""

    def __init__(self, make_tier: Callable[[], Tier], block_bytes: int, swap_from: int | None):
        self.make_tier, self.block_bytes, self.swap_from = make_tier, block_bytes, swap_from
        self.tier: Tier | None = make_tier()
        self.kind, self.tier_bytes = self.tier.kind, self.tier.nbytes
        self.out: dict[int, list[list[int | None]]] = {}  # request -> per group, per table place: its slot
        self.moves = Moves()
        self.failure: InputError | None = None            # why the tier could not be made again, once
        self.went_out: dict[int, list[int]] = {}          # the last step's moves: request -> slots
        self.came_back: dict[int, list[int]] = {}

    def should_move(self, positions: int) -> bool:
        return self.swap_from is not None and positions >= self.swap_from

    def step_begins(self) -> None:
        self.went_out, self.came_back = {}, {}

    def move_out(self, cache: PagedCache, request: int) -> str | None:
        """The request's blocks copied into the tier; None when done, else why not ("full", "unwritable")."""
        if self.tier is None:
            try:
                self.tier = self.make_tier()
            except InputError as failed:
                self.failure = failed
                return "unwritable"
        tables = cache.tables[request]
        ids = held(tables)
        if len(ids) > self.tier.n_free:
            return "full"
        t0 = time.perf_counter()
        at = torch.tensor(ids, device=cache.keys.device)
        blocks = torch.stack((cache.keys[:, :, at], cache.values[:, :, at])).permute(3, 0, 1, 2, 4, 5).cpu()
        try:
            slots = iter(self.tier.write(blocks.contiguous()))
        except OSError as failed:
            log.warning("writing to the tier file %s failed: %s", self.tier.path, failed)
            self.failure = unwritable(str(self.tier.path.parent), self.tier.nbytes, "tier.other")
            return "unwritable"
        self.out[request] = [[None if b is None else next(slots) for b in table] for table in tables]
        self.moves.ms_out += (time.perf_counter() - t0) * 1000
        self.moves.blocks_out += len(ids)
        self.went_out[request] = held(self.out[request])
        return None

    def blocks_coming(self, cache: PagedCache, seq: Request, stop: int) -> int:
        """The pool's blocks the request takes once its blocks are back and it grows to `stop` positions."""
        out = self.out[seq.id]
        return len(held(out)) + sum(max(0, cache.layout.blocks(stop) - len(table)) for table in out)

    def load(self, cache: PagedCache, seq: Request) -> bool:
        """Its blocks moved back into the pool (the scheduler checked blocks_coming are free); False when one came
        back damaged: its positions are computed again."""
        tables = self.move_in(cache, seq.id)
        seq.kv_at = "here"
        if tables is None:
            seq.computed, seq.hashes = 0, []
            return False
        cache.tables[seq.id] = tables
        return True

    def move_in(self, cache: PagedCache, request: int) -> list[list[int | None]] | None:
        """The request's blocks read back, checked, into new blocks of the pool (the caller checked n_free); its
        tables, or None when a block came back damaged. Its slots are free after."""
        out = self.out.pop(request)
        slots = held(out)
        t0 = time.perf_counter()
        blocks, damaged = self.tier.read(slots)
        self.tier.free(slots)
        self.came_back[request] = slots
        if damaged:
            return None
        tables = [[None if s is None else cache.pool.allocate(g) for s in table] for g, table in enumerate(out)]
        at = torch.tensor(held(tables), device=cache.keys.device)
        blocks = blocks.to(cache.keys.device).permute(1, 2, 3, 0, 4, 5)  # (2, layers, n_kv, k, block_size, d_head)
        cache.keys[:, :, at], cache.values[:, :, at] = blocks[0], blocks[1]
        synchronize(cache.keys.device)
        self.moves.ms_in += (time.perf_counter() - t0) * 1000
        self.moves.blocks_in += len(slots)
        return tables

    def forget(self, request: int) -> None:
        """A moved-out request that will not come back (aborted): its slots free."""
        self.tier.free(held(self.out.pop(request, [])))

    def view(self) -> TierView:
        n = 0 if self.tier is None else self.tier.n_slots
        holder, went_out, came_back = np.full(n, -1), np.zeros(n, dtype=bool), np.full(n, -1)
        for request, tables in self.out.items():
            holder[held(tables)] = request
        for request, slots in self.went_out.items():
            went_out[[s for s in slots if holder[s] == request]] = True
        for request, slots in self.came_back.items():
            came_back[[s for s in slots if holder[s] < 0]] = request
        return TierView(holder, went_out, came_back)

    def close(self) -> None:
        """The tier's file deleted (made again at the next move out); what moved is still counted."""
        tier, self.tier = self.tier, None
        if tier is not None:
            tier.close()

    def reset(self) -> None:
        """Every slot free, the file deleted, the counts at zero."""
        self.close()
        self.out, self.moves, self.failure = {}, Moves(), None
        self.went_out, self.came_back = {}, {}
