"""The Decode page's attention row under a bounded cache: which of the row's positions a cache of S sinks + W latest
positions (StreamingLLM), the same budget of latest positions alone, or H2O's heavy hitters would still hold at this
step, from a real re-run of the run's tokens through that cache (model/serving/kv_lessons), fed incrementally as the
run grows and kept in the session. The row's weights stay the full cache's: the page strikes out what the bounded
cache would have lost and says how much of this row's weight went there."""

from __future__ import annotations

from dataclasses import dataclass

import streamlit as st

from model.engine.generate import Generation
from model.engine.kv_evict import check_window, fed_along
from model.engine.runtime import LoadedModel
from model.errors import InputError
from model.serving.kv_lessons import BOUNDED, bounded_cache, default_bound
from ui.i18n import decimal, t

POLICIES = ("off", *BOUNDED)  # the Decode page's choice


@dataclass
class Fed:
    """A bounded cache and the tokens fed through it so far, for one model, policy and bound."""
    key: tuple
    ids: list[int]
    cache: object


def bound(context_length: int) -> tuple[int, int]:
    """The KV page's sinks and window (kept across pages), or their defaults before a visit there."""
    sinks, window = default_bound(context_length)
    return int(st.session_state.get("kv_sinks", sinks)), int(st.session_state.get("kv_window", window))


def held_positions(model: LoadedModel, ids: list[int], policy: str, sinks: int, window: int) -> list[list[int]]:
    """Per layer, the positions of `ids` the bounded cache holds once they are all fed; the tokens already fed in
    this session for the same model, policy and bound are not fed again."""
    key = (model.info.name, model.info.dtype, policy, sinks, window)
    fed = st.session_state.get("decode_bounded_fed")
    if fed is None or fed.key != key or fed.ids != ids[:len(fed.ids)]:
        fed = Fed(key, [], bounded_cache(model, policy, sinks, window))
    for _ in fed_along(model, ids[len(fed.ids):], fed.cache):
        pass
    fed.ids = list(ids)
    st.session_state.decode_bounded_fed = fed
    return [fed.cache.kept(layer) for layer in range(model.info.n_layers)]


def struck_out(model: LoadedModel, gen: Generation, layer: int, row, policy: str) -> tuple[set[int], str]:
    """The positions of the newest query's row (its weights `row`, over the cache) the bounded cache no longer
    holds in `layer`, and the sentence saying so; (set(), "") when the policy is off."""
    if policy == "off":
        return set(), ""
    n = len(row)
    sinks, window = bound(model.info.context_length)
    try:
        check_window(model, sinks, window)
    except InputError as refused:
        if refused.code == "kv_window_sliding":
            return set(), t("decode.bounded_sliding", model=model.info.name)
        return set(), t("decode.bounded_range", s=sinks, w=window, context=model.info.context_length)
    held = set(held_positions(model, gen.ids[:n], policy, sinks, window)[layer])
    out = set(range(n)) - held
    said = dict(policy=t("kv.policy_" + policy), s=sinks, w=window, n=n, layer=layer)
    if not out:
        return out, t("decode.bounded_all", **said, bound=sinks + window)
    return out, t("decode.bounded_row", **said, kept=n - len(out), out=len(out),
                  weight=decimal(float(sum(row[p] for p in out)), 2))
