"""Prefill and decode on two workers (DistServe, Splitwise; vLLM's disaggregated prefill): a second process prefills
each arriving prompt as a solo run does and sends its keys, values and last logits, which the engine's connector
(PrefillConnector) writes into blocks of its pool to decode. docs/serving.md, "Prefill and decode on two workers",
says how and what was measured.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import types
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from model.engine.loading import held_bytes, load_model
from model.engine.runtime import LoadedModel, ModelInfo, NativeModel
from model.serving.paged import PagedCache, PagedLayout
from model.serving.request import Request
from model.serving.runner import prompt_alone, run_rows

log = logging.getLogger(__name__)

STARTUP_S = 180.0     # the worker's import and model load, at most
TRANSFER_S = 60.0     # torch.distributed's timeout: a transfer that takes longer fails (the worker is taken as dead)
POLL_S = 0.05
DEFAULT_MAX_WORKERS = 2
_live_workers: set[int] = set()  # a place per prefill worker of this process, taken before its process starts
_workers_lock = threading.Lock()
_said_ignored: set[str] = set()  # the DECODE_LAB_MAX_WORKERS values already logged as ignored


@dataclass(frozen=True)
class Pairing:
    """How the two workers are joined: torch.distributed's backend and the prefill worker's device."""
    backend: str          # "nccl" | "gloo"
    worker_device: str    # "cpu", "cuda", "cuda:1"…

    @property
    def host_copies(self) -> bool:
        """Whether the tensors go through host memory (gloo) rather than GPU to GPU."""
        return self.backend == "gloo"


def pairing(device: torch.device) -> Pairing:
    """NCCL, the worker on the next GPU, where there are two GPUs or more (NCCL refuses two ranks on one GPU);
    otherwise gloo through host memory, the worker on this process's device."""
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count >= 2:
            index = device.index if device.index is not None else torch.cuda.current_device()
            return Pairing("nccl", f"cuda:{(index + 1) % count}")
    return Pairing("gloo", str(device))


def pair_group(store_file: str, rank: int, backend_name: str):
    """The two workers' own process group (rank 0 decodes, rank 1 prefills), met through a FileStore."""
    store = dist.FileStore(store_file, 2)
    store.set_timeout(timedelta(seconds=TRANSFER_S))
    if backend_name == "nccl":
        return dist.ProcessGroupNCCL(store, rank, 2)
    return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=TRANSFER_S))


def worker_device(device: str) -> str:
    """The device string load_model takes for `device`: a numbered GPU made the current one first."""
    if device.startswith("cuda:"):
        torch.cuda.set_device(int(device.split(":")[1]))
        return "cuda"
    return device


def held_positions(info: ModelInfo, layout: PagedLayout, n: int) -> list[int]:
    """Per group, the positions of an n-position prompt the cache holds and the worker sends."""
    return [info.held_positions(group.layers[0], n) for group in layout.groups]


@dataclass(frozen=True)
class Transfer:
    request: int
    step: int             # the decode worker's step that received it
    positions: int
    bytes: int            # of the keys and values received
    bytes_formula: int    # ModelInfo.cache_bytes_formula(positions)
    ms: float             # this process's recv of them
    prefill_ms: float     # the prefill worker's forward


def prefill_worker(conn, store_file: str, model_name: str, device: str, block_size: int, threads: int,
                   backend_name: str) -> None:
    """Rank 1: load the model, say "ready", join the pair's group, then prefill each prompt it is sent."""
    torch.set_num_threads(threads)
    model = load_model(model_name, worker_device(device))
    conn.send(("ready",))
    group = pair_group(store_file, 1, backend_name)
    layout = PagedLayout.of(model.info, block_size)
    cache = PagedCache(layout, layout.request_blocks(model.info.context_length), model.kv_dtype, model.device)
    wire = model.device if backend_name == "nccl" else torch.device("cpu")
    with torch.inference_mode():
        while True:
            message = conn.recv()
            if message[0] == "stop":
                break
            _, request, ids = message
            n = len(ids)
            rows = prompt_alone(cache, n)
            t0 = time.perf_counter()
            logits = run_rows(model.module, cache, rows, torch.tensor([ids], device=model.device))[0].float()
            prefill_ms = (time.perf_counter() - t0) * 1000
            parts = []
            for table, held in zip(cache.tables[0], held_positions(model.info, layout, n)):
                at = torch.tensor(table, device=model.device)
                keys, values = (store[:, :, at].flatten(2, 3)[:, :, n - held:n] for store in
                                (cache.keys, cache.values))       # (layers, n_kv, held, d_head)
                parts.append(torch.stack((keys, values)).flatten())
            kv = torch.cat(parts)
            conn.send(("prefilled", request, prefill_ms, n))
            group.send([logits.to(wire)], 0, 0).wait()
            group.send([kv.to(wire)], 0, 0).wait()


@contextmanager
def main_set_aside() -> Iterator[None]:
    """A spawned process runs its parent's __main__ again, which under `streamlit run` is the app's page: a bare
    module stands there while the worker starts."""
    main = sys.modules["__main__"]
    bare = types.ModuleType("__main__")
    sys.modules["__main__"] = bare
    try:
        yield
    finally:
        if sys.modules.get("__main__") is bare:  # another script run may have put its own there meanwhile
            sys.modules["__main__"] = main


def end_worker(conn, process, reserved: int, store_dir: str) -> None:
    """The worker told to stop (killed if it does not within seconds), its place freed, the pair's store deleted."""
    _live_workers.discard(reserved)
    shutil.rmtree(store_dir, ignore_errors=True)
    with suppress(OSError):
        conn.send(("stop",))
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join(5)
    conn.close()


class WorkerGone(Exception):
    """The prefill worker did not start, or stopped answering."""


class WorkersBusy(WorkerGone):
    """This process already runs max_workers() prefill workers, each holding a model of its own."""


def max_workers() -> int:
    """The most prefill workers this process runs at once (DECODE_LAB_MAX_WORKERS; no whole number: logged once,
    the default)."""
    value = os.environ.get("DECODE_LAB_MAX_WORKERS", "").strip()
    if not value:
        return DEFAULT_MAX_WORKERS
    try:
        return max(0, int(value))
    except ValueError:
        if value not in _said_ignored:
            _said_ignored.add(value)
            log.warning("DECODE_LAB_MAX_WORKERS=%r is no whole number: ignored, at most %d prefill workers", value,
                        DEFAULT_MAX_WORKERS)
        return DEFAULT_MAX_WORKERS


def worker_bytes(model: LoadedModel, block_size: int) -> tuple[int, int]:
    """What a prefill worker holds beside its own Python and torch: (its model's bytes, its KV cache's: blocks for
    one request of the whole context)."""
    layout = PagedLayout.of(model.info, block_size)
    weights = model.facts.held_bytes if model.facts is not None else held_bytes(model.module)
    return (weights, layout.request_blocks(model.info.context_length) * layout.block_bytes)


def live_workers() -> int:
    return len(_live_workers)


class PrefillWorker:
    """The prefill worker as this process sees it: started at once (WorkerGone when it cannot), prompts submitted,
    results received."""

    def __init__(self, model: NativeModel, model_name: str, block_size: int):
        with _workers_lock:
            if len(_live_workers) >= max_workers():
                raise WorkersBusy
            self._reserved = object()
            _live_workers.add(id(self._reserved))
        try:
            self._begin(model, model_name, block_size)
        except BaseException:
            _live_workers.discard(id(self._reserved))
            raise

    def _begin(self, model: NativeModel, model_name: str, block_size: int) -> None:
        self.model, self.layout = model, PagedLayout.of(model.info, block_size)
        self.pairing = pairing(model.device)
        self.wire = torch.device("cpu") if self.pairing.host_copies else model.device
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        # the pair's own store, a file in a folder only this user may enter (torch's TCPStore would listen on every
        # interface)
        self.store_dir = tempfile.mkdtemp(prefix="decode-lab-pair-")
        store_file = os.path.join(self.store_dir, "store")
        self.process = context.Process(target=prefill_worker, daemon=True, args=(
            child, store_file, model_name, self.pairing.worker_device, block_size, torch.get_num_threads(),
            self.pairing.backend))
        with main_set_aside():
            self.process.start()
        child.close()
        # ended by stop(), or when this object is dropped
        self._end = weakref.finalize(self, end_worker, self.conn, self.process, id(self._reserved), self.store_dir)
        try:
            if self._next(STARTUP_S) != ("ready",):
                raise WorkerGone
            self.group = pair_group(store_file, 0, self.pairing.backend)
        except (WorkerGone, OSError, RuntimeError, ValueError):
            self.stop()
            raise WorkerGone from None

    def _next(self, timeout: float):
        """The worker's next message, within `timeout` seconds; WorkerGone if it is dead or silent that long."""
        end = time.monotonic() + timeout
        while not self.conn.poll(POLL_S):
            if not self.process.is_alive() or time.monotonic() > end:
                raise WorkerGone
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise WorkerGone from None

    def submit(self, request: int, ids: list[int]) -> None:
        try:
            self.conn.send(("prefill", request, ids))
        except OSError:
            raise WorkerGone from None

    def receive(self, wait: bool) -> tuple[int, torch.Tensor, list[torch.Tensor], float, float] | None:
        """The next prefilled prompt (request, logits, per group its (2, layers, n_kv, held, d_head), recv ms, the
        worker's prefill ms); None when none is ready and `wait` is False."""
        if not wait and not self.conn.poll():
            if not self.process.is_alive():
                raise WorkerGone
            return None
        _, request, prefill_ms, n = self._next(TRANSFER_S)
        layout = self.layout
        held = held_positions(self.model.info, layout, n)
        per_position = 2 * layout.group_layers * layout.n_kv_heads * layout.d_head
        logits = torch.empty(self.model.info.vocab_size, dtype=torch.float32, device=self.wire)
        kv = torch.empty(sum(held) * per_position, dtype=self.model.kv_dtype, device=self.wire)
        t0 = time.perf_counter()
        try:
            self.group.recv([logits], 1, 0).wait()
            self.group.recv([kv], 1, 0).wait()
        except RuntimeError:
            raise WorkerGone from None
        ms = (time.perf_counter() - t0) * 1000
        groups = [part.view(2, layout.group_layers, layout.n_kv_heads, size, layout.d_head)
                  for part, size in zip(kv.split([size * per_position for size in held]), held)]
        return request, logits, groups, ms, prefill_ms

    def stop(self) -> None:
        """The worker ended (end_worker), once."""
        self._end()


class EngineState(Protocol):
    """What the connector reads of the engine that made it (engine.Engine, a floor above: it imports this module)."""
    waiting: deque[Request]
    running: list[Request]
    requests: dict[int, Request]
    steps_run: int

    @property
    def finished(self) -> bool: ...


class PrefillConnector:
    """The prefill worker as the engine's KV connector (vLLM's KVConnector): before each step's schedule it sends the
    prompts that arrived and takes what came back; the scheduler sees only that a request's blocks are coming
    (kv_at "remote"). A request preempted here is computed again here."""

    def __init__(self, model: NativeModel, model_name: str, block_size: int):
        self.model, self.model_name, self.block_size = model, model_name, block_size
        self.pairing = pairing(model.device)  # the backend and the worker's device, said by the page and the CLI
        self.transfers: list[Transfer] = []
        self.failure: tuple[str, int] | None = None  # ("start" | "died", the step), once the run went on alone
        self.worker: PrefillWorker | None = None
        self._start(None)

    def _start(self, engine: EngineState | None) -> None:
        try:
            self.worker = PrefillWorker(self.model, self.model_name, self.block_size)
        except WorkersBusy:
            self._alone("busy", engine)
        except WorkerGone:
            self._alone("start", engine)

    def _alone(self, why: str, engine: EngineState | None) -> None:
        """The worker gone: every prompt it has not sent back is prefilled here from now on."""
        self.close()
        self.failure = (why, 0 if engine is None else engine.steps_run)
        for seq in [] if engine is None else engine.waiting:
            if seq.kv_at == "remote" and seq.received_kv is None:
                seq.kv_at = "here"

    def step_begins(self, engine: EngineState) -> float:
        """Before a step's schedule: the exchange with the worker (one started again after a reset); its ms."""
        if self.worker is None and self.failure is None:
            self._start(engine)
        return 0.0 if self.worker is None else self._exchange(engine)

    def step_ends(self, engine: EngineState) -> None:
        if engine.finished:  # nothing left to prefill: the worker and the group let go
            self.close()

    def _exchange(self, engine: EngineState) -> float:
        """Send the prompts that arrived, take the results that are ready (waiting for the next one when nothing
        could run without it, on the clock); the ms spent."""
        index = engine.steps_run
        t0 = time.perf_counter()
        try:
            for seq in engine.waiting:
                if seq.arrival_step <= index and seq.kv_at == "here" and seq.preemptions == 0:
                    self.worker.submit(seq.id, seq.prompt_ids)
                    seq.kv_at = "remote"
            head = engine.waiting[0] if engine.waiting else None
            stalled = not engine.running and head is not None and head.kv_at == "remote"
            while True:
                waiting_for = stalled and head.received_kv is None
                got = self.worker.receive(wait=waiting_for)
                if got is None:
                    break
                rid, logits, kv, ms, prefill_ms = got
                request = engine.requests[rid]
                request.first_logits, request.received_kv = logits, kv
                n = request.prompt_len
                self.transfers.append(Transfer(rid, index, n, sum(t.numel() * t.element_size() for t in kv),
                                               self.model.info.cache_bytes_formula(n), ms, prefill_ms))
        except WorkerGone:
            self._alone("died", engine)
        return (time.perf_counter() - t0) * 1000

    def blocks_coming(self, cache: PagedCache, seq: Request, stop: int) -> int | None:
        """The pool's blocks the request's received prompt takes (its first token's place too); None while the worker
        has not sent it."""
        return None if seq.received_kv is None else cache.layout.request_blocks(len(seq.tokens))

    def load(self, cache: PagedCache, seq: Request) -> bool:
        """A prompt prefilled by the worker into blocks of its own (the scheduler checked they are free), a sliding
        group's places before the first position received left empty; True (a transfer's tensors are not checked)."""
        kv, seq.received_kv, seq.kv_at = seq.received_kv, None, "here"
        layout = cache.layout
        size, n = layout.block_size, seq.prompt_len
        tables = cache.tables_of(seq)
        for g, (table, group_kv) in enumerate(zip(tables, kv)):
            first = n - group_kv.shape[3]
            table.extend(None if (j + 1) * size <= first else cache.pool.allocate(g)
                         for j in range(layout.blocks(len(seq.tokens))))
            at = torch.arange(first, n)
            blocks = torch.tensor([table[p // size] for p in at.tolist()], device=cache.keys.device)
            offsets = (at % size).to(cache.keys.device)
            for store, received in zip((cache.keys, cache.values), group_kv):
                store[:, :, blocks, offsets] = received.to(store.device)
        return True

    def reset(self) -> None:
        """The worker ended (a new one starts at the next step), the transfers forgotten."""
        self.close()
        self.failure, self.transfers = None, []

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None

