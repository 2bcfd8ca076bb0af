"""The Train page's key figure (the loss now and its curve) and its cells (1A … 4C), each drawn by one function from
this session's trainer and its last step, in the order of the map. The page script (app_pages/train.py) holds the
controls and calls them."""

from functools import partial

import numpy as np
import streamlit as st
import torch

from model.engine import generate
from model.engine.llama import Llama
from model.engine.runtime import NativeModel
from model.engine.sampling import SamplingSettings
from model.engine.tokenizer import WordTokenizer
from model.training.train import IGNORE, StepReport, Trainer, limits, lr_curve, measure_memory
from ui import charts
from ui.classroom import localised
from ui.errors import guarded
from ui.i18n import decimal, number, t
from ui.models import shared_model
from ui.runs import save_checkpoint
from ui.state import default_prompt
from ui.widgets import csv_of, md_escape, table_html, token_strip

BOUND = limits()
SHOWN_ROWS = 16   # rows of the probability grid
PREVIEW_LINES = 6
GREEDY = SamplingSettings(temperature=0.0)
MAX_ANSWER = 20  # new tokens per side-by-side answer
MIB = 2**20


def loss_figure(trainer: Trainer) -> dict:
    """The loss of every step against ln V, drawn across a frame of at least ten steps (the first steps fill a frame
    that stays put; before the first step, ln V alone)."""
    steps, losses = [p.step for p in trainer.history], [p.loss for p in trainer.history]
    frame = [0, max(10, steps[-1] if steps else 0)]
    ln_v = (trainer.ln_vocab, t("train.ln_v", value=decimal(trainer.ln_vocab, 3)))
    figure = charts.curve(steps or frame, losses or [None, None], t("train.loss"), t("train.axis_step"),
                          t("train.loss"), level=ln_v, height=280)
    figure["data"][1]["x"] = frame  # the ln V line
    if frame[-1] <= 10:
        figure["layout"]["xaxis"]["dtick"] = 1  # whole steps, not 0.5 between two
    return localised(figure)


def loss_now(trainer: Trainer) -> None:
    """The key figure: the last step's loss beside ln V and the steps made, then the curve of every step; before
    the first step, the one thing to do."""
    report = trainer.last
    numbers, curve = st.columns([1, 3])
    numbers.metric(t("train.loss"), number(report.loss, ".4f") if report is not None else "–")
    numbers.metric(t("train.ln_v_label"), number(trainer.ln_vocab, ".4f"),
                   help=t("train.ln_v_help", v=number(trainer.config.vocab_size)))
    numbers.metric(t("train.steps"), number(trainer.steps_done))
    curve.plotly_chart(loss_figure(trainer), key="train_loss_curve")
    if not trainer.history:
        st.info(t("train.press_step"))


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


def group_names(trainer: Trainer, report: StepReport) -> list[str]:
    """Each parameter group's row label; the embedding's says it is the LM head too only when the two are tied."""
    tied = trainer.config.tie_word_embeddings
    return [t("train.group_embed_tied" if kind == "embed" and tied else "train.group_" + kind, layer=layer)
            for kind, layer in report.groups]


def token_label(tok: WordTokenizer, token_id: int) -> str:
    return "—" if token_id == IGNORE else tok.token(int(token_id))


def real_and_ignored(report: StepReport) -> tuple[int, int]:
    labels = report.batch.labels
    return int((labels != IGNORE).sum()), int((labels == IGNORE).sum())


def corpus_cell(trainer: Trainer) -> None:
    """1A: the corpus, and the sentences of the last step's batch (or the first few before any step)."""
    corpus, report = trainer.corpus, trainer.last
    st.subheader(t("train.h_1a"), anchor="cell-1a")
    m1, m2, m3, m4, m5 = st.columns(5)
    m1.metric(t("train.sentences"), number(len(corpus.sentences)))
    m2.metric(t("train.vietnamese"), number(corpus.n_vietnamese))
    m3.metric(t("train.english"), number(corpus.n_english))
    m4.metric(t("train.corpus_tokens"), number(corpus.n_tokens), help=t("train.corpus_tokens_help"))
    m5.metric(t("train.vocab"), number(trainer.config.vocab_size))
    st.caption(t("train.cleaning_" + trainer.settings.model))
    if report is None:
        st.markdown("\n".join(f"- {md_escape(s)}" for s in corpus.sentences[:PREVIEW_LINES]))
        return
    st.markdown(t("train.batch_lines", n=len(report.batch.sentence_ids)))
    st.markdown("\n".join(f"- {md_escape(corpus.sentences[i])}" for i in report.batch.sentence_ids[:PREVIEW_LINES]))


def tokenizer_cell(trainer: Trainer) -> int:
    """1B: one row of the batch through the tokenizer; returns the row chosen."""
    corpus, tok, batch = trainer.corpus, trainer.tokenizer, trainer.last.batch
    rows = len(batch.sentence_ids)
    st.subheader(t("train.h_1b"), anchor="cell-1b")
    st.session_state.train_row = min(int(st.session_state.train_row), rows - 1)
    row = st.number_input(t("train.row"), 0, rows - 1, key="train_row", help=t("train.row_help"))
    sentence = corpus.sentences[batch.sentence_ids[row]]
    sentence_ids = tok.encode(sentence).ids + [tok.eos_id]
    st.markdown(t("train.sentence", text=md_escape(sentence)))
    token_strip([tok.token(i) for i in sentence_ids], sentence_ids, [""] * len(sentence_ids))
    st.caption(t("train.tokenizer_note"))
    return row


def labels_cell(trainer: Trainer, row: int) -> None:
    """1C: the row's inputs and its labels shifted by one, padding ignored."""
    tok, batch, cfg = trainer.tokenizer, trainer.last.batch, trainer.config
    st.subheader(t("train.h_1c"), anchor="cell-1c")
    seq = batch.inputs.shape[1]
    # a position a row: up to 32 positions side by side ran past a 1280 screen
    inputs, labels = batch.inputs[row].tolist(), batch.labels[row].tolist()
    st.html(table_html([t("train.position"), t("train.input_ids"), t("train.input_tokens"), t("train.label_ids"),
                        t("train.label_tokens")],
                       [[i, x, tok.token(x), y, token_label(tok, y)] for i, (x, y) in enumerate(zip(inputs, labels))]))
    real, ignored = real_and_ignored(trainer.last)
    st.markdown(t("train.shift_explain", ignore=IGNORE, pad=cfg.pad_token_id, rows=len(batch.sentence_ids), seq=seq,
                  real=real, ignored=ignored))


def forward_cell(trainer: Trainer) -> None:
    """2: the forward pass, and the probability each position gave its label."""
    report, cfg = trainer.last, trainer.config
    rows = len(report.batch.sentence_ids)
    st.subheader(t("train.h_2"), anchor="cell-2")
    B, T, V = report.logits_shape
    st.markdown(t("train.forward_chain", b=B, t=T, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                  heads=cfg.num_attention_heads, kv=cfg.num_key_value_heads, v=V))
    shown = min(rows, SHOWN_ROWS)
    probs = np.nan_to_num(report.prob_right[:shown], nan=0.0)  # ignored labels: blank cells
    st.plotly_chart(charts.attention_heatmap(probs, [t("train.row_n", r=r) for r in range(shown)],
                                             [f"#{i}" for i in range(T)], height=max(300, 60 + 26 * shown)),
                    key="train_prob_grid")
    st.caption(t("train.prob_grid_read", shown=shown, rows=rows, uniform=number(1 / V, ".4f")))


def loss_cell(trainer: Trainer, row: int) -> None:
    """3A: the cross-entropy loss against ln V, and the row's loss at each position."""
    report, tok, batch = trainer.last, trainer.tokenizer, trainer.last.batch
    V = report.logits_shape[2]
    real, ignored = real_and_ignored(report)
    st.subheader(t("train.h_3a"), anchor="cell-3a")
    a1, a2, a3, a4 = st.columns(4)
    a1.metric(t("train.loss"), number(report.loss, ".4f"))
    a2.metric(t("train.ln_v_label"), number(trainer.ln_vocab, ".4f"), help=t("train.ln_v_help", v=number(V)))
    a3.metric(t("train.real_labels"), number(real))
    a4.metric(t("train.ignored_labels"), number(ignored))
    real_positions = [i for i in range(batch.inputs.shape[1]) if batch.labels[row, i] != IGNORE]
    st.html(table_html([t("train.position"), t("train.input_tokens"), t("train.label_tokens"), t("train.p_label"),
                        t("train.position_loss")],
                       [[i, tok.token(int(batch.inputs[row, i])), tok.token(int(batch.labels[row, i])),
                         number(report.prob_right[row, i], ".4f"), number(report.token_loss[row, i], ".4f")]
                        for i in real_positions]))
    st.markdown(t("train.loss_explain_" + trainer.settings.init, real=number(real), loss=number(report.loss, ".4f"),
                  ln_v=number(trainer.ln_vocab, ".4f"), v=number(V)))


def group_table_height(report: StepReport) -> int:
    return 36 * (len(report.groups) + 1) + 3  # every group visible without scrolling


def backward_cell(trainer: Trainer) -> None:
    """3B: the gradient's norm per parameter group."""
    report = trainer.last
    st.subheader(t("train.h_3b"), anchor="cell-3b")
    st.dataframe({t("train.group"): group_names(trainer, report), t("train.grad_norm"): report.group_grad_norms},
                 hide_index=True, height=group_table_height(report),
                 column_config={t("train.grad_norm"): st.column_config.ProgressColumn(
                     format="%.4f", min_value=0.0, max_value=max(report.group_grad_norms))})
    st.markdown(t("train.backward_explain"))


def clipping_cell(trainer: Trainer) -> None:
    """3C: clipping the gradient's norm, and gradient accumulation over micro-batches."""
    report = trainer.last
    real, _ = real_and_ignored(report)
    st.subheader(t("train.h_3c"), anchor="cell-3c")
    k1, k2, k3 = st.columns(3)
    k1.metric(t("train.norm_before"), number(report.grad_norm, ".4f"))
    k2.metric(t("train.threshold"), number(report.clip, "g"))
    k3.metric(t("train.norm_after"), number(report.grad_norm_clipped, ".4f"))
    clipped = report.grad_norm > report.clip
    st.markdown(t("train.clipped" if clipped else "train.not_clipped",
                  scale=number(report.clip / report.grad_norm, ".4f")))
    k = len(report.micro_losses)
    if k > 1:
        st.html(table_html([t("train.micro_batch"), t("train.rows"), t("train.real_labels"), t("train.loss")],
                           [[i, report.micro_batch, n, number(loss, ".4f")]
                            for i, (loss, n) in enumerate(zip(report.micro_losses, report.micro_tokens))]))
        st.markdown(t("train.accum_explain", k=k, b=report.micro_batch, rows=len(report.batch.sentence_ids),
                      real=number(real), loss=number(report.loss, ".4f")))
    else:
        st.caption(t("train.accum_off"))


def optimizer_cell(trainer: Trainer) -> None:
    """3D: the learning-rate schedule and AdamW's update per parameter group."""
    report, s = trainer.last, trainer.settings
    st.subheader(t("train.h_3d"), anchor="cell-3d")
    horizon = max(s.schedule_steps, report.step)
    left, right = st.columns(2)
    left.plotly_chart(localised(charts.curve(list(range(1, horizon + 1)), lr_curve(s, horizon), t("train.lr"),
                                             t("train.axis_step"), t("train.lr"),
                                             mark=(report.step, report.lr, t("train.this_step")))),
                      key="train_lr_curve")
    right.dataframe({t("train.group"): group_names(trainer, report), t("train.update_ratio"): report.update_ratios},
                    hide_index=True, height=group_table_height(report),
                    column_config={t("train.update_ratio"): st.column_config.ProgressColumn(
                        format="%.2e", min_value=0.0, max_value=max(report.update_ratios))})
    st.markdown(t("train.adamw_explain", lr=number(report.lr, ".2e"), wd=number(report.weight_decay, "g"),
                  decay=number(report.lr * report.weight_decay, ".2e"), step=number(report.step)))


def checkpoint_cell(trainer: Trainer) -> None:
    """3E: the loss curve's CSV (the curve itself is the key figure, at the top of the page), and a checkpoint saved
    into this session's store."""
    st.subheader(t("train.h_3e"), anchor="cell-3e")
    st.caption(t("train.curve_above"))
    st.download_button(t("train.download_curve"), key="train_download", icon=":material/download:",
                       on_click="ignore", file_name="decode-lab-train.csv", mime="text/csv",
                       data=partial(csv_of, trainer.history))
    if st.button(t("train.save"), key="train_save", icon=":material/save:"):
        saved = save_checkpoint(trainer)
        if saved is not None:
            st.session_state.train_files = saved
            st.rerun()  # the sidebar, drawn before this page, lists the new checkpoint on the next run
    if st.session_state.train_files is not None:
        name, files = st.session_state.train_files
        st.markdown(t("train.saved", name=md_escape(name)))
        st.html(table_html([t("train.file"), t("train.bytes")], [[f, number(b)] for f, b in files]))
    st.markdown(t("train.resumable", moments=number(trainer.optimizer.nbytes()), weights=number(trainer.weight_bytes()),
                  step=number(trainer.steps_done), seed=trainer.settings.seed, most=BOUND.max_checkpoints))


def load_weights_cell(trainer: Trainer) -> None:
    """The arrow 3E → 5A: a saved checkpoint loaded back for inference, its greedy answer beside the bundled one's."""
    st.subheader(t("train.h_load"), anchor="load-weights")
    checkpoints = st.session_state.session_checkpoints
    if not checkpoints:
        st.info(t("train.load_none"))
        return
    st.caption(t("train.load_hint"))
    if st.session_state.get("train_compare_ckpt") not in checkpoints:
        st.session_state.train_compare_ckpt = list(checkpoints)[-1]
    if st.session_state.train_prompt is None:
        st.session_state.train_prompt = default_prompt(trainer.settings.model)
    l1, l2, l3 = st.columns([2, 2, 1], vertical_alignment="bottom")
    l1.selectbox(t("train.checkpoint"), list(checkpoints), key="train_compare_ckpt")
    l2.text_input(t("train.prompt"), key="train_prompt", max_chars=500)
    if l3.button(t("action.compare"), key="train_compare_run", icon=":material/compare_arrows:", width="stretch"):
        st.session_state.train_compare = guarded(lambda: greedy_side_by_side(
            trainer, st.session_state.train_compare_ckpt, checkpoints[st.session_state.train_compare_ckpt],
            st.session_state.train_prompt))
    if st.session_state.train_compare is not None:
        for col, (name, text) in zip(st.columns(2), st.session_state.train_compare):
            col.markdown(t("train.answer", name=md_escape(name), text=md_escape(text) or "∅"))


def mib(n: int) -> str:
    return decimal(n / MIB, 2) + " MiB"


def memory_conditions(trainer: Trainer, measured) -> str:
    return t("train.memory_conditions", device=trainer.device, threads=torch.get_num_threads(),
             b=measured.batch_size, t=measured.seq_len, model=measured.model)


def mixed_precision_cell(trainer: Trainer) -> None:
    """4A: one step's loss, activation memory and peak in float32 and under bfloat16 autocast, measured."""
    st.subheader(t("train.h_4a"), anchor="cell-4a")
    st.toggle(t("train.bf16"), key="train_bf16", help=t("train.bf16_help"))
    if st.button(t("train.measure"), key="train_measure", icon=":material/memory:"):
        with st.spinner(t("train.measuring")):
            st.session_state.train_memory = guarded(lambda: (measure_memory(trainer), trainer.settings))
    if st.session_state.train_memory is None:
        return
    (fp32, bf16, _), measured = st.session_state.train_memory
    st.html(table_html(["", t("train.float32"), t("train.bfloat16")], [
        [t("train.loss"), number(fp32.loss, ".6f"), number(bf16.loss, ".6f")],
        [t("train.loss_diff"), "0", number(bf16.loss - fp32.loss, "+.2e")],
        [t("train.activation_mem"), mib(fp32.activation_bytes), mib(bf16.activation_bytes)],
        [t("train.peak_mem"), mib(fp32.peak_bytes), mib(bf16.peak_bytes)],
        [t("train.ms"), decimal(fp32.ms), decimal(bf16.ms)]]))
    st.markdown(t("train.bf16_read", saved=decimal((fp32.activation_bytes - bf16.activation_bytes) / MIB, 2),
                  share=number(1 - bf16.activation_bytes / fp32.activation_bytes, ".0%")))
    st.caption(memory_conditions(trainer, measured))


def activation_checkpointing_cell(trainer: Trainer) -> None:
    """4B: the same step with activation checkpointing, from 4A's measurement."""
    st.subheader(t("train.h_4b"), anchor="cell-4b")
    st.toggle(t("train.checkpointing"), key="train_ckpt", help=t("train.checkpointing_help"))
    if st.session_state.train_memory is None:
        st.caption(t("train.measure_first"))
        return
    (fp32, _, ckpt), measured = st.session_state.train_memory
    st.html(table_html(["", t("train.without"), t("train.with")], [
        [t("train.peak_mem"), mib(fp32.peak_bytes), mib(ckpt.peak_bytes)],
        [t("train.activation_mem"), mib(fp32.activation_bytes), mib(ckpt.activation_bytes)],
        [t("train.ms"), decimal(fp32.ms), decimal(ckpt.ms)],
        [t("train.loss"), number(fp32.loss, ".6f"), number(ckpt.loss, ".6f")]]))
    st.markdown(t("train.checkpointing_read", layers=trainer.config.num_hidden_layers))
    st.caption(memory_conditions(trainer, measured))


def pretraining_cell(trainer: Trainer) -> None:
    """4C: what pretraining is, from this corpus's size."""
    st.subheader(t("train.h_4c"), anchor="cell-4c")
    st.markdown(t("train.pretraining", n=number(len(trainer.corpus.sentences))))
    st.page_link("app_pages/map.py", label=t("train.to_map"), icon=":material/map:")
