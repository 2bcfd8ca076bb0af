"""Which models may load: the bundled ones, a configurable folder of more, and the classroom switch.

No torch here: the sidebar lists the models on every page, the map page included.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = {"small": "assets/models/small", "micro": "assets/models/micro"}  # the classroom default first


@dataclass(frozen=True)
class Settings:
    models_dir: str | None  # DECODE_LAB_MODELS_DIR: a folder of model folders, offered beside the bundled ones
    allow_paths: bool       # DECODE_LAB_ALLOW_PATHS=0: only names from list_models() load (classroom mode)


def settings() -> Settings:
    allow = os.environ.get("DECODE_LAB_ALLOW_PATHS", "1").strip().lower()
    return Settings(os.environ.get("DECODE_LAB_MODELS_DIR") or None, allow not in ("0", "false", "no", "off"))


def models_dir_entries(models_dir: str | None) -> list[str]:
    folder = Path(models_dir).expanduser() if models_dir else None
    if folder is None or not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / "config.json").is_file())


def list_models(models_dir: str | None) -> list[str]:
    """The bundled names, then the subfolders of `models_dir` that hold a config.json."""
    return list(BUNDLED) + [n for n in models_dir_entries(models_dir) if n not in BUNDLED]


def resolve_path(name_or_path: str) -> Path:
    return ROOT / BUNDLED[name_or_path] if name_or_path in BUNDLED else Path(name_or_path).expanduser()
