"""The API server (server/) on a free port of this process, for the tests: uvicorn in a thread, the engine loop in
its own, and a way to slow the engine's steps down (a bigger model's pace) so that a test can act mid-request."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn

from model.serving.engine import EngineSettings
from server.cli import Server
from server.loop import EngineLoop
from server.openai_api import ApiSettings, build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    url: str
    loop: EngineLoop
    server: Server

    def state(self) -> dict:
        return httpx.get(f"{self.url}/v1/engine/state", headers=self.headers, timeout=10).json()

    headers: dict | None = None


def slow_steps(engine_loop: EngineLoop, seconds: float) -> None:
    """Every engine step takes at least `seconds` (a test's stand-in for a bigger model on a slower machine)."""
    step = engine_loop.engine.step

    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return step(*args, **kwargs)

    engine_loop.engine.step = slowed


def wait_until(condition, timeout: float = 10.0, what: str = "a condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.02)


@contextmanager
def serving(model, *, api_key: str | None = None, max_waiting: int = 256, budget_mb: float = 16,
            max_tokens_limit: int = 4096, body_limit: int = 1 << 16, prefix_cache: bool = True,
            step_s: float = 0.0, start_loop: bool = True, tokenizer=None) -> Iterator[Served]:
    engine_loop = EngineLoop(model, EngineSettings(block_size=16, budget_bytes=int(budget_mb * 2**20),
                                                   prefix_cache=prefix_cache, history=64), max_waiting)
    if step_s:
        slow_steps(engine_loop, step_s)
    info = model.info
    settings = ApiSettings(info.name, info.context_length, info.vocab_size, api_key, max_tokens_limit, body_limit)
    app = build_app(engine_loop, tokenizer or model.tokenizer, settings)
    port = free_port()
    server = Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                   timeout_graceful_shutdown=5), engine_loop)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what="uvicorn to start")
    if start_loop:
        engine_loop.start()
    served = Served(f"http://127.0.0.1:{port}", engine_loop, server,
                    {"Authorization": f"Bearer {api_key}"} if api_key else None)
    try:
        yield served
    finally:
        engine_loop.request_stop()
        server.should_exit = True
        thread.join(15)
        engine_loop.stop()
