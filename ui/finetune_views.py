"""The Fine-tune page's views of a method's run: its numbers per step (chart, table, CSV), what its last step
did (SFT's masked row, LoRA's parameter counts and merge, DPO's pairs, RLHF's sampled answers), its status and the
same prompts answered before and now. The page script (app_pages/finetune.py) holds the controls and the runs."""

import math
from functools import partial

import streamlit as st

from model.training.posttrain_data import preference_pairs
from model.training.sft import FROZEN_IN_SFT
from model.training.train import IGNORE, limits
from ui import charts
from ui.errors import guarded
from ui.i18n import number, t
from ui.widgets import csv_of, table_html, token_strip

BOUND = limits()
SERIES = {"sft": ("loss",), "lora": ("loss",), "dpo": ("loss", "margin", "accuracy"),
          "rlhf": ("reward", "kl", "loss")}
SHOWN_PAIRS = 6
SHOWN_SAMPLES = 8


def history_chart(method: str, trainer):
    steps = [r["step"] for r in trainer.history]
    return charts.lines(steps, {t("finetune.col_" + k): [r[k] for r in trainer.history] for k in SERIES[method]},
                        t("finetune.axis_step"), t("finetune.axis_value"))


def reward_model_chart(trainer):
    steps = [r["step"] for r in trainer.rm_history]
    return charts.lines(steps, {t("finetune.col_loss"): [r["loss"] for r in trainer.rm_history],
                                t("finetune.col_held_out"): [r["held_out_accuracy"] for r in trainer.rm_history]},
                        t("finetune.axis_step"), t("finetune.axis_value"))


def before_after(trainer) -> None:
    """The prompts answered by the starting model and by the model at the step the answers were made at: on small
    after every step (a few ms), on the larger models when the button asks."""
    made = getattr(trainer, "after", None)  # (the step the answers were made at, the answers)
    asked = st.button(t("finetune.refresh_after"), key=f"ft_{trainer.method}_after", icon=":material/compare_arrows:")
    moved_on = trainer.steps_done and (made is None or made[0] != trainer.steps_done)
    if asked or (trainer.settings.model == "small" and moved_on):
        made = trainer.after = (trainer.steps_done, guarded(trainer.answers))
    step, now = made if made is not None else (None, None)
    rows = [[p, b or "∅", (a or "∅") if now else "…"]
            for (p, b), (_, a) in zip(trainer.before, now or trainer.before)]
    heading = t("finetune.after", step=number(step)) if now else t("finetune.after_none")
    st.html(table_html([t("finetune.prompt"), t("finetune.before"), heading], rows))


def numbers(method: str, trainer) -> None:
    if not trainer.history:
        return
    st.plotly_chart(history_chart(method, trainer), key=f"ft_{method}_chart")
    keys = [k for k in trainer.history[-1] if k not in ("lr",)]
    st.dataframe({t("finetune.col_" + k): [r[k] for r in trainer.history] for k in keys}, hide_index=True,
                 height=220, key=f"ft_{method}_table")
    st.download_button(t("train.download_curve"), key=f"ft_{method}_download", icon=":material/download:",
                       on_click="ignore", file_name=f"decode-lab-{method}.csv", mime="text/csv",
                       data=partial(csv_of, trainer.history))


def sft_view(method: str, trainer) -> None:
    if trainer is None or trainer.last is None:
        return
    rows, tok = trainer.last, trainer.tokenizer
    ids, n_prompt = rows.ids[0], rows.n_prompt[0]
    kinds = ["new" if j >= n_prompt else "" for j in range(len(ids))]
    st.markdown(t("finetune.sft_row"))
    token_strip([tok.token(i) for i in ids], ids, kinds)
    r = trainer.history[-1]
    st.markdown(t("finetune.sft_counts", learned=number(r["learned_tokens"]), ignored=number(r["ignored_tokens"]),
                  padding=number(r["padding"]), ignore=IGNORE, loss=number(r["loss"], ".4f")))
    if method == "sft" and trainer.settings.model in FROZEN_IN_SFT:
        trained, total = trainer.trainable_count(), trainer.total_count()
        rows, cols = trainer.module.model.embed_tokens.weight.shape
        # a float32 gradient and AdamW's two float32 moments per frozen parameter
        st.markdown(t("finetune.sft_frozen", model=trainer.settings.model, rows=number(rows), cols=number(cols),
                      frozen=number(total - trained), saved=number(3 * 4 * (total - trained)),
                      trained=number(trained), total=number(total), share=number(trained / total, ".1%")))


def lora_view(trainer) -> None:
    if trainer is None:
        st.caption(t("finetune.lora_before_start"))
        return
    total, trainable = trainer.total_count(), trainer.trainable_count()
    m1, m2, m3, m4 = st.columns(4)
    m1.metric(t("finetune.trainable"), number(trainable))
    m2.metric(t("finetune.total"), number(total))
    m3.metric(t("finetune.share"), number(trainable / total, ".3%"))
    m4.metric(t("finetune.adapter_bytes"), f"{number(trainer.adapter_bytes())} B",
              help=t("finetune.full_bytes", full=number(4 * trainer.base_count())))
    r, layers = trainer.settings.rank, trainer.config.num_hidden_layers
    st.html(table_html([t("finetune.target"), "d_in", "d_out", t("finetune.formula"), t("finetune.params")],
                       [[k, number(i), number(o), f"{r} × ({number(i)} + {number(o)}) × {layers}", number(n)]
                        for k, i, o, n in trainer.formula]))
    if st.button(t("finetune.merge"), key="ft_lora_merge", icon=":material/merge:"):
        st.session_state.ft_lora_merge_diff = guarded(trainer.merge_difference)
    if st.session_state.get("ft_lora_merge_diff") is not None:
        st.markdown(t("finetune.merged", diff=number(st.session_state.ft_lora_merge_diff, ".2e")))


def dpo_view(trainer) -> None:
    seed = trainer.settings.seed if trainer is not None else int(st.session_state.ft_dpo_seed)  # the run's pairs
    st.html(table_html([t("finetune.prompt"), t("finetune.chosen"), t("finetune.rejected")],
                       [[p.prompt, p.chosen, p.rejected] for p in preference_pairs(seed)[:SHOWN_PAIRS]]))
    if trainer is not None and trainer.history:
        r = trainer.history[-1]
        st.markdown(t("finetune.dpo_read", loss=number(r["loss"], ".4f"), margin=number(r["margin"], ".4f"),
                      acc=number(r["accuracy"], ".0%"), ln2=number(math.log(2), ".4f")))


def rlhf_samples(trainer) -> None:
    if not trainer.last_samples:
        return
    st.html(table_html([t("finetune.prompt"), t("finetune.sample"), t("finetune.col_reward"),
                        t("finetune.advantage")],
                       [[s["prompt"], s["answer"] or "∅", number(s["reward"], ".3f"), number(s["advantage"], "+.3f")]
                        for s in trainer.last_samples[:SHOWN_SAMPLES]]))
    r = trainer.history[-1]
    st.markdown(t("finetune.rlhf_read", reward=number(r["reward"], ".3f"), kl=number(r["kl"], ".4f"),
                  length=number(r["length"], ".1f")))


def status(method: str, trainer) -> None:
    """The run's model, its steps against the limit (on RLHF the reward model's count too), lr and last step; the
    memory the run holds of its own."""
    said = dict(most=number(BOUND.max_steps), device=trainer.device, model=trainer.settings.model,
                lr=number(trainer.settings.learning_rate, "g"),
                ms=number(trainer.history[-1]["ms"], ".0f") if trainer.history else "–")
    if method == "rlhf":
        st.caption(t("finetune.status_rlhf", done=number(trainer.steps_done), rm=number(len(trainer.rm_history)),
                     used=number(trainer.steps_used), **said))
    else:
        st.caption(t("finetune.status", done=number(trainer.steps_done), **said))
    st.caption(t("finetune.held", mb=number(trainer.held_bytes() / 1e6, ".1f")))
