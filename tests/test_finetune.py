"""Post-training (cells 4D–4G): each method's must-hold, on `small`, float32, CPU."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model.errors import InputError
from model.texts import text
from model.training.dpo import DPO, dpo_loss
from model.training.lora import LoRA, lora_formula
from model.training.posttrain import FinetuneSettings, completion_labels, completion_loss, completion_rows, tensors
from model.training.posttrain_data import preference_pairs, sft_pairs
from model.training.rlhf import RLHF
from model.training.sft import SFT
from model.training.train import IGNORE, Limits

ROOT = Path(__file__).resolve().parent.parent


def settings(method: str, **kw) -> FinetuneSettings:
    return FinetuneSettings(method=method, **kw)


def test_the_data_is_bilingual_and_every_word_is_in_small_s_vocabulary():
    from model.engine.tokenizer import WordTokenizer

    tok = WordTokenizer.load(ROOT / "assets/models/small")
    pairs, prefs = sft_pairs(), preference_pairs()
    assert {p.lang for p in pairs} == {"vi", "en"} and {p.lang for p in prefs} == {"vi", "en"}
    texts = [x for p in pairs for x in (p.prompt, p.answer)] + [x for p in prefs for x in (p.chosen, p.rejected)]
    assert all(not tok.encode(x).unknown for x in texts)
    assert all(p.chosen != p.rejected for p in prefs)
    assert sft_pairs(3) == sft_pairs(3) and sft_pairs(3) != sft_pairs(4)


# -- 4D SFT ---------------------------------------------------------------------------------------------------

def test_sft_labels_ignore_the_prompt_and_the_loss_is_the_answer_tokens_cross_entropy():
    trainer = SFT(settings("sft", batch_size=4))
    _, rows = trainer.batch(0)
    inputs, labels = tensors(rows, "cpu")
    for ids, n, row in zip(rows.ids, rows.n_prompt, rows.labels):
        assert list(row[: n - 1]) == [IGNORE] * (n - 1)             # the prompt's next ids: never learned
        assert list(row[n - 1: len(ids) - 1]) == ids[n:]           # the answer's ids and <eos>: learned
    with torch.no_grad():
        logits = trainer.module(inputs).logits
    loss, n = completion_loss(logits, labels)
    by_hand, count = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[b, t] != IGNORE:
                by_hand += -torch.log_softmax(logits[b, t], -1)[labels[b, t]].item()
                count += 1
    assert n == count == rows.learned and float(loss) == pytest.approx(by_hand / count, abs=1e-5)
    # what the model predicts at the prompt's positions changes nothing
    noisy = logits.clone()
    prompt_positions = torch.zeros_like(labels, dtype=torch.bool)
    for b, n_prompt in enumerate(rows.n_prompt):
        prompt_positions[b, : n_prompt - 1] = True
    noisy[prompt_positions] += torch.randn_like(noisy[prompt_positions]) * 5
    assert float(completion_loss(noisy, labels)[0]) == float(loss)


def test_changing_a_prompt_token_s_label_does_not_change_the_labels():
    ids, n_prompt = [1, 50, 60, 70, 80, 2], 3
    other = [1, 51, 61, 70, 80, 2]  # the prompt's tokens changed, as labels
    assert completion_labels(ids, n_prompt) == completion_labels(other, n_prompt) == [IGNORE, IGNORE, 70, 80, 2]


def test_sft_teaches_small_to_answer_in_the_trained_format():
    trainer = SFT(settings("sft"))
    assert all(answer == "" for _, answer in trainer.before)  # `small` ends a question at once
    records = [trainer.step() for _ in range(40)]
    assert records[-1]["loss"] < records[0]["loss"] / 3
    assert all(r["learned_tokens"] > 0 and r["ignored_tokens"] > 0 for r in records)
    after = dict(trainer.answers())
    assert after["what is two plus three ?"].startswith("two plus three is")
    assert after["con mèo làm gì ?"].startswith("con mèo")


# -- 4E LoRA --------------------------------------------------------------------------------------------------

def test_lora_starts_as_the_base_model_and_counts_its_parameters_by_the_formula():
    from model.engine.llama import Llama

    trainer = LoRA(settings("lora", rank=4, alpha=8))
    base = Llama.load(ROOT / "assets/models/small")
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(trainer.module(ids).logits, base(ids).logits)  # B = 0: exactly the base model
    cfg = base.config
    q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    expected = cfg.num_hidden_layers * 4 * ((cfg.hidden_size + q_out) + (cfg.hidden_size + kv_out))
    assert trainer.trainable_count() == expected == sum(n for *_, n in trainer.formula)
    assert trainer.total_count() == sum(p.numel() for p in base.parameters()) + expected
    everything = LoRA(settings("lora", rank=2, targets="all"))
    assert everything.trainable_count() == sum(n for *_, n in lora_formula(everything.module, 2, everything.targets))
    for rank in (0, 257):  # one range, said the same way at both ends
        with pytest.raises(InputError) as bad:
            LoRA(settings("lora", rank=rank))
        assert bad.value.message("en") == f"Rank r must be between 1 and 256; the value given is {rank}."


def test_lora_merged_equals_unmerged_and_peft_loads_the_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    trainer = LoRA(settings("lora"))
    for _ in range(5):
        trainer.step()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        ours = trainer.module(ids).logits
        merged = trainer.merged()(ids).logits
    assert (ours - merged).abs().max() <= 1e-5
    files = dict(trainer.save(tmp_path / "out"))
    assert {"model.safetensors", "config.json", "tokenizer.json", "adapter/adapter_config.json",
            "adapter/adapter_model.safetensors"} <= set(files)
    base = AutoModelForCausalLM.from_pretrained(ROOT / "assets/models/small", dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(base, tmp_path / "out" / "adapter").eval()
    with torch.no_grad():
        theirs = wrapped(ids).logits
    assert (theirs - ours).abs().max() <= 1e-5
    # and the merged checkpoint loads in transformers with the same logits
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (plain(ids).logits - ours).abs().max() <= 1e-5


# -- 4G DPO ---------------------------------------------------------------------------------------------------

def trl_sigmoid_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
    """TRL 1.16.0, trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss, f_divergence_type "reverse_kl", loss_type
    "sigmoid", label_smoothing 0 (lines 1350–1388 and 1582 of the wheel), on the same log-probabilities."""
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta_score = chosen_logratios - rejected_logratios
    per_sequence_loss = -F.logsigmoid(beta * delta_score)
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    return per_sequence_loss, chosen_rewards, rejected_rewards


def test_dpo_loss_is_trl_s_on_the_same_log_probabilities():
    g = torch.Generator().manual_seed(0)
    pi_c, pi_r, ref_c, ref_r = (torch.randn(16, generator=g) * 10 - 30 for _ in range(4))
    ours = dpo_loss(pi_c, pi_r, ref_c, ref_r, 0.3)
    theirs = trl_sigmoid_loss(pi_c, pi_r, ref_c, ref_r, 0.3)
    for a, b in zip(ours[:3], theirs):
        assert torch.allclose(a, b, atol=1e-6)
    assert torch.allclose(ours[0], -torch.log(torch.sigmoid(ours[3])), atol=1e-6)  # loss = −log σ(margin)


def test_dpo_starts_at_ln2_and_learns_the_preferences_within_50_steps():
    trainer = DPO(settings("dpo"))
    first = trainer.step()
    assert abs(first["loss"] - math.log(2)) <= 1e-6 and first["margin"] == 0 and first["accuracy"] == 0
    assert all(abs(m) <= 1e-6 for m in trainer.last_margins)  # every pair, not only the mean
    records = [first] + [trainer.step() for _ in range(49)]
    for r in records:
        assert r["margin"] == pytest.approx(r["reward_chosen"] - r["reward_rejected"], abs=1e-5)
    assert max(r["accuracy"] for r in records) > 0.9
    assert sum(r["accuracy"] for r in records[-10:]) / 10 > 0.9
    for beta in (0, 5e-5):  # one range for DPO's β, said the same way below it
        with pytest.raises(InputError) as bad:
            DPO(settings("dpo", beta=beta))
        assert bad.value.message("en") == f"β must be between 0.0001 and 100; the value given is {beta}."


# -- 4F RLHF --------------------------------------------------------------------------------------------------

def test_rlhf_reward_model_then_the_policy_with_a_kl_that_starts_at_zero():
    trainer = RLHF(settings("rlhf"))
    with pytest.raises(InputError) as bad:
        trainer.step()
    assert bad.value.code == "finetune_reward_first"
    for _ in range(trainer.settings.reward_steps):
        trainer.reward_step()
    assert trainer.held_out_accuracy() >= 0.8
    records = [trainer.step() for _ in range(50)]
    assert records[0]["kl"] == 0 and all("kl" in r and r["kl"] >= 0 for r in records)
    first, last = (sum(r["reward"] for r in part) / 10 for part in (records[:10], records[-10:]))
    assert last > first
    assert len(trainer.last_samples) == trainer.settings.batch_size


def test_rlhf_takes_beta_0_a_policy_gradient_without_the_kl_leash():
    """β = 0 is TRL's GRPO default (GRPOConfig.beta = 0.0): the KL is still measured, no longer pulled on. With
    A normalised within each group, the loss −mean(A) is about 0 at every step."""
    trainer = RLHF(settings("rlhf", beta=0.0))
    trainer.reward_step()
    records = [trainer.step() for _ in range(3)]
    assert [r["beta"] for r in records] == [0.0] * 3 and records[0]["kl"] == 0 and records[-1]["kl"] > 0
    assert all(abs(r["loss"]) < 1e-3 for r in records)
    with pytest.raises(InputError) as bad:
        settings("rlhf", beta=-0.01).check(Limits(2000, 3))
    assert bad.value.code == "finetune_setting"


# -- bad input and the limits -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, code", [({"method": "dpo", "model": "smollm2"}, "finetune_model"),
                                      ({"method": "sft", "model": "micro"}, "finetune_model"),
                                      ({"method": "rlhf", "beta": -1.0}, "finetune_setting"),
                                      ({"method": "sft", "batch_size": 0}, "finetune_setting")])
def test_bad_settings_are_one_sentence(kw, code):
    with pytest.raises(InputError) as bad:
        FinetuneSettings(**kw).check(Limits(2000, 3))
    assert bad.value.code == code and bad.value.message("vi") and bad.value.message("en").endswith(".")


def test_the_session_s_step_limit_holds_and_names_the_fine_tune_page_s_reset():
    """The Fine-tune page's button is "Đặt lại" (the Train page's is "Làm lại") and it has no learning-rate input:
    its errors say what can be done there."""
    trainer = SFT(settings("sft", batch_size=2), bound=Limits(2, 3))
    trainer.step()
    trainer.step()
    with pytest.raises(InputError) as bad:
        trainer.step()
    assert bad.value.code == "finetune_step_limit" and trainer.steps_done == 2
    rlhf = RLHF(settings("rlhf"), bound=Limits(1, 3))
    rlhf.reward_step()
    with pytest.raises(InputError) as limit:
        rlhf.reward_step()
    assert limit.value.code == "finetune_step_limit"
    for code in ("finetune_step_limit", "finetune_not_finite"):
        said = text("error." + code, "vi")
        assert text("finetune.reset", "vi") in said and text("train.reset", "vi") not in said
        assert "lower the learning rate" not in text("error." + code, "en")  # the page has no such input


def test_empty_data_is_refused():
    with pytest.raises(InputError) as bad:
        completion_rows([], 0)
    assert bad.value.code == "finetune_empty"


# -- the command line -------------------------------------------------------------------------------------------

def finetune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model", "finetune", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_cli_lora_json_same_seed_same_numbers_and_a_folder_trace_loads(tmp_path):
    args = ["--method", "lora", "--model", "small", "--steps", "3", "--seed", "1", "--json"]
    first = finetune(*args, "--save", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    again = json.loads(finetune(*args).stdout)
    assert [s["loss"] for s in report["steps"]] == [s["loss"] for s in again["steps"]]
    assert {"trainable_params", "total_params", "before", "after"} <= report.keys()
    assert all({"step", "loss", "learned_tokens", "ignored_tokens"} <= s.keys() for s in report["steps"])
    assert (tmp_path / "a" / "adapter" / "adapter_model.safetensors").is_file()
    trace = subprocess.run([sys.executable, "-m", "model", "trace", "--model", str(tmp_path / "a"), "--prompt",
                            "con mèo làm gì ?", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**__import__("os").environ, "DECODE_LAB_ALLOW_PATHS": "1"})
    assert trace.returncode == 0, trace.stderr


def test_cli_bad_input_is_one_sentence_and_exit_status_2():
    bad = finetune("--method", "dpo", "--beta", "0", "--steps", "2")
    assert bad.returncode == 2 and bad.stderr.strip() == "β must be between 0.0001 and 100; the value given is 0.0."
    assert finetune("--method", "rlhf", "--model", "smollm2").returncode == 2
