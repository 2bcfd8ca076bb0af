"""What the server measured, in Prometheus' text exposition format (version 0.0.4), named as vLLM names its metrics
(vllm:num_requests_running, vllm:time_to_first_token_seconds, …) under this project's prefix `decode_lab:`.

Written on the engine thread, read by an HTTP handler: one lock keeps a scrape from seeing half an update."""

from __future__ import annotations

import bisect
import threading

PREFIX = "decode_lab:"
# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        """Cumulative buckets, as Prometheus wants them, then _sum and _count."""
        out, running = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
        out += [f"{name}_sum{{{labels}}} {self.sum!r}", f"{name}_count{{{labels}}} {self.count}"]
        return out


class Metrics:
    def __init__(self, model_name: str):
        self.labels = f'model_name="{model_name}"'
        self.lock = threading.Lock()
        self.running = self.waiting = self.blocks_used = self.blocks_total = 0
        self.preemptions = self.prefix_queries = self.prefix_hits = 0
        self.prompt_tokens = self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def set_gauges(self, running: int, waiting: int, blocks_used: int, blocks_total: int) -> None:
        with self.lock:
            self.running, self.waiting, self.blocks_used, self.blocks_total = (running, waiting, blocks_used,
                                                                               blocks_total)

    def observe_step(self, preempted: int) -> None:
        with self.lock:
            self.preemptions += preempted

    def observe_prefix(self, queried: int, hit: int) -> None:
        with self.lock:
            self.prefix_queries += queried
            self.prefix_hits += hit

    def observe_finished(self, reason: str, prompt_tokens: int, completion_tokens: int, ttft: float | None,
                         itl: list[float], e2e: float) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += completion_tokens
            if ttft is not None:
                self.ttft.observe(ttft)
            for x in itl:
                self.itl.observe(x)
            self.e2e.observe(e2e)

    def render(self) -> str:
        with self.lock:
            return "\n".join(self._lines()) + "\n"

    def _lines(self) -> list[str]:
        labels, out = self.labels, []

        def one(name: str, kind: str, help_text: str, value) -> None:
            out.extend([f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}",
                        f"{PREFIX}{name}{{{labels}}} {value}"])

        one("num_requests_running", "gauge", "Requests holding KV blocks (in the batch).", self.running)
        one("num_requests_waiting", "gauge", "Requests waiting to be admitted.", self.waiting)
        one("kv_blocks_used", "gauge", "KV cache blocks held by some request.", self.blocks_used)
        one("kv_blocks_total", "gauge", "KV cache blocks in the pool.", self.blocks_total)
        one("kv_cache_usage_perc", "gauge", "KV cache usage: 1 means every block is held.",
            self.blocks_used / self.blocks_total if self.blocks_total else 0.0)
        one("num_preemptions_total", "counter", "Preemptions (blocks taken back to compute again).", self.preemptions)
        one("prefix_cache_queries_total", "counter", "Prefix cache queries, in tokens.", self.prefix_queries)
        one("prefix_cache_hits_total", "counter", "Prefix cache hits, in tokens.", self.prefix_hits)
        one("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
        one("generation_tokens_total", "counter", "Generated tokens of finished requests.", self.generation_tokens)
        name = f"{PREFIX}request_success_total"
        out += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
        out += [f'{name}{{{labels},finished_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())]
        for short, hist, help_text in (
                ("time_to_first_token_seconds", self.ttft, "Time to first token, from the request's acceptance."),
                ("inter_token_latency_seconds", self.itl, "Time between two tokens of one request."),
                ("e2e_request_latency_seconds", self.e2e, "End-to-end request latency.")):
            out += [f"# HELP {PREFIX}{short} {help_text}", f"# TYPE {PREFIX}{short} histogram"]
            out += hist.lines(PREFIX + short, labels)
        return out
