"""Fine-tune: post-training one optimizer step per click (cells 4D SFT, 4E LoRA, 4F RLHF, 4G DPO), each method a
tab with its data, its loss, its numbers per step (chart and table) and the same prompts answered before and now."""

import time
from functools import partial

import streamlit as st
import torch

from model.training.dpo import DPO
from model.training.lora import LoRA
from model.training.posttrain import DEFAULT_BATCH, MODELS, FinetuneSettings
from model.training.posttrain_data import preference_pairs
from model.training.rlhf import RLHF
from model.training.sft import FROZEN_IN_SFT, SFT
from model.training.train import IGNORE, CheckpointStore, limits
from ui import charts
from ui.i18n import t
from ui.pages import FINETUNE_TABS
from ui.session import guarded
from ui.state import keep_across_pages
from ui.widgets import NEXT_KEY, csv_of, md_escape, table_html, token_strip

BOUND = limits()
CLASSES = {"sft": SFT, "lora": LoRA, "dpo": DPO, "rlhf": RLHF}
ORDER = tuple(FINETUNE_TABS)  # the map's order: 4D, 4E, 4F, 4G
SERIES = {"sft": ("loss",), "lora": ("loss",), "dpo": ("loss", "margin", "accuracy"),
          "rlhf": ("reward", "kl", "loss")}
LIVE_REDRAW_S = 0.5
SHOWN_PAIRS = 6
WIDGETS = {"ft_trainers": {}, "ft_running": None, "train_store": None, "session_checkpoints": {},
           "checkpoint_bases": {}, "ft_saved": None}
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


def trainer_of(method: str, create: bool):
    """This session's trainer of the method: made at its first step (or after Reset or a change of what the
    starting weights and data come from); hyper-parameters apply from the next step on."""
    trainers, settings = st.session_state.ft_trainers, settings_of(method)
    trainer = trainers.get(method)
    if trainer is not None and trainer.identity != settings.identity:
        trainer = None
    if trainer is None and create:
        with st.spinner(t("finetune.preparing")):
            trainer = guarded(lambda: CLASSES[method](settings, st.session_state.device))
    elif trainer is not None and settings != trainer.settings and guarded(
            lambda: trainer.update_settings(settings)) is None:
        return None
    trainers[method] = trainer
    return trainer


def reset(method: str) -> None:
    st.session_state.ft_trainers[method] = None


def run_steps(method: str, trainer, n: int, action) -> None:
    st.session_state.ft_running = (trainer, n)
    st.button(t("finetune.cancel"), key=f"ft_{method}_cancel", icon=":material/stop:")  # a click stops the loop
    bar = st.progress(0.0)
    live, drawn = st.empty(), 0.0
    for i in range(n):
        if guarded(action) is None:
            break
        bar.progress((i + 1) / n, text=t("finetune.running", done=i + 1, n=n))
        if time.perf_counter() - drawn > LIVE_REDRAW_S and trainer.history:
            live.plotly_chart(history_chart(method, trainer), key=f"ft_{method}_live_{i}")
            drawn = time.perf_counter()
    st.session_state.ft_running = None


def history_chart(method: str, trainer):
    steps = [r["step"] for r in trainer.history]
    return charts.lines(steps, {t("finetune.col_" + k): [r[k] for r in trainer.history] for k in SERIES[method]},
                        t("finetune.axis_step"), t("finetune.axis_value"))


def controls(method: str):
    """One step / N steps / Reset; returns the trainer (None before the first step)."""
    b1, b2, b3, b4 = st.columns([1.2, 1, 1.3, 1], vertical_alignment="bottom")
    one = b1.button(t("finetune.one_step"), key=f"ft_{method}_one", type="primary", icon=":material/skip_next:",
                    width="stretch", shortcut=NEXT_KEY)  # only the open tab is drawn: one button holds the key
    b2.number_input(t("finetune.n_steps"), 1, 500, key=f"ft_{method}_n")
    n = int(st.session_state[f"ft_{method}_n"])
    run = b3.button(t("finetune.run_n", n=n), key=f"ft_{method}_run", icon=":material/fast_forward:",
                    width="stretch")
    b4.button(t("finetune.reset"), key=f"ft_{method}_reset", icon=":material/restart_alt:", on_click=reset,
              args=(method,), width="stretch")
    trainer = trainer_of(method, create=one or run)
    if trainer is not None and (one or run):
        if method == "rlhf" and not trainer.rm_history:
            st.error(t("error.finetune_reward_first"))
        elif one:
            guarded(trainer.step)
        else:
            run_steps(method, trainer, min(n, BOUND.max_steps - trainer.steps_used), trainer.step)
        if trainer.settings.model == "small" and trainer.history:  # a few ms: the "now" answers follow each click
            trainer.after = guarded(trainer.answers)
    return trainer


def before_after(trainer) -> None:
    if st.button(t("finetune.refresh_after"), key=f"ft_{trainer.method}_after", icon=":material/compare_arrows:"):
        trainer.after = guarded(trainer.answers)
    now = getattr(trainer, "after", None)
    rows = [[p, b or "∅", (a or "∅") if now else "…"]
            for (p, b), (_, a) in zip(trainer.before, now or trainer.before)]
    st.html(table_html([t("finetune.prompt"), t("finetune.before"), t("finetune.after", step=trainer.steps_done)],
                       rows))


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


def use_this_model(method: str, trainer) -> None:
    if not st.button(t("finetune.use"), key=f"ft_{method}_use", icon=":material/save:",
                     disabled=trainer.steps_done == 0):
        if st.session_state.ft_saved and st.session_state.ft_saved[0] == method:
            st.success(t("finetune.saved", name=md_escape(st.session_state.ft_saved[1])))
        return
    if st.session_state.train_store is None:
        st.session_state.train_store = CheckpointStore(BOUND.max_checkpoints)
    store = st.session_state.train_store
    saved = guarded(lambda: store.save(trainer, in_use=st.session_state.model_name))
    if saved is not None:
        st.session_state.session_checkpoints = {name: str(path) for name, path in store.saved.items()}
        st.session_state.checkpoint_bases = {name: store.bases[name] for name in store.saved}
        st.session_state.ft_saved = (method, saved[0])
        st.rerun()  # the sidebar, drawn before this page, lists it on the next run


def batch_of_model(method: str) -> None:
    """A newly chosen model starts from its own batch size (gemma3's step is far heavier than small's)."""
    model = st.session_state[f"ft_{method}_model"]
    if model in DEFAULT_BATCH:
        st.session_state[f"ft_{method}_batch"] = min(DEFAULT_BATCH[model], BOUND.max_batch)


def model_and_seed(method: str) -> None:
    c1, c2, c3 = st.columns([1.4, 1, 1])
    models = MODELS[method]
    c1.segmented_control(t("finetune.model"), list(models), key=f"ft_{method}_model", disabled=len(models) == 1,
                         on_change=batch_of_model, args=(method,))
    c2.number_input(t("finetune.seed"), 0, 2**31 - 1, key=f"ft_{method}_seed")
    c3.number_input(t("finetune.batch"), 1, BOUND.max_batch, key=f"ft_{method}_batch")
    if method in ("sft", "lora") and st.session_state[f"ft_{method}_model"] in models:
        st.caption(t("finetune.data_" + st.session_state[f"ft_{method}_model"]))


def sft_view(method: str, trainer) -> None:
    if trainer is None or trainer.last is None:
        return
    rows, tok = trainer.last, trainer.tokenizer
    ids, n_prompt = rows.ids[0], rows.n_prompt[0]
    kinds = ["new" if j >= n_prompt else "" for j in range(len(ids))]
    st.markdown(t("finetune.sft_row"))
    token_strip([tok.token(i) for i in ids], ids, kinds)
    r = trainer.history[-1]
    st.markdown(t("finetune.sft_counts", learned=r["learned_tokens"], ignored=r["ignored_tokens"],
                  padding=r["padding"], ignore=IGNORE, loss=f"{r['loss']:.4f}"))
    if method == "sft" and trainer.settings.model in FROZEN_IN_SFT:
        trained, total = trainer.trainable_count(), trainer.total_count()
        rows, cols = trainer.module.model.embed_tokens.weight.shape
        # a float32 gradient and AdamW's two float32 moments per frozen parameter
        st.markdown(t("finetune.sft_frozen", model=trainer.settings.model, rows=f"{rows:,}", cols=f"{cols:,}",
                      frozen=f"{total - trained:,}", saved=f"{3 * 4 * (total - trained):,}", trained=f"{trained:,}",
                      total=f"{total:,}", share=f"{trained / total:.1%}"))


def lora_view(trainer) -> None:
    if trainer is None:
        st.caption(t("finetune.lora_before_start"))
        return
    total, trainable = trainer.total_count(), trainer.trainable_count()
    m1, m2, m3, m4 = st.columns(4)
    m1.metric(t("finetune.trainable"), f"{trainable:,}")
    m2.metric(t("finetune.total"), f"{total:,}")
    m3.metric(t("finetune.share"), f"{trainable / total:.3%}")
    m4.metric(t("finetune.adapter_bytes"), f"{trainer.adapter_bytes():,} B",
              help=t("finetune.full_bytes", full=f"{4 * trainer.base_count():,}"))
    r = trainer.settings.rank
    st.html(table_html([t("finetune.target"), "d_in", "d_out", t("finetune.formula"), t("finetune.params")],
                       [[k, i, o, f"{r} × ({i} + {o}) × {trainer.config.num_hidden_layers}", f"{n:,}"]
                        for k, i, o, n in trainer.formula]))
    if st.button(t("finetune.merge"), key="ft_lora_merge", icon=":material/merge:"):
        ids = torch.tensor([trainer.prompt_ids(trainer.prompts[0])], device=trainer.device)
        with torch.no_grad():
            diff = float((trainer.module(ids).logits - trainer.merged()(ids).logits).abs().max())
        st.session_state.ft_lora_merge_diff = diff
    if "ft_lora_merge_diff" in st.session_state:
        st.markdown(t("finetune.merged", diff=f"{st.session_state.ft_lora_merge_diff:.2e}"))


def dpo_view(trainer) -> None:
    data = preference_pairs(int(st.session_state.ft_dpo_seed))[:SHOWN_PAIRS]
    st.html(table_html([t("finetune.prompt"), t("finetune.chosen"), t("finetune.rejected")],
                       [[p.prompt, p.chosen, p.rejected] for p in data]))
    if trainer is not None and trainer.history:
        r = trainer.history[-1]
        st.markdown(t("finetune.dpo_read", loss=f"{r['loss']:.4f}", margin=f"{r['margin']:.4f}",
                      acc=f"{r['accuracy']:.0%}", ln2="0.6931"))


def rlhf_reward_model(trainer) -> None:
    st.markdown(t("finetune.rm_explain"))
    c1, c2, c3 = st.columns([1.2, 1, 1.3], vertical_alignment="bottom")
    one = c1.button(t("finetune.rm_one"), key="ft_rlhf_rm_one", icon=":material/skip_next:", width="stretch")
    c2.number_input(t("finetune.n_steps"), 1, 200, key="ft_rlhf_rm_n")
    run = c3.button(t("finetune.rm_run", n=int(st.session_state.ft_rlhf_rm_n)), key="ft_rlhf_rm_run",
                    icon=":material/fast_forward:", width="stretch")
    if one or run:
        trainer = trainer_of("rlhf", create=True)
        if trainer is not None:
            if one:
                guarded(trainer.reward_step)
            else:
                run_steps("rlhf", trainer, int(st.session_state.ft_rlhf_rm_n), trainer.reward_step)
    if trainer is not None and trainer.rm_history:
        r = trainer.rm_history[-1]
        steps = [x["step"] for x in trainer.rm_history]
        st.plotly_chart(charts.lines(steps, {t("finetune.col_loss"): [x["loss"] for x in trainer.rm_history],
                                             t("finetune.col_held_out"): [x["held_out_accuracy"]
                                                                          for x in trainer.rm_history]},
                                     t("finetune.axis_step"), t("finetune.axis_value")), key="ft_rlhf_rm_chart")
        st.markdown(t("finetune.rm_read", steps=r["step"], loss=f"{r['loss']:.4f}",
                      acc=f"{r['held_out_accuracy']:.0%}", n=len(trainer.held_out)))
    return trainer


def rlhf_samples(trainer) -> None:
    if trainer is None or not trainer.last_samples:
        return
    st.html(table_html([t("finetune.prompt"), t("finetune.sample"), t("finetune.col_reward"),
                        t("finetune.advantage")],
                       [[s["prompt"], s["answer"] or "∅", f"{s['reward']:.3f}",
                         f"{s['advantage']:+.3f}"] for s in trainer.last_samples[:8]]))
    r = trainer.history[-1]
    st.markdown(t("finetune.rlhf_read", reward=f"{r['reward']:.3f}", kl=f"{r['kl']:.4f}",
                  length=f"{r['length']:.1f}"))


keep_across_pages(WIDGETS | {"ft_tab": t("finetune.tab_" + ORDER[0])})  # the open tab, by its label
if st.query_params.get("tab") in ORDER:  # a link to one method's cell (the map's, opened in a new tab)
    st.session_state.ft_tab = t("finetune.tab_" + st.query_params.pop("tab"))
st.title(t("finetune.title"))
st.caption(t("finetune.intro"))
if st.session_state.ft_running is not None:  # a Run of N steps stopped by another click
    ran_on, asked = st.session_state.ft_running
    st.info(t("finetune.run_stopped", done=ran_on.steps_done, asked=asked))
    st.session_state.ft_running = None

# Only the open tab runs (Streamlit's lazy tabs): a step on one method does not redraw the three others
tabs = st.tabs([t("finetune.tab_" + m) for m in ORDER], key="ft_tab", on_change="rerun")
for method, tab in zip(ORDER, tabs):
    if not tab.open:
        continue
    with tab:
        st.subheader(t("finetune.h_" + method), anchor=FINETUNE_TABS[method])
        st.markdown(t("finetune.explain_" + method))
        model_and_seed(method)
        if method == "lora":
            l1, l2, l3 = st.columns(3)
            l1.number_input(t("finetune.rank"), 0, 64, key="ft_lora_rank")
            l2.number_input(t("finetune.alpha"), 0.5, 256.0, key="ft_lora_alpha")
            l3.segmented_control(t("finetune.targets"), ["qv", "all"], key="ft_lora_targets",
                                 format_func=lambda v: t("finetune.targets_" + v))
        if method == "dpo":
            st.slider(t("finetune.beta"), 0.0, 1.0, step=0.01, key="ft_dpo_beta")
        held = None
        if method == "rlhf":
            r1, r2 = st.columns(2)
            r1.slider(t("finetune.beta"), 0.0, 1.0, step=0.01, key="ft_rlhf_beta")
            r2.slider(t("finetune.length_bonus"), 0.0, 1.0, step=0.05, key="ft_rlhf_bonus",
                      help=t("finetune.length_bonus_help"))
            st.markdown(t("finetune.h_reward_model"))
            held = rlhf_reward_model(trainer_of("rlhf", create=False))
            st.markdown(t("finetune.h_policy"))
        trainer = controls(method)
        if trainer is None:
            trainer = held
        if method == "dpo":
            dpo_view(trainer)
        if trainer is None:
            st.info(t("finetune.press_step"))
            continue
        st.caption(t("finetune.status", done=trainer.steps_done, most=BOUND.max_steps, device=trainer.device,
                     model=trainer.settings.model, lr=f"{trainer.settings.learning_rate:g}",
                     ms=f"{trainer.history[-1]['ms']:.0f}" if trainer.history else "–"))
        if method in ("sft", "lora"):
            sft_view(method, trainer)
        if method == "lora":
            lora_view(trainer)
        if method == "rlhf":
            rlhf_samples(trainer)
            st.caption(t("finetune.rlhf_simplified"))
        numbers(method, trainer)
        before_after(trainer)
        use_this_model(method, trainer)
