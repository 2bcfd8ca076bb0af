"""Live server: the class's own server (`python -m model serve`) drawn as it serves, about twice a second.

The page reads GET /v1/engine/state through ui/live_server (the one HTTP client) and draws the block pool by
request (the key figure), the queues, what each of the last steps did, preemptions and prefix-cache hits as they
happen, and TTFT / ITL p50/p95/p99 of the finished requests by concurrent requests and by prompt length, with the
server's conditions. A student sends a prompt through the same API and sees their own request framed in the pool;
the same request is written out for curl and for the openai client. A server that cannot be read is one sentence.
"""

import time
import uuid

import streamlit as st

from ui import live_view as view
from ui.classroom import key_figure, settings, why
from ui.i18n import decimal, number, t
from ui.live_server import (
    DEFAULT_URL,
    KEY_ENV,
    URL_ENV,
    ServerDown,
    checked_url,
    is_loopback,
    latency_groups,
    send,
    server_key,
    server_url,
    snippets,
    students_address,
)
from ui.reruns import rerun_whole_page
from ui.state import DEFAULT_PROMPTS, PROMPT_MODES, default_prompt, keep_across_pages
from ui.widgets import md_escape

POLL_S = 0.5       # while the server answers: twice a second
DOWN_POLL_S = 5.0  # while it does not: often enough to notice it start, rarely enough to leave the page idle between
MAX_TOKENS = (8, 16, 32, 64, 128)
SENT_KEPT = 5  # the student's latest requests the page remembers
CODE_CSS = ("<style>.st-key-live_snippets code,.st-key-live_answer code{font-size:1rem !important;"
            "line-height:1.5 !important}</style>")

keep_across_pages({"live_url": server_url(), "live_key": server_key(), "live_paused": False, "live_prompt": "",
                   "live_max_tokens": 32})
state = st.session_state
if "live_user" not in state:  # the `user` of this session's requests: how the page finds them in the server's state
    state.live_user = "decode-lab-" + uuid.uuid4().hex[:8]
state.setdefault("live_sent", [])
# models whose prompts go as text: the bundled ones and Gemma 3 (no chat format), and any the server refused chat for
state.setdefault("live_no_chat", {m for m in DEFAULT_PROMPTS if PROMPT_MODES.get(m) != "chat"} - {"other"})

st.title(t("live.title"))
# the code a class copies, at the body's size (Streamlit writes code at 12 px, under the back row's 16)
st.html(CODE_CSS)
with settings("live"):
    with st.container(horizontal=True, vertical_alignment="bottom"):
        st.text_input(t("live.address"), key="live_url", width=320,
                      help=t("live.address_help", env=URL_ENV, default=DEFAULT_URL))
        st.text_input(t("live.api_key"), key="live_key", type="password", width=220,
                      help=t("live.api_key_help", env=KEY_ENV))
        st.selectbox(t("live.max_tokens"), MAX_TOKENS, key="live_max_tokens", width=160)
    st.caption(t("live.user", user=state.live_user))

url = state.live_url.strip().rstrip("/")
if state.live_max_tokens not in MAX_TOKENS:  # only a forged websocket message sends another value
    state.live_max_tokens = 32


def as_code(address: str) -> str:
    """An address in a sentence as a code span: written as typed (markdown would link it and show its escapes)."""
    return "`" + address.replace("`", "") + "`"


def mine(snapshot) -> set[int]:
    """This session's requests on the server as it runs now (a restarted server numbers its requests from 0
    again: an answer from before its start names none of them)."""
    server_start = time.time() - snapshot.uptime_s - 1.0
    rids = {s.rid for s in state.live_sent if s.rid is not None and s.sent_at >= server_start}
    return snapshot.mine(state.live_user, rids)


# the state as this run sees it: the fragments below poll it again; a change between answering and not answering
# redraws the whole page, so that the polling pace and the send box follow it
first = view.poll(url, state.live_key)
state.live_down_drawn = isinstance(first, ServerDown)
if not state.live_down_drawn:
    state.live_model = first.model


def snapshot_or_redraw():
    snapshot = view.poll(url, state.live_key)
    if isinstance(snapshot, ServerDown) != state.live_down_drawn:
        rerun_whole_page()
    return snapshot


def pool_part() -> None:
    """The status line and the key figure: the pool by request, the legend, the counts."""
    snapshot = snapshot_or_redraw()
    if isinstance(snapshot, ServerDown):
        with key_figure():
            st.html(view.setup_svg())
            st.info(view.down_sentence(snapshot, as_code(url)))
        return
    uptime = snapshot.uptime_s
    st.caption(t("live.status", url=as_code(url), model=md_escape(snapshot.model), minutes=int(uptime // 60),
                 seconds=int(uptime % 60))
               + " " + t("live.paused_note" if state.live_paused else "live.polling_note"))
    held = int((snapshot.holder >= 0).sum())
    preempted = sum(len(s.preempted) for s in snapshot.steps)
    hits = sum(1 for s in snapshot.steps for rid in s.admitted if s.cached_positions.get(rid, 0) > 0)
    with key_figure():
        st.html(view.pool_html(snapshot, mine(snapshot)))
        with st.container(horizontal=True):
            st.metric(t("live.running"), number(len(snapshot.running)))
            st.metric(t("live.waiting"), number(len(snapshot.waiting)))
            st.metric(t("live.blocks_held"), f"{number(held)} / {number(snapshot.n_blocks)}")
            st.metric(t("live.free_cached"), number(view.free_cached(snapshot)))
            last = len(snapshot.steps)  # a server that has run no step yet has no "last steps"
            st.metric(t("live.preemptions", steps=last) if last else t("live.preemptions_none"), number(preempted))
            st.metric(t("live.hits", steps=last) if last else t("live.hits_none"), number(hits))
    with why("live-pool"):
        st.caption(t("live.pool_caption" if view.drawn_by_block(snapshot) else "live.bar_caption",
                     blocks=number(snapshot.n_blocks), size=number(snapshot.block_size),
                     bytes=number(snapshot.block_bytes)))


def send_click() -> None:
    prompt = state.live_prompt.strip()
    if not prompt:
        state.live_refusal = t("live.empty_prompt")
        return
    model = state.get("live_model")
    try:
        sent = send(url, state.live_key, model, prompt, state.live_user, int(state.live_max_tokens),
                    chat_first=model not in state.live_no_chat)
    except ServerDown as down:
        state.live_refusal = view.down_sentence(down, as_code(url))
        return
    state.live_sent = ([*state.live_sent, sent])[-SENT_KEPT:]


def answer_part(snapshot) -> None:
    """The student's latest request: streaming, done, or refused."""
    if not state.live_sent:
        return
    sent = state.live_sent[-1]
    if sent.endpoint == "completions" and sent.done and sent.error is None and state.get("live_model"):
        state.live_no_chat.add(state.live_model)
    rid = sent.rid
    framed = "live.answer_id" if view.drawn_by_block(snapshot) else "live.answer_id_bar"
    where = (t(framed, rid=rid, id=md_escape(sent.response_id)) if rid is not None
             else t("live.answer_no_id"))
    if sent.error is not None:
        st.error(t("live.send_" + sent.error, url=as_code(url), message=md_escape(sent.message)))
        if not sent.text:
            return
    st.markdown(f"**{t('live.answer_title')}** · {where}")
    with st.container(key="live_answer"):
        st.code(sent.text or "…", language=None, wrap_lines=True)
    if sent.done:
        usage = sent.usage
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        st.caption(t("live.answer_done", reason=sent.finish_reason or "—", prompt=number(usage.get("prompt_tokens", 0)),
                     completion=number(usage.get("completion_tokens", 0)), cached=number(cached)))
    else:
        running = rid is not None and rid in snapshot.running
        st.caption(t("live.answer_running" if running else "live.answer_waiting",
                     seconds=decimal(time.monotonic() - sent.started, 1)))


def rest_part() -> None:
    """The student's answer, the queues and events, the lanes of the last steps, the latency tables."""
    snapshot = view.poll(url, state.live_key)
    if isinstance(snapshot, ServerDown):
        return
    answer_part(snapshot)
    left, right = st.columns([2, 3])
    with left:
        st.subheader(t("live.queues"))
        st.html(view.queue_html(snapshot, mine(snapshot)))
    with right:
        st.subheader(t("live.events"))
        if snapshot.steps:
            st.html(view.events_html(snapshot))
        else:
            st.caption(t("live.no_steps"))
    st.subheader(t("live.lanes", steps=len(snapshot.steps)))
    if snapshot.steps:
        st.html(view.lanes_html(snapshot))
    else:
        st.caption(t("live.no_steps"))
    st.subheader(t("live.latency"))
    done = snapshot.finished
    c = snapshot.conditions
    conditions = t("live.conditions", model=md_escape(snapshot.model), cpu=md_escape(c.cpu), threads=c.threads,
                   dtype=md_escape(c.dtype), torch=md_escape(c.torch), device=md_escape(c.device or "—"),
                   n=number(len(done)))
    if not done:
        st.caption(t("live.no_finished"))
        return
    st.markdown(f"**{t('live.by_concurrent')}**")
    st.html(view.latency_table(latency_groups(done, "concurrent"), "concurrent"))
    st.markdown(f"**{t('live.by_context')}**")
    st.html(view.latency_table(latency_groups(done, "context"), "context"))
    st.caption(conditions)
    with why("live-latency"):
        st.caption(t("live.latency_caption"))


# a server that does not answer is looked for even while the picture is frozen: there is no picture to keep
rate = DOWN_POLL_S if state.live_down_drawn else None if state.live_paused else POLL_S
st.fragment(pool_part, run_every=rate, key="live_pool")()

# -- the student's prompt, sent through the same API ------------------------------------------------------------------
with st.container(horizontal=True, vertical_alignment="bottom"):
    if not state.live_prompt:
        state.live_prompt = default_prompt(state.get("live_model", "small"))
    st.text_input(t("live.prompt"), key="live_prompt", max_chars=2000, width=520)
    st.button(t("live.send"), key="live_send", type="primary", icon=":material/send:", on_click=send_click,
              disabled=state.live_down_drawn)
    st.toggle(t("live.pause"), key="live_paused", help=t("live.pause_help"))
if state.get("live_refusal"):
    st.error(state.live_refusal)
    state.live_refusal = None
st.fragment(rest_part, run_every=rate, key="live_rest")()

# -- the same request, for the students to copy ----------------------------------------------------------------------
st.subheader(t("live.snippet"))
model = state.get("live_model", "smollm2")
endpoint = "completions" if model in state.live_no_chat else "chat/completions"
try:
    server_address = checked_url(url)
except ServerDown:
    server_address = DEFAULT_URL
shown_url, own = students_address(server_address, view.browser_origin(),
                                  lambda origin: view.origin_answers_api(origin, state.live_key))
curl, python = snippets(shown_url, endpoint, model, state.live_prompt.strip() or default_prompt(model),
                        int(state.live_max_tokens))
with st.container(key="live_snippets"):
    st.markdown(t("live.snippet_curl"))
    st.code(curl, language="bash", wrap_lines=True)
    st.markdown(t("live.snippet_python"))
    st.code(python, language="python")
said = t("live.snippet_caption", base=as_code(shown_url + "/v1"))
if own:
    said += " " + t("live.snippet_own")
elif is_loopback(shown_url):
    said += " " + t("live.snippet_local")
st.caption(said)
