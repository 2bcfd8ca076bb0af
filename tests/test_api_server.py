"""The OpenAI-compatible API server (server/, `python -m model serve`, issue 51) driven over real HTTP: the official
`openai` client (streaming and not) and httpx for the raw cases, against uvicorn on a free port with the small model.

Each test's docstring names a change to server/ that makes it red."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from api_server import serving, wait_until
from test_batch import prompts_of, solo_run

from server.loop import QueueFull, Submission
from server.text import TextStream

STATE_KEYS = {"model", "block_size", "n_blocks", "block_bytes", "pool", "tables", "running", "waiting", "requests",
              "steps", "finished", "conditions", "uptime_s"}


@pytest.fixture(scope="module")
def api(small):
    with serving(small) as served:
        yield served


def client(served, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                         **kwargs)


def post(served, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, **{"timeout": 30} | kwargs)


def pool_free(served) -> bool:
    state = served.state()
    return not state["running"] and not state["waiting"] and all(h == -1 for h in state["pool"]["holder"])


# -- what a client gets ------------------------------------------------------------------------------------------


def test_models_and_health(api):
    """Red when /v1/models lists another id than the model's name (an OpenAI client's `model=` would 404)."""
    assert [m.id for m in client(api).models.list().data] == ["small"]
    assert httpx.get(f"{api.url}/health").status_code == 200


def test_greedy_requests_at_once_give_their_solo_runs(api, small):
    """Four greedy requests sent together (prompts as token ids) each get the tokens of their solo run. Red with
    the engine's sampling settings not passed (the default temperature 1.0 draws)."""
    prompts = prompts_of(small, [5, 17, 9, 30])

    def ask(prompt):
        return client(api).completions.create(model="small", prompt=prompt, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, answer in zip(prompts, answers):
        assert answer.choices[0].text == small.tokenizer.decode(solo_run(small, prompt, 12)[1])
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage.prompt_tokens == len(prompt) and answer.usage.completion_tokens == 12
        assert answer.id.startswith("cmpl-") and answer.id.removeprefix("cmpl-").isdigit()


def test_streaming_gives_the_same_text_with_usage_and_done(api):
    """The openai client's stream: deltas that join into the non-streamed text, the finish, the usage chunk
    (stream_options.include_usage), and `data: [DONE]` on the wire. Red when the last text is not flushed."""
    c = client(api)
    whole = c.completions.create(model="small", prompt="con mèo", max_tokens=10, temperature=0)
    chunks = list(c.completions.create(model="small", prompt="con mèo", max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    raw = post(api, "/v1/completions", {"prompt": "con mèo", "max_tokens": 3, "stream": True}).text
    assert raw.rstrip().endswith("data: [DONE]")


def test_a_repeated_prompt_reports_its_cached_tokens(api, small):
    """usage.prompt_tokens_details.cached_tokens is the prefix cache's hit: 0 the first time, the full blocks the
    second, and /metrics' prefix_cache_hits_total counts it. Red when cached_tokens is left at 0."""
    prompt = prompts_of(small, [40])[0]
    first = client(api).completions.create(model="small", prompt=prompt, max_tokens=2, temperature=0)
    second = client(api).completions.create(model="small", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert first.choices[0].text == second.choices[0].text
    hits = next(float(x.rsplit(" ", 1)[1]) for x in httpx.get(f"{api.url}/metrics").text.splitlines()
                if x.startswith("decode_lab:prefix_cache_hits_total"))
    assert hits >= second.usage.prompt_tokens_details.cached_tokens   # /metrics counts the same hit


def test_a_stop_string_cuts_the_text_and_frees_the_request(api, small):
    """The text ends before the stop string (which straddles two tokens here), finish_reason "stop", and the engine
    stops the request then (its record in the state ends with "stop" before its 30 tokens). Red when the stop
    string does not abort the engine's request (it would run its 30 tokens)."""
    prompt = prompts_of(small, [6])[0]
    full = small.tokenizer.decode(solo_run(small, prompt, 30)[1])
    words = full.split(" ")
    stop = f"{words[2][-1]} {words[3][:1]}"          # the end of the third word and the start of the fourth
    answer = client(api).completions.create(model="small", prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                                            extra_body={"ignore_eos": True})
    assert answer.choices[0].text == full[:full.index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens < 30
    wait_until(lambda: pool_free(api), what="the stopped request's blocks")
    record = next(f for f in api.state()["finished"] if f"cmpl-{f['request']}" == answer.id)
    assert record["finish_reason"] == "stop" and record["completion_tokens"] < 30


def test_completion_logprobs(api):
    """logprobs=2: per token its log-probability and the top 2, the greedy token the most likely. Red when the
    engine request's `logprobs` is not set (no entries)."""
    answer = client(api).completions.create(model="small", prompt="con mèo", max_tokens=4, temperature=0,
                                            logprobs=2, extra_body={"ignore_eos": True})
    lp = answer.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(top) == 2 for top in lp.top_logprobs)
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value == pytest.approx(max(top.values()))


def test_utf8_deltas_hold_back_half_a_letter():
    """Byte-level tokens of "việt": no delta carries a replacement character, and the deltas join into the word.
    Red without the hold-back of a trailing U+FFFD."""
    data = "việt nam".encode()
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"), [])
    deltas = [stream.add([b]) for b in data] + [stream.flush()]
    assert "".join(deltas) == "việt nam" and not any("\ufffd" in d for d in deltas)


def test_a_stop_string_is_never_sent_in_part():
    """A delta that could be the start of a stop string waits. Red without that hold-back (TextStream._safe_end):
    "ab" would go out before the "c" that completes the stop "abc"."""
    stream = TextStream(lambda ids: "".join(map(chr, ids)), ["abc"])
    sent = "".join(stream.add([ord(ch)]) for ch in "xyabc!")
    assert sent + stream.flush() == "xy" and stream.stopped and stream.tokens_used == 5


# -- refused, each as OpenAI's error object ------------------------------------------------------------------------

BAD = [
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": 3.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "top_k": -3}, 400, "top_k"),
    ("/v1/completions", {"prompt": "a", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": [7, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": list(range(4, 4 + 130))}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD, ids=[f"{b}" for _, b, _, _ in BAD])
def test_bad_requests_get_the_error_object(api, path, body, status, param):
    """Each bad field: its status, OpenAI's error object, the field named. Red when validation is relaxed (a
    string temperature accepted) or a check is dropped."""
    response = post(api, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["message"] and "\n" not in error["message"]


def test_refusals_say_the_limit_in_one_sentence(api):
    """A prompt past the context says the context's size; n > 1 says it is not supported. Red with a bare
    "invalid request"."""
    too_long = post(api, "/v1/completions", {"prompt": list(range(4, 4 + 130))}).json()["error"]["message"]
    assert "128" in too_long and "130" in too_long
    assert "n > 1 is not supported" in post(api, "/v1/completions", {"prompt": "a", "n": 3}).json()["error"]["message"]


def test_body_size_limit_and_bad_json(api):
    """A body past the limit is 413 (declared or chunked), one that is not JSON 400. Red without the limit."""
    big = {"prompt": "a " * 40000}
    assert post(api, "/v1/completions", big).status_code == 413

    def chunks():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"a " * 1000
        yield b'"}'

    streamed = httpx.post(f"{api.url}/v1/completions", content=chunks(), timeout=30)
    assert streamed.status_code == 413 and streamed.json()["error"]["message"]
    bad = httpx.post(f"{api.url}/v1/completions", content=b"{nope", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "the request body is not valid JSON."


def test_max_tokens_past_the_context_is_clipped(api):
    """A max_tokens the context cannot hold runs to the context and ends with "length". Red when it is refused."""
    answer = client(api).completions.create(model="small", prompt=list(range(4, 4 + 120)), max_tokens=100,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 128 - 120


def test_the_api_key_guards_every_endpoint_but_health(small):
    """--api-key: 401 with OpenAI's error object without the key, served with it, /health open. Red when the
    Guard lets /metrics or /v1/engine/state through."""
    with serving(small, api_key="sesame") as served:
        for path in ("/v1/models", "/metrics", "/v1/engine/state"):
            response = httpx.get(f"{served.url}{path}")
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert post(served, "/v1/completions", {"prompt": "a"}).status_code == 401
        assert httpx.get(f"{served.url}/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            client(served, api_key="wrong").models.list()
        answer = client(served, api_key="sesame").completions.create(model="small", prompt="a", max_tokens=2)
        assert answer.usage.completion_tokens >= 1
        assert httpx.get(f"{served.url}/metrics", headers=served.headers).status_code == 200


def test_a_full_waiting_queue_answers_429(small):
    """--max-waiting 1 with the engine loop not started yet: the first request waits, the second gets 429 at once
    (never an unbounded backlog); once the loop runs the first is served. Red without the bound."""
    with serving(small, max_waiting=1, start_loop=False) as served:
        first = {}
        thread = threading.Thread(target=lambda: first.update(r=post(served, "/v1/completions",
                                                                      {"prompt": "a", "max_tokens": 2})))
        thread.start()
        wait_until(lambda: served.loop.inbox.qsize() == 1, what="the first request in the inbox")
        second = post(served, "/v1/completions", {"prompt": "a", "max_tokens": 2})
        assert second.status_code == 429 and second.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            client(served).completions.create(model="small", prompt="a", max_tokens=2)
        served.loop.start()
        thread.join(30)
        assert first["r"].status_code == 200
        assert post(served, "/v1/completions", {"prompt": "a", "max_tokens": 2}).status_code == 200  # room again


def test_the_bound_counts_only_requests_not_yet_admitted(small):
    """submit refuses past max_waiting; a refused add gives its place back. Red when a refusal keeps its place."""
    from model.engine.sampling import SamplingSettings
    from model.serving.engine import EngineSettings
    from server.loop import EngineLoop
    loop = EngineLoop(small, EngineSettings(budget_bytes=2**20), max_waiting=2)
    events = []
    for _ in range(2):
        loop.submit(Submission([], 3, SamplingSettings(), events.append))  # empty: refused by the engine
    with pytest.raises(QueueFull):
        loop.submit(Submission([1], 3, SamplingSettings(), events.append))
    loop.start()
    wait_until(lambda: len(events) == 2, what="the two refusals")
    assert [e.kind for e in events] == ["refused", "refused"]
    loop.submit(Submission([1, 5], 3, SamplingSettings(), events.append))  # the places are free again
    loop.stop()


# -- the client going away, the server stopping ----------------------------------------------------------------------


def test_a_client_leaving_mid_stream_frees_its_blocks_at_once(small):
    """The stream is closed after three chunks: the request is aborted (finish "abort" in the state) and every
    block is free again, long before its 120 tokens would have run. Red without the abort in RunStream.__call__'s
    `finally`."""
    with serving(small, step_s=0.03) as served:
        with httpx.stream("POST", f"{served.url}/v1/completions", timeout=30,
                          json={"prompt": "con mèo", "max_tokens": 120, "stream": True, "ignore_eos": True,
                                "temperature": 0}) as r:
            lines = r.iter_lines()
            seen = [line for line, _ in zip((x for x in lines if x.startswith("data: ")), range(3))]
            rid = int(json.loads(seen[0][6:])["id"].removeprefix("cmpl-"))
            assert str(rid) in served.state()["requests"]
        wait_until(lambda: pool_free(served), timeout=2, what="the blocks back after the client left")
        finished = {f["request"]: f for f in served.state()["finished"]}
        assert finished[rid]["finish_reason"] == "abort" and finished[rid]["completion_tokens"] < 60
        assert served.loop.engine.cache.pool.n_free == served.loop.engine.cache.n_blocks


def test_stopping_the_server_ends_every_stream_with_an_error_and_logs_it(small, caplog):
    """The server's signal handler (SIGTERM, Ctrl-C): each open stream ends with an error object and [DONE], a
    non-streamed request gets 503, and the log says how many were aborted. Red when handle_exit does not stop
    the engine loop first (the streams would hang until uvicorn's timeout)."""
    results = {}
    with serving(small, step_s=0.03) as served:
        def stream(i):
            with httpx.stream("POST", f"{served.url}/v1/completions", timeout=30,
                              json={"prompt": "con mèo", "max_tokens": 120, "stream": True, "ignore_eos": True,
                                "temperature": 0}) as r:
                results[i] = [line for line in r.iter_lines() if line.startswith("data: ")]

        def whole():
            results["whole"] = post(served, "/v1/completions", {"prompt": "a", "max_tokens": 120,
                                                                 "ignore_eos": True})
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)] + [threading.Thread(target=whole)]
        for t in threads:
            t.start()
        wait_until(lambda: len(served.state()["running"]) == 4, what="four requests running")
        with caplog.at_level("WARNING", logger="decode_lab.server"):
            served.server.handle_exit(15, None)
            for t in threads:
                t.join(10)
    for i in range(3):
        assert results[i][-1] == "data: [DONE]"
        error = json.loads(results[i][-2][6:])["error"]
        assert error["code"] == "server_shutdown" and "aborted" in error["message"]
    assert results["whole"].status_code == 503
    assert "aborted 4 running and 0 waiting requests" in caplog.text


# -- what the server shows ---------------------------------------------------------------------------------------


def test_engine_state_while_a_request_runs(small):
    """/v1/engine/state has the documented keys; a running request is in `running`, `requests` (with its response
    id) and `tables`, its blocks in the pool under its rid; once finished it is in `finished` with its latencies.
    Red when the response id and the rid disagree."""
    with serving(small, step_s=0.02) as served:
        with httpx.stream("POST", f"{served.url}/v1/completions", timeout=30,
                          json={"prompt": "con mèo", "max_tokens": 20, "stream": True, "ignore_eos": True,
                                "temperature": 0, "user": "an"}) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the response (the client leaves)
            first = json.loads(next(x for x in lines if x.startswith("data: "))[6:])
            state = served.state()
            rid = int(first["id"].removeprefix("cmpl-"))
            assert set(state) >= STATE_KEYS and state["running"] == [rid]
            assert state["requests"][str(rid)] | {"completion_tokens": 0} == {
                "id": f"cmpl-{rid}", "user": "an", "state": "running", "prompt_tokens": 3, "completion_tokens": 0,
                "cached_tokens": 0, "preemptions": 0}
            assert rid in state["pool"]["holder"] and state["tables"][str(rid)][0][0] >= 0
            assert state["steps"][-1]["spans"][0]["request"] == rid
            assert set(state["conditions"]) >= {"cpu", "threads", "dtype", "torch", "max_waiting"}
            list(lines)
        done = served.state()["finished"][-1]
        assert done["request"] == rid and done["completion_tokens"] == 20 and done["finish_reason"] == "length"
        assert done["ttft_ms"] > 0 and len(done["itl_ms"]) == 19 and done["e2e_ms"] >= done["ttft_ms"]
        assert done["concurrent"] == 1 and done["user"] == "an"


def test_metrics_count_what_was_served(small):
    """/metrics in Prometheus' text format under decode_lab:, counting the tokens and latencies of the requests
    served. Red when finished requests are not observed."""
    with serving(small) as served:
        c = client(served)
        usages = [c.completions.create(model="small", prompt="con mèo", max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True}).usage for _ in range(3)]
        text = httpx.get(f"{served.url}/metrics").text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    label = '{model_name="small"}'
    assert values[f"decode_lab:generation_tokens_total{label}"] == sum(u.completion_tokens for u in usages) == 15
    assert values[f"decode_lab:prompt_tokens_total{label}"] == 9
    assert values[f"decode_lab:time_to_first_token_seconds_count{label}"] == 3
    assert values[f"decode_lab:inter_token_latency_seconds_count{label}"] == 12
    assert values['decode_lab:e2e_request_latency_seconds_bucket{model_name="small",le="+Inf"}'] == 3
    assert values[f"decode_lab:prefix_cache_queries_total{label}"] == 9
    assert values[f"decode_lab:kv_blocks_used{label}"] == 0 and values[f"decode_lab:num_requests_running{label}"] == 0
    assert "# TYPE decode_lab:time_to_first_token_seconds histogram" in text


def test_a_client_leaving_a_non_streamed_request_frees_its_blocks(small):
    """A non-streamed request whose client gives up (a read timeout closes the connection) is aborted within the
    handler's poll, not run to its end. Red without the disconnect poll in respond()."""
    with serving(small, step_s=0.03) as served:
        with pytest.raises(httpx.ReadTimeout):
            post(served, "/v1/completions", {"prompt": "con mèo", "max_tokens": 120, "ignore_eos": True},
                 timeout=httpx.Timeout(30, read=0.4))
        wait_until(lambda: pool_free(served), timeout=2, what="the blocks back after the client left")
        assert served.state()["finished"][-1]["finish_reason"] == "abort"


def test_an_engine_failure_ends_its_requests_with_an_error_and_the_server_goes_on(small):
    """A step that raises ends the requests of that step (a stream: the error object, then [DONE]; not a hang),
    and the next request is served. Red when the loop lets the exception end its thread."""
    with serving(small) as served:
        step, failed = served.loop.engine.step, []

        def fails_once(*args, **kwargs):
            if not failed:
                failed.append(True)
                raise RuntimeError("a bug in a step")
            return step(*args, **kwargs)

        served.loop.engine.step = fails_once
        lines = post(served, "/v1/completions", {"prompt": "con mèo", "max_tokens": 5, "stream": True}).text
        data = [x for x in lines.splitlines() if x.startswith("data: ")]
        assert data[-1] == "data: [DONE]" and json.loads(data[-2][6:])["error"]["type"] == "server_error"
        answer = client(served).completions.create(model="small", prompt="con mèo", max_tokens=3)
        assert answer.usage.completion_tokens >= 1
        wait_until(lambda: pool_free(served), what="the failed request's blocks")


def test_preempted_requests_still_give_their_solo_runs(small):
    """A pool of 8 blocks for four requests of 4 blocks each: the engine preempts (counted in /metrics and in the
    requests' finished records), and every greedy answer is still its solo run. Red when preemptions are not
    counted."""
    prompts = prompts_of(small, [20, 21, 22, 23])
    with serving(small, budget_mb=0.25, prefix_cache=False) as served:
        def ask(prompt):
            return client(served).completions.create(model="small", prompt=prompt, max_tokens=40, temperature=0,
                                                     extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, prompts))
        metrics = httpx.get(f"{served.url}/metrics").text
    for prompt, answer in zip(prompts, answers):
        assert answer.choices[0].text == small.tokenizer.decode(solo_run(small, prompt, 40)[1])
    preemptions = next(float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines()
                       if x.startswith("decode_lab:num_preemptions_total"))
    assert preemptions >= 1


def test_a_stopping_loop_takes_no_new_request(small):
    """Once a stop is asked, submit refuses (the HTTP side's 503) instead of queueing a request nobody will run.
    Red when submit does not look at `stopping` (the caller would wait for ever)."""
    from model.engine.sampling import SamplingSettings
    from model.serving.engine import EngineSettings
    from server.loop import EngineLoop, Stopping
    loop = EngineLoop(small, EngineSettings(budget_bytes=2**20)).start()
    loop.request_stop()
    with pytest.raises(Stopping):
        loop.submit(Submission([1, 5], 3, SamplingSettings(), lambda _e: None))
    loop.stop()
    assert loop.stopped


def test_the_command_line_refuses_bad_settings_in_one_sentence(capsys):
    """`python -m model serve` with a port of 0 or a block size the engine cannot use: exit status 2 and one
    sentence on stderr, before any port is opened. Red when --port takes any int."""
    from server.cli import main
    with pytest.raises(SystemExit) as exit_status:
        main(["--port", "0"])
    assert exit_status.value.code == 2 and "--port: must be at least 1, not 0" in capsys.readouterr().err
    assert main(["--model", "small", "--block-size", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("serve: The block size must be a power of 2") and "\n" not in err


class TemplatedWords:
    """small's word tokenizer with a chat format of its own (each message's words, then the answer's start), so that
    the chat endpoint runs in the quick lane without SmolLM2."""

    chat_template = "words"

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode_chat(self, messages):
        return self.inner.encode(" ".join(m["content"] for m in messages))


def test_chat_streams_deltas_with_the_role_first_and_chat_logprobs(small):
    """The chat endpoint's shapes, as the openai client reads them: a message with the role, usage, logprobs as
    `content` entries with bytes and top_logprobs; the stream's first delta the role, its deltas joining into the
    message, include_usage's last chunk. Red when the stream's first chunk lacks the role."""
    with serving(small, tokenizer=TemplatedWords(small.tokenizer)) as served:
        c = client(served)
        messages = [{"role": "user", "content": "con mèo"}]
        whole = c.chat.completions.create(model="small", messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
        assert whole.id.startswith("chatcmpl-") and whole.choices[0].message.role == "assistant"
        assert whole.usage.prompt_tokens == 3 and whole.usage.completion_tokens == 6
        entries = whole.choices[0].logprobs.content
        assert len(entries) == 6 and all(len(e.top_logprobs) == 3 and e.bytes for e in entries)
        assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in entries)  # greedy: the top one
        chunks = list(c.chat.completions.create(model="small", messages=messages, max_tokens=6, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == whole.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 6 and chunks[-2].choices[0].finish_reason == "length"
