"""Tokenizers of the native models, from a `tokenizers` tokenizer.json: the bundled models' word-level one
with unknown-word reporting, and subword (byte-level BPE) ones with a chat template (SmolLM2).

`TextTokenizer` is what the steps and the pages use; the transformers backend's HFTokenizer provides it too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from model.errors import InputError

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


class TextTokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    chat_template: str | None  # a Jinja template over messages; None: the model has no chat format

    def encode(self, text: str) -> Encoded: ...

    def encode_chat(self, messages: list[dict[str, str]]) -> Encoded: ...

    def token(self, token_id: int) -> str: ...

    def decode(self, ids: list[int]) -> str: ...


class HasTokenizer(Protocol):
    tokenizer: TextTokenizer


def chat_messages(user_text: str, system_text: str | None = None) -> list[dict[str, str]]:
    system = [{"role": "system", "content": system_text}] if system_text and system_text.strip() else []
    return [*system, {"role": "user", "content": user_text}]


def encode_chat(model: HasTokenizer, user_text: str, system_text: str | None = None) -> Encoded:
    """The user's text (after an optional system prompt) in the model's chat template, with the prompt that
    opens the assistant's answer; the template's special tokens (<|im_start|>, <|im_end|>) are tokens too."""
    if not user_text.strip():
        raise InputError("empty_prompt")
    if model.tokenizer.chat_template is None:
        raise InputError("no_chat_template")
    return model.tokenizer.encode_chat(chat_messages(user_text, system_text))


def render_chat(template: str, messages: list[dict[str, str]], **special_tokens: str | None) -> str:
    """The template applied as transformers' apply_chat_template does: a sandboxed Jinja environment with
    trim_blocks / lstrip_blocks, and add_generation_prompt so that the text ends where the answer begins."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, **kw: json.dumps(value, ensure_ascii=False, **kw)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special_tokens)
    except TemplateError as bad:
        raise InputError("bad_chat_template", reason=str(bad)) from None


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
        self.chat_template = None

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

    def encode_chat(self, messages: list[dict[str, str]]) -> Encoded:
        raise InputError("no_chat_template")

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


class SubwordTokenizer:
    """A subword tokenizer.json (byte-level BPE, as GPT-2 and SmolLM2 use) with its tokenizer_config.json:
    special token names and the chat template. Byte-level pieces cover every text, so nothing is unknown."""

    def __init__(self, tokenizer: Tokenizer, config: dict):
        self._tok = tokenizer
        self._special = {name: config.get(name) if isinstance(config.get(name), str) else None
                         for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.bos_id = self._id(self._special["bos_token"])
        self.eos_id = self._id(self._special["eos_token"])
        self.unk_id = self._id(self._special["unk_token"])
        self.add_bos = bool(config.get("add_bos_token")) and self.bos_id is not None
        template = config.get("chat_template")
        self.chat_template = template if isinstance(template, str) else None

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> Encoded:
        """Ids as the tokenizer makes them; special-token names in the text become those tokens."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos:
            ids = [self.bos_id, *ids]
        return Encoded(ids, [self.token(i) for i in ids], [])

    def encode_chat(self, messages: list[dict[str, str]]) -> Encoded:
        return self.encode(render_chat(self.chat_template, messages, **self._special))

    def token(self, token_id: int) -> str:
        """A readable form: the text the token stands for (" the"), or its raw name when that is only part of
        a character (byte-level pieces of a Vietnamese letter)."""
        raw = self._tok.id_to_token(token_id) if token_id >= 0 else None
        if raw is None:
            return f"<{token_id}>"
        text = self._tok.decode([token_id], skip_special_tokens=False)
        return text if text and "\ufffd" not in text else raw

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def read_tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json as a dict; {} where there is none."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return config if isinstance(config, dict) else {}


def load_tokenizer(folder: str | Path) -> WordTokenizer | SubwordTokenizer:
    """The word-level tokenizer of the bundled models, or a subword one (tokenizer.json is read once)."""
    folder = Path(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    if isinstance(tokenizer.model, models.WordLevel):
        return WordTokenizer(tokenizer)
    return SubwordTokenizer(tokenizer, read_tokenizer_config(folder))
