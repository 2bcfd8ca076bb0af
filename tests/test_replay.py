"""Runs that replay (issue 26, item 5): trace --json and speculate --json carry their schema and settings, a
recording reads back or is refused with one sentence, the shipped recordings re-run exactly, and the Replay page shows
what the live run showed (a Decode run's steps, a speculative run's rounds) without loading any model."""

import copy
import json
import os
import re
from pathlib import Path

import pytest
from apptest import click, open_app
from conftest import wait_idle
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from model.errors import InputError
from model.recording.replay import (
    DECODE,
    MAX_RECORDING_BYTES,
    PROB_TOLERANCE,
    SHIPPED,
    SPECULATIVE,
    TRACE_V1,
    Difference,
    read_recording,
    recording_kind,
    rerun,
    shipped_recording,
)
from model.recording.speculative import SCHEMA as SPECULATE_SCHEMA
from model.recording.trace import SCHEMA
from model.texts import LANGUAGES, number_in, text
from model.tools.cli import main
from ui.widgets import md_escape

MICRO = Path(__file__).resolve().parent.parent / "assets" / "recordings" / "micro.json"
SPECULATIVE_RECORDING = MICRO.parent / "small-speculative.json"
DECODE_SHIPPED = [name for name in SHIPPED if recording_kind(shipped_recording(name)) == DECODE]


def trace_json(capsys, *args: str) -> dict:
    assert main(["trace", *args, "--json", "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out)


def test_trace_json_carries_its_schema_and_the_settings_that_re_run_it(capsys):
    run = trace_json(capsys, "--model", "small", "--prompt", "con mèo", "--temperature", "0.8", "--top-k", "7",
                     "--top-p", "0.9", "--seed", "11", "--max-new-tokens", "3", "--stop", "sữa")
    assert run["schema"] == SCHEMA == "decode-lab.trace/2"
    drawn_with = {"temperature": 0.8, "top_k": 7, "top_p": 0.9, "seed": 11}
    assert run["settings"] == drawn_with | {"max_new_tokens": 3, "stop": ["sữa"], "check": False}
    assert [s["settings"] for s in run["steps"]] == [drawn_with] * len(run["steps"])
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
                                  {"found": "decode-lab.speculate/2", "expected": f"“{SPECULATE_SCHEMA}”"}),
    "another program": (_spec_with(_set(["schema"], "other-lab.run/1")), "recording_other_schema",
                        {"found": "other-lab.run/1", "expected": f"“{SCHEMA}”, “{TRACE_V1}”, “{SPECULATE_SCHEMA}”"}),
    "a schema that is a list": (_with(_set(["schema"], ["decode-lab.trace/2"])), "recording_other_schema",
                                {"found": "['decode-lab.trace/2']", "expected": f"“{SCHEMA}”, “{TRACE_V1}”, "
                                                                                 f"“{SPECULATE_SCHEMA}”"}),
    "no draft": (_spec_with(_set(["draft"], KeyError)), "recording_missing", {"field": "draft"}),
    "no rounds": (_spec_with(_set(["rounds"], [])), "recording_wrong_type",
                  {"field": "rounds", "kind_text": "replay.kind_rounds"}),
    "a verdict as text": (_spec_with(_set(["rounds", 1, "proposed", 0, "accepted"], "yes")),
                          "recording_wrong_type_or_null",
                          {"field": "rounds[1].proposed[0].accepted", "kind_text": "replay.kind_bool"}),
    "a round without q": (_spec_with(_set(["rounds", 0, "proposed", 2, "q"], KeyError)), "recording_missing",
                          {"field": "rounds[0].proposed[2].q"}),
    "a round's settings": (_spec_with(_set(["rounds", 2, "settings", "seed"], 1.5)), "recording_wrong_type",
                           {"field": "rounds[2].settings.seed", "kind_text": "replay.kind_int"}),
    "another next kind": (_spec_with(_set(["rounds", 0, "next_kind"], "guess")), "recording_wrong_type",
                          {"field": "rounds[0].next_kind", "kind_text": "replay.kind_next_kind"}),
    "a rejection that kept its token": (_spec_with(_set(["rounds", 1, "proposed", 0, "accepted"], False)),
                                        "recording_disagrees",
                                        {"field": "rounds[1].new_ids", "other": "rounds[1].proposed, next_id"}),
    "before the schema": (_with(_set(["schema"], KeyError)), "recording_no_schema", {"expected": SCHEMA}),
    "another version": (_with(_set(["schema"], "decode-lab.trace/3")), "recording_other_schema",
                        {"found": "decode-lab.trace/3", "expected": f"“{SCHEMA}”, “{TRACE_V1}”"}),
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
    "output not the steps": (_with(_set(["output", "ids"], [4, 5])), "recording_disagrees",
                             {"field": "output.ids", "other": "steps[*].chosen_id"}),
    # issue 41, item 3: files the reader let through, on which the page crashed
    "a date as a number": (_with(_set(["recorded_at"], 20261202)), "recording_wrong_type",
                           {"field": "recorded_at", "kind_text": "replay.kind_text"}),
    "no date": (_spec_with(_set(["recorded_at"], None)), "recording_wrong_type",
                {"field": "recorded_at", "kind_text": "replay.kind_text"}),
    "a check as text": (_with(_set(["steps", 1, "max_abs_logit_diff"], "0.0")), "recording_wrong_type",
                        {"field": "steps[1].max_abs_logit_diff", "kind_text": "replay.kind_number"}),
    "a check of null": (_with(_set(["steps", 0, "max_abs_logit_diff"], None)), "recording_wrong_type",
                        {"field": "steps[0].max_abs_logit_diff", "kind_text": "replay.kind_number"}),
    "prompt tokens as ids": (_with(_set(["prompt", "tokens"], [1, 3])), "recording_wrong_type",
                             {"field": "prompt.tokens", "kind_text": "replay.kind_texts"}),
    "cache bytes of 10^400": (_with(_set(["steps", 0, "cache_bytes"], 10**400)), "recording_wrong_type",
                              {"field": "steps[0].cache_bytes", "kind_text": "replay.kind_int"}),
    "a negative gamma": (_spec_with(_set(["gamma"], -3)), "recording_wrong_type",
                         {"field": "gamma", "kind_text": "replay.kind_positive"}),
    "speculative prompt tokens as ids": (_spec_with(_set(["prompt", "tokens"], [1, 5, 73])), "recording_wrong_type",
                                         {"field": "prompt.tokens", "kind_text": "replay.kind_texts"}),
    "a next token of null beside its id": (_spec_with(_set(["rounds", 0, "next_token"], None)), "recording_disagrees",
                                           {"field": "rounds[0].next_token", "other": "rounds[0].next_id"}),
    # issue 41, Replay: what "Re-run for real" answered with "Something unexpected went wrong… Try again"
    "a prompt id outside the vocabulary": (_with(_set(["prompt", "ids", 1], 8)), "recording_token_id",
                                           {"field": "prompt.ids[1]", "model": "micro"}),
    "a stop that is not text": (_with(_set(["settings", "stop"], [4])), "recording_wrong_type",
                                {"field": "settings.stop", "kind_text": "replay.kind_texts"}),
    # more of the same kind, found by tests/test_replay_files.py
    "a 5,000-digit number": (_with(_set(["steps", 0, "cache_len"], "HUGE")).replace(b'"HUGE"', b"9" * 5000),
                             "recording_wrong_type", {"field": "steps[0].cache_len", "kind_text": "replay.kind_int"}),
    "nested 100,000 deep": (b"[" * 100_000 + b"]" * 100_000, "recording_too_deep", {}),
    "a lone surrogate": (_spec_with(_set(["model", "dtype"], "\ud800")), "recording_wrong_type",
                         {"field": "model.dtype", "kind_text": "replay.kind_text"}),
    "a step at another place": (_with(_set(["steps", 1, "index"], 0)), "recording_index",
                                {"field": "steps[1].index", "index": 1}),
    "a temperature below 0": (_with(_set(["steps", 1, "settings", "temperature"], -0.5)), "recording_wrong_type",
                              {"field": "steps[1].settings.temperature", "kind_text": "replay.kind_number"}),
    "a step without its settings": (_with(_set(["steps", 1, "settings"], KeyError)), "recording_missing",
                                    {"field": "steps[1].settings"}),
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


def test_rerun_on_the_command_line_says_match_or_the_first_difference(tmp_path, capsys):
    assert main(["rerun", str(MICRO), "--device", "cpu"]) == 0
    assert capsys.readouterr().out == text("replay.rerun_match", "en").format(
        model="micro", device="cpu", dtype="float32", n=2, tol=PROB_TOLERANCE, gap="0.0e+00") + "\n"
    nudged = tmp_path / "nudged.json"
    nudged.write_bytes(_with(_set(["steps", 1, "top", 1, "prob"], 0.5)))
    assert main(["rerun", str(nudged), "--device", "cpu"]) == 1
    assert capsys.readouterr().out.startswith("DIFFERENT at step 1: a probability is more than 0.0001 apart.")
    assert main(["rerun", str(SPECULATIVE_RECORDING), "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("MATCH: re-running small with small-draft here (cpu, float32)")


def test_rerun_on_the_command_line_refuses_what_it_cannot_run_in_one_sentence(tmp_path, capsys, monkeypatch):
    import model.weights.catalog

    large = tmp_path / "large.json"
    with large.open("wb") as f:
        f.truncate(MAX_RECORDING_BYTES + 1)
    files = {"missing": tmp_path / "none.json", "folder": tmp_path, "large": large, "not json": tmp_path / "x.json",
             "unknown model": tmp_path / "nobody.json", "absent model": tmp_path / "gemma3.json"}
    files["not json"].write_text("not json")
    # faults review 2026-12-04 #9: /dev/zero was read without end (3 GB in 3.5 s), a FIFO waited for a writer
    files["device"], files["fifo"] = Path("/dev/zero"), tmp_path / "fifo"
    os.mkfifo(files["fifo"])
    files["unknown model"].write_bytes(_with(_set(["model", "name"], "nobody")))
    files["absent model"].write_bytes((MICRO.parent / "gemma3.json").read_bytes())
    monkeypatch.setattr(model.weights.catalog, "list_models", lambda models_dir=None: ["micro", "small"])
    said = {}
    for case, path in files.items():
        assert main(["rerun", str(path), "--device", "cpu"]) == 2, case
        out, err = capsys.readouterr()
        assert not out and err.count("\n") == 1, (case, err)
        said[case] = err.strip()
    assert said["missing"] == f"Cannot read the recording {files['missing']}: No such file or directory."
    assert said["folder"] == f"Cannot read the recording {tmp_path}: Is a directory."
    assert said["large"] == text("error.recording_too_large", "en").format(kb=2048, most=2048)
    assert said["not json"] == text("error.recording_not_json", "en")
    assert said["device"] == "Cannot read the recording /dev/zero: not a regular file."
    assert said["fifo"] == f"Cannot read the recording {files['fifo']}: not a regular file."
    assert said["unknown model"] == text("error.recording_model_unknown", "en").format(model="nobody")
    assert said["absent model"] == text("error.recording_model_absent", "en").format(model="gemma3")


# -- the page ------------------------------------------------------------------------------------------------------

def step_parts(html: str) -> tuple[str, list[str], list[str]]:
    """(the token strip, the probabilities of the first five bars, the cache table's last row) of a step's HTML."""
    strip = re.search(r'<div class="tok-strip">.*?</div></div>', html).group(0)
    values = re.findall(r'<div class="val">([^<]*)</div>', html)[:5]
    last_row = re.findall(r"<tr>(.*?)</tr>", html.split("<tbody>")[1])[-1]
    return strip, values, re.findall(r"<td>([^<]*)</td>", last_row)[:4]


def uploaded(run: dict) -> dict:
    """The session state of a file chosen in the uploader and read: the run and the file's name."""
    return {"replay_uploaded": run, "replay_uploaded_name": "run.json"}


def page_html(at) -> str:
    return next(e.value for e in at.main if type(e).__name__ == "Html" and "tok-strip" in e.value)


def test_a_replay_shows_the_live_run_s_tokens_probabilities_and_cache_figures():
    from model.engine.loading import load_model
    from ui.run import run_as_trace_json

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
                      **uploaded(recording))
    assert len(live) == len(recording["steps"]) >= 3
    for index, (strip, probs, row) in enumerate(live):
        if index:
            click(replay, "replay_next")
        shown = step_parts(page_html(replay))
        assert shown == (strip, probs, row), index
    assert replay.button(key="replay_next").disabled
    click(replay, "replay_back")
    assert step_parts(page_html(replay)) == live[-2]


def _sentence(html: str, key: str, lang: str, **details) -> bool:
    """Whether the step's HTML holds the text key's sentence with these details, as the page writes markdown."""
    from ui.widgets import markdown_html

    return markdown_html(text(key, lang).format(**details)) in html


def test_a_run_whose_settings_changed_mid_run_replays_each_step_with_its_own():
    """W6 (issue 36): a Decode run sampled at T = 1.5, switched to greedy on its last step. The recording keeps
    each step's settings: step 0 (not the most probable token: 'ngủ' beside 'uống') is said to be drawn at 1.5,
    not "greedy, the highest logit always wins", and the re-run draws each step with its own settings."""
    from model.engine.loading import load_model
    from ui.run import run_as_trace_json

    small = load_model("small", "cpu")
    at = open_app("app_pages/decode.py", lang="en", model_name="small", device="cpu", prompt_mode="text",
                  temperature=1.5, seed=0, prompt_text="con mèo")
    click(at, "run_prefill")
    click(at, "next")
    click(at, "next")
    at.select_slider(key="temperature").set_value(0.0).run()
    gen = at.session_state["generation"]
    recording = read_recording(run_as_trace_json(small, gen, at.session_state["prompt_of_run"], []).encode())
    assert [s["settings"]["temperature"] for s in recording["steps"]] == [1.5, 1.5, 0.0]
    first = recording["steps"][0]
    assert (first["chosen_token"], first["top"][0]["token"]) == ("ngủ", "uống")
    replay = open_app("app_pages/replay.py", lang="en", device="cpu", replay_source="upload", **uploaded(recording))
    html = page_html(replay)
    assert _sentence(html, "replay.chosen", "en", token="ngủ", id=first["chosen_id"],
                     p=f"{first['chosen_prob']:.3f}", temperature="1.5", top_k="off", top_p="1", seed=0, n=5)
    assert "greedy" not in html
    click(replay, "replay_next")
    click(replay, "replay_next")
    last = recording["steps"][2]
    assert _sentence(page_html(replay), "replay.chosen_greedy", "en", token=md_escape(last["chosen_token"]),
                     id=last["chosen_id"], p=f"{last['chosen_prob']:.3f}", n=5)
    assert rerun(small, recording).matches
    assert rerun(small, _as_trace_v1(recording)).difference.step == 0  # the last settings for every step: greedy


def _as_trace_v1(run: dict) -> dict:
    """The recording as a trace/1 file wrote it: only the run's last settings."""
    old = copy.deepcopy(run)
    old["schema"] = TRACE_V1
    for step in old["steps"]:
        del step["settings"]
    return old


@pytest.mark.parametrize("lang", LANGUAGES)
def test_an_older_recording_says_it_keeps_only_the_run_s_last_settings(lang):
    """A trace/1 file still opens and re-runs; each step's sentence names the run's last settings as such and does
    not call the step greedy or sampled."""
    old = _as_trace_v1(shipped_recording("micro"))
    assert read_recording(json.dumps(old).encode()) == old
    at = open_app("app_pages/replay.py", lang=lang, device="cpu", replay_source="upload", **uploaded(old))
    step = old["steps"][0]
    assert _sentence(page_html(at), "replay.chosen_last_settings", lang, token="cá", id=4,
                     p=number_in(step["chosen_prob"], lang, ".3f"), temperature="0",
                     top_k=text("replay.top_k_off", lang), top_p="1", seed=0, n=5, schema=md_escape(TRACE_V1))
    greedy_clause = text("replay.chosen_greedy", lang).split("): ")[1].split(".")[0]  # "greedy, since …"
    assert greedy_clause not in page_html(at)
    assert rerun(_model("micro"), old).matches


def test_the_step_counter_names_the_first_and_the_last_step():
    """M8 (issue 36): steps count from 0, the prefill's as on Decode, so small's 4 steps end at "step 3 (steps
    0–3)"; "step 3 of 3" read as three steps."""
    n = len(shipped_recording("small")["steps"])
    at = open_app("app_pages/replay.py", lang="en", device="cpu", replay_source="small")
    for _ in range(n - 1):
        click(at, "replay_next")
    assert f"**Recording · step {n - 1} (steps 0–{n - 1})**" in [m.value for m in at.markdown]


def test_an_uploaded_recording_is_named_above_its_replay():
    """The replay names the file it shows: a file the browser's box refuses (over its limit) never reaches the
    page, which goes on with the file named here."""
    recording = shipped_recording("micro")
    at = open_app("app_pages/replay.py", lang="vi", device="cpu", replay_source="upload", **uploaded(recording))
    assert text("replay.replaying", "vi").format(name="run\\.json", box=8) in [
        c.value for c in at.caption]


def test_a_refused_file_is_said_until_another_is_chosen_in_the_page_s_language():
    """The refusal stays under the box while its file is there: a rerun or a language switch once left the refused
    file in the box with no word of why (the sentence was said once). Red with the refusal said once."""
    at = open_app("app_pages/replay.py", lang="en", device="cpu", replay_source="upload",
                  replay_refusal=InputError("recording_not_json"))
    for lang in ("en", "vi", "vi"):
        if at.session_state["lang"] != lang:
            at.radio(key="lang").set_value(lang)
        at.run()
        assert [e.value for e in at.error] == [text("error.recording_not_json", lang)], lang
        assert text("replay.upload_first", lang) in [i.value for i in at.info]


def test_re_running_a_prompt_id_outside_the_model_s_vocabulary_says_which():
    """A speculative recording keeps no vocabulary size, so its prompt ids are checked against the model before the
    re-run: the sentence names the id's field (it was "Something unexpected went wrong… Try again")."""
    outside = shipped_recording("small-speculative")
    outside["prompt"]["ids"][1] = 10**6
    at = open_app("app_pages/replay.py", lang="en", device="cpu", replay_source="upload",
                  **uploaded(read_recording(json.dumps(outside).encode())))
    click(at, "replay_rerun_button")
    assert at.error[0].value == text("error.recording_token_id", "en").format(field=md_escape("prompt.ids[1]"),
                                                                               model="small")


@pytest.mark.parametrize("lang", LANGUAGES)
def test_a_smollm2_replay_opens_with_no_model_loaded(monkeypatch, lang):
    import model.engine.loading
    import ui.models

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the model loader was called")

    for where, name in ((model.engine.loading, "load_model"), (ui.models, "load_model"),
                        (ui.models, "shared_model")):
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
        model="micro", device="cpu", dtype="float32", n=2, tol="10⁻⁴", gap="0")  # the session's format


def test_a_recording_of_a_model_not_here_says_how_to_get_it(monkeypatch):
    import model.weights.catalog

    monkeypatch.setattr(model.weights.catalog, "list_models", lambda models_dir=None: ["small", "micro"])
    at = open_app("app_pages/replay.py", lang="vi", device="cpu", replay_source="gemma3")
    assert at.info[0].value == text("replay.model_absent", "vi").format(model="gemma3")
    assert "replay_rerun_button" not in [b.key for b in at.button]


def choose_file(page, file) -> None:
    """`file` into the uploader, the box emptied first with its ✕ as a user may. A file dropped onto a full box is
    two changes from Streamlit's uploader, the box emptied and then the new file (the page's callback saw None,
    then the file, for 112 of 120 drops here; the other 8 came as one); in two full runs the page then ended
    showing nothing for the file in the box. Emptying the box first makes each step one change."""
    remove = page.locator("[data-testid='stFileChipDeleteBtn'] button")
    if remove.count():
        remove.first.click()
        wait_idle(page)
    page.locator("input[type=file]").set_input_files(file if isinstance(file, str) else [file])


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
    page.get_by_role("button", name=text("action.next", lang)).click()
    page.get_by_text(step.format(step=1, last=1)).wait_for()
    page.get_by_role("button", name=text("action.back", lang)).click()
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
    choose_file(page, {"name": "old.json", "mimeType": "application/json",
                       "buffer": json.dumps({**_micro(), "schema": "decode-lab.trace/0"}).encode()})
    page.get_by_text("decode-lab.trace/0", exact=False).first.wait_for()
    choose_file(page, str(MICRO.parent / "gemma3.json"))
    # gemma3's 12 steps; it once took over the default 30 s with another job running beside the suite
    page.get_by_text(step.format(step=0, last=11)).wait_for(timeout=120_000)
    assert page.get_by_text(mark).count() == 1
    named = page.locator("[data-testid='stCaptionContainer']", has_text="gemma3.json")
    assert named.count() == 1
    wait_idle(page)
    assert page.locator("[data-testid='stException']").count() == 0
    page.screenshot(path=str(artifacts / f"replay-upload-1440x900-{lang}.png"))
    # over the recording's 2 MB: the page says so and replays nothing (it went on replaying gemma3.json, while only
    # the box's own chip said the file was refused)
    choose_file(page, {"name": "big.json", "mimeType": "application/json", "buffer": b" " * (3 * 2**20)})
    page.get_by_text(text("error.recording_too_large", lang).format(kb=3072, most=2048)).wait_for(timeout=60_000)
    wait_idle(page)
    assert page.get_by_text(mark).count() == 0 and named.count() == 0
    # over the box's own limit the file never reaches the page: the replay stays on the file it names
    choose_file(page, str(MICRO.parent / "gemma3.json"))
    page.get_by_text(step.format(step=0, last=11)).wait_for(timeout=120_000)
    wait_idle(page)
    page.locator("input[type=file]").set_input_files(files=[{
        "name": "huge.json", "mimeType": "application/json", "buffer": b" " * (9 * 2**20)}])
    page.get_by_text("huge.json").first.wait_for()
    wait_idle(page)
    assert page.get_by_text(mark).count() == 1 and named.count() == 1
    assert page.locator("[data-testid='stException']").count() == 0


# -- speculative runs on the page ----------------------------------------------------------------------------------

def _refuse_the_loader(monkeypatch) -> list:
    import model.engine.loading
    import ui.models

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the model loader was called")

    for where, name in ((model.engine.loading, "load_model"), (ui.models, "load_model"),
                        (ui.models, "shared_model")):
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

    from model.recording.speculative import report

    live = click(open_page("en", prompt="my mother cooks", gamma=3), "spec_start")
    views = []
    while True:
        views.append((_round_view(live)[:2], _tables(live), [m.value for m in live.metric]))
        if live.session_state["spec_run"].stop_reason is not None:
            break
        click(live, "spec_next")
    recording = read_recording(json.dumps(report(live.session_state["spec_run"], None, [])).encode())
    replay = open_app("app_pages/replay.py", lang="en", device="cpu", replay_source="upload",
                      **uploaded(recording))
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

    from model.recording.speculative import report

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
        model="small", draft="small\\-draft", device="cpu", dtype="float32", n=3, tol="10⁻⁴", gap="0")


def test_a_tampered_speculative_recording_re_runs_to_the_round_that_differs(monkeypatch):
    tampered = shipped_recording("small-speculative")
    tampered["rounds"][0]["proposed"][0]["id"] = 7
    at = open_app("app_pages/replay.py", lang="vi", device="cpu", replay_source="upload",
                  **uploaded(read_recording(json.dumps(tampered).encode())))
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


def test_choosing_another_recording_drops_a_refusal():
    """The box that held the refused file goes with the upload source, and its sentence with it."""
    at = open_app("app_pages/replay.py", lang="en", device="cpu", replay_source="upload",
                  replay_refusal=InputError("recording_not_json"))
    assert len(at.error) == 1
    at.selectbox(key="replay_source.en").set_value("micro").run()
    at.selectbox(key="replay_source.en").set_value("upload").run()
    assert not at.error and text("replay.upload_first", "en") in [i.value for i in at.info]
