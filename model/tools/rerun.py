"""python -m model rerun FILE: a recording run again, MATCH or the first step that differs."""

from __future__ import annotations

from pathlib import Path

from model.errors import InputError
from model.recording.replay import (
    DECODE,
    MAX_RECORDING_BYTES,
    PROB_TOLERANCE,
    _safe,
    read_recording,
    recording_kind,
    rerun,
)
from model.tools.options import read_bounded


def run_cli(args) -> int:
    """python -m model rerun FILE: the recording read and checked as the Replay page reads it, run again on this
    machine, and the verdict printed; exit status 0 when it matches, 1 when it differs (2: a file or model that
    cannot be re-run, said in one sentence)."""
    from model.engine.loading import load_model
    from model.texts import text
    from model.weights.catalog import FETCHED, list_models, settings

    path = Path(args.file)
    try:
        data = read_bounded(path, MAX_RECORDING_BYTES)
        if len(data) > MAX_RECORDING_BYTES:
            raise InputError("recording_too_large", kb=path.stat().st_size // 1024, most=MAX_RECORDING_BYTES // 1024)
        run = read_recording(data)
    except OSError as failed:
        raise InputError("recording_unreadable", path=args.file,
                         reason=failed.strerror or type(failed).__name__) from None
    name = run["model"]["name"]
    if name not in list_models(settings().models_dir):
        raise InputError("recording_model_absent" if name in FETCHED else "recording_model_unknown", model=_safe(name))
    done = rerun(load_model(name, args.device), run)
    found = {"model": name, "device": done.device, "dtype": done.dtype, "tol": PROB_TOLERANCE}
    decode = recording_kind(run) == DECODE
    if done.matches:
        print(text("replay.rerun_match" if decode else "replay.rerun_match_rounds", "en").format(
            n=done.steps, gap=f"{done.max_prob_diff:.1e}", draft=run.get("draft"), **found))
        return 0
    d = done.difference
    what = text("replay.what_" + d.what, "en").format(tol=PROB_TOLERANCE)
    print(text("replay.rerun_differs" if decode else "replay.rerun_differs_round", "en").format(
        step=d.step, round=d.step + 1, what=what, recorded=d.recorded, now=d.now, **found))
    return 1
