"""Loading a model: where it is (model/weights/catalog.py), checks before any weight is read, then the native Llama or
Gemma 3 (model/engine/runtime.py) or transformers (model/engine/hf.py).

Every way loading can fail ends as an InputError, a sentence in the user's language; the details (paths,
the library's exception) go to the server log. Checked before loading: the operator's settings, a config
that parses, a causal LM, safetensors weights only, and the size (parameters × 4 bytes, counted on
the meta device, which allocates nothing) against DECODE_LAB_MAX_MODEL_BYTES.
"""

from __future__ import annotations

import ctypes
import json
import logging
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from pathlib import Path

import torch
from safetensors import safe_open

from model.engine.gemma3 import Gemma3, Gemma3Config
from model.engine.llama import Linear, Llama, LlamaConfig, can_pack, pack_linears, packed_weights
from model.engine.runtime import (
    LoadedModel,
    LoadFacts,
    NativeModel,
    Quantization,
    Rounding,
    pick_device,
    warmed_up,
)
from model.engine.tokenizer import load_tokenizer
from model.errors import InputError
from model.weights.catalog import (
    SAFETENSORS,
    SOURCE_FILE,
    Location,
    language,
    list_models,
    locate,
    read_config,
    runs_native,
    settings,
)
from model.weights.fetch import SOURCES

log = logging.getLogger(__name__)

FLOAT32_BYTES = 4
# the native architectures by the config's model_type: the module and its config
NATIVE = {"llama": (Llama, LlamaConfig), "gemma3_text": (Gemma3, Gemma3Config)}


def load_native(folder: Path, device: torch.device) -> Llama | Gemma3:
    """The native module of a checkpoint folder, the architecture its config.json's model_type names."""
    model_type = json.loads((folder / "config.json").read_text(encoding="utf-8"))["model_type"]
    return NATIVE[model_type][0].load(folder, device)


def load_shared_native(folder: Path, device: torch.device) -> Llama | Gemma3:
    """The native module as the app's shared model runs it: never changed again, so on a CPU its linears' weights go
    from the file straight into the decode kernels' packed form (llama.pack_linears), one matrix at a time, and the
    process holds each of them once (the module is built on the meta device: shapes, no memory; only the norms, an
    untied embedding and the buffers computed from the config become tensors of their own). Where the kernels cannot
    run (a GPU, no C++ compiler) it is load_native's dense module. A trainer takes load_native: its weights change."""
    architecture, architecture_config = NATIVE[json.loads((folder / "config.json").read_text(encoding="utf-8"))
                                               ["model_type"]]
    with torch.device("meta"):
        module = architecture(architecture_config.from_hf_dict(json.loads((folder / "config.json").read_text())))
    if device.type != "cpu" or not can_pack(module):
        return load_native(folder, device)
    tied = module.lm_head.weight is module.model.embed_tokens.weight
    packed = {f"{name}.weight" for name, m in module.named_modules() if isinstance(m, Linear)}
    with ExitStack() as files:
        where = {key: f for path in weight_files(folder) for f in [files.enter_context(safe_open(str(path), "pt"))]
                 for key in f.keys()}

        def read(key: str) -> torch.Tensor:
            """The tensor in float32; it may be a view of the file's memory map (kept mapped while it lives)."""
            if key == "lm_head.weight" and tied and key not in where:  # a tied head is the embedding's matrix
                key = "model.embed_tokens.weight"
            return where[key].get_tensor(key).float()

        dense = {name: read(name).clone() for name, _ in module.named_parameters()
                 if name not in packed and not (tied and name == "model.embed_tokens.weight")}
        module.load_state_dict(dense, strict=False, assign=True)
        for name, value in module.computed_buffers().items():
            module.register_buffer(name, value, persistent=False)
        pack_linears(module, weight_of=lambda name: read(f"{name}.weight"))
    return module.eval().requires_grad_(False)


def model_key(name: str, device: str = "auto") -> tuple[str, str]:
    """One key per real model, so that a process caches one copy of each: a listed name as it is, a folder as
    its absolute path (no trailing slash, no "~", no ".."), and the device "auto" resolves to ("cpu", "cuda")."""
    name = name.strip()
    if name not in list_models(settings().models_dir) and Path(name).expanduser().exists():
        name = str(Path(name).expanduser().resolve())
    return name, pick_device(device).type


def load_model(name: str = "small", device: str = "auto", allow_download: bool = False,
               operator: bool = False) -> LoadedModel:
    """A listed name, a model folder, or a Hugging Face Hub id (a download only when the operator allows it and
    `allow_download` asks for it; operator: the command line, see catalog.locate). Llama checkpoints the native
    model can run load there, the rest in transformers."""
    return _load_reporting_failures(lambda: locate(name, allow_download, operator), name, device)


def load_session_checkpoint(name: str, folder: str, device: str = "auto") -> LoadedModel:
    """A checkpoint the Train page saved for one session: a folder the server wrote itself, so it loads without
    DECODE_LAB_ALLOW_PATHS (the same size and format checks apply)."""
    return _load_reporting_failures(lambda: Location(name, str(Path(folder).resolve()), True, False), name, device)


def _load_reporting_failures(where: Callable[[], Location], name: str, device: str) -> LoadedModel:
    """Every failure becomes an InputError sentence; the details go to the server log."""
    t0 = time.perf_counter()
    try:
        location = where()
        model = _load(location, device)
    except InputError:
        raise
    except torch.OutOfMemoryError:
        log.exception("loading %r ran out of memory", name)
        raise InputError("out_of_memory", device=device) from None
    except Exception as failed:
        log.exception("loading %r failed", name)
        raise InputError("load_failed", path=name, reason=type(failed).__name__) from None
    model.facts = load_facts(model, location, time.perf_counter() - t0)
    return model


def _load(location: Location, device: str) -> LoadedModel:
    name = location.name
    config = read_config(_config_path(location), name)
    native = runs_native(location, config)
    if not native:
        from model.engine import hf

        hf.check_causal_lm(location, config)
        hf.check_safetensors(location)
    parameters = count_parameters(config, native, name)
    check_size(parameters, name)
    if location.local:
        check_weights_readable(Path(location.where), name)
    dev = pick_device(device)
    if native:
        folder = Path(location.where)
        try:
            tokenizer = load_tokenizer(folder)
        except Exception:
            log.exception("tokenizer of %r", name)
            raise InputError("no_tokenizer", path=name) from None
        model = warmed_up(NativeModel(name, load_shared_native(folder, dev), tokenizer, dev, language(name)))
    else:
        from model.engine import hf

        model = warmed_up(hf.load_transformers(location, dev, language(name)))
    return_freed_memory()
    return model


def return_freed_memory() -> None:
    """Hand what loading freed back to the operating system (glibc's malloc_trim): glibc keeps freed memory for
    reuse, and the process would stay that much larger. Gemma 3's tokenizer alone frees 194 MiB of its JSON's
    parse (288 MiB resident after reading tokenizer.json, 94 MiB after the trim)."""
    if sys.platform == "linux":
        with suppress(AttributeError, OSError):  # a C library without malloc_trim (musl)
            ctypes.CDLL(None).malloc_trim(0)


def _config_path(location: Location) -> Path:
    if location.local:
        return Path(location.where) / "config.json"
    from model.engine import hf

    return hf.hub_file(location, "config.json")


def count_parameters(config: dict, native: bool, name: str) -> int:
    """Distinct parameters (a tied LM head once) of the model this config describes, built on the meta device:
    shapes without memory, so a config asking for 64 GiB costs nothing to check."""
    try:
        if native:
            architecture, architecture_config = NATIVE[config["model_type"]]
            with torch.device("meta"):
                module = architecture(architecture_config.from_hf_dict(config))
        else:
            from model.engine import hf

            module = hf.empty_module(config)
        return sum(p.numel() for p in module.parameters())
    except Exception:
        log.exception("config of %r does not describe a model", name)
        raise InputError("bad_config", path=name) from None


def check_size(parameters: int, name: str) -> None:
    limit = settings().max_model_bytes
    needed = parameters * FLOAT32_BYTES
    if needed > limit:
        raise InputError("too_big", path=name, parameters=f"{parameters:,}", gb=f"{needed / 1e9:.1f}",
                         limit_gb=f"{limit / 1e9:.1f}")


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: one model.safetensors, or the shards an index lists."""
    single, index = folder / SAFETENSORS[0], folder / SAFETENSORS[1]
    if single.is_file():
        return [single]
    if index.is_file():
        shards = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()
        return [folder / shard for shard in sorted(set(shards))]
    return []


def check_weights_readable(folder: Path, name: str) -> None:
    """Open each safetensors file's header (a few KB): a truncated or corrupt file is refused before loading."""
    from safetensors import safe_open

    try:
        files = weight_files(folder)
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
    except Exception:
        log.exception("weights of %r are unreadable", name)
        raise InputError("corrupt_weights", path=name) from None
    if not files:
        raise InputError("no_safetensors", path=name)


def load_facts(model: LoadedModel, location: Location, seconds: float) -> LoadFacts:
    """What cell 5A shows: the file, where it came from, its size and the parameters it became."""
    folder = Path(location.where) if location.local else None
    files = weight_files(folder) if folder is not None else []
    fetched = _fetched_source(folder)
    parameters = sum(p.numel() for p in model.module.parameters())
    return LoadFacts(
        file=", ".join(f.name for f in files), source=_source(fetched, folder, location.name),
        quantization=_quantization(fetched),
        parameters=parameters,
        file_bytes=sum(f.stat().st_size for f in files), memory_bytes=parameters * model.info.bytes_per_element,
        packed_bytes=packed_bytes(model.module), held_bytes=held_bytes(model.module),
        dtype=model.info.dtype, device=model.info.device, load_s=seconds,
    )


def _fetched_source(folder: Path | None) -> dict | None:
    """A fetched model's source.json: what it was made from."""
    path = folder / SOURCE_FILE if folder is not None else None
    return json.loads(path.read_text(encoding="utf-8")) if path is not None and path.is_file() else None


def packed_bytes(module: torch.nn.Module) -> int | None:
    """The bytes of the linears' weights as the decode kernels hold them (pack_linears), in place of the dense ones;
    None when the model multiplies with torch's own product on dense weights (a GPU, no C++ compiler, transformers)."""
    packed = packed_weights(module)
    return sum(p.nbytes for p in packed) if packed else None


def held_bytes(module: torch.nn.Module) -> int:
    """What the process holds for the model's weights: the packed ones and every tensor of its own (norms, an untied
    embedding), a tied matrix once."""
    own = {id(p): p for p in module.parameters() if p.device.type != "meta"}
    return (packed_bytes(module) or 0) + sum(p.numel() * p.element_size() for p in own.values())


def _quantization(fetched: dict | None) -> Quantization | None:
    """The rounding source.json recorded from the GGUF; for a folder converted before it did, the record fetch.py
    keeps for the same file (its sha256 is pinned)."""
    if fetched is None:
        return None
    types = fetched.get("tensor_types") or next(
        (s.facts["tensor_types"] for s in SOURCES.values() if s.facts["gguf"] == fetched["gguf"]), None)
    if types is None:
        return None
    return Quantization(fetched["quantization"], tuple(Rounding(**r) for r in types["layers"]),
                        Rounding(**types["embedding"]))


def _source(fetched: dict | None, folder: Path | None, name: str) -> str:
    """A fetched model's package and file; else the folder's name (not the server's path)."""
    if fetched is not None:
        return f"{fetched['package']} (PyPI): {fetched['gguf']} ({fetched['gguf_bytes']:,} B)"
    return folder.name if folder is not None else name
