"""The KV cache in fewer bits: keys and values stored as int8 or fp8, read back (dequantized) for attention.

- "int8" follows KIVI's split (arXiv 2402.02750): keys are quantized per channel, values per token. Keys have outlier
  channels (a few of the d_head dimensions are large at every position), so one scale per channel over a group of
  positions keeps the other channels' resolution; values have no such channels, and each position's value vector is
  what the attention weights mix, so one scale per position suits them. A key's channel scale needs its whole group,
  so the positions of the group not yet complete stay in float (KIVI's residual) and are quantized when the group
  fills. Both are symmetric: a scale is the largest |x| of what it covers over 127.
- "fp8" is float8 e4m3 with one scale per tensor (here per layer, for K and for V), as vLLM's
  `--kv-cache-dtype fp8` keeps them; the scales are set from the first pass's largest |x| over e4m3's 448, as vLLM's
  calculate_kv_scales does.

The same code runs a decode step, a chunk of a prompt or a whole prompt: a pass reads the complete groups as
stored and the residual and its own new positions in float, so a text fed in passes of GROUP positions (the quality
command's) reads every key exactly as a decode step at that position would. The cache keeps every position (a
sliding layer's queries still see only their window, through first_seen), and cannot crop: it is for measuring, not
for the pages' Back.
"""

from __future__ import annotations

import torch

from model.engine.cache import LayerBytes
from model.engine.runtime import NativeModel
from model.errors import InputError

KV_DTYPES = ("float32", "int8", "fp8")
GROUP = 32          # positions a key channel's int8 scale covers (KIVI's group size)
INT8_MAX = 127.0
FP8_MAX = 448.0     # the largest finite float8 e4m3 ("fn") number
SCALE_BYTES = 4     # a scale is a float32


def bytes_per_position(kv_dtype: str, n_layers: int, n_kv_heads: int, d_head: int, float_bytes: int = 4) -> float:
    """One position's cache bytes in `kv_dtype`, the scales counted: float32 2 × layers × KV heads × d_head × 4; int8
    a byte a number plus a key scale per channel per GROUP positions and a value scale per position; fp8 a byte a
    number (its two scales per layer do not grow with the positions)."""
    per_head = {"float32": 2 * d_head * float_bytes,
                "int8": 2 * d_head + SCALE_BYTES * d_head / GROUP + SCALE_BYTES,
                "fp8": 2 * d_head}[kv_dtype]
    return n_layers * n_kv_heads * per_head


def quantize_int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x in int8 with one scale per slice along every dimension but `dim` (the scale covers `dim`)."""
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX
    return torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale.float()


class QuantizedLayer:
    """One layer's K and V (B, n_kv, positions, d_head) in int8 or fp8."""

    def __init__(self, kv_dtype: str, window: int | None):
        self.kv_dtype, self.window = kv_dtype, window
        self.start = 0          # every position is kept
        self.length = 0
        self.keys: list[tuple[torch.Tensor, torch.Tensor]] = []     # int8: per complete group (int8, scale per channel)
        self.residual: torch.Tensor | None = None                   # int8: keys of the group not yet complete, float
        self.key_codes: torch.Tensor | None = None                  # fp8: every key, e4m3
        self.value_codes: torch.Tensor | None = None                # int8 or e4m3: every value
        self.value_scales: torch.Tensor | None = None               # int8: (B, n_kv, positions, 1); fp8: one number
        self.key_scale: torch.Tensor | None = None                  # fp8: one number

    def first_seen(self, start: int, position: int) -> int:
        return 0 if self.window is None else max(0, position - self.window + 1)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions; return the keys and values the new queries attend over, dequantized."""
        dtype, seen = k.dtype, self.first_seen(0, self.length)
        if self.kv_dtype == "int8":
            keys = self._append_int8_keys(k)
            codes, scales = quantize_int8(v.float(), dim=-1)                    # a scale per position
            self.value_codes = _cat(self.value_codes, codes)
            self.value_scales = _cat(self.value_scales, scales)
            values = self.value_codes.float() * self.value_scales
        else:
            if self.key_scale is None:
                self.key_scale = k.abs().amax().float().clamp_min(1e-12) / FP8_MAX
                self.value_scales = v.abs().amax().float().clamp_min(1e-12) / FP8_MAX
            self.key_codes = _cat(self.key_codes, (k.float() / self.key_scale).to(torch.float8_e4m3fn))
            self.value_codes = _cat(self.value_codes, (v.float() / self.value_scales).to(torch.float8_e4m3fn))
            keys = self.key_codes.float() * self.key_scale
            values = self.value_codes.float() * self.value_scales
        self.length += k.shape[2]
        return keys[:, :, seen:].to(dtype), values[:, :, seen:].to(dtype)

    def _append_int8_keys(self, k: torch.Tensor) -> torch.Tensor:
        """The complete groups as stored, then the residual and the new keys in float; groups that fill are
        quantized afterwards, a scale per channel over their GROUP positions."""
        stored = [codes.float() * scale for codes, scale in self.keys]
        read = torch.cat([*stored, *([self.residual] if self.residual is not None else []), k.float()], dim=2)
        pending = _cat(self.residual, k.float())
        while pending.shape[2] >= GROUP:
            self.keys.append(quantize_int8(pending[:, :, :GROUP], dim=2))          # a scale per channel
            pending = pending[:, :, GROUP:]
        self.residual = pending if pending.shape[2] else None
        return read

    def held(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V as the layer stores them: the codes (the int8 residual's floats included), for counting bytes."""
        if self.length == 0:
            return None
        keys = [codes for codes, _ in self.keys] if self.kv_dtype == "int8" else [self.key_codes]
        return torch.cat([k.float() for k in keys] + ([self.residual] if self.residual is not None else []),
                         dim=2), self.value_codes.float()

    def nbytes(self) -> int:
        if self.length == 0:
            return 0
        if self.kv_dtype == "fp8":
            return self.key_codes.numel() + self.value_codes.numel() + 2 * SCALE_BYTES
        groups = sum(codes.numel() + scale.numel() * SCALE_BYTES for codes, scale in self.keys)
        residual = 0 if self.residual is None else self.residual.numel() * self.residual.element_size()
        return groups + residual + self.value_codes.numel() + self.value_scales.numel() * SCALE_BYTES


def _cat(held: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if held is None else torch.cat((held, new), dim=2)


class QuantizedKVCache(LayerBytes):
    """A sequence's cache in int8 or fp8, a QuantizedLayer a layer; what the model's forward asks of a cache."""

    def __init__(self, kv_dtype: str, n_layers: int, windows: list[int | None]):
        if kv_dtype not in ("int8", "fp8"):
            raise ValueError(f"no quantized cache in {kv_dtype}")
        self.kv_dtype, self.n_layers, self.windows = kv_dtype, n_layers, list(windows)
        self.layers = [QuantizedLayer(kv_dtype, window) for window in self.windows]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer].append(k, v)

    def first_seen(self, layer: int, position: int) -> int:
        return self.layers[layer].first_seen(0, position)

    @property
    def length(self) -> int:
        return self.layers[0].length

    def can_crop(self, n: int) -> bool:
        return n == self.length

    def crop(self, n: int) -> None:
        if n != self.length:
            raise ValueError("a quantized cache is for measuring and does not crop")

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.layers[layer].held()

    def layer_bytes(self, layer: int) -> int:
        return self.layers[layer].nbytes()

    def layer_bytes_reserved(self, layer: int) -> int:
        return self.layers[layer].nbytes()


class QuantizedCacheModel(NativeModel):
    """The shared model (its weights, untouched) with its caches made in `kv_dtype`."""

    def __init__(self, model: NativeModel, kv_dtype: str):
        self.__dict__.update(model.__dict__)
        self.cache_dtype = kv_dtype  # not kv_dtype: NativeModel.kv_dtype is the torch dtype a pool of its K and V holds

    def new_cache(self) -> QuantizedKVCache:
        return QuantizedKVCache(self.cache_dtype, self.info.n_layers, list(self.info.layer_windows))


def check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise InputError("kv_dtype_unknown", dtype=kv_dtype, known=", ".join(KV_DTYPES))


def with_kv_dtype(model: NativeModel, kv_dtype: str) -> NativeModel:
    """The model whose caches keep K and V in `kv_dtype` ("float32": the model itself)."""
    check_kv_dtype(kv_dtype)
    return model if kv_dtype == "float32" else QuantizedCacheModel(model, kv_dtype)
