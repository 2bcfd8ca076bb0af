"""Thirty students on one server: sessions over Streamlit's websocket protocol (no browsers, so only the server is
measured), each with its own prompt, all pressing Next together several times.

    .venv/bin/python benchmarks/classroom_load.py [--sessions 30] [--rounds 5] [--app-root DIR]
                                                  [--option runner.postScriptGC=false]

Prints the time from a Next message to "script finished" (p50/p95 over every session and round), the server's
CPU milliseconds per click (/proc/<pid>/stat of the server process over the rounds), one session's Next alone,
and the isolation check: every session's tokens equal its solo run on the engine. --app-root measures another
copy of the project (e.g. `git archive HEAD | tar -x -C /tmp/before` for a before/after pair); --option tries
a Streamlit setting without editing .streamlit/config.toml.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from conditions import ROOT, p50_p95, print_conditions, server_options

from loadtest.ws_client import StreamlitServer, open_decode_session, prompts_for
from model.engine import generate
from model.engine.loading import load_model
from model.engine.sampling import SamplingSettings

SOLO_CLICKS = 10


def solo_ids(model, prompt: str, nexts: int) -> list[int]:
    """The tokens one session alone would show after prefill and `nexts` Next clicks, with the page's defaults
    (greedy, DEFAULT_NEW_TOKENS: tests/test_state.py holds ui/state.py's DEFAULTS to them)."""
    gen = generate.start(model, generate.encode_prompt(model, prompt).ids, SamplingSettings(),
                         generate.DEFAULT_NEW_TOKENS, ())
    for _ in range(nexts):
        generate.step(model, gen)
    return gen.ids


async def measure(server: StreamlitServer, prompts: list[str], rounds: int) -> dict:
    solo = await open_decode_session(server.ws_url, prompts[0])  # also warms the server up: imports, model load
    await solo.run("run_prefill")
    alone = [await solo.run("next") for _ in range(SOLO_CLICKS)]
    await solo.close()

    sessions = [await open_decode_session(server.ws_url, p) for p in prompts]
    prefill = await asyncio.gather(*(s.run("run_prefill") for s in sessions))
    next_times, cpu_per_click = [], []
    for _ in range(rounds):
        cpu0 = server.cpu_seconds()
        next_times += await asyncio.gather(*(s.run("next") for s in sessions))
        cpu_per_click.append((server.cpu_seconds() - cpu0) / len(sessions))
    shown = [s.strip_ids() for s in sessions]
    exceptions = sum(len(s.exceptions) for s in sessions)
    for s in sessions:
        await s.close()
    return {"alone": alone, "prefill": prefill, "next": next_times, "cpu": cpu_per_click, "shown": shown,
            "exceptions": exceptions}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--app-root", type=Path, default=ROOT)
    parser.add_argument("--option", action="append", default=[], metavar="SECTION.NAME=VALUE",
                        help="a Streamlit option for the app server, e.g. runner.postScriptGC=false (repeatable)")
    args = parser.parse_args()
    model = load_model("small", "cpu")
    prompts = prompts_for(model, args.sessions)
    print_conditions(args.app_root, streamlit_options=" ".join(args.option) or "the project's config",
                     model=f"small ({model.info.dtype}, server device 'auto' = cpu)",
                     sessions=f"{args.sessions}, each its own two-word prompt (e.g. {prompts[0]!r}), "
                              f"{args.rounds} rounds of Next pressed by all together; the client runs on the "
                              "same machine")
    with StreamlitServer("app.py", *server_options(args.option), root=args.app_root) as server:
        started = time.monotonic()
        result = asyncio.run(measure(server, prompts, args.rounds))
        wall = time.monotonic() - started
    print(f"wall time: {wall:.1f} s; load average after the run: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    a50, a95 = p50_p95(result["alone"])
    print(f"one session alone, Next → script finished: p50 {a50 * 1000:.0f} ms, p95 {a95 * 1000:.0f} ms "
          f"({SOLO_CLICKS} clicks)")
    f50, f95 = p50_p95(result["prefill"])
    print(f"{args.sessions} sessions pressing Run prefill together: p50 {f50:.2f} s, p95 {f95:.2f} s")
    n50, n95 = p50_p95(result["next"])
    cpu_ms = 1000 * sum(result["cpu"]) / len(result["cpu"])
    print(f"{args.sessions} sessions pressing Next together: p50 {n50:.2f} s, p95 {n95:.2f} s "
          f"(goal p95 ≤ 3 s), max {max(result['next']):.2f} s over {len(result['next'])} clicks")
    print(f"server CPU per Next click: {cpu_ms:.0f} ms (goal ≤ 100 ms); per round: "
          + ", ".join(f"{1000 * c:.0f}" for c in result["cpu"]))
    expected = [solo_ids(model, p, args.rounds) for p in prompts]
    same = sum(shown == want for shown, want in zip(result["shown"], expected))
    print(f"isolation: {same}/{args.sessions} sessions show exactly their solo run's tokens; "
          f"exception elements: {result['exceptions']}")
    for prompt, shown, want in zip(prompts, result["shown"], expected):
        if shown != want:
            print(f"  differs: {prompt!r}: shown {shown}, solo {want}")


if __name__ == "__main__":
    main()
