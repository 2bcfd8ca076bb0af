"""The engine's own thread. The Engine is not thread-safe, so exactly one thread touches it: HTTP handlers put
commands (add, abort, a state snapshot, stop) on a thread-safe inbox, and this loop drains the inbox between steps,
steps while there is work, and hands every request's new tokens back through its `deliver` callback (the HTTP side
makes that callback thread-safe, e.g. with loop.call_soon_threadsafe).

It also keeps what the engine does not: wall-clock stamps per request (TTFT, inter-token latencies, end-to-end, in
the sense of vLLM's metrics: from the moment the server accepted the request), the last steps and finished requests
for /v1/engine/state, the counters of /metrics, and the bound on the waiting queue (429 past it)."""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

import torch

from model.engine.kernels import cpu_name
from model.engine.sampling import SamplingSettings
from model.errors import InputError
from model.serving.engine import Engine, EngineSettings, StepRecord
from model.serving.request import Request
from server.metrics import Metrics

log = logging.getLogger("decode_lab.server")

STEPS_KEPT = 32       # the last steps /v1/engine/state shows
FINISHED_KEPT = 500   # the last finished requests it shows
IDLE_WAIT_S = 0.5     # how long an idle loop sleeps on its inbox before looking again (a stop wakes it at once)
# engine stop reasons as OpenAI's finish_reason: eos → "stop", the token budget or the context → "length"
FINISH_REASONS = {"eos": "stop", "max_new_tokens": "length", "context_full": "length"}


class QueueFull(Exception):
    """The waiting queue holds --max-waiting requests: the caller answers 429."""


class Stopping(Exception):
    """The server is shutting down: the caller answers 503."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Event:
    """What the loop tells a request's caller: "added" (its rid), "refused" (an InputError: it could never run),
    "tokens" (new ids, and with logprobs per id (logprob, [(id, logprob), ...])), "finished" (reason: an engine stop
    reason, "abort", "shutdown" or "error"; with usage)."""
    kind: str
    rid: int | None = None
    ids: tuple[int, ...] = ()
    logprobs: tuple = ()
    reason: str | None = None
    error: InputError | None = None
    usage: Usage | None = None


@dataclass
class Submission:
    """One request as the HTTP side hands it over; `deliver` is called on the engine thread."""
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingSettings
    deliver: Callable[[Event], None]
    logprobs: int | None = None
    user: str | None = None
    kind: str = "cmpl"        # the response id's prefix: "cmpl" or "chatcmpl"
    ignore_eos: bool = False
    accepted_at: float = field(default_factory=time.perf_counter)
    rid: int | None = None    # set on the engine thread once added


@dataclass
class Tracker:
    """A live request as the loop follows it (engine thread only)."""
    submission: Submission
    request: Request
    sent: int = 0                     # tokens delivered so far
    token_times: list[float] = field(default_factory=list)
    concurrent: int | None = None     # requests running when its first token came
    fresh: bool = True                # not admitted yet: it counts against --max-waiting


class EngineLoop:
    def __init__(self, model, settings: EngineSettings, max_waiting: int = 256):
        self.model = model
        self.engine = Engine(model, [], settings)
        self.max_waiting = max_waiting
        self.inbox: queue.Queue = queue.Queue()
        self.live: dict[int, Tracker] = {}
        self.steps: deque[dict] = deque(maxlen=STEPS_KEPT)
        self.finished: deque[dict] = deque(maxlen=FINISHED_KEPT)
        self.metrics = Metrics(model.info.name)
        self.metrics.set_gauges(0, 0, 0, self.engine.cache.n_blocks)
        self.started = time.time()
        self.conditions = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "dtype": model.info.dtype,
                           "torch": torch.__version__, "max_waiting": max_waiting,
                           "device": str(model.info.device)}
        self._queued = 0                  # accepted and not admitted yet (the bounded queue), under _lock
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stopped = threading.Event()
        self.stopping = False             # a stop was asked: no new requests (the HTTP side answers 503)

    # -- the HTTP side's calls (any thread) ---------------------------------------------------------------------------

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def submit(self, submission: Submission) -> None:
        """Queue a request; QueueFull when --max-waiting are already waiting (never an unbounded backlog)."""
        with self._lock:  # with request_stop's: an accepted request is always ahead of the stop in the inbox
            if self.stopping:
                raise Stopping("the server is shutting down: it takes no new requests.")
            if self._queued >= self.max_waiting:
                raise QueueFull(f"the server's waiting queue is full ({self.max_waiting} requests): retry later.")
            self._queued += 1
            self.inbox.put(("add", submission))

    def abort(self, submission: Submission, reason: str = "abort") -> None:
        """End it now, its blocks freed at once (a disconnected client, a stop string found)."""
        self.inbox.put(("abort", submission, reason))

    def snapshot(self, deliver: Callable[[dict], None]) -> None:
        """deliver(state) on the engine thread between two steps (the engine is read by its own thread only)."""
        self.inbox.put(("state", deliver))

    def request_stop(self) -> None:
        """Abort every request (their callers get a "shutdown" finish), close the engine, end the thread; returns
        at once (stop() waits)."""
        with self._lock:
            if not self.stopping:
                self.stopping = True
                self.inbox.put(("stop",))

    def stop(self, timeout: float = 10.0) -> None:
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    # -- the engine thread --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                busy = bool(self.engine.waiting or self.engine.running)
                if not self._drain(block=not busy):
                    break
                if self.engine.waiting or self.engine.running:
                    self._step()
        finally:
            self._shut_down()

    def _drain(self, block: bool) -> bool:
        """Handle every command waiting in the inbox (when idle, wait for the first); False on stop."""
        try:
            command = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                return False
            self._handle(command)
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._add(command[1])
        elif kind == "abort":
            self._abort(command[1], command[2])
        elif kind == "state":
            command[1](self.state())

    def _add(self, sub: Submission) -> None:
        try:
            request = self.engine.add_request(sub.prompt_ids, sub.max_new_tokens, sub.sampling,
                                              ignore_eos=sub.ignore_eos)
        except InputError as refused:
            self._unqueue()
            sub.deliver(Event("refused", error=refused))
            return
        request.logprobs = sub.logprobs
        sub.rid = request.id
        self.live[request.id] = Tracker(sub, request)
        sub.deliver(Event("added", rid=request.id))

    def _abort(self, sub: Submission, reason: str) -> None:
        tracker = self.live.get(sub.rid) if sub.rid is not None else None
        if tracker is None:
            return
        self.engine.abort(tracker.request.id)
        self._finish(tracker, reason, time.perf_counter())

    def _unqueue(self) -> None:
        with self._lock:
            self._queued -= 1

    def _step(self) -> None:
        try:
            record = self.engine.step()
        except Exception:  # a bug must not take the whole server down: its requests end with an error
            log.error("engine step failed; aborting its %d requests:\n%s", len(self.live), traceback.format_exc())
            for tracker in list(self.live.values()):
                self.engine.abort(tracker.request.id)
                self._finish(tracker, "error", time.perf_counter())
            return
        now = time.perf_counter()
        self._admitted(record)
        for rid in {span.request for span in record.spans}:
            tracker = self.live.get(rid)
            if tracker is not None:
                self._deliver_tokens(tracker, now, record.running)
                if tracker.request.stop_reason is not None:
                    self._finish(tracker, tracker.request.stop_reason, now)
        self.metrics.observe_step(len(record.preempted))
        self.steps.append(step_json(record, time.time()))
        self._set_gauges()

    def _admitted(self, record: StepRecord) -> None:
        """Admitted requests leave the bounded queue; every admission is a prefix-cache query (in tokens)."""
        for rid in record.admitted:
            tracker = self.live.get(rid)
            if tracker is None:
                continue
            if tracker.fresh:
                tracker.fresh = False
                self._unqueue()
            self.metrics.observe_prefix(len(tracker.request.tokens) - 1 if tracker.request.new_ids
                                        else tracker.request.prompt_len, record.cached_positions.get(rid, 0))

    def _deliver_tokens(self, tracker: Tracker, now: float, running: int) -> None:
        request = tracker.request
        new = request.new_ids[tracker.sent:]
        if not new:
            return
        if tracker.concurrent is None:
            tracker.concurrent = running
        tracker.token_times += [now] * len(new)
        logprobs = tuple(request.token_logprobs[tracker.sent:]) if request.logprobs is not None else ()
        tracker.sent = len(request.new_ids)
        tracker.submission.deliver(Event("tokens", rid=request.id, ids=tuple(new), logprobs=logprobs))

    def _finish(self, tracker: Tracker, reason: str, now: float) -> None:
        request, sub = tracker.request, tracker.submission
        self.live.pop(request.id, None)
        if tracker.fresh:
            self._unqueue()
        usage = Usage(request.prompt_len, tracker.sent, request.cached_positions)
        times = tracker.token_times
        ttft = (times[0] - sub.accepted_at) if times else None
        itl = [b - a for a, b in pairwise(times)]
        e2e = now - sub.accepted_at
        self.metrics.observe_finished(FINISH_REASONS.get(reason, reason), usage.prompt_tokens,
                                      usage.completion_tokens, ttft, itl, e2e)
        self.finished.append({"request": request.id, "user": sub.user, "prompt_tokens": usage.prompt_tokens,
                              "completion_tokens": usage.completion_tokens, "cached_tokens": usage.cached_tokens,
                              "ttft_ms": None if ttft is None else ttft * 1000, "itl_ms": [x * 1000 for x in itl],
                              "e2e_ms": e2e * 1000, "concurrent": tracker.concurrent or 0,
                              "finish_reason": FINISH_REASONS.get(reason, reason)})
        sub.deliver(Event("finished", rid=request.id, reason=reason, usage=usage))

    def _set_gauges(self) -> None:
        engine = self.engine
        used = engine.cache.n_blocks - engine.cache.pool.n_free
        self.metrics.set_gauges(len(engine.running), len(engine.waiting), used, engine.cache.n_blocks)

    def _shut_down(self) -> None:
        running = sum(1 for t in self.live.values() if t.request in self.engine.running)
        waiting = len(self.live) - running
        now = time.perf_counter()
        for tracker in list(self.live.values()):
            self.engine.abort(tracker.request.id)
            self._finish(tracker, "shutdown", now)
        # commands that came in after the stop: their callers must not wait for ever
        while True:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                self._unqueue()
                command[1].deliver(Event("finished", reason="shutdown", usage=Usage(0, 0, 0)))
            elif command[0] == "state":
                command[1](self.state())
        log.warning("shutting down: aborted %d running and %d waiting requests", running, waiting)
        self.engine.close()
        self._stopped.set()

    # -- /v1/engine/state (engine thread) -------------------------------------------------------------------------

    def state(self) -> dict:
        engine, view = self.engine, self.engine.pool_view()
        requests = {}
        for rid, tracker in self.live.items():
            request, sub = tracker.request, tracker.submission
            requests[str(rid)] = {"id": f"{sub.kind}-{rid}", "user": sub.user,
                                  "state": "running" if request in engine.running else "waiting",
                                  "prompt_tokens": request.prompt_len, "completion_tokens": len(request.new_ids),
                                  "cached_tokens": request.cached_positions, "preemptions": request.preemptions}
        return {"model": self.model.info.name, "block_size": view.block_size, "n_blocks": engine.cache.n_blocks,
                "block_bytes": engine.layout.block_bytes,
                "pool": {"holder": view.holder.tolist(), "refs": view.refs.tolist(), "cached": view.cached.tolist(),
                         "filled": view.filled.tolist()},
                "tables": {str(rid): tables for rid, tables in view.tables.items()},
                "running": [r.id for r in engine.running], "waiting": [r.id for r in engine.waiting],
                "requests": requests, "steps": list(self.steps), "finished": list(self.finished),
                "conditions": self.conditions, "uptime_s": time.time() - self.started}


def step_json(record: StepRecord, when: float) -> dict:
    return {"index": record.index, "time": when, "ms": record.ms, "tokens": record.tokens, "running": record.running,
            "blocks_held": record.blocks_held, "admitted": list(record.admitted),
            "preempted": list(record.preempted), "left": list(record.left),
            "cached_positions": {str(k): v for k, v in record.cached_positions.items()},
            "spans": [{"request": s.request, "start": s.start, "stop": s.stop, "kind": s.kind}
                      for s in record.spans]}
