"""Shared fixtures: the bundled models, and for the browser tests the real app on a free port and a fresh Chromium
page.

small, micro (session): the bundled models on the CPU, loaded once for every test module that reads them (a test
never changes a model's weights). no_kernels (function): the decode kernels as where they cannot be built;
needs_kernels (mark): skips a test that needs them, only where no C++ compiler exists.

app_server (session): starts `streamlit run app.py` headless on a free port, waits for /_stcore/health
and yields the base URL ("http://127.0.0.1:PORT"); the server is stopped at the end of the session.
browser_page (function): a Playwright page in a fresh browser context (no cookies, no storage) of the
system Chromium, viewport 1440×900. Both skip the test when Chromium or Playwright is missing
(`./dev test` installs Chromium first). artifacts: test-artifacts/, created on demand, for screenshots.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_START_TIMEOUT_S = 90


@pytest.fixture(scope="session", autouse=True)
def _cpu_threads():
    """As the app and the command line set it once per process: torch on DECODE_LAB_CPU_THREADS threads (1)."""
    from model.engine.runtime import apply_cpu_threads  # here, not at the top (torch; see `small`)

    apply_cpu_threads()


@pytest.fixture(scope="session")
def small():
    from model.engine.loading import (
        load_model,  # here, not at the top: the map page's tests check torch is not imported
    )

    return load_model("small", "cpu")


def packed(module):
    """A random model as the loader gives the shared one: eval, no gradients, its linears packed."""
    from model.engine.llama import pack_linears

    module.eval().requires_grad_(False)
    pack_linears(module)
    return module


@pytest.fixture(scope="module")
def tiny_gqa():
    """A random Llama: 3 layers, 6 query heads over 2 KV heads, d_head 8, no tokenizer (ids only)."""
    import torch

    from model.engine.llama import Llama, LlamaConfig
    from model.engine.runtime import NativeModel

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    return NativeModel("tiny-gqa", packed(Llama(cfg)), None, torch.device("cpu"))


@pytest.fixture(scope="session")
def micro():
    from model.engine.loading import load_model

    return load_model("micro", "cpu")


needs_kernels = pytest.mark.skipif(
    __import__("model.engine.kernels", fromlist=["compiler"]).compiler() is None,
    reason="no C++ compiler here (c++, g++ or $CXX): the decode kernels cannot be built, so the models stay dense on "
           "torch's product and int8 is refused (tests/test_engine.py checks that fallback)")


@pytest.fixture
def no_kernels(monkeypatch):
    """The decode kernels as on a machine without a C++ compiler: $CXX names none, and the build is tried afresh (the
    process's own build put aside for the test)."""
    import functools

    from model.engine import kernels

    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(kernels, "_built", functools.cache(kernels._built.__wrapped__))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    """Whether `url` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def served(cmd: list[str], health_url: str, timeout_s: float, what: str):
    """`cmd` started in the project's folder (its output to a temporary log), waited for until `health_url` answers
    200 (else the test fails with the log's tail), then stopped: terminated, killed after 10 s."""
    log = tempfile.NamedTemporaryFile(prefix="served-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        deadline = time.monotonic() + timeout_s
        while not answers(health_url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = Path(log.name).read_text(errors="replace")[-3000:]
                pytest.fail(f"{what} did not start (exit code {proc.poll()}):\n{tail}")
            time.sleep(0.3)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


def app_on(port: int) -> list[str]:
    """The app served on a loopback port, headless, no usage statistics, no file watcher."""
    return [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.port", str(port),
            "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"]


@pytest.fixture(scope="session")
def app_server():
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with served(app_on(port), base + "/_stcore/health", SERVER_START_TIMEOUT_S, "the app server"):
        yield base


@pytest.fixture(scope="session")
def _chromium():
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.skip("no system Chromium: install it with `apt-get install -y chromium` (./dev test does)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def browser_page(_chromium):
    context = _chromium.new_context(viewport={"width": 1440, "height": 900}, locale="vi-VN")
    page = context.new_page()
    page.set_default_timeout(30_000)
    yield page
    context.close()


# Streamlit's running indicator shows only once a run is 500 ms old, and a click's run starts when the server answers:
# right after a click neither says a run is coming, and a poller's fragment run can start and end between two looks.
# So a MutationObserver notes every change of the app's script state (the attribute Streamlit's own browser tests
# read), and the page is idle once that state has been "notRunning", connected, for QUIET_MS with no change.
QUIET_MS = 500
IDLE_JS = """([quiet, call]) => {
    const app = document.querySelector('[data-testid="stApp"]');
    if (!app) return false;
    const now = performance.now();
    const idle = window.__decodeLabIdle ??= {};
    if (idle.app !== app) {
        Object.assign(idle, {app, changed: now});
        new MutationObserver(() => { idle.changed = performance.now(); }).observe(app, {
            attributes: true, attributeFilter: ['data-test-script-state', 'data-test-connection-state']});
    }
    if (idle.call !== call) Object.assign(idle, {call, changed: now});
    return app.getAttribute('data-test-script-state') === 'notRunning'
        && app.getAttribute('data-test-connection-state') === 'CONNECTED' && now - idle.changed >= quiet;
}"""


def wait_idle(page, timeout_ms: int = 60_000) -> None:
    """Waits until no script run is going on or about to start (QUIET_MS of quiet)."""
    page.wait_for_function(IDLE_JS, arg=[QUIET_MS, uuid.uuid4().hex], polling=50, timeout=timeout_ms)


SETTLED_JS = """() => document.fonts.ready.then(() => new Promise(done =>
    requestAnimationFrame(() => requestAnimationFrame(() => done(true)))))"""


def settled(page) -> None:
    """The fonts loaded and two frames painted since: a layout (a resize, a toggle's CSS) has been applied."""
    page.evaluate(SETTLED_JS)


def retried(action, done, what: str, tries: int = 3) -> int:
    """action() until done() holds, at most `tries` times: a click that lands while a rerun is still drawing can
    be lost under load. Returns the tries it took and says so when more than one; fails, naming `what`, after
    the last."""
    for attempt in range(1, tries + 1):
        action()
        if done():
            if attempt > 1:
                warnings.warn(f"{what}: took {attempt} tries", stacklevel=2)
            return attempt
    raise AssertionError(f"{what}: still not done after {tries} tries")


def choose_sidebar_model(page, label: str) -> None:
    """Picks the sidebar's model by (a part of) its label, e.g. "SmolLM2-135M-Instruct", once the page's first run
    is done (a page that opens on a run made for it redraws the sidebar meanwhile, closing its drop-down)."""
    wait_idle(page)
    page.locator("[data-testid='stSidebar'] [data-testid='stSelectbox']").first.click()
    page.get_by_role("option", name=re.compile(re.escape(label))).click()


def wait_for_charts(page) -> None:
    """Plotly draws after the script run and an SVG image decodes after it arrives; a screenshot before that shows
    empty frames. Every page waited on has at least one chart."""
    wait_idle(page)
    page.wait_for_function("""() => {
        const plotly = [...document.querySelectorAll('[data-testid="stPlotlyChart"]')];
        const images = [...document.querySelectorAll('img.dl-chart')];
        return plotly.length + images.length > 0 && plotly.every(c => c.querySelector('.main-svg'))
            && images.every(i => i.complete && i.naturalWidth > 0);
    }""", timeout=60_000)


@pytest.fixture(scope="session")
def artifacts() -> Path:
    path = ROOT / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path


def pytest_collection_modifyitems(items):
    """Browser and real-model tests are slow by definition; `./dev test --fast` leaves the slow ones out."""
    for item in items:
        if any(item.get_closest_marker(name) for name in ("browser", "smollm2", "gemma3")):
            item.add_marker(pytest.mark.slow)
