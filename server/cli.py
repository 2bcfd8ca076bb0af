"""`python -m model serve --model smollm2 [--port 8000] [--host 127.0.0.1] …`: load a model, start the engine loop
on its own thread and the OpenAI-compatible API on uvicorn; Ctrl-C or SIGTERM aborts the requests still running
(each stream ends with an error object and [DONE]), says how many, and exits 0."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import torch
import uvicorn

from model.engine.loading import load_model
from model.engine.runtime import apply_cpu_threads
from model.errors import InputError
from model.serving.engine import EngineSettings
from server.loop import EngineLoop
from server.openai_api import ApiSettings, build_app

log = logging.getLogger("decode_lab.server")


def at_least(least: int, kind=int):
    """An option's type that refuses a number below `least` in argparse's one sentence (exit status 2)."""
    def parse(text: str):
        value = kind(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, not {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m model serve",
                                description="An OpenAI-compatible API (completions, chat, streaming, metrics) on "
                                            "the serving engine.")
    p.add_argument("--model", default="smollm2", help="a native model: smollm2, gemma3, small, micro")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1; --host 0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=at_least(1), default=8000, help="1 to 65535 (default 8000)")
    p.add_argument("--api-key", default=None, help="every endpoint but /health then needs Authorization: Bearer KEY")
    p.add_argument("--max-waiting", type=at_least(1), default=256,
                   help="requests waiting at most, at least 1 (default 256); more get 429")
    p.add_argument("--max-tokens-limit", type=at_least(1), default=4096,
                   help="at least 1 (default 4096): a larger max_tokens is refused (400)")
    p.add_argument("--max-body-kb", type=at_least(1), default=1024,
                   help="at least 1 (default 1024): a larger request body is refused (413)")
    p.add_argument("--threads", type=at_least(1), default=None,
                   help="torch's CPU threads, at least 1 (default: DECODE_LAB_CPU_THREADS, else 1)")
    p.add_argument("--block-size", type=at_least(1), default=16,
                   help="positions per KV block, a power of two within the context (default 16)")
    p.add_argument("--budget-mb", type=at_least(0, float), default=256.0,
                   help="the KV cache pool's MiB (default 256); too small for one request is refused")
    p.add_argument("--chunk", type=at_least(16), default=None,
                   help="prompt positions prefilled per step at most, 16 to the context (default: off)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", default="cpu")
    return p


class Server(uvicorn.Server):
    """uvicorn's server whose Ctrl-C / SIGTERM first tells the engine loop to abort what runs, so that every open
    stream ends (with an error object) and uvicorn's wait for open connections ends with them."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop):
        super().__init__(config)
        self.engine_loop = engine_loop
        self.aio: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.aio = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.aio is not None:
            self.aio.call_soon_threadsafe(self.engine_loop.request_stop)
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # our stop is the signal's answer: exit 0, not the signal raised again


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    if args.port > 65535:
        cli.error(f"argument --port: must be at most 65535, not {args.port}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    else:
        apply_cpu_threads()
    try:
        model = load_model(args.model, args.device)
        settings = EngineSettings(block_size=args.block_size, budget_bytes=int(args.budget_mb * 2**20),
                                  prefix_cache=args.prefix_cache, chunk=args.chunk, history=64)
        engine_loop = EngineLoop(model, settings, max_waiting=args.max_waiting)
    except InputError as bad:
        print(f"serve: {bad.message('en')}", file=sys.stderr)
        return 2
    info = model.info
    api = ApiSettings(info.name, info.context_length, info.vocab_size, args.api_key, args.max_tokens_limit,
                      args.max_body_kb * 1024)
    app = build_app(engine_loop.start(), model.tokenizer, api)
    log.info("serving %s on http://%s:%d: %d KV blocks of %d positions (%.1f MiB), %d CPU threads, %s",
             info.name, args.host, args.port, engine_loop.engine.cache.n_blocks, args.block_size, args.budget_mb,
             torch.get_num_threads(), info.dtype)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=15, lifespan="off")
    try:
        Server(config, engine_loop).run()
    finally:
        engine_loop.stop()
    return 0
