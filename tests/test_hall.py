"""A lecture hall (deploy/hall.py, `./dev serve`): two replicas behind nginx, twenty websocket sessions through it,
a replica killed in the middle of their runs, a clean stop, and the sentences of a bad configuration.

Runs in the plain suite (about a minute on 2 cores); skipped, saying why, only where nginx cannot be had
(`./dev test` installs Debian's package first, as it does chromium).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import websockets

from loadtest.ws_client import (
    LectureHall,
    Session,
    choose_sampling,
    descendants,
    free_port,
    open_decode_session,
    prompts_for,
    run_async,
    solo_trace_ids,
)

ROOT = Path(__file__).resolve().parent.parent
HALL = [sys.executable, str(ROOT / "deploy" / "hall.py")]
SESSIONS = 20
NEXTS_BEFORE_KILL, NEXTS_AFTER_KILL = 4, 4
NEW_TOKENS = 1 + NEXTS_BEFORE_KILL + NEXTS_AFTER_KILL  # the prefill draws the first
ABNORMAL_CLOSURE = 1006  # the websocket code for a connection that ended without a close frame
TEMPERATURE = 0.9  # sampled, each session its own seed: a draw that leaked between sessions would show

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    shutil.which("nginx") is None and shutil.which("nginx", path="/usr/sbin") is None,
    reason="nginx is not installed and this run may not install it: `./dev test` (or apt-get install -y nginx) "
           "installs Debian's package")]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def next_round(sessions: list[Session], clicks: int) -> None:
    for _ in range(clicks):
        await asyncio.gather(*(s.run("next", timeout=120) for s in sessions))


async def sessions_with_a_replica_killed(hall: LectureHall, prompts: list[str], seeds: list[int]) -> dict:
    seats = [hall.new_seat() for _ in prompts]
    sessions = await asyncio.gather(*(open_decode_session(hall.ws_url, p, seat, NEW_TOKENS)
                                      for p, seat in zip(prompts, seats)))
    await asyncio.gather(*(s.run("run_prefill", timeout=120) for s in sessions))
    await asyncio.gather(*(choose_sampling(s, TEMPERATURE, seed) for seed, s in zip(seeds, sessions)))
    await next_round(sessions, NEXTS_BEFORE_KILL)
    before = {"replicas": [s.replica for s in sessions], "shown": [s.strip_ids() for s in sessions],
              "exceptions": [e for s in sessions for e in s.exceptions]}

    pid, port = hall.replicas()[1]
    os.kill(pid, signal.SIGKILL)  # in the middle of every run: each has NEW_TOKENS − 1 − NEXTS_BEFORE_KILL to go
    killed = [i for i, s in enumerate(sessions) if s.replica == f"127.0.0.1:{port}"]
    kept = [s for i, s in enumerate(sessions) if i not in killed]
    closed = []
    for i in killed:  # what a browser sees: its websocket closes without a close frame
        try:
            await sessions[i].run("next", timeout=60)
            closed.append("answered")
        except websockets.ConnectionClosed as gone:
            closed.append(gone.rcvd.code if gone.rcvd else ABNORMAL_CLOSURE)
    # the browser reconnects (same page, same seat cookie): nginx finds the replica gone and sends it on
    reconnected = await asyncio.gather(*(open_decode_session(hall.ws_url, prompts[i], seats[i], NEW_TOKENS)
                                         for i in killed))
    fresh_pages = [(s.replica, s.strip_ids(), "run_prefill" in s.widgets) for s in reconnected]
    await asyncio.gather(*(s.run("run_prefill", timeout=120) for s in reconnected))
    await next_round(kept, NEXTS_AFTER_KILL)
    after = {"killed": killed, "closed": closed, "fresh_pages": fresh_pages, "port": port,
             "replicas": [s.replica for s in kept], "shown": [s.strip_ids() for s in kept],
             "reprefilled": [s.strip_ids() for s in reconnected],
             "exceptions": [e for s in kept + reconnected for e in s.exceptions]}
    for s in kept + reconnected:
        await s.close()
    return {"before": before, "after": after}


@pytest.fixture(scope="module")
def hall():
    with LectureHall(replicas=2) as running:
        yield running


def test_twenty_sessions_behind_nginx_and_a_replica_killed_mid_run(hall, small):
    prompts = prompts_for(small, SESSIONS)
    seeds = list(range(SESSIONS))
    result = run_async(sessions_with_a_replica_killed(hall, prompts, seeds))
    traced = [solo_trace_ids(p, NEW_TOKENS, TEMPERATURE, seed) for p, seed in zip(prompts, seeds)]

    def solo(i: int, nexts: int) -> list[int]:
        """Session i's solo trace after prefill and `nexts` Next clicks (a Next on an ended run adds nothing)."""
        prompt_ids, new_ids = traced[i]
        return prompt_ids + new_ids[: 1 + nexts]

    before, after = result["before"], result["after"]
    assert not before["exceptions"] and not after["exceptions"]
    assert None not in before["shown"], "every session answered its prefill and Next clicks"
    assert len(set(before["replicas"])) == 2, f"the seats spread over both replicas: {before['replicas']}"
    assert before["shown"] == [solo(i, NEXTS_BEFORE_KILL) for i in range(SESSIONS)]

    killed = after["killed"]
    assert killed and len(killed) < SESSIONS
    assert after["closed"] == [ABNORMAL_CLOSURE] * len(killed), "the killed replica's websockets just closed"
    live = f"127.0.0.1:{after['port']}"
    for replica, strip, form in after["fresh_pages"]:
        # reconnected to a live replica (the other one, or the killed one started again): a new session, the
        # Decode page on a run of its default prompt (a page opens on one), its prompt form ready for Run prefill
        assert replica is not None and strip is not None and form
    # a new session has the page's defaults again: greedy
    greedy = [solo_trace_ids(prompts[i], 1, 0.0, 0) for i in killed]
    assert after["reprefilled"] == [prompt_ids + new_ids for prompt_ids, new_ids in greedy]

    kept = [i for i in range(SESSIONS) if i not in killed]
    assert all(r != live for r in after["replicas"])
    assert after["shown"] == [solo(i, NEW_TOKENS - 1) for i in kept], "the other replica's runs went on untouched"
    restarted = "hall: replica 1 exited with status -9"
    for _ in range(20):  # the hall looks at its replicas twice a second
        if restarted in hall.log():
            break
        time.sleep(0.5)
    assert restarted in hall.log()


def test_the_api_server_behind_the_same_nginx_at_v1(hall):
    """`./dev serve` starts one API server (python -m model serve) and nginx routes /v1/ to it: the models list
    and a streamed completion (unbuffered, ending with [DONE]) through the hall's one address, and every replica
    told its address (DECODE_LAB_SERVER_URL). Red without the /v1/ location (Streamlit would answer 404)."""
    if "the hall runs without /v1/" in hall.log():
        pytest.skip("the hall's API server did not start here (its model not fetched?): " + hall.log()[-300:])
    models = urllib.request.urlopen(f"{hall.url}/v1/models", timeout=30)
    assert json.loads(models.read())["data"][0]["id"] == "smollm2"
    body = json.dumps({"prompt": "Hello", "max_tokens": 3, "stream": True, "temperature": 0}).encode()
    request = urllib.request.Request(f"{hall.url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as streamed:
        lines = [line.decode().strip() for line in streamed if line.strip()]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["id"].startswith("cmpl-")
    api_url = re.search(r"api: pid \d+ serving \S+ on (\S+)", hall.log()).group(1)
    for pid, _port in hall.replicas().values():
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"DECODE_LAB_SERVER_URL={api_url}".encode() in environ


def test_sigint_stops_nginx_and_every_replica(hall):
    processes = descendants(hall.proc.pid)
    assert len(processes) >= 4, "two replicas, nginx's master and worker (and the API server)"
    assert hall.stop(signal.SIGINT) == 0
    assert [pid for pid in processes if alive(pid)] == []
    assert "hall: stopped nginx and every replica" in hall.log()


def test_a_hall_of_one_behind_tls_and_sigterm_stops_it(tmp_path):
    """TLS ends at nginx (docs/deploy.md's self-signed example); a service manager's SIGTERM stops all as Ctrl-C."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a self-signed certificate (Debian: apt-get install -y openssl)")
    cert, key = tmp_path / "hall.crt", tmp_path / "hall.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", str(key),
                    "-out", str(cert), "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    with LectureHall(replicas=1, tls=(cert, key)) as one:  # started = its health answered over verified HTTPS
        assert one.first_page_cookie().endswith("; Secure")
        processes = descendants(one.proc.pid)
        assert one.stop(signal.SIGTERM) == 0
    assert len(processes) >= 3 and [pid for pid in processes if alive(pid)] == []


def test_a_port_in_use_is_one_sentence_and_status_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([*HALL, "--replicas", "1", "--port", str(port), "--address", "127.0.0.1"],
                              capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr == f"hall: port {port} on 127.0.0.1 is already in use (another server?): stop it or choose " \
                          "--port.\n"


needs_a_private_mount = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="hiding nginx needs root and unshare (a private mount namespace)")


def without_nginx(command: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """`command` in a mount namespace of its own where /usr/sbin is empty (no nginx) and apt-get fails, as on a
    machine without the package and without the network; the rest of the machine sees nothing of it."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "apt-get").write_text("#!/bin/sh\necho 'E: no network' >&2\nexit 100\n")
    (fake / "apt-get").chmod(0o755)
    path = f"{fake}:{os.environ['PATH']}".replace(":/usr/sbin", "").replace(":/sbin", "")
    return subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs none /usr/sbin && exec {command}"],
                          cwd=ROOT, env={**os.environ, "PATH": path}, capture_output=True, text=True, timeout=120)


@needs_a_private_mount
def test_nginx_missing_and_not_installable_is_one_sentence_and_status_2(tmp_path):
    done = without_nginx(f"./dev serve --replicas 1 --port {free_port()} --address 127.0.0.1", tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == ("dev: nginx is missing and could not be installed "
                                            "(apt-get install -y nginx failed); install it, then retry.")


@needs_a_private_mount
def test_the_hall_without_nginx_says_how_to_get_it(tmp_path):
    done = without_nginx(f"{sys.executable} deploy/hall.py --replicas 1 --port {free_port()}", tmp_path)
    assert done.returncode == 2
    assert done.stderr == ("hall: nginx is not installed: `./dev serve` installs Debian's package "
                           "(apt-get install -y nginx), or install it yourself, then retry.\n")
