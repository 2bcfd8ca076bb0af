"""What a session holds outside Python's heap (a prefill worker process, a tier file, a pool of hundreds of MB)
closed when the session ends, not when a garbage collection happens to run.

Streamlit keeps a closed tab's session for `server.disconnectedSessionTTL` seconds, in a TTL cache that drops an
expired session only when it is next written, and then only its references: the session's state sits in reference
cycles that only a full collection frees, which `runner.postScriptGC = false` leaves to Python's rare passes (faults
review 2026-12-04 #3: 2 GB and a worker held for minutes after eight tabs closed). So a page hands what it makes to
`hold`, and a sweeper thread, every SWEEP_S seconds, closes the things of every session the server no longer knows
(its TTL passed), then collects once.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from typing import Protocol

from streamlit.runtime import Runtime
from streamlit.runtime.scriptrunner import get_script_run_ctx

log = logging.getLogger(__name__)

SWEEP_S = 10.0


class Closable(Protocol):
    def close(self) -> None: ...


_held: dict[str, weakref.WeakSet] = {}  # session id -> what it holds (dropped sooner: gone from here too)
_lock = threading.Lock()
_sweeper: threading.Thread | None = None


def hold(thing: Closable) -> None:
    """`thing` closed when this script run's session ends (outside a server's session, as under AppTest: nothing)."""
    ctx = get_script_run_ctx()
    if ctx is None:
        return
    with _lock:
        _held.setdefault(ctx.session_id, weakref.WeakSet()).add(thing)
    _start_sweeper()


def session_known(session_id: str) -> bool:
    """Whether the server still has the session, connected or within its TTL (True where no server runs)."""
    if not Runtime.exists():
        return True
    manager = Runtime.instance()._session_mgr  # no public way to ask; written against Streamlit 1.67
    storage = getattr(manager, "_session_storage", None)
    expire = getattr(getattr(storage, "_cache", None), "expire", None)
    if expire is not None:
        expire()  # the TTL cache lets its expired sessions go now, not at its next write
    return manager.get_session_info(session_id) is not None


def sweep() -> int:
    """Close what ended sessions hold; how many things were closed."""
    with _lock:
        ended = [session_id for session_id in _held if not session_known(session_id)]
        things = [thing for session_id in ended for thing in list(_held.pop(session_id))]
    for thing in things:
        try:
            thing.close()
        except Exception:  # one failing close must not keep the others' processes and files
            log.exception("closing %r of an ended session failed", thing)
    if ended:
        gc.collect()  # the ended sessions' cycles (their pools, their histories) freed now
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
