"""Train: one training step at a time on this session's own copy of micro or small, every stage in map order
(1A corpus … 3E checkpoint), the checkpoint loaded back for inference, and the memory savers 4A and 4B. The cells
are drawn by ui/train_cells.py.

The key figure is the loss: this step's value beside ln V and the curve of every step so far, with the step buttons
right under it; the architecture, initial weights and hyper-parameters are folded into the settings above it."""

from functools import partial

import streamlit as st
import torch

from model.training.train import Trainer, TrainSettings, limits
from ui import train_cells as cells
from ui.classroom import key_figure, settings, why
from ui.errors import guarded
from ui.i18n import labels, number, t
from ui.runs import interrupted_run, run_steps
from ui.state import keep_across_pages
from ui.widgets import NEXT_KEY, choice

BOUND = limits()
DEFAULTS = TrainSettings()
WIDGETS = {"train_seed": DEFAULTS.seed, "train_batch": DEFAULTS.batch_size, "train_seq_len": DEFAULTS.seq_len,
           "train_accum": DEFAULTS.accum_steps, "train_lr": DEFAULTS.lr, "train_warmup": DEFAULTS.warmup_steps,
           "train_schedule": DEFAULTS.schedule_steps, "train_clip": DEFAULTS.clip,
           "train_wd": DEFAULTS.weight_decay, "train_bf16": False, "train_ckpt": False, "train_n": 50,
           "train_row": 0, "train_trainer": None, "train_store": None, "session_checkpoints": {},
           "checkpoint_bases": {}, "train_memory": None, "train_running": None, "train_files": None,
           "train_compare": None, "train_compare_ckpt": None, "train_prompt": None}
LR_CHOICES = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2]


def reset() -> None:
    st.session_state.train_trainer = None
    st.session_state.train_memory = None


def settings_from_widgets() -> TrainSettings:
    s = st.session_state
    return TrainSettings(model=s.train_model, init=s.train_init, seed=int(s.train_seed),
                         batch_size=int(s.train_batch), seq_len=int(s.train_seq_len), lr=float(s.train_lr),
                         warmup_steps=int(s.train_warmup), schedule_steps=int(s.train_schedule),
                         clip=float(s.train_clip), weight_decay=float(s.train_wd), accum_steps=int(s.train_accum),
                         bf16_autocast=bool(s.train_bf16), activation_checkpointing=bool(s.train_ckpt))


def session_trainer(settings: TrainSettings) -> Trainer | None:
    """This session's trainer: a new one after Reset or a change of model, init or seed; otherwise the same
    one, with the hyper-parameters of the widgets from its next step on."""
    trainer = st.session_state.train_trainer
    if trainer is None or trainer.identity != settings.identity:
        trainer = guarded(lambda: Trainer(settings, st.session_state.device))
        st.session_state.train_trainer = trainer
    elif settings != trainer.settings and guarded(lambda: trainer.update_settings(settings)) is None:
        return None
    return trainer


keep_across_pages(WIDGETS)

st.title(t("train.title"))
with settings("train"):
    c1, c2, c3 = st.columns([1.3, 1.6, 1], vertical_alignment="bottom")
    with c1:
        choice(st.segmented_control, t("train.model"), ["small", "micro"], key="train_model",
               format_func=labels("train.model_", ["small", "micro"]).get, on_change=reset)
    with c2:
        choice(st.segmented_control, t("train.init"), ["random", "bundled"], key="train_init",
               format_func=labels("train.init_", ["random", "bundled"]).get, on_change=reset)
    c3.number_input(t("train.seed"), 0, 2**31 - 1, key="train_seed", on_change=reset)
    st.caption(t("train.reset_note"))
    d1, d2, d3, d4 = st.columns(4)  # four to a row: a label as long as "Accumulation (k)" stays on one line
    d1.number_input(t("train.batch"), 1, BOUND.max_batch, key="train_batch", help=t("train.batch_help"))
    d2.number_input(t("train.seq_len"), 1, BOUND.max_seq_len, key="train_seq_len", help=t("train.seq_len_help"))
    d3.number_input(t("train.accum"), 1, BOUND.max_accum, key="train_accum", help=t("train.accum_help"))
    d4.select_slider(t("train.lr"), LR_CHOICES, key="train_lr", format_func=lambda v: number(v, "g"))
    d5, d6, d7, d8 = st.columns(4)
    d5.number_input(t("train.warmup"), 0, 1000, key="train_warmup")
    d6.number_input(t("train.schedule"), 1, 10_000, key="train_schedule", help=t("train.schedule_help"))
    d7.number_input(t("train.clip"), 0.05, 100.0, step=0.25, key="train_clip")
    d8.number_input(t("train.wd"), 0.0, 1.0, step=0.01, key="train_wd", format="%.3f")

trainer = session_trainer(settings_from_widgets())
if trainer is None:
    st.stop()
stopped = interrupted_run("train_running")
if stopped is not None:
    ran_on, done, asked = stopped
    # another trainer: Reset, or a new architecture, init or seed, during the run; its steps went with the old one
    st.info(t("train.run_stopped", done=done, asked=asked) if ran_on is trainer else t("train.run_reset", asked=asked))

left_steps = BOUND.max_steps - trainer.steps_done
asked_steps = int(st.session_state.train_n)
steps_to_run = min(asked_steps, left_steps)
figure = key_figure()  # drawn after the buttons' clicks are handled, so it shows the step they made
b1, b2, b3, b4, _ = st.columns([1.1, 1, 1.3, 1, 1.6], vertical_alignment="bottom")
one = b1.button(t("train.one_step"), key="train_one", type="primary", icon=":material/skip_next:",
                disabled=left_steps < 1, width="stretch", shortcut=NEXT_KEY)
b2.number_input(t("train.n_steps"), 1, 500, key="train_n")
run = b3.button(t("train.run_n", n=number(steps_to_run if left_steps else asked_steps)), key="train_run",
                icon=":material/fast_forward:", disabled=left_steps < 1, width="stretch")
b4.button(t("action.reset"), key="train_reset", icon=":material/restart_alt:", on_click=reset, width="stretch")
if left_steps < 1:
    st.info(t("error.train_step_limit", steps=number(BOUND.max_steps)))
elif steps_to_run < asked_steps:
    st.caption(t("train.run_capped", left=number(left_steps), most=number(BOUND.max_steps),
                 asked=number(asked_steps)))

if one:
    guarded(trainer.step)
if run:
    run_steps("train_running", trainer, lambda: trainer.steps_done, trainer.step, steps_to_run, t("train.cancel"),
              "train_cancel", lambda done: t("train.running", done=number(done), n=number(steps_to_run),
                                             loss=number(trainer.history[-1].loss, ".3f")),
              partial(cells.loss_figure, trainer), "train_live")
with figure:
    cells.loss_now(trainer)

last_ms = number(trainer.history[-1].ms, ".0f") if trainer.history else "–"
st.caption(t("train.status", done=number(trainer.steps_done), most=number(BOUND.max_steps), ms=last_ms,
             device=trainer.device, threads=torch.get_num_threads()))
with why("train"):
    st.caption(t("train.intro"))

cells.corpus_cell(trainer)
if trainer.last is None:
    st.stop()
row = cells.tokenizer_cell(trainer)
cells.labels_cell(trainer, row)
cells.forward_cell(trainer)
cells.loss_cell(trainer, row)
cells.backward_cell(trainer)
cells.clipping_cell(trainer)
cells.optimizer_cell(trainer)
cells.checkpoint_cell(trainer)
cells.load_weights_cell(trainer)
cells.mixed_precision_cell(trainer)
cells.activation_checkpointing_cell(trainer)
cells.pretraining_cell(trainer)
