"""The transformers backend: tiny random GPT-2, Qwen2 (GQA, q/k/v biases) and GPT-NeoX built in-process, no download."""

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    GPT2Config,
    GPTNeoXConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from model.engine.generate import back, encode_prompt, start, step
from model.engine.hf import HFModel
from model.engine.loading import load_model
from model.engine.sampling import SamplingSettings
from model.engine.steps import decode, max_abs_logit_diff, recompute
from model.errors import InputError
from model.tools import cli
from model.weights.catalog import ROOT, list_models

TOL = 1e-4
GREEDY = SamplingSettings()
WORDS = ["<unk>", "<bos>", "<eos>", *"the cat sat on a mat con mèo ngồi trên tấm thảm".split()]
CORPUS = ["the cat sat on the mat", "con mèo ngồi trên tấm thảm", "a cat, a mat."] * 20
VOCAB = 320  # ≥ both tokenizers below
SHAPE = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64,
             max_position_embeddings=64, vocab_size=VOCAB, initializer_range=0.2)
CONFIGS = {
    "gpt2": lambda: GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=VOCAB,
                               bos_token_id=0, eos_token_id=0, initializer_range=0.2),
    "qwen2": lambda: Qwen2Config(**SHAPE, num_key_value_heads=2, bos_token_id=1, eos_token_id=2),
    "gpt_neox": lambda: GPTNeoXConfig(**SHAPE, bos_token_id=1, eos_token_id=2),
}


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2's kind: byte-level BPE, no <unk>, no <bos> added."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level with <unk>, and <bos> added in front of every text."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>")


def save_tiny(folder, kind: str):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS[kind]()).save_pretrained(folder)  # safetensors
    # transformers picks the tokenizer class by model type; Qwen2's rebuilds a byte-level BPE, as in real checkpoints
    (word_tokenizer() if kind == "gpt_neox" else byte_level_tokenizer()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", autouse=True)
def paths_allowed():
    """These tests load folders by path, which only the operator's DECODE_LAB_ALLOW_PATHS=1 allows."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DECODE_LAB_ALLOW_PATHS", "1")
        env.delenv("DECODE_LAB_ALLOW_DOWNLOADS", raising=False)
        yield


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for kind in CONFIGS:
        save_tiny(root / kind, kind)
    return root


@pytest.fixture(scope="module")
def loaded(models_dir):
    return {kind: load_model(str(models_dir / kind), "cpu") for kind in CONFIGS}


def prompt_for(model):
    return model.tokenizer.encode("the cat sat on").ids


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_every_step_matches_recompute_with_the_native_trace_fields(kind, loaded):
    model = loaded[kind]
    info = model.info
    assert isinstance(model, HFModel) and info.backend == "transformers"
    assert info.n_kv_heads == (2 if kind == "qwen2" else 4) and info.d_head == 8 and info.context_length == 64
    gen = start(model, prompt_for(model), GREEDY, max_new_tokens=8)
    n = len(gen.prompt_ids)
    assert np.stack([gen.steps[0].heads(layer) for layer in range(2)]).shape == (2, 4, n, n)
    for _ in range(6):
        trace = step(model, gen)
        assert trace.attention.shape == (2, 4, 1, trace.cache_len)
        assert max_abs_logit_diff(trace, recompute(model, gen.ids[: trace.cache_len])) <= TOL
        assert trace.cache_bytes == trace.cache_bytes_formula  # 2 × layers × the model's own n_kv_heads × ...
        assert trace.cache_bytes_reserved == trace.cache_bytes  # DynamicCache concatenates: no buffer ahead
        assert gen.cache.layer_shape(1) == (1, info.n_kv_heads, trace.cache_len, info.d_head)
        assert gen.cache.layer_bytes(1) * info.n_layers == trace.cache_bytes


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_back_crops_and_decoding_again_gives_the_same_logits(kind, loaded):
    model = loaded[kind]
    gen = start(model, prompt_for(model), GREEDY, max_new_tokens=8)
    for _ in range(3):
        step(model, gen)
    last = gen.steps[-1]
    assert back(model, gen)
    assert gen.cache.length == gen.steps[-1].cache_len == last.cache_len - 1
    # crop keeps views of the longer tensors: the positions held shrink, the memory they sit in does not
    assert gen.cache.nbytes() == gen.steps[-1].cache_bytes < gen.cache.nbytes_reserved() == last.cache_bytes
    again = step(model, gen)
    np.testing.assert_allclose(again.logits, last.logits, atol=1e-5, rtol=0)
    assert again.cache_bytes == last.cache_bytes


def test_attention_is_float16_for_the_whole_cache(loaded):
    model = loaded["gpt2"]
    cache = model.new_cache()
    _, attention = model.forward([5, 6, 7], cache, output_attentions=True)
    assert attention.dtype == torch.float16 and attention.shape == (2, 4, 3, 3)
    _, attention = model.forward([8], cache, output_attentions=True)
    assert attention.shape == (2, 4, 1, 4)
    np.testing.assert_allclose(attention.float().sum(-1).numpy(), 1.0, atol=1e-2)


def test_out_of_memory_half_way_leaves_the_session_unchanged(loaded):
    """Layer 0 has appended when layer 1 runs out of memory: crop gives the position back."""
    model = loaded["gpt2"]
    cache = model.new_cache()
    ids = [5, 6, 7]
    model.forward(ids, cache, output_attentions=False)
    before = (cache.length, cache.nbytes())

    def out_of_memory(*_):
        raise torch.OutOfMemoryError("simulated")

    hook = model.module.transformer.h[1].register_forward_pre_hook(out_of_memory)
    try:
        with pytest.raises(InputError) as bad:
            decode(model, cache, 8)
    finally:
        hook.remove()
    assert bad.value.code == "out_of_memory"
    assert (cache.length, cache.nbytes()) == before
    trace = decode(model, cache, 8)
    assert max_abs_logit_diff(trace, recompute(model, [*ids, 8])) <= TOL


def test_tokenizer_adapters(loaded):
    gpt2, neox = loaded["gpt2"].tokenizer, loaded["gpt_neox"].tokenizer
    enc = gpt2.encode("con mèo ngồi")
    assert enc.unknown == [] and enc.ids[0] != gpt2.bos_id  # byte-level: nothing unknown, no <bos> added
    assert gpt2.decode(enc.ids) == "con mèo ngồi"
    assert "".join(enc.tokens).startswith("con")
    enc = neox.encode("the dog sat")
    assert enc.ids[0] == neox.bos_id == 1 and enc.unknown == ["dog"]
    assert enc.tokens == ["<bos>", "the", "<unk>", "sat"]
    assert neox.decode(enc.ids) == "the sat"  # special tokens skipped
    assert encode_prompt(loaded["gpt_neox"], "cat").ids == [1, WORDS.index("cat")]


def refused(name, **kwargs) -> InputError:
    with pytest.raises(InputError) as bad:
        load_model(str(name), "cpu", **kwargs)
    for lang in ("vi", "en"):
        assert str(name) in bad.value.message(lang)
    return bad.value


def test_refusals_say_why(tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({
        "model_type": "my_custom_lm", "auto_map": {"AutoModelForCausalLM": "modeling_custom.MyLM"}}))
    assert refused(remote).code == "remote_code_refused"
    BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32).save_pretrained(
        tmp_path / "bert")
    assert refused(tmp_path / "bert").code == "not_causal_lm"
    assert refused(tmp_path / "missing").code == "model_not_found"
    pickled = tmp_path / "pickled"
    GPT2Config(n_layer=1, n_head=2, n_embd=8).save_pretrained(pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"")
    assert refused(pickled).code == "no_safetensors"
    assert refused("decode-lab-tests/no-such-model").code == "download_disabled"


def test_by_default_only_the_listed_models_load(models_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("DECODE_LAB_MODELS_DIR", str(models_dir))
    monkeypatch.setenv("DECODE_LAB_CACHE", str(tmp_path))  # no fetched model listed
    monkeypatch.delenv("DECODE_LAB_ALLOW_PATHS")
    assert list_models(str(models_dir)) == ["small", "micro", "gpt2", "gpt_neox", "qwen2"]
    assert refused(models_dir / "gpt2").code == "path_not_allowed"
    assert refused("gpt2-medium").code == "path_not_allowed"  # a Hub id is not even looked up
    assert load_model("gpt2", "cpu").info.backend == "transformers"
    assert load_model("micro", "cpu").info.backend == "native"


def test_cli_trace_json_on_a_tiny_gpt2(models_dir, capsys):
    code = cli.main(["trace", "--model", str(models_dir / "gpt2"), "--prompt-ids", "5,6,7", "--max-new-tokens", "4",
                     "--json", "--check", "--device", "cpu"])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    assert {"name", "n_layers", "n_heads", "n_kv_heads", "d_head", "dtype", "device"} <= report["model"].keys()
    assert {"text", "ids", "tokens", "unknown"} <= report["prompt"].keys()
    assert report["counts"] == {"prompt_len": 3, "new_tokens": 4, "positions_with_cache": 6,
                                "positions_without_cache": 18}
    assert {"ttft_ms", "itl_ms"} <= report["timing"].keys() and report["output"]["stop_reason"] == "max_new_tokens"
    for s in report["steps"]:
        queries = 3 if s["phase"] == "prefill" else 1
        assert s["attention_shape"] == [2, 4, queries, s["cache_len"]]
        assert s["cache_bytes"] == s["cache_bytes_formula"] and s["max_abs_logit_diff"] <= TOL
        assert {"index", "input_ids", "positions", "chosen_id", "chosen_token", "top", "ms"} <= s.keys()


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_the_live_pages_run_a_transformers_model(models_dir, kind):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60)
    at.session_state["model_name"] = "custom"
    at.session_state["model_path"] = str(models_dir / kind)
    at.session_state["device"] = "cpu"
    at.session_state["prompt_text"] = "the cat sat"
    at.run()
    at.switch_page("app_pages/decode.py").run()
    at.button(key="run_prefill").click().run()
    gen = at.session_state["generation"]
    assert gen is not None, [e.value for e in at.error]
    before = gen.cache.length
    at.button(key="next").click().run()
    assert gen.cache.length == before + 1
    assert gen.steps[-1].attention.dtype == np.float16  # what a session keeps per step, halved
    for page in ("prefill", "cache", "flash"):
        at.switch_page(f"app_pages/{page}.py").run()
        assert not at.exception, (page, at.exception)
    assert at.warning  # the flash page needs per-layer Q, K, V, which only the native model exposes
