"""The speculative decoding page under AppTest (rounds, crops, counts, language switch, bad input) and in
headless Chromium (screenshots at 1280×720 and 1440×900, vi and en)."""


import re

import pytest
from apptest import APP, click, element_order, open_app
from conftest import wait_idle
from streamlit.testing.v1 import AppTest
from test_smollm2 import needs_model

from model.engine import generate
from model.engine.loading import load_model
from model.engine.sampling import SamplingSettings
from model.texts import text

TIMEOUT = 60
PAGE = "app_pages/speculative.py"


def open_page(lang: str = "vi", prompt: str = "my mother cooks", draft: str = "small-draft", gamma: int = 4) -> AppTest:
    return open_app(PAGE, TIMEOUT, lang=lang, model_name="small", device="cpu", prompt_mode="text", prompt_text=prompt,
                    spec_draft=draft, spec_gamma=gamma)


@pytest.mark.parametrize("lang", ["vi", "en"])
def test_page_runs_before_and_after_a_round(lang):
    at = open_page(lang)
    opened = at.session_state["spec_run"]  # the first visit opens on round 1 of the settings shown
    assert len(opened.rounds) == 1 and not at.error
    click(at, "spec_start")
    run = at.session_state["spec_run"]
    assert run is not opened and len(run.rounds) == 1 and not at.error
    assert run.cache.length == len(run.ids) - 1  # cropped to the accepted tokens
    heading = {"vi": "Vòng 1: small-draft đề xuất 4 token (γ = 4)",
               "en": "Round 1: small-draft proposes 4 tokens (γ = 4)"}[lang]
    assert heading in [h.value for h in at.subheader]


def test_rounds_to_the_end_give_plain_greedy_output():
    at = click(open_page("en", gamma=1), "spec_start")  # at most 2 tokens a round: the answer takes 3 or more
    run = at.session_state["spec_run"]
    click(at, "spec_next")
    assert len(run.rounds) == 2
    click(at, "spec_run_to_end")
    assert run.stop_reason == "eos" and at.button(key="spec_next").disabled
    small = load_model("small", "cpu")
    plain = generate.start(small, run.prompt_ids, SamplingSettings(), 20)
    generate.run_to_end(small, plain)
    assert run.new_ids == plain.new_ids
    assert any("noodle soup for me" in m.value for m in at.markdown)
    counts = {m.label: m.value for m in at.metric}
    assert counts["target passes"] == str(len(run.rounds))
    assert counts["tokens produced"] == str(len(plain.new_ids))


def test_measure_prints_both_times_and_the_conditions():
    at = click(click(open_page("en"), "spec_start"), "spec_measure")
    speed = at.session_state["spec_speed"]
    assert speed.plain_ms_per_token > 0 and speed.speculative_ms_per_token > 0
    labels = [m.label for m in at.metric]
    assert "plain decoding, per token" in labels and "speculative, per token" in labels
    assert any(c.value.startswith("Conditions: model small, draft small-draft, γ = 4;") for c in at.caption)


def test_early_exit_and_lookup_drafts():
    at = open_page("en", prompt="the cat eats fish . the cat", draft="early-exit")
    assert at.number_input(key="spec_exit_layers").value == 2  # two thirds of small's 4 layers
    at.number_input(key="spec_exit_layers").set_value(1).run()
    click(at, "spec_start")
    assert at.session_state["spec_run"].draft.name == "early-exit:1"
    at = click(open_page("en", prompt="the cat eats fish . the cat", draft="lookup"), "spec_start")
    run = at.session_state["spec_run"]
    # the last two words "the cat" occurred before: lookup copies "eats fish . the", the target keeps the first
    # three and ends the sentence itself
    first = run.rounds[0]
    assert [run.target.tokenizer.token(c.id) for c in first.checks] == ["eats", "fish", ".", "the"]
    assert [c.accepted for c in first.checks] == [True, True, True, False]
    assert (first.next_kind, first.next_id) == ("corrected", run.target.info.eos_id)
    assert run.stop_reason == "eos" and len(run.rounds) == 1


def test_a_draft_that_proposes_fewer_than_gamma_is_counted_by_what_it_proposed():
    """Lookup copies the 5 tokens that followed "the cat" though γ = 8: the target keeps 3, rejects the 4th and
    never judges the 5th. The verdict divides by the 5 proposed, α by the 4 judged."""
    at = click(open_page("en", prompt="the cat eats fish . the cat", draft="lookup", gamma=8), "spec_start")
    run = at.session_state["spec_run"]
    assert (run.gamma, run.proposed, run.judged, run.accepted) == (8, 5, 4, 3)
    assert any(m.value.startswith("3/5 proposals kept; ") for m in at.markdown)
    alpha = next(m for m in at.metric if m.label == "acceptance rate α")
    assert alpha.value == "0.75"
    assert alpha.proto.help.endswith(": 3 kept of 4 judged, out of 5 proposed.")


@pytest.mark.parametrize(("prompt", "draft", "gamma", "kind", "crop", "held"), [
    ("bố đi làm", "small-draft", 3, "bonus", "crop_all_kept", "cache_draft_lacks_last"),
    ("my mother cooks", "small-draft", 4, "corrected", "crop_rejected", "cache_both"),
    ("a year has", "small-draft", 4, "eos", "crop_eos", "cache_both"),
    ("the cat eats fish . the cat", "lookup", 8, "corrected", "crop_rejected", "cache_target_only"),
])
def test_the_cache_note_says_what_each_cache_holds_after_the_round(prompt, draft, gamma, kind, crop, held):
    """After a round that keeps all γ the draft's cache lacks its own last proposal too (7 target positions,
    6 draft); after a rejection both hold every token but the newest; prompt lookup keeps no cache."""
    at = click(open_page("en", prompt=prompt, draft=draft, gamma=gamma), "spec_start")
    first = at.session_state["spec_run"].rounds[0]
    assert first.next_kind == kind
    if held == "cache_draft_lacks_last":
        assert (first.target_len_after, first.draft_len_after) == (7, 6)
    elif held == "cache_both":
        assert first.draft_len_after == first.target_len_after
    note = (text("speculative." + crop, "en").format(dropped=first.target_len_checked - first.target_len_after)
            + " " + text("speculative." + held, "en"))
    assert note in [c.value for c in at.caption]


def test_a_round_without_proposal_leaves_the_draft_cache_behind():
    """Five new tokens at most: round 1 yields 4, so round 2 has room for no proposal; the draft is fed nothing."""
    at = open_app(PAGE, TIMEOUT, lang="en", model_name="small", device="cpu", prompt_mode="text",
                  prompt_text="my mother cooks", spec_draft="small-draft", spec_gamma=4, max_new_tokens=5)
    click(click(at, "spec_start"), "spec_next")
    last = at.session_state["spec_run"].rounds[-1]
    assert (last.next_kind, last.target_len_after, last.draft_len_after) == ("target", 8, 7)
    assert (text("speculative.crop_no_proposal", "en") + " "
            + text("speculative.cache_draft_not_fed", "en").format(behind=1)) in [c.value for c in at.caption]


def test_sampled_round_shows_r_and_the_resampling_distribution():
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    for key, value in {"lang": "en", "model_name": "small", "device": "cpu", "prompt_mode": "text",
                       "prompt_text": "con mèo", "temperature": 1.0, "seed": 0}.items():
        at.session_state[key] = value
    at.run()
    at.switch_page(PAGE)
    at.run()
    click(at, "spec_start")
    first = at.session_state["spec_run"].rounds[0]
    # seed 0: the draft's first word "ngủ" (q 0.148) gets p 0.130 from the target, and r 0.883 ≥ p/q 0.877
    assert (first.checks[0].accepted, first.next_kind) == (False, "resampled")
    proposals, residual = at.dataframe[0].value, at.dataframe[1].value
    assert list(proposals["r ~ U[0, 1)"]) == ["0.8831", "—", "—", "—"]
    assert proposals["min(1, p/q)"].iloc[0] == f"{first.checks[0].threshold:.4f}" == "0.8768"
    assert list(proposals["verdict"]) == ["✗ rejected", "· dropped", "· dropped", "· dropped"]
    assert "max(0, p − q) normalised" in residual.columns
    assert sum(float(v) for v in residual["max(0, p − q) normalised"]) <= 1.0 + 1e-9
    assert not at.error


def test_micro_course_example_with_the_drafts_it_can_use():
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    for key, value in {"lang": "vi", "model_name": "micro", "device": "cpu", "prompt_mode": "ids",
                       "prompt_ids_text": "1, 3"}.items():
        at.session_state[key] = value
    at.run()
    at.switch_page(PAGE)
    at.run()
    assert at.selectbox(key="spec_draft.vi").options == [
        "Tra cứu trong prompt (chép n-gram)", "Thoát sớm: K lớp đầu của mô hình"]  # small-draft: another vocabulary
    click(at, "spec_start")
    click(at, "spec_run_to_end")
    run = at.session_state["spec_run"]
    assert run.new_ids == [4, 6] and run.stop_reason == "eos"  # "cá", then <eos>, as plain decoding
    assert not at.error


def test_language_switch_keeps_the_run():
    at = click(click(open_page("vi"), "spec_start"), "spec_next")
    run = at.session_state["spec_run"]
    before = (len(run.rounds), run.new_ids)
    at.radio(key="lang").set_value("en").run()
    assert not at.exception
    after = at.session_state["spec_run"]
    assert (len(after.rounds), after.new_ids) == before


def test_bad_prompt_gets_a_sentence_and_keeps_the_run():
    at = click(open_page("en"), "spec_start")
    run = at.session_state["spec_run"]
    at.text_input(key="prompt_text").set_value("   ").run()
    click(at, "spec_start")
    assert [e.value for e in at.error] == [text("error.empty_prompt", "en")]
    assert at.session_state["spec_run"] is run
    # said under the buttons, not above the title (where an element drawn in a callback would land)
    order = element_order(at)
    assert order.index("Title") < order.index("spec_reset") < order.index("Error")


@pytest.mark.browser
@pytest.mark.parametrize(("lang", "size"), [("vi", (1280, 720)), ("en", (1440, 900))])
def test_browser_rounds(app_server, browser_page, artifacts, lang, size):
    page = browser_page
    page.set_viewport_size({"width": size[0], "height": size[1]})
    page.goto(f"{app_server}/speculative?lang={lang}")
    start = {"vi": "Bắt đầu (vòng 1)", "en": "Start (round 1)"}[lang]
    page.get_by_role("button", name=start).click(timeout=90_000)  # the first visit loads the model
    round_2 = {"vi": "Vòng 2:", "en": "Round 2:"}[lang]
    page.get_by_role("button", name=text("speculative.next_round", lang)).click()
    page.get_by_text(round_2).first.wait_for(timeout=30_000)
    page.screenshot(path=str(artifacts / f"speculative-{lang}-{size[0]}.png"))
    page.get_by_role("button", name={"vi": "Đo: suy đoán", "en": "Measure: speculative"}[lang]).click()
    page.get_by_text({"vi": "Điều kiện: mô hình small", "en": "Conditions: model small"}[lang]).wait_for(timeout=60_000)
    assert page.locator("[data-testid='stException']").count() == 0
    page.set_viewport_size({"width": size[0], "height": 2600})  # the app scrolls inside: a tall window shows it all
    page.screenshot(path=str(artifacts / f"speculative-{lang}-{size[0]}-tall.png"))


def test_gamma_k_and_the_run_survive_a_visit_to_another_page():
    at = open_page("en", gamma=7)
    at.selectbox(key="spec_draft.en").set_value("early-exit").run()
    at.number_input(key="spec_exit_layers").set_value(3).run()
    click(at, "spec_start")
    run = at.session_state["spec_run"]
    assert run.gamma == 7 and run.draft.name == "early-exit:3"
    at.switch_page("app_pages/decode.py")
    at.run()
    at.switch_page(PAGE)
    at.run()
    assert not at.exception and not at.error
    assert at.slider(key="spec_gamma").value == 7 and at.number_input(key="spec_exit_layers").value == 3
    assert at.session_state["spec_run"] is run
    click(at, "spec_start")  # a new run starts from the settings shown
    again = at.session_state["spec_run"]
    assert again is not run and again.gamma == 7 and again.draft.name == "early-exit:3"


def test_a_run_to_end_stopped_between_two_rounds_is_said_and_goes_on():
    at = click(open_page("en", gamma=1), "spec_start")
    run = at.session_state["spec_run"]
    at.session_state["spec_running"] = True  # what a click on Stop leaves behind: the loop did not reach its end
    at.run()
    assert any("Stopped after round 1 (" in i.value for i in at.info)
    click(at, "spec_next")
    assert len(run.rounds) == 2 and not any("Stopped after" in i.value for i in at.info)


@pytest.mark.browser
def test_browser_gamma_and_k_survive_a_visit_and_the_next_start_uses_them(app_server, browser_page):
    page = browser_page
    page.goto(f"{app_server}/speculative?lang=en")
    page.locator(".st-key-speculative_settings summary").click(timeout=90_000)  # the folded settings
    prompt = page.locator(".st-key-prompt_text input")
    prompt.fill("the dog")  # round 1 leaves the answer unfinished (the page's example may end in it)
    prompt.press("Enter")
    wait_idle(page)
    page.locator("[class*='st-key-spec_draft'] [data-testid='stSelectbox']").click()
    page.get_by_role("option", name=re.compile("early exit", re.IGNORECASE)).click()
    k = page.locator(".st-key-spec_exit_layers input")
    k.fill("3")
    k.press("Enter")
    wait_idle(page)
    page.locator(".st-key-spec_gamma input[type='range']").focus()
    for _ in range(3):  # 4 -> 7
        page.keyboard.press("ArrowRight")
    wait_idle(page)
    seed = page.locator(".st-key-seed input")
    seed.fill("5")
    seed.press("Enter")
    wait_idle(page)
    page.get_by_role("button", name="Start (round 1)").click()
    page.get_by_text(re.compile(r"Round 1: early-exit:3 proposes \d+ tokens \(γ = 7\)")).wait_for(timeout=60_000)
    page.locator("[data-testid='stSidebarNav']").get_by_role("link", name="Decode").click()
    page.wait_for_url("**/decode?*")
    wait_idle(page, timeout_ms=90_000)
    page.locator("[data-testid='stSidebarNav']").get_by_role("link", name="Speculative decoding").click()
    page.get_by_text(re.compile(r"Round 1: early-exit:3 proposes \d+ tokens \(γ = 7\)")).wait_for(timeout=60_000)
    assert page.locator(".st-key-spec_gamma input[type='range']").input_value() == "7"
    assert k.input_value() == "3" and seed.input_value() == "5"
    assert page.get_by_role("button", name="Start (round 1)").count() == 1
    page.get_by_role("button", name="Next round").click()
    page.get_by_text(re.compile(r"Round 2: early-exit:3 proposes \d+ tokens \(γ = 7\)")).wait_for(timeout=60_000)
    assert page.locator("[data-testid='stException']").count() == 0


@pytest.mark.browser
@needs_model
def test_browser_run_to_end_redraws_and_stops_at_a_click(app_server, browser_page):
    """SmolLM2 counting, its first 20 layers as the draft, 300 new tokens: tens of seconds of rounds. The strip grows
    while it runs, Stop ends it between two rounds, and Next round goes on from there."""
    page = browser_page
    page.goto(f"{app_server}/speculative?lang=en")
    page.locator("[data-testid='stSidebar'] [data-testid='stSelectbox']").first.click()
    page.get_by_role("option", name=re.compile("SmolLM2-135M-Instruct")).click()
    page.locator(".st-key-speculative_settings summary").click()  # the folded settings
    page.get_by_text(text("prompt.chat_label", "en")).wait_for(timeout=180_000)
    wait_idle(page, timeout_ms=180_000)
    page.locator("[class*='st-key-spec_draft'] [data-testid='stSelectbox']").click()
    page.get_by_role("option", name=re.compile("early exit", re.IGNORECASE)).click()
    wait_idle(page)
    page.locator("[class*='st-key-prompt_mode'] button").get_by_text("text", exact=True).click()
    box = page.get_by_label(text("prompt.label", "en"), exact=True)
    box.fill("1, 2, 3, 4, 5, 6, 7,")  # a count goes on for hundreds of tokens: no end of sequence soon
    box.press("Enter")
    wait_idle(page)
    limit = page.locator(".st-key-max_new_tokens input").first
    limit.fill("300")
    limit.press("Enter")
    wait_idle(page)
    page.get_by_role("button", name="Start (round 1)").click()
    # the page opened on a run of its own, so Run to end is there at once: a click before Start's run is drawn
    # could reach the server in the same rerun as Start's and take its place
    page.get_by_text(re.compile(r"Round 1: early-exit:\d+ proposes")).wait_for(timeout=180_000)
    wait_idle(page)
    page.get_by_role("button", name="Run to end").click()
    page.locator(".st-key-spec_stop button").wait_for(timeout=60_000)
    first = page.locator(".tok").count()
    page.wait_for_function(f"document.querySelectorAll('.tok').length > {first}", timeout=60_000)  # it redraws
    page.locator(".st-key-spec_stop button").click()
    stopped = page.get_by_text(re.compile(r"Stopped after round \d+ \(\d+ new tokens\)")).first
    stopped.wait_for(timeout=30_000)
    tokens = int(re.search(r"\((\d+) new tokens\)", stopped.inner_text()).group(1))
    assert tokens < 300 and page.locator(".st-key-spec_stop").count() == 0
    page.get_by_role("button", name="Next round").click()
    page.get_by_text(re.compile(r"Round \d+:")).first.wait_for()
    assert page.locator("[data-testid='stException']").count() == 0


def test_the_first_visit_opens_on_a_round_of_a_draft_the_model_can_use():
    """micro cannot use small-draft (another vocabulary), the session's default draft: the page's first round is
    made after the draft's control has put the model's first draft in its place, so it opens on round 1, no error."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    for key, value in {"lang": "en", "model_name": "micro", "device": "cpu", "prompt_mode": "ids",
                       "prompt_ids_text": "1, 3"}.items():
        at.session_state[key] = value
    at.run()
    at.switch_page(PAGE)
    at.run()
    run = at.session_state["spec_run"]
    assert not at.error and len(run.rounds) == 1 and run.draft.name == "lookup"
