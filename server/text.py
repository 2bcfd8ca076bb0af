"""Tokens into the text a client receives: decoded incrementally, a stop string cutting it, and never half a
character on the wire (a byte-level token can be one byte of a multi-byte UTF-8 letter: it is held back until the
token that completes it)."""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what decoding makes of an incomplete UTF-8 sequence


class TextStream:
    """The text of a request's tokens so far, handed out as deltas that are safe to send."""

    def __init__(self, decode, stops: list[str]):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0                  # characters handed out
        self.text = ""                 # the text so far (cut at a stop string once one is found)
        self.stopped = False           # a stop string was found: no more tokens count
        self.tokens_used = 0           # tokens up to the one that completed the stop string

    def add(self, ids: list[int] | tuple[int, ...]) -> str:
        """The delta the new tokens make that can be sent now."""
        if self.stopped:
            return ""
        for token in ids:
            self.ids.append(token)
            self.text = self.decode(self.ids)
            cut = self._stop_at()
            if cut is not None:
                self.text, self.stopped, self.tokens_used = self.text[:cut], True, len(self.ids)
                return self._take(len(self.text))
        self.tokens_used = len(self.ids)
        return self._take(self._safe_end())

    def flush(self) -> str:
        """Everything not sent yet (the request ended: nothing more can complete a character or a stop)."""
        return self._take(len(self.text))

    def _stop_at(self) -> int | None:
        """Where the first stop string begins in the text not sent yet (one may straddle what was sent: only the
        part after `sent` can be new)."""
        found = [i for s in self.stops if (i := self.text.find(s, max(0, self.sent - len(s) + 1))) >= 0]
        return min(found) if found else None

    def _safe_end(self) -> int:
        """The end of what can go now: no trailing replacement character (an unfinished letter), and with stop
        strings not the last len(longest) − 1 characters (they may be the beginning of one)."""
        end = len(self.text)
        while end > self.sent and self.text[end - 1] == REPLACEMENT:
            end -= 1
        if self.stops:
            end = min(end, len(self.text) - max(len(s) for s in self.stops) + 1)
        return max(end, self.sent)

    def _take(self, end: int) -> str:
        delta, self.sent = self.text[self.sent:end], max(self.sent, end)
        return delta
