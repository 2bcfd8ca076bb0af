"""A bounded load on the API server (`python -m model serve`), measured by its client as vLLM's `vllm bench serve`
measures one, and beside it what the server itself measured (/metrics).

    .venv/bin/python benchmarks/serve_load.py [--url http://127.0.0.1:8000] [--num-prompts 100] [--rate 4]
        [--concurrency 16] [--input-len 32] [--output-len 32] [--range-ratio 0.0] [--goodput ttft:500 tpot:100]

Requests arrive as a Poisson process at --rate per second (exponential gaps; inf: all at once), at most
--concurrency in flight. Each prompt is --input-len random token ids and asks for --output-len tokens with
ignore_eos (the lengths vary by ±range-ratio), streamed with include_usage, as vLLM's random data set does.

The figures, with vLLM's names and definitions (vllm/benchmarks/serve.py, calculate_metrics):
  TTFT  time to first token: from sending the request to its first chunk of text;
  TPOT  time per output token, excluding the first: (E2EL − TTFT) / (output tokens − 1), per request of 2+ tokens;
  ITL   inter-token latency: the time between two successive chunks of one stream, all streams' pooled;
  E2EL  end-to-end latency: from sending to the last chunk;
each as mean, median and p99 in ms; request throughput (completed requests ÷ duration), output token throughput
(output tokens ÷ duration), and goodput (DistServe, Zhong et al. 2024): requests per second that met every SLO given
in --goodput (ttft, tpot, e2el in ms).

The server's own histograms are scraped before and after: their means over the run (Δsum ÷ Δcount) are printed
beside the client's. The server stamps a token when its engine step ends, the client when its chunk arrives, and the
server's TTFT starts when it accepted the request (after reading and tokenizing its body): the client's figures are
the server's plus the network, the HTTP and JSON work and the event-loop hops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from conditions import ROOT, code_version, cpu_name

SERVER_HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds")


@dataclass
class Outcome:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def lengths(mean: int, ratio: float, rng: random.Random) -> int:
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    out, sent = Outcome(), time.perf_counter()
    last = sent
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter()
                if "error" in chunk:
                    out.error = chunk["error"]["message"]
                    return out
                if chunk.get("usage"):
                    out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    out.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if out.ttft == 0.0:
                        out.ttft = now - sent
                    else:
                        out.itl.append(now - last)
                    last = now
        out.e2el, out.ok = last - sent, True
    except httpx.HTTPError as failed:
        out.error = f"{type(failed).__name__}: {failed}"
    return out


async def run_load(args, model: str) -> tuple[list[Outcome], float]:
    rng = random.Random(args.seed)
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)

    async def limited(client, prompt, max_tokens):
        async with gate:
            return await one_request(client, args.url, model, prompt, max_tokens)

    async with httpx.AsyncClient(timeout=600, limits=limits, headers=auth(args)) as client:
        tasks, started = [], time.perf_counter()
        for i in range(args.num_prompts):
            prompt = [rng.randrange(4, args.vocab) for _ in range(lengths(args.input_len, args.range_ratio, rng))]
            tasks.append(asyncio.create_task(limited(client, prompt,
                                                     lengths(args.output_len, args.range_ratio, rng))))
            if args.rate != float("inf") and i < args.num_prompts - 1:
                await asyncio.sleep(rng.expovariate(args.rate))  # Poisson arrivals: exponential gaps
        outcomes = await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - started


def auth(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def scrape(url: str, headers: dict) -> dict[str, float]:
    """The server's histograms' _sum and _count, by name."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith("decode_lab:") and ("_sum{" in line or "_count{" in line):
            name = line.split("{", 1)[0].removeprefix("decode_lab:")
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


def server_mean_ms(before: dict, after: dict, name: str) -> float | None:
    count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
    return (after[f"{name}_sum"] - before.get(f"{name}_sum", 0)) / count * 1000 if count else None


def parse_goodput(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:100"] → {"ttft": 0.5, "tpot": 0.1} in seconds."""
    slos = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not ms:
            raise SystemExit(f"--goodput takes ttft:MS, tpot:MS, e2el:MS; not {item!r}")
        slos[name] = float(ms) / 1000
    return slos


def is_good(outcome: Outcome, slos: dict[str, float]) -> bool:
    measured = {"ttft": outcome.ttft, "tpot": outcome.tpot or 0.0, "e2el": outcome.e2el}
    return all(measured[name] <= limit for name, limit in slos.items())


def line(label: str, values: list[float]) -> None:
    if not values:
        print(f"{label}: none")
        return
    ms = np.array(values) * 1000
    print(f"{'Mean ' + label + ' (ms):':<40}{np.mean(ms):>10.2f}")
    print(f"{'Median ' + label + ' (ms):':<40}{np.median(ms):>10.2f}")
    print(f"{'P99 ' + label + ' (ms):':<40}{np.percentile(ms, 99):>10.2f}")


def report(outcomes: list[Outcome], seconds: float, slos: dict, before: dict, after: dict) -> None:
    done = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in done)
    print("============ Serving Benchmark Result ============")
    print(f"{'Successful requests:':<40}{len(done):>10}")
    print(f"{'Failed requests:':<40}{len(outcomes) - len(done):>10}")
    print(f"{'Benchmark duration (s):':<40}{seconds:>10.2f}")
    print(f"{'Total input tokens:':<40}{sum(o.prompt_tokens for o in done):>10}")
    print(f"{'Total generated tokens:':<40}{out_tokens:>10}")
    print(f"{'Request throughput (req/s):':<40}{len(done) / seconds:>10.2f}")
    print(f"{'Output token throughput (tok/s):':<40}{out_tokens / seconds:>10.2f}")
    if slos:
        good = sum(is_good(o, slos) for o in done)
        print(f"{'Request goodput (req/s):':<40}{good / seconds:>10.2f}   ({good} of {len(done)} met "
              + ", ".join(f"{k} ≤ {v * 1000:g} ms" for k, v in slos.items()) + ")")
    line("TTFT", [o.ttft for o in done])
    line("TPOT", [t for o in done if (t := o.tpot) is not None])
    line("ITL", [x for o in done for x in o.itl])
    line("E2EL", [o.e2el for o in done])
    print("---------- The server's own /metrics, same run ----------")
    client_means = {"time_to_first_token_seconds": [o.ttft for o in done],
                    "inter_token_latency_seconds": [x for o in done for x in o.itl],
                    "e2e_request_latency_seconds": [o.e2el for o in done]}
    for name in SERVER_HISTOGRAMS:
        server = server_mean_ms(before, after, name)
        client = np.mean(client_means[name]) * 1000 if client_means[name] else float("nan")
        shown = "n/a" if server is None else f"{server:.2f}"
        print(f"{name:<32} server mean {shown:>9} ms   client mean {client:9.2f} ms")
    errors = {o.error for o in outcomes if not o.ok}
    if errors:
        print("errors:", "; ".join(sorted(errors))[:500])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--rate", type=float, default=float("inf"), help="requests per second (Poisson); inf: at once")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--vocab", type=int, default=500, help="prompt ids are drawn from 4 .. vocab − 1")
    p.add_argument("--goodput", nargs="*", default=[], help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    slos = parse_goodput(args.goodput)
    headers = auth(args)
    model = httpx.get(f"{args.url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    conditions = httpx.get(f"{args.url}/v1/engine/state", headers=headers, timeout=30).json()["conditions"]
    print(f"server: {args.url}, model {model}; its conditions: {conditions}")
    print(f"client: {cpu_name()}; code {code_version(ROOT)}")
    print(f"load: {args.num_prompts} prompts, rate {args.rate}/s (Poisson), concurrency ≤ {args.concurrency}, "
          f"input {args.input_len} tokens, output {args.output_len} tokens, range ratio {args.range_ratio}")
    before = scrape(args.url, headers)
    outcomes, seconds = asyncio.run(run_load(args, model))
    report(outcomes, seconds, slos, before, scrape(args.url, headers))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
