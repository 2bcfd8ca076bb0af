"""The API server under load and as a process (issue 51, part 2): 100 concurrent streaming clients, SIGTERM on a
real `python -m model serve`, and SmolLM2's chat through the openai client. Slow: each starts servers or runs
a real model.

Each test's docstring names a change that makes it red."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from api_server import free_port, serving, wait_until
from test_smollm2 import needs_model

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
CLIENTS = 100


async def one_stream(client: httpx.AsyncClient, url: str, i: int) -> tuple[str, int]:
    """('done' | 'error' | 'cut', text chunks seen): how the stream ended."""
    body = {"prompt": "con mèo", "max_tokens": 24 + i % 8, "stream": True, "temperature": 0.8, "seed": i,
            "ignore_eos": True, "user": f"client-{i}"}
    chunks, last = 0, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return ("error" if "error" in json.loads(await response.aread()) else "cut"), 0
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                last = line[6:]
                chunks += last != "[DONE]"
    if last == "[DONE]":
        return "done", chunks
    return ("error" if last and "error" in json.loads(last) else "cut"), chunks


async def hundred_clients(url: str) -> list[tuple[str, int]]:
    limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=CLIENTS + 10)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        return await asyncio.gather(*(one_stream(client, url, i) for i in range(CLIENTS)))


def test_a_hundred_concurrent_streams_all_end_and_the_pool_is_free(small):
    """100 streaming clients at once on the small model: none lost, each stream ends with [DONE] (or an error
    object, never cut), every request in `finished`, the pool's every block free afterwards and no request left.
    Red when a finished request's blocks are not freed, or when a stream's end is dropped."""
    with serving(small, budget_mb=8) as served:
        started = time.perf_counter()
        ends = asyncio.run(hundred_clients(served.url))
        seconds = time.perf_counter() - started
        assert all(end == "done" for end, _ in ends), [e for e in ends if e[0] != "done"][:5]
        assert all(chunks >= 1 for _, chunks in ends)
        wait_until(lambda: not served.state()["running"], what="every request to leave")
        state = served.state()
        assert state["waiting"] == [] and state["requests"] == {}
        assert all(h == -1 for h in state["pool"]["holder"]) and all(r == 0 for r in state["pool"]["refs"])
        assert served.loop.engine.cache.pool.n_free == served.loop.engine.cache.n_blocks
        assert len(state["finished"]) == CLIENTS
        assert max(f["concurrent"] for f in state["finished"]) > 10   # they really ran together
        print(f"{CLIENTS} streams in {seconds:.1f} s")


def test_sigterm_on_the_process_aborts_the_streams_says_how_many_and_exits_0(tmp_path):
    """`python -m model serve --model small`, two long streams open, then SIGTERM: both end with the error object
    and [DONE], stderr says "aborted 2 running", the exit status is 0. Red when the Server's handle_exit does not
    stop the engine loop first (uvicorn would wait for the streams, then kill them without an error chunk)."""
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "model", "serve", "--model", "small", "--port", str(port)],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: healthy(url), timeout=90, what="the server to answer /health")

        ended = asyncio.run(streams_then_sigterm(url, proc))
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    for lines in ended:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert json.loads(lines[-2][6:])["error"]["code"] == "server_shutdown"
    assert "aborted 2 running and 0 waiting requests" in text, text[-2000:]


async def streams_then_sigterm(url: str, proc: subprocess.Popen) -> list[list[str]]:
    """Two long greedy streams; once both have their first chunks, SIGTERM; each stream's data lines."""
    both_running = asyncio.Barrier(3)

    async def stream(client: httpx.AsyncClient) -> list[str]:
        body = {"prompt": list(range(4, 14)), "max_tokens": 110, "stream": True, "temperature": 0, "ignore_eos": True}
        lines = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 1:
                        await both_running.wait()
        return lines

    async def signal_once_both_run() -> None:
        await both_running.wait()
        proc.send_signal(signal.SIGTERM)

    async with httpx.AsyncClient(timeout=60) as client:
        *ended, _ = await asyncio.gather(stream(client), stream(client), signal_once_both_run())
    return ended


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def smollm2():
    from model.engine.loading import load_model
    return load_model("smollm2", "cpu")


@needs_model
def test_smollm2_chat_through_the_openai_client(smollm2):
    """SmolLM2's chat template, greedy: the streamed deltas join into the non-streamed answer, which is the solo
    run of the template's ids; top_logprobs come back per token; a Vietnamese answer streams without a broken
    character. Red when chat messages skip the template (the prompt tokens would differ)."""
    from test_batch import solo_run
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smollm2.tokenizer.encode_chat(messages).ids
    with serving(smollm2, budget_mb=64) as served:
        c = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
        whole = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0,
                                          logprobs=True, top_logprobs=2)
        assert whole.usage.prompt_tokens == len(ids)
        solo = solo_run(smollm2, ids, whole.usage.completion_tokens)[1]
        assert whole.choices[0].message.content == smollm2.tokenizer.decode(solo)
        assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens
        assert all(len(t.top_logprobs) == 2 for t in whole.choices[0].logprobs.content)
        chunks = list(c.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0,
                                                stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content
        viet = [{"role": "user", "content": "Say 'xin chào Việt Nam' and nothing else."}]
        deltas = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="smollm2", messages=viet, max_tokens=16, temperature=0, stream=True)]
        assert not any("\ufffd" in d for d in deltas)
