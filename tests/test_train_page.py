"""The Train page under AppTest (one step, N steps, save, side-by-side, memory) and in a real browser."""

import math
import re
from html import escape
from pathlib import Path

import pytest
from apptest import open_app
from conftest import wait_idle
from streamlit.runtime.scriptrunner_utils.exceptions import StopException
from streamlit.testing.v1 import AppTest

from model.texts import number_in, text
from model.training.train import Trainer
from ui.pages import page

TIMEOUT = 120
PAGE = "app_pages/train.py"


def open_train(lang: str = "vi", model: str = "micro") -> AppTest:
    return open_app(PAGE, TIMEOUT, lang=lang, device="cpu", train_model=model)


def click(at: AppTest, key: str) -> AppTest:
    at.button(key=key).click().run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    return at


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_train_page_before_and_after_one_step(lang):
    at = open_train(lang)
    assert at.session_state["train_trainer"].steps_done == 0
    assert metric(at, "Số câu" if lang == "vi" else "Sentences") == "4"
    click(at, "train_one")
    trainer = at.session_state["train_trainer"]
    assert trainer.steps_done == 1
    assert metric(at, "Loss") == number_in(trainer.last.loss, lang, ".4f")
    assert metric(at, "ln V") == number_in(math.log(8), lang, ".4f")  # micro: 8 tokens, ln 8 = 2.0794 (2,0794)
    assert any("<td>-100</td>" in h.proto.body for h in at.get("html"))  # the ignored label value in the 1C grid
    # 1C a position a row (its positions side by side ran past a 1280 screen): position 0's input and its label,
    # the next input
    batch, tok = trainer.last.batch, trainer.tokenizer
    row = [0, int(batch.inputs[0, 0]), escape(tok.token(int(batch.inputs[0, 0]))), int(batch.labels[0, 0])]
    assert int(batch.labels[0, 0]) == int(batch.inputs[0, 1])
    assert any("<tr>" + "".join(f"<td>{v}</td>" for v in row) in h.proto.body for h in at.get("html"))


def test_every_cell_of_the_registry_has_its_anchor_on_the_page():
    at = click(open_train(), "train_one")
    anchors = {h.proto.anchor for h in at.subheader}
    assert set(page("train").cells.values()) <= anchors
    assert set(page("train").cells) == {"1A", "1B", "1C", "2A", "2B", "2C", "2D", "3A", "3B", "3C", "3D", "3E",
                                        "4A", "4B", "4C"}


def test_run_n_steps_then_reset():
    at = open_train()
    at.number_input(key="train_n").set_value(5).run()
    click(at, "train_run")
    trainer = at.session_state["train_trainer"]
    assert trainer.steps_done == 5 and [p.step for p in trainer.history] == [1, 2, 3, 4, 5]
    click(at, "train_reset")
    assert at.session_state["train_trainer"].steps_done == 0


def test_settings_apply_from_the_next_step_and_a_new_seed_starts_again():
    at = click(open_train(), "train_one")
    at.number_input(key="train_clip").set_value(0.3).run()
    click(at, "train_one")
    trainer = at.session_state["train_trainer"]
    assert trainer.steps_done == 2 and trainer.last.clip == 0.3
    at.number_input(key="train_seed").set_value(5).run()
    assert at.session_state["train_trainer"].steps_done == 0


def test_save_checkpoint_records_it_for_the_session_and_compares_greedy_answers():
    at = open_train("en")
    at.number_input(key="train_n").set_value(3).run()
    click(at, "train_run")
    click(at, "train_save")
    checkpoints = at.session_state["session_checkpoints"]
    assert list(checkpoints) == ["ckpt1-micro-random-seed0-step3"]
    folder = Path(checkpoints["ckpt1-micro-random-seed0-step3"])
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    click(at, "train_compare_run")
    (bundled, bundled_text), (saved, _) = at.session_state["train_compare"]
    assert (bundled, saved) == ("micro", "ckpt1-micro-random-seed0-step3")
    assert bundled_text == "cá"  # the course example: greedy on "ăn" answers "cá", then <eos>


def test_memory_measure_shows_both_savers():
    at = click(click(open_train("en"), "train_one"), "train_measure")
    fp32, bf16, ckpt = at.session_state["train_memory"][0]
    assert ckpt.loss == pytest.approx(fp32.loss, abs=1e-6) and bf16.loss != fp32.loss
    assert at.session_state["train_trainer"].steps_done == 1  # measuring trains nothing


@pytest.mark.parametrize(("model", "embedding", "lm_head"), [
    ("small", "embedding (shared with the LM head)", False),  # tie_word_embeddings: true
    ("micro", "embedding", True),                             # false: the LM head is a group of its own
])
def test_the_embedding_is_called_the_lm_head_only_when_the_two_are_tied(model, embedding, lm_head):
    at = click(open_train("en", model), "train_one")
    assert at.session_state["train_trainer"].config.tie_word_embeddings is not lm_head
    for table in (at.dataframe[0], at.dataframe[1]):  # 3B's gradient norms, 3D's update ratios
        groups = list(table.value["Parameter group"])
        assert groups[0] == embedding and ("LM head" in groups) is lm_head


@pytest.mark.parametrize("init", ["random", "bundled"])
def test_the_first_loss_is_said_to_be_near_ln_v_only_from_random_weights(init):
    at = click(open_app(PAGE, TIMEOUT, lang="en", device="cpu", train_model="micro", train_init=init), "train_one")
    trainer = at.session_state["train_trainer"]
    (explain,) = [m.value for m in at.markdown if m.value.startswith("Loss = the mean of −ln p(label)")]
    assert ("the first loss is close to ln V" in explain) is (init == "random")
    assert ("well below ln V" in explain) is (init == "bundled")
    if init == "bundled":  # micro's bundled weights: 0.41 against ln 8 = 2.08
        assert trainer.last.loss < trainer.ln_vocab / 2


def test_bad_settings_are_a_sentence():
    at = open_train("en")
    at.number_input(key="train_seq_len").set_value(30).run()  # micro's context holds 16 positions
    assert not at.exception
    assert at.error and "Sequence length must be between 1 and 16" in at.error[0].value


@pytest.mark.browser
@pytest.mark.parametrize("lang", ["vi", "en"])
def test_browser_one_step_shows_the_loss(app_server, browser_page, artifacts, lang):
    page_, words = browser_page, {"vi": ("Một bước", "Làm lại"), "en": ("One step", "Reset")}[lang]
    page_.goto(f"{app_server}/train?lang={lang}")
    page_.get_by_role("button", name=words[0]).first.click()
    from playwright.sync_api import expect

    loss = page_.locator('[data-testid="stMetric"]').filter(has_text=re.compile(r"^Loss")).first
    expect(loss).to_contain_text(re.compile(r"\d+[.,]\d{4}"), timeout=90_000)  # "–" until the first step
    value = float(re.search(r"\d+[.,]\d{4}", loss.inner_text()).group().replace(",", "."))
    assert abs(value - math.log(525)) < 0.1  # small from random weights: near ln V
    assert page_.locator("[data-testid='stException']").count() == 0
    wait_idle(page_)
    page_.screenshot(path=str(artifacts / f"train-1440x900-{lang}.png"))
    page_.set_viewport_size({"width": 1280, "height": 720})
    page_.screenshot(path=str(artifacts / f"train-1280x720-{lang}.png"))


@pytest.mark.browser
def test_browser_cancel_keeps_the_steps_done(app_server, browser_page):
    page_ = browser_page
    page_.goto(f"{app_server}/train?lang=en")
    page_.get_by_label("N steps").fill("500")
    page_.get_by_label("N steps").press("Enter")
    page_.get_by_role("button", name="Run 500 steps").click()
    page_.get_by_text(re.compile(r"Step \d+/500")).first.wait_for(timeout=90_000)  # the progress bar moves
    page_.get_by_role("button", name="Cancel").click()
    stopped = page_.get_by_text(re.compile(r"Stopped after \d+ of 500 steps")).first
    stopped.wait_for(timeout=90_000)
    done = int(re.search(r"after (\d+) of", stopped.inner_text()).group(1))
    assert 1 <= done < 500
    assert page_.get_by_text(f"Steps done: {done} ").count() == 1


def test_a_saved_checkpoint_is_a_sidebar_model_that_the_decode_page_runs():
    """3E → 5A: the checkpoint this session saved is listed in the sidebar (for this session) and decodes."""
    at = click(click(open_train(model="micro"), "train_one"), "train_save")
    name = next(iter(at.session_state["session_checkpoints"]))
    assert any(name in label for label in at.selectbox(key="model_name.vi").options)
    at.selectbox(key="model_name.vi").set_value(name).run()
    at.switch_page("app_pages/decode.py")
    at.run()
    assert at.session_state["prompt_mode"] == "ids"  # a micro checkpoint starts as micro does: its ids [1, 3]
    click(at, "run_prefill")
    gen = at.session_state["generation"]
    assert at.session_state["generation_for"][0] == name and gen.prompt_ids == [1, 3]
    assert gen.cache.length == 2


def visit_decode_and_come_back(at: AppTest) -> AppTest:
    at.switch_page("app_pages/decode.py")
    at.run()
    assert not at.exception, at.exception
    at.switch_page(PAGE)
    at.run()
    assert not at.exception, at.exception
    return at


def test_settings_and_the_run_survive_a_visit_to_another_page():
    at = open_train("en")
    for key, value in (("train_seed", 5), ("train_batch", 3), ("train_clip", 0.3), ("train_n", 7)):
        at.number_input(key=key).set_value(value).run()
    trainer = click(click(at, "train_one"), "train_one").session_state["train_trainer"]
    visit_decode_and_come_back(at)
    assert not at.error, [e.value for e in at.error]
    assert [at.number_input(key=k).value for k in ("train_seed", "train_batch", "train_clip", "train_n")] == \
        [5, 3, 0.3, 7]
    assert at.session_state["train_trainer"] is trainer and trainer.steps_done == 2
    click(at, "train_one")
    assert trainer.steps_done == 3 and len(trainer.last.batch.sentence_ids) == 3 and trainer.last.clip == 0.3


def test_reset_during_a_run_of_n_steps_says_the_run_is_gone(monkeypatch):
    at = open_train("en")
    at.number_input(key="train_n").set_value(5).run()
    step = Trainer.step

    def step_then_click(self):
        report = step(self)
        if self.steps_done == 2:
            raise StopException()  # the script run ends here, as a click during the Run ends it
        return report

    monkeypatch.setattr(Trainer, "step", step_then_click)
    at.button(key="train_run").click().run()
    old = at.session_state["train_trainer"]
    assert old.steps_done == 2
    click(at, "train_reset")  # the click
    said = " ".join(i.value for i in at.info)
    assert "The run of 5 steps stopped because you pressed Reset" in said and "Stopped after" not in said
    assert at.session_state["train_trainer"] is not old and at.session_state["train_trainer"].steps_done == 0


def test_the_step_limit_is_said_and_a_run_of_n_says_it_runs_fewer(monkeypatch):
    monkeypatch.setenv("DECODE_LAB_TRAIN_MAX_STEPS", "7")
    at = click(open_train("en"), "train_one")
    at.number_input(key="train_n").set_value(50).run()
    assert at.button(key="train_run").label == "Run 6 steps"
    assert any("has 6 steps left before its limit of 7" in c.value for c in at.caption)
    click(at, "train_run")
    assert at.session_state["train_trainer"].steps_done == 7
    assert at.button(key="train_one").disabled and at.button(key="train_run").disabled
    assert any("press Reset to train again" in i.value for i in at.info)


def test_saves_at_the_same_step_are_two_checkpoints_and_the_one_in_use_is_kept(monkeypatch):
    monkeypatch.setenv("DECODE_LAB_TRAIN_MAX_CHECKPOINTS", "2")
    at = click(click(open_train("en"), "train_one"), "train_save")
    first = next(iter(at.session_state["session_checkpoints"]))
    at.selectbox(key="model_name.en").set_value(first).run()  # the sidebar runs the first checkpoint
    for _ in range(3):  # Reset and save at step 1 again, three times: the limit is 2
        click(at, "train_reset")
        click(click(at, "train_one"), "train_save")
    names = list(at.session_state["session_checkpoints"])
    assert len(names) == 2 and names[0] == first and at.session_state["model_name"] == first
    assert len({Path(p).name for p in at.session_state["session_checkpoints"].values()}) == 2


def sidebar_to(page_, title: str) -> None:
    page_.locator("[data-testid='stSidebarNav']").get_by_role("link", name=title).click()


@pytest.mark.browser
def test_browser_settings_and_run_survive_a_visit_with_a_non_default_seed(app_server, browser_page):
    """Issue 28: seed 5, batch 3, two steps, Decode in the sidebar, back to Train: the same run goes on."""
    page_ = browser_page
    page_.goto(f"{app_server}/train?lang=en")
    wait_idle(page_)
    page_.locator(".st-key-train_settings summary").click()  # the hyper-parameters are folded above the key figure
    page_.get_by_label("Seed", exact=True).wait_for(timeout=30_000)
    for label, value in (("Seed", "5"), ("Batch (rows)", "3")):
        box = page_.get_by_label(label, exact=True)
        box.fill(value)
        box.press("Enter")
        wait_idle(page_)
    for done in (1, 2):
        page_.get_by_role("button", name="One step").click()
        page_.get_by_text(f"Steps done: {done} ").wait_for(timeout=90_000)
    sidebar_to(page_, "Decode")
    page_.get_by_role("heading", name=text("decode.title", "en")).wait_for(timeout=90_000)
    sidebar_to(page_, "Train")
    page_.get_by_text("Steps done: 2 ").wait_for(timeout=90_000)
    assert page_.get_by_label("Seed", exact=True).input_value() == "5"
    assert page_.get_by_label("Batch (rows)", exact=True).input_value() == "3"
    page_.get_by_role("button", name="One step").click()
    page_.get_by_text("Steps done: 3 ").wait_for(timeout=90_000)
    page_.get_by_text("This step's batch holds 3 sentences", exact=False).first.wait_for()
    assert page_.locator("[data-testid='stException']").count() == 0
    assert page_.get_by_text("Something unexpected went wrong").count() == 0


def test_the_curve_downloads_as_csv_with_a_row_per_step():
    import dataclasses

    from model.training.train import HistoryPoint
    from ui.widgets import csv_of

    at = click(click(open_train("en"), "train_one"), "train_one")
    assert at.get("download_button")
    history = at.session_state["train_trainer"].history
    lines = csv_of(history).splitlines()  # the rows as the page passes them, dataclasses
    assert lines[0].split(",") == [f.name for f in dataclasses.fields(HistoryPoint)] and len(lines) == 3
    assert float(lines[2].split(",")[1]) == history[1].loss
