"""quality --kv-window S,W: the attention sink measured, and a bounded cache re-run along a text (kv_evict).

Four runs of the same text, one token a step: the full cache, the first S positions kept with the W latest
(StreamingLLM), the window alone with as many positions (S + W latest), and H2O's heavy hitters at the same budget
(the W latest and the S older ones that received the most attention); the perplexity of each over the
positions past the bound, and by segments of SEGMENT positions (the curve). Beside them, the sink: the mean attention
weight each layer and head puts on the text's first position.
"""

from __future__ import annotations

import math

from model.engine.kv_evict import check_window, nll_along, sink_mass
from model.errors import InputError
from model.serving.kv_lessons import BOUNDED, bounded_cache

SEGMENT = 64
MAX_ALONG = 384  # tokens fed one a step in each of the four runs: six times a 4 + 60 bound


def parse_window(value: str) -> tuple[int, int]:
    try:
        sinks, window = (int(part) for part in value.split(","))
    except ValueError:
        raise InputError("kv_window_form", value=value) from None
    return sinks, window


def parse_policies(value: str | None) -> tuple[str, ...]:
    """--kv-policy: bounded caches among kv_lessons.BOUNDED, comma-separated, each once (default: all three)."""
    if value is None:
        return BOUNDED
    policies = tuple(part.strip() for part in value.split(","))
    for policy in policies:
        if policy not in BOUNDED or policies.count(policy) > 1:
            raise InputError("kv_policy", value=value, offered=",".join(BOUNDED))
    return policies


def measure_window(model, ids: list[int], sinks: int, window: int, policies: tuple[str, ...] = BOUNDED) -> dict:
    check_window(model, sinks, window)
    along = ids[:MAX_ALONG]
    full_len = min(len(along), model.info.context_length)
    # H2O keeps the text's positions (as the full cache does), so its run stops at the context too; sinks and the
    # window re-assign positions inside the cache and run the whole text
    runs = {"full": nll_along(model, along[:full_len], model.new_cache())} | {
        policy: nll_along(model, along[:full_len] if policy == "heavy_hitters" else along,
                          bounded_cache(model, policy, sinks, window)) for policy in policies}
    bound = sinks + window

    def perplexity(nlls: list[float]) -> float | None:
        return math.exp(sum(nlls) / len(nlls)) if nlls else None

    mass = sink_mass(model, ids[:min(len(ids), model.info.context_length, 512)])
    return {
        "sinks": sinks, "window": window, "tokens": len(along), "segment": SEGMENT,
        "runs": [{"policy": name, "positions": len(nlls),
                  "perplexity_past_bound": perplexity(nlls[bound:]),
                  "perplexity_by_segment": [perplexity(nlls[a:a + SEGMENT]) for a in range(0, len(nlls), SEGMENT)]}
                 for name, nlls in runs.items()],
        "sink_mass": [[round(float(x), 4) for x in layer] for layer in mass],
    }


def print_window(report: dict) -> None:
    print(f"bounded cache: {report['sinks']} sinks + {report['window']} latest positions, against the window alone "
          f"({report['sinks'] + report['window']} latest) and the full cache, {report['tokens']} tokens fed one a step")
    for run in report["runs"]:
        past = run["perplexity_past_bound"]
        curve = " ".join("-" if p is None else f"{p:.1f}" for p in run["perplexity_by_segment"])
        print(f"{run['policy']:<8} perplexity past the bound {'-' if past is None else f'{past:.3f}':>9}; "
              f"by {report['segment']} positions: {curve}")
    by_layer = [sum(heads) / len(heads) for heads in report["sink_mass"]]
    print("attention on the first position, mean of the heads, layer by layer: "
          + " ".join(f"{m:.2f}" for m in by_layer))
