"""What a session holds outside Python's heap (a prefill worker process, a tier file, a pool of hundreds of MB)
closed when the session ends, not when a garbage collection happens to run.

Streamlit keeps a closed tab's session for `server.disconnectedSessionTTL` seconds, in a TTL cache that drops an
expired session only when it is next written, and then only its references: the session's state sits in reference
cycles that only a full collection frees, which `runner.postScriptGC = false` leaves to Python's rare passes (faults
review 2026-12-04 #3: 2 GB and a worker held for minutes after eight tabs closed). So a page hands what it makes to
`hold`, and a sweeper thread, every SWEEP_S seconds, closes the things of every session the server no longer knows
(its TTL passed: asked on the server's event loop, where Streamlit keeps its sessions), then collects once. A close
lets go of the run's pool, tier file and worker itself (QueueRun.close); the collection frees the rest.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol, TypeVar

from streamlit.runtime import Runtime
from streamlit.runtime.scriptrunner import get_script_run_ctx

log = logging.getLogger(__name__)

SWEEP_S = 10.0
DEGRADED_GC_S = 60.0  # where the server cannot be asked which sessions ended: a full collection this often instead
T = TypeVar("T")


class Closable(Protocol):
    def close(self) -> None: ...


_held: dict[str, weakref.WeakSet] = {}  # session id -> what it holds (dropped sooner: gone from here too)
_lock = threading.Lock()
_sweeper: threading.Thread | None = None
_degraded: list[str] = []  # why the server cannot be asked (logged once), empty while it can
_last_gc = 0.0


def hold(thing: Closable) -> None:
    """`thing` closed when this script run's session ends (outside a server's session, as under AppTest: nothing)."""
    ctx = get_script_run_ctx()
    if ctx is None:
        return
    with _lock:
        _held.setdefault(ctx.session_id, weakref.WeakSet()).add(thing)
    _start_sweeper()


def session_known(session_id: str) -> bool:
    """Whether the server still has the session, connected or within its TTL (True where no server runs). Run on the
    server's event loop (on_server_loop): Streamlit's session storage is a TTL cache that is not thread-safe, which
    only that loop touches. No public way to ask: written against Streamlit 1.67's internals (AttributeError where
    they changed)."""
    if not Runtime.exists():
        return True
    manager = Runtime.instance()._session_mgr
    expire = getattr(getattr(getattr(manager, "_session_storage", None), "_cache", None), "expire", None)
    if expire is not None:
        expire()  # the TTL cache lets its expired sessions go now, not at its next write
    return manager.get_session_info(session_id) is not None


def on_server_loop(ask: Callable[[], T]) -> T | None:
    """ask() run on the server's event loop and its answer (here, where no server runs); None where it cannot be:
    Streamlit's internals not as written against (logged once: the sweep then degrades to a collection every
    DEGRADED_GC_S), or no answer within SWEEP_S."""
    if not Runtime.exists():
        return ask()
    try:
        loop = Runtime.instance()._get_async_objs().eventloop
        answer: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                answer.set_result(ask())
            except BaseException as failed:  # handed to the sweeper's thread, which says it
                answer.set_exception(failed)

        loop.call_soon_threadsafe(run)
        return answer.result(timeout=SWEEP_S)
    except concurrent.futures.TimeoutError:
        log.warning("the server's event loop did not answer the session-end sweep within %s s", SWEEP_S)
    except Exception as failed:
        if not _degraded:
            log.warning("the session-end sweep cannot ask Streamlit which sessions ended (%s: %s; written against "
                        "Streamlit 1.67): what a closed tab holds is freed by a full collection every %d s instead",
                        type(failed).__name__, failed, DEGRADED_GC_S)
        _degraded[:] = [type(failed).__name__]
    return None


def sweep() -> int:
    """Close what ended sessions hold; how many things were closed."""
    global _last_gc
    with _lock:
        held = list(_held)
    ended = on_server_loop(lambda: [session_id for session_id in held if not session_known(session_id)])
    if ended is None:  # not known which ended: a full collection now and then frees the dropped runs' cycles
        if held and time.monotonic() - _last_gc >= DEGRADED_GC_S:
            _last_gc = time.monotonic()
            gc.collect()
        return 0
    with _lock:
        things = [thing for session_id in ended if session_id in _held for thing in list(_held.pop(session_id))]
    for thing in things:
        try:
            thing.close()
        except Exception:  # one failing close must not keep the others' processes and files
            log.exception("closing %r of an ended session failed", thing)
    if ended:
        gc.collect()  # the ended sessions' cycles (their histories) freed now
    return len(things)


def _start_sweeper() -> None:
    global _sweeper
    with _lock:
        if _sweeper is not None and _sweeper.is_alive():
            return
        _sweeper = threading.Thread(target=_sweep_forever, name="decode-lab-session-end", daemon=True)
        _sweeper.start()


def _sweep_forever() -> None:
    stop = threading.Event()
    while not stop.wait(SWEEP_S):
        try:
            sweep()
        except Exception:
            log.exception("the session-end sweep failed")
