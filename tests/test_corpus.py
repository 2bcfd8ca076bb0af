import re
import unicodedata
from collections import Counter

import pytest
from tokenizers import pre_tokenizers

from model.training.corpus import EXAMPLE_PROMPTS, generate_corpus, vocabulary

PUNCTUATION = {".", ",", "?", "!"}
VIETNAMESE_LETTERS = re.compile(r"[^\x00-\x7f]")  # every Vietnamese sentence has at least one diacritic


@pytest.fixture(scope="module")
def corpus():
    return generate_corpus()


def words_of(sentence):
    return [w for w in sentence.split() if w not in PUNCTUATION]


def is_vietnamese(sentence):
    return bool(VIETNAMESE_LETTERS.search(sentence))


def test_same_seed_gives_the_same_corpus(corpus):
    assert generate_corpus(seed=0) == corpus
    assert generate_corpus(seed=7, n_sentences=500) == generate_corpus(seed=7, n_sentences=500)


def test_different_seeds_give_different_corpora(corpus):
    assert generate_corpus(seed=1) != corpus


def test_default_size(corpus):
    assert len(corpus) == 6000
    assert len(generate_corpus(n_sentences=10)) == 10


def test_vocabulary_size_is_within_bounds(corpus):
    assert 300 <= len(vocabulary(corpus)) <= 700


def test_every_word_is_frequent_enough_to_learn(corpus):
    counts = Counter(w for s in corpus for w in s.split())
    rare = {w: n for w, n in counts.items() if n < 5}
    assert not rare


def test_vocabulary_is_sorted_by_frequency_then_alphabetically(corpus):
    counts = Counter(w for s in corpus for w in s.split())
    vocab = vocabulary(corpus)
    assert sorted(vocab) == sorted(counts)
    assert vocab == sorted(counts, key=lambda w: (-counts[w], w))
    assert vocab[0] == "."  # every sentence but the questions and exclamations ends with it


def test_sentences_are_lowercase_nfc_and_well_formed(corpus):
    for s in corpus:
        assert s == s.lower() == unicodedata.normalize("NFC", s)
        assert s == " ".join(s.split()), "single spaces, no leading or trailing space"
        assert s.split()[-1] in {".", "?", "!"}
        assert 3 <= len(words_of(s)) <= 12, s


def test_no_character_that_would_split_a_word(corpus):
    for s in corpus:
        assert "'" not in s and "-" not in s
        assert all(re.fullmatch(r"\w+", w) or w in PUNCTUATION for w in s.split()), s


def test_app_tokenizer_splits_exactly_at_the_spaces(corpus):
    whitespace = pre_tokenizers.Whitespace()
    for s in set(corpus):
        assert [w for w, _ in whitespace.pre_tokenize_str(s)] == s.split()


def test_both_languages_in_about_equal_shares(corpus):
    vietnamese = sum(map(is_vietnamese, corpus))
    assert 0.45 <= vietnamese / len(corpus) <= 0.55
    english = [s for s in corpus if not is_vietnamese(s)]
    assert all(re.fullmatch(r"[a-z ,.?!]+", s) for s in english)


def test_example_prompts_are_frequent_sentence_starts(corpus):
    vocab = set(vocabulary(corpus))
    assert EXAMPLE_PROMPTS["vi"][0] == "con mèo" and EXAMPLE_PROMPTS["en"][0] == "the dog"
    for lang, prompts in EXAMPLE_PROMPTS.items():
        assert 5 <= len(prompts) <= 6
        for prompt in prompts:
            assert is_vietnamese(prompt) == (lang == "vi")
            assert set(prompt.split()) <= vocab, prompt
            starts = sum(s.startswith(prompt + " ") for s in corpus)
            assert starts >= 20, (prompt, starts)
