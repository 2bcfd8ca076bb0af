"""The Decode run as a file (`trace --json`, the Decode page's "Download the run"): schema decode-lab.trace/2, its
writer; model/recording/replay.py reads it back."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime

TOP_N = 5

# the version read_recording reads back; a change of the fields gets a new one. /2: each step carries the sampling
# settings it was drawn with (/1 kept only the run's last ones)
SCHEMA = "decode-lab.trace/2"

def percentiles(values: list[float]) -> dict[str, float | None]:
    from model.serving.timing import percentile

    return {f"p{q}": round(percentile(values, q), 3) if values else None for q in (50, 95, 99)}

def trace_report(model, gen, prompt_text: str, unknown: list[str]) -> dict:
    """The run as `trace --json` prints it and the Decode page downloads it: a recording read_recording reads.
    gen.checks holds each step's max |Δlogit| when the run was checked step by step (--check)."""
    info, tok = model.info, model.tokenizer
    steps = []
    for index, (trace, drawn) in enumerate(zip(gen.steps, gen.samples)):
        row = {
            "index": index, "phase": trace.phase, "input_ids": trace.input_ids, "positions": trace.positions,
            "cache_len": trace.cache_len, "cache_bytes": trace.cache_bytes,
            "cache_bytes_formula": trace.cache_bytes_formula,
            "attention_shape": [info.n_layers, info.n_heads, len(trace.input_ids), trace.cache_len],
            "chosen_id": drawn.chosen_id, "chosen_token": tok.token(drawn.chosen_id),
            "chosen_bytes": tok.token_bytes(drawn.chosen_id).hex(" "), "chosen_prob": round(drawn.chosen_prob, 6),
            "settings": asdict(drawn.settings),
            "top": [{"id": int(i), "token": tok.token(int(i)), "bytes": tok.token_bytes(int(i)).hex(" "),
                     "prob": round(float(p), 6)}
                    for i, p in zip(drawn.top_ids[:TOP_N], drawn.top_probs[:TOP_N])],
            "ms": round(trace.ms, 3), "answer": tok.decode(gen.new_ids[: index + 1]),
        }
        if index in gen.checks:
            row["max_abs_logit_diff"] = gen.checks[index].max_abs_diff
        steps.append(row)
    s = gen.settings
    return {
        "schema": SCHEMA,
        "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": {"name": info.name, "engine": info.backend, "architecture": info.architecture,
                  "n_layers": info.n_layers, "n_heads": info.n_heads, "n_kv_heads": info.n_kv_heads,
                  "d_head": info.d_head, "sliding_window": info.window, "sliding_layers": info.sliding_layers,
                  "dtype": info.dtype, "bytes_per_element": info.bytes_per_element, "vocab_size": info.vocab_size,
                  "device": info.device},
        # what re-runs it with the prompt's ids (rerun), each step with its own sampling settings;
        # these are the latest: a change of them on the Decode page re-draws the current step and goes on with them
        "settings": asdict(s) | {"max_new_tokens": gen.max_new_tokens, "stop": list(gen.stop_strings),
                                 "check": len(gen.checks) == len(gen.steps)},
        # token: the readable form (a byte piece as <E1><BB>); bytes: what each token holds, in hex
        "prompt": {"text": prompt_text, "ids": gen.prompt_ids, "tokens": [tok.token(i) for i in gen.prompt_ids],
                   "bytes": [tok.token_bytes(i).hex(" ") for i in gen.prompt_ids], "unknown": unknown},
        "steps": steps,
        "output": {"ids": gen.new_ids, "text": tok.decode(gen.new_ids), "stop_reason": gen.stop_reason},
        "counts": {"prompt_len": len(gen.prompt_ids), "new_tokens": len(gen.new_ids),
                   "positions_with_cache": gen.positions_with_cache,
                   "positions_without_cache": gen.positions_without_cache},
        "timing": {"ttft_ms": round(gen.steps[0].ms, 3), "itl_ms": percentiles([s.ms for s in gen.steps[1:]])},
    }
