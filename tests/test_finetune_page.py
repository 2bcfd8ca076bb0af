"""The Fine-tune page under AppTest: a step on each tab, Run N, Reset, Use this model, the widgets' bounds, a setting
that needs a new run, a Run that a click stops, the step limit, and each sentence that depends on the run's state."""

import math

import pytest
from apptest import APP, open_app
from streamlit.runtime.scriptrunner_utils.exceptions import StopException
from streamlit.testing.v1 import AppTest

from model.texts import text
from model.training.posttrain import FinetuneSettings
from model.training.sft import SFT
from model.training.train import limits
from model.weights.catalog import fetched_folder
from ui.pages import page

TIMEOUT = 240
PAGE = "app_pages/finetune.py"


def open_page(lang: str = "vi") -> AppTest:
    return open_app(PAGE, TIMEOUT, lang=lang, device="cpu")


def open_tab(at: AppTest, method: str) -> AppTest:
    """Only the open tab is drawn (lazy tabs), as after a click on its label."""
    at.session_state["ft_tab"] = text("finetune.tab_" + method, "en")  # the same label in both languages
    at.run()
    return at


def click(at: AppTest, key: str) -> AppTest:
    method = key.split("_")[1]
    if at.session_state["ft_tab"] != text("finetune.tab_" + method, "en"):
        open_tab(at, method)
    at.button(key=key).click().run()
    assert not at.exception, at.exception
    return at


def trainer(at: AppTest, method: str):
    return at.session_state["ft_trainers"].get(method)


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_one_step_on_each_tab_and_the_anchors_of_the_map(lang):
    at = open_page(lang)
    anchors = {m: open_tab(at, m) and {h.proto.anchor for h in at.subheader} for m in ("sft", "lora", "rlhf", "dpo")}
    assert set().union(*anchors.values()) >= set(page("finetune").cells.values())
    assert len(at.button(key="ft_dpo_one").proto.shortcut) and not [b for b in at.button if b.key == "ft_sft_one"]
    for method in ("sft", "lora", "dpo"):
        click(at, f"ft_{method}_one")
        assert trainer(at, method).steps_done == 1 and not at.error
    assert abs(trainer(at, "dpo").history[0]["loss"] - math.log(2)) <= 1e-6
    open_tab(at, "rlhf")
    assert at.button(key="ft_rlhf_one").disabled and trainer(at, "rlhf") is None  # the reward model steps first
    click(at, "ft_rlhf_rm_one")
    click(at, "ft_rlhf_one")
    assert trainer(at, "rlhf").steps_done == 1 and trainer(at, "rlhf").history[0]["kl"] == 0
    assert trainer(at, "sft").steps_done == 1  # the other tabs keep their runs


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_a_link_with_a_tab_opens_that_tab_once(lang):
    """The map's link to 4F (finetune?tab=rlhf#cell-4f, opened in a new browser tab): the RLHF tab and its anchor,
    then the query is gone, so a later click on another tab is not overruled."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.session_state["lang"] = lang
    at.query_params["tab"] = "rlhf"
    at.run()
    at.switch_page(PAGE)
    at.run()
    assert not at.exception, at.exception
    assert at.session_state["ft_tab"] == text("finetune.tab_rlhf", lang)
    assert [h.proto.anchor for h in at.subheader] == ["cell-4f"]
    assert "tab" not in at.query_params
    open_tab(at, "dpo")
    assert [h.proto.anchor for h in at.subheader] == ["cell-4g"]


def test_run_n_then_reset_and_use_this_model():
    at = open_page("en")
    at.number_input(key="ft_sft_n").set_value(3).run()
    click(at, "ft_sft_run")
    assert [r["step"] for r in trainer(at, "sft").history] == [1, 2, 3]
    click(at, "ft_sft_use")
    assert list(at.session_state["session_checkpoints"]) == ["ckpt1-small-sft-seed0-step3"]
    assert at.session_state["checkpoint_bases"]["ckpt1-small-sft-seed0-step3"] == "small"
    click(at, "ft_sft_reset")
    assert trainer(at, "sft") is None


WIDGET_SETTINGS = {"ft_lora_rank": ("lora", "rank"), "ft_lora_alpha": ("lora", "alpha"),
                   "ft_dpo_beta": ("dpo", "beta"), "ft_rlhf_beta": ("rlhf", "beta"),
                   "ft_rlhf_bonus": ("rlhf", "length_bonus"), "ft_sft_batch": ("sft", "batch_size"),
                   "ft_rlhf_batch": ("rlhf", "batch_size"), "ft_sft_seed": ("sft", "seed")}


def test_every_input_offers_only_values_the_trainer_accepts():
    """Both ends of each number box and slider pass the trainer's own check (rank 0 and DPO's β = 0 were offered
    and refused); RLHF's β goes down to 0, no KL leash (TRL's GRPO default)."""
    at = open_page("en")
    for key, (method, name) in WIDGET_SETTINGS.items():
        open_tab(at, method)
        widget = next(w for w in (*at.number_input, *at.slider) if w.key == key)
        for end in (widget.min, widget.max):
            FinetuneSettings(method=method, **{name: end}).check(limits())
    assert open_tab(at, "rlhf").slider(key="ft_rlhf_beta").min == 0


def test_rlhf_with_beta_0_steps_and_says_nothing_twice():
    at = open_tab(open_page("en"), "rlhf")
    at.slider(key="ft_rlhf_beta").set_value(0.0).run()
    click(at, "ft_rlhf_rm_one")
    click(at, "ft_rlhf_one")
    assert not at.error and trainer(at, "rlhf").settings.beta == 0 and trainer(at, "rlhf").steps_done == 1
    assert chart_keys(at) == ["ft_rlhf_rm_chart", "ft_rlhf_chart"]  # the reward model's chart stays


def chart_keys(at: AppTest) -> list[str]:
    """The keys of the Plotly charts on the page, top to bottom (an element id ends with its key)."""
    return [e.proto.id.rsplit("-", 1)[-1] for e in at.get("plotly_chart")]


def texts(at: AppTest) -> list[str]:
    return [e.value for kind in (at.info, at.warning, at.error, at.caption, at.markdown) for e in kind]


def test_a_runs_own_memory_is_said_and_reset_frees_it():
    """Issue 38: the run's own copy (its weights read from the file, their gradients, AdamW's moments) is counted on
    the page, and after Reset nothing holds the trainer any more (breaks if the page kept a reference to it)."""
    import gc
    import weakref

    at = open_page("en")
    click(at, "ft_sft_one")
    run = trainer(at, "sft")
    said = text("finetune.held", "en").format(mb=f"{run.held_bytes() / 1e6:.1f}")
    assert said in texts(at) and run.held_bytes() > 16 * run.total_count()
    gone = weakref.ref(run)
    del run
    click(at, "ft_sft_reset")
    gc.collect()
    assert trainer(at, "sft") is None and gone() is None and said not in texts(at)


def test_a_new_seed_model_rank_or_alpha_waits_for_reset_and_says_so():
    """SFT at step 3, seed 0 → 1: the run and its steps stay, One step goes on with it, a warning names the old and
    the new setting; seed back to 0 and the warning goes; a new model waits too; Reset starts the new run."""
    at = open_page("en")
    at.number_input(key="ft_sft_n").set_value(3).run()
    click(at, "ft_sft_run")
    run = trainer(at, "sft")
    at.number_input(key="ft_sft_seed").set_value(1).run()
    waits = text("finetune.new_run_waits", "en")
    assert [w.value for w in at.warning] == [waits.format(was="Seed = 0", now="Seed = 1")]
    click(at, "ft_sft_one")
    assert trainer(at, "sft") is run and run.steps_done == 4 and run.settings.seed == 0
    at.number_input(key="ft_sft_seed").set_value(0).run()
    assert not at.warning and trainer(at, "sft") is run
    at.segmented_control(key="ft_sft_model").set_value("smollm2").run()
    assert [w.value for w in at.warning] == [waits.format(was="Model = small", now="Model = smollm2")]
    assert trainer(at, "sft") is run and run.steps_done == 4
    at.segmented_control(key="ft_sft_model").set_value("small").run()
    open_tab(at, "lora")
    click(at, "ft_lora_one")
    lora = trainer(at, "lora")
    at.number_input(key="ft_lora_rank").set_value(8).run()
    at.number_input(key="ft_lora_alpha").set_value(16.0).run()
    assert [w.value for w in at.warning] == [waits.format(was="Rank r = 4, alpha = 8", now="Rank r = 8, alpha = 16")]
    click(at, "ft_lora_one")
    assert trainer(at, "lora") is lora and lora.steps_done == 2 and lora.settings.rank == 4
    click(at, "ft_lora_reset")
    click(at, "ft_lora_one")
    assert trainer(at, "lora").settings.rank == 8 and trainer(at, "lora").steps_done == 1 and not at.warning
    assert trainer(at, "sft") is run


def stop_at_step(monkeypatch, stop_at: int) -> None:
    """SFT's step `stop_at` ends the script run as a click during a Run does (Streamlit stops the script)."""
    step = SFT.step

    def step_then_click(self):
        record = step(self)
        if self.steps_done == stop_at:
            raise StopException()
        return record

    monkeypatch.setattr(SFT, "step", step_then_click)


def test_a_run_stopped_by_a_new_model_keeps_its_steps_and_by_reset_says_they_are_gone(monkeypatch):
    at = open_page("en")
    at.number_input(key="ft_sft_n").set_value(5).run()
    stop_at_step(monkeypatch, 2)
    at.button(key="ft_sft_run").click().run()
    run = trainer(at, "sft")
    at.segmented_control(key="ft_sft_model").set_value("smollm2").run()  # the click that stopped the Run
    assert [i.value for i in at.info] == [text("finetune.run_stopped", "en").format(done=2, asked=5)]
    assert trainer(at, "sft") is run and run.steps_done == 2 and len(at.warning) == 1
    at.segmented_control(key="ft_sft_model").set_value("small").run()
    stop_at_step(monkeypatch, 4)
    at.button(key="ft_sft_run").click().run()
    click(at, "ft_sft_reset")  # Reset stopped this Run
    assert [i.value for i in at.info] == [text("finetune.run_reset", "en").format(asked=5),
                                          text("finetune.press_step", "en")]
    assert trainer(at, "sft") is None


def test_after_run_n_one_chart_and_at_the_limit_the_buttons_say_why(monkeypatch):
    monkeypatch.setenv("DECODE_LAB_TRAIN_MAX_STEPS", "4")
    at = open_page("en")
    at.number_input(key="ft_sft_n").set_value(3).run()
    click(at, "ft_sft_run")
    assert chart_keys(at) == ["ft_sft_chart"]  # the live chart of the Run is gone
    assert at.button(key="ft_sft_run").label == text("finetune.run_n", "en").format(n=1)
    assert text("finetune.run_capped", "en").format(left=1, most=4, asked=3) in texts(at)
    click(at, "ft_sft_run")
    assert trainer(at, "sft").steps_done == 4
    assert at.button(key="ft_sft_one").disabled and at.button(key="ft_sft_run").disabled
    assert [i.value for i in at.info] == [text("error.finetune_step_limit", "en").format(steps=4)]


def html_of(at: AppTest) -> str:
    return "".join(e.proto.body for e in at.get("html"))


def test_rlhf_starts_with_the_reward_model_and_its_status_counts_both_kinds_of_step():
    """M9: the hint names the reward model's step and the policy's buttons wait for it; M10: the status counts the
    reward model's steps, which the limit counts too."""
    at = open_tab(open_page("en"), "rlhf")
    assert [i.value for i in at.info] == [text("finetune.press_reward_step", "en").format(warmup=40)]
    assert at.button(key="ft_rlhf_one").disabled and at.button(key="ft_rlhf_run").disabled
    click(at, "ft_rlhf_rm_one")
    click(at, "ft_rlhf_rm_one")
    click(at, "ft_rlhf_one")
    run = trainer(at, "rlhf")
    assert not at.info and run.steps_used == 3
    status = text("finetune.status_rlhf", "en").format(model="small", done=1, rm=2, used=3, most="2,000",
                                                       lr="0.0003", ms=f"{run.history[-1]['ms']:.0f}", device="cpu")
    assert status in texts(at)


def test_rlhf_batch_counts_sampled_answers_and_the_reward_model_takes_its_own():
    """W7: the box counts sampled answers in whole groups of G = 8; the reward model's step takes 32 pairs."""
    at = open_tab(open_page("en"), "rlhf")
    box = at.number_input(key="ft_rlhf_batch")
    assert box.label == text("finetune.batch_rlhf", "en")
    read = text("finetune.batch_rlhf_read", "en")
    assert read.format(g=8, questions=2, answers=16, rm=32) in texts(at)
    box.set_value(12).run()
    assert read.format(g=8, questions=1, answers=8, rm=32) in texts(at)
    click(at, "ft_rlhf_rm_one")
    click(at, "ft_rlhf_one")
    assert len(trainer(at, "rlhf").last_samples) == 8


def test_the_answers_on_small_follow_every_step_under_the_step_they_were_made_at():
    at = open_page("en")
    at.number_input(key="ft_sft_n").set_value(2).run()
    click(at, "ft_sft_run")
    assert text("finetune.after", "en").format(step=2) in html_of(at)


@pytest.mark.smollm2
@pytest.mark.skipif(not (fetched_folder("smollm2") / "source.json").is_file(),
                    reason="SmolLM2 is not fetched: run `python -m model fetch smollm2` (./dev test does)")
def test_on_smollm2_the_answers_say_the_step_they_were_made_at():
    """W8: SmolLM2's answers come only from "Answer again": made at step 1, they still say step 1 at step 3."""
    at = open_page("en")
    open_tab(at, "lora").segmented_control(key="ft_lora_model").set_value("smollm2").run()
    at.number_input(key="ft_lora_batch").set_value(2).run()
    click(at, "ft_lora_one")
    assert text("finetune.after_none", "en") in html_of(at)
    click(at, "ft_lora_after")
    click(at, "ft_lora_one")
    click(at, "ft_lora_one")
    assert trainer(at, "lora").steps_done == 3
    assert text("finetune.after", "en").format(step=1) in html_of(at)


def test_numbers_in_vietnamese_sentences_use_vietnamese_marks():
    """V1: 0,6931 in the DPO tab's two sentences alike; thousands with a dot in LoRA's counts."""
    at = open_tab(open_page("vi"), "dpo")
    click(at, "ft_dpo_one")
    said = [m.value for m in at.markdown if "ln 2" in m.value]
    assert len(said) == 2 and all("ln 2 = 0,6931" in m for m in said)
    click(at, "ft_lora_one")
    lora = trainer(at, "lora")
    metrics = {m.label: m.value for m in at.metric}
    assert metrics[text("finetune.trainable", "vi")] == f"{lora.trainable_count():,}".replace(",", ".")
    assert metrics[text("finetune.adapter_bytes", "vi")] == f"{lora.adapter_bytes():,} B".replace(",", ".")
    assert "," in metrics[text("finetune.share", "vi")] and "." not in metrics[text("finetune.share", "vi")]


BROWSER = {"vi": {"rm": "Một bước mô hình thưởng", "step": "bước 1/", "rlhf_step": "bước chính sách 1,",
                  "rm_done": "Ở bước 1:"},
           "en": {"rm": "One reward-model step", "step": "step 1/", "rlhf_step": "policy step 1,",
                  "rm_done": "At step 1:"}}


@pytest.mark.browser
@pytest.mark.parametrize("lang", ["vi", "en"])
def test_a_step_on_each_tab_in_a_real_browser(app_server, browser_page, artifacts, lang):
    from conftest import wait_idle

    page, words = browser_page, BROWSER[lang]
    page.goto(f"{app_server}/finetune?lang={lang}")
    wait_idle(page)
    for method in ("sft", "lora", "rlhf", "dpo"):
        page.get_by_role("tab", name=text("finetune.tab_" + method, lang)).click()
        wait_idle(page, 120_000)  # only the open tab is drawn: its content comes with the rerun the click starts
        panel = page.locator("[role='tabpanel']:visible")
        if method == "rlhf":
            panel.get_by_role("button", name=words["rm"], exact=True).click()
            panel.get_by_text(words["rm_done"]).first.wait_for(timeout=120_000)  # the reward model's first step
        panel.locator(f".st-key-ft_{method}_one button").click()
        wait_idle(page, 120_000)
        panel.get_by_text(words["rlhf_step" if method == "rlhf" else "step"]).first.wait_for(timeout=120_000)
        if method == "sft":  # the → key is the open tab's One step
            page.keyboard.press("ArrowRight")
            panel.get_by_text(words["step"].replace("1", "2")).first.wait_for(timeout=120_000)
            wait_idle(page, 120_000)
        assert page.locator("[data-testid='stException']").count() == 0
        assert page.locator("[data-testid='stAlertContentError']").count() == 0
        page.set_viewport_size({"width": 1440, "height": 2600})
        page.screenshot(path=str(artifacts / f"finetune-{method}-{lang}.png"), full_page=True)
        page.set_viewport_size({"width": 1440, "height": 900})


def test_the_page_opens_on_the_sft_run_with_its_before_answers_and_names_an_empty_one():
    """Issue 49: the first visit makes the SFT run (small, no step yet), so the key figure shows the answers before;
    an empty answer is a word that the line under the table explains, not a bare symbol; Reset is not undone."""
    from html import escape

    at = open_page("vi")
    run = trainer(at, "sft")
    assert run is not None and run.steps_done == 0 and not at.error
    html = html_of(at)
    assert all(escape(p) in html for p, _ in run.before) and "∅" not in html
    if any(not answer for _, answer in run.before):
        legend = text("finetune.empty_legend", "vi").format(empty=text("finetune.empty_answer", "vi"))
        assert escape(legend) in html
    click(at, "ft_sft_reset")
    assert trainer(at, "sft") is None and [i.value for i in at.info] == [text("finetune.press_step", "vi")]


def test_a_chart_of_one_series_names_it_on_its_y_axis():
    """classroom audit 2026-12-06: SFT's and LoRA's chart has the loss alone, so no legend shows, and its y axis said
    only "Value"; DPO's three series keep "Value" and their legend."""
    from types import SimpleNamespace

    from ui.finetune_views import history_chart

    history = [{"step": 1, "loss": 2.0, "margin": 0.1, "accuracy": 0.5}]
    y_title = {m: history_chart(m, SimpleNamespace(history=history))["layout"]["yaxis"]["title"]["text"]
               for m in ("sft", "lora", "dpo")}
    assert y_title == {"sft": text("finetune.col_loss", "vi"), "lora": text("finetune.col_loss", "vi"),
                       "dpo": text("finetune.axis_value", "vi")}
