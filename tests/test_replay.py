"""Runs that replay (issue 26, item 5): trace --json and speculate --json carry their schema and settings, a
recording reads back or is refused with one sentence, the shipped recordings re-run exactly, and the Replay page shows
what the live run showed (a Decode run's steps, a speculative run's rounds) without loading any model."""

import copy
import json
import re
from pathlib import Path

import pytest
from apptest import click, open_app
from conftest import wait_idle
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from model.errors import InputError
from model.texts import LANGUAGES, text
from model.tools.cli import SCHEMA, main
from model.tools.replay import (
    DECODE,
    MAX_RECORDING_BYTES,
    PROB_TOLERANCE,
    SHIPPED,
    SPECULATIVE,
    Difference,
    read_recording,
    recording_kind,
    rerun,
    shipped_recording,
)
from model.tools.speculate import SCHEMA as SPECULATE_SCHEMA

MICRO = Path(__file__).resolve().parent.parent / "assets" / "recordings" / "micro.json"
SPECULATIVE_RECORDING = MICRO.parent / "small-speculative.json"
DECODE_SHIPPED = [name for name in SHIPPED if recording_kind(shipped_recording(name)) == DECODE]


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


def _with(change, recording: Path = MICRO) -> bytes:
    run = json.loads(recording.read_text(encoding="utf-8"))
    change(run)
    return json.dumps(run).encode()


def _spec_with(change) -> bytes:
    return _with(change, SPECULATIVE_RECORDING)


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
    "speculative before the schema": (_spec_with(_set(["schema"], KeyError)), "recording_no_schema",
                                      {"expected": SPECULATE_SCHEMA}),
    "another speculate version": (_spec_with(_set(["schema"], "decode-lab.speculate/2")), "recording_other_schema",
                                  {"found": "decode-lab.speculate/2", "expected": SPECULATE_SCHEMA}),
    "another program": (_spec_with(_set(["schema"], "other-lab.run/1")), "recording_other_schema",
                        {"found": "other-lab.run/1", "expected": f"{SCHEMA} / {SPECULATE_SCHEMA}"}),
    "no draft": (_spec_with(_set(["draft"], KeyError)), "recording_missing", {"field": "draft"}),
    "no rounds": (_spec_with(_set(["rounds"], [])), "recording_wrong_type",
                  {"field": "rounds", "kind_text": "replay.kind_rounds"}),
    "a verdict as text": (_spec_with(_set(["rounds", 1, "proposed", 0, "accepted"], "yes")), "recording_wrong_type",
                          {"field": "rounds[1].proposed[0].accepted", "kind_text": "replay.kind_bool"}),
    "a round without q": (_spec_with(_set(["rounds", 0, "proposed", 2, "q"], KeyError)), "recording_missing",
                          {"field": "rounds[0].proposed[2].q"}),
    "a round's settings": (_spec_with(_set(["rounds", 2, "settings", "seed"], 1.5)), "recording_wrong_type",
                           {"field": "rounds[2].settings.seed", "kind_text": "replay.kind_int"}),
    "another next kind": (_spec_with(_set(["rounds", 0, "next_kind"], "guess")), "recording_wrong_type",
                          {"field": "rounds[0].next_kind", "kind_text": "replay.kind_next_kind"}),
    "a rejection that kept its token": (_spec_with(_set(["rounds", 1, "proposed", 0, "accepted"], False)),
                                        "recording_inconsistent", {}),
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
    "bytes not in hex": (_with(_set(["steps", 0, "chosen_bytes"], "zz")), "recording_wrong_type",
                         {"field": "steps[0].chosen_bytes", "kind_text": "replay.kind_hex"}),
    "a prompt's bytes not in hex": (_spec_with(_set(["prompt", "bytes", 1], "the")), "recording_wrong_type",
                                    {"field": "prompt.bytes", "kind_text": "replay.kind_hexes"}),
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


def test_a_real_speculate_json_reads_back_as_a_speculative_run_and_re_runs_exactly(capsys):
    assert main(["speculate", "--prompt", "bố đi làm", "--gamma", "2", "--temperature", "0.9", "--seed", "3",
                 "--max-new-tokens", "6", "--json", "--device", "cpu"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert read_recording(json.dumps(run).encode()) == run and recording_kind(run) == SPECULATIVE
    again = rerun(_model("small"), run)
    assert again.matches and again.steps == len(run["rounds"]), again


def test_the_shipped_speculative_recording_is_small_small_draft_with_a_rejection_and_a_bonus():
    run = shipped_recording("small-speculative")
    assert recording_kind(run) == SPECULATIVE and (run["model"]["name"], run["draft"], run["gamma"]) == (
        "small", "small-draft", 3)
    assert run["prompt"]["tokens"] == ["<bos>", "the", "dog"] and run["settings"]["temperature"] == 0.0
    assert {"corrected", "bonus"} <= {r["next_kind"] for r in run["rounds"]}
    assert SPECULATIVE_RECORDING.stat().st_size < 100_000


def test_the_shipped_speculative_recording_re_runs_exactly():
    """A change of the speculative loop or the engine that alters a proposal, a verdict, a token, q, p or a cache
    length fails here."""
    run = shipped_recording("small-speculative")
    again = rerun(_model("small"), run)
    assert again.matches and again.steps == len(run["rounds"]) and again.max_prob_diff <= PROB_TOLERANCE, again


def test_a_speculative_re_run_names_the_first_round_that_differs_and_how():
    small, run = _model("small"), shipped_recording("small-speculative")
    flipped = copy.deepcopy(run)  # round 1 kept all three proposals; the file now says its last was rejected
    flipped["rounds"][1]["proposed"][2]["accepted"] = False
    difference = rerun(small, flipped).difference
    assert (difference.step, difference.what) == (1, "accepted"), difference
    assert difference.recorded == "[True, True, False]" and difference.now == "[True, True, True]"
    other_token = copy.deepcopy(run)  # round 0's rejected proposal: another id, a file that still reads back
    other_token["rounds"][0]["proposed"][0]["id"] = 7
    other_token = read_recording(json.dumps(other_token).encode())
    assert (rerun(small, other_token).difference.step, rerun(small, other_token).difference.what) == (0, "proposal")
    nudged = copy.deepcopy(run)
    nudged["rounds"][2]["proposed"][0]["p"] -= 3 * PROB_TOLERANCE
    assert (rerun(small, nudged).difference.step, rerun(small, nudged).difference.what) == (2, "prob")
    cropped = copy.deepcopy(run)
    cropped["rounds"][0]["target_cache_len"] += 1
    assert rerun(small, cropped).difference.what == "cache"
    saved_mid_run = copy.deepcopy(run)  # the Speculative page's download before the run stopped
    saved_mid_run["rounds"].pop()
    saved_mid_run["output"]["stop_reason"] = None
    assert rerun(small, saved_mid_run).matches
    saved_mid_run["output"]["stop_reason"] = "eos"  # but the re-run did not stop after round 1
    assert rerun(small, saved_mid_run).difference == Difference(2, "length", "2 (eos)", "2 (None)")


@pytest.mark.parametrize("name", DECODE_SHIPPED)
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
    # gemma3's 12 steps; it once took over the default 30 s with another job running beside the suite
    page.get_by_text(step.format(step=0, last=11)).wait_for(timeout=120_000)
    assert page.get_by_text(mark).count() == 1
    wait_idle(page)
    assert page.locator("[data-testid='stException']").count() == 0
    page.screenshot(path=str(artifacts / f"replay-upload-1440x900-{lang}.png"))


# -- speculative runs on the page ----------------------------------------------------------------------------------

def _refuse_the_loader(monkeypatch) -> list:
    import model.engine.loading
    import ui.session

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the model loader was called")

    for where, name in ((model.engine.loading, "load_model"), (ui.session, "load_model"),
                        (ui.session, "shared_model")):
        monkeypatch.setattr(where, name, refuse)
    return calls


def _round_view(at) -> tuple:
    """(the round's heading, the sequence's chips, the proposals' table) as the page draws them."""
    strip = next(e.value for e in at.main if type(e).__name__ == "Html" and "tok-strip" in e.value)
    return (at.subheader[0].value, strip, at.dataframe[0].value.to_dict("records"))


@pytest.mark.parametrize("lang", LANGUAGES)
def test_a_speculative_recording_replays_round_by_round_with_no_model_loaded(monkeypatch, lang):
    calls = _refuse_the_loader(monkeypatch)
    at = open_app("app_pages/replay.py", lang=lang, device="cpu", replay_source="small-speculative")
    banner = text("replay.banner_rounds", lang).split("**")[1]
    assert any(banner in e.value for e in at.main if type(e).__name__ == "Html")
    round_of = text("replay.round_of", lang)
    assert f"**{round_of.format(round=1, rounds=3)}**" in [e.value for e in at.markdown]
    assert at.button(key="replay_back").disabled
    first = _round_view(at)
    assert 'spec-target">runs<' in first[1] and first[2][0][text("speculative.col_token", lang)] == "guards"
    click(at, "replay_next")
    assert f"**{round_of.format(round=2, rounds=3)}**" in [e.value for e in at.markdown]
    assert "garden" in _round_view(at)[1] and _round_view(at) != first
    click(at, "replay_next")
    assert at.button(key="replay_next").disabled and at.session_state["replay_step"] == 2
    click(at, "replay_back")
    click(at, "replay_back")
    assert _round_view(at) == first
    assert not at.exception and not at.error and not calls


def _tables(at) -> list[list[dict]]:
    """Every table's rows but the time column: a recording keeps times to 3 decimals, then the table rounds them."""
    return [[{k: v for k, v in row.items() if k != "ms"} for row in d.value.to_dict("records")] for d in at.dataframe]


def _same_tables(ours: list[list[dict]], theirs: list[list[dict]]) -> bool:
    """Equal, but a q or p shown to 4 decimals one step apart: the recording rounds it to 6 first."""
    def same(a, b) -> bool:
        return abs(a - b) <= 1.01e-4 if isinstance(a, float) and isinstance(b, float) else a == b

    def shape(tables: list[list[dict]]) -> list[list]:
        return [[list(row) for row in table] for table in tables]

    return shape(ours) == shape(theirs) and all(same(a[k], b[k]) for x, y in zip(ours, theirs) for a, b in zip(x, y)
                                                for k in a)


def test_a_replayed_round_is_drawn_as_the_speculative_page_drew_it():
    """The live run's every round, then its download opened on the Replay page: the same heading, chips, proposals'
    table (q, p, verdicts), caches' table and counts, round by round."""
    from test_speculative_page import open_page

    from model.tools.speculate import report

    live = click(open_page("en", prompt="my mother cooks", gamma=3), "spec_start")
    views = []
    while True:
        views.append((_round_view(live)[:2], _tables(live), [m.value for m in live.metric]))
        if live.session_state["spec_run"].stop_reason is not None:
            break
        click(live, "spec_next")
    recording = read_recording(json.dumps(report(live.session_state["spec_run"], None, [])).encode())
    replay = open_app("app_pages/replay.py", lang="en", device="cpu", replay_source="upload",
                      replay_uploaded=recording)
    assert len(views) == len(recording["rounds"]) >= 2
    for index, (view, tables, metrics) in enumerate(views):
        if index:
            click(replay, "replay_next")
        assert _round_view(replay)[:2] == view and [m.value for m in replay.metric] == metrics, index
        assert _same_tables(_tables(replay), tables), index


def test_the_speculative_download_is_speculate_json_of_the_session_s_run(capsys):
    """The Speculative page's Download the run is speculate.report of its run: the object `speculate --json` prints
    for the same prompt and settings (times aside), and a recording the Replay page reads and re-runs exactly."""
    from test_speculative_page import open_page

    from model.tools.speculate import report

    at = click(open_page("en", prompt="my mother cooks", gamma=3), "spec_start")
    click(at, "spec_run_to_end")
    assert at.get("download_button")
    run = at.session_state["spec_run"]
    page = report(run, None, at.session_state["spec_unknown"])
    assert main(["speculate", "--model", "small", "--prompt", "my mother cooks", "--gamma", "3", "--max-new-tokens",
                 str(run.max_new_tokens), "--json", "--device", "cpu"]) == 0
    cli = json.loads(capsys.readouterr().out)
    times = {"draft_ms", "target_ms", "ms"}
    assert page.keys() == cli.keys() and page["schema"] == SPECULATE_SCHEMA
    for key in page.keys() - {"recorded_at", "rounds", "timing"}:
        assert page[key] == cli[key], key
    for ours, theirs in zip(page["rounds"], cli["rounds"], strict=True):
        assert {k: v for k, v in ours.items() if k not in times} == {k: v for k, v in theirs.items() if k not in times}
    assert rerun(_model("small"), read_recording(json.dumps(page).encode())).matches


def test_re_running_a_speculative_recording_on_the_page_says_every_round_matches():
    at = click(open_app("app_pages/replay.py", lang="en", device="cpu", replay_source="small-speculative"),
               "replay_rerun_button")
    assert at.success[0].value == text("replay.rerun_match_rounds", "en").format(
        model="small", draft="small\\-draft", device="cpu", dtype="float32", n=3, tol=PROB_TOLERANCE, gap="0.0e+00")


def test_a_tampered_speculative_recording_re_runs_to_the_round_that_differs(monkeypatch):
    tampered = shipped_recording("small-speculative")
    tampered["rounds"][0]["proposed"][0]["id"] = 7
    at = open_app("app_pages/replay.py", lang="vi", device="cpu", replay_source="upload",
                  replay_uploaded=read_recording(json.dumps(tampered).encode()))
    click(at, "replay_rerun_button")
    assert at.error[0].value.startswith(text("replay.rerun_differs_round", "vi").split("{")[0] + "1")
    assert text("replay.what_proposal", "vi") in at.error[0].value


@pytest.mark.browser
@pytest.mark.parametrize("lang", LANGUAGES)
def test_the_browser_replays_the_shipped_speculative_recording_round_by_round(app_server, browser_page, artifacts,
                                                                              lang):
    page = browser_page
    page.goto(f"{app_server}/replay?lang={lang}")
    page.get_by_text(text("replay.step_of", lang).format(step=0, last=1)).wait_for(timeout=60_000)  # micro first
    wait_idle(page)
    option = page.get_by_role("option", name=text("replay.source_small-speculative", lang), exact=True)
    for attempt in range(3):  # a click while the first run's elements still arrive may not open the drop-down
        page.locator("[class*='st-key-replay_source']").first.click()
        try:
            option.wait_for(timeout=5_000)
            break
        except PlaywrightTimeout:
            if attempt == 2:
                raise
    option.click()
    round_of = text("replay.round_of", lang)
    page.get_by_text(round_of.format(round=1, rounds=3)).wait_for(timeout=60_000)
    page.get_by_text(re.compile(text("replay.banner_rounds", lang).split("**")[1])).first.wait_for()
    page.locator(".st-key-replay_next button").click()  # its name carries the icon's and the shortcut's text
    page.get_by_text(round_of.format(round=2, rounds=3)).wait_for()
    page.get_by_text(text("speculative.round", lang).format(n=2, k=3, gamma=3, draft="small-draft")).wait_for()
    wait_idle(page)
    assert page.locator("[data-testid='stException']").count() == 0
    assert page.locator(".tok.spec-accepted").count() == 3
    page.screenshot(path=str(artifacts / f"replay-speculative-1440x900-{lang}.png"), full_page=True)
