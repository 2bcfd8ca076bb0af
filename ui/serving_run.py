"""The Serving page's long work, run in the page's own script where a click reaches it: its steps, its sweep and
its profile. Streamlit stops a script only where it draws, so the work redraws a bar as it goes (after a layer of a
pass, or between two timed steps; at most every RUN_REDRAW_S): a click on Stop, or on anything else, ends it there.
A stopped step keeps its plan, which the next click runs again whole (engine.Engine.step); a stopped measurement is
dropped. Work run from a button's callback could not be stopped and would show nothing until it ended."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import streamlit as st
import torch

from model.engine.kernels import MachineProducts
from model.engine.llama import has_tile_products
from model.engine.lowbit import DTYPES
from model.engine.runtime import LoadedModel
from model.errors import InputError
from model.serving import measure, workload
from model.serving.engine import Engine, StepProgress
from model.serving.kv_runs import QueueRun
from model.serving.quality import CHUNK, Quality, held_out
from ui.classroom import play_row
from ui.errors import attempt
from ui.i18n import t
from ui.models import shared_model_in
from ui.run import RUN_REDRAW_S
from ui.widgets import NEXT_KEY


class StopBar:
    """A Stop button and a progress bar, redrawn at most every RUN_REDRAW_S; `clear()` takes both away."""

    def __init__(self, key: str, text: str):
        self.stop = st.empty()
        self.stop.button(t("action.stop"), key=key, type="primary", icon=":material/stop:")
        self.bar = st.progress(0.0, text=text)
        self.last_drawn = time.monotonic()

    def draw(self, done: float, text: str) -> None:
        if time.monotonic() - self.last_drawn >= RUN_REDRAW_S:
            self.bar.progress(min(1.0, done), text=text)
            self.last_drawn = time.monotonic()

    def clear(self) -> None:
        self.stop.empty()
        self.bar.empty()


class StepBar:
    """How far the step under way is, and in a run to the end how many requests are served; `one_pass` the text of
    a pass over every row (the Serving page's, its decode rows apart; the Paged KV and Tiers pages', one mixed pass)."""

    def __init__(self, server: Engine, to_end: bool, key: str, one_pass: str):
        self.server, self.to_end, self.one_pass = server, to_end, one_pass
        self.stop_bar = StopBar(key, t("serving.running"))

    def show(self, progress: StepProgress) -> None:
        if progress.prefilled < progress.prefills:
            text = t("serving.progress_prefill", step=progress.step, k=progress.prefilled + 1, n=progress.prefills,
                     layer=progress.layer, layers=progress.layers)
        else:
            text = t(self.one_pass, step=progress.step, rows=progress.rows, layer=progress.layer,
                     layers=progress.layers)
        done = progress.done
        if self.to_end:
            served = sum(r.left_step is not None for r in self.server.requests.values())
            total = len(self.server.requests)
            text = t("serving.progress_served", served=served, total=total) + " · " + text
            done = served / total
        self.stop_bar.draw(done, text)


def run_steps(server: Engine, to_end: bool, key: str = "serving_stop",
              one_pass: str = "serving.progress_decode") -> str | None:
    """One step, or steps until every request is served, under a StepBar (its Stop button's key, its text of a pass);
    the sentence saying why a step failed, or None. The serving pages' one run of steps."""
    bar = StepBar(server, to_end, key, one_pass)
    error = None
    while not server.finished and error is None:
        _, error = attempt(lambda: server.step(bar.show))
        if not to_end:
            break
    bar.stop_bar.clear()
    return error


def asked_steps(prefix: str, run: Engine | QueueRun | None,
                run_steps: Callable[[bool], str | None]) -> tuple[str | None, bool]:
    """The steps the last click asked for (state[prefix + "_wanted"]: "one", or to the "end"), run here in the page's
    script, where a click on Stop reaches them (a callback cannot be stopped); state[prefix + "_running"] is True
    while they run, so the script run after a Stop knows the steps were cut short. run_steps(to_end) runs them and
    gives the sentence saying why a step failed, kept for callback_error_here. Returns what was asked (None: no
    click asked for anything) and whether the last steps were cut short."""
    state = st.session_state
    wanted, state[prefix + "_wanted"] = state[prefix + "_wanted"], None
    stopped = state[prefix + "_running"] and run is not None and not run.finished
    state[prefix + "_running"] = False
    if wanted in ("one", "end") and run is not None and not run.finished:
        state[prefix + "_running"], stopped = True, False
        error = run_steps(wanted == "end")
        state[prefix + "_running"] = False
        if error is not None:
            state.callback_error = error
    return wanted, stopped


def ask_steps(prefix: str, wanted: str) -> None:
    """Next's callback ("one") and Run's ("end"): asked_steps runs them in the page's next script run."""
    st.session_state[prefix + "_wanted"] = wanted


def run_buttons(prefix: str, run: Engine | QueueRun | None, start_label: str, on_start: Callable[[], None],
                on_reset: Callable[[], None], run_key: str, play: bool = False) -> None:
    """Start, then Next, Run (to the end) and Reset once there is a run: Next and Run ask asked_steps for one step
    or all of them (state[prefix + "_wanted"]); each button's key is prefix + its name, Run's run_key. With `play`,
    Play / Pause (ui/classroom.play_row, keys prefix + "_play"...) whose every tick asks for one step as Next does."""
    with st.container(horizontal=True, vertical_alignment="center"):
        st.button(t(start_label), key=prefix + "_start", type="primary" if run is None else "secondary",
                  icon=":material/play_arrow:", on_click=on_start)
        if run is not None:
            st.button(t("action.next"), key=prefix + "_next", type="primary", icon=":material/skip_next:",
                      disabled=run.finished, on_click=ask_steps, args=(prefix, "one"), shortcut=NEXT_KEY)
            st.button(t("action.run_to_end"), key=run_key, icon=":material/fast_forward:", disabled=run.finished,
                      on_click=ask_steps, args=(prefix, "end"))
            st.button(t("action.reset"), key=prefix + "_reset", icon=":material/restart_alt:", on_click=on_reset)
            if play:
                play_row(prefix, lambda: run.finished, functools.partial(ask_steps, prefix, "one"))


def run_variants(runs: list[QueueRun], names: list[str]) -> str | None:
    """Each run to its end under one Stop bar (names[k]: what the bar says it is); a Stop drops the run under way
    (the ones done stay done). The sentence saying why one failed, or None."""
    bar = StopBar("paged_compare_stop", t("paged.comparing"))
    error = None
    for run, name in zip(runs, names):
        def show(progress: StepProgress, run=run, name=name) -> None:
            served, total = sum(r.left_step is not None for r in run.requests), len(run.requests)
            bar.draw(served / total, t("paged.comparing_variant", variant=name, served=served, total=total))

        _, error = attempt(lambda run=run, show=show: run.run(show))
        if error is not None:
            break
    bar.clear()
    return error


@functools.cache
def machine(device: str, dtype: str = "float32") -> measure.Machine:
    """This machine's copy bandwidth and the matmul peak of `dtype`'s kernel, each measured once per process, the
    first time a Serving run needs it (the bandwidth once for every dtype)."""
    if dtype == "float32":
        return measure.measure_machine(torch.device(device))
    return measure.with_matmul_peak(machine(device, "float32"), dtype)  # one cache key: one measurement


_pass_costs: dict[tuple[str, str, str], workload.PassCosts] = {}


def pass_costs(model: LoadedModel) -> workload.PassCosts:
    """workload.pass_costs of the model in its weights' dtype, timed once per process (kept by name, device, dtype
    and tile products: not the model, which the shared models may drop)."""
    key = (model.info.name, model.info.device, model.info.dtype, has_tile_products(model.module))
    if key not in _pass_costs:
        _pass_costs[key] = workload.pass_costs(model)
    return _pass_costs[key]


DTYPE_CONTEXT = 64   # cached positions of the B = 1 step each dtype times
DTYPE_REPEATS = 10   # timed steps per dtype, the median shown

# per (model, device): each dtype's step and quality (measure.dtype_costs) and the sentences of the dtypes this
# machine refused; measured once per process, on the first click, so every later visit shows them at once
# (the refusals kept as InputErrors, said in each visitor's language when drawn)
_dtype_costs: dict[tuple[str, str], tuple[list[measure.DtypeCost], Quality, list[InputError]]] = {}


def dtype_context(model: LoadedModel) -> int:
    """The cached positions of each dtype's timed step: DTYPE_CONTEXT, or half of a shorter context."""
    return min(DTYPE_CONTEXT, model.info.context_length // 2)


def kept_dtype_costs(model: LoadedModel) -> tuple[list[measure.DtypeCost], Quality, list[InputError]] | None:
    return _dtype_costs.get((model.info.name, model.info.device))


def measure_dtype_costs(model: LoadedModel, draw: Callable[[float], None]) -> None:
    """measure.dtype_costs of every dtype this machine runs (the others' refusals kept), kept for the
    process; draw(share done) between the passes."""
    models, refused = {}, []
    for dtype in DTYPES:
        try:
            models[dtype] = shared_model_in(model, dtype)
        except InputError as bad:
            refused.append(bad)
    text_tokens = len(model.tokenizer.encode(held_out(model.info.language).text).ids)
    # the passes that tick: the text's chunks and the greedy texts per dtype, then each dtype's prefill and steps
    total = len(models) * (-(-text_tokens // CHUNK) + 1 + model.info.n_layers + DTYPE_REPEATS + 1)
    done = [0]

    def tick() -> None:
        done[0] += 1
        draw(done[0] / total)

    rows, quality = measure.dtype_costs(models, dtype_context(model), DTYPE_REPEATS, tick)
    _dtype_costs[(model.info.name, model.info.device)] = (rows, quality, refused)


def cpu_sentences(products: MachineProducts) -> list[str]:
    """What this CPU offers the bfloat16 and int8 products and how they run here, true whatever it lists."""
    cpu = products.cpu
    if products.bf16 == "avx512_bf16":
        bf16 = t("serving.cpu_bf16_native")
    elif products.bf16 == "torch":
        bf16 = t("serving.cpu_bf16_torch")
    elif cpu.avx512_bf16:
        bf16 = t("serving.cpu_bf16_unused")
    else:
        bf16 = t("serving.cpu_bf16_emulated" if cpu.avx512_bf16 is not None else "serving.cpu_bf16_unknown")
    said = [bf16]
    if cpu.amx_bf16:
        said.append(t("serving.cpu_amx_torch" if products.bf16 == "torch" else "serving.cpu_amx"))
    said.append(t({"avx512_vnni": "serving.cpu_int8_vnni", "integer": "serving.cpu_int8_integer",
                   "none": "serving.cpu_int8_none"}[products.int8]))
    return said
