"""ui/session_end.py: what a session holds (a tier file, a prefill worker) is closed by the sweep once the server no
longer knows the session, not at a garbage collection (faults review 2026-12-04 #3); a failing close does not keep
the others."""

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


def test_outside_a_server_hold_keeps_nothing(monkeypatch):
    monkeypatch.setattr(session_end, "_held", {})
    session_end.hold(Thing())  # no script run context (a test, the CLI)
    assert session_end._held == {}
