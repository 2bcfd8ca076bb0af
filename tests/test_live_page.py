"""The Live server page (app_pages/live.py) and its client (ui/live_server.py): the JSON of /v1/engine/state as
dataclasses, TTFT / ITL percentiles by concurrent requests and by prompt length, every way a server can fail to be
read as one sentence, a prompt sent and its request framed in the pool, and the copy-paste snippets. Against
tests/live_fake.py, a stand-in server on a thread; the test against the real server is in test_browser_live.py."""

from __future__ import annotations

import base64
import json
import re
import socket
import time

import numpy as np
import pytest
from apptest import click, open_app
from live_fake import FakeServer, fixture_state

from model.texts import text
from ui.live_server import (
    ServerDown,
    answers_api,
    fetch_state,
    latency_groups,
    parse_state,
    percentiles,
    send,
    snippets,
    students_address,
)
from ui.live_view import EVENTS_SHOWN, marked_blocks, shown_events
from ui.svg import MINE_INK

PAGE = "app_pages/live.py"
COMMAND = "python -m model serve --model smollm2"


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def escaped(url: str) -> str:
    return f"`{url}`"  # a code span in a sentence


def open_live(lang: str, url: str, monkeypatch):
    monkeypatch.setenv("DECODE_LAB_SERVER_URL", url)
    return open_app(PAGE, lang=lang)


# -- the client ------------------------------------------------------------------------------------------------------

def test_the_state_json_becomes_the_dataclasses():
    state = parse_state(fixture_state())
    assert (state.model, state.block_size, state.n_blocks, state.block_bytes) == ("small", 16, 20, 32768)
    assert state.holder.tolist()[:8] == [3, 3, 3, 4, 4, -1, 5, 5] and state.refs[0] == 2
    assert state.cached.tolist()[:7] == [True, True, False, True, False, False, True]
    assert state.tables == {3: [[0, 1, 2]], 4: [[3, 4]], 5: [[0, 6, 7]]}
    assert (state.running, state.waiting) == ((3, 4, 5), (6,))
    assert state.requests[5].id == "chatcmpl-5" and state.requests[5].cached_tokens == 16
    assert [s.index for s in state.steps] == list(range(100, 110))
    assert state.steps[4].preempted == (4,) and state.steps[7].cached_positions == {5: 16}
    assert [(s.request, s.start, s.stop, s.kind) for s in state.steps[7].spans] == [
        (3, 35, 36, "decode"), (4, 16, 32, "recompute"), (5, 16, 32, "prefill")]
    assert state.finished[3].ttft_ms is None and state.finished[2].itl_ms == (40.0, 50.0, 60.0)
    assert state.conditions.threads == 1 and state.conditions.dtype == "float32"
    # the student's requests: by `user` (5 running, 1 finished), or by the id an answer named
    assert state.mine("decode-lab-fixture") == {1, 5}
    assert state.mine("nobody", {3}) == {3}
    # their blocks, a block shared with request 3 among them
    assert np.flatnonzero(marked_blocks(state, {5})).tolist() == [0, 6, 7]


def test_preemptions_and_prefix_hits_are_not_pushed_out_by_departures():
    found = [("left", f"l{k}") for k in range(10)] + [("preempted", "p"), ("admitted", "a"), ("hit", "h")]
    assert shown_events(found) == [*(("left", f"l{k}") for k in range(EVENTS_SHOWN - 2)), ("preempted", "p"),
                                   ("hit", "h")]
    assert shown_events(found[:3]) == found[:3]


def test_percentiles_by_concurrent_requests_and_by_prompt_length():
    finished = parse_state(fixture_state()).finished
    rows = latency_groups(finished, "concurrent")
    assert [(r.first, r.last, r.requests) for r in rows] == [(1, 1, 1), (2, 2, 2), (3, 4, 1)]
    assert rows[0].ttft_ms == {50: 100.0, 95: 100.0, 99: 100.0}
    assert rows[0].itl_ms == pytest.approx({50: 15.0, 95: 19.5, 99: 19.9})
    assert rows[1].ttft_ms == pytest.approx({50: 250.0, 95: 295.0, 99: 299.0})
    assert rows[1].itl_ms == pytest.approx({50: 45.0, 95: 58.5, 99: 59.7})  # 30, 40, 50, 60 pooled
    assert rows[2].ttft_ms is None and rows[2].itl_ms is None  # a request that ended before its first token
    rows = latency_groups(finished, "context")
    assert [(r.first, r.last, r.requests) for r in rows] == [(1, 16, 2), (17, 32, 1), (33, 64, 1)]
    assert rows[0].ttft_ms == {50: 100.0, 95: 100.0, 99: 100.0}  # prompts of 10 and 12 tokens, one first token
    assert rows[2].itl_ms == pytest.approx({50: 50.0, 95: 59.0, 99: 59.8})
    assert percentiles([]) is None


@pytest.mark.parametrize(("change", "detail"), [
    (lambda s: s.pop("pool"), "pool"),
    (lambda s: s["pool"]["holder"].pop(), "pool.holder"),
    (lambda s: s["pool"].__setitem__("cached", [1] * 20), "pool.cached"),
    (lambda s: s.__setitem__("running", "3,4"), "running"),
    (lambda s: s["steps"][0]["spans"][0].__setitem__("kind", "magic"), "steps.spans.kind"),
    (lambda s: s["finished"][0].__setitem__("ttft_ms", "fast"), "finished.ttft_ms"),
    (lambda s: s["requests"].__setitem__("x", s["requests"]["3"]), "requests"),
])
def test_a_state_that_is_not_one_names_its_first_wrong_field(change, detail):
    data = fixture_state()
    change(data)
    with pytest.raises(ServerDown) as down:
        parse_state(data)
    assert (down.value.reason, down.value.detail) == ("garbage", detail)


def test_every_way_a_server_cannot_be_read_is_a_reason():
    with pytest.raises(ServerDown) as down:
        fetch_state(closed_port_url())
    assert down.value.reason == "unreachable"
    with pytest.raises(ServerDown) as down:
        fetch_state("ftp://example.org")
    assert down.value.reason == "address"
    with FakeServer() as fake:
        assert fetch_state(fake.url + "/").n_blocks == 20
        fake.state = "<html>not json</html>"
        with pytest.raises(ServerDown) as down:
            fetch_state(fake.url)
        assert (down.value.reason, down.value.detail) == ("garbage", "json")
        fake.state = "[1, 2, 3]"
        with pytest.raises(ServerDown) as down:
            fetch_state(fake.url)
        assert down.value.reason == "garbage"
        for status, reason in ((401, "key"), (403, "key"), (500, "status")):
            fake.status = status
            with pytest.raises(ServerDown) as down:
                fetch_state(fake.url)
            assert (down.value.reason, down.value.detail) == (reason, str(status))


def wait_done(sent, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not sent.done and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sent.done
    return sent


def test_a_prompt_is_streamed_and_names_its_request():
    with FakeServer() as fake:
        sent = wait_done(send(fake.url, "", "small", "con mèo", "decode-lab-x", 16))
        assert (sent.error, sent.text, sent.response_id, sent.rid) == (None, "con mèo ngủ", "chatcmpl-5", 5)
        assert sent.finish_reason == "length" and sent.usage["completion_tokens"] == 3
        endpoint, body = fake.posted[-1]
        assert endpoint == "chat/completions" and body["user"] == "decode-lab-x" and body["stream"] is True
        assert body["messages"] == [{"role": "user", "content": "con mèo"}] and body["max_tokens"] == 16
        fake.chat = False  # a model without a chat format: the same prompt as text
        sent = wait_done(send(fake.url, "", "small", "con mèo", "decode-lab-x", 16))
        assert (sent.error, sent.endpoint, sent.text, sent.rid) == (None, "completions", "con mèo ngủ", 5)
        assert [e for e, _ in fake.posted[-2:]] == ["chat/completions", "completions"]
        assert fake.posted[-1][1]["prompt"] == "con mèo"
    sent = wait_done(send(closed_port_url(), "", "small", "x", "u", 4))
    assert sent.error == "unreachable"


def test_the_snippets_send_the_same_request():
    curl, python = snippets("http://10.0.0.5:8000", "chat/completions", "smollm2", "It's \"x\" & <y>", 32)
    assert curl.startswith("curl http://10.0.0.5:8000/v1/chat/completions \\\n")
    body = curl.split(" -d ", 1)[1]
    assert body.startswith("'") and body.endswith("'")
    sent = json.loads(body[1:-1].replace("'\"'\"'", "'"))  # shlex.quote's way of writing a quote back
    assert sent == {"model": "smollm2", "messages": [{"role": "user", "content": "It's \"x\" & <y>"}],
                    "max_tokens": 32}
    compile(python, "snippet", "exec")
    assert 'base_url="http://10.0.0.5:8000/v1"' in python and "chat.completions.create" in python
    _, python = snippets("http://10.0.0.5:8000", "completions", "small", "con mèo", 8)
    compile(python, "snippet", "exec")
    assert "client.completions.create" in python and 'prompt="con mèo"' in python


def test_the_snippets_use_the_address_a_laptop_reaches():
    """A server on this machine's loopback is no address for a laptop; where the page's own address serves the API
    too (./dev serve: /v1/ behind the same nginx), the snippets use that one."""
    with FakeServer() as fake:
        assert answers_api(fake.url) and not answers_api(closed_port_url())
        fake.state = "{}"
    asked = []

    def answers(origin):
        asked.append(origin)
        return origin == "http://10.0.0.5:8501"

    hall = "http://10.0.0.5:8501"
    assert students_address("http://127.0.0.1:8000", hall, answers) == (hall, True)
    assert students_address("http://127.0.0.1:8000", "http://10.0.0.6:8501", answers) == (
        "http://127.0.0.1:8000", False)
    assert students_address("http://10.0.0.7:8000", hall, answers) == ("http://10.0.0.7:8000", False)
    assert students_address("http://127.0.0.1:8000", "http://localhost:8501", answers) == (
        "http://127.0.0.1:8000", False)
    assert students_address("http://127.0.0.1:8000", None, answers) == ("http://127.0.0.1:8000", False)
    assert asked == [hall, "http://10.0.0.6:8501"]  # asked only where it could change the address


# -- the page --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lang", ["vi", "en"])
def test_no_server_is_one_sentence_with_the_command(lang, monkeypatch):
    url = closed_port_url()
    at = open_live(lang, url, monkeypatch)
    said = text("live.down_unreachable", lang).format(url=escaped(url), command=COMMAND, detail="")
    assert [i.value for i in at.info] == [said] and not at.error and not at.exception
    assert at.button(key="live_send").disabled
    assert any("dl-chart" in h.proto.body for h in at.html)  # the set-up's picture holds the first screen


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_a_busy_server_is_drawn(lang, monkeypatch):
    with FakeServer() as fake:
        at = open_live(lang, fake.url, monkeypatch)
        assert not at.error and not at.info
        bodies = "".join(h.proto.body for h in at.html)
        assert text("paged.pool_alt", lang).format(blocks=20, free=13) in bodies
        metrics = {m.label: m.value for m in at.metric}
        assert metrics[text("live.running", lang)] == "3" and metrics[text("live.waiting", lang)] == "1"
        assert metrics[text("live.blocks_held", lang)] == "7 / 20"
        assert metrics[text("live.preemptions", lang).format(steps=10)] == "1"
        assert metrics[text("live.hits", lang).format(steps=10)] == "1"
        assert text("live.event_preempted", lang).format(step=104, request=4) in bodies
        assert text("live.event_hit", lang).format(step=107, request=5, n=16) in bodies
        # TTFT p50 of the two requests that ran beside one other: 250 ms, in the language's format
        assert ("250,0" if lang == "vi" else "250.0") in bodies and ("59,7" if lang == "vi" else "59.7") in bodies
        captions = [c.value for c in at.caption]
        assert sum("Intel Xeon" in c and "float32" in c for c in captions) == 1


def pool_svg(at, lang: str) -> str:
    """The pool's picture as SVG text (an <img> of base64 SVG in the key figure)."""
    alt = text("paged.pool_alt", lang).format(blocks=20, free=13)
    for h in at.html:
        for src, said in re.findall(r'src="data:image/svg\+xml;base64,([^"]+)" alt="([^"]*)"', h.proto.body):
            if said == alt:
                return base64.b64decode(src).decode("utf-8")
    raise AssertionError("no pool picture")


def test_a_sent_prompt_is_answered_and_its_request_framed(monkeypatch):
    with FakeServer() as fake:
        at = open_live("en", fake.url, monkeypatch)
        assert MINE_INK not in pool_svg(at, "en")  # this session has sent nothing yet
        at.text_input(key="live_prompt").set_value("the dog")
        click(at, "live_send")
        sent = wait_done(at.session_state["live_sent"][-1])
        at.run()
        assert sent.rid == 5 and fake.posted[-1][1]["user"] == at.session_state["live_user"]
        # small has no chat format: its prompt goes to /v1/completions as text, at once
        assert [e for e, _ in fake.posted] == ["completions"] and fake.posted[-1][1]["prompt"] == "the dog"
        assert "con mèo ngủ" in [c.value for c in at.code]
        assert pool_svg(at, "en").count(f'stroke="{MINE_INK}"') == 3  # request 5's blocks 0, 6 and 7
        queues = "".join(h.proto.body for h in at.html if "Running" in h.proto.body)
        assert f"outline:3px solid {MINE_INK}" in queues  # and its chip in the running queue


def test_a_pool_too_large_to_draw_block_by_block_is_a_bar_and_says_so(monkeypatch):
    """`python -m model serve --model small` takes 256 MiB: 8,192 blocks, drawn as one bar (past 512: a grid sent to
    every student at every step), where no block is framed: the caption and the answer say the bar, not the
    squares."""
    with FakeServer() as fake:
        data = fake.state
        extra = 8192 - data["n_blocks"]
        data["n_blocks"] = 8192
        for name, fill in (("holder", -1), ("refs", 0), ("cached", False), ("filled", 0)):
            data["pool"][name] += [fill] * extra
        at = open_live("en", fake.url, monkeypatch)
        captions = [c.value for c in at.caption]
        assert text("live.bar_caption", "en").format(blocks="8,192", size=16, bytes="32,768") in captions
        assert not any(c.startswith("Each square") for c in captions)
        bodies = "".join(h.proto.body for h in at.html)
        assert text("live.legend_mine", "en") not in bodies
        assert text("paged.pool_summary", "en").format(blocks="8,192", most=512) in bodies


def test_an_answer_from_before_the_server_started_marks_nothing(monkeypatch):
    """A restarted server numbers its requests from 0 again: request 5 of the old run is not this session's."""
    with FakeServer() as fake:
        at = open_live("en", fake.url, monkeypatch)
        old = wait_done(send(fake.url, "", "small", "x", "someone", 4))
        old.sent_at -= 3600  # an hour ago; the fixture's server is 42.5 s old
        at.session_state["live_sent"] = [old]
        at.run()
        assert MINE_INK not in pool_svg(at, "en")


def test_the_frame_of_a_students_blocks_is_a_colour_of_its_own():
    """Its own name and colour: named MARK_INK once, it replaced the Flash page's red ✕ of a skipped tile (a second
    MARK_INK further down ui/svg.py); and a blue no request's lane colour is close to (a pink was, request 11's)."""
    from ui import svg

    assert svg.MARK_INK == "#c92a2a" and svg.MINE_INK not in svg.LANE_COLOURS


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_a_server_that_has_served_nothing_says_so(lang, monkeypatch):
    """Just started: no step, no request, every block free; no "last 0 steps" anywhere."""
    with FakeServer() as fake:
        data = fake.state
        data.update(steps=[], finished=[], running=[], waiting=[], requests={}, tables={}, uptime_s=3.0)
        data["pool"] = {"holder": [-1] * 20, "refs": [0] * 20, "cached": [False] * 20, "filled": [0] * 20}
        at = open_live(lang, fake.url, monkeypatch)
        assert not at.error and not at.exception
        metrics = {m.label: m.value for m in at.metric}
        assert metrics[text("live.preemptions_none", lang)] == "0" and metrics[text("live.hits_none", lang)] == "0"
        assert metrics[text("live.blocks_held", lang)] == "0 / 20"
        captions = [c.value for c in at.caption]
        assert captions.count(text("live.no_steps", lang)) == 2 and text("live.no_finished", lang) in captions
        assert not any(" 0 " in m.label for m in at.metric)
