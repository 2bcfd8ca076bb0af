"""The Fine-tune page's views of a method's run: the same prompts answered before and now (the key figure), the
method's settings, its numbers per step (chart, table, CSV), what its last step did (SFT's masked row, LoRA's
parameter counts and merge, DPO's pairs, RLHF's sampled answers), its status and its save. The page script
(app_pages/finetune.py) holds the step buttons and the runs."""

import math
from functools import partial

import streamlit as st

from model.training.posttrain import DEFAULT_BATCH, MODELS, FinetuneSettings
from model.training.posttrain_data import SFT_DATA, preference_pairs
from model.training.rlhf import RM_BATCH, questions_per_step
from model.training.sft import FROZEN_IN_SFT
from model.training.train import IGNORE, limits
from ui import charts
from ui.classroom import localised
from ui.errors import guarded
from ui.i18n import number, t
from ui.runs import save_checkpoint
from ui.widgets import csv_of, md_escape, paragraph_html, table_html, token_strip

BOUND = limits()
SERIES = {"sft": ("loss",), "lora": ("loss",), "dpo": ("loss", "margin", "accuracy"),
          "rlhf": ("reward", "kl", "loss")}
SHOWN_PAIRS = 6
SHOWN_SAMPLES = 8
GROUP = FinetuneSettings().group_size  # RLHF's answers per question: no widget, the page keeps the default
# the settings a user can change that need a new trainer (IDENTITY_FIELDS), each with its label
NEW_RUN = {"model": "finetune.model", "seed": "finetune.seed", "rank": "finetune.rank", "alpha": "finetune.alpha",
           "targets": "finetune.targets"}
INTEGER_COLUMNS = {"step", "learned_tokens", "ignored_tokens", "padding"}


def history_chart(method: str, trainer):
    """Each series of the method by step; one alone (SFT's and LoRA's loss) names the y axis, as no legend shows."""
    steps = [r["step"] for r in trainer.history]
    series = {t("finetune.col_" + k): [r[k] for r in trainer.history] for k in SERIES[method]}
    y_title = next(iter(series)) if len(series) == 1 else t("finetune.axis_value")
    return localised(charts.lines(steps, series, t("finetune.axis_step"), y_title))


def reward_model_chart(trainer):
    steps = [r["step"] for r in trainer.rm_history]
    return localised(charts.lines(steps, {t("finetune.col_loss"): [r["loss"] for r in trainer.rm_history],
                                          t("finetune.col_held_out"): [r["held_out_accuracy"]
                                                                       for r in trainer.rm_history]},
                                  t("finetune.axis_step"), t("finetune.axis_value")))


def answer(text: str) -> str:
    """A model's answer as the table shows it: an empty one as a word, which the legend under the table explains."""
    return text or t("finetune.empty_answer")


def before_after(method: str, trainer, model: str) -> None:
    """The key figure: the prompts answered by the starting model and by the model at the step the answers were
    made at (on small after every step, a few ms; on the larger models when the button under the table asks);
    before the run is made, the prompts alone."""
    st.markdown(t("finetune.trains", model=trainer.settings.model if trainer is not None else model))
    if trainer is None:
        st.html(table_html([t("finetune.prompt"), t("finetune.before"), t("finetune.after_none")],
                           [[p, "…", "…"] for p in SFT_DATA[model][1]]))
        return
    made = getattr(trainer, "after", None)  # (the step the answers were made at, the answers)
    moved_on = trainer.steps_done and (made is None or made[0] != trainer.steps_done)
    if trainer.settings.model == "small" and moved_on:
        made = trainer.after = (trainer.steps_done, guarded(trainer.answers))
    step, now = made if made is not None else (None, None)
    rows = [[p, answer(b), answer(a) if now else "…"] for (p, b), (_, a) in zip(trainer.before, now or trainer.before)]
    heading = t("finetune.after", step=number(step)) if now else t("finetune.after_none")
    legend = any(not b for _, b in trainer.before) or any(not a for _, a in now or [])
    st.html(table_html([t("finetune.prompt"), t("finetune.before"), heading], rows)
            + (paragraph_html(t("finetune.empty_legend", empty=t("finetune.empty_answer")), "dl-caption")
               if legend else ""))
    if trainer.settings.model != "small" and st.button(t("finetune.refresh_after"), key=f"ft_{method}_after",
                                                       icon=":material/compare_arrows:"):
        trainer.after = (trainer.steps_done, guarded(trainer.answers))
        st.rerun()  # the table above shows them


def method_settings(method: str, settings: FinetuneSettings) -> None:
    """The method's folded settings: the model it trains (its own copy, not the sidebar's), seed and batch, and the
    method's own (LoRA's rank, alpha and target layers, DPO's β, RLHF's β and length bonus)."""
    c1, c2, c3 = st.columns([1.4, 1, 1])
    models = MODELS[method]
    c1.segmented_control(t("finetune.model"), list(models), key=f"ft_{method}_model", disabled=len(models) == 1,
                         required=True, on_change=batch_of_model, args=(method,), help=t("finetune.model_help"))
    c2.number_input(t("finetune.seed"), 0, 2**31 - 1, key=f"ft_{method}_seed")
    if method == "rlhf":  # its policy's batch counts sampled answers, G to a question
        c3.number_input(t("finetune.batch_rlhf"), GROUP, BOUND.max_batch // GROUP * GROUP, step=GROUP,
                        key="ft_rlhf_batch")
        questions = questions_per_step(settings)
        st.caption(t("finetune.batch_rlhf_read", questions=number(questions), g=number(GROUP),
                     answers=number(questions * GROUP), rm=number(RM_BATCH)))
    else:
        c3.number_input(t("finetune.batch"), 1, BOUND.max_batch, key=f"ft_{method}_batch")
    if method in ("sft", "lora") and st.session_state[f"ft_{method}_model"] in models:
        st.caption(t("finetune.data_" + st.session_state[f"ft_{method}_model"]))
    if method == "lora":
        l1, l2, l3 = st.columns([1, 1, 1.4])
        l1.number_input(t("finetune.rank"), 1, 64, key="ft_lora_rank")
        l2.number_input(t("finetune.alpha"), 0.5, 256.0, key="ft_lora_alpha")
        l3.segmented_control(t("finetune.targets"), ["qv", "all"], key="ft_lora_targets", required=True,
                             format_func=lambda v: t("finetune.targets_" + v))
    if method == "dpo":  # DPO needs β > 0: at 0 every margin and every gradient is 0
        st.slider(t("finetune.beta"), 0.01, 1.0, step=0.01, key="ft_dpo_beta")
    if method == "rlhf":  # β = 0: no KL leash at all (TRL's GRPO default)
        r1, r2 = st.columns(2)
        r1.slider(t("finetune.beta"), 0.0, 1.0, step=0.01, key="ft_rlhf_beta")
        r2.slider(t("finetune.length_bonus"), 0.0, 1.0, step=0.05, key="ft_rlhf_bonus",
                  help=t("finetune.length_bonus_help"))


def batch_of_model(method: str) -> None:
    """A newly chosen model starts from its own batch size (gemma3's step is far heavier than small's)."""
    model = st.session_state[f"ft_{method}_model"]
    if model in DEFAULT_BATCH:
        st.session_state[f"ft_{method}_batch"] = min(DEFAULT_BATCH[model], BOUND.max_batch)


def described(settings: FinetuneSettings, names: list[str]) -> str:
    """'Seed = 2, Model = small': the named settings with their values, as the widgets show them."""
    def value(name: str) -> str:
        v = getattr(settings, name)
        return (t("finetune.targets_" + v) if name == "targets" else number(v, "g") if name == "alpha"
                else number(v) if name == "seed" else str(v))
    return ", ".join(f"{t(NEW_RUN[name])} = {value(name)}" for name in names)


def new_run_waits(wanted: FinetuneSettings, trainer) -> None:
    """The widgets name another model, seed, rank, alpha or target layers than the run's: say that the run goes on
    until Reset, which starts the new one."""
    changed = [name for name in NEW_RUN if getattr(wanted, name) != getattr(trainer.settings, name)]
    if changed:
        st.warning(t("finetune.new_run_waits", was=described(trainer.settings, changed),
                     now=described(wanted, changed)), icon=":material/pending:")


def use_this_model(method: str, trainer) -> None:
    if not st.button(t("finetune.use"), key=f"ft_{method}_use", icon=":material/save:",
                     disabled=trainer.steps_done == 0):
        if st.session_state.ft_saved and st.session_state.ft_saved[0] == method:
            st.success(t("finetune.saved", name=md_escape(st.session_state.ft_saved[1])))
        return
    saved = save_checkpoint(trainer)
    if saved is not None:
        st.session_state.ft_saved = (method, saved[0])
        st.rerun()  # the sidebar, drawn before this page, lists it on the next run


def cell(key: str, value) -> str:
    return number(value) if key in INTEGER_COLUMNS else number(value, ".5g")


def numbers(method: str, trainer) -> None:
    """The run's numbers per step: the chart (before the first step its empty frame, which the steps fill), the
    table and its CSV."""
    st.plotly_chart(history_chart(method, trainer), key=f"ft_{method}_chart")
    if not trainer.history:
        return
    keys = [k for k in trainer.history[-1] if k not in ("lr",)]
    st.html('<div class="dl-scroll">' + table_html([t("finetune.col_" + k) for k in keys],
                                                   [[cell(k, r[k]) for k in keys] for r in trainer.history])
            + "</div>")
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
                       [[s["prompt"], answer(s["answer"]), number(s["reward"], ".3f"), number(s["advantage"], "+.3f")]
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
