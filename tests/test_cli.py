"""The command line's options (issue 41): every number an option takes has one range, which its --help states and
which is refused outside it in one sentence, exit status 2, before any work; a file a command writes is checked
before the work and never claimed when it was not written; each command's defaults hold on every listed model; the
operator's prompt is limited by the model's context, not by the pages' 2,000 characters."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import needs_kernels

from model.engine import generate
from model.engine.token_tax import cache_shape, tax_models
from model.errors import InputError
from model.serving.memory import MAX_SLOTS
from model.tools import cli, serve_bench
from model.weights.catalog import list_models, locate, read_config

# the required options of each command, and small values so that an accepted value would run quickly
BASE = {
    "trace": ["--model", "micro", "--prompt-ids", "1,3"],
    "speculate": ["--model", "small", "--prompt-ids", "1,5", "--max-new-tokens", "2"],
    "train": ["--model", "small", "--steps", "1"],
    "finetune": ["--method", "sft", "--steps", "1"],
    "serve-bench": ["--model", "micro", "--dtype", "float32", "--batch", "1", "--context", "4", "--steps", "1"],
    "profile": ["--model", "micro", "--steps", "1"],
}
STATED = ("between", "at least", "greater than", "≥")  # how a help says a range


def run(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(args))
    except SystemExit as exit_:  # argparse refusing an option
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def subcommands() -> dict[str, object]:
    [sub] = [a for a in cli.parser()._actions if a.dest == "command"]
    return sub.choices


def numeric_options() -> list[tuple[str, object]]:
    """(command, argparse action) of every option or argument that takes a number, or a list of numbers."""
    return [(name, action) for name, command in subcommands().items() for action in command._actions
            if action.type in (int, float) or "each between" in (action.help or "")]


def number(text: str) -> int | float:
    return float(text) if any(c in text for c in ".e") else int(text)


def outside(help_text: str) -> tuple[str, list]:
    """The range a help states, as the refusal must say it too, and values just outside it."""
    if m := re.search(r"between (-?\d[\d.e+-]*) and (-?\d[\d.e+-]*)", help_text):
        low, high = number(m[1]), number(m[2])
        below = low - 1 if isinstance(low, int) or low <= 0 else low / 2
        if f"; {below} = " in help_text:  # 0 = the default: one further down
            below -= 1
        return m[0], [below, high + 1 if isinstance(high, int) else high * 2]
    if m := re.search(r"greater than (\d+) and at most (\d[\d.]*\d|\d)", help_text):
        return m[0], [number(m[1]), number(m[2]) * 2]
    if m := re.search(r"at least (\d+)", help_text):
        return m[0], [number(m[1]) - 1]
    if m := re.search(r"a finite number ≥ (\d+)", help_text):
        return m[0], [number(m[1]) - 1, math.inf]
    return "", []


@pytest.mark.parametrize(("command", "action"), numeric_options(), ids=lambda x: getattr(x, "dest", x))
def test_every_number_an_option_takes_has_its_range_in_help(command, action):
    assert any(word in (action.help or "") for word in STATED), f"{command} {action.dest}: {action.help!r}"


REFUSALS = [(command, action, value) for command, action in numeric_options()
            for value in outside(action.help or "")[1]]


@pytest.mark.parametrize(("command", "action", "value"), REFUSALS,
                         ids=[f"{c}-{a.dest}-{v}" for c, a, v in REFUSALS])
def test_a_value_outside_the_help_s_range_is_refused_in_the_help_s_words(capsys, command, action, value):
    """The range stated in --help is the one checked, said the same way, naming the option; nothing printed before.
    Red when a help and its check drift apart, when a check is missing (exit 0 or a run), or a traceback."""
    phrase, _ = outside(action.help)
    given = str(value)
    if action.option_strings:
        args = [command, *BASE.get(command, []), action.option_strings[0], given]
    else:  # count's N and T
        args = [command, given, "1"] if action.dest == "N" else [command, "1", given]
    code, out, err = run(capsys, *args)
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and phrase in err, err


def test_the_counts_of_profile_and_serve_bench_are_refused_before_any_model_is_loaded(capsys, monkeypatch):
    """Item 1: `profile --steps 99999999` ate 16.4 GB; `serve-bench --steps 99999999` ran without end."""
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(serve_bench, "load_model", no_loading)
    for args, said in ((["profile", "--steps", "99999999"], "--steps must be between 1 and 50;"),
                       (["serve-bench", "--steps", "99999999"], "--steps must be between 1 and 1000;"),
                       (["profile", "--batch", "33"], "--batch must be between 1 and 32;"),
                       (["serve-bench", "--batch", "1,64"], "--batch must be between 1 and 32;"),
                       (["serve-bench", "--batch", ",".join(map(str, range(1, 10)))], "8 different"),
                       (["serve-bench", "--batch", "2,2"], "8 different")):
        code, out, err = run(capsys, *args)
        assert (code, out) == (2, "") and err.count("\n") == 1 and said in err, (args, err)


def test_serve_bench_steps_0_and_negative_are_a_sentence_about_steps(capsys):
    """Item 5 and 8: an IndexError with status 1, after the default context's sentence, before."""
    for steps in ("0", "-2"):
        code, _, err = run(capsys, "serve-bench", "--model", "micro", "--steps", steps)
        assert code == 2 and err == f"--steps must be between 1 and 1000; the value given is {steps}.\n"


def test_tokens_with_a_word_outside_micro_s_vocabulary_is_a_sentence(capsys):
    """Item 5: micro's vocabulary has no <unk>, its tokenizer raised UnknownWordsError (a traceback)."""
    code, out, err = run(capsys, "tokens", "--models", "micro", "--text", "con zebra")
    assert (code, out) == (2, "")
    assert err == "The model micro does not know the words: con, zebra. Use only words from its vocabulary.\n"


def test_tokens_opens_a_model_folder_as_trace_does_and_skips_empty_names(capsys):
    """The operator's tokens refused a folder in the web server's words ("This server opens only the models in its
    list…"), and --models "," was an IndexError."""
    folder = locate("micro").where
    code, out, err = run(capsys, "tokens", "--models", f"{folder},", "--text", "ăn cá", "--json")
    assert code == 0, err
    [row] = json.loads(out)["models"]
    assert row["model"] == folder and row["sentences"][0]["tokens"] == ["<bos>", "ăn", "cá"]
    code, out, err = run(capsys, "tokens", "--models", ",", "--text", "con mèo", "--json")
    assert code == 0, err
    assert [row["model"] for row in json.loads(out)["models"]] == tax_models()


# -- --trace: checked as finetune --save is, written whole or said not to be ------------------------------------------

@pytest.mark.parametrize("case", ["folder", "under_a_file", "missing_folder", "proc", "exists", "empty"])
def test_a_bad_trace_path_is_refused_before_the_work_and_nothing_is_written(capsys, monkeypatch, tmp_path, case):
    """Item 2: each of these said "Chrome trace: PATH" and exit 0 after the run (one left PATH.tmp behind), and an
    existing file was overwritten without a word."""
    (tmp_path / "a-file").write_text("mine")
    (tmp_path / "folder").mkdir()
    path = {"folder": tmp_path / "folder", "under_a_file": tmp_path / "a-file" / "t.json",
            "missing_folder": tmp_path / "missing" / "t.json", "proc": Path("/proc/decode-lab-t.json"),
            "exists": tmp_path / "a-file", "empty": ""}[case]

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(serve_bench, "load_model", no_loading)
    code, out, err = run(capsys, "profile", "--model", "micro", "--steps", "1", "--trace", str(path))
    assert (code, out) == (2, "") and err.count("\n") == 1 and err.startswith("--trace"), err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a-file", "folder"]
    assert (tmp_path / "a-file").read_text() == "mine"


def test_a_trace_the_profiler_did_not_write_is_said_not_claimed_and_nothing_stays(capsys, monkeypatch, tmp_path):
    """The profiler's own write can still fail after the check (torch only logs it): the command says so, exit 2,
    and the temporary files (the profiler's PATH.tmp too) are gone. Red without the check after the write."""
    def writes_only_its_tmp(model, batch, context, steps, trace_file=None):
        Path(trace_file + ".tmp").write_text("{")
        return []

    monkeypatch.setattr(serve_bench, "profile_steps", writes_only_its_tmp)
    target = tmp_path / "t.json"
    code, out, err = run(capsys, "profile", "--model", "micro", "--steps", "1", "--trace", str(target))
    assert code == 2 and "Chrome trace" not in out
    assert err == f"--trace {target}: the file was not written (No such file or directory).\n"
    assert list(tmp_path.iterdir()) == []


def test_overwrite_replaces_an_existing_trace_and_leaves_nothing_else(capsys, tmp_path):
    (tmp_path / "t.json").write_text("old")
    code, out, err = run(capsys, "profile", "--model", "micro", "--steps", "2", "--trace", str(tmp_path / "t.json"),
                         "--overwrite")
    assert code == 0, err
    assert '"traceEvents"' in (tmp_path / "t.json").read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]
    assert out.splitlines()[-1] == f"Chrome trace: {tmp_path / 't.json'} (open it in https://ui.perfetto.dev)"


# -- defaults that hold on every listed model; refusals that name the option typed -------------------------------------

@pytest.mark.parametrize("name", list_models())
def test_serve_bench_and_profile_defaults_fit_every_listed_model(name):
    """Item 8: serve-bench's default contexts 64,256 were past small's 128 positions (and profile's 64 past
    micro's 16). Each default context fits the model, and its default batches' KV cache (the slot buffers may
    reserve twice the cache of context + 1 positions, counted here from config.json) fits the default budget."""
    config = read_config(Path(locate(name).where) / "config.json", name)
    context_length = config["max_position_embeddings"]
    contexts = serve_bench.default_contexts(SimpleNamespace(info=SimpleNamespace(context_length=context_length)))
    profile_context = min(serve_bench.PROFILE_CONTEXT, context_length - 1)
    assert contexts and all(1 <= c < context_length for c in [*contexts, profile_context])
    shape = cache_shape(config)
    batches = [int(b) for b in serve_bench.DEFAULT_BATCHES.split(",")]  # the sweep's, when --batch is not given
    assert max(batches) <= MAX_SLOTS
    assert 2 * max(batches) * shape.cache_bytes(max(contexts) + 1) <= generate.session_budget_bytes()


def test_serve_bench_runs_small_with_its_defaults_and_says_the_context_it_chose(capsys):
    code, out, err = run(capsys, "serve-bench", "--model", "small", "--dtype", "float32", "--batch", "1",
                         "--steps", "1", "--json")
    assert code == 0, err
    assert {row["context"] for row in json.loads(out)["rows"]} == {64}
    code, out, err = run(capsys, "profile", "--model", "micro", "--steps", "1")
    assert code == 0 and "15 positions" in out.splitlines()[0], err


@needs_kernels
def test_serve_bench_says_the_accuracy_it_measured_and_none_it_did_not(capsys):
    """It claimed "accuracy over 4 prompts of 16 ids × 24 tokens" on micro, whose 16 positions hold prompts of
    16 // 4 = 4 ids and 16 - 4 = 12 new tokens, and with float32 alone, which compares nothing."""
    args = ["serve-bench", "--model", "micro", "--batch", "1", "--context", "4", "--steps", "1", "--json"]
    code, out, err = run(capsys, *args, "--dtype", "float32,int8")
    assert code == 0, err
    report = json.loads(out)
    assert report["conditions"].endswith("; accuracy over 4 prompts of 4 ids × 12 tokens float32 wrote")
    assert report["accuracy"][0]["greedy_total"] == 4 * 12
    code, out, err = run(capsys, *args, "--dtype", "float32")
    assert code == 0 and "accuracy" not in json.loads(out)["conditions"], err


@pytest.mark.parametrize(("model", "prompt", "draft"), [("micro", "1,3", "lookup"), ("small", "1,5", "small-draft")])
def test_speculate_s_default_draft_serves_the_model(capsys, model, prompt, draft):
    """small-draft was the default for every model, and every model but small refused it (another tokenizer)."""
    code, out, err = run(capsys, "speculate", "--model", model, "--prompt-ids", prompt, "--max-new-tokens", "2",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["draft"] == draft


@pytest.mark.parametrize(("args", "said"), [
    (["serve-bench", "--model", "micro", "--dtype", "float32", "--context", "16"],
     "--context must be between 1 and 15;"),
    (["profile", "--model", "micro", "--context", "16"], "--context must be between 1 and 15;"),
    (["serve-bench", "--model", "micro", "--batch", "8", "--seed", "2147483641"],
     "--seed must be between 0 and 2147483640;"),  # row 7 would draw with seed + 7, past 2^31 - 1
])
def test_a_refusal_names_the_option_typed(capsys, args, said):
    code, out, err = run(capsys, *args)
    assert (code, out) == (2, "") and err.count("\n") == 1 and said in err, err


def test_the_kv_budget_is_said_in_the_operator_s_words(capsys, monkeypatch):
    """profile refused with "the session's budget", a web page's idea, where the operator's limit is
    DECODE_LAB_SESSION_MB."""
    monkeypatch.setenv("DECODE_LAB_SESSION_MB", "1")
    code, _, err = run(capsys, "profile", "--model", "small", "--batch", "32", "--context", "127", "--steps", "1")
    assert code == 2 and "session" not in err
    # small: 2 (K, V) × 4 layers × 2 KV heads × 32 × 4 B = 2,048 B a position; 128 positions in each of 32 padded
    # slots, reserved whole (measure.check_batch: memory.padded_bytes)
    assert err.startswith("--batch 32 with --context 127 needs up to 8 MiB of KV cache, past the 1 MiB that "
                          "DECODE_LAB_SESSION_MB allows"), err


# -- one range per option, the same words everywhere -----------------------------------------------------------------

@pytest.mark.parametrize(("args", "said"), [
    (["finetune", "--method", "lora", "--steps", "1", "--rank", "0"], "Rank r must be between 1 and 256;"),
    (["finetune", "--method", "lora", "--steps", "1", "--rank", "100000"], "Rank r must be between 1 and 256;"),
    (["finetune", "--method", "dpo", "--steps", "1", "--beta", "0"], "β must be between 0.0001 and 100;"),
    (["finetune", "--method", "dpo", "--steps", "1", "--beta", "0.00005"], "β must be between 0.0001 and 100;"),
    (["finetune", "--method", "rlhf", "--steps", "1", "--reward-steps", "-1"],
     "Reward-model steps must be between 1 and 1000;"),
    (["finetune", "--method", "rlhf", "--steps", "1", "--reward-steps", "0"],
     "Reward-model steps must be between 1 and 1000;"),
    (["trace", "--model", "micro", "--prompt-ids", "1,3", "--temperature", "inf"],
     "Temperature must be a finite number ≥ 0"),
    (["trace", "--model", "micro", "--prompt-ids", "1,3", "--temperature", "nan"],
     "Temperature must be a finite number ≥ 0"),
    (["serve-bench", "--model", "micro", "--seed", str(10**20)], "--seed must be between 0 and"),
    (["trace", "--model", "micro", "--prompt-ids", "1,3", "--seed", str(10**20)],
     "Seed must be between 0 and 2147483647;"),
    (["train", "--model", "micro", "--steps", "1", "--seed", str(10**20)], "Seed must be between 0 and 2147483647;"),
    (["count", "1", str(10**2200)], "T must be between 1 and 1000000000;"),  # 10^4400 positions: unprintable
])
def test_one_range_per_option_said_the_same_way_at_both_ends(capsys, args, said):
    code, out, err = run(capsys, *args)
    assert (code, out) == (2, "") and err.count("\n") == 1 and err.startswith(said), err


def test_a_fine_tuning_loss_that_blows_up_is_said_in_the_command_line_s_words(capsys, monkeypatch):
    """finetune ended with the page's "lower the learning rate or press Reset"."""
    from model.training.sft import SFT

    def blows_up(self):
        raise InputError("train_not_finite", step=1, loss=math.nan, lr="1.00e+00")

    monkeypatch.setattr(SFT, "step", blows_up)
    code, out, err = run(capsys, "finetune", "--method", "sft", "--steps", "2")
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith("Step 1 was not applied") and err.endswith("try a smaller --lr.\n"), err


# -- the operator's prompt: the model's context, not the pages' characters -------------------------------------------

LONG = "the cat sleeps on the chair. " * 80  # 2,320 characters; 561 of small's tokens


def test_the_command_line_s_prompt_is_limited_by_the_context_not_by_the_pages_characters(capsys, small):
    assert len(LONG) > generate.MAX_PROMPT_CHARS
    code, _, err = run(capsys, "trace", "--model", "small", "--prompt", LONG)
    assert code == 2
    assert err == "The prompt has 561 tokens but the context window holds only 128 positions: shorten the prompt.\n"
    code, _, err = run(capsys, "tokens", "--models", "small", "--text", LONG)
    assert code == 2 and err.startswith("--text is 561 tokens long in the model small"), err
    long_word = "con " + "x" * 2100  # 2,104 characters that small reads as 3 tokens: <bos> con <unk>
    code, out, err = run(capsys, "trace", "--model", "small", "--prompt", long_word, "--max-new-tokens", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["prompt"]["tokens"] == ["<bos>", "con", "<unk>"]
    with pytest.raises(InputError) as page:  # a page keeps its limit, and its words
        generate.encode_prompt(small, long_word)
    assert page.value.code == "prompt_too_many_chars"
