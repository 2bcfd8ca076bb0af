"""Post-training on gemma3 (Gemma 3 270M, native, float32, CPU): SFT with the embedding frozen, LoRA on its q_proj and
v_proj (PEFT's own default targets for gemma3_text), the PEFT adapter in transformers, the page, the command line
and two real-browser runs. Skipped, with the reason, when the fetched model is missing."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.engine.gemma3 import Gemma3
from model.training.lora import LoRA
from model.training.posttrain import FinetuneSettings, completion_loss, tensors
from model.training.posttrain_data import GEMMA3_FACTS, VI_NUMBERS, gemma3_pairs
from model.training.sft import SFT
from model.training.train import IGNORE
from model.weights.catalog import fetched_folder

ROOT = Path(__file__).resolve().parent.parent
FOLDER = fetched_folder("gemma3")
pytestmark = [pytest.mark.gemma3, pytest.mark.skipif(
    not (FOLDER / "source.json").is_file(),
    reason=f"Gemma 3 270M is not fetched into {FOLDER}: run `python -m model fetch gemma3` (./dev test does)")]

PARAMETERS = 268_098_176
EMBEDDING = 262_144 * 640
# r · (d_in + d_out) · 18 layers at r = 4: q_proj 640 → 4 heads × 256, v_proj 640 → 1 KV head × 256
LORA_QV = [("q_proj", 640, 1024, 4 * (640 + 1024) * 18), ("v_proj", 640, 256, 4 * (640 + 256) * 18)]
IDS = torch.tensor([[2, 1214, 237417, 79162, 5042, 33154, 11774, 3244]])  # <bos>Thủ đô của Việt Nam là


def gemma3(method: str, **kw) -> FinetuneSettings:
    return FinetuneSettings(method=method, model="gemma3", batch_size=2, **kw)


def test_the_pairs_are_vietnamese_and_their_sums_are_right():
    pairs = gemma3_pairs(0)
    assert {p.lang for p in pairs} == {"vi"} and gemma3_pairs(1) != pairs
    facts = {f"Hỏi: {q}\nĐáp:": " " + a for q, a in GEMMA3_FACTS}
    for p in pairs:
        if p.prompt in facts:
            assert p.answer == facts[p.prompt]
        else:
            a, b, total = re.fullmatch(r"Hỏi: (.+) cộng (.+) bằng mấy\?\nĐáp:", p.prompt).groups() + (
                p.answer.rsplit(" bằng ", 1)[1][:-1],)
            assert VI_NUMBERS.index(a.lower()) + VI_NUMBERS.index(b) == VI_NUMBERS.index(total)


def test_sft_trains_all_but_the_tied_embedding_and_its_loss_is_the_answer_tokens_cross_entropy():
    trainer = SFT(gemma3("sft"))
    assert isinstance(trainer.module, Gemma3)
    assert trainer.total_count() == PARAMETERS and trainer.trainable_count() == PARAMETERS - EMBEDDING == 100_326_016
    assert "model.embed_tokens.weight" not in dict(trainer.named_params)
    _, rows = trainer.batch(0)
    inputs, labels = tensors(rows, "cpu")
    with torch.no_grad():
        logits = trainer.module(inputs).logits
    loss, n = completion_loss(logits, labels)
    picked = [-torch.log_softmax(logits[b, t].double(), -1)[labels[b, t]].item()
              for b in range(labels.shape[0]) for t in range(labels.shape[1]) if labels[b, t] != IGNORE]
    assert n == len(picked) == rows.learned and float(loss) == pytest.approx(sum(picked) / n, abs=1e-5)
    embedding = trainer.module.model.embed_tokens.weight.clone()
    layer = trainer.module.model.layers[0].self_attn.q_proj.weight.clone()
    record = trainer.step()
    assert record["loss"] == pytest.approx(float(loss), abs=1e-5)  # step 1's batch is batch(0)
    assert torch.equal(trainer.module.model.embed_tokens.weight, embedding)
    assert not torch.equal(trainer.module.model.layers[0].self_attn.q_proj.weight, layer)


def test_lora_step_0_is_the_base_model_and_counts_q_and_v_by_the_formula():
    trainer = LoRA(gemma3("lora", rank=4))
    base = Gemma3.load(FOLDER)
    with torch.no_grad():
        assert torch.equal(trainer.module(IDS).logits, base(IDS).logits)  # B = 0: exactly the base model
    assert trainer.formula == LORA_QV
    assert trainer.trainable_count() == 184_320 == sum(n for *_, n in LORA_QV)
    assert trainer.total_count() == PARAMETERS + 184_320 and trainer.adapter_bytes() == 4 * 184_320


def test_lora_merged_equals_unmerged_and_peft_loads_the_adapter_onto_transformers_gemma3(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import Gemma3ForCausalLM

    trainer = LoRA(gemma3("lora"))
    for _ in range(2):
        trainer.step()
    with torch.no_grad():
        ours = trainer.module(IDS).logits
        merged = trainer.merged()(IDS).logits
    # float32 rounding alone moves gemma3's logits (|logit| up to ~36) by ~4e-5 from a float64 forward, so the two
    # summation orders agree to 1e-5 of the largest logit, not to 1e-5 absolute
    assert (ours - merged).abs().max() <= 1e-5 * ours.abs().max()
    files = dict(trainer.save(tmp_path / "out"))
    assert {"model.safetensors", "config.json", "tokenizer.json", "adapter/adapter_config.json",
            "adapter/adapter_model.safetensors"} <= set(files)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (FOLDER / "config.json").read_text())  # the saved config is the base's, key for key
    base = Gemma3ForCausalLM.from_pretrained(FOLDER, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        moved = (base(IDS).logits - ours).abs().max()
    wrapped = peft.PeftModel.from_pretrained(base, tmp_path / "out" / "adapter").eval()
    with torch.no_grad():
        theirs = wrapped(IDS).logits
    # 1e-3: what the native base model and transformers' agree to (test_gemma3.py); the adapter moves the logits far
    # more than that, so an adapter PEFT reads wrongly (other keys, scaling, targets) cannot pass
    assert moved > 1e-2 and (theirs - ours).abs().max() <= 1e-3
    del wrapped, base
    plain = Gemma3ForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager",
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        assert (plain(IDS).logits - ours).abs().max() <= 1e-3


def test_cli_sft_on_gemma3_one_step_json():
    run = subprocess.run([sys.executable, "-m", "model", "finetune", "--method", "sft", "--model", "gemma3",
                          "--steps", "1", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["model"] == "gemma3" and report["settings"]["batch_size"] == 4
    assert report["steps"][0]["learned_tokens"] > 0 and report["steps"][0]["ignored_tokens"] > 0
    assert [b["prompt"] for b in report["before"]] == ["Hỏi: Thủ đô của Việt Nam là thành phố nào?\nĐáp:",
                                                       "Hỏi: Ba cộng bốn bằng mấy?\nĐáp:"]


def test_page_lora_on_gemma3_then_use_this_model_on_decode():
    from apptest import click, open_app
    from test_finetune_page import open_tab

    at = open_tab(open_app("app_pages/finetune.py", 600, lang="en", device="cpu"), "lora")
    at.segmented_control(key="ft_lora_model").set_value("gemma3").run()
    assert at.number_input(key="ft_lora_batch").value == 4  # the model's own batch size
    click(at, "ft_lora_one")
    trainer = at.session_state["ft_trainers"]["lora"]
    assert trainer.settings.model == "gemma3" and trainer.steps_done == 1 and not at.error
    assert any("q_proj" in h.proto.body and "4 × (640 + 1,024) × 18" in h.proto.body for h in at.get("html"))
    click(at, "ft_lora_use")
    (name,) = at.session_state["session_checkpoints"]
    assert name == "ckpt1-gemma3-lora-seed0-step1" and at.session_state["checkpoint_bases"][name] == "gemma3"
    at.switch_page("app_pages/decode.py").run()
    at.selectbox(key="model_name.en").set_value(name).run()  # as the sidebar: the model's own example prompt
    for key in ("run_prefill", "next"):
        click(at, key)
    gen = at.session_state["generation"]
    assert not at.error and gen.cache.length == len(gen.prompt_ids) + 1
    assert gen.prompt_ids == IDS[0].tolist()  # gemma3's own example prompt, its tokenizer


def test_page_sft_on_gemma3_says_what_is_frozen_in_both_languages():
    from apptest import click, open_app

    from model.texts import text

    at = open_app("app_pages/finetune.py", 600, lang="vi", device="cpu")
    at.segmented_control(key="ft_sft_model").set_value("gemma3").run()
    assert text("finetune.data_gemma3", "vi") in [c.value for c in at.caption]
    click(at, "ft_sft_one")
    said = text("finetune.sft_frozen", "vi").format(
        model="gemma3", rows="262.144", cols="640", frozen="167.772.160", saved="2.013.265.920",
        trained="100.326.016", total="268.098.176", share="37,4%")  # Vietnamese marks (it once said 262,144)
    assert said in [m.value for m in at.markdown]


# -- real browsers ------------------------------------------------------------------------------------------------

def choose_gemma3(page, lang: str) -> None:
    from conftest import choose_sidebar_model, wait_idle

    from model.texts import text

    choose_sidebar_model(page, text("model.gemma3", lang))
    wait_idle(page, 180_000)


@pytest.mark.browser
def test_decode_on_gemma3_in_vietnamese_in_a_real_browser(app_server, browser_page, artifacts):
    from conftest import wait_for_charts, wait_idle
    from playwright.sync_api import expect

    from model.texts import text

    page = browser_page
    page.goto(f"{app_server}/decode?lang=vi")
    wait_idle(page)
    choose_gemma3(page, "vi")
    # the choice's rerun brings the model's own example prompt (it may start after wait_idle has returned)
    expect(page.get_by_label(text("prompt.label", "vi"), exact=True)).to_have_value("Thủ đô của Việt Nam là",
                                                                                   timeout=180_000)
    page.locator(".st-key-decode_settings summary").first.click()  # the page opens on a run, its form folded
    for name in ("Chạy prefill", "Bước tiếp", "Bước tiếp"):
        page.get_by_role("button", name=name, exact=False).first.click()
        wait_idle(page, 180_000)
    page.get_by_text(re.compile(r"cache: 10 vị trí")).first.wait_for(timeout=120_000)
    verdict = page.get_by_text(re.compile(r"^(KHỚP|LỆCH):")).first
    verdict.wait_for(timeout=120_000)
    assert verdict.inner_text().startswith("KHỚP:")
    assert page.locator("[data-testid='stException']").count() == 0
    wait_for_charts(page)
    page.screenshot(path=str(artifacts / "decode-gemma3-vi.png"))


@pytest.mark.browser
def test_finetune_lora_one_step_on_gemma3_in_english_in_a_real_browser(app_server, browser_page, artifacts):
    from conftest import retried, wait_idle
    from playwright.sync_api import expect

    from model.texts import text

    page = browser_page
    page.goto(f"{app_server}/finetune?lang=en")
    wait_idle(page)
    page.get_by_role("tab", name="4E LoRA").click()
    panel = page.locator("[role='tabpanel']:visible")
    # only the open tab is drawn: its controls come with the rerun the click starts, folded in its Settings
    panel.locator(".st-key-ft_lora_settings summary").click(timeout=120_000)
    panel.locator(".st-key-ft_lora_model").get_by_text("gemma3", exact=True).click(timeout=120_000)
    expect(panel.locator(".st-key-ft_lora_batch input")).to_have_value("4", timeout=120_000)  # gemma3's batch
    wait_idle(page)
    button, waiting = panel.locator(".st-key-ft_lora_one button"), panel.get_by_text(text("finetune.press_step", "en"))
    def step() -> None:  # a click that lands while the model's rerun is still drawing can be lost
        button.click()
        wait_idle(page, 300_000)

    retried(step, lambda: not waiting.count(), "LoRA's first step on gemma3")
    panel.get_by_text("gemma3 · step 1/").first.wait_for(timeout=300_000)
    panel.get_by_text("184,320").first.wait_for()
    assert page.locator("[data-testid='stException']").count() == 0
    assert page.locator("[data-testid='stAlertContentError']").count() == 0
    page.set_viewport_size({"width": 1440, "height": 2600})
    page.screenshot(path=str(artifacts / "finetune-lora-gemma3-en.png"), full_page=True)
