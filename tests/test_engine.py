"""The native engine: cached logits equal a full recompute, the course's numbers, sampling, stops, crop."""

import json
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import needs_kernels

from model.engine.counting import (
    cache_bytes_formula,
    cumulative_positions,
    positions_with_cache,
    positions_without_cache,
)
from model.engine.gemma3 import GemmaRMSNorm
from model.engine.generate import back, encode_prompt, resample, run_to_end, session_budget_bytes, start, step
from model.engine.llama import Llama, LlamaConfig, RMSNorm, attend
from model.engine.loading import load_model
from model.engine.runtime import NativeModel
from model.engine.sampling import SamplingSettings
from model.engine.steps import max_abs_logit_diff, recompute
from model.engine.tokenizer import WordTokenizer, build_word_tokenizer
from model.errors import InputError
from model.tools import cli

TOL = 1e-5
GREEDY = SamplingSettings()


@pytest.fixture(scope="module")
def tiny_random():
    """A random GQA config unlike either bundled model: 3 layers, 6 query heads over 2 KV heads."""
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=12, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=4, max_position_embeddings=32)
    vocab = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(8)]
    tok = WordTokenizer(build_word_tokenizer(vocab))
    return NativeModel("tiny", Llama(cfg).eval().requires_grad_(False), tok, torch.device("cpu"))


def assert_every_step_matches_recompute(model, prompt_ids, settings, n_steps):
    gen = start(model, prompt_ids, settings, max_new_tokens=n_steps)
    for _ in range(n_steps):
        trace = gen.steps[-1]
        assert max_abs_logit_diff(trace, recompute(model, gen.ids[: trace.cache_len])) <= TOL
        if step(model, gen) is None:
            break
    return gen


@pytest.mark.parametrize("name", ["micro", "small", "tiny_random"])
def test_cached_logits_equal_recompute_at_every_step(name, request):
    model = request.getfixturevalue(name)
    prompt = [1, 3] if name == "micro" else [1, 5, 6, 7]
    sampled = SamplingSettings(temperature=1.0, seed=3)
    gen = assert_every_step_matches_recompute(model, prompt, sampled, n_steps=8)
    assert len(gen.steps) >= 2


@needs_kernels
@pytest.mark.parametrize("norm_class", [RMSNorm, GemmaRMSNorm])
def test_fused_norm_and_attention_agree_with_torchs_ops_and_give_a_row_its_solo_bits(norm_class):
    """The shared model's norm (w, or Gemma's 1 + w) and one-query attention in the decode kernels: within float32
    rounding of torch's ops, and each row of a batch (every row over the same keys, so one call) the same bits as
    that row alone."""
    torch.manual_seed(0)
    norm = norm_class(577, 1e-6)  # not a multiple of the kernel's 16 lanes
    norm.weight.data.normal_(0.0, 0.5)
    x = torch.randn(2, 5, 577) * 3
    norm.fused = True
    fused = norm(x)
    assert torch.allclose(fused, norm.eager(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(fused[1, 3], norm(x[1, 3:4])[0])

    q = torch.randn(4, 9, 1, 80)
    k, v = torch.randn(2, 4, 3, 70, 80).unbind()  # 3 KV heads for 9 query heads
    out, weights = attend(q, k, v, None, 8.0, fused=True)
    eager_out, eager_weights = attend(q, k, v, None, 8.0)
    assert torch.allclose(out, eager_out, rtol=1e-5, atol=1e-6)
    assert torch.allclose(weights, eager_weights, rtol=1e-5, atol=1e-7)
    solo = attend(q[2:3], k[2:3], v[2:3], None, 8.0, fused=True)
    assert torch.equal(out[2:3], solo[0]) and torch.equal(weights[2:3], solo[1])


def test_micro_is_the_course_example(micro):
    info = micro.info
    assert (info.vocab_size, info.n_layers, info.n_kv_heads, info.d_head, info.dtype) == (8, 2, 1, 4, "float32")
    tok = micro.tokenizer
    assert (tok.vocab["<pad>"], tok.vocab["<bos>"], tok.vocab["cá"], tok.vocab["<eos>"]) == (0, 1, 4, 6)
    gen = start(micro, [1, 3], GREEDY, max_new_tokens=10)
    assert (gen.steps[0].cache_len, gen.steps[0].cache_bytes) == (2, 128)
    run_to_end(micro, gen)
    assert gen.new_ids == [4, 6]
    assert gen.stop_reason == "eos"
    decode_step = gen.steps[1]
    assert decode_step.input_ids == [4] and decode_step.positions == [2]
    assert (decode_step.cache_len, decode_step.cache_bytes, decode_step.cache_bytes_formula) == (3, 192, 192)
    assert decode_step.attention.shape == (2, 2, 1, 3)
    assert gen.steps[0].attention.shape == (2, 2, 3)  # the prefill's triangle, kept without its upper zeros
    assert gen.steps[0].heads(1).shape == (2, 2, 2) and gen.steps[0].weights(1, 0).shape == (2, 2)


def test_prefill_attention_is_causal_and_rows_sum_to_one(small):
    gen = start(small, encode_prompt(small, "con mèo").ids, GREEDY, 1)
    att = np.stack([gen.steps[0].heads(layer) for layer in range(small.info.n_layers)])  # (layers, heads, N, N)
    n = att.shape[-1]
    assert np.all(att[..., np.triu_indices(n, k=1)[0], np.triu_indices(n, k=1)[1]] == 0)
    np.testing.assert_allclose(att.sum(-1), 1.0, atol=1e-6)


def test_small_uses_gqa_and_writes_sentences(small):
    info = small.info
    assert info.n_kv_heads < info.n_heads
    for prompt in ("con mèo", "hôm nay trời", "the dog"):
        gen = start(small, encode_prompt(small, prompt).ids, GREEDY, max_new_tokens=20)
        run_to_end(small, gen)
        assert gen.stop_reason == "eos", (prompt, small.tokenizer.decode(gen.new_ids))
        answer = small.tokenizer.decode(gen.new_ids)
        assert answer.endswith((".", "?", "!")) and len(answer.split()) >= 2


def test_unknown_words_are_reported(small, micro):
    encoded = encode_prompt(small, "con mèo xyzzy")
    assert encoded.unknown == ["xyzzy"]
    assert encoded.ids[-1] == small.tokenizer.unk_id
    with pytest.raises(InputError) as bad:
        encode_prompt(micro, "chó ăn")  # micro has no <unk>: its 8 words are all it can read
    assert bad.value.code == "unknown_words"


@pytest.mark.parametrize(("n", "t", "with_cache", "without_cache"), [(13, 5, 17, 75), (2, 4, 5, 14), (2, 2, 3, 5)])
def test_course_counts(n, t, with_cache, without_cache):
    assert positions_with_cache(n, t) == with_cache
    assert positions_without_cache(n, t) == without_cache
    assert cumulative_positions(n, t) == ([n + k - 1 for k in range(1, t + 1)],
                                          [sum(n + j - 1 for j in range(1, k + 1)) for k in range(1, t + 1)])


def test_cache_bytes_formula():
    assert cache_bytes_formula(2, 1, 3, 4, 4) == 192
    assert cache_bytes_formula(12, 12, 1024, 64, 2) == 37_748_736


def test_counts_of_a_real_run(micro):
    gen = start(micro, [1, 3], GREEDY, 10)
    run_to_end(micro, gen)
    assert (gen.positions_with_cache, gen.positions_without_cache) == (3, 5)
    assert gen.positions_with_cache == gen.cache.length


def test_crop_then_decode_equals_a_fresh_run(small):
    ids = encode_prompt(small, "the dog").ids
    gen = start(small, ids, GREEDY, 10)
    for _ in range(4):
        step(small, gen)
    fresh = start(small, ids, GREEDY, 10)
    for _ in range(2):
        step(small, fresh)
    assert back(small, gen) and back(small, gen)
    assert gen.cache.length == fresh.cache.length == fresh.steps[-1].cache_len
    step(small, gen)
    step(small, fresh)
    np.testing.assert_allclose(gen.steps[-1].logits, fresh.steps[-1].logits, atol=TOL)
    np.testing.assert_allclose(gen.steps[-1].attention, fresh.steps[-1].attention, atol=TOL)
    assert gen.new_ids == fresh.new_ids


def test_back_stops_at_prefill(micro):
    gen = start(micro, [1, 3], GREEDY, 10)
    assert not back(micro, gen)
    assert gen.cache.length == 2


def test_resample_reuses_stored_logits(small, monkeypatch):
    gen = start(small, encode_prompt(small, "con mèo").ids, GREEDY, 10)
    monkeypatch.setattr(small, "forward", lambda *a, **k: pytest.fail("resampling must not run the model"))
    resample(small, gen, SamplingSettings(temperature=1.5, top_k=5, seed=7))
    first = gen.samples[-1].chosen_id
    resample(small, gen, SamplingSettings(temperature=1.5, top_k=5, seed=7))
    assert gen.samples[-1].chosen_id == first
    assert gen.samples[-1].n_kept_top_k == 5


def test_stop_max_new_tokens(small):
    gen = start(small, encode_prompt(small, "con mèo").ids, GREEDY, max_new_tokens=2)
    run_to_end(small, gen)
    assert (len(gen.new_ids), gen.stop_reason) == (2, "max_new_tokens")


def test_stop_string(small):
    gen = start(small, encode_prompt(small, "con mèo").ids, GREEDY, 20, stop_strings=(".",))
    run_to_end(small, gen)
    assert gen.stop_reason == "stop_string"
    assert small.tokenizer.decode(gen.new_ids).endswith(".")


def test_stop_context_full(tiny_random):
    context = tiny_random.info.context_length
    prompt = [1] + [4] * (context - 3)
    gen = start(tiny_random, prompt, SamplingSettings(temperature=1.0, top_k=3, seed=0), max_new_tokens=3)
    run_to_end(tiny_random, gen)
    if gen.stop_reason == "eos":
        pytest.skip("the random model drew <eos> first")
    assert gen.stop_reason == "context_full"
    assert gen.cache.length == context


def test_stop_cancel_pauses(small):
    gen = start(small, encode_prompt(small, "con mèo").ids, GREEDY, 20)
    run_to_end(small, gen, cancelled=lambda: True)
    assert gen.stop_reason == "cancelled" and len(gen.steps) == 1
    assert step(small, gen) is not None


@pytest.mark.parametrize(("settings", "code"), [
    (SamplingSettings(temperature=-1), "bad_temperature"),
    (SamplingSettings(temperature=1, top_k=0), "bad_top_k"),
    (SamplingSettings(temperature=1, top_p=0), "bad_top_p"),
    (SamplingSettings(temperature=1, top_p=1.5), "bad_top_p"),
])
def test_bad_settings_are_refused_before_any_state(micro, settings, code):
    with pytest.raises(InputError) as bad:
        start(micro, [1, 3], settings, 5)
    assert bad.value.code == code


def test_bad_requests(micro):
    for prompt, max_new, code in (([1], 5, "only_start_token"), ([1] + [3] * 16, 1, "prompt_too_long"),
                                  ([1, 3], 16, "max_new_tokens")):
        with pytest.raises(InputError) as bad:
            start(micro, prompt, GREEDY, max_new)
        assert bad.value.code == code
        assert bad.value.message("vi") and bad.value.message("en")


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run_cli(capsys):
    """`python -m model ARGS` in this process (what the entry point calls), its exit status and output."""
    def run(*args: str) -> CliRun:
        try:
            code = cli.main(list(args))
        except SystemExit as exit_:  # argparse refusing an option
            code = exit_.code
        out = capsys.readouterr()
        return CliRun(code, out.out, out.err)
    return run


def test_cli_count(run_cli):
    out = run_cli("count", "13", "5")
    assert out.returncode == 0
    assert "17" in out.stdout and "75" in out.stdout


def test_the_module_entry_point_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "model", "count", "2", "4"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "5" in out.stdout and "14" in out.stdout


def test_cli_trace_json_micro(run_cli):
    out = run_cli("trace", "--model", "micro", "--prompt-ids", "1,3", "--json", "--check")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["output"] == {"ids": [4, 6], "text": "cá", "stop_reason": "eos"}
    assert [s["cache_len"] for s in report["steps"]] == [2, 3]
    assert [s["cache_bytes"] for s in report["steps"]] == [128, 192]
    assert report["steps"][1]["attention_shape"] == [2, 2, 1, 3]
    assert all(s["max_abs_logit_diff"] <= TOL for s in report["steps"])
    assert report["counts"] == {"prompt_len": 2, "new_tokens": 2, "positions_with_cache": 3,
                                "positions_without_cache": 5}
    assert set(report["model"]) >= {"name", "n_layers", "n_heads", "n_kv_heads", "d_head", "dtype", "device"}
    assert set(report["timing"]["itl_ms"]) == {"p50", "p95", "p99"}


def test_cli_trace_table_small(run_cli):
    out = run_cli("trace", "--prompt", "con mèo", "--max-new-tokens", "3")
    assert out.returncode == 0, out.stderr
    assert "prefill" in out.stdout and "decode" in out.stdout and "stop: max_new_tokens" in out.stdout


@pytest.mark.parametrize("args", [
    ("trace", "--prompt", "   "),
    ("trace", "--prompt", " ".join(["con"] * 200)),
    ("trace", "--prompt", "con", "--model", "no-such-model"),
    ("trace", "--prompt", "con", "--top-p", "1.5"),
    ("trace", "--prompt", "con", "--top-p", "0"),
    ("trace", "--prompt-ids", "1,x"),
    ("trace", "--prompt-ids", "1,,3"),
    ("trace", "--prompt-ids", "1_0"),
    ("trace", "--prompt-ids", "１,３"),  # full-width digits: int() would read them
    ("trace", "--prompt", "con", "--seed", "-1"),
    ("trace", "--prompt", "con", "--max-new-tokens", "0"),
])
def test_cli_bad_input_is_one_sentence(run_cli, args):
    out = run_cli(*args)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["micro", "small"])
def test_transformers_loads_bundled_checkpoint_with_same_logits(name):
    from transformers import AutoModelForCausalLM

    from model.weights.catalog import resolve_path

    native = load_model(name, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(resolve_path(name), trust_remote_code=False, use_safetensors=True)
    hf.eval()
    rng = np.random.default_rng(0)
    for length in (2, 5, 11):
        ids = [1] + rng.integers(2, native.info.vocab_size, size=length - 1).tolist()
        with torch.inference_mode():
            theirs = hf(torch.tensor([ids])).logits[0].numpy()      # (T, vocab): every position
            ours = native.module(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(native.forward(ids, None, output_attentions=False)[0].numpy(), theirs[-1],
                                   atol=1e-5, rtol=0)


@needs_kernels
def test_the_shared_model_holds_each_matrix_once_packed_and_dense_ones_are_made_on_demand(tmp_path):
    """Issue 38, item 1: the loader reads every Linear's matrix from the file straight into the decode kernels'
    packed form (q, k, v in one product, gate and up in one); no dense weight stays beside it (each Linear's own is a
    stand-in on the meta device), the tied embedding looks its rows up in the LM head's packed weights, and what
    needs dense weights gets them made from the packed ones: save writes the file it was loaded from, dense_copy
    multiplies the plain way; a plain deepcopy, which would copy stand-ins, is refused."""
    import copy

    from safetensors.torch import load_file

    from model.engine.llama import Linear, dense_copy
    from model.weights.catalog import resolve_path

    shared = load_model("small", "cpu").module
    original = load_file(resolve_path("small") / "model.safetensors")
    linears = [m for m in shared.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight.device.type == "meta" for m in linears)
    assert shared.lm_head.weight is shared.model.embed_tokens.weight
    attention, mlp = shared.model.layers[0].self_attn, shared.model.layers[0].mlp
    assert attention.q_proj.packed is attention.k_proj.packed is attention.v_proj.packed
    assert mlp.gate_proj.packed is mlp.up_proj.packed is not mlp.down_proj.packed
    ids = torch.tensor([[0, 1, 7], [524, 300, 16]])
    assert torch.equal(shared.model.embed_tokens(ids), original["model.embed_tokens.weight"][ids])
    shared.save(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in saved)
    plain = dense_copy(shared)
    assert all(m.packed is None and torch.equal(m.weight, original.get(f"{n}.weight", original[
        "model.embed_tokens.weight"])) for n, m in plain.named_modules() if isinstance(m, Linear))
    assert plain.lm_head.weight is plain.model.embed_tokens.weight and plain.model.embed_tokens.packed is None
    torch.testing.assert_close(plain(ids).logits, shared(ids).logits, atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="dense_copy"):
        copy.deepcopy(shared)


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("d_in,d_out", [(576, 576), (576, 1536), (1536, 576), (640, 2048), (2048, 640),
                                        (576, 49152), (3001, 8), (48, 525)])
def test_a_packed_row_has_the_same_bits_beside_any_number_of_rows(d_in, d_out, dtype):
    """PackedWeight in each dtype: row 0 of 1 to 40 rows comes out bit for bit the same (MKL's sgemm, the plain
    F.linear, rounds it differently at 1 row and at 8), and matrices stacked along the outputs give each matrix's
    outputs alone; within the dtype's rounding of F.linear on the same numbers. The shapes: SmolLM2's and Gemma 3's
    projections, an LM head, an odd input and outputs that do not fill a block of 16."""
    from model.engine import kernels
    from model.engine.llama import PackedWeight

    torch.manual_seed(0)
    weight, other = torch.randn(d_out, d_in) / d_in ** 0.5, torch.randn(40, d_in) / d_in ** 0.5
    x = torch.randn(40, d_in).to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    shapes = [[weight], [weight, other]]
    arena = kernels.Arena(sum(PackedWeight.nbytes_of(s, getattr(torch, dtype)) for s in shapes))
    packed, stacked = (PackedWeight(s, getattr(torch, dtype), arena) for s in shapes)
    alone = packed(x[:1])
    for rows in range(2, 41):
        assert torch.equal(packed(x[:rows])[:1], alone), rows
    assert torch.equal(stacked(x)[:, :d_out], packed(x)) and stacked.outputs == (d_out, 40)
    if dtype != "int8":  # (int8 rounds the inputs too: test_the_int8_product_is_its_definition_bit_for_bit)
        expected = torch.nn.functional.linear(x.float(), packed.dense().float())
        tolerance = dict(atol=1e-2, rtol=2**-7) if dtype == "bfloat16" else dict(atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(packed(x).float(), expected, **tolerance)
    assert torch.equal(packed.rows(torch.tensor([d_out - 1, 0])), packed.dense()[[d_out - 1, 0]])


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16-weights", "int8"])
def test_a_decode_steps_layer_in_the_kernels_is_the_blocks_own_ops_bit_for_bit(dtype):
    """Issue 38, item 5: on the shared model a decode step's layer runs as Block.decode (kernels.decode_in: norm, q/k/v
    product, RoPE; the caller's cache write; kernels.decode_out: attention, output product plus the residual, norm,
    gate/up product, silu_mul, down product plus the residual). It gives the bits of the
    block's own twenty-odd ops: the logits, the attention weights, q, k and v of a layer, and the cache, for a solo
    decode; and a pass of decode rows of different lengths over a paged pool (the serving runner's, the layer as
    Block.pass_in_place) gives the bits of the same ops. It breaks if RoPE's two products are fused into one
    multiply-add (kernels.cpp's `rounded`; made red once), if a residual is added to another row, or if a row reads
    keys outside its span."""
    from model.engine.llama import Block, Probe, pack_linears
    from model.engine.lowbit import ACTIVATIONS, PRODUCTS
    from model.serving.memory import BlockMemory
    from model.serving.paged import PagedLayout, Row, layer_groups
    from model.serving.request import Request
    from model.serving.runner import run_rows

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    module = Llama(cfg).eval().requires_grad_(False)
    for name, weight in module.named_parameters():
        if "norm" in name:
            weight.normal_(1.0, 0.5)
    assert pack_linears(module, PRODUCTS[dtype], activations=ACTIVATIONS[dtype])
    blocks = [m for m in module.modules() if isinstance(m, Block)]
    layers = [block.decode_layer for block in blocks]
    assert all(layers)

    def solo_and_batch(in_kernels: bool):
        for block, layer in zip(blocks, layers):
            block.decode_layer = layer if in_kernels else None
        cache = module.new_cache()
        module(torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1)), cache)
        solo = [module(torch.tensor([[t]]), cache, probe=Probe(attentions=True, qkv_layer=1)) for t in (5, 17, 33)]
        lengths = (9, 4, 7)
        pool = BlockMemory(PagedLayout(layer_groups((None,) * 2), 4, 2, 16, 4), 12, torch.float32, torch.device("cpu"))
        for r, n in enumerate(lengths):
            pool.grow(Request(r, [], 2), n + 2)
            run_rows(module, pool, [Row(r, 0, n, True, n)], torch.arange(n)[None] + r)
        batch = [run_rows(module, pool, [Row(r, n + i, 1, False, n + i + 1) for r, n in enumerate(lengths)],
                          torch.tensor([[t, t + 1, t + 2]])) for i, t in enumerate((3, 8))]
        return solo, cache, batch

    (solo, cache, batch), (solo_ops, cache_ops, batch_ops) = solo_and_batch(True), solo_and_batch(False)
    for fused, ops in zip(solo, solo_ops):
        assert torch.equal(fused.logits, ops.logits)
        assert all(torch.equal(a, b) for a, b in zip(fused.attentions, ops.attentions))
        assert all(torch.equal(a, b) for a, b in zip(fused.qkv, ops.qkv))
    assert all(torch.equal(a, b) for i in range(2) for a, b in zip(cache.layer(i), cache_ops.layer(i)))
    assert all(torch.equal(a, b) for a, b in zip(batch, batch_ops))


@needs_kernels
@pytest.mark.parametrize("d_in,d_out", [(576, 576), (576, 960), (1536, 576), (576, 49152), (3001, 8), (48, 525),
                                        (129, 20)])
def test_bfloat16_weights_are_the_float32_product_over_the_rounded_weights_bit_for_bit(d_in, d_out):
    """lowbit's "bfloat16-weights": float32 rows times bfloat16 weights (kernels.cpp's tile_bf16w) give the float32
    product's bits over the same weights widened to float32, for 1 to 40 rows beside each other and with a residual
    added, so such a model is the float32 model over rounded weights, bit for bit, reading half the bytes. The shapes:
    SmolLM2's, an LM head, odd inputs (the last pair's one input: 3001 and 129 start a run of 64 with it) and outputs
    that do not fill a block. Red once with a pair's two products added together before they join the run's sum."""
    from model.engine import kernels

    torch.manual_seed(0)
    weight = (torch.randn(d_out, d_in) / d_in ** 0.5).to(torch.bfloat16).float()
    arena = kernels.Arena(sum(kernels.packed_nbytes(d_out, d_in, dtype) for dtype in (torch.float32, torch.bfloat16)))
    wide, narrow = kernels.pack(weight, torch.float32, arena), kernels.pack(weight, torch.bfloat16, arena)
    assert narrow.flat.numel() * 2 < wide.flat.numel() * 2 + 64 * 4
    x = torch.randn(40, d_in)
    for rows in (1, 2, 5, 6, 7, 13, 40):
        assert torch.equal(kernels.matmul(x[:rows], narrow), kernels.matmul(x[:rows], wide)), rows
    y, residual = torch.empty(40, narrow.shape.blocks * kernels.LANES), torch.randn(40, narrow.shape.blocks * 16)
    kernels.kernels().matmul_bf16w(x.data_ptr(), 40, d_in, narrow.flat.data_ptr(), narrow.shape.blocks, y.data_ptr(),
                                   residual.data_ptr(), 1)
    assert torch.equal(y, residual + kernels.matmul(x, wide))


@needs_kernels
def test_a_bfloat16_weights_model_is_the_float32_model_over_rounded_weights(small):
    """with_weights(model, "bfloat16-weights"): every Block's layer still in the decode kernels, half the packed bytes,
    the norms and the cache float32, the shared model untouched, the logits of the float32 model whose matrices are
    rounded to bfloat16 (torch's product on a dense copy: within float32's rounding), and each cached step's logits
    a full recompute's, bit for bit."""
    from model.engine.llama import Block, dense_copy, packed_weights
    from model.engine.lowbit import with_rounded_linears, with_weights

    before = [w.matrix.flat.data_ptr() for w in packed_weights(small.module)]
    model = with_weights(small, "bfloat16-weights")
    assert model.info.dtype == "bfloat16-weights" and model.info.kv_dtype == "float32"
    assert all(b.decode_layer is not None for b in model.module.modules() if isinstance(b, Block))
    assert sum(w.nbytes for w in packed_weights(model.module)) < 0.51 * sum(
        w.nbytes for w in packed_weights(small.module))
    assert [w.matrix.flat.data_ptr() for w in packed_weights(small.module)] == before
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    reference = with_rounded_linears(dense_copy(small.module))
    torch.testing.assert_close(model.module(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-5)
    assert not torch.allclose(model.module(ids).logits, small.module(ids).logits, atol=1e-4, rtol=1e-5)
    # each cached decode step's logits are the full recompute's at its position, bit for bit
    full = model.every_logits(ids[0].tolist(), model.new_cache())
    cache = model.new_cache()
    model.forward(ids[0, :3].tolist(), cache, False)
    for position in range(3, 6):
        assert torch.equal(model.forward([int(ids[0, position])], cache, False)[0], full[position]), position


@needs_kernels
def test_the_kernels_silu_is_within_3_ulps_and_gives_a_number_the_same_bits_wherever_it_lies():
    """kernels.silu_mul, the shared model's SiLU(gate) · up: within 3 float32 ulps of the float64 value (0 and the
    extremes included), and a number's bits do not depend on where it lies: in a row's last width mod 16 numbers or
    before them, in row 4 of 400 or alone, in a tensor of its own or a packed product's wider output (torch's SiLU
    finishes a row's tail another way). It breaks if the tail is computed apart from the vector code (made red
    once)."""
    from model.engine import kernels

    torch.manual_seed(0)
    width = 4099  # 3 numbers past the last full 16
    gate_up = torch.randn(400, 2 * width) * 6  # 1,200 numbers in the tails: the scalar exp differs in about 45
    gate_up[0, :5] = torch.tensor([100.0, -100.0, 0.0, 88.0, -90.0])
    out = kernels.silu_mul(gate_up, width)
    exact = torch.nn.functional.silu(gate_up[:, :width].double()) * gate_up[:, width:].double()
    ulp = torch.from_numpy(np.spacing(exact.abs().float().numpy())).double()
    assert bool(((out.double() - exact).abs() <= 3 * ulp + 1e-30).all())
    shifted = torch.cat([half.roll(7, dims=-1) for half in gate_up.split(width, dim=-1)], dim=-1)
    assert torch.equal(kernels.silu_mul(shifted, width)[:, 7:], out[:, :-7])
    assert torch.equal(kernels.silu_mul(gate_up[4:5], width)[0], out[4])
    wider = torch.zeros(400, 2 * width + 13)
    wider[:, :2 * width] = gate_up
    assert torch.equal(kernels.silu_mul(wider[:, :2 * width], width), out)


@needs_kernels
def test_the_decode_kernels_take_a_layer_only_where_they_give_its_bits():
    """Block.decode needs float32 or int8 products whose outputs fill their blocks of 16 (it adds the residual as it
    stores whole blocks): bfloat16, an MLP width of 84 (gate and up: 168 outputs) and a dense copy keep the block's
    own ops. A decode step with a head switched off runs the block's ops too: the same logits with Block.decode
    taken away, not those of every head on."""
    from model.engine.llama import Block, Probe, dense_copy, pack_linears

    def blocks(intermediate, dtype):
        cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
        module = Llama(cfg).eval().requires_grad_(False)
        pack_linears(module, dtype)
        return module, [m for m in module.modules() if isinstance(m, Block)]

    assert all(b.decode_layer is None for b in blocks(96, torch.bfloat16)[1] + blocks(84, torch.float32)[1])
    module, (block,) = blocks(96, torch.float32)
    assert block.decode_layer is not None
    assert [m.decode_layer for m in dense_copy(module).modules() if isinstance(m, Block)] == [None]
    cache = module.new_cache()
    module(torch.tensor([[1, 2, 3]]), cache)
    off = module(torch.tensor([[4]]), cache.copy_first(3), probe=Probe(heads_off={0: (1,)}))
    block.decode_layer, kept = None, block.decode_layer
    assert torch.equal(off.logits, module(torch.tensor([[4]]), cache.copy_first(3),
                                          probe=Probe(heads_off={0: (1,)})).logits)
    block.decode_layer = kept
    assert not torch.equal(off.logits, module(torch.tensor([[4]]), cache.copy_first(3)).logits)


@needs_kernels
@pytest.mark.parametrize("d_in,d_out", [(576, 960), (1536, 576), (2048, 640), (3001, 8), (48, 525)])
def test_the_int8_product_is_its_definition_bit_for_bit(d_in, d_out):
    """Issue 38, item 2: int8 multiplies int8 weights by each row's inputs rounded to int16 with the row's own scale,
    in whole numbers, runs of 256 inputs whose whole sums join a float32 total in turn; computed here in torch from
    that definition (the whole numbers in float64, exact): W_q = round(W / s), s = max|W_row| / 127;
    x_q = round(x · (32767 / max|x_row|)); y = Σ_runs float32(x_q · W_qᵀ) · (max|x_row| / 32767) · s, bit for bit, a
    row of zeros included."""
    from model.engine import kernels
    from model.engine.llama import PackedWeight

    torch.manual_seed(1)
    weight, x = torch.randn(d_out, d_in) / d_in ** 0.5, 3 * torch.randn(9, d_in)
    x[4] = 0
    packed = PackedWeight([weight], torch.int8, kernels.Arena(PackedWeight.nbytes_of([weight], torch.int8)))
    s = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    weight_q = torch.round(weight / s[:, None]).clamp(-127, 127).double()
    most = x.abs().amax(dim=1, keepdim=True)
    # (a number over a tensor is torch's reciprocal times the number, a float32 rounding apart from the division)
    x_q = torch.round(x * torch.where(most > 0, torch.tensor(32767.0) / most, 0)).double()
    total = torch.zeros(9, d_out)
    for first in range(0, d_in, 256):
        total += (x_q[:, first:first + 256] @ weight_q[:, first:first + 256].T).float()
    assert torch.equal(packed(x), total * (most / 32767) * s)


def test_check_is_computed_once_per_step_and_forgotten_on_back(small, monkeypatch):
    from model.engine import generate

    gen = start(small, encode_prompt(small, "the dog").ids, GREEDY, 10)
    step(small, gen)
    assert generate.check_last_step(small, gen).max_abs_diff <= TOL
    monkeypatch.setattr(generate, "recompute", lambda *a: pytest.fail("the check of this step is already known"))
    assert generate.check_last_step(small, gen).max_abs_diff <= TOL
    back(small, gen)
    assert 1 not in gen.checks


def test_out_of_memory_mid_pass_leaves_the_session_as_it_was(small, monkeypatch):
    gen = start(small, encode_prompt(small, "the dog").ids, GREEDY, 10)
    step(small, gen)
    before = (gen.cache.length, gen.cache.nbytes(), list(gen.new_ids), len(gen.steps))
    last_block = small.module.model.layers[-1]

    def out_of_memory(*args, **kwargs):  # the earlier layers have appended their K, V by now
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(last_block, "forward", out_of_memory)
    with pytest.raises(InputError) as bad:
        step(small, gen)
    assert bad.value.code == "out_of_memory"
    assert (gen.cache.length, gen.cache.nbytes(), list(gen.new_ids), len(gen.steps)) == before
    monkeypatch.undo()
    assert step(small, gen) is not None and gen.cache.length == before[0] + 1


def test_cli_bench_tiny_prints_every_table_with_its_conditions(run_cli):
    """The benchmark's every table on tiny shapes, in-process: the code path, not a measurement."""
    run = run_cli("bench", "--tiny")
    assert run.returncode == 0
    out = run.stdout
    for heading in ("micro:", "llama-tiny (random):", "cached vs recomputed step", "GPT-2-tiny shape"):
        assert heading in out
    assert out.count("float32") >= 4 and "native / tf" in out and "model.engine.generate" in out


def test_where_the_kernels_do_not_build_the_model_runs_dense_on_torchs_product(no_kernels):
    """On a machine without a C++ compiler the loader keeps the dense module and torch's F.linear: no Linear half
    packed, the same logits within float32's rounding (breaks if the build's failure escaped to the loader); int8 is
    refused in one sentence, bfloat16 runs as a bfloat16 copy."""
    from model.engine import kernels, llama
    from model.engine.lowbit import with_weights
    from model.weights.catalog import resolve_path

    assert "no C++ compiler" in kernels.unavailable_reason()
    model = load_model("small", "cpu")
    assert not any(m.packed is not None for m in model.module.modules() if isinstance(m, llama.Linear))
    assert model.facts.packed_bytes is None and model.facts.held_bytes == model.facts.memory_bytes
    ids = torch.tensor([[1, 5, 9, 12]])
    torch.testing.assert_close(model.module(ids).logits, Llama.load(resolve_path("small"))(ids).logits)
    with pytest.raises(InputError) as refused:
        with_weights(model, "int8")
    assert refused.value.code == "int8_no_kernels" and "C++" in refused.value.message("en")
    assert with_weights(model, "bfloat16").info.dtype == "bfloat16"
    rounded = with_weights(model, "bfloat16-weights")  # float32 over weights rounded to bfloat16, on torch's product
    assert rounded.info.dtype == "bfloat16-weights" and rounded.info.kv_dtype == "float32"
    assert torch.equal(rounded.module.lm_head.weight, model.module.lm_head.weight.bfloat16().float())
    assert not torch.equal(rounded.module.lm_head.weight, model.module.lm_head.weight)


def test_a_compiler_that_fails_leaves_no_partial_library_and_says_so(monkeypatch, tmp_path):
    """$CXX names a program that exits 1 (false): the kernels are unavailable with "did not build", and the cache
    folder keeps no half-written library (the build writes a temporary file, renamed only once whole)."""
    import functools
    import shutil

    from model.engine import kernels

    monkeypatch.setenv("CXX", shutil.which("false"))
    monkeypatch.setenv("DECODE_LAB_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_built", functools.cache(kernels._built.__wrapped__))
    assert kernels.unavailable_reason() == "kernels.cpp did not build here (CalledProcessError)"
    assert list((tmp_path / "kernels").iterdir()) == []


@needs_kernels
@pytest.mark.parametrize("kind", ["not_writable", "damaged"])
def test_a_cache_folder_that_cannot_hold_the_kernels_still_gives_them(kind, monkeypatch, tmp_path):
    """faults 2026-12-04 #4: a cache folder that cannot be written, or a library there cut short, raised a plain
    OSError, and no model loaded (float32 too). Now the kernels are built in a temporary folder of the process."""
    import functools

    from model.engine import kernels

    cache = tmp_path / "cache"
    if kind == "not_writable":  # a path under a file: mkdir fails as in a read-only folder, for root too
        (tmp_path / "a-file").write_text("")
        cache = tmp_path / "a-file" / "cache"
    monkeypatch.setenv("DECODE_LAB_CACHE", str(cache))
    monkeypatch.setattr(kernels, "_built", functools.cache(kernels._built.__wrapped__))
    if kind == "damaged":  # a library of 100 bytes where this machine's should be
        (cache / "kernels").mkdir(parents=True)
        (cache / "kernels" / kernels.library_name(kernels.compiler())).write_bytes(b"\x7fELF" + bytes(96))
    assert kernels.unavailable_reason() is None
    x = torch.randn(3, 32)
    w = torch.randn(16, 32)
    arena = kernels.Arena(kernels.packed_nbytes(16, 32, torch.float32))
    assert torch.allclose(kernels.matmul(x, kernels.pack(w, torch.float32, arena)), x @ w.T, atol=1e-5)


def test_a_kernels_build_that_fails_is_tried_once_per_process(monkeypatch, tmp_path):
    """faults 2026-12-04 #18 + #4: functools.cache kept no raised KernelsUnavailable, so every later kernels() call
    (each model load, each Serving page render through bf16_products and int8_products) ran the compiler again: 300 s
    each with a hung one. The failure is remembered: the compiler runs once, the reason is the same each time."""
    import functools

    from model.engine import kernels

    calls = tmp_path / "calls"
    compiler = tmp_path / "c++"
    compiler.write_text(f"#!/bin/sh\necho run >> {calls}\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("DECODE_LAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_built", functools.cache(kernels._built.__wrapped__))
    assert kernels.build_ahead()
    reasons = {kernels.unavailable_reason() for _ in range(3)}
    assert (kernels.bf16_products(), kernels.int8_products()) == ("torch", "none")
    assert reasons == {"kernels.cpp did not build here (CalledProcessError)"}
    assert calls.read_text().splitlines() == ["run"]
    assert not kernels.build_ahead()  # settled for the process: the page no longer says a build is ahead


@needs_kernels
def test_the_temporary_kernels_folder_is_gone_once_the_library_is_loaded(monkeypatch, tmp_path):
    """faults 2026-12-04 #4: where the cache folder cannot hold the library it is built in a decode-lab-kernels-*
    folder of the temp folder; that folder is deleted once the library is loaded (it stays mapped), not left per
    process, and the products still run."""
    import functools
    import tempfile

    from model.engine import kernels

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("DECODE_LAB_CACHE", str(tmp_path / "a-file" / "cache"))
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setattr(kernels, "_built", functools.cache(kernels._built.__wrapped__))
    assert kernels.unavailable_reason() is None and kernels.unavailable_reason() is None
    assert list(temp.iterdir()) == []
    x, w = torch.randn(3, 32), torch.randn(16, 32)
    arena = kernels.Arena(kernels.packed_nbytes(16, 32, torch.float32))
    assert torch.allclose(kernels.matmul(x, kernels.pack(w, torch.float32, arena)), x @ w.T, atol=1e-5)


def test_the_model_spinner_says_the_kernels_build_and_its_longest_wait_only_while_one_is_ahead(monkeypatch):
    """faults 2026-12-04 #18: a visitor whose load builds the kernels sees why it waits and for how long at most, in
    vi and en; once they are settled the spinner says only that the model loads."""
    from model.engine import kernels
    from model.texts import text
    from ui import models

    language = {"lang": "en"}
    monkeypatch.setattr(models, "t", lambda key, **details: text(key, language["lang"]).format(**details))
    monkeypatch.setattr(kernels, "build_ahead", lambda: True)
    assert models.loading_sentence() == ("Loading the model… The first time on this machine, Decode Lab builds the "
                                         "decode kernels for this CPU (once per machine, usually a few seconds, at "
                                         f"most {kernels.BUILD_SECONDS} s); other sessions wait for this build.")
    language["lang"] = "vi"
    assert f"tối đa {kernels.BUILD_SECONDS} giây" in models.loading_sentence()
    monkeypatch.setattr(kernels, "build_ahead", lambda: False)
    assert models.loading_sentence() == text("state.loading_model", "vi")


@needs_kernels
@pytest.mark.slow
def test_two_processes_building_the_kernels_at_once_both_load_them(tmp_path):
    """Two fresh processes (the app and a test, say) build the kernels into one empty cache folder at the same time:
    each compiles to a temporary file of its own and renames it into place, so both load a whole library and the
    folder ends with one library and no temporary file."""
    import os
    from pathlib import Path

    code = "from model.engine import kernels; print(kernels.bf16_products())"
    env = {**os.environ, "DECODE_LAB_CACHE": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[1])}
    runs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    said = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], said
    assert {out.strip() for out, _ in said} <= {"avx512_bf16", "float32"}
    assert [path.suffix for path in (tmp_path / "kernels").iterdir()] == [".so"]


@pytest.mark.parametrize(("value", "mib"), [("", 256), ("64", 64), ("0.5", 0.5), ("abc", 256), ("-3", 256),
                                            ("0", 256), ("nan", 256), ("inf", 256)])
def test_a_session_budget_that_is_no_positive_number_is_ignored_and_the_default_holds(value, mib, monkeypatch):
    """A typo in DECODE_LAB_SESSION_MB (or DECODE_LAB_TIER_MB, read by the same function) raised at every page that
    read it: now it is a log line and the default."""
    monkeypatch.setenv("DECODE_LAB_SESSION_MB", value)
    assert session_budget_bytes() == int(mib * 2**20)
