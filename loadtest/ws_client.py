"""Sessions without browsers: a Streamlit server of our own on a free port, and a client of Streamlit's websocket
protocol (protobuf BackMsg / ForwardMsg over /_stcore/stream), for the burst, isolation and load measurements.

    with StreamlitServer("app.py") as server:
        s = Session(server.ws_url, page="decode", query="lang=en")
        await s.connect(); await s.run()                   # the first run sends the page's widgets
        s.set_value("prompt_text", "my mother")            # widgets are found by their user key
        seconds = await s.run("run_prefill")               # press a button; wait until the run has finished

    with LectureHall(replicas=2) as hall:                  # deploy/hall.py: replicas behind nginx
        s = Session(hall.ws_url, headers=hall.new_seat())  # a browser's seat cookie: its replica
        await s.connect(); s.replica                       # "127.0.0.1:PORT" of the replica that answered

A click on a widget inside an st.fragment reruns only that fragment, as the browser does. `page` models what
the browser shows: the last element at each delta path. Written against Streamlit 1.67; a measuring tool, not
part of the product. Adapted from the team's shared/tools/streamlit_ws_client.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import websockets
from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 90
WIDGET_KINDS = ("button", "text_input", "number_input", "slider", "checkbox", "selectbox", "radio",
                "button_group", "toggle", "text_area")
FINISHED = {0: "ok", 1: "compile error", 3: "fragment ok"}  # ForwardMsg.ScriptFinishedStatus; 2 = stopped for a rerun
WEIGHTS_LINE = "decode-lab-test: weights read from "
REPLICA_HEADER = "X-Decode-Lab-Replica"  # added by deploy/hall.py's nginx to a websocket's upgrade response
REPLICA_LINE = re.compile(r"^replica (\d+): pid (\d+) on 127\.0\.0\.1:(\d+)$", re.M)  # printed by deploy/hall.py

# Run by the server process when counting is asked for: every safetensors read prints one line to stderr, so a
# test sees each model load (the app's own caching, whatever its shape, cannot hide a real reload).
_COUNTING_LAUNCHER = f"""
import sys
import safetensors, safetensors.torch

def counted(original):
    def read(path, *args, **kwargs):
        print({WEIGHTS_LINE!r} + str(path), file=sys.stderr, flush=True)
        return original(path, *args, **kwargs)
    return read

safetensors.torch.load_file = counted(safetensors.torch.load_file)
safetensors.safe_open = counted(safetensors.safe_open)
from streamlit.web.cli import main
sys.argv = ["streamlit", *sys.argv[1:]]
sys.exit(main())
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url + "/_stcore/health", timeout=2, context=context) as r:
            return r.status == 200
    except OSError:
        return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def descendants(pid: int) -> set[int]:
    """Every process below `pid` now (children of children included), from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found.update(children)
        todo += children
    return found


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def prompts_for(model, count: int) -> list[str]:
    """`count` different two-word prompts from the model's own vocabulary (no <unk>: each prompt is distinct)."""
    tok = model.tokenizer
    words = [w for w in (tok.token(i) for i in range(model.info.vocab_size)) if w.isalpha()]
    return [f"{words[i % len(words)]} {words[(7 * i + 3) % len(words)]}" for i in range(count)]


def solo_trace_ids(prompt: str, new_tokens: int, temperature: float, seed: int,
                   model: str = "small") -> tuple[list[int], list[int]]:
    """Prompt ids and new ids of `python -m model trace --json` for this prompt and seed (the CLI's main, run in this
    process: the same code as the command, without a torch import per prompt)."""
    from model.tools import cli

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli.main(["trace", "--model", model, "--device", "cpu", "--prompt", prompt, "--json",
                           "--max-new-tokens", str(new_tokens), "--temperature", str(temperature),
                           "--seed", str(seed)])
    if status != 0:
        raise RuntimeError(f"python -m model trace failed for {prompt!r} (status {status})")
    report = json.loads(printed.getvalue())
    return report["prompt"]["ids"], report["output"]["ids"]



class StreamlitServer:
    """`streamlit run <script>` on a free port of 127.0.0.1, from the project root (so its .streamlit/config.toml
    applies; `root` runs another copy of the project, e.g. an older commit for a before/after measurement), until
    the `with` block ends. count_weight_reads: log every safetensors read (see weight_reads)."""

    def __init__(self, script: str | Path = "app.py", *options: str, count_weight_reads: bool = False,
                 env: dict[str, str] | None = None, root: Path = ROOT):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/_stcore/stream"
        launcher = ["-c", _COUNTING_LAUNCHER] if count_weight_reads else ["-m", "streamlit"]
        self.command = [sys.executable, *launcher, "run", str(script), "--server.headless", "true",
                        "--server.port", str(self.port), "--server.address", "127.0.0.1",
                        "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none", *options]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="streamlit-", suffix=".log")[1])

    def __enter__(self) -> StreamlitServer:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"streamlit did not start (exit {self.proc.returncode}):\n{self.log()[-3000:]}")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def healthy(self) -> bool:
        return healthy(self.url)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def weight_reads(self) -> list[str]:
        return [line[len(WEIGHTS_LINE):] for line in self.log().splitlines() if line.startswith(WEIGHTS_LINE)]

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)


class LectureHall:
    """deploy/hall.py (replicas behind nginx) on a free port of 127.0.0.1 until the `with` block ends; its output
    goes to a log file. replicas(): {number: (pid, port)} as the hall last printed them (a restart prints again).
    tls: (certificate, key) for HTTPS, the certificate trusted by this client's requests (self.context)."""

    def __init__(self, replicas: int = 2, tls: tuple[Path, Path] | None = None):
        self.port = free_port()
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.ws_url = f"{'wss' if tls else 'ws'}://127.0.0.1:{self.port}/_stcore/stream"
        self.context = ssl.create_default_context(cafile=tls[0]) if tls else None
        self.command = [sys.executable, str(ROOT / "deploy" / "hall.py"), "--replicas", str(replicas),
                        "--port", str(self.port), "--address", "127.0.0.1",
                        *(["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])] if tls else [])]
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="hall-", suffix=".log")[1])

    def __enter__(self) -> LectureHall:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 2 * START_TIMEOUT_S
        while "hall: nginx pid" not in self.log() or not healthy(self.url, self.context):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the hall did not start (exit {self.proc.returncode}):\n{self.log()[-3000:]}")
            time.sleep(0.3)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Sends `sig` (what Ctrl-C or a service manager sends) and waits for the hall's exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def nginx_pids(self) -> list[int]:
        """nginx's master and its worker (the worker does the proxying)."""
        master = int(re.search(r"^hall: nginx pid (\d+)", self.log(), re.M).group(1))
        return [master, *sorted(descendants(master))]

    def replicas(self) -> dict[int, tuple[int, int]]:
        return {int(n): (int(pid), int(port)) for n, pid, port in REPLICA_LINE.findall(self.log())}

    def first_page_cookie(self) -> str:
        """The Set-Cookie header of a browser's first page load: its seat."""
        with urllib.request.urlopen(self.url + "/", timeout=10, context=self.context) as r:
            return r.headers["Set-Cookie"]

    def new_seat(self) -> dict[str, str]:
        """The seat cookie of a first page load, as the header that browser's websocket then sends."""
        return {"Cookie": self.first_page_cookie().split(";", 1)[0]}


async def open_decode_session(ws_url: str, prompt: str, headers: dict[str, str] | None = None,
                              max_new_tokens: int | None = None) -> Session:
    """A new tab on the Decode page with its prompt typed (and its token limit, when given), before Run prefill."""
    session = Session(ws_url, page="decode", query="lang=en", headers=headers)
    await session.connect()
    await session.run()
    session.set_value("prompt_text", prompt)
    if max_new_tokens is not None:
        session.set_value("max_new_tokens", max_new_tokens)
    return session


async def choose_sampling(session: Session, temperature: float, seed: int) -> None:
    """After Run prefill: the sampling controls of the run (the page re-draws the first token with them)."""
    # the page's temperature is a select slider (ui/controls.decimal_slider): it takes the option as written, in
    # the session's language (English: 0.50)
    session.set_value("temperature", f"{temperature:.2f}")
    session.set_value("seed", seed)
    await session.run()


class Session:
    """One browser tab's worth of protocol: the page's widgets, the values this session set, the shown elements."""

    def __init__(self, ws_url: str, page: str = "decode", query: str = "lang=en",
                 headers: dict[str, str] | None = None):
        self.ws_url, self.page_name, self.query, self.headers = ws_url, page, query, headers
        self.ws = None
        self.page_hash = ""
        self.widgets: dict[str, tuple[str, str, str]] = {}  # user key -> (widget id, kind, fragment id)
        self.values: dict[str, tuple[str, object]] = {}      # widget id -> (WidgetState field, value)
        self.page: dict[tuple[int, ...], tuple[str, str]] = {}  # delta path -> (element kind, text)
        self.exceptions: list[str] = []  # of the last run
        self.drawn: list[str] = []  # the kinds of the elements the last run sent, in order
        self.status = ""

    async def connect(self) -> None:
        self.ws = await websockets.connect(self.ws_url, subprotocols=["streamlit"], max_size=2**27,
                                           open_timeout=60, ping_interval=None, additional_headers=self.headers)

    @property
    def replica(self) -> str | None:
        """The replica that answered this websocket behind the hall's nginx ("127.0.0.1:PORT"); None direct."""
        return self.ws.response.headers.get(REPLICA_HEADER)

    async def close(self) -> None:
        await self.ws.close()

    async def send_clear_cache(self) -> None:
        """What the ⋮ menu's "Clear cache" sends (st.cache_data and st.cache_resource are process-wide)."""
        msg = BackMsg()
        msg.clear_cache = True
        await self.ws.send(msg.SerializeToString())

    def key_of(self, widget_id: str) -> str:
        return widget_id.split("-", 2)[2] if widget_id.startswith("$$ID-") else widget_id  # "$$ID-<hash>-<key>"

    def set_value(self, key: str, value) -> None:
        widget_id, kind, _ = self.widgets[key]
        field = {"text_input": "string_value", "text_area": "string_value", "checkbox": "bool_value",
                 "toggle": "bool_value", "slider": "double_array_value", "number_input": "double_value",
                 "selectbox": "string_value", "radio": "string_value"}[kind]
        if kind == "number_input" and isinstance(value, int):
            field = "int_value"
        if kind == "slider" and isinstance(value, str):  # a select slider: its option's label
            field = "string_array_value"
        self.values[widget_id] = (field, value)

    def _rerun_message(self, trigger: str | None) -> BackMsg:
        msg = BackMsg()
        rerun = msg.rerun_script
        rerun.query_string = self.query
        rerun.page_script_hash = self.page_hash
        rerun.page_name = "" if self.page_hash else self.page_name
        for widget_id, (field, value) in self.values.items():
            state = rerun.widget_states.widgets.add()
            state.id = widget_id
            if field in ("double_array_value", "string_array_value"):
                getattr(state, field).data.extend(value if isinstance(value, list) else [value])
            else:
                setattr(state, field, value)
        if trigger is not None:
            widget_id, _, fragment = self.widgets[trigger]
            state = rerun.widget_states.widgets.add()
            state.id, state.trigger_value = widget_id, True
            rerun.fragment_id = fragment
        return msg

    async def run(self, trigger: str | None = None, timeout: float = 300) -> float:
        """Rerun (pressing the button with user key `trigger`, if given); seconds until the run finished."""
        msg = self._rerun_message(trigger)
        if not msg.rerun_script.fragment_id:
            self.page = {}
        self.exceptions, self.drawn = [], []
        t0 = time.monotonic()
        await self.ws.send(msg.SerializeToString())
        await asyncio.wait_for(self._read_until_finished(), timeout)
        return time.monotonic() - t0

    async def _read_until_finished(self) -> None:
        while True:
            fm = ForwardMsg()
            fm.ParseFromString(await self.ws.recv())
            kind = fm.WhichOneof("type")
            if kind == "navigation":
                for p in fm.navigation.app_pages:
                    if p.url_pathname == self.page_name:
                        self.page_hash = p.page_script_hash
            elif kind == "delta":
                self._delta(tuple(fm.metadata.delta_path), fm.delta)
            elif kind == "script_finished" and fm.script_finished in FINISHED:
                self.status = FINISHED[fm.script_finished]
                return

    def _delta(self, path: tuple[int, ...], delta) -> None:
        if delta.WhichOneof("type") != "new_element":
            return
        element = delta.new_element
        kind = element.WhichOneof("type")
        self.drawn.append(kind)
        if kind == "markdown":
            self.page[path] = (kind, element.markdown.body)
        elif kind == "html":
            self.page[path] = (kind, element.html.body)
        elif kind == "alert":
            self.page[path] = (kind, element.alert.body)
        elif kind == "exception":
            e = element.exception
            text = "\n".join([e.type, e.message, *e.stack_trace])
            self.page[path] = (kind, text)
            self.exceptions.append(text)
        elif kind == "plotly_chart":
            self.page[path] = (kind, "")
        elif kind in WIDGET_KINDS:
            widget = getattr(element, kind)
            self.widgets[self.key_of(widget.id)] = (widget.id, kind, delta.fragment_id)

    def texts(self, kind: str = "markdown") -> list[str]:
        return [text for k, text in self.page.values() if k == kind]

    def cache_len(self) -> int | None:
        """The cache length in the decode page's step summary (vi or en), drawn as HTML."""
        for text in self.texts("html"):
            found = re.search(r"cache: <b>(\d+) (?:positions|vị trí)", text)
            if found:
                return int(found.group(1))
        return None

    def strip_ids(self) -> list[int] | None:
        """Token ids of the token strip, in order."""
        for body in self.texts("html"):
            if 'class="tok-strip"' in body:
                return [int(x) for x in re.findall(r"id (\d+)</small>", body)]
        return None


def run_async(coroutine):
    """asyncio.run in a thread of its own: Playwright's sync API (the browser tests of the same pytest run) keeps an
    event loop running in the main thread, where asyncio.run refuses to start another."""
    with ThreadPoolExecutor(max_workers=1) as worker:
        return worker.submit(asyncio.run, coroutine).result()
