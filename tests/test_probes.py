"""Issue 26 in the engine: the logit lens and switched-off heads, side computations on one step of a run."""

import numpy as np
import pytest
import test_gemma3
import test_smollm2

from model.engine import generate
from model.engine.ablation import ablate, by_layer, kl_divergence, parse_heads
from model.engine.lens import LENS_TOP, LensLayer, LogitLens, logit_lens
from model.engine.llama import Probe
from model.engine.loading import load_model
from model.engine.sampling import SamplingSettings
from model.engine.steps import side_step
from model.errors import InputError
from model.texts import text
from ui.probes import lens_reading

LENS_TOLERANCE = 1e-5


GREEDY = SamplingSettings()


def run_of(model, prompt: str | None, steps: int = 3, settings: SamplingSettings = GREEDY):
    ids = [1, 3] if prompt is None else model.tokenizer.encode(prompt).ids
    return generate.start(model, ids, settings, steps + 1)


def snapshot(gen):
    """The run as a side computation must leave it: tokens, the cache's length and every held K and V, the traces."""
    held = [tuple(t.clone() for t in gen.cache.layer(i)) for i in range(gen.cache.n_layers)]
    return (gen.ids, gen.cache.length, held, [s.logits.copy() for s in gen.steps if s.logits is not None],
            [d.chosen_id for d in gen.samples], gen.stop_reason)


def assert_unchanged(before, after):
    assert before[0] == after[0] and before[1] == after[1] and before[4:] == after[4:]
    for (k0, v0), (k1, v1) in zip(before[2], after[2], strict=True):
        assert torch_equal(k0, k1) and torch_equal(v0, v1)
    assert all(np.array_equal(a, b) for a, b in zip(before[3], after[3], strict=True))


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def lens_matches_every_step(model, prompt, steps=3):
    """Each step's lens, made as the run goes: its last layer against the step's real logits."""
    gen, worst = run_of(model, prompt, steps), 0.0
    while True:
        trace = gen.steps[-1]
        lens = logit_lens(model, gen.cache, trace, gen.samples[-1].chosen_id)
        assert [row.layer for row in lens.layers] == list(range(model.info.n_layers))
        assert all(len(row.top_ids) == LENS_TOP and 1 <= row.chosen_rank for row in lens.layers)
        worst = max(worst, float(np.abs(lens.last_logits - trace.logits).max()))
        if generate.step(model, gen) is None:
            return gen, worst


@pytest.mark.parametrize("name, prompt", [("micro", None), ("small", "con mèo")])
def test_the_lens_last_layer_is_the_step_s_real_logits(name, prompt, request):
    model = request.getfixturevalue(name)
    gen, worst = lens_matches_every_step(model, prompt)
    assert worst <= LENS_TOLERANCE and len(gen.steps) >= 2


@test_smollm2.needs_model
def test_the_lens_last_layer_on_smollm2():
    model = load_model("smollm2", "cpu")
    _, worst = lens_matches_every_step(model, "The capital of France is")
    assert worst <= LENS_TOLERANCE


@test_gemma3.needs_model
def test_the_lens_last_layer_on_gemma3():
    model = load_model("gemma3", "cpu")
    _, worst = lens_matches_every_step(model, "Thủ đô của Việt Nam là")
    assert worst <= LENS_TOLERANCE


def test_the_lens_reads_where_the_answer_settles(micro):
    """micro's course example: "cá" is already first after layer 0 and stays first, the lens says layer 0."""
    gen = run_of(micro, None)
    lens = logit_lens(micro, gen.cache, gen.steps[0], gen.samples[0].chosen_id)
    assert gen.samples[0].chosen_id == 4
    assert [row.chosen_rank for row in lens.layers][-1] == 1 and lens.settled_at is not None
    assert all(row.chosen_rank == 1 for row in lens.layers[lens.settled_at:])
    assert lens.settled_at == 0 or lens.layers[lens.settled_at - 1].chosen_rank > 1


def lens_of_ranks(ranks: list[int]) -> LogitLens:
    """A lens whose chosen token (id 7) stands at these ranks, layer by layer."""
    return LogitLens(7, [LensLayer(i, [7], [0.5], r, 0.5) for i, r in enumerate(ranks)], np.zeros(1, np.float32))


@pytest.mark.parametrize("ranks, settled, first", [([3, 1, 2, 1, 1], 3, 1),   # first, loses the lead, takes it back
                                                   ([2, 2, 1, 1], 2, 2), ([1, 1, 1], 0, 0),
                                                   ([1, 2, 2], None, 0), ([2, 1, 3], None, 1), ([4, 2], None, None)])
def test_settled_is_the_start_of_the_last_run_of_rank_1_and_first_is_the_first_layer_at_rank_1(ranks, settled,
                                                                                                 first):
    lens = lens_of_ranks(ranks)
    assert (lens.settled_at, lens.first_at) == (settled, first)


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_the_lens_sentence_says_whether_the_token_was_first_before_it_settled(lang):
    """Issue 36 W1: a token first at layers 1 and 2 that loses the lead at layer 3 and is first again from layer 4
    on; the layers before 4 do not all guess other tokens."""
    key, details = lens_reading(lens_of_ranks([2, 1, 1, 2, 1, 1]), "mèo", "1.0e-06")
    again = text(key, lang).format(**details)
    assert key == "lens.settled_again" and details == {"token": "mèo", "layer": 4, "n": 2, "layers": 6,
                                                       "diff": "1.0e-06", "first": 1, "earlier": 2}
    assert {"vi": "đứng đầu ở lớp 1 rồi mất vị trí đầu", "en": "already first at layer 1, then lost the lead"}[lang] \
        in again
    assert {"vi": "các lớp trước còn đoán token khác", "en": "the layers before still guess other tokens"}[lang] \
        not in again
    key, details = lens_reading(lens_of_ranks([2, 3, 1, 1]), "mèo", "0.0e+00")
    assert key == "lens.settled" and (details["layer"], details["n"], details["layers"]) == (2, 2, 4)
    assert {"vi": "lớp ngay trước đó đoán một token khác", "en": "the layer just before guesses another token"}[lang] \
        in text(key, lang).format(**details)
    key, details = lens_reading(lens_of_ranks([1, 1, 1]), "mèo", "0.0e+00")
    assert key == "lens.settled_all" and "3" in text(key, lang).format(**details)
    assert lens_reading(lens_of_ranks([1, 2]), "mèo", "0.0e+00")[0] == "lens.not_first"


def test_a_sampled_token_that_is_not_first_has_no_settled_layer(small):
    gen = run_of(small, "con mèo")
    top = gen.samples[0].top_ids
    lens = logit_lens(small, gen.cache, gen.steps[0], int(top[1]))  # the second most probable, as a draw could be
    assert lens.layers[-1].chosen_rank == 2 and lens.settled_at is None


def test_the_lens_and_heads_off_leave_the_run_as_it_was(small):
    gen = run_of(small, "con mèo", settings=SamplingSettings(temperature=0.9, seed=3))
    generate.step(small, gen)
    before = snapshot(gen)
    trace, index = gen.steps[-1], len(gen.steps) - 1
    logit_lens(small, gen.cache, trace, gen.samples[-1].chosen_id)
    ablate(small, gen.cache, trace, [(0, 0), (2, 1)], gen.settings, index, gen.samples[-1].chosen_id)
    ablate(small, gen.cache, gen.steps[0], [(1, 3)], gen.settings, 0, gen.samples[0].chosen_id)
    assert_unchanged(before, snapshot(gen))
    # and the run goes on exactly as one that never looked
    twin = run_of(small, "con mèo", settings=SamplingSettings(temperature=0.9, seed=3))
    generate.run_to_end(small, twin)
    generate.run_to_end(small, gen)
    assert gen.ids == twin.ids and all(np.array_equal(a.logits, b.logits) for a, b in zip(gen.steps, twin.steps)
                                       if a.logits is not None and b.logits is not None)


def test_no_head_off_gives_the_real_logits_exactly(small):
    gen = run_of(small, "con mèo")
    generate.step(small, gen)
    for trace in (gen.steps[0], gen.steps[-1]):
        again = side_step(small, gen.cache, trace, Probe(heads_off=by_layer([]))).logits[0, -1].numpy()
        assert np.array_equal(again, trace.logits)


def test_a_head_off_changes_the_logits(small):
    gen = run_of(small, "con mèo")
    generate.step(small, gen)
    result = ablate(small, gen.cache, gen.steps[-1], [(0, 0)], gen.settings, 1, gen.samples[-1].chosen_id)
    assert float(np.abs(result.logits - gen.steps[-1].logits).max()) > 1e-3 and result.kl > 0
    assert [i for i, _ in result.top_before] == [int(i) for i in gen.samples[-1].top_ids[:LENS_TOP]]


def test_every_head_off_changes_the_chosen_token(small):
    """small's "con mèo" step 1: with the first two layers' heads all off the greedy answer changes."""
    gen = run_of(small, "con mèo")
    generate.step(small, gen)
    heads = [(layer, head) for layer in (0, 1) for head in range(small.info.n_heads)]
    result = ablate(small, gen.cache, gen.steps[-1], heads, gen.settings, 1, gen.samples[-1].chosen_id)
    assert result.changed and result.chosen_after == result.top_after[0][0]


def test_kl_divergence():
    p, q = np.array([0.5, 0.5, 0.0]), np.array([0.25, 0.25, 0.5])
    assert kl_divergence(p, p) == 0.0
    assert kl_divergence(p, q) == pytest.approx(np.log(2))


@pytest.mark.parametrize("text", ["", "0", "0.9", "2.0", "a.b", "0.0,", "0.0;1.1", "-1.0"])
def test_heads_that_cannot_be_read_are_a_sentence(micro, text):
    with pytest.raises(InputError) as bad:
        parse_heads(text, micro.info)
    assert bad.value.code == "bad_heads" and "layer.head" in bad.value.message("en")


def test_heads_are_read_as_layer_dot_head(small):
    assert parse_heads(" 0.1, 3.3 ,0.2", small.info) == [(0, 1), (3, 3), (0, 2)]
    assert by_layer([(3, 3), (0, 2), (0, 1), (0, 1)]) == {0: (1, 2), 3: (3,)}


def trace_json(capsys, *extra):
    import json

    from model.tools.cli import main

    assert main(["trace", "--model", "small", "--prompt", "con mèo", "--temperature", "0.8", "--seed", "2",
                 "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_trace_logit_lens_and_ablate_beside_an_untouched_run(capsys):
    plain = trace_json(capsys)
    probed = trace_json(capsys, "--logit-lens", "--ablate", "0.1,3.2")
    assert probed["output"] == plain["output"] and probed["counts"] == plain["counts"]
    for ours, theirs in zip(probed["steps"], plain["steps"], strict=True):
        assert ours["chosen_id"] == theirs["chosen_id"] and ours["top"] == theirs["top"]
        assert "logit_lens" not in theirs and "ablation" not in theirs
        lens = ours["logit_lens"]
        assert [row["layer"] for row in lens] == [0, 1, 2, 3]
        # the last layer is the real step (its probabilities at temperature 1, the step's at the run's 0.8)
        assert [t["id"] for t in lens[-1]["top"]] == [t["id"] for t in ours["top"]]
        assert ours["ablation"]["heads"] == ["0.1", "3.2"] and ours["ablation"]["kl"] > 0


def test_trace_ablate_that_cannot_be_read_is_one_sentence(capsys):
    from model.tools.cli import main

    assert main(["trace", "--model", "micro", "--prompt-ids", "1,3", "--ablate", "2.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "layers 0 to 1, heads 0 to 1" in err
