"""What a benchmark prints beside its numbers: the machine, its load, the versions, the code measured."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the project, when a benchmark runs outside the venv's editable install

from model.engine.kernels import cpu_name  # noqa: E402
from model.serving.timing import percentile  # noqa: E402


def code_version(app_root: Path) -> str:
    """The commit of the measured tree, '+ uncommitted changes' when its files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if app_root.resolve() != ROOT:
        return f"copy at {app_root}"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("log", "-1", "--format=%h %s")[:70] + (" + uncommitted changes" if dirty else "")


def print_conditions(app_root: Path, **details) -> None:
    """Printed before the run, so that the load average is the machine's, not the benchmark's own."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, load average before the run {load} (1, 5, 15 min)")
    print("versions: python {}, streamlit {}, plotly {}, torch {}, playwright {}".format(
        platform.python_version(), version("streamlit"), version("plotly"), version("torch"), version("playwright")))
    print(f"code: {code_version(app_root)}")
    for name, value in details.items():
        print(f"{name.replace('_', ' ')}: {value}")


def server_options(assignments: list[str]) -> list[str]:
    """["runner.postScriptGC=false"] -> ["--runner.postScriptGC", "false"]: command-line options for streamlit run."""
    return [part for a in assignments for part in ("--" + a.split("=", 1)[0], a.split("=", 1)[1])]


def p50_p95(values: list[float]) -> tuple[float, float]:
    return percentile(values, 50), percentile(values, 95)


def ab_parser() -> argparse.ArgumentParser:
    """The options of a before/after benchmark (kernels_ab, queue_ab): the two versions, the model, torch's threads."""
    parser = argparse.ArgumentParser()
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=1)
    return parser
