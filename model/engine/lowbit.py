"""Fewer bits per weight: the shared model's weights in bfloat16, or in int8 with one scale per output channel.

bfloat16: the whole model in bfloat16, its parameters and its activations (as transformers runs a model loaded with
torch_dtype=bfloat16), the KV cache too; each product sums in float32 and rounds its outputs to bfloat16.

bfloat16-weights: the matrices rounded to bfloat16 once, everything else float32 (activations, norms, KV cache): each
product widens its weights to the float32 numbers they are and sums as the float32 product does, so a row's numbers
are the float32 model's over those rounded weights, bit for bit beside any other rows, and a decode step reads half
the float32 model's bytes (SmolLM2's 121 products at one row, one thread, here: 19.7 ms against float32's 38.3 ms;
at 16 rows 39 ms against 60, where the multiply-adds, float32's in both, begin to bound them).

int8: each matrix W (out, in) becomes round(W / s) in int8, one float32 scale per output row, s = max|W_row| / 127:
every projection, the LM head, and the embedding when it is the LM head's matrix (tied: the lookup reads the int8
row times its scale). Each product rounds its input rows to int16, each row with its own scale, max|x_row| / 32767
(dynamic, per row: an error of at most 1/65534 of the row's largest input, and nothing from another row of a batch
enters a row's numbers, so each row is its solo run, bit for bit), multiplies whole numbers, exactly, on the CPU's
int16 dot product (vpdpwssd), and scales the sums back to float32. The norms, the attention, the residual stream and
the KV cache stay float32. Measured on this CPU, SmolLM2's 121 products at one row, one thread: int8 weights turned
into float32 for float32 multiply-adds took 9–11 ms, bound by those conversions, not by the 136 MB they read; int16
inputs on vpdpwssd 5.5 ms; int8 inputs on vpdpbusd 5.8 ms, but they cost more accuracy (the held-out text's
perplexity 36.34 against float32's 34.33, 83 % greedy agreement; int16 inputs: 34.88, 94 %, as weight-only int8).
torch's own dynamic int8 (fbgemm) scales a batch's inputs with one scale per tensor, which would tie each row to the
rows beside it.

Tile products (with_weights(..., tiles=True), a CPU that lists AMX-BF16): a copy of a float32 or bfloat16 model
whose products of many rows multiply in bfloat16 on torch's product, which oneDNN runs on the AMX tiles
(llama.with_tile_products); faster prefills, not bit for bit. A bfloat16 one keeps its keys and values in a float32
pool, which a pass reads in place and attends in float32 in the kernels (llama.attend_flat) instead of a gathered
bfloat16 copy attended row by row in torch's ops.

On a CPU both run in the decode kernels (model/engine/kernels.py); the converted model holds its matrices once,
packed. bfloat16 off a CPU, or where the kernels do not build, is a bfloat16 copy on torch's own product; int8 there is
refused with a sentence.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from model.engine.kernels import cpu_features
from model.engine.llama import (
    TILE_ROWS,
    Linear,
    dense_copy,
    is_packed,
    pack_linears,
    packed_weights,
    with_tile_products,
)
from model.engine.runtime import NativeModel
from model.errors import InputError

PRODUCTS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bfloat16-weights": torch.bfloat16,
            "int8": torch.int8}  # what each dtype's packed weights hold
DTYPES = tuple(PRODUCTS)
ACTIVATIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bfloat16-weights": torch.float32,
               "int8": torch.float32}  # what its products take and give, and its norms and cache hold


def check_dtype(dtype: str) -> None:
    """InputError unless `dtype` is one of DTYPES (the command line's --dtype)."""
    if dtype not in DTYPES:
        raise InputError("unknown_dtype", option="--dtype", dtype=dtype, known=", ".join(DTYPES))


def with_weights(model: NativeModel, dtype: str, tiles: bool = False) -> NativeModel:
    """The model with its weights in `dtype` ("float32": the model itself; otherwise a converted copy, the
    shared model untouched). `tiles` (float32 or bfloat16, on a CPU with AMX-BF16; refused in one sentence
    elsewhere): a copy whose products of llama.TILE_ROWS rows or more run in bfloat16 on oneDNN's AMX tiles
    (llama.with_tile_products: faster for a prefill or a large batch, not bit for bit)."""
    check_dtype(dtype)
    if not isinstance(model, NativeModel):
        raise InputError("lowbit_needs_native", model=model.info.name, dtype=dtype)
    if tiles:
        check_tiles(model, dtype)
    module = model.module
    if dtype != "float32":
        packed = is_packed(module)
        if dtype == "int8" and not packed:
            if model.device.type != "cpu":
                raise InputError("int8_needs_cpu", device=model.device.type)
            raise InputError("int8_no_kernels")
        if packed:
            module = repacked(module, PRODUCTS[dtype], activations=ACTIVATIONS[dtype])
        elif dtype == "bfloat16-weights":  # the same numbers on torch's own product
            module = with_rounded_linears(dense_copy(module))
        else:
            module = dense_copy(module).to(torch.bfloat16)
    if tiles:
        module = with_tile_products(module)
    if module is model.module:
        return model
    converted = NativeModel(model.info.name, module, model.tokenizer, model.device, model.info.language)
    converted.facts = model.facts
    if dtype in ("int8", "bfloat16-weights"):  # its other parameters and its cache stay float32: the name says so
        converted.info = dataclasses.replace(converted.info, dtype=dtype)
    if tiles and dtype == "bfloat16":  # a pool it attends in place, in the kernels, in float32 (llama.attend_flat)
        converted.info = dataclasses.replace(converted.info, kv_dtype="float32", bytes_per_element=4)
    return converted


def tile_rows(dtype: str) -> int:
    """The rows from which a product of `dtype`'s weights runs on the tiles (llama.TILE_ROWS)."""
    return TILE_ROWS[ACTIVATIONS[dtype]]


def check_tiles(model: NativeModel, dtype: str) -> None:
    """Tile products are for a float32 or bfloat16 model the kernels pack, on a CPU that lists AMX-BF16 (elsewhere
    torch's bfloat16 product has no tiles to run on and is no faster than the kernels)."""
    if dtype == "int8":
        raise InputError("tiles_not_int8")
    if not isinstance(model, NativeModel) or not is_packed(model.module):
        raise InputError("tiles_need_kernels")
    if not cpu_features().amx_bf16:
        raise InputError("tiles_need_amx")


def repacked(module: torch.nn.Module, dtype: torch.dtype, activations: torch.dtype) -> torch.nn.Module:
    """A copy of a packed module with its linears packed again in `dtype`, made from the packed float32 ones matrix by
    matrix (never a whole dense copy); bfloat16 activations turn the rest of the module (norms, buffers) to bfloat16
    too."""
    copied = copy.deepcopy(module, {id(p): None for p in packed_weights(module)})  # the packed weights are not copied
    copied.to(activations)
    pack_linears(copied, dtype, weight_of=lambda name: module.get_submodule(name).dense_weight(),
                 activations=activations)
    return copied


def with_rounded_linears(module: torch.nn.Module) -> torch.nn.Module:
    """The module (a dense copy) with every Linear's weight rounded to bfloat16 and kept in float32: the numbers the
    kernels' "bfloat16-weights" products multiply by."""
    for linear in (m for m in module.modules() if isinstance(m, Linear)):
        with torch.no_grad():
            linear.weight.copy_(linear.weight.to(torch.bfloat16))
    return module
