"""ui/session_end.py: what a session holds (a tier file, a prefill worker) is closed by the sweep once the server no
longer knows the session, not at a garbage collection (faults review 2026-12-04 #3); a failing close does not keep
the others."""

import asyncio
import logging
import threading
import types

import pytest
from test_tiers import tier_files, tight

from model.serving import kv_runs
from ui import session_end


class Thing:
    def __init__(self, fails=False):
        self.closed, self.fails = 0, fails

    def close(self):
        self.closed += 1
        if self.fails:
            raise OSError("no")


@pytest.fixture
def sessions(monkeypatch):
    """Sessions known to a stand-in server: the set of ids it still has; hold() called as from a session's script."""
    known = set()
    monkeypatch.setattr(session_end, "_held", {})
    monkeypatch.setattr(session_end, "_start_sweeper", lambda: None)
    monkeypatch.setattr(session_end, "session_known", lambda sid: sid in known)

    def as_session(sid, thing):
        known.add(sid)
        monkeypatch.setattr(session_end, "get_script_run_ctx", lambda: types.SimpleNamespace(session_id=sid))
        session_end.hold(thing)

    return known, as_session


def test_an_ended_session_s_things_are_closed_once_and_a_live_one_s_kept(sessions):
    known, as_session = sessions
    a, b, c = Thing(), Thing(fails=True), Thing()
    as_session("one", a)
    as_session("one", b)
    as_session("two", c)
    assert session_end.sweep() == 0 and a.closed == b.closed == c.closed == 0
    known.discard("one")
    assert session_end.sweep() == 2 and (a.closed, b.closed, c.closed) == (1, 1, 0)
    assert session_end.sweep() == 0 and a.closed == 1  # once


def test_an_ended_session_s_tier_file_is_deleted_by_the_sweep(sessions, small, tmp_path):
    known, as_session = sessions
    requests, settings = tight(small, tmp_path)
    run = kv_runs.QueueRun(small, requests, kv_runs.KVSettings("paged", settings.block_size, settings.budget_bytes,
                                                               offload="disk", tier_folder=str(tmp_path)))
    as_session("tab", run)
    assert len(tier_files(tmp_path)) == 1
    known.discard("tab")
    session_end.sweep()
    assert tier_files(tmp_path) == []
    assert run.server.cache.nbytes_reserved == 0  # the pool let go by close itself, not left to the collector


def test_an_ended_session_s_prefill_worker_and_pool_are_let_go_by_the_sweep(sessions, small):
    """faults 2026-12-04 #3: a closed tab's two-worker run: the worker process ended, its place among
    DECODE_LAB_MAX_WORKERS free again, the pool's K and V dropped by the sweep's close (a reference elsewhere to
    the run, as a session's cycles keep, does not hold them)."""
    from model.serving import disaggregated, queues

    known, as_session = sessions
    requests = queues.built_in_queue(small, "mixed")
    budget = kv_runs.default_budget(small, "mixed", requests, 16)
    run = kv_runs.QueueRun(small, requests, kv_runs.KVSettings("paged", 16, budget, prefill_worker="small"))
    process = run.server.connector.worker.process
    as_session("tab", run)
    run.server.step()
    assert process.is_alive() and disaggregated.live_workers() == 1 and run.server.cache.nbytes_reserved > 0
    known.discard("tab")
    assert session_end.sweep() == 1
    assert not process.is_alive() and disaggregated.live_workers() == 0 and run.server.connector.worker is None
    assert run.server.cache.nbytes_reserved == 0 and run.server.cache.keys.numel() == 0


class FakeServer:
    """Streamlit's runtime as the sweep reads it (Streamlit 1.67): its event loop on a thread of its own, a session
    manager whose storage records the thread each call came from."""

    def __init__(self, known: set[str]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.threads = []
        cache = types.SimpleNamespace(expire=lambda: self.threads.append(threading.current_thread()))
        self._session_mgr = types.SimpleNamespace(
            _session_storage=types.SimpleNamespace(_cache=cache),
            get_session_info=lambda sid: self.threads.append(threading.current_thread()) or (
                object() if sid in known else None))

    def _get_async_objs(self):
        return types.SimpleNamespace(eventloop=self.loop)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def test_the_sweep_asks_the_server_on_its_event_loop_only(monkeypatch):
    """Streamlit's session storage is a TTL cache that is not thread-safe: the sweeper thread never touches it
    (expire, get_session_info), it asks on the server's event loop."""
    monkeypatch.setattr(session_end, "_held", {})
    monkeypatch.setattr(session_end, "_start_sweeper", lambda: None)
    server = FakeServer({"live"})
    monkeypatch.setattr(session_end, "Runtime", types.SimpleNamespace(exists=lambda: True, instance=lambda: server))
    try:
        things = {sid: Thing() for sid in ("live", "gone")}
        for sid, thing in things.items():
            monkeypatch.setattr(session_end, "get_script_run_ctx",
                                lambda sid=sid: types.SimpleNamespace(session_id=sid))
            session_end.hold(thing)
        assert session_end.sweep() == 1 and (things["live"].closed, things["gone"].closed) == (0, 1)
        assert server.threads and set(server.threads) == {server.thread}
    finally:
        server.stop()


def test_a_streamlit_without_those_internals_is_logged_once_and_the_sweep_degrades_to_a_collection(monkeypatch,
                                                                                                    caplog):
    """Streamlit's private Runtime._session_mgr (or its loop) renamed: one log line, nothing closed, no exception in
    the sweeper; a full collection now and then instead (what the closed tabs dropped is freed by it)."""
    monkeypatch.setattr(session_end, "_held", {})
    monkeypatch.setattr(session_end, "_degraded", [], raising=False)
    monkeypatch.setattr(session_end, "_last_gc", 0.0, raising=False)
    monkeypatch.setattr(session_end, "_start_sweeper", lambda: None)
    monkeypatch.setattr(session_end, "get_script_run_ctx", lambda: types.SimpleNamespace(session_id="tab"))
    monkeypatch.setattr(session_end, "Runtime", types.SimpleNamespace(exists=lambda: True,
                                                                      instance=lambda: types.SimpleNamespace()))
    collections = []
    monkeypatch.setattr(session_end.gc, "collect", lambda: collections.append(1))
    thing = Thing()
    session_end.hold(thing)
    with caplog.at_level(logging.WARNING, logger=session_end.__name__):
        assert [session_end.sweep() for _ in range(3)] == [0, 0, 0]
    said = [r.getMessage() for r in caplog.records if r.name == session_end.__name__]
    assert len(said) == 1 and "cannot ask Streamlit" in said[0] and thing.closed == 0
    assert collections == [1]  # once per DEGRADED_GC_S


def test_outside_a_server_hold_keeps_nothing(monkeypatch):
    monkeypatch.setattr(session_end, "_held", {})
    session_end.hold(Thing())  # no script run context (a test, the CLI)
    assert session_end._held == {}
