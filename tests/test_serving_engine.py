"""The serving engine's face for a server (issue 51 drives it over HTTP): requests added while it runs,
aborted with their blocks freed at once, and a bounded memory of its steps and finished requests."""

from __future__ import annotations

import pytest
from conftest import needs_kernels
from test_batch import prompts_of, solo_run

from model.engine.loading import load_model
from model.engine.sampling import SamplingSettings
from model.errors import InputError
from model.serving.engine import Engine, EngineSettings
from model.serving.memory import mib_up
from model.serving.request import Request


@pytest.fixture(scope="module")
def small():
    return load_model("small", "cpu")


def test_requests_added_while_it_runs_get_their_solo_tokens(small):
    """Made red by scheduling a request added at step k as if it arrived at step 0 (arrival_step = 0): the third
    request would then be admitted in the step it is added, before its arrival."""
    engine = Engine(small, [], EngineSettings(block_size=16, budget_bytes=2**20, history=4))
    prompts = prompts_of(small, [9, 14, 5])
    first = engine.add_request(prompts[0], 6, ignore_eos=True)
    second = engine.add_request(prompts[1], 6, ignore_eos=True)
    engine.step()
    engine.step()
    third = engine.add_request(prompts[2], 6, ignore_eos=True)
    assert third.arrival_step == 2
    step = engine.step()
    assert third.id in step.admitted
    while engine.waiting or engine.running:
        engine.step()
    for request, prompt in zip((first, second, third), prompts):
        assert request.new_ids == solo_run(small, prompt, 6)[1]
        assert request.stop_reason == "max_new_tokens"
    assert len(engine.steps) == 4 and engine.steps_run > 4   # the bounded history
    assert engine.requests == {}                            # finished requests are the caller's
    assert engine.cache.pool.n_free == engine.cache.n_blocks


def test_abort_frees_the_blocks_at_once(small):
    """Made red by an abort that forgets cache.free: the pool would keep the aborted request's blocks."""
    engine = Engine(small, [], EngineSettings(block_size=16, budget_bytes=2**20, history=8))
    kept, aborted = (engine.add_request(p, 20, ignore_eos=True) for p in prompts_of(small, [30, 40]))
    engine.step()
    held = engine.cache.n_blocks - engine.cache.pool.n_free
    assert engine.abort(aborted.id)
    assert aborted.stop_reason == "abort"
    assert engine.cache.n_blocks - engine.cache.pool.n_free == held - engine.layout.blocks(41)
    assert not engine.abort(aborted.id)
    waiting = engine.add_request(prompts_of(small, [3])[0], 4)
    assert engine.abort(waiting.id) and not engine.waiting
    while engine.running:
        engine.step()
    assert kept.stop_reason == "max_new_tokens" and engine.cache.pool.n_free == engine.cache.n_blocks


def test_a_request_that_could_never_run_is_refused_in_one_sentence(small):
    engine = Engine(small, [], EngineSettings(block_size=16, budget_bytes=2**20))
    context = small.info.context_length
    with pytest.raises(InputError) as refused:
        engine.add_request(list(range(4, 4 + context)), 1)
    assert refused.value.code == "prompt_too_long"
    with pytest.raises(InputError) as refused:
        engine.add_request([], 1)
    assert refused.value.code == "empty_prompt"
    with pytest.raises(InputError) as refused:
        engine.add_request([5], 4, SamplingSettings(temperature=-1.0))
    tiny = Engine(small, [], EngineSettings(block_size=16, budget_bytes=engine.layout.block_bytes * 2))
    with pytest.raises(InputError) as refused:
        tiny.add_request([5] * 40, 4)
    assert refused.value.code == "paged_budget"
    assert not engine.waiting and not tiny.waiting


def test_a_request_asking_past_the_context_needs_only_the_blocks_the_context_holds(small):
    """It stops at the context (context_full): at the start and when added, the refusal names the budget of the
    context's positions, not of its token budget (made red by the least of prompt + max_new_tokens − 1)."""
    context = small.info.context_length
    request = Request(0, [5] * 10, 4 * context)
    with pytest.raises(InputError) as refused:
        Engine(small, [request], EngineSettings(block_size=16, budget_bytes=1))
    layout = Engine(small, [], EngineSettings(block_size=16, budget_bytes=2**20)).layout
    least = layout.request_blocks(context - 1) * layout.block_bytes
    assert refused.value.details["least_number"] == mib_up(least)
    engine = Engine(small, [request], EngineSettings(block_size=16, budget_bytes=least))
    assert engine.add_request([5] * 10, 4 * context).id == 1


def test_one_scheduler_for_both_memories_the_same_plan_at_every_step(small):
    """With a budget that never preempts, the mixed queue under padded slots and under paged blocks is one schedule:
    the same spans (request, positions, kind) and the same admissions at every step, and the same tokens; only the
    bytes differ. Made red by a padded memory with a scheduler of its own (the padded Server prefilled each joiner
    alone and decoded it from the next step: its spans differ), or by slots that the budget caps below the queue."""
    from model.serving.kv_runs import KVSettings, QueueRun, padded_slot_bytes
    from model.serving.queues import built_in_queue

    requests = built_in_queue(small, "mixed")
    budget = len(requests) * padded_slot_bytes(small, requests)   # a slot for every request: none waits on memory
    padded = QueueRun(small, requests, KVSettings("padded", 16, budget)).run()
    paged = QueueRun(small, requests, KVSettings("paged", 16, budget)).run()
    assert len(padded.steps) == len(paged.steps) > 1
    for a, b in zip(padded.steps, paged.steps):
        assert (a.spans, a.admitted, a.left, a.preempted) == (b.spans, b.admitted, b.left, b.preempted)
    assert [r.new_ids for r in padded.requests] == [r.new_ids for r in paged.requests]
    assert max(s.bytes_reserved for s in padded.steps) > max(s.bytes_reserved for s in paged.steps)
    padded.close()
    paged.close()


@pytest.mark.parametrize("memory", ["paged", "padded"])
def test_separate_passes_give_the_tokens_of_one_mixed_pass(small, memory):
    """EngineSettings.mixed False (the Serving page's: each span that prefills in a pass of its own, then the decode
    rows in one) runs the mixed queue's plan of one mixed pass a step, to the same tokens; each pass is recorded
    with its kind and spans, and their times sum to the step's forward_ms."""
    from model.serving.kv_runs import default_budget
    from model.serving.queues import built_in_queue

    runs = {}
    for mixed in (True, False):
        requests = built_in_queue(small, "mixed")
        engine = Engine(small, requests, EngineSettings(memory=memory, budget_bytes=default_budget(
            small, "mixed", requests, 16), mixed=mixed))
        while not engine.finished:
            step = engine.step()
            assert step.forward_ms == sum(p.ms for p in step.passes)
        runs[mixed] = engine
    together, apart = runs[True], runs[False]
    assert [s.spans for s in together.steps] == [s.spans for s in apart.steps]
    assert [r.new_ids for r in together.requests.values()] == [r.new_ids for r in apart.requests.values()]
    assert all(len(s.passes) <= 1 for s in together.steps)
    assert any(p.kind == "mixed" for s in together.steps for p in s.passes)
    for step in apart.steps:
        kinds = [p.kind for p in step.passes]
        assert "mixed" not in kinds and kinds.count("decode") <= 1 and kinds == sorted(kinds, reverse=True)
        assert all(len(p.spans) == 1 for p in step.passes if p.kind == "prefill")
        assert sorted(s.request for p in step.passes for s in p.spans) == sorted(s.request for s in step.spans)
    assert any(len(s.passes) > 1 for s in apart.steps)


def test_an_fp8_pool_holds_four_times_the_blocks_and_reads_back_within_e4m3s_rounding(small):
    """The same budget in fp8 holds 4× a float32 model's blocks; what a pass writes reads back within e4m3's relative
    step (2^-3 of the number, its 3 mantissa bits) times its layer's scale, the scales set by the first write and
    kept. Made red by a read that forgets the scale (numbers off by the scale's factor)."""
    import torch

    from model.serving.paged import FP8_MAX

    budget = 2**20
    plain = Engine(small, [], EngineSettings(budget_bytes=budget))
    fp8 = Engine(small, [], EngineSettings(budget_bytes=budget, kv_dtype="fp8"))
    assert fp8.cache.n_blocks == 4 * plain.cache.n_blocks and fp8.cache.keys.element_size() == 1
    request = fp8.add_request(prompts_of(small, [20])[0], 2, ignore_eos=True)
    fp8.step()
    k_scale, v_scale = fp8.cache.scales[0]
    torch.manual_seed(0)
    k = torch.randn(small.info.n_kv_heads, 3, small.info.d_head)
    blocks, offsets = torch.tensor([fp8.cache.tables[request.id][0][0]] * 3), torch.tensor([0, 1, 2])
    fp8.cache.write(0, blocks, offsets, k, k)
    back, _ = fp8.cache.read(0, blocks[:1], torch.float32)
    expected = k.clamp(-FP8_MAX * float(k_scale), FP8_MAX * float(k_scale))
    assert torch.allclose(back[:, 0, :3], expected, rtol=2**-3, atol=float(k_scale) * 2**-9)
    assert fp8.cache.scales[0] == (k_scale, v_scale)  # not set again


def test_a_pool_in_fewer_bits_is_fp8_and_takes_no_prefill_worker(small):
    from model.serving.kv_runs import KVSettings, QueueRun
    from model.serving.queues import built_in_queue

    requests = built_in_queue(small, "mixed")
    with pytest.raises(InputError) as refused:
        Engine(small, requests, EngineSettings(budget_bytes=2**20, kv_dtype="int8"))
    assert refused.value.code == "pool_kv_dtype"
    with pytest.raises(InputError) as refused:
        QueueRun(small, requests, KVSettings("paged", 16, 2**20, kv_dtype="fp8", prefill_worker="small"))
    assert refused.value.code == "pool_kv_dtype_workers"


@pytest.mark.parametrize("alongside", [dict(prefix_cache=True), dict(chunk=32), dict(offload="host")])
def test_a_prefill_worker_beside_another_mode_is_refused_by_the_engine_before_any_worker_starts(small, alongside):
    """The engine that builds the prefill connector refuses it beside a prefix cache, chunks or a tier (red once with
    the refusal in QueueRun alone, where it had been: the engine then started a worker for such a run)."""
    from model.serving.disaggregated import live_workers
    from model.serving.queues import built_in_queue

    with pytest.raises(InputError) as refused:
        Engine(small, built_in_queue(small, "mixed"),
               EngineSettings(budget_bytes=2**20, prefill_worker="small", **alongside))
    assert refused.value.code == "disaggregate_alone" and live_workers() == 0


def test_where_the_clock_went_adds_up_to_the_clock(small):
    """kv_runs.time_split's parts (the pages' table, serve-bench's line) sum to the engine's clock, each pass
    counted once, by its kind: prompts alone, prompts with decode rows beside them, decode rows alone. Made red by a
    pass counted in two parts."""
    from model.serving.kv_runs import KVSettings, QueueRun
    from model.serving.queues import built_in_queue

    run = QueueRun(small, built_in_queue(small, "long-join"), KVSettings("paged", 16, 2**20, chunk=16)).run()
    split = run.summary()["time_ms"]
    assert sum(split.values()) == pytest.approx(run.server.clock_ms)
    prefilled = sum(s.forward_ms for s in run.steps if any(p.kind == "prefill" for p in s.spans))
    assert split["forward_prefill"] + split["forward_mixed"] == pytest.approx(prefilled)
    assert split["forward_mixed"] > 0 and split["forward_decode"] > 0
    run.close()


def test_within_each_kind_of_pass_the_kernels_clocks_and_the_rest_add_up_to_its_time():
    """kv_runs.op_split: per kind of pass, the products, attention and small ops its passes' kernels clocked, summed,
    and the rest: the passes' time outside them (never below 0). Exact sums of made-up passes."""
    from types import SimpleNamespace

    from model.serving.engine import PassRecord
    from model.serving.kv_runs import op_split

    clocked = {"products": 6.0, "attention": 2.0, "small_ops": 0.5}
    steps = [SimpleNamespace(passes=[PassRecord("prefill", [], 10.0, clocked), PassRecord("decode", [], 4.0, {})]),
             SimpleNamespace(passes=[PassRecord("decode", [], 3.0, {"products": 2.0, "attention": 0.25})])]
    assert op_split(steps) == {
        "prefill": {"products": 6.0, "attention": 2.0, "small_ops": 0.5, "rest": 1.5},
        "decode": {"products": 2.0, "attention": 0.25, "small_ops": 0.0, "rest": 4.75}}


@needs_kernels
def test_a_runs_passes_carry_the_kernels_clocks(small):
    """Each pass of a run in the decode kernels reads their clocks before and after it (kernels.op_seconds, this
    thread's): products, attention and small ops all ran, and together took no more than the pass. Red once with the
    products' clock left out of matmul_f32 (then no product time at all: the decode layers call it)."""
    from model.serving.kv_runs import KVSettings, QueueRun
    from model.serving.queues import built_in_queue

    run = QueueRun(small, built_in_queue(small, "mixed"), KVSettings("paged", 16, 2**20)).run()
    passes = [p for s in run.steps for p in s.passes]
    assert all(p.ops_ms["products"] > 0 and p.ops_ms["attention"] > 0 and p.ops_ms["small_ops"] > 0 for p in passes)
    assert all(sum(p.ops_ms.values()) <= p.ms for p in passes)
    assert set(run.summary()["ops_ms"]) == {p.kind for p in passes}
    run.close()


def test_reset_forgets_a_stopped_steps_wait_for_the_prefill_worker(small):
    """A step stopped after its connector's exchange keeps the wait it measured for the step run again; Reset starts
    the clock over, that wait included (red once with reset leaving received_ms: the next step counted it)."""
    engine = Engine(small, [Request(0, [1, 5, 6], 2)], EngineSettings(budget_bytes=2**20))
    engine.received_ms = 5.0
    engine.reset()
    record = engine.step()
    assert engine.received_ms == 0.0 and record.received_ms == 0.0 and engine.clock_ms == record.ms
