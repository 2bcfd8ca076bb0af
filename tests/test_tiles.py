"""Tile products (llama.with_tile_products, lowbit.with_weights(tiles=True), serve-bench --tiles): a product of
llama.TILE_ROWS rows or more multiplies in bfloat16 on torch's product (oneDNN: AMX tiles on a CPU that has them),
fewer rows stay in the decode kernels; the shared model is not changed; refused in one sentence where it cannot
help. torch's bfloat16 product runs on every CPU (slowly without AMX), so the CPU's flags are set here as an AMX
CPU's to test the routing anywhere."""

import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from model.engine import kernels
from model.engine.llama import TILE_ROWS, Block, has_tile_products, packed_weights
from model.engine.lowbit import ACTIVATIONS, with_weights
from model.errors import InputError
from tests.conftest import needs_kernels

pytestmark = needs_kernels


@pytest.fixture
def amx(monkeypatch):
    """This CPU seen as one that lists AMX-BF16."""
    import model.engine.lowbit as lowbit

    real = kernels.cpu_features()
    monkeypatch.setattr(lowbit, "cpu_features", lambda: dataclasses.replace(real, amx_bf16=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16-weights"])
def test_from_tile_rows_a_product_is_torchs_bfloat16_one_and_below_the_kernels(tiny_gqa, amx, dtype):
    """TILE_ROWS rows (of the inputs' dtype) give exactly F.linear of the inputs rounded to bfloat16 on the dense
    bfloat16 weights; one row fewer gives exactly the kernels' product of the same weights. Red if the branch goes or
    counts rows otherwise (> for >=, made once). A tiled Llama keeps its blocks' decode layers, so a decode step's
    few rows run in the kernels' two calls a layer (red once without them: a tiled run's decode steps ran torch's
    ops: the mixed queue in float32 at 73 tokens/s against 86 with them)."""
    tiled = with_weights(tiny_gqa, dtype, tiles=True)
    assert all(block.decode_layer is not None for block in tiled.module.modules() if isinstance(block, Block)) == (
        ACTIVATIONS[dtype] == torch.float32)
    for weight in packed_weights(tiled.module):
        outputs = sum(weight.outputs)
        dense = kernels.unpack(weight.matrix, 0, outputs).to(torch.bfloat16)
        x = torch.randn(TILE_ROWS[ACTIVATIONS[dtype]], weight.inputs).to(ACTIVATIONS[dtype])
        assert torch.equal(weight(x), F.linear(x.to(torch.bfloat16), dense).to(x.dtype))
        fewer = x[:-1].contiguous()
        assert torch.equal(weight(fewer), kernels.matmul(fewer, weight.matrix)[:, :outputs])


def test_the_shared_model_is_not_changed_and_its_weights_are_not_copied(tiny_gqa, amx):
    ids = (torch.arange(64) % 49 + 1)[None]  # 64 rows: the tiled copy would multiply them on its tiles
    before = tiny_gqa.module(ids).logits
    tiled = with_weights(tiny_gqa, "float32", tiles=True)
    assert has_tile_products(tiled.module) and not has_tile_products(tiny_gqa.module)
    assert tiled.module is not tiny_gqa.module
    ours = {w.matrix.flat.data_ptr() for w in packed_weights(tiny_gqa.module)}
    assert {w.matrix.flat.data_ptr() for w in packed_weights(tiled.module)} == ours  # shared, not copied
    assert torch.equal(tiny_gqa.module(ids).logits, before)


def test_a_tiled_prefill_is_float32s_within_bfloat16_rounding(small, amx):
    """A prefill of more than 64 positions multiplies on the tiles: its logits are not float32's bits, but within what
    rounding every product's inputs and weights to bfloat16 (8 significant bits) costs over the model's layers."""
    ids = torch.tensor([list(range(3, 3 + 100))])
    exact = small.module(ids).logits[0]                                         # (T, vocab)
    tiled = with_weights(small, "float32", tiles=True).module(ids).logits[0]
    assert not torch.equal(tiled, exact)
    assert (tiled - exact).abs().max() <= 0.02 * exact.abs().max()  # 0.6 % measured on `small`
    assert (tiled.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


def test_tiles_are_refused_in_one_sentence_where_they_cannot_help(tiny_gqa, monkeypatch):
    import model.engine.lowbit as lowbit

    real = kernels.cpu_features()
    monkeypatch.setattr(lowbit, "cpu_features", lambda: dataclasses.replace(real, amx_bf16=False))
    with pytest.raises(InputError) as refused:
        with_weights(tiny_gqa, "bfloat16", tiles=True)
    assert refused.value.code == "tiles_need_amx"
    monkeypatch.setattr(lowbit, "cpu_features", lambda: dataclasses.replace(real, amx_bf16=True))
    with pytest.raises(InputError) as refused:
        with_weights(tiny_gqa, "int8", tiles=True)
    assert refused.value.code == "tiles_not_int8"


@pytest.mark.parametrize("argv, sentence", [
    (["--queue", "mixed", "--dtype", "bfloat16,int8"], "A served queue runs one dtype"),
    (["--tiles"], "--tiles belongs to a served queue"),
    (["--queue", "mixed", "--dtype", "bfloat16", "--disaggregate"], "--disaggregate applies only with --dtype"),
])
def test_serve_bench_refuses_a_dtype_the_queue_cannot_serve(argv, sentence):
    done = subprocess.run([sys.executable, "-m", "model", "serve-bench", "--model", "small", *argv],
                          capture_output=True, text=True, timeout=120, env={"DECODE_LAB_LANG": "en",
                                                                              **__import__("os").environ})
    assert done.returncode == 2 and sentence in done.stderr + done.stdout, done.stderr


@pytest.fixture(scope="module")
def tiny_gemma3():
    """A random Gemma 3: 4 layers (3 sliding of window 24, 1 full), 4 query heads over 2 KV heads, d_head 16."""
    from model.engine.gemma3 import FULL, SLIDING, Gemma3, Gemma3Config
    from model.engine.runtime import NativeModel
    from tests.conftest import packed

    torch.manual_seed(2)
    cfg = Gemma3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       query_pre_attn_scalar=16, sliding_window=24, layer_types=(SLIDING, SLIDING, SLIDING, FULL),
                       rope_theta=1e6, rope_local_theta=1e4)
    return NativeModel("tiny-gemma3", packed(Gemma3(cfg)), None, torch.device("cpu"))


@pytest.mark.parametrize("name", ["tiny_gqa", "tiny_gemma3"])
def test_a_tiled_bfloat16_model_attends_a_float32_pool_in_place_within_bfloat16_rounding(request, amx, name):
    """A bfloat16 model with tile products keeps its keys and values in a float32 pool that the engine's pass reads
    where they lie (kernels.attend_paged, its queries widened to float32): a prompt's last logits are the model's own
    bfloat16 forward's within bfloat16 rounding. Red if attend_flat hands attend_paged a bfloat16 query."""
    from model.serving.memory import BlockMemory, memory_layout, pool_dtype
    from model.serving.runner import prompt_alone, reads_in_place, run_rows

    model = with_weights(request.getfixturevalue(name), "bfloat16", tiles=True)
    n = 40
    ids = (torch.arange(n) * 7 % 49 + 1)[None]                                  # (1, n)
    layout = memory_layout(model.info, "paged", 16, n)
    cache = BlockMemory(layout, layout.request_blocks(n) * len(layout.groups), pool_dtype("float32", model.kv_dtype),
                        model.device)
    assert cache.keys.dtype == torch.float32 and reads_in_place(model.module, cache)
    paged = run_rows(model.module, cache, prompt_alone(cache, n), ids)[0].float()  # (vocab,)
    solo = model.module(ids).logits[0, -1].float()
    assert (paged - solo).abs().max() <= 0.05 * solo.abs().max()
