"""What fewer bits cost in accuracy: perplexity on a held-out text, greedy agreement with float32 and the mean KL
divergence from float32's next-token distributions (model/serving/quality.py).

python -m model quality --model M --dtype float32,bfloat16,int8 [--text FILE] [--json]
"""

from __future__ import annotations

import json
from dataclasses import asdict

import torch

from model.engine.kernels import bf16_products, cpu_features, int8_products
from model.engine.kv_quant import GROUP, bytes_per_position, check_kv_dtype, with_kv_dtype
from model.engine.loading import load_model
from model.engine.lowbit import check_dtype, with_weights
from model.errors import InputError
from model.serving.quality import CHUNK, STEP_REPEATS, decode_step_times, held_out, measure_quality, text_ids
from model.serving.timing import percentile
from model.tools.kv_window import measure_window, parse_policies, parse_window, print_window
from model.tools.options import check_list, read_bounded
from model.tools.serve_bench import cpu_line, parse_list

DEFAULT_DTYPES = "float32,bfloat16,int8"
MAX_TEXT_BYTES = 2**20  # a text past this is refused before it is tokenised (8,192 tokens take far fewer bytes)


def read_text(path: str) -> str:
    try:
        data = read_bounded(path, MAX_TEXT_BYTES)
        if len(data) > MAX_TEXT_BYTES:
            raise InputError("quality_text_too_large", path=path, most=MAX_TEXT_BYTES // 1024)
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as failed:
        raise InputError("quality_text_unreadable", path=path, reason=getattr(failed, "strerror", None)
                         or type(failed).__name__) from None


def run_cli(args) -> int:
    if args.kv_window is not None:
        return run_window(args)
    if args.kv_policy is not None:
        raise InputError("kv_policy_alone")
    kv_dtypes = None if args.kv_dtype is None else parse_list(args.kv_dtype, str.strip, "--kv-dtype")
    if kv_dtypes is not None:
        check_list("--kv-dtype", kv_dtypes)
        if args.dtype not in (None, "float32"):
            raise InputError("kv_dtype_with_dtype")
        for kv_dtype in kv_dtypes:
            check_kv_dtype(kv_dtype)  # before the model loads
    dtypes = parse_list(args.dtype or DEFAULT_DTYPES, str.strip, "--dtype")
    check_list("--dtype", dtypes)
    for dtype in dtypes:
        check_dtype(dtype)  # before the model loads
    base = load_model(args.model, args.device, operator=True)
    if kv_dtypes is not None:  # the cache in fewer bits, the weights float32 (kv_quant)
        models = {"float32": base} | {d: with_kv_dtype(base, d) for d in kv_dtypes if d != "float32"}
    else:
        models = {"float32": base} | {d: with_weights(base, d) for d in dtypes if d != "float32"}  # refusals first
    text = held_out(base.info.language)
    name = args.text if args.text is not None else text.name
    ids = text_ids(base, read_text(args.text) if args.text is not None else text.text, name)
    quality = measure_quality(models, base.info.name, name, ids, text.prompts)
    report = asdict(quality) | {
        "dtypes": [asdict(row) | {"greedy_agreement": round(row.greedy_agreement, 4)} for row in quality.rows],
        "held_out": None if args.text is not None else {"title": text.title, "source": text.source,
                                                        "licence": text.licence},
        "machine": {"cpu": asdict(cpu_features()), "bf16_products": bf16_products(), "int8_products": int8_products()},
        "conditions": f"perplexity = exp(mean NLL of every token but the first given those before it); "
                      f"{quality.prompts} prompts × {quality.new_tokens} greedy tokens float32 wrote, each dtype "
                      f"reading them through its cache, {CHUNK} positions a pass; KL(float32 ‖ dtype) of the "
                      f"next-token distributions at every scored position of the text, in nats"}
    del report["rows"]
    if kv_dtypes is not None:
        info = base.info
        steps = decode_step_times(models, ids)
        report["kv_dtypes"] = [{"kv_dtype": row.pop("dtype"), "bytes_per_position": bytes_per_position(
            row_dtype, info.n_layers, info.n_kv_heads, info.d_head), **row,
            "step_ms": round(percentile(steps.ms[row_dtype], 50), 3)}
            for row, row_dtype in ((dict(r), r["dtype"]) for r in report.pop("dtypes"))]
        report["conditions"] += (f"; the weights float32, K and V stored in each kv_dtype (int8: keys a scale per "
                                 f"channel per {GROUP} positions, values a scale per position; fp8: e4m3, a scale "
                                 f"per layer for K and for V) and read back for attention; step_ms: p50 of "
                                 f"{STEP_REPEATS} decode steps after {steps.context} positions of the text, the "
                                 f"cache dtypes' steps taken in turn, {torch.get_num_threads()} thread(s) on "
                                 f"{base.device.type}")
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    else:
        print_report(report)
    return 0


def print_report(report: dict) -> None:
    held = report["held_out"]
    where = f' ("{held["title"]}": {held["source"]}; {held["licence"]})' if held else ""
    print(f"model {report['model']}; text {report['text']}{where}")
    print(f"{report['tokens']} tokens scored in {report['windows']} window(s) of the {report['context']}-position "
          "context")
    print(cpu_line(report["machine"]["cpu"], report["machine"]["bf16_products"]))
    kv = "kv_dtypes" in report
    print(f"{'KV dtype' if kv else 'dtype':<10}{'perplexity':>11}{'NLL':>9}{'greedy agreement':>22}{'mean KL':>10}"
          + (f"{'B/position':>12}{'step ms':>9}" if kv else ""))
    for row in report["kv_dtypes" if kv else "dtypes"]:
        agree = f"{row['greedy_agree']}/{row['greedy_total']} ({row['greedy_agreement']:.1%})"
        print(f"{row['kv_dtype' if kv else 'dtype']:<10}{row['perplexity']:>11.3f}{row['nll']:>9.4f}{agree:>22}"
              f"{row['mean_kl']:>10.5f}"
              + (f"{row['bytes_per_position']:>12,.0f}{row['step_ms']:>9.2f}" if kv else ""))
    print(report["conditions"])


def run_window(args) -> int:
    """--kv-window S,W: the sink and the bounded cache (model/tools/kv_window.py), float32 weights."""
    sinks, window = parse_window(args.kv_window)
    policies = parse_policies(args.kv_policy)
    base = load_model(args.model, args.device, operator=True)
    text = held_out(base.info.language)
    name = args.text if args.text is not None else text.name
    ids = text_ids(base, read_text(args.text) if args.text is not None else text.text, name)
    report = {"model": base.info.name, "text": name} | measure_window(base, ids, sinks, window, policies)
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    else:
        print(f"model {report['model']}; text {report['text']}")
        print_window(report)
    return 0
