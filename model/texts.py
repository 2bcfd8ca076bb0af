"""The one lookup for user-facing text: every sentence in vi and en, in assets/strings/*.json.

The texts are split by area (app.json, and one file per larger page) only so that they stay readable;
a key lives in exactly one file.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
LANGUAGES = ("vi", "en")


@cache
def strings() -> dict[str, dict[str, str]]:
    merged: dict[str, dict[str, str]] = {}
    for path in sorted((ASSETS / "strings").glob("*.json")):
        part = json.loads(path.read_text(encoding="utf-8"))
        twice = merged.keys() & part.keys()
        if twice:
            raise ValueError(f"{path.name} repeats keys of another strings file: {sorted(twice)}")
        merged.update(part)
    return merged


# Vietnamese groups thousands with a dot and writes the decimal comma
VIETNAMESE_MARKS = str.maketrans(",.", ".,")


def number_in(value: float, lang: str, spec: str | None = None) -> str:
    """A number as `lang` writes it: 6,144 and 6.5625 in English, 6.144 and 6,5625 in Vietnamese. spec: a format
    spec with English marks (".4f" writes 0.6931 as 0,6931 in Vietnamese); without one, a float with the shortest
    digits that give it back, a whole one without its .0."""
    if spec is not None:
        written = format(value, spec)
    else:
        written = f"{value:,}" if value != int(value) else f"{int(value):,}"
    return written.translate(VIETNAMESE_MARKS) if lang == "vi" else written


def text(key: str, lang: str) -> str:
    entry = strings().get(key)
    if entry is None:
        raise KeyError(f"no text for {key!r} in assets/strings/")
    return entry[lang]
