"""Server time of one Next click on the decode page, measured with AppTest (script run + rendering to protos).

    .venv/bin/python benchmarks/next_click.py [--model small] [--clicks 15] [--sentences 0]

AppTest runs the page script the way the server does, without the browser, so this is the server's share
of a click. Printed with the conditions; compare runs on the same machine only.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parent.parent / "app.py")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small")
    parser.add_argument("--clicks", type=int, default=15)
    parser.add_argument("--sentences", type=int, default=0,
                        help="corpus sentences before the prompt 'con mèo': a longer context")
    args = parser.parse_args()
    at = AppTest.from_file(APP, default_timeout=120)
    at.session_state["model_name"] = args.model
    at.session_state["device"] = "cpu"
    at.session_state["max_new_tokens"] = args.clicks + 5
    at.session_state["prompt_text"] = "con mèo ăn cá . " * args.sentences + "con mèo"
    at.run()
    at.switch_page("app_pages/decode.py").run()
    at.button(key="run_prefill").click().run()
    times = []
    for _ in range(args.clicks):
        t0 = time.perf_counter()
        at.button(key="next").click().run()
        times.append((time.perf_counter() - t0) * 1000)
        if at.button(key="next").disabled:  # the model stopped (eos): rewind one step and go on
            at.button(key="back").click().run()
    assert not at.exception, at.exception
    gen = at.session_state["generation"]
    print(f"Next click, {args.model} on cpu float32, {torch.get_num_threads()} torch threads, "
          f"{len(times)} clicks, cache ends at {gen.cache.length} positions")
    print(f"server time per click: p50 {statistics.median(times):.0f} ms, max {max(times):.0f} ms")


if __name__ == "__main__":
    main()
