"""The Fine-tune page under AppTest: a step on each tab, Run N, Reset, bad input as a sentence, Use this model."""

import math

import pytest
from apptest import APP, open_app
from streamlit.testing.v1 import AppTest

from model.texts import text
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
    return at.session_state["ft_trainers"][method]


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
    click(at, "ft_rlhf_one")  # before the reward model: one sentence, nothing stepped
    assert [e.value for e in at.error] == [text("error.finetune_reward_first", lang)]
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


def test_bad_input_is_one_sentence_and_the_session_keeps_its_runs():
    at = click(open_page("en"), "ft_sft_one")
    open_tab(at, "lora").number_input(key="ft_lora_rank").set_value(0).run()
    click(at, "ft_lora_one")
    assert [e.value for e in at.error] == [text("error.finetune_rank", "en").format(value=0)]
    open_tab(at, "dpo").slider(key="ft_dpo_beta").set_value(0.0).run()
    click(at, "ft_dpo_one")
    assert [e.value for e in at.error] == [text("error.finetune_beta", "en").format(value="0\\.0")]
    assert trainer(at, "sft").steps_done == 1


BROWSER = {"vi": {"rm": "Một bước mô hình thưởng", "step": "bước 1/", "rm_done": "Sau 1 bước:"},
           "en": {"rm": "One reward-model step", "step": "step 1/", "rm_done": "After 1 steps:"}}


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
        panel.get_by_text(words["step"]).first.wait_for(timeout=120_000)
        if method == "sft":  # the → key is the open tab's One step
            page.keyboard.press("ArrowRight")
            panel.get_by_text(words["step"].replace("1", "2")).first.wait_for(timeout=120_000)
            wait_idle(page, 120_000)
        assert page.locator("[data-testid='stException']").count() == 0
        assert page.locator("[data-testid='stAlertContentError']").count() == 0
        page.set_viewport_size({"width": 1440, "height": 2600})
        page.screenshot(path=str(artifacts / f"finetune-{method}-{lang}.png"), full_page=True)
        page.set_viewport_size({"width": 1440, "height": 900})
