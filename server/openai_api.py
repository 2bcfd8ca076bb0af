"""OpenAI's API as vLLM serves it, on the engine loop: routes, request and response JSON, server-sent events, and
errors as OpenAI's error object. This layer only translates: what runs and when is the engine's (through loop.py).

A response's `id` carries the engine's request id ("cmpl-17", "chatcmpl-17"), so that a client can find its request
in /v1/engine/state."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from model.engine.sampling import MAX_SEED, SamplingSettings
from model.engine.tokenizer import UnknownWordsError
from model.errors import InputError
from server.loop import FINISH_REASONS, EngineLoop, Event, QueueFull, Stopping, Submission, Usage
from server.text import TextStream

STATE_TIMEOUT_S = 10.0
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request looks whether its client is still there
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
# which request field an engine refusal is about
PARAMS = {"bad_temperature": "temperature", "bad_top_p": "top_p", "bad_top_k": "top_k", "bad_seed": "seed",
          "prompt_too_long": "prompt", "empty_prompt": "prompt", "paged_budget": "max_tokens"}


@dataclass(frozen=True)
class ApiSettings:
    model_name: str
    context_length: int
    vocab_size: int
    api_key: str | None = None
    max_tokens_limit: int = 4096          # a larger max_tokens is refused (the context clips the rest)
    body_limit_bytes: int = 1 << 20       # a larger request body: 413


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# -- request bodies ------------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class Sampled(BaseModel):
    """The fields both endpoints share; strict: a string where a number belongs is a 400, not a guess."""
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)        # vLLM's: -1 or 0 means off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    user: str | None = None
    ignore_eos: bool = False                       # vLLM's extension: run to max_tokens (a benchmark's fixed lengths)


class CompletionBody(Sampled):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)       # the legacy endpoint's default (OpenAI's and vLLM's)
    logprobs: int | None = Field(None, ge=0, le=20)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(Sampled):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def parse(kind: type[BaseModel], data: object) -> Any:
    try:
        return kind.model_validate(data)
    except ValidationError as bad:
        first = bad.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = next((str(p) for p in first["loc"] if isinstance(p, str)), None)
        raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"], param) from None


async def read_json(request: Request, limit: int) -> object:
    """The body, refused with 413 as soon as it passes `limit` bytes (chunked bodies too), and 400 unless JSON."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than this server's limit of {limit} bytes.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is larger than this server's limit of {limit} bytes.")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON.") from None


# -- from a body to a submission ------------------------------------------------------------------------------------


def sampling_of(body: Sampled) -> SamplingSettings:
    temperature = 1.0 if body.temperature is None else body.temperature
    top_k = None if body.top_k in (None, -1, 0) else body.top_k
    # OpenAI's sampling without a seed differs every time; the engine draws from a seed, so one is drawn here
    seed = random.randrange(MAX_SEED) if body.seed is None else body.seed
    return SamplingSettings(temperature, top_k, 1.0 if body.top_p is None else body.top_p, seed)


def stops_of(body: Sampled) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def check_common(body: Sampled, settings: ApiSettings) -> None:
    if body.model is not None and body.model != settings.model_name:
        raise ApiError(404, f"the model `{body.model}` does not exist: this server serves `{settings.model_name}`.",
                       "model", "model_not_found")
    if body.n != 1:
        raise ApiError(400, "n > 1 is not supported: this server draws one completion per request, so send n "
                       "requests instead.", "n")


def max_new_tokens(requested: int | None, prompt_len: int, settings: ApiSettings) -> int:
    """max_tokens within the server's limit (refused above it), clipped to what the context leaves (the engine then
    stops at the context: finish_reason "length"); by default all the context leaves, up to the limit."""
    room = settings.context_length - prompt_len
    if prompt_len >= settings.context_length:
        raise ApiError(400, f"the prompt has {prompt_len} tokens but this model's context holds only "
                       f"{settings.context_length} positions: shorten it.", "prompt", "context_length_exceeded")
    if requested is None:
        return max(1, min(room, settings.max_tokens_limit))
    if requested > settings.max_tokens_limit:
        raise ApiError(400, f"max_tokens is {requested} but this server allows at most "
                       f"{settings.max_tokens_limit}.", "max_tokens")
    return max(1, min(requested, room))


def completion_prompt(prompt, tokenizer, settings: ApiSettings) -> list[int]:
    """Text or token ids, one prompt per request (a list of several is refused in one sentence)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, "one prompt per request: send a list of several prompts as separate requests.",
                           "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt.strip():  # it would still be a begin-of-sequence token: a request for nothing
            raise ApiError(400, "the prompt is empty: send at least one word.", "prompt")
        try:
            ids = tokenizer.encode(prompt).ids
        except UnknownWordsError as unknown:
            raise ApiError(400, str(unknown), "prompt") from None
    else:
        ids = list(prompt)
        bad = [i for i in ids if not 0 <= i < settings.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside this model's vocabulary (0 to "
                           f"{settings.vocab_size - 1}).", "prompt")
    if not ids:
        raise ApiError(400, "the prompt is empty: send at least one token.", "prompt")
    return ids


def message_text(message: ChatMessage) -> str:
    """A message's text: a string, or the text parts of a list of parts (images are not this model's)."""
    if isinstance(message.content, list):
        return "".join(str(part.get("text", "")) for part in message.content if part.get("type") == "text")
    return message.content or ""


def chat_prompt(body: ChatBody, tokenizer, settings: ApiSettings) -> list[int]:
    if tokenizer.chat_template is None:
        raise ApiError(400, f"the model `{settings.model_name}` has no chat template: send its prompt as text "
                       "to /v1/completions.", "messages")
    messages = [{"role": m.role, "content": message_text(m)} for m in body.messages]
    try:
        return tokenizer.encode_chat(messages).ids
    except InputError as refused:
        raise ApiError(400, refused.message("en"), "messages") from None


# -- one request's run, on the asyncio side ---------------------------------------------------------------------------


class Run:
    """A submitted request: its events from the engine thread, its text so far, its end."""

    def __init__(self, engine_loop: EngineLoop, submission: Submission, text: TextStream):
        self.engine_loop, self.submission, self.text = engine_loop, submission, text
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.rid: int | None = None
        self.finished: Event | None = None
        self.logprobs: list = []    # per token used, (id, logprob, [(id, logprob)])
        aio = asyncio.get_running_loop()

        def deliver(event: Event) -> None:
            try:
                aio.call_soon_threadsafe(self.events.put_nowait, event)
            except RuntimeError:  # the event loop is closed (the server stopped): nobody is listening
                pass

        submission.deliver = deliver

    async def start(self) -> None:
        """Submitted and added, or the reason why not as an ApiError."""
        try:
            self.engine_loop.submit(self.submission)
        except QueueFull as full:
            raise ApiError(429, str(full), None, "queue_full") from None
        except Stopping as stopping:
            raise ApiError(503, str(stopping), None, "server_shutdown") from None
        event = await self.events.get()
        if event.kind == "refused":
            raise ApiError(400, event.error.message("en"), PARAMS.get(event.error.code)) from None
        if event.kind == "finished":
            raise ApiError(503, "the server is shutting down: it takes no new requests.")
        self.rid = event.rid

    async def deltas(self) -> AsyncIterator[tuple[str, list]]:
        """(text delta, the new tokens' logprobs) until the request ends; self.finished then holds the end."""
        while self.finished is None:
            event = await self.events.get()
            if event.kind == "tokens":
                yield self._tokens(event)
            elif event.kind == "finished":
                self.finished = event
        tail = self.text.flush()
        if tail:
            yield tail, []

    def _tokens(self, event: Event) -> tuple[str, list]:
        if self.text.stopped:
            return "", []
        delta = self.text.add(event.ids)
        used = self.text.tokens_used - (len(self.text.ids) - len(event.ids))
        new = [(i, *lp) for i, lp in zip(event.ids[:used], event.logprobs)]
        self.logprobs += new
        if self.text.stopped:  # a stop string: the engine stops now, its blocks freed at once
            self.engine_loop.abort(self.submission, "stop")
        return delta, new

    def abort_if_running(self) -> None:
        if self.finished is None:
            self.engine_loop.abort(self.submission)

    @property
    def finish_reason(self) -> str | None:
        if self.text.stopped:
            return "stop"
        return FINISH_REASONS.get(self.finished.reason) if self.finished else None

    @property
    def usage(self) -> dict:
        usage = self.finished.usage if self.finished and self.finished.usage else Usage(0, 0, 0)
        completion = self.text.tokens_used if self.text.stopped else usage.completion_tokens
        return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": completion,
                "total_tokens": usage.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}

    def failure(self) -> ApiError | None:
        """A run that ended without a finish OpenAI knows: the server stopping, or an engine failure."""
        reason = self.finished.reason if self.finished else None
        if reason == "shutdown":
            return ApiError(503, f"the server is shutting down: this request was aborted after "
                            f"{len(self.text.ids)} tokens.", None, "server_shutdown")
        if reason == "error":
            return ApiError(500, "the engine failed while running this request (the server's log says why).")
        return None


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) or tokenizer.token(token_id)


def completion_logprobs(tokenizer, entries: list, offset: int) -> dict:
    """The legacy completions' shape: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset."""
    tokens = [token_text(tokenizer, i) for i, _, _ in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{token_text(tokenizer, j): v for j, v in top} for _, _, top in entries],
            "text_offset": offsets}


def chat_logprobs(tokenizer, entries: list) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        return {"token": token_text(tokenizer, token_id), "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token_id))}
    return {"content": [one(i, lp) | {"top_logprobs": [one(j, v) for j, v in top]} for i, lp, top in entries]}


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


# -- the two generating endpoints ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """How one endpoint writes its responses (completions and chat differ only here)."""
    prefix: str                                   # "cmpl" | "chatcmpl"
    obj: str                                      # the response's object
    chunk_obj: str                                # a stream chunk's object
    choice: Callable[[str, dict | None, str | None], dict]        # (text, logprobs, finish) → a full choice
    chunk_choice: Callable[[str, dict | None, str | None], dict]  # (delta, logprobs, finish) → a chunk's choice
    logprobs: Callable[[list, int], dict]          # (entries, text offset) → logprobs JSON
    first_chunk: dict | None = None               # a chat stream opens with the assistant's role


def completion_shape(tokenizer) -> Shape:
    return Shape("cmpl", "text_completion", "text_completion",
                 lambda text, lp, fin: {"index": 0, "text": text, "logprobs": lp, "finish_reason": fin},
                 lambda text, lp, fin: {"index": 0, "text": text, "logprobs": lp, "finish_reason": fin},
                 lambda entries, offset: completion_logprobs(tokenizer, entries, offset))


def chat_shape(tokenizer) -> Shape:
    return Shape("chatcmpl", "chat.completion", "chat.completion.chunk",
                 lambda text, lp, fin: {"index": 0, "message": {"role": "assistant", "content": text},
                                        "logprobs": lp, "finish_reason": fin},
                 lambda text, lp, fin: {"index": 0, "delta": {"content": text} if text else {},
                                        "logprobs": lp, "finish_reason": fin},
                 lambda entries, offset: chat_logprobs(tokenizer, entries),
                 {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None})


async def respond(run: Run, shape: Shape, model_name: str, want_logprobs: bool, stream: bool,
                  include_usage: bool, request: Request) -> Response:
    await run.start()
    head = {"id": f"{shape.prefix}-{run.rid}", "created": int(time.time()), "model": model_name}
    if stream:
        return RunStream(run, stream_events(run, shape, head, want_logprobs, include_usage))
    collecting = asyncio.ensure_future(collect(run))
    try:
        while not collecting.done():
            await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_S)
            if not collecting.done() and await request.is_disconnected():
                collecting.cancel()
                return Response(status_code=499)
        text = collecting.result()
    finally:
        run.abort_if_running()
    failed = run.failure()
    if failed is not None:
        return failed.response()
    logprobs = shape.logprobs(run.logprobs, 0) if want_logprobs else None
    return JSONResponse(head | {"object": shape.obj, "choices": [shape.choice(text, logprobs, run.finish_reason)],
                                "usage": run.usage})


async def collect(run: Run) -> str:
    return "".join([delta async for delta, _ in run.deltas()])


class RunStream(StreamingResponse):
    """Server-sent events of one run. A client that goes away ends the response (Starlette listens for the
    disconnect and cancels the stream): whatever ended it, a run still going is aborted then, its blocks freed at
    once, even when the stream had not begun (a generator never started has no `finally` of its own to run)."""

    def __init__(self, run: Run, events: AsyncIterator[bytes]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.abort_if_running()


async def stream_events(run: Run, shape: Shape, head: dict, want_logprobs: bool,
                        include_usage: bool) -> AsyncIterator[bytes]:
    """A chunk per step's tokens, the finish, the usage when asked, then [DONE]."""
    chunk = head | {"object": shape.chunk_obj}
    usage_field = {"usage": None} if include_usage else {}
    offset = 0
    if shape.first_chunk is not None:
        yield sse(chunk | {"choices": [shape.first_chunk]} | usage_field)
    async for delta, entries in run.deltas():
        if delta or (entries and want_logprobs):
            logprobs = shape.logprobs(entries, offset) if want_logprobs else None
            yield sse(chunk | {"choices": [shape.chunk_choice(delta, logprobs, None)]} | usage_field)
            offset += len(delta)
    failed = run.failure()
    if failed is not None:
        yield sse(failed.body())
    else:
        yield sse(chunk | {"choices": [shape.chunk_choice("", None, run.finish_reason)]} | usage_field)
        if include_usage:
            yield sse(chunk | {"choices": [], "usage": run.usage})
    yield sse("[DONE]")


# -- the app ---------------------------------------------------------------------------------------------------------


class Guard:
    """ASGI middleware: with an API key, every path but /health needs `Authorization: Bearer <key>` (a pure ASGI
    layer: Starlette's BaseHTTPMiddleware would stand between a stream and its client's disconnect)."""

    def __init__(self, app, api_key: str | None):
        self.app, self.expected = app, None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.expected is not None and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization")
            if given != self.expected:
                error = ApiError(401, "a valid API key is needed: send `Authorization: Bearer <key>`.", None,
                                 "invalid_api_key")
                return await error.response()(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(engine_loop: EngineLoop, tokenizer, settings: ApiSettings) -> Guard:
    """The FastAPI app behind its Guard (an ASGI app for uvicorn)."""
    app = FastAPI(title="Decode Lab", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_loop = engine_loop

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(404)
    async def not_found(request: Request, _exc) -> JSONResponse:
        return ApiError(404, f"no such endpoint: {request.method} {request.url.path}.").response()

    @app.exception_handler(405)
    async def not_allowed(request: Request, _exc) -> JSONResponse:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}.").response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine_loop.stopping else 200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model",
                                            "created": int(engine_loop.started), "owned_by": "decode-lab",
                                            "root": settings.model_name, "max_model_len": settings.context_length}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine_loop.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/engine/state")
    async def state() -> JSONResponse:
        if engine_loop.stopped:
            raise ApiError(503, "the server is shutting down: the engine is stopped.")
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        aio = asyncio.get_running_loop()
        engine_loop.snapshot(lambda s: aio.call_soon_threadsafe(lambda: answer.done() or answer.set_result(s)))
        try:
            return JSONResponse(await asyncio.wait_for(answer, STATE_TIMEOUT_S))
        except TimeoutError:
            raise ApiError(503, "the engine did not answer in time (it is stopping, or one step is very long)."
                           ) from None

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse(CompletionBody, await read_json(request, settings.body_limit_bytes))
        check_common(body, settings)
        ids = completion_prompt(body.prompt, tokenizer, settings)
        return await generate(request, body, ids, body.logprobs, body.max_tokens, completion_shape(tokenizer))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = parse(ChatBody, await read_json(request, settings.body_limit_bytes))
        check_common(body, settings)
        ids = chat_prompt(body, tokenizer, settings)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await generate(request, body, ids, logprobs, requested, chat_shape(tokenizer))

    async def generate(request: Request, body: Sampled, ids: list[int], logprobs: int | None,
                       requested: int | None, shape: Shape) -> Response:
        submission = Submission(ids, max_new_tokens(requested, len(ids), settings), sampling_of(body),
                                lambda _e: None, logprobs=logprobs, user=body.user, kind=shape.prefix,
                                ignore_eos=body.ignore_eos)
        run = Run(engine_loop, submission, TextStream(tokenizer.decode, stops_of(body)))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(run, shape, settings.model_name, logprobs is not None, body.stream, include_usage,
                             request)

    return Guard(app, settings.api_key)
