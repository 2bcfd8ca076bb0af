"""Fine-tune: post-training one optimizer step per click (cells 4D SFT, 4E LoRA, 4F RLHF, 4G DPO), each method a
tab with its data, its loss, its numbers per step (chart and table) and the same prompts answered before and now.

Each tab's key figure is those answers, with the step buttons right under them and the method's settings folded; the
page opens on the SFT tab with its run made (small, no step yet), so the "before" answers are there at once. The
views are drawn by ui/finetune_views.py."""

import math
from dataclasses import replace
from functools import partial

import streamlit as st

from model.training.dpo import DPO
from model.training.lora import LoRA
from model.training.posttrain import IDENTITY_FIELDS, FinetuneSettings
from model.training.rlhf import RLHF
from model.training.sft import SFT
from model.training.train import limits
from ui import finetune_views as views
from ui.classroom import key_figure, settings, why
from ui.errors import guarded
from ui.i18n import number, t
from ui.pages import FINETUNE_TABS
from ui.runs import interrupted_run, run_steps
from ui.state import keep_across_pages
from ui.widgets import NEXT_KEY

BOUND = limits()
CLASSES = {"sft": SFT, "lora": LoRA, "dpo": DPO, "rlhf": RLHF}
ORDER = tuple(FINETUNE_TABS)  # the map's order: 4D, 4E, 4F, 4G
DEFAULTS = FinetuneSettings()
WIDGETS = {"ft_trainers": {}, "ft_running": None, "train_store": None, "session_checkpoints": {},
           "checkpoint_bases": {}, "ft_saved": None, "ft_opened": False}
for m in ORDER:
    WIDGETS.update({f"ft_{m}_model": "small", f"ft_{m}_seed": 0, f"ft_{m}_batch": 16, f"ft_{m}_n": 20})
WIDGETS.update({"ft_lora_rank": 4, "ft_lora_alpha": 8.0, "ft_lora_targets": "qv", "ft_dpo_beta": 0.1,
                "ft_rlhf_beta": 0.1, "ft_rlhf_bonus": 0.0, "ft_rlhf_rm_n": 40})


def settings_of(method: str) -> FinetuneSettings:
    s = st.session_state
    extra = {}
    if method == "lora":
        extra = dict(rank=int(s.ft_lora_rank), alpha=float(s.ft_lora_alpha), targets=s.ft_lora_targets)
    if method == "dpo":
        extra = dict(beta=float(s.ft_dpo_beta))
    if method == "rlhf":
        extra = dict(beta=float(s.ft_rlhf_beta), length_bonus=float(s.ft_rlhf_bonus))
    model = s[f"ft_{method}_model"] if method in ("sft", "lora") else "small"
    return FinetuneSettings(method=method, model=model, seed=int(s[f"ft_{method}_seed"]),
                            batch_size=int(s[f"ft_{method}_batch"]), **extra)


def session_trainer(method: str):
    """This session's trainer of the method (None before its first step or after Reset), with the widgets' β, batch
    and length bonus from its next step on. A new model, seed, rank, alpha or target layers waits for Reset: until
    then the run goes on as it was (new_run_waits says so)."""
    trainer = st.session_state.ft_trainers.get(method)
    if trainer is None:
        return None
    wanted = replace(settings_of(method), **{name: getattr(trainer.settings, name) for name in IDENTITY_FIELDS})
    if wanted != trainer.settings:
        guarded(lambda: trainer.update_settings(wanted))  # refused: one sentence, the trainer keeps its settings
    return trainer


def new_trainer(method: str):
    """The method's trainer from the widgets' settings, made at its first step; None (and one sentence) if refused."""
    with st.spinner(t("finetune.preparing")):
        trainer = guarded(lambda: CLASSES[method](settings_of(method), st.session_state.device))
    st.session_state.ft_trainers[method] = trainer
    return trainer


def reset(method: str) -> None:
    st.session_state.ft_trainers[method] = None


def steps_left(trainer) -> int:
    """Optimizer steps this run may still make (RLHF counts its reward model's too)."""
    return BOUND.max_steps - (trainer.steps_used if trainer is not None else 0)


def run_label(key: str, asked: int, left: int) -> str:
    """"Run N steps" with the N the button will run: the steps asked, or fewer near the run's limit."""
    return t(key, n=number(min(asked, left) if left > 0 else asked))


def capped(asked: int, left: int) -> None:
    if 0 < left < asked:
        st.caption(t("finetune.run_capped", left=number(left), most=number(BOUND.max_steps), asked=number(asked)))


def run_n(method: str, trainer, count, step, n: int, figure) -> None:
    run_steps("ft_running", trainer, count, step, n, t("finetune.cancel"), f"ft_{method}_cancel",
              lambda done: t("finetune.running", done=number(done), n=number(n)), figure, f"ft_{method}_live")


def controls(method: str, trainer):
    """One step / Run N / Reset of the method (on RLHF, of its policy); returns the trainer (None before the
    first step)."""
    left, asked = steps_left(trainer), int(st.session_state[f"ft_{method}_n"])
    waiting = method == "rlhf" and (trainer is None or not trainer.rm_history)  # the reward model steps first
    b1, b2, b3, b4 = st.columns([1.2, 1, 1.3, 1], vertical_alignment="bottom")
    one = b1.button(t("finetune.one_step"), key=f"ft_{method}_one", type="primary", icon=":material/skip_next:",
                    width="stretch", shortcut=NEXT_KEY,  # only the open tab is drawn: one button holds the key
                    disabled=left < 1 or waiting)
    b2.number_input(t("finetune.n_steps"), 1, 500, key=f"ft_{method}_n")
    run = b3.button(run_label("finetune.run_n", asked, left), key=f"ft_{method}_run", icon=":material/fast_forward:",
                    width="stretch", disabled=left < 1 or waiting)
    b4.button(t("action.reset"), key=f"ft_{method}_reset", icon=":material/restart_alt:", on_click=reset,
              args=(method,), width="stretch")
    if left < 1:
        st.info(t("error.finetune_step_limit", steps=number(BOUND.max_steps)))
    capped(asked, left)
    if (one or run) and trainer is None:
        trainer = new_trainer(method)
    if trainer is not None and one:
        guarded(trainer.step)
    elif trainer is not None and run:
        run_n(method, trainer, lambda: trainer.steps_done, trainer.step, min(asked, left),
              partial(views.history_chart, method, trainer))
    return trainer


def rlhf_reward_model(trainer):
    """(a): the reward model's One step / Run N, its chart and its held-out accuracy; returns the trainer, made at
    the reward model's first step."""
    st.markdown(t("finetune.rm_explain"))
    left, asked = steps_left(trainer), int(st.session_state.ft_rlhf_rm_n)
    c1, c2, c3 = st.columns([1.2, 1, 1.3], vertical_alignment="bottom")
    one = c1.button(t("finetune.rm_one"), key="ft_rlhf_rm_one", icon=":material/skip_next:", width="stretch",
                    disabled=left < 1)
    c2.number_input(t("finetune.n_steps"), 1, 200, key="ft_rlhf_rm_n")
    run = c3.button(run_label("finetune.rm_run", asked, left), key="ft_rlhf_rm_run", icon=":material/fast_forward:",
                    width="stretch", disabled=left < 1)
    capped(asked, left)
    if (one or run) and trainer is None:
        trainer = new_trainer("rlhf")
    if trainer is not None and one:
        guarded(trainer.reward_step)
    elif trainer is not None and run:
        run_n("rlhf", trainer, lambda: len(trainer.rm_history), trainer.reward_step, min(asked, left),
              partial(views.reward_model_chart, trainer))
    if trainer is not None and trainer.rm_history:
        r = trainer.rm_history[-1]
        st.plotly_chart(views.reward_model_chart(trainer), key="ft_rlhf_rm_chart")
        st.markdown(t("finetune.rm_read", steps=number(r["step"]), loss=number(r["loss"], ".4f"),
                      acc=number(r["held_out_accuracy"], ".0%"), n=number(len(trainer.held_out))))
    return trainer


keep_across_pages(WIDGETS | {"ft_tab": t("finetune.tab_" + ORDER[0])})  # the open tab, by its label
if st.query_params.get("tab") in ORDER:  # a link to one method's cell (the map's, opened in a new tab)
    st.session_state.ft_tab = t("finetune.tab_" + st.query_params.pop("tab"))
st.title(t("finetune.title"))
stopped = interrupted_run("ft_running")
if stopped is not None:
    ran_on, done, asked = stopped
    if ran_on is st.session_state.ft_trainers.get(ran_on.method):
        st.info(t("finetune.run_stopped", done=number(done), asked=number(asked)))
    else:  # Reset during the run: its steps went with the trainer it ran on
        st.info(t("finetune.run_reset", asked=number(asked)))

# Only the open tab runs (Streamlit's lazy tabs): a step on one method does not redraw the three others
tabs = st.tabs([t("finetune.tab_" + m) for m in ORDER], key="ft_tab", on_change="rerun")
for method, tab in zip(ORDER, tabs):
    if not tab.open:
        continue
    with tab:
        st.subheader(t("finetune.h_" + method), anchor=FINETUNE_TABS[method])
        trainer = session_trainer(method)
        if method == "sft" and trainer is None and not st.session_state.ft_opened:
            trainer = new_trainer(method)  # the first visit opens on a run made: its "before" answers
        elif trainer is not None and trainer.steps_used == 0 and any(
                getattr(trainer.settings, name) != getattr(settings_of(method), name) for name in IDENTITY_FIELDS):
            trainer = new_trainer(method)  # no step made yet: a new model or seed needs no Reset
        st.session_state.ft_opened = True
        with settings("ft_" + method):
            views.method_settings(method, settings_of(method))
        figure = key_figure()  # filled once the buttons below have made their step
        if method == "rlhf":
            st.markdown(t("finetune.h_reward_model"))
            trainer = rlhf_reward_model(trainer)
            st.markdown(t("finetune.h_policy"))
        trainer = controls(method, trainer)
        with figure:
            views.before_after(method, trainer, settings_of(method).model)
            if method == "rlhf" and (trainer is None or not trainer.rm_history):
                st.info(t("finetune.press_reward_step", warmup=DEFAULTS.warmup_sft_steps))
            elif trainer is None:
                st.info(t("finetune.press_step"))
        if trainer is not None:
            views.new_run_waits(settings_of(method), trainer)
        with why("ft-" + method):
            st.caption(t("finetune.intro", warmup=DEFAULTS.warmup_sft_steps))
            st.markdown(t("finetune.explain_" + method, ln2=number(math.log(2), ".4f")))
        if method == "dpo":
            views.dpo_view(trainer)
        if trainer is None:
            continue
        views.status(method, trainer)
        if method in ("sft", "lora"):
            views.sft_view(method, trainer)
        if method == "lora":
            views.lora_view(trainer)
        if method == "rlhf" and trainer.history:
            views.rlhf_samples(trainer)
        if method == "rlhf":
            st.caption(t("finetune.rlhf_simplified"))
        views.numbers(method, trainer)
        views.use_this_model(method, trainer)
