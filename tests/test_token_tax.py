"""Issue 26: the token tax, counted by each tokenizer itself."""

import json

import pytest
import test_gemma3
import test_smollm2
from tokenizers import Tokenizer

from model.engine.token_tax import TWINS, token_tax
from model.engine.tokenizer import load_tokenizer
from model.errors import InputError
from model.tools.cli import main
from model.weights.catalog import locate

VI, EN = TWINS[1]  # "con chó chạy trong vườn" · "the dog runs in the garden"


def own_encode(name: str, text: str) -> list[int]:
    """The tokenizer.json itself, through `tokenizers` alone, after the start token the model's prompt begins with
    (the word-level tokenizer of small adds it in code, Gemma 3's tokenizer.json itself)."""
    raw = Tokenizer.from_file(f"{locate(name).where}/tokenizer.json").encode(text).ids
    bos = load_tokenizer(locate(name).where).bos_id
    return raw if bos is None or raw[:1] == [bos] or name == "smollm2" else [bos, *raw]


def counts_are_the_tokenizer_s_own(name):
    tax = token_tax(name, (VI, EN))
    vi, en = tax.sentences
    assert vi.ids == own_encode(name, VI) and en.ids == own_encode(name, EN)
    assert tax.ratio == len(vi.ids) / len(en.ids)
    cost = tax.cost(vi)
    assert cost["cache_bytes"] == len(vi.ids) * tax.shape.cache_bytes(1)
    assert (cost["positions_with_cache"], cost["positions_without_cache"]) == (
        len(vi.ids) + tax.new_tokens - 1, sum(len(vi.ids) + k - 1 for k in range(1, tax.new_tokens + 1)))


def test_small_s_counts_are_its_tokenizer_s_own():
    counts_are_the_tokenizer_s_own("small")


@test_smollm2.needs_model
def test_smollm2_s_counts_are_its_tokenizer_s_own():
    counts_are_the_tokenizer_s_own("smollm2")


@test_gemma3.needs_model
def test_gemma3_s_counts_are_its_tokenizer_s_own():
    counts_are_the_tokenizer_s_own("gemma3")


@test_smollm2.needs_model
def test_smollm2_pays_the_tax_in_byte_pieces():
    """SmolLM2's English BPE cuts "chạy" into bytes: 15 tokens for the sentence against 6 for its twin."""
    vi, en = token_tax("smollm2", (VI, EN)).sentences
    assert (len(vi.ids), len(en.ids)) == (15, 6)
    assert "<E1><BA>" in vi.tokens and vi.joined[vi.tokens.index("<E1><BA>")] == "ạ"


def test_tokens_json(capsys):
    assert main(["tokens", "--text", VI, "--twin", EN, "--models", "small", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["models"]
    assert row["model"] == "small" and row["kv_bytes_per_position"] == 2048 and row["ratio"] == round(6 / 7, 4)
    assert [s["n_tokens"] for s in row["sentences"]] == [6, 7] and row["sentences"][0]["tokens"][1] == "con"


def test_an_empty_sentence_is_a_sentence():
    with pytest.raises(InputError) as bad:
        token_tax("small", (VI, "  "))
    assert bad.value.code == "empty_prompt"
