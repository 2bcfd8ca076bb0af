"""Decode: one token per step over a KV cache that grows by one position; sampling; the recompute check.

Everything a step changes sits in one fragment: Next, Back, the sampling controls and the layer and head rerun it
alone, not the sidebar, the title or the controls. The browser's work per click grows with the number of elements
it redraws, hardly with their size, so the fragment is the four buttons and one piece of HTML: the strip, the
attention, the probabilities, the cache (two SVG charts among them), the check and the answer. Run to end is a
whole-page run instead, so that its Stop button can interrupt it.

The key figure, on the first screen: Play and the sampling lesson's preset (whole-page controls, outside the
fragment), then the step view. Every setting, the prompt form among them, is folded into one expander above it,
and the page opens on the form's prompt already prefilled (controls.first_run). Play presses the Next button's own
callback, so n ticks are n Next presses.
"""

from functools import partial

import streamlit as st

from model.engine import generate
from model.serving.kv_lessons import BOUNDED
from ui.bounded_row import POLICIES
from ui.classroom import key_figure, play_row, settings, why
from ui.controls import (
    attention_scale,
    first_run,
    layer_head_selectors,
    prompt_form,
    sampling_controls,
)
from ui.errors import callback_error_here
from ui.i18n import labels, number, t
from ui.models import page_start
from ui.pages import page
from ui.predict import guess_inputs, on_next_with_guess, reveal_html
from ui.probes import probe_controls, probes_html
from ui.process import CHECKS
from ui.reruns import redraw_only, rerun_whole_page
from ui.run import (
    generation,
    mark_cancelled_run,
    on_back,
    on_sampling_change,
    request_run_to_end,
    reset,
    run_as_trace_json,
    run_to_end,
)
from ui.step_keys import clicks_marker, count_click, queue_step_keys
from ui.step_view import live_step, step_view_html
from ui.widgets import (
    BACK_KEY,
    NEXT_KEY,
    box_html,
    choice,
)

STEP_VIEW = "decode_step"  # the fragment that draws the current step
CHECK_POLL_S = 0.15  # how often the page asks whether the step's background check is done
CHECK_INLINE_S = 0.03  # a check done this soon is drawn with its step (small's take a few ms): no poll, no rerun
CHECK_DEFER_S = 0.1  # a slower check starts this long after its step, at the poller's first tick: the token first
# the sampling lesson in one click: a spread distribution, from which top-k and top-p visibly remove tokens
SAMPLING_PRESET = {"temperature": 0.8, "top_k_on": True, "top_k": 5, "top_p": 0.9}

model = page_start("decode", intro=False)
info, tok = model.info, model.tokenizer
mark_cancelled_run()
started = first_run(model)

# The controls stay outside the step view: a Next click does not redraw them, and a change of them reruns only
# the step view (redraw_only), not the sidebar and the title. Flex rows, not st.columns: with columns on the page,
# every click of the step view costs the browser more (benchmarks/click_latency.py).
with settings("decode", expanded=started is None):
    prompt_form(model)  # Run prefill's callback starts the new run before the page is drawn
    with st.container(horizontal=True, vertical_alignment="bottom"):
        layer_head_selectors(info, redraw=STEP_VIEW)
        attention_scale(redraw=STEP_VIEW)
        sampling_controls(redraw=STEP_VIEW)
        st.toggle(t("decode.check_each_step"), key="check_each_step", help=t("decode.check_help"),
                  on_change=redraw_only, args=(STEP_VIEW,))
        probe_controls(info, redraw=STEP_VIEW)
        choice(st.selectbox, t("decode.bounded"), POLICIES, key="decode_bounded", width=220,
               format_func={"off": t("decode.bounded_off"), **labels("kv.policy_", BOUNDED)}.get,
               help=t("decode.bounded_help"), on_change=lambda: redraw_only(STEP_VIEW))
        st.toggle(t("predict.toggle"), key="predict_on",  # the whole page: the guesses appear
                  help=t("predict.help", next=t("action.next")))
if started is None:  # after Reset: the form above is the next action
    st.info(t("decode.press_prefill"))
    st.stop()
if st.session_state.predict_on:
    guess_inputs(model, generation(model))
queue_step_keys()  # → and ← press Next and Back in the order pressed


if st.session_state.run_to_end_requested:
    # Run to end runs in a whole-page run, with a Stop button outside any fragment: Streamlit 1.67 lets a click
    # inside a fragment wait until the running script ends, while a click outside one stops it between two steps
    # (mark_cancelled_run above then records the cancel).
    st.session_state.run_to_end_requested = False
    st.button(t("action.stop"), key="stop_run", type="primary", icon=":material/stop:")
    run_to_end(model, generation(model))
    st.rerun()


def back_step() -> None:
    """Back, noted with the run and the step it went back to: the step view then says the cache was cropped."""
    on_back()
    gen = st.session_state.generation
    st.session_state.decode_cropped = (id(gen), len(gen.steps)) if gen is not None else None


def use_sampling_preset() -> None:
    """The sampling lesson's settings, then the current step drawn again with them (the model does not run)."""
    for key, value in SAMPLING_PRESET.items():
        st.session_state[key] = value
    on_sampling_change()


next_click = count_click(on_next_with_guess)  # the Next button's callback, and Play's step


@st.fragment(key=STEP_VIEW)
def step_view() -> None:
    mark_cancelled_run()
    gen = generation(model)
    if gen is None:  # Reset inside the fragment: the whole page draws the prompt form again
        rerun_whole_page()
    # callbacks run before the fragment is drawn, so the buttons below already show the new state
    with st.container(horizontal=True):
        st.button(t("action.next"), key="next", type="primary", icon=":material/skip_next:", disabled=gen.finished,
                  on_click=next_click, shortcut=NEXT_KEY)
        st.button(t("action.back"), key="back", icon=":material/undo:", disabled=len(gen.steps) < 2,
                  on_click=count_click(back_step), shortcut=BACK_KEY)
        st.button(t("action.run_to_end"), key="run_to_end", icon=":material/fast_forward:", disabled=gen.finished,
                  on_click=request_run_to_end)
        st.button(t("action.reset"), key="reset", icon=":material/restart_alt:", on_click=reset)
    callback_error_here()  # why Next, Back or a sampling change failed, under the buttons
    cropped = (box_html(t("decode.back_cropped", n=gen.steps[-1].cache_len), "note")
               if st.session_state.get("decode_cropped") == (id(gen), len(gen.steps)) else "")
    st.html(cropped + step_html(gen, st.session_state.layer, st.session_state.head) + clicks_marker())
    if st.session_state.check_each_step and len(gen.steps) - 1 not in gen.checks:
        wait_for_check(len(gen.steps) - 1)


@st.fragment(run_every=CHECK_POLL_S)
def wait_for_check(index: int) -> None:
    """Every CHECK_POLL_S: starts this step's check in the background once the step is CHECK_DEFER_S old (the page
    has drawn it by then), and asks whether it is done; then one whole-page run draws the verdict in place, and no
    longer draws this poller (Streamlit then stops its timer). Between two polls nothing runs, so a Next is never
    kept waiting by a check."""
    gen = st.session_state.generation
    if gen is None or len(gen.steps) - 1 != index:  # the run moved on
        rerun_whole_page()
    if generate.check_last_step_in_background(model, gen, CHECKS, defer_s=CHECK_DEFER_S) is not None:
        rerun_whole_page()


def step_html(gen: generate.Generation, layer: int, head: int) -> str:
    """Everything the current step shows, as one piece of HTML."""
    gen.view = (layer, head)  # what older steps keep of their attention once the session reaches its budget
    checking = st.session_state.check_each_step
    check = (generate.check_last_step_in_background(model, gen, CHECKS, CHECK_INLINE_S, CHECK_DEFER_S) if checking
             else None)
    predicted = reveal_html(model, gen) if st.session_state.predict_on else ""
    return (step_view_html(live_step(model, gen, layer, head, check, checking, predicted,
                                     st.session_state.attention_scale, st.session_state.decode_bounded))
            + probes_html(model, gen, len(gen.steps) - 1, lens=st.session_state.logit_lens))


def run_finished() -> bool:
    gen = generation(model)
    return gen is None or gen.finished


with key_figure():
    with st.container(horizontal=True, vertical_alignment="center"):
        play_row("decode", finished=run_finished, step=next_click)
        st.button(t("decode.sampling_preset", temperature=number(SAMPLING_PRESET["temperature"]),
                    k=SAMPLING_PRESET["top_k"], p=number(SAMPLING_PRESET["top_p"])), key="sampling_preset",
                  icon=":material/filter_alt:", help=t("decode.sampling_preset_help"), on_click=use_sampling_preset)
    step_view()
with why("decode"):
    st.caption(t("decode.intro"))
# the file is made when it is asked for (no work on a Next), from the run as it is then
st.download_button(t("decode.download"), key="download_run", icon=":material/download:", on_click="ignore",
                   file_name="decode-lab-run.json", mime="application/json",
                   data=partial(run_as_trace_json, model, generation(model), st.session_state.prompt_of_run,
                                st.session_state.prompt_unknown), help=t("decode.download_help"))
st.page_link(page("replay").path, label=t("replay.open"), icon=page("replay").icon)
