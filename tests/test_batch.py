"""Batched decode (model/serving/, the Serving page's engine over padded slots): every row of a batch equals its solo
run, with requests joining and leaving mid-run, on a random GQA Llama, small, SmolLM2, a random Gemma 3 whose window
is shorter than the rows, and Gemma 3 270M."""

import itertools
import time

import numpy as np
import pytest
import torch
from conftest import needs_kernels, packed
from test_gemma3 import needs_model as needs_gemma3
from test_smollm2 import needs_model

from model.engine import kernels
from model.engine.gemma3 import FULL, SLIDING, Gemma3, Gemma3Config
from model.engine.generate import run_to_end, start
from model.engine.loading import load_model
from model.engine.lowbit import with_weights
from model.engine.runtime import NativeModel
from model.engine.sampling import SamplingSettings
from model.engine.tokenizer import WordTokenizer, build_word_tokenizer
from model.errors import InputError
from model.serving import workload
from model.serving.engine import Engine
from model.serving.request import Request
from model.serving.workload import slot_engine

TOL = 1e-5  # the bound
# A Llama (small, SmolLM2, a random one) on a CPU where the decode kernels build: every row is its solo run bit for
# bit, on any such CPU, because every op a row's numbers go through is the project's own code or an elementwise torch
# op that rounds one number alone: the linears multiply in the kernels, which sum every output in one order whatever
# the rows beside it (llama.PackedWeight, kernels.cpp), the norms and each query's attention over exactly its keys
# are the kernels' (llama.RowKeys, kernels.attend_spans), and SiLU × up is the kernels' silu_mul, a number's bits
# wherever it lies.
EXACT = 0.0 if kernels.unavailable_reason() is None else TOL
# Gemma 3's GELU (tanh) is torch's F.gelu, whose vector loop finishes a row's last width mod its step (and, past
# 32,768 numbers on several threads, a thread's share of the rows) one number at a time, rounded unlike the vector
# lanes: which numbers go that way depends on the CPU's vector width, the thread count and the rows beside it, so a
# Gemma row is its solo run within this bound, not bit for bit (where the widths happen to fill the loops, as 128,
# 640 and 2,048 do on this AVX-512 Xeon on two threads, it is 0.0, which no test relies on). The bound: every GELU
# output one float32 ulp off (GELU computed in float64 and rounded, in place of torch's) moved Gemma 3 270M's logits
# by at most 1.7e-4 (prompts of 5 to 530 positions, 3 decode steps) and a random Gemma 3's (widths 64, 128) by 1.5e-5.
GELU_TOL = 1e-3


def row_tol(model) -> float:
    """How far a row's logits may be from its solo run's: EXACT (a Llama), GELU_TOL where torch's GELU takes part
    (Gemma 3)."""
    return GELU_TOL if isinstance(model.module, Gemma3) else EXACT


GEMMA3_WINDOW = 4


@pytest.fixture(scope="module")
def tiny_gemma3():
    """A random Gemma 3: 6 layers (two runs of 2 sliding then 1 full), window 4, 4 query heads over 2 KV heads,
    norm weights away from 0 so that (1 + w) matters; a word tokenizer over its 40 ids."""
    torch.manual_seed(0)
    cfg = Gemma3Config(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                       query_pre_attn_scalar=24, sliding_window=GEMMA3_WINDOW, layer_types=(SLIDING, SLIDING, FULL) * 2,
                       rope_theta=1e6, rope_local_theta=1e4)
    module = Gemma3(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for name, weight in module.named_parameters():
            if "norm" in name:
                weight.normal_(0.0, 0.5)
    packed(module)
    vocab = ["<pad>", "<bos>", "w", "<unk>"] + [f"w{i}" for i in range(36)]  # no <eos>: runs end at their limit
    return NativeModel("tiny-gemma3", module, WordTokenizer(build_word_tokenizer(vocab)), torch.device("cpu"))


@pytest.fixture(scope="module")
def gemma3():
    return load_model("gemma3", "cpu")


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2", "cpu")


def solo_run(model, prompt: list[int], n: int) -> tuple[list[np.ndarray], list[int]]:
    """The single-sequence path the other pages use: prefill, then n − 1 greedy decode steps; logits and tokens."""
    cache = model.new_cache()
    logits, _ = model.forward(prompt, cache, output_attentions=False)
    all_logits, tokens = [logits.float().numpy()], [int(logits.argmax())]
    for _ in range(n - 1):
        logits, _ = model.forward(tokens[-1:], cache, output_attentions=False)
        all_logits.append(logits.float().numpy())
        tokens.append(int(logits.argmax()))
    return all_logits, tokens


def prompts_of(model, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(4, model.info.vocab_size, size=n).tolist() for n in lengths]


def check_rows_equal_solo(model, lengths: list[int], new_tokens: int, slots: int, tol: float = TOL) -> set[int]:
    """The Serving page's engine (workload.slot_engine: padded slots, each prompt's pass alone, then the decode rows
    in one pass): requests take slots as they free, and one that leaves after `new_tokens` gives its slot to the next
    waiting one. Every logit each request draws from against its solo run; returns the decode passes' row counts."""
    requests = [Request(i, p, new_tokens, ignore_eos=True) for i, p in enumerate(prompts_of(model, lengths))]
    seen: dict[int, list[np.ndarray]] = {}
    choose = Request.choose

    def recorded(self, logits):
        seen.setdefault(self.id, []).append(logits.float().numpy().copy())
        return choose(self, logits)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Request, "choose", recorded)
        server = slot_engine(model, requests, slots)
        while not server.finished:
            server.step()
    for r in requests:
        solo_logits, solo_tokens = solo_run(model, r.prompt_ids, new_tokens)
        worst = max(float(np.abs(a - b).max()) for a, b in zip(solo_logits, seen[r.id]))
        assert worst <= tol, (r.id, worst)
        assert r.new_ids == solo_tokens
    return {len(p.spans) for s in server.steps for p in s.passes if p.kind == "decode"}


def test_random_gqa_rows_equal_their_solo_runs_with_joins_and_leaves(tiny_gqa):
    # 5 requests of different lengths through 3 slots: two join after the first ones leave
    sizes = check_rows_equal_solo(tiny_gqa, [3, 11, 7, 1, 20], new_tokens=6, slots=3, tol=EXACT)
    assert 3 in sizes


def test_small_rows_equal_their_solo_runs_with_joins_and_leaves(small):
    check_rows_equal_solo(small, [2, 9, 5, 14], new_tokens=5, slots=3, tol=EXACT)


@needs_kernels
@needs_model
def test_smollm2_rows_equal_their_solo_runs_with_joins_and_leaves(smollm2):
    check_rows_equal_solo(smollm2, [5, 40, 17], new_tokens=4, slots=2, tol=EXACT)


@needs_kernels
@needs_model
def test_smollm2_rows_are_their_solo_runs_in_a_batch_of_eight(smollm2):
    # 10 requests through 8 slots: batches of 8 rows of different lengths (MKL's plain product rounded a row 1e-4
    # away from its solo run here), and two requests joining as the first ones leave
    sizes = check_rows_equal_solo(smollm2, [5, 40, 17, 9, 33, 12, 3, 25, 60, 21], new_tokens=3, slots=8, tol=EXACT)
    assert 8 in sizes


def test_random_gemma3_rows_equal_their_solo_runs_past_the_window(tiny_gemma3):
    # every row passes the window of 4: its sliding layers attend over its own 4 latest positions only
    sizes = check_rows_equal_solo(tiny_gemma3, [3, 11, 7, 1, 20], new_tokens=6, slots=3)
    assert 3 in sizes


@needs_kernels
@needs_gemma3
def test_gemma3_rows_equal_their_solo_runs_with_joins_and_leaves(gemma3):
    # the second row is past the 512-position window from its prefill on
    check_rows_equal_solo(gemma3, [5, 530, 17], new_tokens=4, slots=2, tol=row_tol(gemma3))


def check_fewer_bits_rows_exact(model, dtype: str, longest: int) -> None:
    """Issue 38: the decode kernels sum each row alone in every dtype, and int8 rounds each row's inputs to int16 with
    the row's own scale, nothing measured across the batch (torch's dynamic int8 products scale the inputs per tensor,
    which couples the rows): 9 requests of different lengths through 8 slots are their solo runs, bit for bit (a
    Gemma 3 within its GELU's rounding: row_tol)."""
    sizes = check_rows_equal_solo(with_weights(model, dtype), [5, 40, 17, 9, 33, 12, 3, 25, longest], new_tokens=3,
                                  slots=8, tol=row_tol(model))
    assert 8 in sizes


@needs_kernels
@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat16-weights", "int8"])
def test_small_bfloat16_and_int8_rows_are_their_solo_runs(small, dtype):
    check_fewer_bits_rows_exact(small, dtype, 60)


@needs_kernels
@needs_model
@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat16-weights", "int8"])
def test_smollm2_bfloat16_and_int8_rows_are_their_solo_runs(smollm2, dtype):
    check_fewer_bits_rows_exact(smollm2, dtype, 60)


@needs_kernels
@needs_gemma3
@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat16-weights", "int8"])
def test_gemma3_bfloat16_and_int8_rows_are_their_solo_runs_past_the_window(gemma3, dtype):
    check_fewer_bits_rows_exact(gemma3, dtype, 530)


def test_server_greedy_tokens_equal_solo_and_slots_are_reused(tiny_gqa):
    lengths, budgets = [4, 12, 2, 9, 6], [3, 7, 2, 5, 4]
    prompts = prompts_of(tiny_gqa, lengths)
    requests = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, budgets))]
    server = slot_engine(tiny_gqa, requests, 2)
    while not server.finished:
        step = server.step()
        kinds = [p.kind for p in step.passes]
        assert step.tokens == len(step.spans) and kinds == sorted(kinds, reverse=True)  # prompts' passes, then decodes'
    for r in requests:
        assert r.new_ids == solo_run(tiny_gqa, r.prompt_ids, r.max_new_tokens)[1]
        assert r.stop_reason == "max_new_tokens"
        assert r.token_steps == list(range(r.joined_step, r.joined_step + len(r.new_ids)))
        assert r.left_step == r.token_steps[-1]
    # request 0 (3 tokens) leaves first, and the next waiting one takes its slot in the step after
    joined = {rid: s.index for s in server.steps for rid in s.admitted}
    left = {rid: s.index for s in server.steps for rid in s.left}
    slot = {rid: s.slots.index(rid) for s in server.steps for rid in s.admitted}
    assert joined[2] == left[0] + 1 and slot[2] == slot[0]
    assert all(len(r.itl_ms) == len(r.new_ids) - 1 for r in requests)


def test_a_request_longer_than_the_context_stops_when_no_position_is_left(tiny_gqa):
    """tiny_gqa holds 64 positions: a prompt of 60 leaves room for 64 − 60 + 1 = 5 new tokens (the last is never
    fed back), so it stops at 5 with "context_full" as a solo run does; the other row goes on to its 20."""
    requests = [Request(i, p, 20) for i, p in enumerate(prompts_of(tiny_gqa, [60, 10]))]
    server = slot_engine(tiny_gqa, requests, 2)
    while not server.finished:
        server.step()
    assert [(len(r.new_ids), r.stop_reason) for r in requests] == [(5, "context_full"), (20, "max_new_tokens")]
    assert requests[0].new_ids == solo_run(tiny_gqa, requests[0].prompt_ids, 5)[1]


@pytest.mark.parametrize("name", ["small", "tiny_gemma3"])
def test_sampled_rows_equal_their_solo_sampled_runs(name, request):
    """Each request samples with its own settings and seed, decoded in a batch of 3 slots with joins and leaves:
    its tokens are those of generate.py's solo run with the same settings (and greedy ones stay greedy)."""
    model = request.getfixturevalue(name)
    settings = [SamplingSettings(temperature=1.0, seed=7), SamplingSettings(temperature=0.8, top_k=5, seed=1),
                SamplingSettings(), SamplingSettings(temperature=1.3, top_p=0.9, seed=3),
                SamplingSettings(temperature=0.7, top_k=10, top_p=0.8, seed=11)]
    lengths, budgets = [4, 12, 2, 9, 6], [9, 7, 3, 12, 8]
    requests = [Request(i, p, n, settings=s) for i, (p, n, s) in
                enumerate(zip(prompts_of(model, lengths), budgets, settings))]
    server = slot_engine(model, requests, 3)
    while not server.finished:
        server.step()
    assert max(len(p.spans) for s in server.steps for p in s.passes if p.kind == "decode") == 3
    for r in requests:
        solo = start(model, r.prompt_ids, r.settings, r.max_new_tokens)
        run_to_end(model, solo)
        assert r.new_ids == solo.new_ids and r.stop_reason == solo.stop_reason, r.id
    # the sampled rows did not all follow the argmax: sampling really ran
    greedy = [solo_run(model, r.prompt_ids, len(r.new_ids))[1] for r in requests if not r.settings.greedy]
    assert greedy != [r.new_ids for r in requests if not r.settings.greedy]


class Stopped(Exception):
    """What a page's Stop raises inside a step's report (Streamlit's own is a BaseException)."""


def stopping_at(n: int):
    """A step's report that stops the step at its n-th call."""
    calls = []

    def report(progress):
        calls.append(progress)
        if len(calls) == n:
            raise Stopped

    return report


@pytest.mark.parametrize("name", ["tiny_gqa", "tiny_gemma3"])
def test_a_step_stopped_between_two_layers_goes_on_where_it_stopped(name, request):
    """Every step of a run is stopped once at each of its reports in turn (after each layer of each prefill and of
    the decode pass), and called again until it ends: the step's plan is kept and its passes run again whole,
    and the run's steps and tokens are those of a run never stopped."""
    model = request.getfixturevalue(name)
    lengths, budgets = [4, 12, 2, 9, 6], [3, 7, 2, 5, 4]

    def server() -> Engine:
        return slot_engine(model, [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts_of(model, lengths),
                                                                               budgets))], 2)

    never = server()
    while not never.finished:
        never.step()
    stopped, stops = server(), 0
    while not stopped.finished:
        for stop_at in itertools.count(1):
            try:
                stopped.step(stopping_at(stop_at))
                break
            except Stopped:
                stops += 1
    assert stops > 2 * len(never.steps)  # every step stopped at each of its layers' reports, several at least
    assert [(s.admitted, s.left, s.slots, [(p.kind, p.spans) for p in s.passes]) for s in stopped.steps] == \
        [(s.admitted, s.left, s.slots, [(p.kind, p.spans) for p in s.passes]) for s in never.steps]
    assert [r.new_ids for r in stopped.requests.values()] == [r.new_ids for r in never.requests.values()]


def test_a_steps_reports_say_where_it_is_and_their_time_is_not_counted(tiny_gqa):
    """A step of two prefills then (the next step) a decode pass of 2 rows over 3 layers: a report after each layer;
    a report that sleeps 30 ms is not in the step's times."""
    server = slot_engine(tiny_gqa, [Request(0, [5, 6, 7], 3), Request(1, [8, 9], 3)], 2)
    reports = []

    def slow_report(progress):
        reports.append((progress.prefilled, progress.prefills, progress.rows, progress.layer, progress.done))
        time.sleep(0.03)

    first = server.step(slow_report)
    third = 1 / 3
    assert reports == [(0, 2, 0, 1, third / 2), (0, 2, 0, 2, 2 * third / 2), (0, 2, 0, 3, 0.5),
                       (1, 2, 0, 1, 0.5 + third / 2), (1, 2, 0, 2, 0.5 + 2 * third / 2), (1, 2, 0, 3, 1.0)]
    assert [p.kind for p in first.passes] == ["prefill", "prefill"]
    assert first.forward_ms < 6 * 30 and sum(p.ms for p in first.passes) == pytest.approx(first.forward_ms)
    reports.clear()
    second = server.step(slow_report)
    assert [r[:4] for r in reports] == [(0, 0, 2, 1), (0, 0, 2, 2), (0, 0, 2, 3)] and reports[-1][4] == 1.0
    assert [p.kind for p in second.passes] == ["decode"] and second.forward_ms < 3 * 30


def test_bad_serving_input_is_one_sentence(tiny_gqa, monkeypatch):
    with pytest.raises(InputError) as zero:
        workload.start_serving(tiny_gqa, 0, 1, (2, 2), (4, 4))
    assert zero.value.code == "serving_slots"
    monkeypatch.setattr(workload, "session_budget_bytes", lambda: 1000)
    with pytest.raises(InputError) as past:
        workload.start_serving(tiny_gqa, 8, 1, (2, 2), (4, 4))
    assert past.value.code == "serving_queue_budget" and "MiB" in past.value.message("en")
    monkeypatch.undo()
    with pytest.raises(InputError) as cold:
        workload.start_serving(tiny_gqa, 2, 1, (2, 2), (4, 4), SamplingSettings(temperature=1.0, top_p=0))
    assert cold.value.code == "bad_top_p"
