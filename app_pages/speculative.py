"""Speculative decoding: a draft proposes γ tokens, the model checks them in one pass, accepts a prefix and
crops the rest from both caches; the round's arithmetic, running counts and the measured speed."""

import json
from functools import partial

import streamlit as st

from model.recording import speculative as speculative_file
from model.speculative import decoding, drafts, rules
from ui import svg
from ui.classroom import key_figure, play_row, settings
from ui.controls import sampling_controls
from ui.errors import callback_error_here, guarded, guarded_in_callback
from ui.i18n import decimal, labels, lang, number, t
from ui.models import page_start
from ui.run import LiveStrip, encoded_prompt, prompt_modes, sampling_settings
from ui.speculative_round import draw_counts, draw_round, draw_round_picture, draw_sequence, run_strip
from ui.state import SPECULATIVE_PROMPTS, default_prompt, keep_across_pages, trained_from
from ui.widgets import NEXT_KEY, choice, md_escape

PAGE_DEFAULTS = {"spec_run": None, "spec_for": None, "spec_draft": "small-draft", "spec_exit_layers": None,
                 "spec_exit_for": None, "spec_gamma": 4, "spec_speed": None, "spec_run_to_end_requested": False,
                 "spec_running": False, "spec_unknown": [], "spec_opened_for": None}
keep_across_pages(PAGE_DEFAULTS)

model = page_start("speculative")
info, tok = model.info, model.tokenizer
if st.session_state.spec_for != (info.name, info.device):
    st.session_state.spec_run, st.session_state.spec_speed = None, None


def draft_spec() -> str:
    chosen = st.session_state.spec_draft
    return f"{drafts.EARLY_EXIT}{st.session_state.spec_exit_layers}" if chosen == "early-exit" else chosen


def start_run() -> None:
    prompt = guarded_in_callback(lambda: encoded_prompt(model, st.session_state.prompt_mode))
    if prompt is None:
        return
    run = guarded_in_callback(lambda: decoding.start(model, draft_spec(), prompt[0],
                                                        int(st.session_state.spec_gamma), sampling_settings(),
                                                        int(st.session_state.max_new_tokens)))
    if run is not None and guarded_in_callback(lambda: decoding.next_round(run)) is not None:
        st.session_state.spec_run, st.session_state.spec_for = run, (info.name, info.device)
        st.session_state.spec_speed, st.session_state.spec_unknown = None, prompt[1]


def next_round() -> None:
    run = st.session_state.spec_run
    run.settings = sampling_settings()  # the sampling controls apply from the next round on
    guarded_in_callback(lambda: decoding.next_round(run))


def request_run_to_end() -> None:
    """The rounds run in a whole-page run below the buttons, where a click on Stop (or any button) ends it."""
    st.session_state.spec_run.settings = sampling_settings()
    st.session_state.spec_run_to_end_requested = True


def rounds_to_the_end(run: decoding.SpeculativeRun) -> None:
    st.session_state.spec_running = True
    live = LiveStrip(t("speculative.running"))
    while guarded(lambda: decoding.next_round(run)) is not None:
        live.show(*run_strip(run, tok.token), done=len(run.new_ids) / run.max_new_tokens,
                  last=run.stop_reason is not None)
    live.clear()
    st.session_state.spec_running = False


def run_json(run: decoding.SpeculativeRun, speed: decoding.SpeedComparison | None, unknown: list[str]) -> str:
    """The run as `python -m model speculate --json` prints it."""
    return json.dumps(speculative_file.report(run, speed, unknown), ensure_ascii=False)


def reset() -> None:
    st.session_state.spec_run, st.session_state.spec_speed = None, None


def use_page_example() -> None:
    """Where the box still holds the model's example prompt, the page's own (one the draft partly agrees with);
    before the box is drawn."""
    state = st.session_state
    example = SPECULATIVE_PROMPTS.get(trained_from(state.model_name))
    if example is not None and state.prompt_mode == "text" and state.prompt_text == default_prompt(
            trained_from(state.model_name)):
        state.prompt_text = example[lang()]


# -- settings: draft, γ, prompt, sampling -----------------------------------------------------------------------
draft_names = [d.split(":")[0] for d in drafts.draft_choices(model)]
if st.session_state.spec_exit_for != info.name:  # each model starts from its own suggested K
    st.session_state.spec_exit_for = info.name
    st.session_state.spec_exit_layers = drafts.suggested_exit_layers(model)
# the first visit with this model opens on round 1 of the settings shown (the draft and mode as the controls have
# them: after they are drawn)
first_visit = st.session_state.spec_run is None and st.session_state.spec_opened_for != (info.name, info.device)
if first_visit:
    use_page_example()
with settings("speculative"):
    # the draft with the early exit's layers beside it: "small-draft — 1 lớp, cùng tokenizer với small" is 272 px,
    # 340 in presenter mode; then γ and the tokens
    draft_column, exit_column = st.columns([2, 1])
    with draft_column:
        draft = choice(st.selectbox, t("speculative.draft"), draft_names, key="spec_draft",
                       format_func=labels("speculative.draft_", draft_names).get, help=t("speculative.draft_help"))
    if draft == "early-exit":
        st.session_state.spec_exit_layers = min(int(st.session_state.spec_exit_layers), info.n_layers - 1)
        exit_column.number_input(t("speculative.exit_layers"), min_value=1, max_value=info.n_layers - 1,
                                 key="spec_exit_layers", help=t("speculative.exit_layers_help", n=info.n_layers))
    gamma_column, tokens_column = st.columns([2, 1])
    gamma_column.slider(t("speculative.gamma"), 1, 8, key="spec_gamma", help=t("speculative.gamma_help"))
    st.session_state.max_new_tokens = min(int(st.session_state.max_new_tokens), info.context_length - 1)
    tokens_column.number_input(t("prompt.max_new_tokens"), min_value=1, max_value=info.context_length - 1,
                               key="max_new_tokens")
    modes = prompt_modes(model)
    p1, p2 = st.columns([4, 1], vertical_alignment="bottom")
    with p2:
        mode = choice(st.segmented_control, t("prompt.mode"), modes, key="prompt_mode",
                      format_func=labels("prompt.mode_", modes).get, required=True)
    if mode == "ids":
        p1.text_input(t("prompt.ids_label"), key="prompt_ids_text", help=t("prompt.ids_help"))
    else:
        p1.text_input(t("prompt.chat_label" if mode == "chat" else "prompt.label"), key="prompt_text")
    st.markdown(f"**{md_escape(t('speculative.sampling'))}**")
    with st.container(horizontal=True, vertical_alignment="bottom"):
        sampling_controls()
    st.caption(t("speculative.sampling_note"))
if first_visit:
    st.session_state.spec_opened_for = (info.name, info.device)
    start_run()

run = st.session_state.spec_run
finished = run is not None and run.stop_reason is not None
with st.container(horizontal=True, vertical_alignment="center"):
    st.button(t("speculative.start"), key="spec_start", type="primary" if run is None else "secondary",
              icon=":material/play_arrow:", on_click=start_run)
    if run is not None:
        st.button(t("speculative.next_round"), key="spec_next", type="primary", icon=":material/skip_next:",
                  disabled=finished, on_click=next_round, shortcut=NEXT_KEY)
        st.button(t("action.run_to_end"), key="spec_run_to_end", icon=":material/fast_forward:", disabled=finished,
                  on_click=request_run_to_end)
        st.button(t("action.reset"), key="spec_reset", icon=":material/restart_alt:", on_click=reset)
if run is not None:  # a row of its own: beside the four buttons the pace would not fit a 1280-px screen
    play_row("speculative", lambda: run.stop_reason is not None, next_round)
callback_error_here()  # under the row of buttons, whichever of them failed
if run is None:
    st.info(t("speculative.press_start"))
    st.stop()
if st.session_state.spec_running:  # the last Run to end was stopped by a click between two rounds
    st.session_state.spec_running = False
    if not finished:
        st.info(t("speculative.run_stopped", rounds=len(run.rounds), tokens=len(run.new_ids)))
if st.session_state.spec_run_to_end_requested:
    st.session_state.spec_run_to_end_requested = False
    st.button(t("action.stop"), key="spec_stop", type="primary", icon=":material/stop:")
    rounds_to_the_end(run)
    st.rerun()

# -- this round as a picture, the sequence, the round's tables, the running counts (ui/speculative_round.py: the
# Replay page draws a recording so) ---------------------------------------------------------------------------
with key_figure():
    draw_round_picture(run, tok.token)
draw_sequence(run, tok.token)
draw_round(run, tok.token, run.settings.greedy, folded=True)
draw_counts(run, tok.token)
st.html(svg.line_chart_svg([r.index + 1 for r in run.rounds],
                           {t("speculative.chart_proposed"): [len(r.checks) for r in run.rounds],
                            t("speculative.chart_kept"): [r.accepted for r in run.rounds]},
                           t("speculative.col_round"), t("speculative.chart_tokens"), t("speculative.chart_title"),
                           dashed=(t("speculative.chart_proposed"),), number=lambda v: number(v, "g"),
                           title=t("speculative.chart_title"), zoom=1.5))

# -- speed against plain decoding -----------------------------------------------------------------------------
st.subheader(t("speculative.speed"))
if st.button(t("speculative.measure"), key="spec_measure", icon=":material/timer:"):
    with st.spinner(t("speculative.measuring")):
        st.session_state.spec_speed = guarded(lambda: decoding.compare_speed(
            model, run.draft.name, run.prompt_ids, run.gamma, run.settings, run.max_new_tokens))
speed = st.session_state.spec_speed
if speed is None:
    st.caption(t("speculative.measure_help"))
else:
    s1, s2, s3 = st.columns(3)
    s1.metric(t("speculative.plain_ms"), f"{decimal(speed.plain_ms_per_token, 2)} ms")
    s2.metric(t("speculative.spec_ms"), f"{decimal(speed.speculative_ms_per_token, 2)} ms")
    s3.metric(t("speculative.speedup"), f"{decimal(speed.speedup, 2)}×")
    st.caption(t("speculative.conditions", model=info.name, draft=run.draft.name, gamma=run.gamma,
                 plain=speed.plain_tokens, spec=speed.speculative_tokens, passes=speed.target_passes,
                 repeats=speed.repeats, device=speed.device, dtype=speed.dtype, threads=speed.threads))
    st.markdown(t("speculative.speed_verdict_" + ("faster" if speed.speedup > 1 else "slower")))
    if speed.alpha is not None and speed.cost_ratio is not None:
        st.caption(t("speculative.predicted", alpha=decimal(speed.alpha, 2), gamma=run.gamma,
                     c=decimal(speed.cost_ratio, 2),
                     value=decimal(rules.predicted_speedup(speed.alpha, run.gamma, speed.cost_ratio), 2)))

st.download_button(t("speculative.download"), key="spec_download", icon=":material/download:", on_click="ignore",
                   help=t("speculative.download_help"),
                   file_name="decode-lab-speculative.json", mime="application/json",
                   data=partial(run_json, run, speed, st.session_state.spec_unknown))
st.subheader(t("speculative.answer"))
st.markdown(t("speculative.answer_text", text=md_escape(tok.decode(run.new_ids)) or "∅", n=len(run.new_ids)))
if finished:
    st.info(t("speculative.stopped", reason=t("stop." + run.stop_reason)))
with st.expander(t("speculative.how")):
    st.markdown(t("speculative.how_text"))
    st.caption(t("speculative.sources"))
