"""The KV cache in fewer bits (model/engine/kv_quant.py): what it stores, what a pass reads back, what it costs."""

import json

import pytest
import torch

from model.engine.kv_quant import (
    GROUP,
    QuantizedKVCache,
    bytes_per_position,
    quantize_int8,
    with_kv_dtype,
)
from model.serving.quality import decode_step_times
from model.tools.cli import main


def test_int8_keys_take_a_scale_per_channel_and_values_one_per_position():
    """KIVI's split: an outlier key channel keeps its own scale, so the other channels keep their resolution."""
    torch.manual_seed(0)
    k = torch.randn(1, 1, GROUP, 8)
    k[..., 3] *= 100                                                      # an outlier channel
    codes, scale = quantize_int8(k, dim=2)                                 # over the positions: per channel
    assert scale.shape == (1, 1, 1, 8) and codes.dtype == torch.int8
    per_channel_error = (codes.float() * scale - k).abs().max(dim=2).values[0, 0]
    _, one_scale = quantize_int8(k.flatten(), dim=0)
    assert per_channel_error[0] < one_scale / 50                            # far finer than one scale for all
    v_codes, v_scale = quantize_int8(k, dim=-1)
    assert v_scale.shape == (1, 1, GROUP, 1) and (v_codes.float() * v_scale - k).abs().max() <= v_scale.max() / 2


def test_bytes_per_position_counts_the_scales():
    """SmolLM2 (30 layers, 3 KV heads of 64): 46,080 B in float32; int8 a byte a number, a key scale a channel per
    32 positions and a value scale a position: 30 × 3 × (128 + 8 + 4) = 12,600 B; fp8 11,520 B."""
    assert bytes_per_position("float32", 30, 3, 64) == 46_080
    assert bytes_per_position("int8", 30, 3, 64) == 12_600
    assert bytes_per_position("fp8", 30, 3, 64) == 11_520


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_text_fed_in_passes_reads_its_keys_as_decode_steps_do(small, kv_dtype):
    """After the same first pass (fp8's scales are set by it), fed GROUP positions a pass (the quality command's way),
    every position's logits are those of a decode step at that position over the same quantized cache, bit for bit:
    breaks if a pass read its own group's keys quantized (a decode step reads them from the float residual) or
    quantized a group before it is complete."""
    model = with_kv_dtype(small, kv_dtype)
    ids = [(7 * i) % 300 + 3 for i in range(3 * GROUP + 5)]
    passes, steps = model.new_cache(), model.new_cache()
    with torch.inference_mode():
        first = [model.every_logits(ids[:GROUP], cache) for cache in (passes, steps)]
        assert torch.equal(*first)
        fed = torch.cat([model.every_logits(ids[at:at + GROUP], passes) for at in range(GROUP, len(ids), GROUP)])
        stepped = torch.cat([model.every_logits([i], steps) for i in ids[GROUP:]])
    assert torch.equal(fed, stepped)
    assert passes.nbytes() == steps.nbytes()


def test_the_cache_holds_the_formula_s_bytes_and_stays_close_to_float32(small):
    int8 = with_kv_dtype(small, "int8")
    ids = [(5 * i) % 200 + 3 for i in range(2 * GROUP)]
    with torch.inference_mode():
        exact = small.every_logits(ids, small.new_cache())
        cache = int8.new_cache()
        assert isinstance(cache, QuantizedKVCache)
        rounded = int8.every_logits(ids[:GROUP], cache)
        rounded = torch.cat([rounded, int8.every_logits(ids[GROUP:], cache)])
    info = small.info
    assert cache.nbytes() == bytes_per_position("int8", info.n_layers, info.n_kv_heads, info.d_head) * len(ids)
    assert 0 < (exact - rounded).abs().max() < 0.05 * exact.abs().max()
    assert with_kv_dtype(small, "float32") is small and small.new_cache().nbytes() == 0


def test_quality_by_kv_dtype(capsys):
    assert main(["quality", "--model", "small", "--kv-dtype", "float32,int8,fp8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["kv_dtype"]: row for row in report["kv_dtypes"]}
    assert list(rows) == ["float32", "int8", "fp8"] and "dtypes" not in report
    assert rows["float32"]["mean_kl"] == 0.0 and rows["float32"]["greedy_agreement"] == 1.0
    assert [rows[d]["bytes_per_position"] for d in rows] == [2048, 576, 512]
    assert 0 < rows["int8"]["mean_kl"] < rows["fp8"]["mean_kl"] < 0.05
    assert all(row["step_ms"] > 0 for row in rows.values())
    assert "p50 of 20 decode steps after 107 positions" in report["conditions"]  # small's 128 − 20 − 1


def test_each_cache_dtype_is_timed_after_the_same_positions(small):
    """As many timed steps per cache dtype, after the context the text and the model's context leave."""
    steps = decode_step_times({"float32": small, "int8": with_kv_dtype(small, "int8")}, list(range(5, 305)), repeats=3)
    assert steps.context == 128 - 3 - 1  # the warm-up and the 3 timed steps fill the context
    assert {name: len(ms) for name, ms in steps.ms.items()} == {"float32": 3, "int8": 3}
    assert all(t > 0 for ms in steps.ms.values() for t in ms)


@pytest.mark.parametrize("argv, said", [
    (["--kv-dtype", "int4"], "--kv-dtype: there is no cache dtype int4"),
    (["--kv-dtype", "int8", "--dtype", "int8"], "--kv-dtype measures the cache with float32 weights"),
])
def test_bad_kv_dtype_is_one_sentence(capsys, argv, said):
    assert main(["quality", "--model", "small", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1
