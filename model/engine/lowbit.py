"""Fewer bits per weight: the same native model in bfloat16, or int8 weight-only with per-output-channel scales.

int8 weight-only: each Linear's weight W (out, in) becomes round(W / s) in int8, with one float32 scale per output
row, s = max|W_row| / 127; the activations, norms, the embedding lookup and the KV cache stay float32. The matmul
runs in torch's own int8 weight-only kernel, torch._weight_int8pack_mm(x, W_int8, s) = x · (W_int8 · s)ᵀ, which
reads the int8 weights as they are (no float32 copy of the matrix is made): a quarter of the bytes a float32 step
reads in its matmuls.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from model.engine.runtime import NativeModel
from model.errors import InputError

DTYPES = ("float32", "bfloat16", "int8")


class Int8Linear(nn.Module):
    """y = x · (W_int8 · scale)ᵀ, W_int8 (out, in) int8 and scale (out,) float32, no bias."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # (out, in) row-major, as torch's int8 kernel reads it
        w = linear.weight.detach().float().contiguous()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # (out,)
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)

    def forward(self, x):
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight, self.scale)  # (rows, out)
        return y.view(*shape[:-1], self.out_features)


def quantize_int8(module: nn.Module) -> nn.Module:
    """Every nn.Linear (the attention and MLP projections, the LM head) replaced by an Int8Linear, in place; a tied
    LM head gets an int8 copy of the embedding, the lookup keeps the float32 table."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
        else:
            quantize_int8(child)
    return module


def with_weights(model: NativeModel, dtype: str) -> NativeModel:
    """The model with its weights in `dtype` ("float32": the model itself; otherwise a converted copy, the
    shared model untouched)."""
    if dtype not in DTYPES:
        raise InputError("unknown_dtype", dtype=dtype, known=", ".join(DTYPES))
    if not isinstance(model, NativeModel):
        raise InputError("lowbit_needs_native", model=model.info.name, dtype=dtype)
    if dtype == "float32":
        return model
    module = copy.deepcopy(model.module)
    module = module.to(torch.bfloat16) if dtype == "bfloat16" else quantize_int8(module)
    converted = NativeModel(model.info.name, module, model.tokenizer, model.device, model.info.language)
    converted.facts = model.facts
    if dtype == "int8":  # the parameters left (norms, embedding) and the cache stay float32: the name says the weights
        converted.info = dataclasses.replace(converted.info, dtype="int8")
    return converted
