"""Bad input as a code plus details, so that each front end can say it in the user's language."""

from __future__ import annotations

from model.texts import text


class InputError(ValueError):
    def __init__(self, code: str, **details):
        self.code = code
        self.details = details
        super().__init__(self.message("en"))

    def message(self, lang: str) -> str:
        return text("error." + self.code, lang).format(**self.details)
