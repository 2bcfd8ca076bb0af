"""Which models may load, where each one is, and which engine runs it; the operator's settings.

No torch and no transformers here: the sidebar lists the models on every page, the map page included.
Safe by default: a visitor can choose only the listed models (bundled, fetched, DECODE_LAB_MODELS_DIR);
other folders and Hugging Face Hub downloads open only when the operator sets the environment variables below.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from model.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = {"small": "assets/models/small", "micro": "assets/models/micro"}  # the classroom default first
DRAFT_MODELS = {"small-draft": "assets/models/small-draft"}  # bundled, not listed: drafts for speculative decoding
FETCHED = ("smollm2", "gemma3")  # `python -m model fetch NAME` writes these into the cache folder
# what each listed model was trained to write
LANGUAGES = {"small": "vi+en", "micro": "vi", "smollm2": "en", "gemma3": "vi+en"}
SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
SOURCE_FILE = "source.json"  # in a fetched model's folder: what it was made from; written last
HUB_ID = re.compile(r"[\w][\w.-]*(/[\w][\w.-]*)?")  # "gpt2", "Qwen/Qwen2-0.5B"
DEFAULT_MAX_MODEL_BYTES = 2_000_000_000
OFF = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Settings:
    models_dir: str | None   # DECODE_LAB_MODELS_DIR: a folder of model folders, listed beside the bundled ones
    allow_paths: bool        # DECODE_LAB_ALLOW_PATHS=1: any folder on the server may load (default: only the list)
    allow_downloads: bool    # DECODE_LAB_ALLOW_DOWNLOADS=1 (with ALLOW_PATHS=1): Hub ids may download
    max_model_bytes: int     # DECODE_LAB_MAX_MODEL_BYTES: parameters × 4 bytes (float32) above this are refused
    cache_dir: Path          # DECODE_LAB_CACHE: where fetched models are converted (default ~/.cache/decode-lab)
    cpu_threads: int | None  # DECODE_LAB_CPU_THREADS: torch's threads for the whole process (default 1)


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in OFF


def _positive_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip().replace("_", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


_said_ignored: set[tuple[str, str]] = set()


def env_megabytes(name: str, default: float) -> int:
    """The bytes an environment variable sets in MiB (DECODE_LAB_SESSION_MB, DECODE_LAB_TIER_MB): a value that is no
    positive number is ignored with one log line, and the default holds. A typo in a server's set-up must not stop
    every page that reads it."""
    value = os.environ.get(name, "").strip()
    try:
        megabytes = float(value) if value else default
    except ValueError:
        megabytes = math.nan
    if not (megabytes > 0 and math.isfinite(megabytes)):
        if (name, value) not in _said_ignored:
            _said_ignored.add((name, value))
            logging.getLogger(__name__).warning("%s=%r is no positive number of MiB: ignored, %s MiB hold", name,
                                                value, default)
        megabytes = default
    return int(megabytes * 2**20)


def settings() -> Settings:
    cache = os.environ.get("DECODE_LAB_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "decode-lab"
    allow_paths = _flag("DECODE_LAB_ALLOW_PATHS")
    return Settings(
        models_dir=os.environ.get("DECODE_LAB_MODELS_DIR") or None, allow_paths=allow_paths,
        allow_downloads=allow_paths and _flag("DECODE_LAB_ALLOW_DOWNLOADS"),
        max_model_bytes=_positive_int("DECODE_LAB_MAX_MODEL_BYTES") or DEFAULT_MAX_MODEL_BYTES,
        cache_dir=Path(cache).expanduser(), cpu_threads=_positive_int("DECODE_LAB_CPU_THREADS"),
    )


def fetched_folder(name: str) -> Path:
    return settings().cache_dir / name


def models_dir_entries(models_dir: str | None) -> list[str]:
    folder = Path(models_dir).expanduser() if models_dir else None
    if folder is None or not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / "config.json").is_file())


def list_models(models_dir: str | None = None) -> list[str]:
    """The bundled names, the fetched ones that are converted, then the subfolders of `models_dir` with a
    config.json."""
    fetched = [n for n in FETCHED if (fetched_folder(n) / "config.json").is_file()]
    names = list(BUNDLED) + fetched
    return names + [n for n in models_dir_entries(models_dir) if n not in names]


def resolve_path(name_or_path: str) -> Path:
    """The folder of a bundled or fetched name, else the path as given (user folder expanded)."""
    if name_or_path in BUNDLED:
        return ROOT / BUNDLED[name_or_path]
    if name_or_path in FETCHED:
        return fetched_folder(name_or_path)
    return Path(name_or_path).expanduser()


@dataclass(frozen=True)
class Location:
    name: str        # as the user gave it
    where: str       # a local folder, or a Hugging Face Hub id
    local: bool
    download: bool   # a Hub id that may be downloaded now


def _listed_folder(name: str, s: Settings) -> Path | None:
    if name in BUNDLED or name in FETCHED:
        return resolve_path(name)
    if name in models_dir_entries(s.models_dir):
        return Path(s.models_dir).expanduser() / name
    return None


def locate(name: str, allow_download: bool = False, operator: bool = False) -> Location:
    """Where `name` points: a listed model, a folder, or a Hub id, refused early when the settings forbid it.
    A web visitor's download needs the operator's DECODE_LAB_ALLOW_DOWNLOADS and this request's `allow_download`.
    operator: the command line, run by whoever runs the machine: any folder opens, and `allow_download` (its
    --allow-download) alone allows a download; the locks are for the web server's visitors."""
    s = settings()
    listed = _listed_folder(name, s)
    if listed is not None:
        if name in FETCHED and not (listed / "config.json").is_file():
            raise InputError("not_fetched", name=name)
        return Location(name, str(listed), True, False)
    if not (s.allow_paths or operator):
        raise InputError("path_not_allowed", path=name, models=", ".join(list_models(s.models_dir)))
    folder = Path(name).expanduser()
    if folder.exists() or not HUB_ID.fullmatch(name) or ".." in name:
        if not folder.is_dir():
            raise InputError("model_not_found", path=name)
        return Location(name, str(folder.resolve()), True, False)
    return Location(name, name, False, (s.allow_downloads or operator) and allow_download)


def read_config(path: Path, name: str) -> dict:
    """config.json as a dict; a missing file says "not found", an unreadable one says so."""
    if not path.is_file():
        raise InputError("model_not_found", path=name)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise InputError("bad_config", path=name) from None
    if not isinstance(config, dict):
        raise InputError("bad_config", path=name)
    return config


# what the native architectures implement: anything else in their configs (rope scaling, biases, soft-capping)
# runs on transformers
NATIVE_ROPE = (None, "default")


def _default_rope(rope) -> bool:
    return isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in NATIVE_ROPE


def native_llama(config: dict) -> bool:
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return (config.get("model_type") == "llama" and config.get("hidden_act", "silu") == "silu"
            and not config.get("attention_bias") and not config.get("mlp_bias") and _default_rope(rope))


def native_gemma3(config: dict) -> bool:
    """Gemma 3's text model with its own layer pattern and RoPE bases, no soft-capping, causal attention."""
    rope = config.get("rope_parameters") or {}
    return (config.get("model_type") == "gemma3_text"
            and config.get("hidden_activation", "gelu_pytorch_tanh") == "gelu_pytorch_tanh"
            and isinstance(config.get("layer_types"), list) and not config.get("rope_scaling")
            and all(_default_rope(rope.get(kind) or {}) for kind in ("full_attention", "sliding_attention"))
            and config.get("final_logit_softcapping") is None and config.get("attn_logit_softcapping") is None
            and not config.get("use_bidirectional_attention") and not config.get("attention_bias"))


def runs_native(location: Location, config: dict) -> bool:
    """A local Llama or Gemma 3 checkpoint in one safetensors file, with a tokenizer.json and nothing the native
    model lacks, runs on the native engine; every other causal LM on transformers."""
    folder = Path(location.where)
    return (location.local and (native_llama(config) or native_gemma3(config))
            and (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file())


def language(name: str) -> str | None:
    """"vi", "en" or "vi+en" for the listed models; None where nobody checked."""
    return LANGUAGES.get(name)
