"""python -m model speculate: a speculative run as a table of rounds or one JSON object."""

from __future__ import annotations

import json

from model.engine.generate import DEFAULT_NEW_TOKENS, context_room, encode_prompt, parse_prompt_ids
from model.engine.loading import load_model
from model.engine.sampling import SamplingSettings
from model.engine.tokenizer import encode_chat
from model.recording.speculative import report
from model.speculative.decoding import compare_speed, run_to_end, start
from model.speculative.drafts import draft_choices

# -- the command line: python -m model speculate ---------------------------------------------------------------


def print_rounds(rep: dict) -> None:
    m, c, a = rep["model"], rep["counts"], rep["acceptance"]
    print(f"target {m['name']} ({m['n_layers']} layers, {m['dtype']} on {m['device']}), draft {rep['draft']}, "
          f"γ = {rep['gamma']}")
    if rep["prompt"]["unknown"]:
        print(f"unknown words, read as <unk>: {', '.join(rep['prompt']['unknown'])}")
    for r in rep["rounds"]:
        verdicts = " ".join(f"{p['token']}{'✓' if p['accepted'] else '✗' if p['accepted'] is False else '·'}"
                            for p in r["proposed"])
        print(f"round {r['index']:>3}: {verdicts or '(no proposal)'} -> {r['next_kind']} {r['next_token'] or ''!r}  "
              f"cache {r['target_cache_len_checked']} -> {r['target_cache_len']}  {r['ms']:.2f} ms")
    print(f"output {rep['output']['text']!r} stop: {rep['output']['stop_reason']}")
    print(f"{c['new_tokens']} tokens in {c['target_passes']} target passes ({c['draft_passes']} draft passes); "
          f"accepted {c['accepted']} of {c['judged']} judged ({c['proposed']} proposed); α = {a['alpha']}, "
          f"tokens per pass {a['tokens_per_pass']} (expected {a['expected_tokens_per_pass']})")
    t = rep["timing"]
    if "speedup" in t:
        print(f"ms per token: plain {t['plain_ms_per_token']}, speculative {t['speculative_ms_per_token']} "
              f"(×{t['speedup']}; median of {t['repeats']}, {m['device']}, {m['dtype']}, {t['threads']} threads)")


def run_cli(args) -> int:
    target = load_model(args.model, args.device, operator=True)
    unknown = []
    if args.prompt_ids is not None:
        ids = parse_prompt_ids(target, args.prompt_ids)
    elif args.chat is not None:
        ids = encode_chat(target, args.chat).ids
    else:
        encoded = encode_prompt(target, args.prompt, operator=True)
        ids, unknown = encoded.ids, encoded.unknown
    settings = SamplingSettings(args.temperature, args.top_k, args.top_p, args.seed)
    max_new_tokens = (min(DEFAULT_NEW_TOKENS, context_room(target, len(ids))) if args.max_new_tokens is None
                      else args.max_new_tokens)
    draft = draft_choices(target)[0] if args.draft is None else args.draft  # the first that can serve it
    run = start(target, draft, ids, args.gamma, settings, max_new_tokens)
    run_to_end(run)
    speed = compare_speed(target, draft, ids, args.gamma, settings, max_new_tokens) if args.compare else None
    rep = report(run, speed, unknown)
    if args.json:
        print(json.dumps(rep, ensure_ascii=False))
    else:
        print_rounds(rep)
    return 0
