"""Bad input as a code plus details, so that each front end can say it in the user's language."""

from __future__ import annotations

from model.texts import number_in, text


class InputError(ValueError):
    def __init__(self, code: str, **details):
        self.code = code
        self.details = details
        super().__init__(self.message("en"))

    def details_in(self, lang: str) -> dict:
        """The details, a detail named `x_text` (a text key, such as a setting's label) said as `x` in `lang`, one
        named `x_number` written as `lang` writes numbers (a float with 2 decimals)."""
        said = {}
        for k, v in self.details.items():
            if k.endswith("_text"):
                said[k.removesuffix("_text")] = text(v, lang)
            elif k.endswith("_number"):
                said[k.removesuffix("_number")] = number_in(v, lang, ",.2f" if isinstance(v, float) else None)
            else:
                said[k] = v
        return said

    def message(self, lang: str) -> str:
        return text("error." + self.code, lang).format(**self.details_in(lang))
