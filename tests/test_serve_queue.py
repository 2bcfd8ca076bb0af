"""serve-bench --queue: a built-in queue served to its end under a padded or paged KV cache, its --json (each
request's prompt ids, tokens, TTFT and ITL, the run's kv object), the same tokens under every setting, and each bad
option refused in one sentence (exit status 2) before any step."""

import json

import pytest
from test_engine import run_cli  # noqa: F401  (the fixture)
from test_smollm2 import needs_model as needs_smollm2

from model.serving import queues
from model.tools import serve_queue

REQUEST_KEYS = {"id", "arrival_step", "prompt_ids", "tokens", "ttft_ms", "itl_ms", "stop_reason", "preemptions"}
KV_KEYS = {"layout", "block_size", "budget_bytes", "max_concurrent", "bytes_reserved_peak", "bytes_held_peak",
           "waste_fraction", "shared_blocks", "prefill_positions_computed", "preemptions", "prefix_cache", "chunk",
           "pool_blocks", "block_bytes", "slots", "offload", "kv_dtype"}
OFFLOAD_KEYS = {"kind", "tier_bytes", "bytes", "blocks_out", "blocks_in", "ms_per_block_out", "ms_per_block_in",
                "recompute_ms_per_block", "crossover_positions", "run_ms_per_block_out", "run_ms_per_block_in",
                "recomputed", "points"}


def served(run_cli, *options: str) -> dict:  # noqa: F811
    out = run_cli("serve-bench", "--model", "small", *options, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_json_of_a_served_queue_holds_every_request_and_the_kv_object(run_cli):  # noqa: F811
    report = served(run_cli, "--queue", "long-join", "--chunk", "32")
    assert set(report["kv"]) == KV_KEYS and len(report["requests"]) == queues.LONG_JOIN_SHORT + 1
    for r in report["requests"]:
        assert set(r) == REQUEST_KEYS and set(r["itl_ms"]) == {"p50", "p95", "p99", "max"}
        assert len(r["tokens"]) >= 1 and r["stop_reason"] == "max_new_tokens"
    kv = report["kv"]
    assert (kv["layout"], kv["block_size"], kv["chunk"], kv["prefix_cache"]) == ("paged", 16, 32, False)
    # the long prompt (96 positions on small's context of 128) arrives at step 4 and is prefilled in chunks of 32
    long = report["requests"][-1]
    assert len(long["prompt_ids"]) == 96 and long["arrival_step"] == queues.LONG_JOIN_STEP
    assert kv["prefill_positions_computed"] == sum(len(r["prompt_ids"]) for r in report["requests"])
    assert kv["bytes_held_peak"] <= kv["bytes_reserved_peak"] <= kv["budget_bytes"]


def test_at_start_every_request_arrives_at_the_first_step_and_the_long_one_is_admitted_there(run_cli):  # noqa: F811
    """--at-start (vs_vllm.py's, as vLLM's offline generate has every request at once): the long-join queue's long
    prompt arrives at step 0, not LONG_JOIN_STEP, and a budget for all of them admits it in the first step."""
    report = served(run_cli, "--queue", "long-join", "--at-start", "--dtype", "float32")
    assert [r["arrival_step"] for r in report["requests"]] == [0] * (queues.LONG_JOIN_SHORT + 1)
    assert report["requests"][-1]["ttft_ms"] == report["requests"][0]["ttft_ms"]  # one step's prefill for all
    assert "every request there from the first step" in report["conditions"]


def test_the_prefix_cache_computes_fewer_prefill_positions_and_the_same_tokens(run_cli):  # noqa: F811
    """small has no chat template: 12 prompts after the same 48 filler ids, one arriving a step; with the cache
    each later one finds its first 48 positions (three blocks of 16) and prefills the rest."""
    on = served(run_cli, "--queue", "shared-prefix", "--prefix-cache")
    off = served(run_cli, "--queue", "shared-prefix")
    prompts = sum(len(r["prompt_ids"]) for r in off["requests"])
    assert off["kv"]["prefill_positions_computed"] == prompts
    assert on["kv"]["prefill_positions_computed"] == prompts - (queues.SHARED_REQUESTS - 1) * queues.SHARED_FILLER
    assert on["kv"]["shared_blocks"] >= 3 and off["kv"]["shared_blocks"] == 0
    assert [r["tokens"] for r in on["requests"]] == [r["tokens"] for r in off["requests"]]


def test_paged_runs_more_requests_at_once_than_padded_under_the_same_budget_with_the_same_tokens(run_cli):  # noqa: F811
    paged = served(run_cli, "--queue", "mixed", "--kv", "paged")
    padded = served(run_cli, "--queue", "mixed", "--kv", "padded")
    assert paged["kv"]["budget_bytes"] == padded["kv"]["budget_bytes"]
    assert padded["kv"]["slots"] == padded["kv"]["max_concurrent"] == 4  # whole-length slots (the one engine's)
    assert paged["kv"]["max_concurrent"] > padded["kv"]["max_concurrent"]
    assert paged["kv"]["waste_fraction"] < padded["kv"]["waste_fraction"]
    assert [r["tokens"] for r in paged["requests"]] == [r["tokens"] for r in padded["requests"]]
    # every request ran to its token budget (an eos does not end a mixed-queue request)
    assert all(r["stop_reason"] == "max_new_tokens" for r in paged["requests"])


@pytest.mark.parametrize(("options", "said"), [
    (["--queue", "mixed", "--block-size", "3"], "The block size must be a power of 2 from 1 to the model's context "
                                                 "of 128 positions (it is 3)."),
    (["--queue", "mixed", "--block-size", "256"], "(it is 256)"),
    (["--queue", "long-join", "--chunk", "8"], "--chunk must be between 16 and 128; the value given is 8."),
    (["--queue", "mixed", "--kv", "padded", "--prefix-cache"],
     "the prefix cache, chunked prefill and the second tier need the paged"),
    (["--queue", "mixed", "--batch", "2"], "--batch belongs to the step sweep"),
    (["--chunk", "64"], "--chunk belongs to a served queue"),
    (["--prefix-cache"], "--prefix-cache belongs to a served queue"),
    (["--offload", "disk"], "--offload belongs to a served queue"),
    (["--disaggregate"], "--disaggregate belongs to a served queue"),
    (["--queue", "mixed", "--disaggregate", "--prefix-cache"], "without the prefix cache, chunked prefill or a second"),
    (["--queue", "mixed", "--kv", "padded", "--offload", "disk"], "and the second tier need the paged layout"),
    (["--queue", "mixed", "--offload", "host"], "on a CPU the pool is in host memory already"),
    (["--queue", "mixed", "--offload", "disk", "--tier-dir", "/no/such/folder"],
     "cannot be made in /no/such/folder: this folder does not exist."),
    # faults review 2026-12-04 #6, #10, #16: each of these ran (exit 0), ignoring an option or with another value
    (["--queue", "mixed", "--block-size", "0"], "(it is 0)"),
    # faults #15: the sentence named the crossover's scratch tier (0.25 MiB), not the run's
    (["--queue", "mixed", "--offload", "disk", "--tier-dir", "/no/such/folder"], "a file of 0.62 MiB"),
    (["--queue", "mixed", "--kv", "padded", "--block-size", "32"], "--block-size applies only with --kv paged"),
    (["--queue", "mixed", "--tier-dir", "/tmp"], "--tier-dir applies only with --offload disk"),
    (["--queue", "mixed", "--offload", "disk", "--tier-dir", ""], "--tier-dir needs a value"),
    (["--queue", "mixed", "--kv", "padded", "--disaggregate"], "(--disaggregate) sends a prompt's blocks"),
    (["--batch", ""], "--batch takes comma-separated values (got '')"),
    (["--batch", "1,,2"], "(got '1,,2')"),
])
def test_bad_queue_options_are_one_sentence(run_cli, options, said):  # noqa: F811
    out = run_cli("serve-bench", "--model", "small", *options)
    assert (out.returncode, out.stdout) == (2, "") and out.stderr.count("\n") == 1 and said in out.stderr, out.stderr


def test_offload_moves_preempted_blocks_out_and_back_with_the_same_tokens_and_the_crossover_of_its_points(
        run_cli, tmp_path):  # noqa: F811
    """small's mixed queue under its default budget preempts; with the disk tier each victim's blocks go out to a
    file in --tier-dir and come back (the crossover on small is one block: a round trip of a block's 32 KiB beats a
    forward pass), the tokens those of the run without it; the file is gone at the end."""
    on = served(run_cli, "--queue", "mixed", "--offload", "disk", "--tier-dir", str(tmp_path))
    off = served(run_cli, "--queue", "mixed")
    offload = on["kv"]["offload"]
    assert off["kv"]["offload"] is None and set(offload) == OFFLOAD_KEYS and offload["kind"] == "disk"
    assert [r["tokens"] for r in on["requests"]] == [r["tokens"] for r in off["requests"]]
    assert on["kv"]["preemptions"] == off["kv"]["preemptions"] > 0
    assert offload["blocks_in"] == offload["blocks_out"] > 0
    assert offload["bytes"] == offload["blocks_out"] * on["kv"]["block_bytes"]
    assert offload["tier_bytes"] == on["kv"]["pool_blocks"] * on["kv"]["block_bytes"]
    # on this model the victims hold at least the crossover's positions: none is computed again
    assert offload["recomputed"] == {"short": 0, "full": 0, "unwritable": 0, "damaged": 0}
    # the crossover from the points: the fewest positions from which every larger point's round trip wins
    points = offload["points"]
    wins = [p["out_ms"] + p["in_ms"] < p["recompute_ms"] for p in points]
    expected = next((p["positions"] for i, p in enumerate(points) if all(wins[i:])), None)
    assert offload["crossover_positions"] == expected == points[0]["positions"] == 16
    assert [p["positions"] for p in points] == [16, 32, 64, 127]
    per_block = sorted(p["recompute_ms"] / p["blocks"] for p in points)
    assert offload["recompute_ms_per_block"] == pytest.approx((per_block[1] + per_block[2]) / 2)
    assert list(tmp_path.iterdir()) == []


def test_disaggregate_sends_the_formula_s_bytes_and_compares_with_one_process(run_cli):  # noqa: F811
    report = served(run_cli, "--queue", "mixed", "--disaggregate")
    transfer, one = report["transfer"], report["transfer"]["one_process"]
    assert transfer["alone"] is None and transfer["backend"] == "gloo" and transfer["prompts"] == 16
    assert transfer["worker_device"] == "cpu"  # which backend ran and where the worker was, said (texts review T3)
    # small: 4 layers × 2 × 2 KV heads × 32 × 4 bytes a position, every prompt position of the 16 requests
    prompts = sum(len(r["prompt_ids"]) for r in report["requests"])
    assert transfer["bytes"] == transfer["bytes_formula"] == 2048 * prompts
    assert transfer["ms"] > 0 and one["same_tokens"] is True and one["ttft_ms_p50"] > 0
    assert served(run_cli, "--queue", "mixed")["transfer"] is None


def test_a_budget_too_small_says_the_smallest_that_fits(run_cli, small):  # noqa: F811
    """small's mixed queue: its longest request holds 81 positions at most (every position but its last token), 6
    blocks of 16 positions of 4 layers × 2 × 2 KV heads × 32 × 4 bytes = 32,768 B each: 0.1875 MiB, said rounded
    up."""
    longest = max(len(r.prompt_ids) + r.max_new_tokens - 1 for r in queues.mixed_queue(small))
    assert longest == 81 and -(-longest // 16) * 16 * 4 * 2 * 2 * 32 * 4 == 0.1875 * 2**20
    out = run_cli("serve-bench", "--model", "small", "--queue", "mixed", "--kv-budget-mb", "0.1")
    assert out.returncode == 2 and "the smallest budget that holds it is 0.19 MiB." in out.stderr
    assert run_cli("serve-bench", "--model", "small", "--queue", "mixed", "--kv-budget-mb", "0.19").returncode == 0
    out = run_cli("serve-bench", "--model", "small", "--queue", "mixed", "--kv", "padded", "--kv-budget-mb", "0.1")
    assert out.returncode == 2 and "one padded slot" in out.stderr


def test_a_budget_past_the_session_is_refused_before_the_model_loads(run_cli, monkeypatch):  # noqa: F811
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(serve_queue, "load_model", no_loading)
    out = run_cli("serve-bench", "--queue", "mixed", "--kv-budget-mb", "100000")
    assert out.returncode == 2 and "--kv-budget-mb must be between 0.01 and 256" in out.stderr


@needs_smollm2
def test_smollm2_mixed_queue_paged_wastes_under_4_percent_and_runs_twice_the_requests(run_cli):  # noqa: F811
    paged = json.loads(run_cli("serve-bench", "--model", "smollm2", "--queue", "mixed", "--json").stdout)
    padded = json.loads(run_cli("serve-bench", "--model", "smollm2", "--queue", "mixed", "--kv", "padded",
                                "--json").stdout)
    assert paged["kv"]["waste_fraction"] < 0.04 < padded["kv"]["waste_fraction"]
    assert paged["kv"]["max_concurrent"] >= 2 * padded["kv"]["max_concurrent"]
    assert [r["tokens"] for r in paged["requests"]] == [r["tokens"] for r in padded["requests"]]
