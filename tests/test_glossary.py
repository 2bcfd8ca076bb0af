"""One glossary per language: an action keeps one name on every page (Next is never "Bước tiếp" on one page and
"Bước kế" on another), and the stepping pages name their steps from the glossary's action.* keys."""

import re
from pathlib import Path

from model.texts import strings

ROOT = Path(__file__).resolve().parent.parent
BUTTON = re.compile(r"st\.button\(\s*t\(\"([\w.]+)\"")


def button_keys() -> set[str]:
    keys = set()
    for path in [*ROOT.glob("app_pages/*.py"), *ROOT.glob("ui/*.py")]:
        keys |= set(BUTTON.findall(path.read_text(encoding="utf-8")))
    return keys


def test_an_action_has_one_name_in_each_language():
    """Two buttons with the same English name have the same Vietnamese one, and the other way round."""
    texts = strings()
    keys = sorted(button_keys())
    assert len(keys) > 20
    for a in keys:
        for b in keys:
            same_en, same_vi = texts[a]["en"] == texts[b]["en"], texts[a]["vi"] == texts[b]["vi"]
            assert same_en == same_vi, f"{a} and {b}: {texts[a]} against {texts[b]}"


def test_the_step_buttons_take_their_names_from_the_glossary():
    """No page keeps a private key for Next, Back, Reset, Run to end, Start or Stop."""
    texts = strings()
    glossary = {texts[k]["en"]: k for k in texts if k.startswith("action.")}
    for key in button_keys():
        wanted = glossary.get(texts[key]["en"])
        assert wanted in (None, key), f"{key} names {texts[key]['en']!r}: use {wanted}"


# names of code in prose: a CamelCase class (KVCache, BlockManager), a Python file, a path into the source tree; the
# proper names below are products, papers and methods, which the texts cite
CODE_NAME = re.compile(r"\b[A-Z][a-z]+[A-Z]\w*\b|\b\w+\.py\b|\bmodel/\w+|\bKVCache\b")
PROPER_NAMES = {"SmolLM2", "DeepSeek", "FlashAttention", "PagedAttention", "LMCache", "DistServe", "TinyStories",
                "SentencePiece", "LayerNorm", "RMSNorm", "GitHub", "PyTorch", "OpenAI", "TinyLlama", "LoRA", "RoPE",
                "PyPI", "SwiGLU", "LayerSkip", "SiLU", "AdamW", "MiB", "GiB", "KiB", "StreamingLLM"}


def test_no_prose_names_a_class_a_file_or_a_source_path():
    """The CLI name of a command may stand in a code span; no class, file or source path in either language."""
    found = []
    for key, entry in strings().items():
        for lang in ("vi", "en"):
            prose = re.sub(r"`[^`]*`", "", entry[lang])
            found += [(key, lang, name) for name in CODE_NAME.findall(prose) if name not in PROPER_NAMES]
    assert found == []
