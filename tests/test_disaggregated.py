"""Prefill and decode on two processes (model/serving/disaggregated.py): a prefill worker sends each prompt's keys,
values and last logits over torch.distributed (gloo), this process decodes; the tokens are the one-process run's,
the bytes sent the cache formula's; a worker that dies mid-run or fails to start leaves the run to this process,
said, no request lost; a reset and the run's end end the worker."""

import dataclasses

import pytest

from model.serving.engine import Engine, EngineSettings
from model.serving.kv_runs import default_budget
from model.serving.queues import built_in_queue


def served(server):
    while not server.finished:
        server.step()
    return {r.id: r.new_ids for r in server.requests.values()}


@pytest.fixture(scope="module")
def one_process(small):
    requests = built_in_queue(small, "mixed")
    settings = EngineSettings(budget_bytes=default_budget(small, "mixed", requests, 16))
    return requests, settings, served(Engine(small, [dataclasses.replace(r).restart() for r in requests],
                                                  settings))


def fresh(requests):
    return [dataclasses.replace(r).restart() for r in requests]


def disaggregated_engine(model, requests, settings, model_name):
    """An engine whose prompts a prefill worker of `model_name` computes."""
    return Engine(model, requests, dataclasses.replace(settings, prefill_worker=model_name))


def test_two_workers_give_the_one_process_tokens_and_send_the_formula_s_bytes_and_reset_ends_the_worker(
        small, one_process):
    requests, settings, tokens = one_process
    server = disaggregated_engine(small, fresh(requests), settings, "small")
    try:
        first = server.connector.worker.process
        assert server.connector.failure is None and first.is_alive()
        assert served(server) == tokens
        assert not first.is_alive() and server.connector.worker is None  # the run's last step let it go
        assert server.connector.failure is None and len(server.connector.transfers) == len(requests)
        # small: 4 layers × 2 × 2 KV heads × 32 × 4 bytes = 2,048 B a position, every prompt position sent
        for transfer in server.connector.transfers:
            assert transfer.bytes == transfer.bytes_formula == 2048 * len(requests[transfer.request].prompt_ids)
            assert transfer.ms > 0 and transfer.prefill_ms > 0
        assert sum(s.kind == "received" for step in server.steps for s in step.spans) == len(requests)
        server.reset()
        server.step()  # a new worker, ended by the reset
        process = server.connector.worker.process
        assert process.is_alive() and process is not first
        server.reset()
        assert not process.is_alive() and server.connector.worker is None
    finally:
        server.close()


def test_two_sessions_run_their_workers_at_once(small, one_process):
    """Each pair of workers meets in a process group of its own: a second session's worker starts and sends while the
    first's is alive (with the process's one default group, the second failed to start and ran alone)."""
    requests, settings, tokens = one_process
    first = disaggregated_engine(small, fresh(requests), settings, "small")
    second = disaggregated_engine(small, fresh(requests), settings, "small")
    try:
        assert first.connector.worker.process.is_alive() and second.connector.worker.process.is_alive()
        while not (first.finished and second.finished):  # the two interleaved, as two sessions' clicks are
            for server in (first, second):
                if not server.finished:
                    server.step()
        assert first.connector.failure is None and second.connector.failure is None
        assert {r.id: r.new_ids for r in second.requests.values()} == tokens == {
            r.id: r.new_ids for r in first.requests.values()}
        assert len(first.connector.transfers) == len(second.connector.transfers) == len(requests)
    finally:
        first.close()
        second.close()


def test_a_worker_killed_mid_run_leaves_the_run_to_this_process_and_no_request_is_lost(small, one_process):
    requests, settings, tokens = one_process
    # a request a step: the worker is killed before it has every prompt (all at once, on a loaded machine it could
    # have sent them all before the first receive); each request's tokens are its solo run's, whenever it arrives
    staggered = [dataclasses.replace(r, arrival_step=i) for i, r in enumerate(fresh(requests))]
    server = disaggregated_engine(small, staggered, settings, "small")
    try:
        while not server.connector.transfers:
            server.step()
        server.connector.worker.process.kill()
        assert served(server) == tokens
        why, step = server.connector.failure
        assert why == "died" and 0 < step < len(server.steps)
        assert 0 < len(server.connector.transfers) < len(requests)  # the rest prefilled here
        assert any(s.kind == "prefill" for st in server.steps[step:] for s in st.spans)
    finally:
        server.close()


def test_a_worker_that_fails_to_start_leaves_the_run_to_this_process(small, one_process):
    requests, settings, tokens = one_process
    server = disaggregated_engine(small, fresh(requests), settings, "no-such-model")
    try:
        assert server.connector.failure == ("start", 0) and server.connector.worker is None
        assert served(server) == tokens and server.connector.transfers == []
    finally:
        server.close()


def test_past_the_worker_cap_a_run_goes_on_alone_and_says_so_until_a_worker_ends(small, one_process, monkeypatch):
    """faults 2026-12-04 #2: every Two-workers Start spawned a worker with a model of its own, with no cap."""
    from model.serving import disaggregated

    monkeypatch.setenv("DECODE_LAB_MAX_WORKERS", "1")
    requests, settings, tokens = one_process
    first = disaggregated_engine(small, fresh(requests), settings, "small")
    second = disaggregated_engine(small, fresh(requests), settings, "small")
    try:
        assert first.connector.worker is not None and disaggregated.live_workers() == 1
        assert second.connector.failure == ("busy", 0) and second.connector.worker is None
        assert served(second) == tokens and second.connector.transfers == []
        first.close()  # its worker ends: the place is free again
        assert disaggregated.live_workers() == 0
        third = disaggregated_engine(small, fresh(requests), settings, "small")
        assert third.connector.worker is not None and third.connector.failure is None
        third.close()
        assert disaggregated.live_workers() == 0
    finally:
        first.close()
        second.close()


def test_a_worker_cap_that_is_no_whole_number_is_ignored_with_one_log_line(monkeypatch, caplog):
    """faults 2026-12-04 #2: DECODE_LAB_MAX_WORKERS=two raised ValueError at every Two-workers Start."""
    from model.serving import disaggregated

    monkeypatch.setattr(disaggregated, "_said_ignored", set(), raising=False)
    for value, cap in [("two", 2), ("1.5", 2), (" 3 ", 3), ("-1", 0), ("", 2)]:
        monkeypatch.setenv("DECODE_LAB_MAX_WORKERS", value)
        assert disaggregated.max_workers() == cap and disaggregated.max_workers() == cap, value
    ignored = [r.getMessage() for r in caplog.records if "DECODE_LAB_MAX_WORKERS" in r.getMessage()]
    assert ignored == ["DECODE_LAB_MAX_WORKERS='two' is no whole number: ignored, at most 2 prefill workers",
                       "DECODE_LAB_MAX_WORKERS='1.5' is no whole number: ignored, at most 2 prefill workers"]


def test_a_worker_holds_the_model_again_and_a_kv_cache_for_a_whole_context(small):
    """What the Tiers page says a worker costs: small's held weights, and 4 layers × 2 × 2 KV heads × 32 × 4 bytes
    × its 128 positions."""
    from model.serving.disaggregated import worker_bytes

    assert worker_bytes(small, 16) == (small.facts.held_bytes, 4 * 2 * 2 * 32 * 4 * 128)


def test_a_two_worker_run_listens_on_the_loopback_only(small, one_process):
    """faults review 2026-12-04 #11: the pair's TCPStore listened on every interface (*:PORT) although given
    127.0.0.1; the pair now meets through a file in a private folder, and gloo listens on 127.0.0.1."""
    import os
    import shutil
    import subprocess

    if shutil.which("ss") is None:
        pytest.skip("no ss (iproute2) here to list listening sockets")
    requests, settings, _ = one_process
    server = disaggregated_engine(small, fresh(requests), settings, "small")
    try:
        server.step()
        pids = {os.getpid(), server.connector.worker.process.pid}
        listening = [line.split()[3] for line in subprocess.run(["ss", "-ltnpH"], capture_output=True,
                                                                text=True).stdout.splitlines()
                     if any(f"pid={pid}," in line for pid in pids)]
        assert listening and all(address.startswith("127.0.0.1:") for address in listening), listening
    finally:
        server.close()


def test_one_gpu_pairs_over_gloo_through_host_memory_and_two_gpus_over_nccl_each_worker_on_its_own(monkeypatch):
    """texts review T3: on a one-GPU machine both ranks were put on one device and NCCL was chosen, which NCCL refuses
    (NVIDIA/nccl#418, "Duplicate GPU detected"): with fewer than two GPUs the pair uses gloo through host memory, the
    worker sharing the GPU; with two or more the worker takes the next GPU and the pair uses NCCL (checked on a CPU
    machine by setting torch's device count)."""
    import torch

    from model.serving.disaggregated import Pairing, pairing

    assert pairing(torch.device("cpu")) == Pairing("gloo", "cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pairing(torch.device("cuda", 0)) == Pairing("gloo", "cuda:0") and pairing(torch.device("cuda")).host_copies
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert pairing(torch.device("cuda")) == Pairing("nccl", "cuda:1")
    assert pairing(torch.device("cuda", 1)) == Pairing("nccl", "cuda:0")
    assert not pairing(torch.device("cuda", 1)).host_copies


def test_a_run_says_which_backend_ran_and_where_the_worker_was(small, one_process):
    requests, settings, _ = one_process
    server = disaggregated_engine(small, fresh(requests), settings, "small")
    try:
        assert server.connector.pairing.backend == "gloo" and server.connector.pairing.worker_device == "cpu"
        assert server.connector.worker.pairing == server.connector.pairing
    finally:
        server.close()
