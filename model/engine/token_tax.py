"""The token tax: one sentence in Vietnamese and its English twin through each model's own tokenizer, and what the
difference costs in KV-cache bytes and in positions processed with and without the cache.

Only the tokenizers and config.json are read, no weights: the counts are the tokenizers' own encode, the bytes
the cache formula for the model as the app loads it (float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from model.engine.counting import cache_bytes_formula, positions_with_cache, positions_without_cache
from model.engine.generate import DEFAULT_NEW_TOKENS, check_prompt_text
from model.engine.tokenizer import TextTokenizer, UnknownWordsError, joined_characters, load_tokenizer
from model.errors import InputError
from model.weights.catalog import BUNDLED, list_models, locate, read_config

BYTES_PER_ELEMENT = 4  # float32, as the app loads every model
# a few sentences of the bundled small model's domain (its vocabulary holds every word), each with its twin
TWINS = (
    ("con mèo ngủ trên ghế", "the cat sleeps on the chair"),
    ("con chó chạy trong vườn", "the dog runs in the garden"),
    ("hôm nay trời mưa", "today it is raining"),
)


def tax_models() -> list[str]:
    """Every tokenizer the app has: the bundled small (micro's 8 tokens say nothing here) and each fetched model."""
    return [name for name in list_models() if name not in BUNDLED or name == "small"]


@dataclass(frozen=True)
class Pieces:
    text: str
    ids: list[int]
    tokens: list[str]            # readable: a byte piece as <E1><BB>
    joined: list[str | None]     # per token, the character a byte piece writes with its neighbours
    unknown: list[str]           # words a word-level vocabulary lacks (each one <unk>)


@dataclass(frozen=True)
class CacheShape:
    n_layers: int
    n_kv_heads: int
    d_head: int
    sliding_layers: int
    window: int | None
    context: int  # positions the model takes (max_position_embeddings): a prompt holds one fewer at most

    def cache_bytes(self, positions: int) -> int:
        return cache_bytes_formula(self.n_layers, self.n_kv_heads, positions, self.d_head, BYTES_PER_ELEMENT,
                                   self.sliding_layers, self.window)


@dataclass(frozen=True)
class ModelTax:
    model: str
    sentences: tuple[Pieces, ...]  # the Vietnamese sentence, then its English twin when there is one
    shape: CacheShape
    new_tokens: int                # the answer the position counts assume

    @property
    def ratio(self) -> float | None:
        """Tokens of the Vietnamese sentence per token of its English twin."""
        return len(self.sentences[0].ids) / len(self.sentences[1].ids) if len(self.sentences) == 2 else None

    def cost(self, pieces: Pieces) -> dict[str, int]:
        n = len(pieces.ids)
        return {"n_tokens": n, "cache_bytes": self.shape.cache_bytes(n),
                "positions_with_cache": positions_with_cache(n, self.new_tokens),
                "positions_without_cache": positions_without_cache(n, self.new_tokens)}


def cache_shape(config: dict) -> CacheShape:
    layer_types = config.get("layer_types") or []
    sliding = sum(kind == "sliding_attention" for kind in layer_types)
    return CacheShape(config["num_hidden_layers"], config.get("num_key_value_heads", config["num_attention_heads"]),
                      config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"], sliding,
                      config.get("sliding_window") if sliding else None, config["max_position_embeddings"])


def pieces(tokenizer, text: str) -> Pieces:
    encoded = tokenizer.encode(text)
    return Pieces(text, encoded.ids, [tokenizer.token(i) for i in encoded.ids],
                  joined_characters(tokenizer, encoded.ids), encoded.unknown)


@cache
def tokenizer_and_shape(name: str, operator: bool = False) -> tuple[TextTokenizer, CacheShape]:
    """A listed model's tokenizer and cache shape (operator: also a model folder's, as catalog.locate allows the
    command line), read once per process (Gemma 3's tokenizer.json is 33 MB)."""
    folder = Path(locate(name, operator=operator).where)
    return load_tokenizer(folder), cache_shape(read_config(folder / "config.json", name))


def token_tax(name: str, texts: tuple[str, ...], new_tokens: int = DEFAULT_NEW_TOKENS,
              operator: bool = False) -> ModelTax:
    """The sentences (Vietnamese, then optionally its English twin) through model `name`'s tokenizer; operator: the
    command line, which opens a model folder too and has no limit on a text's characters (check_prompt_text)."""
    for text in texts:
        check_prompt_text(text, operator)
    tokenizer, shape = tokenizer_and_shape(name, operator)
    try:
        sentences = tuple(pieces(tokenizer, text) for text in texts)
    except UnknownWordsError as unknown:  # a vocabulary without <unk> (micro's)
        raise InputError("model_unknown_words", model=name, words=", ".join(unknown.words)) from None
    return ModelTax(name, sentences, shape, new_tokens)
