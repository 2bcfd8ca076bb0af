"""Why GQA exists: the multi-head equivalent of a grouped-query model computes the same logits, bit for bit, and
keeps group × the cache (model/engine/kv_heads.py)."""

import json

import pytest
import torch

from model.engine.kv_heads import as_multi_head, cache_formulas, mla_bytes_per_position
from model.engine.loading import load_model
from model.tools.cli import main
from model.weights.catalog import fetched_folder


def run_both(model, wide, prompt, steps):
    caches = model.new_cache(), wide.new_cache()
    diffs = []
    with torch.inference_mode():
        logits = [m.forward(prompt, c, False)[0] for m, c in zip((model, wide), caches)]
        diffs.append(float((logits[0] - logits[1]).abs().max()))
        for _ in range(steps):
            token = int(logits[0].argmax())
            logits = [m.forward([token], c, False)[0] for m, c in zip((model, wide), caches)]
            diffs.append(float((logits[0] - logits[1]).abs().max()))
    return diffs, caches


def test_the_multi_head_equivalent_has_the_same_logits_and_group_times_the_cache(small):
    """Breaks if a KV head's copies go to the wrong query heads (repeat in place of repeat_interleave: 0.0 no more)."""
    wide = as_multi_head(small)
    group = small.info.n_heads // small.info.n_kv_heads
    assert (wide.info.n_kv_heads, group) == (small.info.n_heads, 2)
    diffs, (cache, wide_cache) = run_both(small, wide, [2, 5, 9, 11, 3], 6)
    assert diffs == [0.0] * 7
    assert wide_cache.nbytes() == group * cache.nbytes()
    shipped, multi = cache_formulas(small)
    assert multi.bytes_per_position == group * shipped.bytes_per_position == cache.nbytes() // cache.length * group


def test_the_shared_model_is_not_touched(small):
    before = small.module.model.layers[0].self_attn.n_kv_heads
    as_multi_head(small)
    assert small.module.model.layers[0].self_attn.n_kv_heads == before == small.info.n_kv_heads


def test_mla_formula():
    """DeepSeek-V2's cache: (d_c + d_h^R) × layers elements a position (60 layers, 512 + 64, 2 bytes)."""
    assert mla_bytes_per_position(60, 512, 64, 2) == 60 * 576 * 2


def test_the_command_reports_both_rows(capsys):
    assert main(["kv-heads", "--model", "small", "--steps", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["max_abs_logit_diff"] == 0.0
    shipped, multi = report["rows"]
    assert (shipped["n_kv_heads"], multi["n_kv_heads"]) == (2, 4)
    assert multi["cache_bytes"] == 2 * shipped["cache_bytes"]


def test_bad_steps_is_one_sentence(capsys):
    assert main(["kv-heads", "--model", "small", "--steps", "0"]) == 2
    assert "--steps must be between 1 and 256" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name, group", [("smollm2", 3), ("gemma3", 4)])
def test_real_models_multi_head_equivalents_are_exact(name, group):
    """SmolLM2's 3 KV heads for 9 query heads, Gemma 3's one for 4 (its per-head key norm and sliding layers too)."""
    if not (fetched_folder(name) / "source.json").is_file():
        pytest.skip(f"{name} is not fetched: run `python -m model fetch {name}` (./dev test does)")
    model = load_model(name)
    wide = as_multi_head(model)
    diffs, (cache, wide_cache) = run_both(model, wide, model.tokenizer.encode("The capital of France is").ids, 4)
    assert diffs == [0.0] * 5
    assert wide_cache.nbytes() == group * cache.nbytes()
