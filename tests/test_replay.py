"""Runs that replay (issue 26, item 5): trace --json carries its schema and settings, a recording reads back or is
refused with one sentence, the shipped recordings re-run exactly, and the Replay page shows what the live run
showed without loading any model."""

import copy
import json
import re
from pathlib import Path

import pytest
from apptest import click, open_app
from conftest import wait_idle

from model.errors import InputError
from model.texts import LANGUAGES, text
from model.tools.cli import SCHEMA, main
from model.tools.replay import MAX_RECORDING_BYTES, PROB_TOLERANCE, SHIPPED, read_recording, rerun, shipped_recording

MICRO = Path(__file__).resolve().parent.parent / "assets" / "recordings" / "micro.json"


def trace_json(capsys, *args: str) -> dict:
    assert main(["trace", *args, "--json", "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out)


def test_trace_json_carries_its_schema_and_the_settings_that_re_run_it(capsys):
    run = trace_json(capsys, "--model", "small", "--prompt", "con mèo", "--temperature", "0.8", "--top-k", "7",
                     "--top-p", "0.9", "--seed", "11", "--max-new-tokens", "3", "--stop", "sữa")
    assert run["schema"] == SCHEMA == "decode-lab.trace/1"
    assert run["settings"] == {"temperature": 0.8, "top_k": 7, "top_p": 0.9, "seed": 11, "max_new_tokens": 3,
                               "stop": ["sữa"], "check": False}
    assert [s["answer"] for s in run["steps"]][-1] == run["output"]["text"]
    assert read_recording(json.dumps(run).encode()) == run
    again = rerun(_model("small"), run)
    assert again.matches and again.steps == len(run["steps"]), again


def _model(name: str):
    from model.engine.loading import load_model

    return load_model(name, "cpu")


def _micro() -> dict:
    return json.loads(MICRO.read_text(encoding="utf-8"))


def _with(change) -> bytes:
    run = _micro()
    change(run)
    return json.dumps(run).encode()


def _set(path: str, value):
    def change(run: dict) -> None:
        *parents, last = path
        target = run
        for key in parents:
            target = target[key]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value
    return change


BAD_FILES = {
    "not utf-8": (b"\xff\xfe\x00", "recording_not_json", {}),
    "not json": (b'{"steps": [', "recording_not_json", {}),
    "a list": (b"[1, 2, 3]", "recording_not_a_run", {}),
    "another json": (b'{"name": "x"}', "recording_not_a_run", {}),
    "speculative": (b'{"rounds": [], "model": "small"}', "recording_speculative", {}),
    "before the schema": (_with(_set(["schema"], KeyError)), "recording_no_schema", {"expected": SCHEMA}),
    "another version": (_with(_set(["schema"], "decode-lab.trace/2")), "recording_other_schema",
                        {"found": "decode-lab.trace/2", "expected": SCHEMA}),
    "no settings": (_with(_set(["settings"], KeyError)), "recording_missing", {"field": "settings"}),
    "no top": (_with(_set(["steps", 1, "top"], KeyError)), "recording_missing", {"field": "steps[1].top"}),
    "text for a number": (_with(_set(["steps", 0, "cache_len"], "2")), "recording_wrong_type",
                          {"field": "steps[0].cache_len", "kind_text": "replay.kind_int"}),
    "true for a number": (_with(_set(["settings", "seed"], True)), "recording_wrong_type",
                          {"field": "settings.seed", "kind_text": "replay.kind_int"}),
    "no steps": (_with(_set(["steps"], [])), "recording_wrong_type",
                 {"field": "steps", "kind_text": "replay.kind_steps"}),
    "ids as text": (_with(_set(["prompt", "ids"], ["1", "3"])), "recording_wrong_type",
                    {"field": "prompt.ids", "kind_text": "replay.kind_ints"}),
    "another phase": (_with(_set(["steps", 1, "phase"], "train")), "recording_wrong_type",
                      {"field": "steps[1].phase", "kind_text": "replay.kind_phase"}),
    "unknown stop": (_with(_set(["output", "stop_reason"], "tired")), "recording_wrong_type",
                     {"field": "output.stop_reason", "kind_text": "replay.kind_stop"}),
    "output not the steps": (_with(_set(["output", "ids"], [4, 5])), "recording_inconsistent", {}),
    "too large": (b" " * (MAX_RECORDING_BYTES + 1), "recording_too_large",
                  {"kb": (MAX_RECORDING_BYTES + 1) // 1024, "most": MAX_RECORDING_BYTES // 1024}),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_each_bad_file_is_one_sentence_in_both_languages(case):
    data, code, details = BAD_FILES[case]
    with pytest.raises(InputError) as refused:
        read_recording(data)
    assert refused.value.code == code and refused.value.details == details
    for lang in LANGUAGES:
        sentence = refused.value.message(lang)
        assert "{" not in sentence.replace("{ }", "") and sentence.count(". ") <= 1, sentence


def test_a_real_speculate_json_is_said_to_be_a_speculative_run(capsys):
    assert main(["speculate", "--prompt", "the dog", "--max-new-tokens", "4", "--json"]) == 0
    with pytest.raises(InputError) as refused:
        read_recording(capsys.readouterr().out.encode())
    assert refused.value.code == "recording_speculative"


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recording_reads_back_and_is_small(name):
    run = shipped_recording(name)
    assert run["model"]["name"] == name and run["settings"]["temperature"] == 0.0
    assert all("max_abs_logit_diff" in s for s in run["steps"])  # recorded with --check
    assert (MICRO.parent / f"{name}.json").stat().st_size < 100_000


def test_the_micro_recording_is_the_course_example():
    run = shipped_recording("micro")
    assert run["prompt"]["ids"] == [1, 3] and run["output"]["ids"] == [4, 6]
    assert [(s["cache_len"], s["cache_bytes"]) for s in run["steps"]] == [(2, 128), (3, 192)]


@pytest.mark.parametrize("name", ["micro", "small"])
def test_the_bundled_models_recordings_re_run_exactly(name):
    """A change of the engine that alters a token, a probability or a cache figure fails here."""
    run = shipped_recording(name)
    again = rerun(_model(name), run)
    assert again.matches and again.steps == len(run["steps"]) and again.max_prob_diff <= PROB_TOLERANCE, again


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_the_fetched_models_recordings_re_run_exactly(name):
    from model.weights.catalog import list_models

    if name not in list_models():
        pytest.skip(f"{name} is not fetched: python -m model fetch {name}")
    again = rerun(_model(name), shipped_recording(name))
    assert again.matches and again.max_prob_diff <= PROB_TOLERANCE, again


def test_a_re_run_names_the_first_step_that_differs_and_how():
    small, run = _model("small"), shipped_recording("small")
    nudged = copy.deepcopy(run)
    nudged["steps"][2]["top"][1]["prob"] += 3 * PROB_TOLERANCE
    difference = rerun(small, nudged).difference
    assert (difference.step, difference.what) == (2, "prob")
    swapped = copy.deepcopy(run)
    swapped["steps"][1]["chosen_id"] = swapped["steps"][1]["top"][1]["id"]
    difference = rerun(small, swapped).difference
    assert (difference.step, difference.what) == (1, "token")
    longer = copy.deepcopy(run)
    longer["settings"]["max_new_tokens"] = 1
    assert rerun(small, longer).difference.what == "length"


# -- the page ------------------------------------------------------------------------------------------------------

def step_parts(html: str) -> tuple[str, list[str], list[str]]:
    """(the token strip, the probabilities of the first five bars, the cache table's last row) of a step's HTML."""
    strip = re.search(r'<div class="tok-strip">.*?</div></div>', html).group(0)
    values = re.findall(r'<div class="val">([^<]*)</div>', html)[:5]
    last_row = re.findall(r"<tr>(.*?)</tr>", html.split("<tbody>")[1])[-1]
    return strip, values, re.findall(r"<td>([^<]*)</td>", last_row)[:4]


def page_html(at) -> str:
    return next(e.value for e in at.main if type(e).__name__ == "Html" and "tok-strip" in e.value)


def test_a_replay_shows_the_live_run_s_tokens_probabilities_and_cache_figures():
    from model.engine.loading import load_model
    from ui.session import run_as_trace_json

    at = open_app("app_pages/decode.py", lang="en", model_name="small", device="cpu", prompt_mode="text",
                  temperature=0.9, seed=4, prompt_text="con mèo")
    click(at, "run_prefill")
    assert [link.proto.page for link in at.get("page_link")] == ["replay"]
    live = [step_parts(page_html(at))]
    while not at.session_state["generation"].finished:
        click(at, "next")
        live.append(step_parts(page_html(at)))
    gen = at.session_state["generation"]
    recording = read_recording(run_as_trace_json(load_model("small", "cpu"), gen, at.session_state["prompt_of_run"],
                                                 []).encode())
    replay = open_app("app_pages/replay.py", lang="en", device="cpu", replay_source="upload",
                      replay_uploaded=recording)
    assert len(live) == len(recording["steps"]) >= 3
    for index, (strip, probs, row) in enumerate(live):
        if index:
            click(replay, "replay_next")
        shown = step_parts(page_html(replay))
        assert shown == (strip, probs, row), index
    assert replay.button(key="replay_next").disabled
    click(replay, "replay_back")
    assert step_parts(page_html(replay)) == live[-2]


@pytest.mark.parametrize("lang", LANGUAGES)
def test_a_smollm2_replay_opens_with_no_model_loaded(monkeypatch, lang):
    import model.engine.loading
    import ui.session

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the model loader was called")

    for where, name in ((model.engine.loading, "load_model"), (ui.session, "load_model"),
                        (ui.session, "shared_model")):
        monkeypatch.setattr(where, name, refuse)
    at = open_app("app_pages/replay.py", lang=lang, device="cpu", replay_source="smollm2")
    banner = text("replay.banner", lang).split("**")[1]
    assert any(banner in e.value for e in at.main if type(e).__name__ == "Html")
    click(at, "replay_next")
    click(at, "replay_next")
    assert "The" in page_html(at) and at.session_state["replay_step"] == 2
    click(at, "replay_back")
    assert not at.error and not calls


def test_re_run_for_real_on_the_page_says_every_token_matches():
    at = click(open_app("app_pages/replay.py", lang="en", device="cpu", replay_source="micro"), "replay_rerun_button")
    assert at.success[0].value == text("replay.rerun_match", "en").format(
        model="micro", device="cpu", dtype="float32", n=2, tol=PROB_TOLERANCE, gap="0.0e+00")


def test_a_recording_of_a_model_not_here_says_how_to_get_it(monkeypatch):
    import model.weights.catalog

    monkeypatch.setattr(model.weights.catalog, "list_models", lambda models_dir=None: ["small", "micro"])
    at = open_app("app_pages/replay.py", lang="vi", device="cpu", replay_source="gemma3")
    assert at.info[0].value == text("replay.model_absent", "vi").format(model="gemma3")
    assert "replay_rerun_button" not in [b.key for b in at.button]


@pytest.mark.browser
@pytest.mark.parametrize("lang", LANGUAGES)
def test_the_browser_replays_a_shipped_recording_with_buttons_and_keys(app_server, browser_page, artifacts, lang):
    page = browser_page
    page.goto(f"{app_server}/replay?lang={lang}")
    wait_idle(page)
    step = text("replay.step_of", lang)
    mark = re.compile(text("replay.banner", lang).split("**")[1])  # case-sensitive, unlike a plain text match
    page.get_by_text(mark).first.wait_for(timeout=60_000)
    page.get_by_text(step.format(step=0, last=1)).wait_for()
    page.get_by_role("button", name=text("decode.next", lang)).click()
    page.get_by_text(step.format(step=1, last=1)).wait_for()
    page.get_by_role("button", name=text("decode.back", lang)).click()
    page.get_by_text(step.format(step=0, last=1)).wait_for()
    page.locator("h1").first.click()
    page.keyboard.press("ArrowRight")
    page.get_by_text(step.format(step=1, last=1)).wait_for()
    assert page.get_by_text(text("stop.eos", lang), exact=False).count() >= 1
    page.keyboard.press("ArrowLeft")
    page.get_by_text(step.format(step=0, last=1)).wait_for()
    wait_idle(page)
    page.screenshot(path=str(artifacts / f"replay-micro-1440x900-{lang}.png"))
    page.locator("[class*='st-key-replay_source']").first.click()
    page.get_by_role("option", name=text("replay.source_upload", lang)).click()
    wait_idle(page)
    page.locator("input[type=file]").set_input_files(
        files=[{"name": "notes.json", "mimeType": "application/json", "buffer": b"not json at all"}])
    page.get_by_text(text("error.recording_not_json", lang).split(":")[0], exact=False).first.wait_for()
    assert page.get_by_text(mark).count() == 0
    page.locator("input[type=file]").set_input_files(files=[{
        "name": "old.json", "mimeType": "application/json",
        "buffer": json.dumps({**_micro(), "schema": "decode-lab.trace/0"}).encode()}])
    page.get_by_text("decode-lab.trace/0", exact=False).first.wait_for()
    page.locator("input[type=file]").set_input_files(str(MICRO.parent / "gemma3.json"))
    page.get_by_text(step.format(step=0, last=11)).wait_for()  # gemma3's 12 steps
    assert page.get_by_text(mark).count() == 1
    wait_idle(page)
    assert page.locator("[data-testid='stException']").count() == 0
    page.screenshot(path=str(artifacts / f"replay-upload-1440x900-{lang}.png"))
