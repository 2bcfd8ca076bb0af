"""Word-level tokenizer of the bundled models: a `tokenizers` tokenizer.json plus unknown-word reporting."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
NO_SPACE_BEFORE = set(".,!?;:")


class UnknownWordsError(ValueError):
    """The vocabulary has no <unk> token, so words outside it cannot be encoded at all."""

    def __init__(self, words: list[str]):
        super().__init__("words outside the vocabulary: " + ", ".join(words))
        self.words = words


@dataclass
class Encoded:
    ids: list[int]
    tokens: list[str]
    unknown: list[str]  # words of the text that are not in the vocabulary (encoded as <unk>)


def build_word_tokenizer(vocab: list[str]) -> Tokenizer:
    """A lower-casing, word-level tokenizer; ids follow the order of `vocab`."""
    unk = "<unk>" if "<unk>" in vocab else None
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=unk))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([w for w in SPECIAL_TOKENS if w in vocab])
    return tok


class WordTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self.vocab = tokenizer.get_vocab()
        self.id_to_token = {i: w for w, i in self.vocab.items()}
        self.bos_id = self.vocab.get("<bos>")
        self.eos_id = self.vocab.get("<eos>")
        self.unk_id = self.vocab.get("<unk>")

    @classmethod
    def load(cls, folder: str | Path) -> WordTokenizer:
        return cls(Tokenizer.from_file(str(Path(folder) / "tokenizer.json")))

    def words(self, text: str) -> list[str]:
        normalized = self._tok.normalizer.normalize_str(text)
        return [w for w, _ in self._tok.pre_tokenizer.pre_tokenize_str(normalized)]

    def encode(self, text: str) -> Encoded:
        """<bos> followed by one id per word; unknown words become <unk> and are listed."""
        words = self.words(text)
        unknown = [w for w in words if w not in self.vocab]
        if unknown and self.unk_id is None:
            raise UnknownWordsError(unknown)
        ids = [self.vocab.get(w, self.unk_id) for w in words]
        if self.bos_id is not None:
            ids = [self.bos_id] + ids
        return Encoded(ids, [self.token(i) for i in ids], unknown)

    def token(self, token_id: int) -> str:
        return self.id_to_token.get(token_id, f"<{token_id}>")

    def decode(self, ids: list[int]) -> str:
        """Words joined by spaces, special tokens dropped, no space before punctuation."""
        text = ""
        for word in (self.token(i) for i in ids):
            if word in SPECIAL_TOKENS:
                continue
            text += word if (not text or word in NO_SPACE_BEFORE) else " " + word
        return text
