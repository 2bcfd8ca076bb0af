"""A bounded cache (model/engine/kv_evict.py): StreamingLLM's sinks and window, and the sink measured."""

import json

import pytest
import torch

from model.engine.kv_evict import HeavyHitterCache, SinkWindowCache, check_window, nll_along, sink_mass
from model.errors import InputError
from model.tools.cli import main

IDS = [(11 * i) % 250 + 3 for i in range(40)]


def test_a_bound_never_reached_is_the_full_cache_within_rounding(small):
    """Keys kept unturned and turned again by their slot: the same keys up to float rounding (stated: 1e-4 on the
    NLL), since nothing was evicted and every slot is the text's position."""
    full = nll_along(small, IDS, small.new_cache())
    bounded = nll_along(small, IDS, SinkWindowCache(small, 4, 60))
    assert max(abs(a - b) for a, b in zip(full, bounded)) < 1e-4


def test_the_cache_keeps_the_sinks_and_the_latest_with_their_slots(small):
    """After 40 positions through 2 sinks + 8 latest: 10 held, the first layer's values those of positions 0, 1 and
    32..39 as the full cache holds them (a first layer's value depends on its token alone, and values are never
    turned: bit for bit); breaks if the oldest after the sinks were kept instead."""
    bounded, full = SinkWindowCache(small, 2, 8), small.new_cache()
    nll_along(small, IDS + [3], bounded)
    nll_along(small, IDS + [3], full)
    assert bounded.length == 10 and bounded.evicted == 30
    kept = [0, 1, *range(32, 40)]
    assert all(bounded.kept(layer) == kept for layer in range(small.info.n_layers))  # what the page draws
    assert torch.equal(bounded.layer(0)[1], full.layer(0)[1][:, :, kept])
    assert all(bounded.layer(layer)[0].shape[2] == 10 for layer in range(small.info.n_layers))


def test_the_window_alone_is_the_same_cache_without_sinks(small):
    alone = SinkWindowCache(small, 0, 10)
    nll_along(small, IDS + [3], alone)
    assert alone.length == 10 and alone.evicted == 30 and alone.kept(0) == list(range(30, 40))
    early = SinkWindowCache(small, 2, 8)
    nll_along(small, IDS[:6], early)
    assert early.kept(0) == list(range(5))  # before the bound every position is held


def test_heavy_hitters_keep_the_latest_and_the_most_attended(small):
    """H2O at 3 heavy + 5 recent: 8 positions held a layer, the 5 latest among them, and the 3 older ones that had
    received the most attention when each drop was made; a bound
    never reached gives the full cache's NLL bit for bit (keys are kept as the model turned them)."""
    cache = HeavyHitterCache(small, 3, 5)
    nll_along(small, IDS, cache)
    assert cache.length == len(IDS) - 1
    for layer, held in enumerate(cache.positions):
        assert len(held) == 8 and held[-5:] == list(range(len(IDS) - 6, len(IDS) - 1)) and cache.kept(layer) == held
    assert nll_along(small, IDS, HeavyHitterCache(small, 40, 40)) == nll_along(small, IDS, small.new_cache())


def test_sink_mass_is_a_share_per_layer_and_head(small):
    mass = sink_mass(small, IDS)
    assert mass.shape == (small.info.n_layers, small.info.n_heads)
    assert bool(((mass >= 0) & (mass <= 1)).all())


def test_bad_windows_are_refused(small):
    with pytest.raises(InputError, match="W must be at least 1"):
        check_window(small, 4, 0)
    with pytest.raises(InputError, match="under the model's context of 128"):
        check_window(small, 64, 64)


def test_quality_kv_window_runs_the_three_caches(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("con mèo ngủ trên ghế . con chó chạy ngoài sân . " * 4, encoding="utf-8")
    assert main(["quality", "--model", "small", "--kv-window", "2,8", "--text", str(text), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    runs = {r["policy"]: r for r in report["runs"]}
    assert list(runs) == ["full", "sinks", "window", "heavy_hitters"] and report["sinks"] == 2 and report["window"] == 8
    assert all(r["positions"] == report["tokens"] - 1 for r in runs.values())
    assert len(report["sink_mass"]) == 4 and len(report["sink_mass"][0]) == 4


@pytest.mark.parametrize("value, said", [("4", "takes two whole numbers"), ("a,b", "takes two whole numbers")])
def test_bad_kv_window_is_one_sentence(capsys, value, said):
    assert main(["quality", "--model", "small", "--kv-window", value]) == 2
    assert said in capsys.readouterr().err


def test_kv_policy_chooses_the_bounded_caches_and_h2o_stops_at_the_context(capsys):
    """--kv-policy runs the full cache and the named ones; H2O keeps the text's positions, so on small (context 128)
    over the held-out text its run stops at the context as the full cache's does (it raised an IndexError at
    position 128: red with H2O fed the whole text)."""
    assert main(["quality", "--model", "small", "--kv-window", "4,28", "--kv-policy", "heavy_hitters", "--json"]) == 0
    runs = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert list(runs) == ["full", "heavy_hitters"] and runs["heavy_hitters"]["positions"] == runs["full"]["positions"]
    assert runs["full"]["positions"] == 127


@pytest.mark.parametrize("args, said", [(["--kv-window", "4,28", "--kv-policy", "sinks,sinks"], "each once"),
                                        (["--kv-window", "4,28", "--kv-policy", "lru"], "it is lru"),
                                        (["--kv-policy", "sinks"], "goes with --kv-window")])
def test_bad_kv_policy_is_one_sentence(capsys, args, said):
    assert main(["quality", "--model", "small", *args]) == 2
    assert said in capsys.readouterr().err


def test_a_window_smaller_than_the_sinks_is_refused(small):
    """Issue 53's bad input: a window smaller than the sinks. Red with W ≥ 1 the only bound."""
    with pytest.raises(InputError, match="no fewer than S"):
        check_window(small, 8, 4)
    check_window(small, 4, 4)
