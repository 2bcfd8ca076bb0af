"""Any Hugging Face causal LM, step by step, behind the same interface as the native Llama.

model/engine/loading.py decides which engine runs a model (model/weights/catalog.py: `runs_native`) and calls
`load_transformers` for every causal LM that the native Llama does not run: transformers with eager attention,
so that the attention weights exist. transformers is imported only on that path: native models never pay for it.
Every difference between the transformers versions of pyproject's range is in the section "transformers API".
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from model.engine.cache import LayerBytes
from model.engine.runtime import LoadedModel, ModelInfo
from model.engine.tokenizer import Encoded, raw_token_bytes, readable_token
from model.errors import InputError
from model.weights.catalog import SAFETENSORS, Location

DEFAULT_CONTEXT = 2048  # for models without a position limit (ALiBi, e.g. BLOOM)


# -- transformers API: the calls into it, with every difference inside pyproject's range (>=4.56, <5.25) --------

def hub_file(location: Location, filename: str) -> Path:
    """A file of a Hub repository, from the local cache, or downloaded when allowed."""
    from transformers.utils import cached_file

    try:
        return Path(cached_file(location.where, filename, local_files_only=not location.download))
    except (OSError, ValueError):  # not cached / no such repo / an invalid id / no network
        raise InputError("model_not_found" if location.download else "download_disabled",
                         path=location.name) from None


def cache_argument(module) -> str:
    """5.24 renamed the forward argument `past_key_values` to `cache` (the old name still works, with a warning)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def last_logits_argument(module) -> dict:
    """`logits_to_keep=1` (the LM head on the last position only) where the model's forward takes it."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(module.forward).parameters else {}


def layer_kv(dynamic, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K and V (1, n_kv_heads, positions, d_head) of one layer of a DynamicCache, None while it holds none.
    In the whole range a DynamicCache is a list `.layers` of DynamicLayer with `.keys` and `.values`
    (the `key_cache` / `value_cache` lists are from before 4.54); layers appear at their first update."""
    if layer >= len(dynamic.layers):
        return None
    keys = getattr(dynamic.layers[layer], "keys", None)
    return None if keys is None or keys.numel() == 0 else (keys, dynamic.layers[layer].values)


def crop_layer(dynamic, layer: int, n: int) -> None:
    """Keep the first n positions of one layer.
    DynamicLayer.crop(x) changed meaning inside the range: in 4.56 x is the length to keep (`max_length`), in
    5.24 the number of tokens to remove, given as x ≤ 0 (`tokens_to_remove`; a positive x raises). A negative x
    removes -x positions in both, so that is the one call made; 0 is never passed (4.56 would empty the layer)."""
    kv = layer_kv(dynamic, layer)
    extra = 0 if kv is None else kv[0].shape[2] - n
    if extra > 0:
        dynamic.layers[layer].crop(-extra)


def load_module(location: Location, device: torch.device):
    """The model with eager attention (so that attention weights exist), float32, never running remote code."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # no "Loading weights" bars in the CLI's output or the app's log
    module = AutoModelForCausalLM.from_pretrained(
        location.where, attn_implementation="eager", dtype=torch.float32, use_safetensors=True,
        trust_remote_code=False, local_files_only=not location.download)  # `dtype`: the name since 4.56
    return module.to(device).eval().requires_grad_(False)


def empty_module(config: dict):
    """The model of this config with every tensor on the meta device (no memory): to count its parameters
    before anything is allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kind = config.get("model_type")
    cfg = AutoConfig.for_model(kind, **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def load_tokenizer(location: Location):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(location.where, trust_remote_code=False,
                                             local_files_only=not location.download)
    except (OSError, ValueError):
        raise InputError("no_tokenizer", path=location.name) from None


def check_causal_lm(location: Location, config: dict) -> None:
    """Refuse what transformers' own classes cannot run as a decoder-only language model."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = config.get("model_type")
    # BERT-like encoders have a causal-LM class too, but it only means something with is_decoder set
    causal = kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
        kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES or bool(config.get("is_decoder")))
    if not causal:
        code = "remote_code_refused" if "auto_map" in config else "not_causal_lm"
        raise InputError(code, path=location.name, model_type=kind or "?")


def check_safetensors(location: Location) -> None:
    """Only safetensors weights load: a pickled .bin file can run code while it is read."""
    from transformers.utils.hub import has_file

    try:
        found = any(has_file(location.where, f, local_files_only=not location.download) for f in SAFETENSORS)
    except OSError:
        raise InputError("model_not_found", path=location.name) from None
    if not found:
        raise InputError("no_safetensors", path=location.name)


def new_dynamic_cache():
    """A DynamicCache of full layers: built without the config, so that sliding-window models also keep every
    position (the views show the whole cache growing, and crop works at any length)."""
    from transformers import DynamicCache

    return DynamicCache()


# -- the session's cache, the tokenizer and the model --------------------------------------------------------

class HFCache(LayerBytes):
    """A transformers DynamicCache with the Cache interface (model/engine/cache.py) that the steps and the pages use."""

    def __init__(self, n_layers: int):
        self.dynamic = new_dynamic_cache()  # handed to the model's forward, which appends to it
        self.n_layers = n_layers

    @property
    def length(self) -> int:
        kv = layer_kv(self.dynamic, 0)
        return 0 if kv is None else kv[0].shape[2]

    def crop(self, n: int) -> None:
        """Keep the first n positions. Each layer is cropped on its own, so this also undoes a forward pass
        that stopped half-way (out of memory) after some layers had appended."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {n}")
        for layer in range(self.n_layers):
            crop_layer(self.dynamic, layer, n)

    def can_crop(self, n: int) -> bool:
        return True  # every layer keeps every position (new_dynamic_cache)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return layer_kv(self.dynamic, layer)


class HFTokenizer:
    """The WordTokenizer interface over a transformers tokenizer, whose tokens are usually subword pieces."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.bos_id, self.eos_id, self.unk_id = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id
        template = getattr(tokenizer, "chat_template", None)
        self.chat_template = template if isinstance(template, str) else None

    def encode(self, text: str) -> Encoded:
        """Ids as the tokenizer makes them (with <bos> when it adds one)."""
        enc = self._tok(text, return_offsets_mapping=self._tok.is_fast)
        ids = list(enc["input_ids"])
        return Encoded(ids, [self.token(i) for i in ids], self._unknown(text, ids, enc.get("offset_mapping")))

    def encode_chat(self, messages: list[dict[str, str]]) -> Encoded:
        """The tokenizer's own apply_chat_template; the rendered text holds every special token it needs."""
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = list(self._tok(text, add_special_tokens=False)["input_ids"])
        return Encoded(ids, [self.token(i) for i in ids], [])

    def _unknown(self, text: str, ids: list[int], offsets) -> list[str]:
        """The pieces of the text that became the unknown token; byte-level tokenizers never have any."""
        if self.unk_id is None or self.unk_id not in ids:
            return []
        if offsets is None:
            return [self.token(i) for i in ids if i == self.unk_id]
        return [text[a:b] for i, (a, b) in zip(ids, offsets, strict=True) if i == self.unk_id]

    def token(self, token_id: int) -> str:
        """A readable form: the text the token stands for (" the"), or, when that is only part of a character
        (byte-level pieces of a Vietnamese letter), its bytes as <E1><BB>."""
        if not 0 <= token_id < len(self._tok):
            return f"<{token_id}>"
        return readable_token(self._tok.convert_ids_to_tokens(token_id), self._tok.decode([token_id]))

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < len(self._tok):
            return b""
        return raw_token_bytes(self._tok.convert_ids_to_tokens(token_id), self._tok.decode([token_id]))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def _context_length(text_config) -> int:
    for attr in ("max_position_embeddings", "n_positions"):
        if getattr(text_config, attr, None):
            return int(getattr(text_config, attr))
    return DEFAULT_CONTEXT


def _eos_id(text_config, tokenizer: HFTokenizer | None) -> int | None:
    """The config's end-of-sequence id; of several (chat models), the tokenizer's own if listed."""
    eos = text_config.eos_token_id
    tok_eos = tokenizer.eos_id if tokenizer is not None else None
    if isinstance(eos, list):
        eos = tok_eos if tok_eos in eos else (eos[0] if eos else None)
    return eos if eos is not None else tok_eos


def model_info(name: str, module, tokenizer: HFTokenizer | None, device: torch.device,
               language: str | None = None) -> ModelInfo:
    cfg = module.config.get_text_config()
    n_heads = getattr(cfg, "num_attention_heads", None)
    if not n_heads:  # state-space and RNN models (Mamba, RWKV) have no attention to show
        raise InputError("no_attention", path=name, model_type=cfg.model_type)
    dtype = next(module.parameters()).dtype
    return ModelInfo(
        name=name, backend="transformers", n_layers=cfg.num_hidden_layers, n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        d_head=getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads, vocab_size=cfg.vocab_size,
        context_length=_context_length(cfg), dtype=str(dtype).removeprefix("torch."), device=str(device),
        bytes_per_element=dtype.itemsize, eos_id=_eos_id(cfg, tokenizer), language=language,
        architecture=cfg.model_type, kv_dtype=str(dtype).removeprefix("torch."),
    )


class HFModel(LoadedModel):
    """A transformers causal LM; its traces carry the same fields as the native model's."""

    def __init__(self, name: str, module, tokenizer: HFTokenizer | None, device: torch.device,
                 language: str | None = None):
        self.module, self.tokenizer, self.device = module, tokenizer, device  # tokenizer None: ids only (bench)
        self.info = model_info(name, module, tokenizer, device, language)
        self._cache_arg = cache_argument(module)
        self._last_logits = last_logits_argument(module)

    def new_cache(self) -> HFCache:
        return HFCache(self.info.n_layers)

    @torch.inference_mode()
    def forward(self, ids, cache, output_attentions):
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        past = {self._cache_arg: cache.dynamic, "use_cache": True} if cache is not None else {"use_cache": False}
        out = self.module(input_ids=x, output_attentions=output_attentions, **past, **self._last_logits)
        # float16, converted on the device: half the bytes of every step a session keeps
        attentions = torch.cat([a.to(torch.float16) for a in out.attentions]) if output_attentions else None
        return out.logits[0, -1], attentions  # (vocab,), (layers, heads, T, S)

    @torch.inference_mode()
    def every_logits(self, ids, cache):
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        return self.module(input_ids=x, use_cache=True, **{self._cache_arg: cache.dynamic}).logits[0]  # (T, vocab)


def load_transformers(location: Location, device: torch.device, language: str | None = None) -> HFModel:
    tokenizer = HFTokenizer(load_tokenizer(location))
    return HFModel(location.name, load_module(location, device), tokenizer, device, language)
