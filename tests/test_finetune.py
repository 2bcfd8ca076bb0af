"""Post-training (cells 4D–4G): each method's must-hold, on `small`, float32, CPU."""

import json
import math
import statistics
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
from model.training.posttrain import (
    FinetuneSettings,
    completion_labels,
    completion_logprobs,
    completion_loss,
    completion_rows,
    tensors,
)
from model.training.posttrain_data import preference_pairs, sft_pairs
from model.training.rlhf import MAX_SAMPLE, RLHF, group_advantages, grpo_loss
from model.training.sft import SFT
from model.training.train import IGNORE, Limits

ROOT = Path(__file__).resolve().parent.parent


def settings(method: str, **kw) -> FinetuneSettings:
    return FinetuneSettings(method=method, **kw)


def answer_logps(module, seqs: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's token log-probabilities, one forward per sequence without padding, left-aligned as TRL keeps
    completions: (B, longest answer) and its mask."""
    width = max(len(ids) - n for ids, n in seqs)
    rows, mask = [], torch.zeros(len(seqs), width)
    for r, (ids, n) in enumerate(seqs):
        logprobs = F.log_softmax(module(torch.tensor([ids])).logits[0].float(), dim=-1)     # (T, vocab)
        picked = logprobs[n - 1: len(ids) - 1].gather(1, torch.tensor(ids[n:])[:, None])[:, 0]
        rows.append(F.pad(picked, (0, width - len(picked))))
        mask[r, : len(picked)] = 1
    return torch.stack(rows), mask


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


def test_a_run_holds_its_own_weights_gradients_and_moments_counted_once():
    """Issue 38: what the Fine-tune page says a run holds. SFT on small trains every parameter: its own float32 weights
    (read from the file, not the shared model's), a gradient and AdamW's two moments each, 16 B a parameter, and
    RoPE's two 128 × 32 tables; DPO adds its frozen reference's weights (4 B a parameter) and tables."""
    sft = SFT(settings("sft", batch_size=2))
    sft.step()
    parameters, tables = sft.total_count(), 2 * 128 * 32 * 4
    assert sft.held_bytes() == 16 * parameters + tables
    dpo = DPO(settings("dpo", batch_size=2, warmup_sft_steps=0))
    dpo.step()
    assert dpo.held_bytes() == 16 * parameters + tables + 4 * parameters + tables


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
    assert trainer.merge_difference() <= 1e-5  # what the page's Merge button says: the same comparison
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


def test_dpo_s_log_probability_of_an_answer_is_the_sum_over_its_tokens_as_trl_s():
    """TRL's DPOTrainer (v1.9.0, trl/trainer/dpo_trainer.py line 1350) sums each completion's token log-probabilities;
    the padded batch gives each answer's sum computed alone (red on the mean over the tokens)."""
    trainer = DPO(settings("dpo", warmup_sft_steps=0))
    seqs = [trainer.encode("what is seven plus two ?", answer) for answer in ("seven plus two is nine .", "nine .")]
    inputs, labels = tensors(completion_rows(seqs, trainer.pad_id), "cpu")
    with torch.no_grad():
        ours = completion_logprobs(trainer.module, inputs, labels)
        alone, _ = answer_logps(trainer.module, seqs)
    assert torch.allclose(ours, alone.sum(1), rtol=1e-5)


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


def test_group_advantages_by_hand():
    """Two groups of four: rewards 0, 0, 0, 4 have mean 1 and, with Bessel's correction, std √(12 / 3) = 2; rewards
    3, 3, 3, 11 have mean 5 and std √(48 / 3) = 4. Red if the std is dropped (÷ 1), taken without Bessel's correction
    (÷ √3, ÷ √12) or over the whole batch."""
    advantages = group_advantages(torch.tensor([0.0, 0, 0, 4, 3, 3, 3, 11]), 4)
    expected = [-1 / 2.0001] * 3 + [3 / 2.0001] + [-2 / 4.0001] * 3 + [6 / 4.0001]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)


def test_grpo_loss_averages_each_answer_over_its_tokens_then_over_the_answers():
    """A hand-worked batch: answer 0 has one token, answer 1 three; the padding holds values that must not count.
    Every answer token has log π = ln 0.5; the reference gives answer 0's token ln 0.25 (k3 = 0.5 − ln 0.5 − 1 =
    0.193147) and agrees with π on answer 1 (k3 = 0). With A = (1, −0.5) and β = 0.1:
        answer 0: −1 + 0.1 · 0.193147 = −0.980685, answer 1: +0.5, loss = (−0.980685 + 0.5) / 2 = −0.240343
    (summing answer 1's three tokens gives +0.259657, TRL's default "dapo" mean over the 4 tokens +0.129828).
    KL logged, TRL's mean over the 4 answer tokens: 0.193147 / 4 = 0.048287 (the mean of the answers' means is
    0.096574). d loss / d log π: answer 0's token (−1 + 0.1 · (1 − 0.5)) / (1 · 2) = −0.475, each of answer 1's
    +0.5 / (3 · 2) = 0.083333, 0 on the padding."""
    half, quarter = math.log(0.5), math.log(0.25)
    logp = torch.tensor([[half, -5.0, -5.0], [half, half, half]], requires_grad=True)
    ref_logp = torch.tensor([[quarter, -1.0, -1.0], [half, half, half]])
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    loss, kl = grpo_loss(torch.tensor([1.0, -0.5]), logp, ref_logp, mask, 0.1)
    assert loss.item() == pytest.approx(-0.240343, abs=1e-6) and kl == pytest.approx(0.048287, abs=1e-6)
    loss.backward()
    assert logp.grad.tolist() == [pytest.approx(row, abs=1e-6) for row in ([-0.475, 0, 0], [1 / 12] * 3)]


def trl_grpo(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor, g: int,
             beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL v1.9.0's GRPOTrainer (trl/trainer/grpo_trainer.py) on answer tokens (B, T), left-aligned, mask 1 on
    them: the advantages of _generate_and_score_completions with scale_rewards="group" (lines 2685–2707, nanstd
    of trl/trainer/utils.py 857–879 with Bessel's correction), then _compute_loss with loss_type="grpo", one
    iteration (old log-probabilities = the current ones detached, line 3037): per token −min(ratio · A, clip(ratio)
    · A) + β · k3 (lines 3066–3121), each answer's mean, the mean over answers (line 3125), and the logged KL, k3's
    mean over every answer token (global_masked_mean, lines 3229–3238). Returns the loss, advantages, KL."""
    grouped = rewards.view(-1, g)
    mean_grouped = grouped.mean(dim=1).repeat_interleave(g)
    variance = ((grouped - grouped.mean(dim=1, keepdim=True)) ** 2).mean(dim=1) * g / (g - 1)
    std_rewards = variance.sqrt().repeat_interleave(g)
    advantages = ((rewards - mean_grouped) / (std_rewards + 1e-4)).unsqueeze(1)
    coef_1 = torch.exp(logps - logps.detach())
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
    per_token_loss = per_token_loss + beta * per_token_kl
    loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    kl = (per_token_kl * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, advantages.squeeze(1), kl


def test_the_rlhf_step_s_loss_is_trl_s_grpo_on_one_small_batch():
    """Two questions, two answers each of different lengths, hand-chosen rewards, a policy moved off its reference
    (so the KL and its gradient are not 0): the loss, the advantages, the KL logged and every gradient agree with
    TRL's formulas computed on each answer alone."""
    trainer = RLHF(settings("rlhf", group_size=2, batch_size=4, beta=0.3, warmup_sft_steps=0))
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for _, p in trainer.named_params:
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    pairs = {p.prompt: p.answer for p in sft_pairs(0)}
    first, second = list(pairs)[:2]
    seqs = [trainer.encode(first, pairs[first]), trainer.encode(first, "."),
            trainer.encode(second, pairs[second]), trainer.encode(second, "nine .")]
    assert len({len(ids) - n for ids, n in seqs}) == 4
    rewards = torch.tensor([1.0, 3.0, 0.5, -0.5])
    loss, advantages, kl = trainer.policy_loss(seqs, rewards)
    loss.backward()
    ours = {name: p.grad.clone() for name, p in trainer.named_params}
    for _, p in trainer.named_params:
        p.grad = None
    logps, mask = answer_logps(trainer.module, seqs)
    with torch.no_grad():
        ref_logps, _ = answer_logps(trainer.reference, seqs)
    trl_loss, trl_advantages, trl_kl = trl_grpo(logps, ref_logps, mask, rewards, 2, 0.3)
    trl_loss.backward()
    assert trl_kl.item() > 1e-3
    # one padded batch against one forward per answer: float32 rounds differently (seen: 7e-6 relative on the KL,
    # 2e-5 on a gradient)
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-4) and kl == pytest.approx(trl_kl.item(), rel=1e-4)
    assert torch.allclose(advantages, trl_advantages, atol=1e-6)
    for name, p in trainer.named_params:
        assert (ours[name] - p.grad).norm() <= 1e-3 * p.grad.norm(), name


@pytest.fixture(scope="module")
def rlhf_start():
    return RLHF(settings("rlhf", warmup_sft_steps=0))


def test_the_reward_model_reads_each_answer_s_last_token(rlhf_start):
    """A padded batch of three lengths: each reward is the head on the final hidden state of that sequence's last
    token (its <eos>), computed on the sequence alone."""
    trainer = rlhf_start
    seqs = [trainer.encode("what is seven plus two ?", answer)[0] for answer in ("seven plus two is nine .", "nine .",
                                                                                   "nine")]
    with torch.no_grad():
        rewards = trainer.score(seqs)
        alone = [trainer.reward_model.head(trainer.reward_model.body(torch.tensor([ids])).hidden[0, -1]).item()
                 for ids in seqs]
    assert rewards.tolist() == pytest.approx(alone, rel=1e-5)


def test_the_held_out_preference_pairs_are_not_training_pairs(rlhf_start):
    held, train = ({(p.chosen, p.rejected) for p in pairs} for pairs in (rlhf_start.held_out, rlhf_start.train_pairs))
    assert len(rlhf_start.held_out) == 96 and not held & train


class Scripted(torch.nn.Module):
    """A stand-in policy: row r of a group says token 5 until its answer has ends[r] tokens, then <eos>, and token 6
    after that, which a finished answer must never take."""

    def __init__(self, n_prompt: int, ends: list[int], eos: int, vocab: int):
        super().__init__()
        self.n_prompt, self.ends, self.eos, self.vocab = n_prompt, ends, eos, vocab

    def forward(self, x):
        said = x.shape[1] - self.n_prompt
        logits = torch.full((x.shape[0], x.shape[1], self.vocab), -1e9)
        for r, end in enumerate(self.ends):
            logits[r, -1, 5 if said < end else self.eos if said == end else 6] = 0
        return type("Out", (), {"logits": logits})


def test_sampled_answers_end_at_their_eos(rlhf_start, monkeypatch):
    """Rows that end at different steps: each answer stops at its own <eos>, the others go on, and a row that never
    ends stops at MAX_SAMPLE tokens."""
    trainer, eos = rlhf_start, rlhf_start.tokenizer.eos_id
    prompt = trainer.prompt_ids("what is seven plus two ?")
    monkeypatch.setattr(trainer, "module", Scripted(len(prompt), [0, 1, 3, 99], eos, trainer.config.vocab_size))
    answers = trainer.sample(prompt, 4, torch.Generator().manual_seed(0))
    assert answers == [[eos], [5, eos], [5, 5, 5, eos], [5] * MAX_SAMPLE]


def test_an_rlhf_step_rewards_and_advantages_each_group_of_answers():
    """One policy step with a length bonus: each answer's reward is the reward model's plus bonus × length, and
    its advantage is (r − mean) / (stdev + 1e-4) over the G answers to its question (statistics.stdev: Bessel)."""
    trainer = RLHF(settings("rlhf", group_size=4, batch_size=8, length_bonus=0.5, warmup_sft_steps=0))
    trainer.reward_step()
    record = trainer.step()
    assert record["reward"] == pytest.approx(record["rm_reward"] + 0.5 * record["length"], abs=1e-5)
    samples = trainer.last_samples
    assert len(samples) == 8
    for group in (samples[:4], samples[4:]):
        assert len({s["prompt"] for s in group}) == 1
        rewards = [s["reward"] for s in group]
        mean, stdev = statistics.mean(rewards), statistics.stdev(rewards)
        assert [s["advantage"] for s in group] == pytest.approx([(r - mean) / (stdev + 1e-4) for r in rewards],
                                                                abs=1e-5)


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
    """The Fine-tune page's button is "Đặt lại" (the glossary's Reset, on every page; no "Làm lại" any more) and it
    has no learning-rate input: its errors say what can be done there."""
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
        assert text("action.reset", "vi") in said and "Làm lại" not in said
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


def test_the_grpo_loss_s_value_is_beta_times_the_kl_averaged_per_answer():
    """What the RLHF tab says of its loss column: the advantages' term is 0 in value (group-centred advantages, a
    ratio of 1), so the value is β × the KL averaged over each answer's tokens, then over the answers, up to rounding
    (made red by a token-weighted KL, or by advantages not centred in their group)."""
    import torch

    from model.training.rlhf import group_advantages, grpo_loss

    torch.manual_seed(0)
    rewards = torch.randn(12)
    advantages = group_advantages(rewards, 4)
    logp, ref_logp = torch.randn(12, 9) - 2, torch.randn(12, 9) - 2
    mask = (torch.rand(12, 9) > 0.3).float()
    mask[:, 0] = 1.0
    loss, _ = grpo_loss(advantages, logp, ref_logp, mask, 0.1)
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3, as grpo_loss takes it
    per_answer = (kl * mask).sum(1) / mask.sum(1)
    assert float(loss) == pytest.approx(0.1 * float(per_answer.mean()), abs=1e-6)
