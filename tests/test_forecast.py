"""model/serving/forecast.py: the step at which a tier run first moves blocks out, foreseen by replaying the run's
schedule without the model, is the step at which the real run does (small, the mixed queue, two block sizes)."""

import dataclasses

import pytest

from model.engine.loading import load_model
from model.serving import kv_runs, queues
from model.serving.forecast import first_move_out
from model.serving.tiers import tier_kind


@pytest.fixture(scope="module")
def small():
    return load_model("small", "cpu")


@pytest.mark.parametrize("block_size", [16, 8])
def test_the_first_move_out_foreseen_is_the_real_run_s(small, block_size):
    requests = queues.built_in_queue(small, "mixed")
    budget = kv_runs.default_budget(small, "mixed", requests, block_size)
    settings = kv_runs.KVSettings("paged", block_size, budget, offload=tier_kind(small.device))
    run = kv_runs.QueueRun(small, requests, settings)
    try:
        first = first_move_out(small, requests, run.settings.paged, run.crossover.positions)
        assert first is not None
        while not run.finished:
            run.server.step()
            moved = [rid for rid, what in run.server.steps[-1].tier if what == "out"]
            if moved:
                break
        step = run.server.steps[-1]
        assert (step.index, moved[0]) == (first.step, first.request) and first.positions >= run.crossover.positions
        assert all(what != "out" for s in run.server.steps[:-1] for _, what in s.tier)
    finally:
        run.close()


def test_nothing_is_foreseen_where_nothing_moves_or_a_length_depends_on_the_tokens(small):
    requests = queues.built_in_queue(small, "mixed")
    settings = kv_runs.KVSettings("paged", 16, kv_runs.default_budget(small, "mixed", requests, 16)).paged
    assert first_move_out(small, requests, settings, None) is None  # the crossover never came: nothing moves
    assert first_move_out(small, requests, settings, 10**6) is None  # no victim holds that many positions
    may_end = [dataclasses.replace(r, ignore_eos=False) for r in requests]
    assert first_move_out(small, may_end, settings, 16) is None
