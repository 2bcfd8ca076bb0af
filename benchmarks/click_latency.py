"""Click → settled in a real browser: a bare one-button Streamlit page and the Decode page's skeleton against the
app's clicks.

    .venv/bin/python benchmarks/click_latency.py [--clicks 20] [--prompt "my mother"] [--app-root DIR]
    .venv/bin/python benchmarks/click_latency.py --model smollm2 --context 200      # the real model, if fetched
    .venv/bin/python benchmarks/click_latency.py --model smollm2 --context 200 --without-check
    .venv/bin/python benchmarks/click_latency.py --option runner.postScriptGC=false  # try a Streamlit setting

Starts its own servers on free ports (the bare page, the skeleton and the app, all under the project's .streamlit
config) and the system Chromium, headless, 1280×720, in a fresh profile.

The skeleton is the Decode page without a model: the sidebar, the navigation over seven pages, the title, the row of
controls, and a fragment of four buttons and one line of HTML; a click on its first button reruns the fragment. It
tells Streamlit's own share of a click on a page of this shape. The bare page and the skeleton stay open in tabs of
their own and are clicked once each before every app action, so that the machine's noisy minutes weigh on the
references and the app alike.

Settled: the script run has finished (its "script finished" message reached the page), Streamlit's status widget is
gone, every chart is drawn (plotly's, and the decoded SVG images), the expected text is shown, and no DOM mutation
happened for QUIET_MS. The time is taken inside the page: from the click's (or key press's) event time to the last
DOM mutation before the quiet period. Printed per action: p50, p95, p95 ÷ the bare page's p95; and as medians, to
tell the server's share from the browser's: the time until the page's main thread handled "script finished" (it
waits behind the rendering of earlier messages), the server process's CPU time meanwhile (/proc, 10 ms ticks) and
the websocket bytes received.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conditions import ROOT, p50_p95, print_conditions, server_options
from playwright.sync_api import Page, sync_playwright

from loadtest.ws_client import StreamlitServer

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
VIEWPORT = {"width": 1280, "height": 720}
QUIET_MS = 100
SETTLE_TIMEOUT_MS = 120_000

BARE_PAGE = """
import streamlit as st

st.session_state.setdefault("clicks", 0)


def count():
    st.session_state.clicks += 1


st.button("Click", key="click", on_click=count)
st.write(f"clicks: {st.session_state.clicks}")
"""

SKELETON_PAGE = """
from pathlib import Path

import streamlit as st

st.set_page_config(page_title="Decode Lab", layout="wide")
with st.sidebar:
    st.radio("Language", ["vi", "en"], key="lang", horizontal=True)
    st.selectbox("Model", ["small", "micro", "smollm2"], key="model_name")
    st.selectbox("Device", ["auto", "cpu"], key="device")
here = Path(__file__).parent
pages = [st.Page(str(here / "step_view.py"), title="Decode step by step", default=True)]
pages += [st.Page(str(here / "other.py"), title=f"Page {i}", url_path=f"page{i}") for i in range(6)]
st.navigation(pages).run()
"""
SKELETON_FILES = {
    "other.py": "import streamlit as st\n\nst.write('another page')\n",
    "step_view.py": """
import streamlit as st

st.session_state.setdefault("clicks", 0)


def count():
    st.session_state.clicks += 1


st.title("Decode step by step")
st.caption("One token per step over a KV cache that grows by one position.")
with st.container(border=True, horizontal=True, vertical_alignment="bottom"):
    st.selectbox("Layer", range(4), key="layer", width=90)
    st.selectbox("Head", range(4), key="head", width=220)
    st.slider("Temperature", 0.0, 2.0, 0.0, step=0.05, key="temperature", width=200)
    st.toggle("Top-k on", key="top_k_on")
    st.number_input("Top-k", min_value=1, max_value=1000, value=50, key="top_k", width=110)
    st.slider("Top-p", 0.01, 1.0, 1.0, step=0.01, key="top_p", width=200)
    st.number_input("Seed", min_value=0, max_value=2**31 - 1, value=0, key="seed", width=130)
    st.toggle("Check each step", key="check_each_step", value=True)


@st.fragment
def step_view():
    with st.container(horizontal=True):
        st.button("Next", key="click", type="primary", icon=":material/skip_next:", on_click=count)
        st.button("Back", key="back", icon=":material/undo:")
        st.button("Run to end", key="run_to_end", icon=":material/fast_forward:")
        st.button("Reset", key="reset", icon=":material/restart_alt:")
    st.html(f"<p>clicks: {st.session_state.clicks}</p>")


step_view()
""",
}

# Before any page script: the time of each click / key press, of the last DOM mutation, and of each "script
# finished" message on Streamlit's websocket (ForwardMsg field 6, read with a minimal protobuf field scanner).
INSTRUMENT_JS = """
(() => {
  const lat = window.__lat = {input: null, last: performance.now(), finished: 0, finishedAt: null, bytes: 0};
  const mark = e => { lat.input = e.timeStamp; };
  window.addEventListener('click', mark, true);
  window.addEventListener('keydown', mark, true);
  const watch = () => new MutationObserver(() => { lat.last = performance.now(); }).observe(
    document.documentElement, {subtree: true, childList: true, attributes: true, characterData: true});
  if (document.documentElement) watch(); else document.addEventListener('DOMContentLoaded', watch);

  const varint = (bytes, at) => {
    let value = 0, scale = 1;
    for (;;) { const b = bytes[at++]; value += (b & 127) * scale; scale *= 128; if (b < 128) return [value, at]; }
  };
  const scriptFinished = bytes => {  // the ScriptFinishedStatus, or null for any other ForwardMsg
    let at = 0;
    while (at < bytes.length) {
      let tag, value;
      [tag, at] = varint(bytes, at);
      const field = Math.floor(tag / 8), wire = tag & 7;
      if (wire === 0) { [value, at] = varint(bytes, at); if (field === 6) return value; }
      else if (wire === 2) { [value, at] = varint(bytes, at); at += value; }
      else if (wire === 1) at += 8;
      else if (wire === 5) at += 4;
      else return null;
    }
    return null;
  };
  const Native = window.WebSocket;
  window.WebSocket = class extends Native {
    constructor(...args) {
      super(...args);
      this.addEventListener('message', ev => {
        if (!(ev.data instanceof ArrayBuffer)) return;
        lat.bytes += ev.data.byteLength;
        const status = scriptFinished(new Uint8Array(ev.data));
        if (status === 0 || status === 1 || status === 3) { lat.finished += 1; lat.finishedAt = performance.now(); }
      });
    }
  };
})();
"""

@dataclass
class Click:
    settled_ms: float   # click → settled, in the page
    shown_ms: float | None  # click → the expected text first on the page (a Next's new token), before settling
    finished_ms: float  # click → the page's main thread handled "script finished"
    server_cpu_ms: float  # the server process's CPU time meanwhile
    kib: float          # websocket bytes the page received meanwhile


SETTLED_JS = """
([quiet, finishedBefore, expect]) => {
  const lat = window.__lat;
  if (lat.finished <= finishedBefore || performance.now() - lat.last < quiet) return false;
  if (document.querySelector('[data-testid="stStatusWidget"]')) return false;
  const charts = [...document.querySelectorAll('[data-testid="stPlotlyChart"]')];
  if (!charts.every(c => c.querySelector('.main-svg'))) return false;
  if (![...document.querySelectorAll('img.dl-chart')].every(i => i.complete && i.naturalWidth > 0)) return false;
  return !expect || new RegExp(expect).test(document.body.textContent);
}
"""


SHOWN_JS = "expect => new RegExp(expect).test(document.body.textContent)"


class Timer:
    """Runs one user action; returns a Click: the page's times, the server's CPU time, the bytes it sent.
    `pace` runs before each action: the reference pages' clicks, interleaved with the app's."""

    def __init__(self, page: Page, server: StreamlitServer, pace: Callable[[], None] = lambda: None):
        self.page, self.server, self.pace = page, server, pace

    def __call__(self, action, expect: str | None = None) -> Click:
        self.pace()
        self.page.bring_to_front()  # a tab in the background renders later: the page clicked is the one shown
        before = self.page.evaluate("[window.__lat.finished, window.__lat.bytes]")
        cpu = self.server.cpu_seconds()
        action()
        shown = None
        if expect:  # the Decode page shows a Next's token before its check's verdict: when the token came
            self.page.wait_for_function(SHOWN_JS, arg=expect, polling="raf", timeout=SETTLE_TIMEOUT_MS)
            shown = self.page.evaluate("performance.now() - window.__lat.input")
        self.page.wait_for_function(SETTLED_JS, arg=[QUIET_MS, before[0], expect], polling=20,
                                    timeout=SETTLE_TIMEOUT_MS)
        lat = self.page.evaluate("window.__lat")
        return Click(lat["last"] - lat["input"], shown, lat["finishedAt"] - lat["input"],
                     1000 * (self.server.cpu_seconds() - cpu), (lat["bytes"] - before[1]) / 1024)


def button(page: Page, key: str):
    return page.locator(f".st-key-{key} button").first


def enabled(page: Page, key: str) -> bool:
    return button(page, key).is_enabled()


def cache_length(page: Page) -> int:
    return int(re.search(r"cache: (\d+) positions", page.locator("body").text_content()).group(1))


def printed_ms(page: Page, pattern: str) -> float | None:
    """A time the page prints, found by a pattern whose group is the milliseconds: the engine step's own time in
    the step summary ("… · 2.41 ms on cpu, float32"), the check's recompute ("… without the cache took 10.5 ms")."""
    found = re.search(pattern, page.locator("body").text_content())
    return float(found.group(1)) if found else None


ENGINE_MS, RECOMPUTE_MS = r"([\d.]+) ms on ", r"without the cache took ([\d.]+) ms"


class ReferencePage:
    """The bare page or the skeleton, open in a tab of its own; each click() presses its counting button once
    and keeps the time. Clicked before every app action, so that a noisy minute of the machine weighs on both."""

    def __init__(self, page: Page, server: StreamlitServer):
        self.timer, self.count, self.times = Timer(page, server), 0, []
        page.goto(server.url)
        page.get_by_text("clicks: 0").wait_for()
        for _ in range(2):  # warm-up clicks, not kept
            self.click()
        self.times.clear()

    def click(self) -> None:
        self.count += 1
        self.times.append(self.timer(button(self.timer.page, "click").click, expect=f"clicks: {self.count}\\b"))


def set_text(timer: Timer, key: str, value: str) -> None:
    """Type into a text or number input and commit it (Enter), then wait for the rerun."""
    box = timer.page.locator(f".st-key-{key} input").first
    if box.input_value() != value:  # an unchanged value starts no run
        timer(lambda: (box.fill(value), box.press("Enter")))


def choose_model(timer: Timer, name: str) -> None:
    """Type the name into the sidebar's model box (it filters its options) and take the first match."""
    box = timer.page.locator("[class*='st-key-model_name'] input").first
    box.click()
    box.fill(name)
    timer(lambda: box.press("Enter"))


def open_settings(page: Page) -> None:
    """The Decode page opens on a run with its prompt form folded into its settings: open them once (they stay
    open). A page that opens on the form instead (an older checkout under --app-root) shows its button at once."""
    page.locator(".st-key-key-figure, .st-key-run_prefill button").first.wait_for()
    if not page.locator(".st-key-run_prefill button").first.is_visible():
        page.locator(".st-key-decode_settings summary").first.click()


def measure_app(page: Page, server: StreamlitServer, clicks: int, prompt: str, model: str, check: bool,
                pace: Callable[[], None]) -> dict:
    page.goto(server.url + "/decode?lang=en")
    timer = Timer(page, server, pace)
    open_settings(page)
    button(page, "run_prefill").wait_for()
    if model != "small":
        choose_model(timer, model)
    set_text(timer, "max_new_tokens", str(clicks + 5))
    set_text(timer, "prompt_text", prompt)
    if not check:  # the Decode page's "Check each step" toggle (shown with a run): a recompute per Next
        timer(button(page, "run_prefill").click, expect=r"cache: \d+ positions")
        timer(page.locator(".st-key-check_each_step label").first.click, expect="Off: this step")
        timer(button(page, "reset").click)
    times: dict[str, list[Click]] = {k: [] for k in ("Prefill", "first Next after prefill", "Decode Next", "Back",
                                              "sampling change", "Flash Next")}
    engine: list[float] = []
    recompute: list[float | None] = []
    for _ in range(clicks):  # the decode page shows the prompt form only before a run: Reset first
        times["Prefill"].append(timer(button(page, "run_prefill").click, expect=r"cache: \d+ positions"))
        start = cache_length(page)
        times["first Next after prefill"].append(
            timer(button(page, "next").click, expect=f"cache: {start + 1} positions"))
        timer(button(page, "reset").click)
    timer(button(page, "run_prefill").click, expect=r"cache: \d+ positions")
    context = cache_length(page)
    for series, key, other, change in (("Decode Next", "next", "back", 1), ("Back", "back", "next", -1)):
        while len(times[series]) < clicks:
            if not enabled(page, key):  # the run ended (end of text) or is back at the prefill: one unmeasured step
                n = cache_length(page)
                timer(button(page, other).click, expect=f"cache: {n - change} positions")
            n = cache_length(page)
            times[series].append(timer(button(page, key).click, expect=f"cache: {n + change} positions"))
            step_ms = printed_ms(page, ENGINE_MS) if key == "next" else None
            if step_ms is not None:
                engine.append(step_ms)
                recompute.append(printed_ms(page, RECOMPUTE_MS))
    slider = page.locator(".st-key-temperature input[type='range']").first
    for _ in range(clicks):  # 0.05 per key press, 0 → 1 in 20 presses
        slider.focus()
        times["sampling change"].append(timer(lambda: page.keyboard.press("ArrowRight")))
    timer(page.locator("[data-testid='stSidebarNav'] a[href$='/flash']").first.click)
    button(page, "flash_next").wait_for()
    for _ in range(clicks):
        if not enabled(page, "flash_next"):  # the walk's last tile: back to the first, unmeasured
            timer(button(page, "flash_first").click)
        times["Flash Next"].append(timer(button(page, "flash_next").click))
    return {"times": times, "engine": engine, "recompute": [r for r in recompute if r is not None],
            "context": context}


def long_prompt(model_name: str, context: int) -> str:
    """English text of at least `context` tokens for the model (its tokenizer counts)."""
    from model.engine import generate
    from model.engine.loading import load_model

    model = load_model(model_name, "cpu")
    sentence = "The students watch the model write one token at a time, and the cache grows by one position. "
    text = sentence
    while len(generate.encode_prompt(model, text).ids) < context:
        text += sentence
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clicks", type=int, default=20)
    parser.add_argument("--prompt", default="my mother")
    parser.add_argument("--model", default="small")
    parser.add_argument("--context", type=int, default=0, help="make the prompt this many tokens long")
    parser.add_argument("--without-check", action="store_true",
                        help="turn the Decode page's check (a recompute of the whole sequence per Next) off")
    parser.add_argument("--app-root", type=Path, default=ROOT)
    parser.add_argument("--option", action="append", default=[], metavar="SECTION.NAME=VALUE",
                        help="a Streamlit option for the servers, e.g. runner.postScriptGC=false (repeatable)")
    args = parser.parse_args()
    prompt = long_prompt(args.model, args.context) if args.context else args.prompt
    executable = shutil.which("chromium") or "/usr/bin/chromium"
    browser_version = subprocess.run([executable, "--version"], capture_output=True, text=True).stdout.strip()
    print_conditions(args.app_root, streamlit_options=" ".join(args.option) or "the project's config",
                     browser=f"{browser_version}, headless, at "
                     f"{VIEWPORT['width']}×{VIEWPORT['height']}, server and browser on this machine",
                     model=f"{args.model} (float32, device 'auto' = cpu)",
                     check="off" if args.without_check else "on (the page's default)",
                     prompt=repr(prompt if len(prompt) < 60 else prompt[:57] + "..."),
                     settled=f"script finished, no status widget, charts drawn, then {QUIET_MS} ms without a "
                             "DOM mutation; time from the click's event to the last mutation")
    pages = Path(tempfile.mkdtemp(prefix="bare-pages-"))
    for name, source in {"bare.py": BARE_PAGE, "skeleton.py": SKELETON_PAGE, **SKELETON_FILES}.items():
        (pages / name).write_text(source)
    options = server_options(args.option)  # for every server: the bare page runs under the app's settings
    with (StreamlitServer(pages / "bare.py", *options) as bare,
          StreamlitServer(pages / "skeleton.py", *options) as skeleton,
          StreamlitServer("app.py", *options, root=args.app_root) as app,
          tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile, sync_playwright() as p):
        context = p.chromium.launch_persistent_context(profile, executable_path=executable, headless=True,
                                                       args=CHROMIUM_ARGS, viewport=VIEWPORT, locale="en-US")
        context.add_init_script(INSTRUMENT_JS)
        context.set_default_timeout(SETTLE_TIMEOUT_MS)
        references = [ReferencePage(context.new_page(), server) for server in (bare, skeleton)]
        page = context.new_page()

        def pace() -> None:
            for reference in references:
                reference.click()

        result = measure_app(page, app, args.clicks, prompt, args.model, check=not args.without_check, pace=pace)
        context.close()
    bare_times, skeleton_times = (reference.times for reference in references)
    print(f"context after prefill: {result['context']} positions; load average after the run: "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    _, bare95 = p50_p95([c.settled_ms for c in bare_times])
    print(f"{'action':<25} {'clicks':>6} {'p50 ms':>7} {'p95 ms':>7} {'p95/bare':>8}   {'→finished':>9} "
          f"{'server CPU':>10} {'received':>9}")
    print(f"{'':<25} {'':>6} {'':>7} {'':>7} {'':>8}   {'p50 ms':>9} {'p50 ms':>10} {'p50 KiB':>9}")
    for name, rows in [("bare page", bare_times), ("Decode page's skeleton", skeleton_times),
                       *result["times"].items()]:
        if not rows:
            print(f"{name:<25} {0:>6} (not measured)")
            continue
        s50, s95 = p50_p95([c.settled_ms for c in rows])
        f50, cpu50, kib50 = (p50_p95([getattr(c, f) for c in rows])[0] for f in ("finished_ms", "server_cpu_ms", "kib"))
        print(f"{name:<25} {len(rows):>6} {s50:>7.0f} {s95:>7.0f} {s95 / bare95:>7.2f}×   {f50:>9.0f} {cpu50:>10.0f} "
              f"{kib50:>9.1f}")
    for name in ("first Next after prefill", "Decode Next"):
        shown = [c.shown_ms for c in result["times"][name] if c.shown_ms is not None]
        if shown:
            h50, h95 = p50_p95(shown)
            print(f"{name}: click → its token on the page p50 {h50:.0f} ms, p95 {h95:.0f} ms ({h95 / bare95:.2f}× the "
                  "bare page's p95); the check's verdict follows")
    first = result["times"]["Prefill"][0]
    print(f"the page's first Prefill: {first.settled_ms:.0f} ms (included above)")
    if result["engine"]:
        e50, e95 = p50_p95(result["engine"])
        print(f"engine decode step alone (the page's step summary): p50 {e50:.1f} ms, p95 {e95:.1f} ms")
    if result["recompute"]:
        r50, r95 = p50_p95(result["recompute"])
        print(f"the check's recompute without the cache, in each Next (the page's check): p50 {r50:.1f} ms, "
              f"p95 {r95:.1f} ms")


if __name__ == "__main__":
    main()
