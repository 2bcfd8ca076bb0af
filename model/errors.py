"""Bad input as a code plus details, so that each front end can say it in the user's language."""

from __future__ import annotations

from model.texts import text


class InputError(ValueError):
    def __init__(self, code: str, **details):
        self.code = code
        self.details = details
        super().__init__(self.message("en"))

    def details_in(self, lang: str) -> dict:
        """The details, a detail named `x_text` (a text key, such as a setting's label) said as `x` in `lang`."""
        return {k.removesuffix("_text"): text(v, lang) if k.endswith("_text") else v for k, v in self.details.items()}

    def message(self, lang: str) -> str:
        return text("error." + self.code, lang).format(**self.details_in(lang))
