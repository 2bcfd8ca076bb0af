"""Sampling on hand-made logits: exact kept sets, greedy, seeds."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.engine.sampling import (
    MAX_SEED,
    SamplingSettings,
    check_settings,
    draw,
    draw_from,
    sample,
    softmax,
    top_k_ids,
    top_p_ids,
)

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 at temperature 1
LOGITS = np.log(np.array([0.0625, 0.5, 0.125, 0.25, 0.0625]))


def test_greedy_is_argmax():
    result = sample(LOGITS, SamplingSettings(temperature=0))
    assert result.chosen_id == 1 and result.greedy
    assert result.final_probs[1] == 1.0


def test_top_k_keeps_the_k_best():
    assert top_k_ids(LOGITS, 2).tolist() == [1, 3]
    assert top_k_ids(LOGITS, 3).tolist() == [1, 2, 3]
    assert top_k_ids(LOGITS, None).tolist() == [0, 1, 2, 3, 4]


def test_top_k_keeps_ties_at_the_boundary():
    assert top_k_ids(LOGITS, 4).tolist() == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = softmax(LOGITS)
    everything = np.arange(5)
    assert top_p_ids(probs, everything, 0.5).tolist() == [1]
    assert top_p_ids(probs, everything, 0.6).tolist() == [1, 3]
    assert top_p_ids(probs, everything, 0.75).tolist() == [1, 3]
    assert top_p_ids(probs, everything, 0.8).tolist() == [1, 2, 3]
    assert top_p_ids(probs, everything, 1.0).tolist() == [0, 1, 2, 3, 4]


def test_filters_apply_in_order_temperature_top_k_top_p():
    result = sample(LOGITS, SamplingSettings(temperature=1.0, top_k=3, top_p=0.7, seed=0))
    assert result.kept_by_top_k.tolist() == [1, 2, 3]
    # renormalised over top-k: 0.5/0.875, 0.25/0.875 -> 0.571 + 0.286 = 0.857 ≥ 0.7
    assert result.kept_by_top_p.tolist() == [1, 3]
    np.testing.assert_allclose(result.final_probs[[1, 3]], [2 / 3, 1 / 3])
    assert result.final_probs.sum() == pytest.approx(1.0)


def test_temperature_sharpens_and_flattens():
    cold = sample(LOGITS, SamplingSettings(temperature=0.5, seed=0)).probs
    hot = sample(LOGITS, SamplingSettings(temperature=2.0, seed=0)).probs
    assert cold[1] > softmax(LOGITS)[1] > hot[1]
    np.testing.assert_allclose(cold, softmax(LOGITS / 0.5))


def test_top_k_one_equals_greedy():
    for seed in range(20):
        assert sample(LOGITS, SamplingSettings(temperature=1.3, top_k=1, seed=seed)).chosen_id == 1


def test_same_seed_same_draw_and_seeds_differ():
    flat = np.zeros(50)
    draws = [sample(flat, SamplingSettings(temperature=1.0, seed=s)).chosen_id for s in range(10)]
    again = [sample(flat, SamplingSettings(temperature=1.0, seed=s)).chosen_id for s in range(10)]
    assert draws == again
    assert len(set(draws)) > 1


def test_draw_frequencies_follow_probabilities():
    counts = np.bincount([sample(LOGITS, SamplingSettings(temperature=1.0, seed=s)).chosen_id for s in range(4000)],
                         minlength=5) / 4000
    np.testing.assert_allclose(counts, softmax(LOGITS), atol=0.03)


@pytest.mark.parametrize(("bad", "name"), [(dict(temperature=-0.1), "temperature"), (dict(top_k=0), "top_k"),
                                           (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
                                           (dict(temperature=float("inf")), "temperature"),
                                           (dict(seed=-1), "seed"), (dict(seed=MAX_SEED + 1), "seed")])
def test_bad_settings_name_the_setting(bad, name):
    with pytest.raises(ValueError, match=name):
        check_settings(SamplingSettings(**bad))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=2, max_size=30), st.floats(0.05, 3), st.integers(1, 40),
       st.floats(0.01, 1.0), st.integers(0, MAX_SEED))
def test_chosen_id_always_survives_every_filter(logits, temperature, k, p, seed):
    result = sample(np.array(logits), SamplingSettings(temperature, k, p, seed))
    assert result.chosen_id in result.kept_by_top_p
    assert set(result.kept_by_top_p) <= set(result.kept_by_top_k)
    assert result.final_probs.sum() == pytest.approx(1.0)


def test_a_draw_keeps_the_top_candidates_with_what_each_filter_did():
    """softmax([3, 2, 1, 0, -1]) = .636, .234, .086, .032, .012: top-k 3 keeps ids 0-2, top-p 0.8 then keeps 0 and 1
    (.636 + .234 ≥ .8); id 0 is drawn with .636 / .870 = .731."""
    drawn = draw(np.array([3.0, 2.0, 1.0, 0.0, -1.0]), SamplingSettings(temperature=1.0, top_k=3, top_p=0.8, seed=0))
    assert drawn.top_ids.tolist() == [0, 1, 2, 3, 4]
    assert drawn.top_status == ("chosen", "kept", "cut_p", "cut_k", "cut_k")
    assert (drawn.n_kept_top_k, drawn.n_kept_top_p) == (3, 2)
    assert drawn.chosen_prob == pytest.approx(0.63641, abs=1e-5)
    assert drawn.chosen_final_prob == pytest.approx(0.73106, abs=1e-5)


def test_draw_from_inverts_the_cumulative_distribution():
    probs = np.array([0.2, 0.0, 0.5, 0.3])  # cumulative 0.2, 0.2, 0.7, 1.0
    assert [draw_from(probs, u) for u in (0.0, 0.1999, 0.2, 0.6999, 0.7, 0.9999)] == [0, 0, 2, 2, 3, 3]
    # a sum rounded below 1 leaves u past the end: the last id with a probability, never a zero-probability one
    assert draw_from(np.array([0.5, 0.4999, 0.0]), 0.99995) == 1


def test_most_probable_is_the_stable_argsort_s_head_ties_by_id():
    """most_probable = np.argsort(-probs, kind="stable")[:k], ties at the boundary and inside broken by id (breaks if
    the candidates were taken in another order or a tie at the k-th value were dropped)."""
    from model.engine.sampling import most_probable

    rng = np.random.default_rng(0)
    for _ in range(200):
        probs = rng.choice([0.0, 0.1, 0.2, 0.3, 0.5], size=int(rng.integers(1, 60)))  # many ties
        for k in (1, 3, 20, 80):
            assert most_probable(probs, k).tolist() == np.argsort(-probs, kind="stable")[:k].tolist()
