"""When decoding stops: the one rule that the session loop (generate.py), the serving engine's requests
(model/serving/request.py) and speculative decoding share, checked after each new token."""

from __future__ import annotations

from collections.abc import Callable


def stop_reason(token: int, eos_id: int | None, positions_fed: int, context_length: int, new_tokens: int,
                max_new_tokens: int, stop_string_seen: Callable[[], bool] = lambda: False) -> str | None:
    """Why a run stops after choosing `token`, its new_tokens-th, with positions_fed positions already through the
    model; None when it goes on. In this order: the end-of-sequence token; a stop string in the answer (asked only
    when the others have not stopped it: decoding the answer costs); the context full, when no position is left
    to feed the token just chosen (checked before the token limit: asking for every token that fits reaches both
    at once); the token limit."""
    if eos_id is not None and token == eos_id:
        return "eos"
    if stop_string_seen():
        return "stop_string"
    if positions_fed >= context_length:
        return "context_full"
    if new_tokens >= max_new_tokens:
        return "max_new_tokens"
    return None
