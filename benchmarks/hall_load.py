"""A lecture hall under load: S websocket sessions through nginx (deploy/hall.py, as `./dev serve` runs it), each
with its own prompt and seed, all pressing Run prefill together and then Next together, round after round.

    .venv/bin/python benchmarks/hall_load.py [--sessions 60] [--replicas N] [--nexts 12]

Prints the conditions; the time from a click to "script finished" (p50/p95 of prefill and of Next); errors (a
session that failed to connect or a click that failed, exception elements); the sessions each replica got; the
CPU of each replica and of nginx over the Next rounds, and per click; the isolation check (every session shows
exactly the CLI's solo trace, `python -m model trace --json`, for its prompt and seed); and each replica's
memory: idle, with small and the sessions, and after one session ran SmolLM2 there (when it is fetched).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import Counter

from conditions import ROOT, p50_p95, print_conditions

from loadtest.ws_client import (
    LectureHall,
    Session,
    choose_sampling,
    cpu_seconds,
    open_decode_session,
    prompts_for,
    rss_mib,
    solo_trace_ids,
)
from model.engine.loading import load_model
from model.texts import text
from model.weights.catalog import list_models, settings

TEMPERATURE = 0.9  # sampled, each session its own seed: a draw that leaked between sessions would show
SMOLLM2_PROMPT = "The cat"


def replica_of(session: Session, ports: dict[int, int]) -> int:
    """The replica number behind a session's websocket ({port: number})."""
    return ports[int(session.replica.rsplit(":", 1)[1])]


async def gather_counting(coroutines, errors: list[str]) -> list:
    """Runs them together; a failure is counted (its text kept) and comes back as None."""
    results = await asyncio.gather(*coroutines, return_exceptions=True)
    errors += [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    return [None if isinstance(r, BaseException) else r for r in results]


async def warm_up(hall: LectureHall, ports: dict[int, int]) -> None:
    """A prefill and a Next on every replica first (its imports, the model read once), as a teacher's own try."""
    warmed: set[int] = set()
    for _ in range(20 * len(ports)):  # seats land at random: bounded tries until each replica had one
        if len(warmed) == len(ports):
            return
        session = await open_decode_session(hall.ws_url, "con mèo", hall.new_seat())
        number = replica_of(session, ports)
        if number not in warmed:
            await session.run("run_prefill")
            await session.run("next")
            warmed.add(number)
        await session.close()
    raise RuntimeError(f"replicas {set(ports.values()) - warmed} got no seat in {20 * len(ports)} tries")


async def measure(hall: LectureHall, prompts: list[str], nexts: int) -> dict:
    replicas = hall.replicas()
    ports = {port: number for number, (_, port) in replicas.items()}
    await warm_up(hall, ports)
    errors: list[str] = []
    opened = await gather_counting((open_decode_session(hall.ws_url, p, hall.new_seat(), 1 + nexts)
                                    for p in prompts), errors)
    sessions = {i: s for i, s in enumerate(opened) if s is not None}
    prefill = await gather_counting((s.run("run_prefill") for s in sessions.values()), errors)
    await gather_counting((choose_sampling(s, TEMPERATURE, i) for i, s in sessions.items()), errors)
    watched = {f"replica {n}": [pid] for n, (pid, _) in replicas.items()} | {"nginx": hall.nginx_pids()}

    def cpu_now() -> dict[str, float]:
        return {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in watched.items()}

    cpu0, wall0 = cpu_now(), time.monotonic()
    next_times = []
    for _ in range(nexts):
        next_times += await gather_counting((s.run("next") for s in sessions.values()), errors)
    wall = time.monotonic() - wall0
    cpu = {name: seconds - cpu0[name] for name, seconds in cpu_now().items()}
    result = {
        "prefill": [t for t in prefill if t is not None], "next": [t for t in next_times if t is not None],
        "errors": errors, "exceptions": sum(len(s.exceptions) for s in sessions.values()),
        "shown": {i: s.strip_ids() for i, s in sessions.items()},
        "per_replica": Counter(replica_of(s, ports) for s in sessions.values()),
        "cpu": cpu, "wall": wall, "clicks": len(sessions) * nexts,
        "rss_loaded": {n: rss_mib(pid) for n, (pid, _) in replicas.items()},
    }
    for s in sessions.values():
        await s.close()
    if "smollm2" in list_models(settings().models_dir):  # fetched
        result["rss_smollm2"] = await smollm2_rss(hall, ports)
    return result


async def smollm2_rss(hall: LectureHall, ports: dict[int, int]) -> tuple[int, float]:
    """One session chooses SmolLM2 in the sidebar and runs a prefill: (its replica, that replica's RSS after)."""
    session = await open_decode_session(hall.ws_url, SMOLLM2_PROMPT, hall.new_seat())
    session.set_value("model_name.en", text("model.smollm2", "en"))  # a select box's value is its shown label
    await session.run()
    session.set_value("prompt_text", SMOLLM2_PROMPT)
    await session.run("run_prefill")
    number = replica_of(session, ports)
    shown = session.strip_ids()
    await session.close()
    if shown is None:
        raise RuntimeError("the SmolLM2 session showed no run")
    return number, rss_mib(hall.replicas()[number][0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=60)
    parser.add_argument("--replicas", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--nexts", type=int, default=12)
    args = parser.parse_args()
    model = load_model("small", "cpu")
    prompts = prompts_for(model, args.sessions)
    print_conditions(ROOT, model=f"small ({model.info.dtype}, server device 'auto' = cpu), "
                                 "DECODE_LAB_CPU_THREADS=1 per replica",
                     hall=f"{args.replicas} replicas behind nginx (deploy/hall.py, seat cookie), all on this machine",
                     sessions=f"{args.sessions}, each its own two-word prompt (e.g. {prompts[0]!r}) and seed "
                              f"(temperature {TEMPERATURE}); Run prefill pressed by all together, then "
                              f"{args.nexts} rounds of Next pressed by all together; the client (one Python "
                              "process) runs on the same machine")
    with LectureHall(replicas=args.replicas) as hall:
        rss_idle = {n: rss_mib(pid) for n, (pid, _) in hall.replicas().items()}
        started = time.monotonic()
        result = asyncio.run(measure(hall, prompts, args.nexts))
        wall = time.monotonic() - started
    print(f"wall time: {wall:.1f} s; load average after the run: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    f50, f95 = p50_p95(result["prefill"])
    print(f"Run prefill, all together: p50 {f50:.2f} s, p95 {f95:.2f} s ({len(result['prefill'])} clicks)")
    n50, n95 = p50_p95(result["next"])
    print(f"Next, all together: p50 {n50:.2f} s, p95 {n95:.2f} s, max {max(result['next']):.2f} s "
          f"({len(result['next'])} clicks)")
    print(f"errors: {len(result['errors'])} failed connections or clicks; exception elements: {result['exceptions']}")
    for error in result["errors"][:5]:
        print(f"  {error}")
    print("sessions per replica: " + ", ".join(f"replica {n}: {c}" for n, c in sorted(result["per_replica"].items())))
    cpu, rounds_wall = result["cpu"], result["wall"]
    replicas_cpu = sum(v for k, v in cpu.items() if k.startswith("replica"))
    print(f"CPU over the {args.nexts} Next rounds ({rounds_wall:.1f} s): "
          + ", ".join(f"{k} {v:.1f} s ({100 * v / rounds_wall:.0f} %)" for k, v in cpu.items())
          + f"; replicas per Next click: {1000 * replicas_cpu / result['clicks']:.0f} ms, "
          f"nginx per click: {1000 * cpu['nginx'] / result['clicks']:.2f} ms")
    traced = {i: solo_trace_ids(prompts[i], 1 + args.nexts, TEMPERATURE, i) for i in result["shown"]}
    same = sum(result["shown"][i] == p + new for i, (p, new) in traced.items())
    drawn = sum(len(new) for _, new in traced.values()) - len(traced)  # the prefill draws each run's first
    print(f"isolation: {same}/{args.sessions} sessions show exactly their CLI solo trace; {drawn} of "
          f"{result['clicks']} Next clicks drew a token (the others hit an ended run: the page redraws, the "
          "engine does not run)")
    for i, (p, new) in traced.items():
        if result["shown"][i] != p + new:
            print(f"  differs: {prompts[i]!r} seed {i}: shown {result['shown'][i]}, solo {p + new}")
    print("replica RSS: " + "; ".join(
        f"replica {n}: idle {rss_idle[n]:.0f} MiB, with small and its sessions {result['rss_loaded'][n]:.0f} MiB"
        for n in sorted(rss_idle)))
    if "rss_smollm2" in result:
        n, rss = result["rss_smollm2"]
        print(f"replica {n} after one session ran SmolLM2 too: {rss:.0f} MiB "
              f"(+{rss - result['rss_loaded'][n]:.0f} MiB)")


if __name__ == "__main__":
    main()
