"""Tokenizers of the native models, from a `tokenizers` tokenizer.json: the bundled models' word-level one
with unknown-word reporting, and subword (byte-level BPE) ones with a chat template (SmolLM2).

`TextTokenizer` is what the steps and the pages use; the transformers backend's HFTokenizer provides it too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from model.errors import InputError

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
NO_SPACE_BEFORE = set(".,!?;:")
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback (Gemma): one byte a token
SHOWN_BYTE = re.compile(r"<[0-9A-F]{2}>")         # a byte of a cut character, as shown_bytes writes it


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as a printable letter (bytes_to_unicode); this maps them back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


BYTE_LEVEL = _byte_level_alphabet()


def shown_bytes(data: bytes) -> str:
    """Whole UTF-8 characters as text, each byte of a character cut by the tokenizer as <XX>: "á»" (the byte-level
    alias) looks like a Vietnamese letter and is not one; <E1><BB> is what the token holds."""
    text = data.decode("utf-8", errors="surrogateescape")  # a lone byte b becomes the surrogate U+DC00 + b
    return "".join(f"<{ord(c) - 0xDC00:02X}>" if "\udc80" <= c <= "\udcff" else c for c in text)


def raw_token_bytes(raw: str, text: str) -> bytes:
    """The bytes a token holds: of its text when that is whole characters, else read from its raw name (a <0xXX>
    byte token, or byte-level letters); a raw name of neither kind gives its text's bytes."""
    byte_token = BYTE_TOKEN.fullmatch(raw)
    if byte_token:
        return bytes([int(byte_token[1], 16)])
    if "\ufffd" in text and all(c in BYTE_LEVEL for c in raw):
        return bytes(BYTE_LEVEL[c] for c in raw)
    return text.encode("utf-8")


def readable_token(raw: str, text: str) -> str:
    """The text a token stands for (" the"), or, when that is only part of a character, its bytes (<E1><BB>)."""
    if text and "\ufffd" not in text:
        return text
    data = raw_token_bytes(raw, text)
    return shown_bytes(data) if "\ufffd" not in data.decode("utf-8", errors="surrogateescape") else raw


def joined_characters(tokenizer: TextTokenizer, ids: list[int]) -> list[str | None]:
    """Per position: for a byte piece (a token holding part of a character), the text that it and its neighbours
    write together ("ủ"); None for a token that is whole characters."""
    joined: list[str | None] = [None] * len(ids)
    i = 0
    while i < len(ids):
        if not SHOWN_BYTE.search(tokenizer.token(ids[i])):
            i += 1
            continue
        end = i + 1  # a character has at most 4 bytes: its pieces span at most 4 tokens
        while end < len(ids) and end - i < 4 and "\ufffd" in tokenizer.decode(ids[i:end]):
            end += 1
        text = tokenizer.decode(ids[i:end])
        for position in range(i, end):
            joined[position] = text
        i = end
    return joined


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

    def token_bytes(self, token_id: int) -> bytes: ...

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

    def token_bytes(self, token_id: int) -> bytes:
        return self.token(token_id).encode("utf-8")

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
        """A readable form: the text the token stands for (" the"), or, when that is only part of a character
        (byte-level pieces of a Vietnamese letter), its bytes as <E1><BB>."""
        raw = self._tok.id_to_token(token_id) if token_id >= 0 else None
        if raw is None:
            return f"<{token_id}>"
        return readable_token(raw, self._tok.decode([token_id], skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes:
        raw = self._tok.id_to_token(token_id) if token_id >= 0 else None
        return b"" if raw is None else raw_token_bytes(raw, self._tok.decode([token_id], skip_special_tokens=False))

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
