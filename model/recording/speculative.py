"""A speculative run as a file (`speculate --json`, the Speculative page's "Download the run"): schema
decode-lab.speculate/1, its writer; model/recording/replay.py reads it back."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime

from model.speculative.decoding import SpeculativeRun, SpeedComparison
from model.speculative.rules import expected_tokens_per_pass

SCHEMA = "decode-lab.speculate/1"  # a change of the fields gets a new version

def report(run: SpeculativeRun, speed: SpeedComparison | None, unknown: list[str]) -> dict:
    """The run as one JSON-ready object. q and p are after the sampling filters (greedy: the plain softmax).
    Each round carries its own sampling settings and what the Speculative page shows of it, so that a replay can
    draw it again without the model and a re-run with the same draft, γ and settings can check it."""
    target, tok = run.target, run.target.tokenizer

    def piece(token_id: int) -> dict:
        return {"id": token_id, "token": tok.token(token_id), "bytes": tok.token_bytes(token_id).hex(" ")}

    rounds, produced = [], []
    for r in run.rounds:
        produced += r.new_ids
        rounds.append({
            "index": r.index, "gamma": r.gamma, "settings": asdict(r.settings),
            "proposed": [piece(c.id) | {"q": round(c.q, 6), "p": round(c.p, 6),
                                        "r": None if c.r is None else round(c.r, 6), "accepted": c.accepted}
                         for c in r.checks],
            "next_id": r.next_id, "next_token": None if r.next_id is None else tok.token(r.next_id),
            "next_bytes": None if r.next_id is None else tok.token_bytes(r.next_id).hex(" "),
            "next_kind": r.next_kind, "new_ids": r.new_ids,
            "residual": [piece(x) | {"p": round(p, 6), "q": round(q, 6), "residual": round(rest, 6)}
                         for x, p, q, rest in r.residual_top],
            "target_cache_len_before": r.target_len_before, "target_cache_len_checked": r.target_len_checked,
            "target_cache_len": r.target_len_after, "draft_cache_len_before": r.draft_len_before,
            "draft_cache_len_proposed": r.draft_len_proposed, "draft_cache_len": r.draft_len_after,
            "draft_passes": r.draft_passes, "draft_ms": round(r.draft_ms, 3), "target_ms": round(r.target_ms, 3),
            "ms": round(r.total_ms, 3), "answer": tok.decode(produced),
        })
    alpha = run.alpha
    timing = {"ms_per_token": round(run.ms_per_token, 3)}
    if speed is not None:
        timing.update(plain_ms_per_token=round(speed.plain_ms_per_token, 3),
                      speculative_ms_per_token=round(speed.speculative_ms_per_token, 3),
                      speedup=round(speed.speedup, 3), cost_ratio=speed.cost_ratio, repeats=speed.repeats,
                      threads=speed.threads)
    return {
        "schema": SCHEMA,
        "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": {"name": target.info.name, "n_layers": target.info.n_layers, "dtype": target.info.dtype,
                  "device": target.info.device},
        "draft": run.draft.name, "gamma": run.gamma,
        # the latest sampling settings; each round records the ones it ran with
        "settings": asdict(run.settings) | {"max_new_tokens": run.max_new_tokens},
        "prompt": {"ids": run.prompt_ids, "tokens": [tok.token(i) for i in run.prompt_ids],
                   "bytes": [tok.token_bytes(i).hex(" ") for i in run.prompt_ids], "unknown": unknown},
        "output": {"ids": run.new_ids, "text": tok.decode(run.new_ids), "stop_reason": run.stop_reason},
        "counts": {"new_tokens": len(run.new_ids), "target_passes": run.target_passes,
                   "draft_passes": run.draft_passes, "proposed": run.proposed, "judged": run.judged,
                   "accepted": run.accepted},
        "acceptance": {"alpha": None if alpha is None else round(alpha, 6),
                       "expected_tokens_per_pass": None if alpha is None
                       else round(expected_tokens_per_pass(alpha, run.gamma), 6),
                       "tokens_per_pass": round(run.tokens_per_pass, 6)},
        "rounds": rounds,
        "timing": timing,
    }
