"""The one lookup for user-facing text: assets/strings.json holds every sentence in vi and en."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
LANGUAGES = ("vi", "en")


@cache
def strings() -> dict[str, dict[str, str]]:
    return json.loads((ASSETS / "strings.json").read_text(encoding="utf-8"))


def text(key: str, lang: str) -> str:
    entry = strings().get(key)
    if entry is None:
        raise KeyError(f"no text for {key!r} in assets/strings.json")
    return entry[lang]
