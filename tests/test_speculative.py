"""Speculative decoding: the accept-or-resample arithmetic, greedy output equal to plain decoding for every
draft, the target's distribution under sampling, the caches after a round, bad input, early exit, the CLI."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from test_hf import save_tiny
from test_smollm2 import needs_model

from model.engine import generate
from model.engine.cache import KVCache
from model.engine.llama import Llama, LlamaConfig, Probe
from model.engine.loading import load_model
from model.engine.runtime import NativeModel
from model.engine.sampling import SamplingSettings, sample
from model.engine.tokenizer import WordTokenizer, build_word_tokenizer, encode_chat
from model.errors import InputError
from model.speculative import decoding, drafts
from model.speculative.decoding import SpeculativeRun, next_round
from model.speculative.drafts import ModelDraft, lookup_continuation
from model.speculative.rules import expected_tokens_per_pass, output_distribution, residual
from model.tools.cli import main

GREEDY = SamplingSettings()
PROMPTS = ["con mèo", "the dog", "hôm nay trời", "my mother cooks", "i go to school",
           "the cat eats fish . the cat eats"]  # the last repeats itself: prompt lookup finds a match
DRAFTS = ["small-draft", "lookup", "early-exit:1", "early-exit:3"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: on a shared 2-core machine one thread runs them many times faster than two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_llama(seed: int, n_layers: int = 3) -> NativeModel:
    """A random GQA Llama over 8 words (+ specials): p and q far apart, as a sampling test needs."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=12, hidden_size=24, intermediate_size=40, num_hidden_layers=n_layers,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=4, max_position_embeddings=48)
    module = Llama(cfg)
    for p in module.parameters():  # larger weights than the default init: peaked, unlike distributions
        torch.nn.init.normal_(p, std=0.5)
    vocab = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(8)]
    return NativeModel(f"tiny{seed}", module.eval().requires_grad_(False), WordTokenizer(build_word_tokenizer(vocab)),
                       torch.device("cpu"))


def plain_greedy(model, prompt_ids, max_new_tokens):
    gen = generate.start(model, prompt_ids, GREEDY, max_new_tokens)
    generate.run_to_end(model, gen)
    return gen


# -- the arithmetic -------------------------------------------------------------------------------------------

def test_accept_or_resample_yields_p_exactly():
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.5, 0.3])
    # kept: q·min(1, p/q) = min(p, q) = [0.2, 0.3, 0.2]; rejected 0.3 of the time, then max(0, p − q) = [0.3, 0, 0]
    np.testing.assert_allclose(residual(p, q), [1.0, 0.0, 0.0])
    np.testing.assert_allclose(output_distribution(p, q), [0.5, 0.3, 0.2], atol=1e-15)
    # a token the draft never proposes (q = 0) comes only from the residual
    p, q = np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.0, 0.5, 0.5, 0.0])
    np.testing.assert_allclose(residual(p, q), [0.2, 0.0, 0.0, 0.8])
    np.testing.assert_allclose(output_distribution(p, q), p, atol=1e-15)
    # a deterministic draft (prompt lookup, q = one-hot): keep x with probability p(x), else p without x
    p, q = np.array([0.6, 0.3, 0.1]), np.array([0.0, 1.0, 0.0])
    np.testing.assert_allclose(output_distribution(p, q), p, atol=1e-15)


def test_expected_tokens_per_pass():
    assert expected_tokens_per_pass(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2) == pytest.approx(3.3616)
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0


def test_lookup_copies_what_followed_the_first_earlier_match():
    assert lookup_continuation([5, 6, 7, 8, 5, 6], 3) == [7, 8, 5]    # the last 2 tokens [5, 6] at 0
    assert lookup_continuation([5, 6, 7, 9, 6], 2) == [7, 9]          # no [9, 6] earlier: the last token, 6
    assert lookup_continuation([5, 6, 7], 3) == []                    # nothing repeats


# -- greedy: the same tokens as plain decoding ---------------------------------------------------------------

@pytest.mark.parametrize("draft", DRAFTS)
def test_greedy_speculative_equals_plain_greedy(small, draft):
    accepted = 0
    for prompt in PROMPTS:
        ids = generate.encode_prompt(small, prompt).ids
        plain = plain_greedy(small, ids, 30)
        for gamma in (1, 3, 5):
            run = decoding.start(small, draft, ids, gamma, GREEDY, 30)
            decoding.run_to_end(run)
            assert run.new_ids == plain.new_ids, (prompt, gamma)
            assert run.stop_reason == plain.stop_reason
            assert run.target_passes <= len(run.new_ids)
            accepted += run.accepted
    assert accepted > 0  # the drafts did propose tokens that were kept, not only the target's own


def test_greedy_speculative_equals_plain_on_a_tiny_random_llama():
    """Early exit on a Llama unlike `small`; runs up to max_new_tokens and to the context window's end."""
    model = tiny_llama(1)
    for prompt in ([1, 5, 6, 7], [1, 4, 4, 4, 4]):
        for max_new in (12, model.info.context_length - len(prompt) + 1):
            plain = plain_greedy(model, prompt, max_new)
            for draft in ("early-exit:1", "early-exit:2", "lookup"):
                run = decoding.start(model, draft, prompt, 4, GREEDY, max_new)
                decoding.run_to_end(run)
                assert (run.new_ids, run.stop_reason) == (plain.new_ids, plain.stop_reason), (prompt, draft)


@needs_model
def test_greedy_speculative_equals_plain_on_smollm2():
    """The real model: early exit from its first 20 of 30 layers, and prompt lookup, on a chat prompt."""
    model = load_model("smollm2", "cpu")
    ids = encode_chat(model, "What is the capital of France?").ids
    plain = plain_greedy(model, ids, 12)
    assert model.tokenizer.decode(plain.new_ids) == "The capital of France is Paris."
    assert drafts.draft_choices(model) == ["lookup", "early-exit:20"]
    for draft in ("early-exit:20", "lookup"):
        run = decoding.start(model, draft, ids, 4, GREEDY, 12)
        decoding.run_to_end(run)
        assert (run.new_ids, run.stop_reason) == (plain.new_ids, plain.stop_reason), draft
        assert run.target_passes < len(run.new_ids)  # some proposals were kept


def test_a_transformers_target_with_prompt_lookup(tmp_path, monkeypatch):
    """The check pass on the transformers backend (a tiny random Qwen2, GQA, built here): lookup only."""
    monkeypatch.setenv("DECODE_LAB_ALLOW_PATHS", "1")
    model = load_model(str(save_tiny(tmp_path / "qwen2", "qwen2")), "cpu")
    assert drafts.draft_choices(model) == ["lookup"]
    with pytest.raises(InputError) as bad:
        decoding.start(model, "early-exit:1", [1, 5], 4, GREEDY, 5)
    assert bad.value.code == "speculative_early_exit_native"
    ids = model.tokenizer.encode("the cat sat on the mat the cat sat").ids
    plain = plain_greedy(model, ids, 16)
    run = decoding.start(model, "lookup", ids, 3, GREEDY, 16)
    decoding.run_to_end(run)
    assert (run.new_ids, run.stop_reason) == (plain.new_ids, plain.stop_reason)
    assert run.proposed > 0 and run.cache.length == len(run.ids) - 1


def test_early_exit_is_the_first_k_layers_then_the_final_norm_and_head():
    model = tiny_llama(2)
    x = torch.tensor([[1, 5, 6, 7, 8]])
    shallow = Llama(dataclasses.replace(model.module.config, num_hidden_layers=2))
    shallow.load_state_dict(model.module.state_dict(), strict=False)  # layers 0, 1, the norm and the head
    with torch.inference_mode():
        expected = shallow(x).logits
        got = model.module(x, probe=Probe(n_layers=2)).logits
        full = model.module(x).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.allclose(got, full)


# -- sampling: the target's distribution ---------------------------------------------------------------------

def first_tokens(target, draft_model, settings, n_runs):
    prompt = [1, 5, 6]
    counts = np.zeros(target.info.vocab_size)
    for seed in range(n_runs):
        s = SamplingSettings(settings.temperature, settings.top_k, settings.top_p, seed)
        draft = ModelDraft("tiny-draft", draft_model.module, draft_model.device, draft_model.info.n_layers)
        run = SpeculativeRun(target, draft, prompt, 1, s, 2, target.new_cache())
        rnd = next_round(run)
        assert len(rnd.checks) == 1  # the first token went through accept-or-resample
        counts[rnd.new_ids[0]] += 1
    return counts


def test_first_token_follows_the_target_distribution():
    """2000 seeded runs of one round: the first token's frequencies match the target's p after top-k
    (chi-square over its 6 tokens, 5 degrees of freedom, critical value 20.5 at 0.001), though the draft's q
    is far from p."""
    target, draft = tiny_llama(3), tiny_llama(4, n_layers=1)
    settings = SamplingSettings(temperature=1.0, top_k=6)
    prompt = [1, 5, 6]
    p = sample(target.forward(prompt, None, False)[0].numpy(), settings).final_probs
    q = sample(draft.forward(prompt, None, False)[0].numpy(), settings).final_probs
    assert 0.5 * np.abs(p - q).sum() > 0.3  # total variation: the draft alone would be far off
    n = 2000
    counts = first_tokens(target, draft, settings, n)
    support = p > 0
    assert support.sum() == 6
    assert counts[~support].sum() == 0  # nothing top-k removed is ever emitted
    expected = n * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (counts, expected)
    # the same statistic on the draft's own distribution is far past the critical value: the test can fail
    chi2_q = float(((counts[support] - n * q[support]) ** 2 / np.maximum(n * q[support], 1e-9)).sum())
    assert chi2_q > 100


# -- the caches after a round --------------------------------------------------------------------------------

@pytest.mark.parametrize("settings", [GREEDY, SamplingSettings(temperature=1.0, seed=5)])
@pytest.mark.parametrize("draft", ["small-draft", "early-exit:2"])
def test_caches_after_a_round_equal_plain_decoding_of_the_same_tokens(small, draft, settings):
    ids = generate.encode_prompt(small, "con mèo").ids
    run = decoding.start(small, draft, ids, 4, settings, 30)
    for _ in range(2):
        rnd = next_round(run)
        assert rnd.target_len_checked > rnd.target_len_after or rnd.accepted == rnd.gamma  # a crop, or all kept
        assert run.cache.length == len(run.ids) - 1
        # plain decoding of the same tokens: prefill the prompt, then feed each new token but the newest
        plain = small.new_cache()
        small.forward(run.prompt_ids, plain, output_attentions=False)
        for token in run.new_ids[:-1]:
            small.forward([token], plain, output_attentions=False)
        assert plain.length == run.cache.length
        assert plain.nbytes() == run.cache.nbytes()
        for layer in range(small.info.n_layers):
            for ours, theirs in zip(run.cache.layer(layer), plain.layer(layer)):
                assert ours.shape == theirs.shape
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        # the next step: the same logits from either cache (the forward appends, so compare copies' results)
        ours_next = small.forward(run.ids[-1:], run.cache, output_attentions=False)[0]
        theirs_next = small.forward(run.ids[-1:], plain, output_attentions=False)[0]
        torch.testing.assert_close(ours_next, theirs_next, rtol=0, atol=1e-5)
        run.cache.crop(len(run.ids) - 1)
        # the draft's cache: the same tokens, all but the newest (or the newest two, after a bonus token, whose
        # predecessor the draft never fed), equal to the draft run over those tokens from scratch
        held = run.draft.cache.length
        assert held in (len(run.ids) - 1, len(run.ids) - 2)
        fresh = KVCache(run.draft.n_layers)
        with torch.inference_mode():
            run.draft.module(torch.tensor([run.ids[:held]]), fresh, probe=Probe(n_layers=run.draft.n_layers))
        for layer in range(run.draft.n_layers):
            for ours, theirs in zip(run.draft.cache.layer(layer), fresh.layer(layer)):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        if run.stop_reason:
            break


# -- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("target", "draft", "gamma", "code"), [
    ("small", "small-draft", 0, "speculative_gamma"),
    ("small", "small-draft", 17, "speculative_gamma"),
    ("micro", "small-draft", 4, "speculative_tokenizer"),
    ("small", "micro", 4, "speculative_unknown_draft"),
    ("small", "early-exit:4", 4, "speculative_early_exit_layers"),
    ("small", "early-exit:0", 4, "speculative_early_exit_layers"),
    ("small", "early-exit:x", 4, "speculative_early_exit_layers"),
])
def test_bad_input_gets_a_sentence(target, draft, gamma, code, request):
    model = request.getfixturevalue("small") if target == "small" else load_model("micro", "cpu")
    with pytest.raises(InputError) as bad:
        decoding.start(model, draft, [1, 5], gamma, GREEDY, 5)
    assert bad.value.code == code
    for lang in ("vi", "en"):
        assert bad.value.message(lang).endswith(".")
    if code == "speculative_gamma":
        assert bad.value.message("en") == ("γ, the tokens the draft proposes per round, must be between 1 and 16; "
                                           f"the value given is {gamma}.")


# -- the command line -----------------------------------------------------------------------------------------

def test_cli_json(small, capsys):
    assert main(["speculate", "--model", "small", "--draft", "small-draft", "--gamma", "3",
                 "--prompt", "my mother cooks", "--max-new-tokens", "12", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["schema"] == "decode-lab.speculate/1" and rep["settings"]["max_new_tokens"] == 12
    assert all(r["settings"] == {"temperature": 0.0, "top_k": None, "top_p": 1.0, "seed": 0} for r in rep["rounds"])
    assert rep["rounds"][-1]["answer"] == rep["output"]["text"]
    plain = plain_greedy(small, generate.encode_prompt(small, "my mother cooks").ids, 12)
    assert rep["output"]["ids"] == plain.new_ids
    assert rep["output"]["text"] == "noodle soup for me."
    assert rep["output"]["stop_reason"] == "eos"
    counts = rep["counts"]
    assert counts["target_passes"] == len(rep["rounds"])
    assert counts["proposed"] == sum(len(r["proposed"]) for r in rep["rounds"])
    assert counts["accepted"] == sum(p["accepted"] is True for r in rep["rounds"] for p in r["proposed"])
    assert counts["new_tokens"] == counts["accepted"] + sum(r["next_id"] is not None for r in rep["rounds"])
    prompt_len, produced = len(rep["prompt"]["ids"]), 0
    for r in rep["rounds"]:
        produced += len(r["new_ids"])
        assert r["target_cache_len"] == prompt_len + produced - 1
        assert all(p["r"] is None for p in r["proposed"])  # greedy
        assert set(r["proposed"][0]) == {"id", "token", "bytes", "q", "p", "r", "accepted"}


def test_cli_lists_the_unknown_words_as_trace_does(capsys):
    assert main(["speculate", "--prompt", "the zebra eats", "--draft", "lookup", "--max-new-tokens", "3",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt"]["unknown"] == ["zebra"]
    assert main(["speculate", "--prompt", "the zebra eats", "--draft", "lookup", "--max-new-tokens", "3"]) == 0
    assert "unknown words, read as <unk>: zebra" in capsys.readouterr().out
