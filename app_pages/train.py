"""Train: one training step at a time on this session's own copy of micro or small, every stage in map order
(1A corpus … 3E checkpoint), the checkpoint loaded back for inference, and the memory savers 4A and 4B."""

from functools import partial

import numpy as np
import streamlit as st
import torch

from model.engine import generate
from model.engine.llama import Llama
from model.engine.runtime import NativeModel
from model.engine.sampling import SamplingSettings
from model.engine.tokenizer import WordTokenizer
from model.training.train import (
    IGNORE,
    CheckpointStore,
    Trainer,
    TrainSettings,
    limits,
    lr_curve,
    measure_memory,
)
from ui import charts
from ui.i18n import labels, t
from ui.runs import interrupted_run, run_steps
from ui.session import guarded, shared_model
from ui.state import default_prompt, keep_across_pages
from ui.widgets import NEXT_KEY, choice, csv_of, md_escape, table_html, token_strip

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
SHOWN_ROWS = 16   # rows of the probability grid
PREVIEW_LINES = 6
GREEDY = SamplingSettings(temperature=0.0)
MAX_ANSWER = 20  # new tokens per side-by-side answer


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


def loss_figure(trainer: Trainer) -> dict:
    steps = [p.step for p in trainer.history]
    return charts.curve(steps, [p.loss for p in trainer.history], t("train.loss"), t("train.axis_step"),
                        t("train.loss"), level=(trainer.ln_vocab, t("train.ln_v", value=f"{trainer.ln_vocab:.3f}")))


def greedy_side_by_side(trainer: Trainer, name: str, folder: str, prompt: str) -> list[tuple[str, str]]:
    """(model name, greedy answer) for the bundled weights of the trained architecture, then for the checkpoint
    as saved on disk."""
    device = trainer.device
    saved = NativeModel(name, Llama.load(folder, device), WordTokenizer.load(folder), device)
    answers = []
    for model in (shared_model(trainer.settings.model, str(device)), saved):
        ids = generate.encode_prompt(model, prompt).ids
        gen = generate.start(model, ids, GREEDY, min(MAX_ANSWER, generate.context_room(model, len(ids))))
        generate.run_to_end(model, gen)
        answers.append((model.info.name, model.tokenizer.decode(gen.new_ids)))
    return answers


def group_name(kind: str, layer: int | None, tied: bool) -> str:
    """A parameter group's row label; the embedding's says it is the LM head too only when the two are tied."""
    return t("train.group_embed_tied" if kind == "embed" and tied else "train.group_" + kind, layer=layer)


def token_label(tok: WordTokenizer, token_id: int) -> str:
    return "—" if token_id == IGNORE else tok.token(int(token_id))


keep_across_pages(WIDGETS)

st.title(t("train.title"))
st.caption(t("train.intro"))

with st.container(border=True):
    c1, c2, c3, c4 = st.columns([1.1, 1.8, 0.8, 2.6])
    with c1:
        choice(st.segmented_control, t("train.model"), ["small", "micro"], key="train_model",
               format_func=labels("train.model_", ["small", "micro"]).get, on_change=reset)
    with c2:
        choice(st.segmented_control, t("train.init"), ["random", "bundled"], key="train_init",
               format_func=labels("train.init_", ["random", "bundled"]).get, on_change=reset)
    c3.number_input(t("train.seed"), 0, 2**31 - 1, key="train_seed", on_change=reset)
    c4.caption(t("train.reset_note"))
    d1, d2, d3, d4, d5, d6, d7, d8 = st.columns(8)
    d1.number_input(t("train.batch"), 1, BOUND.max_batch, key="train_batch", help=t("train.batch_help"))
    d2.number_input(t("train.seq_len"), 1, BOUND.max_seq_len, key="train_seq_len", help=t("train.seq_len_help"))
    d3.number_input(t("train.accum"), 1, BOUND.max_accum, key="train_accum", help=t("train.accum_help"))
    d4.select_slider(t("train.lr"), LR_CHOICES, key="train_lr", format_func=lambda v: f"{v:g}")
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
b1, b2, b3, b4, _ = st.columns([1.1, 1, 1.3, 1, 1.6], vertical_alignment="bottom")
one = b1.button(t("train.one_step"), key="train_one", type="primary", icon=":material/skip_next:",
                disabled=left_steps < 1, width="stretch", shortcut=NEXT_KEY)
b2.number_input(t("train.n_steps"), 1, 500, key="train_n")
run = b3.button(t("train.run_n", n=steps_to_run if left_steps else asked_steps), key="train_run",
                icon=":material/fast_forward:", disabled=left_steps < 1, width="stretch")
b4.button(t("train.reset"), key="train_reset", icon=":material/restart_alt:", on_click=reset, width="stretch")
if left_steps < 1:
    st.info(t("error.train_step_limit", steps=BOUND.max_steps))
elif steps_to_run < asked_steps:
    st.caption(t("train.run_capped", left=left_steps, most=BOUND.max_steps, asked=asked_steps))

if one:
    guarded(trainer.step)
if run:
    run_steps("train_running", trainer, lambda: trainer.steps_done, trainer.step, steps_to_run, t("train.cancel"),
              "train_cancel", lambda done: t("train.running", done=done, n=steps_to_run,
                                             loss=f"{trainer.history[-1].loss:.3f}"),
              partial(loss_figure, trainer), "train_live")

last_ms = f"{trainer.history[-1].ms:.0f}" if trainer.history else "–"
st.caption(t("train.status", done=trainer.steps_done, most=BOUND.max_steps, ms=last_ms, device=trainer.device,
             threads=torch.get_num_threads()))

corpus, tok, cfg = trainer.corpus, trainer.tokenizer, trainer.config
report = trainer.last

st.subheader(t("train.h_1a"), anchor="cell-1a")
m1, m2, m3, m4, m5 = st.columns(5)
m1.metric(t("train.sentences"), f"{len(corpus.sentences):,}")
m2.metric(t("train.vietnamese"), f"{corpus.n_vietnamese:,}")
m3.metric(t("train.english"), f"{corpus.n_english:,}")
m4.metric(t("train.corpus_tokens"), f"{corpus.n_tokens:,}")
m5.metric(t("train.vocab"), cfg.vocab_size)
st.caption(t("train.cleaning_" + trainer.settings.model))
if report is None:
    st.markdown("\n".join(f"- {md_escape(s)}" for s in corpus.sentences[:PREVIEW_LINES]))
    st.info(t("train.press_step"))
    st.stop()

batch = report.batch
rows = len(batch.sentence_ids)
st.markdown(t("train.batch_lines", n=rows))
st.markdown("\n".join(f"- {md_escape(corpus.sentences[i])}" for i in batch.sentence_ids[:PREVIEW_LINES]))

st.subheader(t("train.h_1b"), anchor="cell-1b")
st.session_state.train_row = min(int(st.session_state.train_row), rows - 1)
row = st.number_input(t("train.row"), 0, rows - 1, key="train_row", help=t("train.row_help"))
encoded = tok.encode(corpus.sentences[batch.sentence_ids[row]])
sentence_ids = encoded.ids + [tok.eos_id]
st.markdown(t("train.sentence", text=md_escape(corpus.sentences[batch.sentence_ids[row]])))
token_strip([tok.token(i) for i in sentence_ids], sentence_ids, [""] * len(sentence_ids))
st.caption(t("train.tokenizer_note"))

st.subheader(t("train.h_1c"), anchor="cell-1c")
seq = batch.inputs.shape[1]
st.html(table_html([t("train.position")] + [str(i) for i in range(seq)], [
    [t("train.input_ids")] + batch.inputs[row].tolist(),
    [t("train.input_tokens")] + [tok.token(int(i)) for i in batch.inputs[row]],
    [t("train.label_ids")] + batch.labels[row].tolist(),
    [t("train.label_tokens")] + [token_label(tok, i) for i in batch.labels[row]],
]))
n_real, n_ignored = int((batch.labels != IGNORE).sum()), int((batch.labels == IGNORE).sum())
st.markdown(t("train.shift_explain", ignore=IGNORE, pad=cfg.pad_token_id, rows=rows, seq=seq, real=n_real,
              ignored=n_ignored))

st.subheader(t("train.h_2"), anchor="cell-2")
B, T, V = report.logits_shape
st.markdown(t("train.forward_chain", b=B, t=T, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
              heads=cfg.num_attention_heads, kv=cfg.num_key_value_heads, v=V))
shown = min(rows, SHOWN_ROWS)
probs = np.nan_to_num(report.prob_right[:shown], nan=0.0)  # ignored labels: blank cells
st.plotly_chart(charts.attention_heatmap(probs, [t("train.row_n", r=r) for r in range(shown)],
                                         [f"#{i}" for i in range(T)], height=max(300, 60 + 26 * shown)),
                key="train_prob_grid")
st.caption(t("train.prob_grid_read", shown=shown, rows=rows, uniform=f"{1 / V:.4f}"))

st.subheader(t("train.h_3a"), anchor="cell-3a")
a1, a2, a3, a4 = st.columns(4)
a1.metric(t("train.loss"), f"{report.loss:.4f}")
a2.metric(t("train.ln_v_label"), f"{trainer.ln_vocab:.4f}", help=t("train.ln_v_help", v=V))
a3.metric(t("train.real_labels"), n_real)
a4.metric(t("train.ignored_labels"), n_ignored)
real_positions = [i for i in range(seq) if batch.labels[row, i] != IGNORE]
st.html(table_html([t("train.position"), t("train.input_tokens"), t("train.label_tokens"), t("train.p_label"),
                    t("train.position_loss")],
                   [[i, tok.token(int(batch.inputs[row, i])), tok.token(int(batch.labels[row, i])),
                     f"{report.prob_right[row, i]:.4f}", f"{report.token_loss[row, i]:.4f}"]
                    for i in real_positions]))
st.markdown(t("train.loss_explain_" + trainer.settings.init, real=n_real, loss=f"{report.loss:.4f}",
              ln_v=f"{trainer.ln_vocab:.4f}", v=V))

st.subheader(t("train.h_3b"), anchor="cell-3b")
group_names = [group_name(kind, layer, cfg.tie_word_embeddings) for kind, layer in report.groups]
table_height = 36 * (len(group_names) + 1) + 3  # every group visible without scrolling
st.dataframe({t("train.group"): group_names, t("train.grad_norm"): report.group_grad_norms}, hide_index=True,
             height=table_height,
             column_config={t("train.grad_norm"): st.column_config.ProgressColumn(
                 format="%.4f", min_value=0.0, max_value=max(report.group_grad_norms))})
st.markdown(t("train.backward_explain"))

st.subheader(t("train.h_3c"), anchor="cell-3c")
k1, k2, k3 = st.columns(3)
k1.metric(t("train.norm_before"), f"{report.grad_norm:.4f}")
k2.metric(t("train.threshold"), f"{report.clip:g}")
k3.metric(t("train.norm_after"), f"{report.grad_norm_clipped:.4f}")
clipped = report.grad_norm > report.clip
st.markdown(t("train.clipped" if clipped else "train.not_clipped", scale=f"{report.clip / report.grad_norm:.4f}"))
k = len(report.micro_losses)
if k > 1:
    st.html(table_html([t("train.micro_batch"), t("train.rows"), t("train.real_labels"), t("train.loss")],
                       [[i, report.micro_batch, n, f"{loss:.4f}"]
                        for i, (loss, n) in enumerate(zip(report.micro_losses, report.micro_tokens))]))
    st.markdown(t("train.accum_explain", k=k, b=report.micro_batch, rows=rows, real=n_real,
                  loss=f"{report.loss:.4f}"))
else:
    st.caption(t("train.accum_off"))

st.subheader(t("train.h_3d"), anchor="cell-3d")
s = trainer.settings
horizon = max(s.schedule_steps, report.step)
left, right = st.columns(2)
left.plotly_chart(charts.curve(list(range(1, horizon + 1)), lr_curve(s, horizon), t("train.lr"), t("train.axis_step"),
                               t("train.lr"), mark=(report.step, report.lr, t("train.this_step"))),
                  key="train_lr_curve")
right.dataframe({t("train.group"): group_names, t("train.update_ratio"): report.update_ratios}, hide_index=True,
                height=table_height,
                column_config={t("train.update_ratio"): st.column_config.ProgressColumn(
                    format="%.2e", min_value=0.0, max_value=max(report.update_ratios))})
st.markdown(t("train.adamw_explain", lr=f"{report.lr:.2e}", wd=f"{report.weight_decay:g}",
              decay=f"{report.lr * report.weight_decay:.2e}", step=report.step))

st.subheader(t("train.h_3e"), anchor="cell-3e")
st.plotly_chart(loss_figure(trainer), key="train_loss_curve")
st.download_button(t("train.download_curve"), key="train_download", icon=":material/download:", on_click="ignore",
                   file_name="decode-lab-train.csv", mime="text/csv",
                   data=partial(csv_of, trainer.history))
if st.button(t("train.save"), key="train_save", icon=":material/save:"):
    if st.session_state.train_store is None:
        st.session_state.train_store = CheckpointStore(BOUND.max_checkpoints)
    store = st.session_state.train_store
    saved = guarded(lambda: store.save(trainer, in_use=st.session_state.model_name))
    if saved is not None:
        st.session_state.train_files = saved
        st.session_state.session_checkpoints = {name: str(path) for name, path in store.saved.items()}
        st.session_state.checkpoint_bases = {name: store.bases[name] for name in store.saved}
        st.rerun()  # the sidebar, drawn before this page, lists the new checkpoint on the next run
if st.session_state.train_files is not None:
    name, files = st.session_state.train_files
    st.markdown(t("train.saved", name=md_escape(name)))
    st.html(table_html([t("train.file"), t("train.bytes")], [[f, f"{b:,}"] for f, b in files]))
st.markdown(t("train.resumable", moments=f"{trainer.optimizer.nbytes():,}", weights=f"{trainer.weight_bytes():,}",
              step=trainer.steps_done, seed=s.seed, most=BOUND.max_checkpoints))

st.subheader(t("train.h_load"), anchor="load-weights")
checkpoints = st.session_state.session_checkpoints
if not checkpoints:
    st.info(t("train.load_none"))
else:
    st.caption(t("train.load_hint"))
    if st.session_state.get("train_compare_ckpt") not in checkpoints:
        st.session_state.train_compare_ckpt = list(checkpoints)[-1]
    if st.session_state.train_prompt is None:
        st.session_state.train_prompt = default_prompt(s.model)
    l1, l2, l3 = st.columns([2, 2, 1], vertical_alignment="bottom")
    l1.selectbox(t("train.checkpoint"), list(checkpoints), key="train_compare_ckpt")
    l2.text_input(t("train.prompt"), key="train_prompt", max_chars=500)
    if l3.button(t("train.compare"), key="train_compare_run", icon=":material/compare_arrows:", width="stretch"):
        st.session_state.train_compare = guarded(lambda: greedy_side_by_side(
            trainer, st.session_state.train_compare_ckpt, checkpoints[st.session_state.train_compare_ckpt],
            st.session_state.train_prompt))
    if st.session_state.train_compare is not None:
        for col, (name, text) in zip(st.columns(2), st.session_state.train_compare):
            col.markdown(t("train.answer", name=md_escape(name), text=md_escape(text) or "∅"))

st.subheader(t("train.h_4a"), anchor="cell-4a")
st.toggle(t("train.bf16"), key="train_bf16", help=t("train.bf16_help"))
if st.button(t("train.measure"), key="train_measure", icon=":material/memory:"):
    with st.spinner(t("train.measuring")):
        st.session_state.train_memory = guarded(lambda: (measure_memory(trainer), trainer.settings))
memory = st.session_state.train_memory
if memory is not None:
    (fp32, bf16, ckpt), measured = memory
    mib = 2**20
    st.html(table_html(["", t("train.float32"), t("train.bfloat16")], [
        [t("train.loss"), f"{fp32.loss:.6f}", f"{bf16.loss:.6f}"],
        [t("train.loss_diff"), "0", f"{bf16.loss - fp32.loss:+.2e}"],
        [t("train.activation_mem"), f"{fp32.activation_bytes / mib:.2f} MiB", f"{bf16.activation_bytes / mib:.2f} MiB"],
        [t("train.peak_mem"), f"{fp32.peak_bytes / mib:.2f} MiB", f"{bf16.peak_bytes / mib:.2f} MiB"],
        [t("train.ms"), f"{fp32.ms:.1f}", f"{bf16.ms:.1f}"]]))
    st.markdown(t("train.bf16_read", saved=f"{(fp32.activation_bytes - bf16.activation_bytes) / mib:.2f}",
                  share=f"{1 - bf16.activation_bytes / fp32.activation_bytes:.0%}"))
    conditions = t("train.memory_conditions", device=trainer.device, threads=torch.get_num_threads(),
                   b=measured.batch_size, t=measured.seq_len, model=measured.model)
    st.caption(conditions)

st.subheader(t("train.h_4b"), anchor="cell-4b")
st.toggle(t("train.checkpointing"), key="train_ckpt", help=t("train.checkpointing_help"))
if memory is None:
    st.caption(t("train.measure_first"))
else:
    st.html(table_html(["", t("train.without"), t("train.with")], [
        [t("train.peak_mem"), f"{fp32.peak_bytes / mib:.2f} MiB", f"{ckpt.peak_bytes / mib:.2f} MiB"],
        [t("train.activation_mem"), f"{fp32.activation_bytes / mib:.2f} MiB", f"{ckpt.activation_bytes / mib:.2f} MiB"],
        [t("train.ms"), f"{fp32.ms:.1f}", f"{ckpt.ms:.1f}"],
        [t("train.loss"), f"{fp32.loss:.6f}", f"{ckpt.loss:.6f}"]]))
    st.markdown(t("train.checkpointing_read", layers=cfg.num_hidden_layers))
    st.caption(conditions)

st.subheader(t("train.h_4c"), anchor="cell-4c")
st.markdown(t("train.pretraining", n=f"{len(corpus.sentences):,}"))
st.page_link("app_pages/map.py", label=t("train.to_map"), icon=":material/map:")
