"""The served queues as they are before the serving room becomes one engine (issue 50): each built-in queue under
padded slots and paged blocks, with the prefix cache, chunked prefill, a disk tier and a prefill worker, kept as
golden files in tests/golden/serve/. After any move of the serving code the same commands must give the same
tokens and the same KV figures. Timings are left out.

Regenerate only before a change of behaviour that is meant: DECODE_LAB_WRITE_GOLDEN=1 pytest tests/test_serve_golden.py
"""

import json
import os
from pathlib import Path

import pytest
import torch

from model.tools import cli

GOLDEN = Path(__file__).resolve().parent / "golden" / "serve"
WRITE = os.environ.get("DECODE_LAB_WRITE_GOLDEN") == "1"

# name -> serve-bench options after --model small; the disaggregated run starts a second process
VARIANTS = {
    "mixed-padded": ["--queue", "mixed", "--kv", "padded"],
    "mixed-paged": ["--queue", "mixed", "--kv", "paged"],
    "shared-prefix-padded": ["--queue", "shared-prefix", "--kv", "padded"],
    "shared-prefix-paged": ["--queue", "shared-prefix", "--kv", "paged"],
    "shared-prefix-paged-prefix-cache": ["--queue", "shared-prefix", "--kv", "paged", "--prefix-cache"],
    "long-join-padded": ["--queue", "long-join", "--kv", "padded"],
    "long-join-paged": ["--queue", "long-join", "--kv", "paged"],
    "long-join-paged-chunk": ["--queue", "long-join", "--kv", "paged", "--chunk", "16"],
    "mixed-paged-offload-disk": ["--queue", "mixed", "--kv", "paged", "--offload", "disk"],
    "mixed-paged-disaggregate": ["--queue", "mixed", "--kv", "paged", "--disaggregate"],
}
KV_FIELDS = ("layout", "block_size", "budget_bytes", "max_concurrent", "bytes_reserved_peak", "bytes_held_peak",
             "shared_blocks", "prefill_positions_computed", "preemptions", "pool_blocks", "block_bytes", "slots")
# what this machine's clock decides, left out: with a tier, which preempted requests move out rather than being
# computed again (the crossover is measured before the run); with a prefill worker, when each prompt's keys and
# values arrive, hence what is admitted when. The tokens and the memory's shape are every machine's.
CLOCKED = {
    "mixed-paged-offload-disk": {"prefill_positions_computed"},
    "mixed-paged-disaggregate": {"steps", "max_concurrent", "bytes_reserved_peak", "bytes_held_peak",
                                 "prefill_positions_computed", "preemptions"},
}
# the smallest gap between the chosen token's logit and the next one's along every golden request: another order
# of the float32 sums (another CPU's, or the cache against a full recompute, which the Decode page checks) moves
# small's logits by ~1e-6, so choices 1e-4 apart are every CPU's and the tokens encode no one CPU's rounding
MIN_TOP2_GAP = 1e-4


def served(variant: str, capsys) -> dict:
    code = cli.main(["serve-bench", "--model", "small", *VARIANTS[variant], "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    clocked = CLOCKED.get(variant, set())

    def kept(fields, row: dict) -> dict:
        return {key: row[key] for key in fields if key not in clocked}

    return {
        "command": "python -m model serve-bench --model small " + " ".join(VARIANTS[variant]) + " --json",
        **kept(("steps", "tokens"), report),
        "requests": [kept(("id", "arrival_step", "prompt_ids", "tokens", "stop_reason", "preemptions"), r)
                     for r in report["requests"]],
        "kv": kept(KV_FIELDS, report["kv"]),
    }


def smallest_top2_gap(model, requests: list[dict]) -> float:
    """Over every token a request drew: its logit minus the best other one's, from one full pass of the request."""
    gaps = []
    for r in requests:
        ids = r["prompt_ids"] + r["tokens"]
        with torch.inference_mode():
            logits = model.every_logits(ids[:-1], model.new_cache()).float()   # (T − 1, vocab)
        rows = logits[len(r["prompt_ids"]) - 1:]                               # the rows that drew r["tokens"]
        chosen = rows[torch.arange(len(r["tokens"])), torch.tensor(r["tokens"])]
        others = rows.scatter(1, torch.tensor(r["tokens"])[:, None], float("-inf")).max(dim=1).values
        gaps.append((chosen - others).min().item())
    return min(gaps)


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) if "disaggregate" in v else v
                                     for v in VARIANTS])
def test_the_served_queue_is_its_golden_file(variant, capsys, small):
    run = served(variant, capsys)
    path = GOLDEN / f"{variant}.json"
    if WRITE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run, indent=1) + "\n")
    golden = json.loads(path.read_text())
    assert smallest_top2_gap(small, golden["requests"]) > MIN_TOP2_GAP
    assert [r["tokens"] for r in run["requests"]] == [r["tokens"] for r in golden["requests"]]
    assert run == golden
