"""The Live server page's client: the one place that speaks HTTP to `python -m model serve`.

fetch_state() reads GET {url}/v1/engine/state (a timeout of about a second) and translates its JSON into plain
dataclasses (EngineState); a server that is down, refuses, asks for a key or answers with something else is a
ServerDown whose `reason` the page turns into one sentence. latency_groups() reduces the finished requests to TTFT
and ITL percentiles by concurrent requests and by prompt length, the course's two axes. send() posts a student's
prompt on a thread of its own (streamed, so the request's id, and with it its blocks, are known from its first
chunk) into a Sent the page reads at each poll. snippets() writes the same request for curl and the openai client.
No Streamlit here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV, KEY_ENV = "DECODE_LAB_SERVER_URL", "DECODE_LAB_SERVER_API_KEY"
STATE_TIMEOUT_S = 1.0  # a poll twice a second gives up after a second
SEND_TIMEOUT_S = 120.0  # till the next chunk of a stream: a busy CPU server may keep a request waiting a while
MAX_STATE_BYTES = 32 * 2**20  # a state larger than this is no engine state
SPAN_KINDS = ("prefill", "recompute", "decode", "received")
# the course's two axes, as buckets: concurrent requests and prompt tokens (each bucket's first and last, inclusive)
CONCURRENCY_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, None))
CONTEXT_BUCKETS = ((1, 16), (17, 32), (33, 64), (65, 128), (129, 256), (257, 512), (513, 1024), (1025, None))
QUANTILES = (50, 95, 99)
RID_IN_ID = re.compile(r"^(?:chat)?cmpl-(\d+)$")


def server_url() -> str:
    """The operator's address for the server ($DECODE_LAB_SERVER_URL), without a trailing slash."""
    return (os.environ.get(URL_ENV, "").strip() or DEFAULT_URL).rstrip("/")


def server_key() -> str:
    return os.environ.get(KEY_ENV, "").strip()


class ServerDown(Exception):
    """The server could not be read. reason: "address" (not an http(s) address), "unreachable" (no answer),
    "key" (401/403: it wants an API key), "status" (another HTTP status), "garbage" (an answer that is no engine
    state); detail: what was seen, for the sentence (a status code, a missing field)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


# -- the engine's state, as the page draws it -----------------------------------------------------------------------

@dataclass(frozen=True)
class Span:
    request: int
    start: int
    stop: int
    kind: str  # one of SPAN_KINDS


@dataclass(frozen=True)
class Step:
    index: int
    time: float
    ms: float
    tokens: int
    running: int
    blocks_held: int
    admitted: tuple[int, ...]
    preempted: tuple[int, ...]
    left: tuple[int, ...]
    cached_positions: dict[int, int]  # request -> positions the prefix cache gave it at admission (its hit)
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class Request:
    rid: int
    id: str  # the API's id: cmpl-17 or chatcmpl-17
    user: str | None
    state: str  # waiting or running
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    preemptions: int


@dataclass(frozen=True)
class Finished:
    request: int
    user: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float | None
    itl_ms: tuple[float, ...]
    e2e_ms: float
    concurrent: int
    finish_reason: str


@dataclass(frozen=True)
class Conditions:
    cpu: str
    threads: int
    dtype: str
    torch: str
    max_waiting: int
    device: str | None = None  # said by servers that say it


@dataclass(frozen=True)
class EngineState:
    model: str
    block_size: int
    n_blocks: int
    block_bytes: int
    holder: np.ndarray  # per block: the request holding it, −1 when free
    refs: np.ndarray    # per block: how many requests hold it
    cached: np.ndarray  # per block: the prefix cache can find it
    filled: np.ndarray  # per block: positions it holds
    tables: dict[int, list[list[int]]]
    running: tuple[int, ...]
    waiting: tuple[int, ...]
    requests: dict[int, Request]
    steps: tuple[Step, ...]
    finished: tuple[Finished, ...]
    conditions: Conditions
    uptime_s: float

    def mine(self, user: str, rids: set[int] = frozenset()) -> set[int]:
        """The requests of one student: sent with their `user`, or whose ids their answers named (the caller
        passes only the ids of answers from this server's run: ids start again at 0 when a server restarts)."""
        live = {rid for rid, r in self.requests.items() if r.user == user or rid in rids}
        return live | {f.request for f in self.finished if f.user == user or f.request in rids}


def _int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ServerDown("garbage", name)
    return value


def _float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ServerDown("garbage", name)
    return float(value)


def _str(value, name: str, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ServerDown("garbage", name)
    return value


def _list(value, name: str) -> list:
    if not isinstance(value, list):
        raise ServerDown("garbage", name)
    return value


def _dict(value, name: str) -> dict:
    if not isinstance(value, dict):
        raise ServerDown("garbage", name)
    return value


def _rid(key, name: str) -> int:
    """A request id, an int or (as an object's key) its digits."""
    if isinstance(key, str) and re.fullmatch(r"-?\d+", key):
        return int(key)
    return _int(key, name)


def parse_state(data) -> EngineState:
    """The JSON of /v1/engine/state as dataclasses; ServerDown("garbage", the first field that is missing or of the
    wrong kind) for anything else. Fields beyond these are ignored."""
    top = _dict(data, "state")
    try:
        pool = _dict(top["pool"], "pool")
        n_blocks = _int(top["n_blocks"], "n_blocks")
        arrays = {}
        for name in ("holder", "refs", "cached", "filled"):
            values = _list(pool[name], f"pool.{name}")
            flags = name == "cached"
            if len(values) != n_blocks or not all(isinstance(v, bool) if flags else isinstance(v, int)
                                                  and not isinstance(v, bool) for v in values):
                raise ServerDown("garbage", f"pool.{name}")
            arrays[name] = np.array(values, dtype=bool if flags else np.int64)
        tables = {_rid(rid, "tables"): [[_int(b, "tables") for b in _list(group, "tables")]
                                         for group in _list(groups, "tables")]
                  for rid, groups in _dict(top["tables"], "tables").items()}
        requests = {}
        for rid, r in _dict(top["requests"], "requests").items():
            r = _dict(r, "requests")
            requests[_rid(rid, "requests")] = Request(
                _rid(rid, "requests"), _str(r["id"], "requests.id"), _str(r.get("user"), "requests.user", True),
                _str(r["state"], "requests.state"), _int(r["prompt_tokens"], "requests.prompt_tokens"),
                _int(r["completion_tokens"], "requests.completion_tokens"),
                _int(r["cached_tokens"], "requests.cached_tokens"), _int(r["preemptions"], "requests.preemptions"))
        steps = []
        for s in _list(top["steps"], "steps"):
            s = _dict(s, "steps")
            spans = []
            for span in _list(s["spans"], "steps.spans"):
                span = _dict(span, "steps.spans")
                kind = _str(span["kind"], "steps.spans.kind")
                if kind not in SPAN_KINDS:
                    raise ServerDown("garbage", "steps.spans.kind")
                spans.append(Span(_rid(span["request"], "steps.spans.request"), _int(span["start"], "steps.spans"),
                                  _int(span["stop"], "steps.spans"), kind))
            steps.append(Step(
                _int(s["index"], "steps.index"), _float(s["time"], "steps.time"), _float(s["ms"], "steps.ms"),
                _int(s["tokens"], "steps.tokens"), _int(s["running"], "steps.running"),
                _int(s["blocks_held"], "steps.blocks_held"),
                *(tuple(_rid(r, f"steps.{name}") for r in _list(s[name], f"steps.{name}"))
                  for name in ("admitted", "preempted", "left")),
                {_rid(rid, "steps.cached_positions"): _int(n, "steps.cached_positions")
                 for rid, n in _dict(s["cached_positions"], "steps.cached_positions").items()},
                tuple(spans)))
        finished = []
        for f in _list(top["finished"], "finished"):
            f = _dict(f, "finished")
            ttft = f.get("ttft_ms")
            finished.append(Finished(
                _rid(f["request"], "finished.request"), _str(f.get("user"), "finished.user", True),
                _int(f["prompt_tokens"], "finished.prompt_tokens"),
                _int(f["completion_tokens"], "finished.completion_tokens"),
                _int(f["cached_tokens"], "finished.cached_tokens"),
                None if ttft is None else _float(ttft, "finished.ttft_ms"),
                tuple(_float(v, "finished.itl_ms") for v in _list(f["itl_ms"], "finished.itl_ms")),
                _float(f["e2e_ms"], "finished.e2e_ms"), _int(f["concurrent"], "finished.concurrent"),
                _str(f["finish_reason"], "finished.finish_reason")))
        c = _dict(top["conditions"], "conditions")
        conditions = Conditions(_str(c["cpu"], "conditions.cpu"), _int(c["threads"], "conditions.threads"),
                                _str(c["dtype"], "conditions.dtype"), _str(c["torch"], "conditions.torch"),
                                _int(c["max_waiting"], "conditions.max_waiting"),
                                _str(c.get("device"), "conditions.device", True))
        return EngineState(
            _str(top["model"], "model"), _int(top["block_size"], "block_size"), n_blocks,
            _int(top["block_bytes"], "block_bytes"), arrays["holder"], arrays["refs"], arrays["cached"],
            arrays["filled"], tables,
            tuple(_rid(r, "running") for r in _list(top["running"], "running")),
            tuple(_rid(r, "waiting") for r in _list(top["waiting"], "waiting")),
            requests, tuple(steps), tuple(finished), conditions, _float(top["uptime_s"], "uptime_s"))
    except KeyError as missing:
        raise ServerDown("garbage", str(missing.args[0])) from None


def checked_url(url: str) -> str:
    """An http(s) address without its trailing slash, or ServerDown("address")."""
    url = url.strip().rstrip("/")
    if not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", url):
        raise ServerDown("address", url)
    return url


def _headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _http_error(error: urllib.error.HTTPError) -> ServerDown:
    return ServerDown("key" if error.code in (401, 403) else "status", str(error.code))


def fetch_state(url: str, api_key: str = "", timeout: float = STATE_TIMEOUT_S) -> EngineState:
    """GET {url}/v1/engine/state, translated; ServerDown for whatever prevents it."""
    request = urllib.request.Request(checked_url(url) + "/v1/engine/state", headers=_headers(api_key))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            body = answer.read(MAX_STATE_BYTES + 1)
    except urllib.error.HTTPError as error:
        raise _http_error(error) from None
    except (OSError, ValueError) as error:  # refused, timed out, no such host, a broken answer
        raise ServerDown("unreachable", type(error).__name__) from None
    if len(body) > MAX_STATE_BYTES:
        raise ServerDown("garbage", "size")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ServerDown("garbage", "json") from None
    return parse_state(data)


# -- TTFT and ITL by concurrent requests and by context length ------------------------------------------------------

@dataclass(frozen=True)
class LatencyRow:
    first: int
    last: int | None  # None: and above
    requests: int
    ttft_ms: dict[int, float] | None  # quantile -> ms, None without a first token
    itl_ms: dict[int, float] | None   # over every gap of the group's requests pooled, None without a gap


def percentiles(values: list[float]) -> dict[int, float] | None:
    """p50, p95, p99 as numpy's default (linear) percentile, as vLLM's bench serve computes them."""
    return {q: float(np.percentile(values, q)) for q in QUANTILES} if values else None


def latency_groups(finished: tuple[Finished, ...] | list[Finished], axis: str) -> list[LatencyRow]:
    """The finished requests by `axis`, "concurrent" (the requests running beside each, CONCURRENCY_BUCKETS) or
    "context" (its prompt tokens, CONTEXT_BUCKETS): for each bucket that holds a request, how many, TTFT p50/p95/p99
    over its requests' first tokens and ITL p50/p95/p99 over all their gaps between tokens pooled (each token
    counts once, as vLLM's bench serve counts ITL)."""
    buckets = CONCURRENCY_BUCKETS if axis == "concurrent" else CONTEXT_BUCKETS
    rows = []
    for first, last in buckets:
        group = [f for f in finished
                 if first <= (f.concurrent if axis == "concurrent" else f.prompt_tokens) <= (last or 2**62)]
        if group:
            rows.append(LatencyRow(first, last, len(group),
                                   percentiles([f.ttft_ms for f in group if f.ttft_ms is not None]),
                                   percentiles([gap for f in group for gap in f.itl_ms])))
    return rows


# -- a student's prompt, sent from the page ---------------------------------------------------------------------------

@dataclass
class Sent:
    """One request sent from the page, filled in by its thread as the stream arrives. error: "unreachable", "key",
    "refused" (the server's own error object; message holds its text) or "garbage"."""
    prompt: str
    user: str
    endpoint: str = ""  # chat/completions or completions
    response_id: str | None = None
    text: str = ""
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    error: str | None = None
    message: str = ""
    done: bool = False
    started: float = field(default_factory=time.monotonic)
    sent_at: float = field(default_factory=time.time)  # wall clock: a server started later never saw it

    @property
    def rid(self) -> int | None:
        """The engine's request id, read from the API's id ("chatcmpl-17" -> 17)."""
        found = RID_IN_ID.match(self.response_id or "")
        return int(found.group(1)) if found else None


def request_body(endpoint: str, model: str, prompt: str, max_tokens: int, user: str | None,
                 stream: bool = False) -> dict:
    """The JSON of one request as OpenAI's API takes it: the prompt as a user message for chat, as text else."""
    body: dict = {"model": model}
    if endpoint == "chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body["max_tokens"] = max_tokens
    if user:
        body["user"] = user
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


CHAT_REFUSED = re.compile(r"chat|template", re.I)  # a server's refusal of chat for a model that has no chat format


def _post_stream(url: str, api_key: str, endpoint: str, body: dict, sent: Sent) -> None:
    data = json.dumps(body).encode("utf-8")
    request = urllib.request.Request(f"{url}/v1/{endpoint}", data=data, method="POST",
                                     headers={"Content-Type": "application/json", **_headers(api_key)})
    # one timeout for the connection and each read: the page sends only to a server its last poll reached
    with urllib.request.urlopen(request, timeout=SEND_TIMEOUT_S) as answer:
        for raw in answer:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                sent.error, sent.message = "refused", str(chunk["error"].get("message", ""))
                return
            sent.response_id = sent.response_id or chunk.get("id")
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if endpoint == "chat/completions" \
                    else choice.get("text")
                sent.text += piece or ""
                sent.finish_reason = choice.get("finish_reason") or sent.finish_reason
            if chunk.get("usage"):
                sent.usage = chunk["usage"]


def _refusal(error: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(error.read(65536))["error"]["message"])
    except Exception:
        return str(error.code)


def _send(url: str, api_key: str, model: str, max_tokens: int, sent: Sent, chat_first: bool) -> None:
    endpoints = ["chat/completions", "completions"] if chat_first else ["completions"]
    try:
        for k, endpoint in enumerate(endpoints):
            sent.endpoint = endpoint
            try:
                _post_stream(url, api_key, endpoint, request_body(endpoint, model, sent.prompt, max_tokens,
                                                                  sent.user, stream=True), sent)
                return
            except urllib.error.HTTPError as error:
                if error.code in (401, 403):
                    sent.error = "key"
                    return
                message = _refusal(error)
                if k + 1 < len(endpoints) and error.code in (400, 404, 422) and CHAT_REFUSED.search(message):
                    continue  # no chat format: the same prompt as text
                sent.error, sent.message = "refused", message
                return
    except (OSError, ValueError):  # refused, timed out, a broken stream
        sent.error = "unreachable" if not sent.response_id else "garbage"
    finally:
        sent.done = True


def send(url: str, api_key: str, model: str, prompt: str, user: str, max_tokens: int,
         chat_first: bool = True) -> Sent:
    """Posts the prompt on a thread of its own, streamed (chat first, then as text where the server has no chat
    format for the model); the Sent fills in as the answer arrives."""
    sent = Sent(prompt=prompt, user=user)
    threading.Thread(target=_send, args=(checked_url(url), api_key, model, max_tokens, sent, chat_first),
                     daemon=True, name="live-send").start()
    return sent


# -- the address the students' laptops use ---------------------------------------------------------------------

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def is_loopback(url: str) -> bool:
    return urlsplit(url).hostname in LOOPBACK


def answers_api(base: str, api_key: str = "", timeout: float = STATE_TIMEOUT_S) -> bool:
    """Whether GET {base}/v1/models answers as an OpenAI-compatible server does (a list of models)."""
    request = urllib.request.Request(base.rstrip("/") + "/v1/models", headers=_headers(api_key))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return isinstance(json.loads(answer.read(MAX_STATE_BYTES)).get("data"), list)
    except (OSError, ValueError, AttributeError):
        return False


def students_address(server: str, origin: str | None, answers: Callable[[str], bool]) -> tuple[str, bool]:
    """The address for the snippets, and whether it is the page's own: a server the page reaches on this machine's
    loopback is not where a laptop reaches it; where the address the browser opened the page at also serves the API
    (./dev serve: nginx sends /v1/ to the API server), that one."""
    if origin and is_loopback(server) and not is_loopback(origin) and answers(origin):
        return origin, True
    return server, False


# -- the same request, for the students to copy ------------------------------------------------------------------

def snippets(url: str, endpoint: str, model: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    """(curl, openai Python client) for the same request; the prompt written so each language reads it back."""
    body = request_body(endpoint, model, prompt, max_tokens, None)
    curl = (f"curl {shlex.quote(url + '/v1/' + endpoint)} \\\n  -H 'Content-Type: application/json' \\\n"
            f"  -d {shlex.quote(json.dumps(body, ensure_ascii=False))}")
    text = json.dumps(prompt, ensure_ascii=False)  # a JSON string is a Python string literal
    if endpoint == "chat/completions":
        call = (f"reply = client.chat.completions.create(\n    model={json.dumps(model)},\n"
                f'    messages=[{{"role": "user", "content": {text}}}],\n    max_tokens={max_tokens},\n)\n'
                "print(reply.choices[0].message.content)")
    else:
        call = (f"reply = client.completions.create(\n    model={json.dumps(model)},\n    prompt={text},\n"
                f"    max_tokens={max_tokens},\n)\nprint(reply.choices[0].text)")
    python = (f'from openai import OpenAI\n\nclient = OpenAI(base_url={json.dumps(url + "/v1")}, api_key="EMPTY")\n'
              + call)
    return curl, python
