"""The app server's decisions for its whole process, made once, when the first page that runs a model imports this:
torch's thread count (DECODE_LAB_CPU_THREADS, by default 1) and the one thread that runs the Decode page's
cached-vs-recomputed checks at the lowest CPU priority. The engine makes neither decision: the command line and the
tests import it without side effects."""

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from model.engine.runtime import apply_cpu_threads

CPU_THREADS = apply_cpu_threads()
CHECK_NICENESS = 19  # the lowest CPU priority Linux gives a thread


def _yield_to_the_steps() -> None:
    """The check's thread gives way to every other thread of the machine, the sessions' steps first: on a busy
    2-core machine a recompute at normal priority doubled the next Next's step (benchmarks/click_latency.py), while
    at the lowest its verdict only comes later. Where threads have no priority of their own, nothing changes; nor
    with more than one torch thread, since a pool of torch's worker threads started from here would keep the low
    priority for every session's steps."""
    if CPU_THREADS > 1:
        return
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CHECK_NICENESS)


# One check at a time in the process, beside the sessions' own steps: a Next never waits for a check, and on a
# 2-core machine the checks of a whole class queue here instead of slowing everybody's tokens.
CHECKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-check", initializer=_yield_to_the_steps)
