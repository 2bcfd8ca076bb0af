"""The training engine against PyTorch's own: labels, loss, clipping, AdamW, accumulation, checkpoint, CLI."""

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model.errors import InputError
from model.tools.cli import main
from model.training import train
from model.training.train import IGNORE, CheckpointStore, Trainer, TrainSettings
from ui.map_view import load_cells

MICRO = TrainSettings(model="micro", seed=0, batch_size=4, seq_len=4)
SMALL = TrainSettings(model="small", seed=0, batch_size=6, seq_len=10)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_micro_labels_are_the_inputs_shifted_by_one_with_padding_ignored():
    trainer = Trainer(MICRO)
    # <pad>=0 <bos>=1 mèo=2 ăn=3 cá=4 uống=5 <eos>=6 sữa=7
    assert trainer.corpus.encoded == [[1, 3, 4, 6], [1, 2, 3, 4, 6], [1, 5, 7, 6], [1, 2, 5, 7, 6]]
    expected = {0: ([1, 3, 4, 6], [3, 4, 6, IGNORE]), 1: ([1, 2, 3, 4], [2, 3, 4, 6]),
                2: ([1, 5, 7, 6], [5, 7, 6, IGNORE]), 3: ([1, 2, 5, 7], [2, 5, 7, 6])}
    batch = trainer.batch(0)
    assert batch.inputs.shape == batch.labels.shape == (4, 4)
    for row, sentence in enumerate(batch.sentence_ids):
        assert (batch.inputs[row].tolist(), batch.labels[row].tolist()) == expected[sentence]
    cut = train.sample_batch(trainer.corpus, 8, 3, 0, seed=1, step=0)
    for row, sentence in enumerate(cut.sentence_ids):
        assert cut.labels[row].tolist() == expected[sentence][1][:3]  # "mèo ăn cá" -> 2, 3, 4: no <eos> label


def test_batches_depend_on_seed_and_step_only():
    trainer = Trainer(SMALL)
    assert np.array_equal(trainer.batch(5).rows, Trainer(SMALL).batch(5).rows)
    assert not np.array_equal(trainer.batch(5).rows, trainer.batch(6).rows)


def test_activation_checkpointing_gives_the_same_logits_and_gradients():
    trainer = Trainer(SMALL)
    ids = torch.from_numpy(trainer.batch(0).inputs)
    grads = []
    for checkpointing in (False, True):
        trainer.module.zero_grad(set_to_none=True)
        logits = trainer.module(ids, activation_checkpointing=checkpointing).logits
        logits.square().mean().backward()
        grads.append((logits.detach(), [p.grad.clone() for _, p in trainer.named_params]))
    (plain, plain_grads), (ckpt, ckpt_grads) = grads
    assert torch.equal(plain, ckpt)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(plain_grads, ckpt_grads))


def test_loss_equals_cross_entropy_on_shifted_labels_with_padding_ignored():
    trainer = Trainer(SMALL)
    batch = trainer.batch(0)
    assert (batch.labels == IGNORE).any()  # this batch has padding
    with torch.no_grad():
        logits = trainer.module(torch.from_numpy(batch.inputs)).logits  # (B, T, V)
    labels = torch.from_numpy(batch.labels)
    vocab = logits.shape[-1]
    reference = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))  # ignore_index=-100
    pad_ignored = F.cross_entropy(logits.reshape(-1, vocab), torch.from_numpy(batch.rows[:, 1:]).reshape(-1),
                                  ignore_index=0)  # the same, ignoring the pad id itself
    report = trainer.step()
    assert report.loss == pytest.approx(reference.item(), abs=1e-6)
    assert report.loss == pytest.approx(pad_ignored.item(), abs=1e-6)
    per_position = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="none")
    per_position = per_position.reshape(labels.shape)
    real = batch.labels != IGNORE
    assert np.allclose(report.token_loss[real], per_position.numpy()[real], atol=1e-6)
    assert np.isnan(report.token_loss[~real]).all()
    assert report.logits_shape == (6, 10, 525)


def test_random_init_loss_is_near_ln_vocab():
    report = Trainer(SMALL).step()
    assert abs(report.loss - math.log(525)) < 0.1  # ln 525 = 6.263


def test_clipping_equals_clip_grad_norm():
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn_like(a) * 3
        b.grad = a.grad.clone()
    before, after = train.clip_gradients(ours, 1.0)
    reference = torch.nn.utils.clip_grad_norm_(theirs, 1.0, foreach=False)
    assert before == pytest.approx(reference.item(), rel=1e-6) and before > 1
    assert after == pytest.approx(1.0, abs=1e-5)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a.grad, b.grad, atol=1e-7, rtol=0)
    small = [a.grad.clone() for a in ours]
    assert train.clip_gradients(ours, 100.0)[1] == pytest.approx(1.0, abs=1e-5)  # below the threshold: unchanged
    assert all(torch.allclose(a.grad, g, atol=1e-7, rtol=0) for a, g in zip(ours, small))


def test_adamw_step_equals_torch_adamw_on_the_same_gradients():
    trainer = Trainer(replace(SMALL, weight_decay=0.1))
    reference = Trainer(replace(SMALL, weight_decay=0.1))
    params = [p for _, p in reference.named_params]
    torch_adamw = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                     {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                    lr=1.0, foreach=False)
    for step, lr in enumerate([1e-3, 3e-3, 2e-3]):
        for t in (trainer, reference):
            t.module.zero_grad(set_to_none=True)
            t.forward_backward(t.batch(step), t.settings)
        for g in torch_adamw.param_groups:
            g["lr"] = lr
        trainer.optimizer.step(lr)
        torch_adamw.step()
        for (name, ours), theirs in zip(trainer.named_params, params):
            assert torch.equal(ours, theirs), name


def test_accumulated_micro_batches_give_the_big_batch_gradient():
    big = Trainer(replace(SMALL, batch_size=24, accum_steps=1))
    accumulated = Trainer(replace(SMALL, batch_size=6, accum_steps=4))
    batch = big.batch(0)
    assert np.array_equal(batch.rows, accumulated.batch(0).rows)  # the same 24 rows, in 4 micro-batches of 6
    _, _, counts = accumulated.forward_backward(batch, accumulated.settings)
    big.forward_backward(batch, big.settings)
    assert len(counts) == 4 and sum(counts) == int((batch.labels != IGNORE).sum())
    for (name, a), (_, b) in zip(accumulated.named_params, big.named_params):
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-4), name
    report = accumulated.step()
    weighted = sum(loss * n for loss, n in zip(report.micro_losses, report.micro_tokens)) / sum(report.micro_tokens)
    # both are float32 sums of the same losses in different orders (torch's over the batch, numpy's per micro-batch):
    # 1.1e-6 apart (2 ulps of 6.3) on one Intel host; an unweighted mean of the micro-batches is off by far more
    assert report.loss == pytest.approx(weighted, rel=1e-6)


def test_group_norms_and_clipping_report():
    report = Trainer(replace(SMALL, clip=0.5)).step()
    assert math.sqrt(sum(n * n for n in report.group_grad_norms)) == pytest.approx(report.grad_norm, rel=1e-5)
    assert report.grad_norm > 0.5 and report.grad_norm_clipped == pytest.approx(0.5, abs=1e-5)
    assert report.groups[0] == ("embed", None) and report.groups[-1] == ("final_norm", None)
    assert len(report.groups) == 2 + 3 * 4  # embed (tied LM head), 4 layers × (attention, MLP, norms), final norm
    assert all(r > 0 for r in report.update_ratios)


def test_learning_rate_schedule():
    s = TrainSettings(lr=1e-3, warmup_steps=10, schedule_steps=110, min_lr_ratio=0.1)
    assert train.lr_at(0, s) == pytest.approx(1e-4)
    assert train.lr_at(9, s) == pytest.approx(1e-3)
    assert train.lr_at(10, s) == pytest.approx(1e-3)
    assert train.lr_at(60, s) == pytest.approx(0.55e-3)  # half-way down the cosine
    assert train.lr_at(110, s) == pytest.approx(1e-4)
    assert train.lr_at(500, s) == pytest.approx(1e-4)


def test_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(SMALL)
    trainer.step()
    trainer.step()
    files = trainer.save(tmp_path / "ckpt")
    assert [name for name, _ in files] == ["config.json", "model.safetensors", "tokenizer.json"]
    assert all(size == (tmp_path / "ckpt" / name).stat().st_size for name, size in files)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", trust_remote_code=False, use_safetensors=True)
    ids = torch.from_numpy(trainer.batch(7).inputs)
    with torch.no_grad():
        ours = trainer.module(ids).logits
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4


def test_checkpoint_store_keeps_at_most_its_limit(tmp_path):
    trainer = Trainer(MICRO)
    store = CheckpointStore(limit=2)
    folders = []
    for _ in range(3):
        trainer.step()
        name, _ = store.save(trainer)
        folders.append(store.saved[name])
    assert list(store.saved) == ["ckpt2-micro-random-seed0-step2", "ckpt3-micro-random-seed0-step3"]
    assert not folders[0].exists() and folders[2].is_dir()
    root = store.root
    del store
    assert not root.exists()  # the session's folder goes with the store


def test_bundled_init_trains_a_copy():
    from model.engine.llama import Llama
    from model.weights.catalog import resolve_path

    shipped = Llama.load(resolve_path("micro")).state_dict()
    trainer = Trainer(replace(MICRO, init="bundled"))
    assert all(torch.equal(v, trainer.module.state_dict()[k]) for k, v in shipped.items())
    trainer.step()
    assert not torch.equal(shipped["model.embed_tokens.weight"], trainer.module.model.embed_tokens.weight)
    again = Llama.load(resolve_path("micro")).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in shipped.items())


def test_checkpointing_and_bfloat16_measured_side_by_side():
    trainer = Trainer(replace(SMALL, batch_size=16, seq_len=16, accum_steps=2))
    fp32, bf16, ckpt = train.measure_memory(trainer)
    assert (bf16.bf16_autocast, ckpt.activation_checkpointing) == (True, True)
    assert ckpt.loss == pytest.approx(fp32.loss, abs=1e-6)  # recomputing gives the same numbers
    assert 0 < abs(bf16.loss - fp32.loss) < 0.05
    assert ckpt.activation_bytes < fp32.activation_bytes
    assert bf16.activation_bytes < fp32.activation_bytes
    assert all(p.grad is None for _, p in trainer.named_params) and trainer.steps_done == 0
    # the figure cell 4A cites: autocast keeps norms, softmax, the loss and the residual stream in float32
    mib = [f"{r.activation_bytes / 2**20:.2f}" for r in (fp32, bf16)]
    share = f"−{1 - bf16.activation_bytes / fp32.activation_bytes:.0%}".replace("%", " %")
    assert f"{mib[0]} → {mib[1]} MiB ({share})" == "11.67 → 9.76 MiB (−16 %)"
    assert "11.67 → 9.76 MiB (−16 %)" in next(c for c in load_cells() if c["id"] == "4A")["en"]["does"]


def test_step_limit_and_bad_settings_are_input_errors():
    trainer = Trainer(MICRO, bound=replace(train.limits(), max_steps=1))
    trainer.step()
    with pytest.raises(InputError) as limit:
        trainer.step()
    assert limit.value.code == "train_step_limit"
    with pytest.raises(InputError) as bad:
        Trainer(replace(MICRO, seq_len=40))  # micro's context holds 16 positions
    assert bad.value.code == "train_setting"
    assert bad.value.message("en") == "Sequence length must be between 1 and 16; the value given is 40."
    assert bad.value.message("vi") == "Độ dài chuỗi phải nằm trong khoảng 1–16; giá trị đã cho là 40."


def test_a_save_at_the_same_step_after_reset_gets_its_own_name_and_the_one_in_use_stays():
    store = CheckpointStore(limit=2)
    first, _ = store.save(trainer_after(MICRO, 1))
    second, _ = store.save(trainer_after(replace(MICRO, lr=1e-2), 1))  # Reset, another learning rate, step 1 again
    assert first != second and store.saved[first].is_dir() and store.saved[second].is_dir()
    third, _ = store.save(trainer_after(MICRO, 2), in_use=first)  # the sidebar runs the first: the second goes
    assert list(store.saved) == [first, third]


def trainer_after(settings: TrainSettings, steps: int) -> Trainer:
    trainer = Trainer(settings)
    for _ in range(steps):
        trainer.step()
    return trainer


def test_a_loss_that_is_not_finite_refuses_the_step_and_keeps_the_weights(monkeypatch):
    trainer = trainer_after(MICRO, 1)
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    monkeypatch.setattr(train, "token_losses", lambda logits, labels: logits[..., 0] * float("inf"))
    with pytest.raises(InputError) as blown:
        trainer.step()
    assert blown.value.code == "train_not_finite" and blown.value.details["step"] == 2
    assert "Step 2 was not applied" in blown.value.message("en")
    assert trainer.steps_done == 1 and len(trainer.history) == 1
    assert all(torch.equal(v, trainer.module.state_dict()[k]) for k, v in before.items())


def cli_curve(capsys, *args) -> dict:
    assert main(["train", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_same_seed_same_curve(capsys, tmp_path):
    first = cli_curve(capsys, "--model", "small", "--steps", "4", "--seed", "3", "--batch", "8")
    again = cli_curve(capsys, "--model", "small", "--steps", "4", "--seed", "3", "--batch", "8")
    other = cli_curve(capsys, "--model", "small", "--steps", "4", "--seed", "4", "--batch", "8")
    losses = [s["loss"] for s in first["steps"]]
    assert losses == [s["loss"] for s in again["steps"]]
    assert losses != [s["loss"] for s in other["steps"]]
    assert [s["step"] for s in first["steps"]] == [1, 2, 3, 4]
    assert set(first["steps"][0]) == {"step", "loss", "grad_norm", "grad_norm_clipped", "lr", "ms"}
    assert first["clip"] == 1.0 and first["checkpoint"] is None
    assert first["model"]["vocab_size"] == 525 and first["model"]["n_kv_heads"] == 2
    saved = cli_curve(capsys, "--model", "micro", "--steps", "2", "--save", str(tmp_path / "m"))
    assert saved["checkpoint"] == str(tmp_path / "m") and (tmp_path / "m" / "model.safetensors").is_file()


@pytest.mark.parametrize(("args", "setting"), [
    (["--seed", "-1"], "Seed"), (["--seed", "99999999999999999999"], "Seed"), (["--lr", "inf"], "Learning rate"),
    (["--lr", "1e300"], "Learning rate"), (["--lr", "1e6", "--clip", "100"], "Learning rate"),
    (["--lr", "nan"], "Learning rate"), (["--clip", "0"], "Clip"), (["--steps", "0"], "Steps"),
    (["--steps", "-1"], "Steps"), (["--batch", "0"], "Batch"), (["--seq-len", "99"], "Sequence length"),
])
def test_cli_bad_settings_name_the_setting_before_any_step(capsys, args, setting):
    assert main(["train", "--model", "micro", "--steps", "3", *args]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith(setting), out.err


@pytest.mark.parametrize("case", ["empty", "file", "not_empty", "unwritable"])
def test_cli_a_bad_save_target_is_said_before_training_and_nothing_is_written(capsys, tmp_path, case):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    target = {"empty": "", "file": str(tmp_path / "a-file"), "not_empty": str(tmp_path / "full"),
              "unwritable": "/proc/decode-lab/ck"}[case]
    assert main(["train", "--model", "micro", "--steps", "2", "--save", target]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "--save" in out.err, out.err  # no step line printed
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a-file", "full", "notes.txt"]
    assert not Path("/proc/decode-lab").exists()


def test_cli_overwrite_replaces_the_checkpoint_files_of_a_folder(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    saved = cli_curve(capsys, "--model", "micro", "--steps", "2", "--save", str(tmp_path), "--overwrite")
    assert saved["checkpoint"] == str(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors", "notes.txt",
                                                         "tokenizer.json"]


def test_cli_a_loss_that_blows_up_stops_with_a_sentence_and_valid_json(capsys, monkeypatch, tmp_path):
    real = train.token_losses
    calls = []

    def blows_up_at_the_third_step(logits, labels):
        calls.append(1)
        return real(logits, labels) * (float("nan") if len(calls) >= 3 else 1.0)

    monkeypatch.setattr(train, "token_losses", blows_up_at_the_third_step)
    assert main(["train", "--model", "micro", "--steps", "5", "--json", "--save", str(tmp_path / "ck")]) == 1
    out = capsys.readouterr()

    def no_nan(name):
        raise AssertionError(f"{name} is not JSON")

    report = json.loads(out.out, parse_constant=no_nan)
    assert [s["step"] for s in report["steps"]] == [1, 2]
    assert report["stop_reason"] == "not_finite" and report["checkpoint"] is None
    assert report["error"].startswith("Step 3 was not applied")
    assert report["error"].endswith("try a smaller --lr.")  # not the page's "press Reset"
    assert out.err.startswith("Step 3 was not applied") and "Nothing was saved" in out.err
    assert not (tmp_path / "ck").exists()
