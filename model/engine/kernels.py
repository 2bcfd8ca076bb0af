"""Decode Lab's own matrix products for the shared model on a CPU (kernels.cpp: plain C++ and OpenMP, built once per
machine with the C++ compiler into the cache folder, a few seconds, then loaded with ctypes), the layout they read,
the memory that holds it, and what this CPU offers.

Why our own: at one row (a decode step at B = 1) a product does one multiply-add per weight it reads, so its time is
the time to read the weights. On this 2-core AMD EPYC, one thread, SmolLM2's 211 products at one row took 45–50 ms in
oneDNN's packed form (about 11–12 GB/s) and 17–19 ms here (28–31 GB/s, 0.9 of a read-only pass over memory held as
the weights are), and any number of rows gives a row the same bits (kernels.cpp says why). int8 and bfloat16 weights
go through the same loop, each weight turned into float32 in a register (bfloat16: the CPU's own bf16 dot product
where it has one), so fewer bytes read is less time.

The weights of a model live in one buffer (Arena), in transparent huge pages where Linux gives them: a step reads
hundreds of MB once, and with 4 KiB pages every 4 KiB of it needs its own address translation (under a hypervisor a
slow one): a read-only pass ran at about 19 GB/s on 4 KiB pages and 30 GB/s on 2 MiB pages here.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from model.weights.catalog import settings

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
# this CPU's vector instructions; a*b + c as one fused multiply-add everywhere (the same bits in every tile)
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")
BUILD_SECONDS = 300
LANES = 16          # outputs in a block (kernels.cpp)
ALIGN = 64          # bytes: each packed matrix starts on a cache line
HUGE_PAGE = 2**21   # bytes of a transparent huge page on x86-64 and arm64 Linux
MADV_HUGEPAGE = 14  # linux/mman.h
PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.int8)

_build_lock = threading.Lock()
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
SIGNATURES = {"matmul_f32": (_ptr, _i64, _i64, _ptr, _i64, _ptr, _int),
              "matmul_int8": (_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _int),
              "matmul_bf16": (_ptr, _i64, _i64, _ptr, _i64, _ptr, _int),
              "bf16_instructions": ()}


class KernelsUnavailable(RuntimeError):
    """The products cannot be built here; the message says why (for the server log and the facts)."""


@dataclass(frozen=True)
class CpuFeatures:
    """What this CPU offers for the products, as Linux lists its flags (None: not known, no /proc/cpuinfo)."""
    vector: str                 # torch's widest vector kernels here: "AVX512", "AVX2", "DEFAULT", ...
    avx512_bf16: bool | None    # a bfloat16 dot product in AVX-512 registers (vdpbf16ps)
    amx_bf16: bool | None       # AMX tiles with a bfloat16 matrix multiply (Sapphire Rapids and later)
    avx512_vnni: bool | None    # int8 dot products (vpdpbusd)


def cpu_features() -> CpuFeatures:
    flags = _cpu_flags()

    def has(flag: str) -> bool | None:
        return None if flags is None else flag in flags

    return CpuFeatures(torch.backends.cpu.get_cpu_capability(), has("avx512_bf16"), has("amx_bf16"),
                       has("avx512_vnni"))


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def _built() -> ctypes.CDLL:
    """The compiled products, loaded; built at the first call on a machine (kernels/<hash>.so in the cache folder,
    the hash of the source, the flags and this CPU's), or KernelsUnavailable with the reason."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise KernelsUnavailable("no C++ compiler (c++, g++ or $CXX) on this machine")
    key = hashlib.sha256("\n".join([SOURCE.read_text(), compiler, *FLAGS, *sorted(_cpu_flags() or ())]).encode())
    library = settings().cache_dir / "kernels" / f"{key.hexdigest()[:16]}.so"
    if not library.is_file():
        library.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
        os.close(handle)
        try:
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", partial], check=True, capture_output=True,
                           timeout=BUILD_SECONDS)
            os.replace(partial, library)  # whole or not at all, also when two processes build at once
        except (OSError, subprocess.SubprocessError) as failed:
            detail = getattr(failed, "stderr", b"") or b""
            log.error("building %s failed: %s %s", SOURCE.name, failed, detail.decode(errors="replace")[-2000:])
            raise KernelsUnavailable(f"{SOURCE.name} did not build here ({type(failed).__name__})") from None
        finally:
            Path(partial).unlink(missing_ok=True)
    built = ctypes.CDLL(str(library))
    for name, arguments in SIGNATURES.items():
        getattr(built, name).argtypes = arguments
        getattr(built, name).restype = _int if name == "bf16_instructions" else None
    return built


def kernels() -> ctypes.CDLL:
    """The compiled products (see _built); one build at a time in the process."""
    with _build_lock:
        return _built()


def unavailable_reason() -> str | None:
    """None when the products run here, else why not."""
    try:
        kernels()
    except KernelsUnavailable as reason:
        return str(reason)
    return None


def bf16_instructions() -> bool:
    """Whether the bfloat16 product runs on the CPU's own bf16 dot product (else float32 multiply-adds)."""
    return bool(kernels().bf16_instructions())


# -- the layout --------------------------------------------------------------------------------------------------


def blocks_shape(outputs: int, inputs: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The packed weights of an (outputs, inputs) matrix: outputs padded to a multiple of LANES with zeros."""
    blocks = -(-outputs // LANES)
    return (blocks, -(-inputs // 2), LANES, 2) if dtype == torch.bfloat16 else (blocks, inputs, LANES)


def packed_nbytes(outputs: int, inputs: int, dtype: torch.dtype) -> int:
    """Bytes of the packed matrix, int8's float32 scales included, rounded up to ALIGN."""
    shape = blocks_shape(outputs, inputs, dtype)
    n = torch.Size(shape).numel() * dtype.itemsize + (shape[0] * LANES * 4 if dtype == torch.int8 else 0)
    return -(-n // ALIGN) * ALIGN


class Arena:
    """One buffer for the packed weights of a model, taken from in turn; 2 MiB-aligned and advised for transparent
    huge pages on Linux before anything is written to it, so its pages are 2 MiB ones where the kernel has them."""

    def __init__(self, nbytes: int):
        spare = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
        start = -spare.data_ptr() % HUGE_PAGE
        self.buffer = spare[start:start + nbytes]
        self.taken = 0
        if sys.platform == "linux" and nbytes >= HUGE_PAGE:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(self.buffer.data_ptr()), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = torch.Size(shape).numel() * dtype.itemsize
        piece = self.buffer[self.taken:self.taken + n].view(dtype).view(shape)
        self.taken += -(-n // ALIGN) * ALIGN
        return piece


def pack(weight: torch.Tensor, dtype: torch.dtype, arena: Arena) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weight (outputs, inputs) into the arena in `dtype`: float32 and bfloat16 as they round; int8 as round(W / s)
    with one float32 scale per output, s = max|W_row| / 127. Returns the blocks and int8's scales (None otherwise)."""
    outputs, inputs = weight.shape
    shape = blocks_shape(outputs, inputs, dtype)
    padded = torch.zeros(shape[0] * LANES, shape[1] * shape[3] if dtype == torch.bfloat16 else inputs)
    padded[:outputs, :inputs] = weight
    scale = None
    if dtype == torch.int8:
        scale = arena.take((shape[0] * LANES,), torch.float32)
        scale.copy_((padded.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny))
        padded = torch.round(padded / scale[:, None]).clamp(-127, 127)
    blocks = arena.take(shape, dtype)
    if dtype == torch.bfloat16:
        blocks.copy_(padded.view(shape[0], LANES, shape[1], 2).permute(0, 2, 1, 3))
    else:
        blocks.copy_(padded.view(shape[0], LANES, inputs).transpose(1, 2))
    return blocks, scale


def unpack(blocks: torch.Tensor, scale: torch.Tensor | None, start: int, end: int, inputs: int) -> torch.Tensor:
    """Outputs start .. end − 1 of the packed matrix as a dense (end − start, inputs) tensor of its own: float32 and
    bfloat16 as stored, int8 as its float32 values q · s."""
    first = start // LANES
    part = blocks[first:-(-end // LANES)]
    if part.dtype == torch.bfloat16:
        dense = part.permute(0, 2, 1, 3).reshape(part.shape[0] * LANES, -1)
    else:
        dense = part.transpose(1, 2).reshape(part.shape[0] * LANES, inputs)
    dense = dense[start - first * LANES:end - first * LANES, :inputs]
    return dense * scale[start:end, None] if scale is not None else dense.contiguous()


def gather_rows(blocks: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor, inputs: int) -> torch.Tensor:
    """Rows `ids` of the packed matrix, (…, inputs): an embedding lookup in a tied LM head's weights."""
    flat = ids.reshape(-1)
    if blocks.dtype == torch.bfloat16:
        rows = blocks[flat // LANES, :, flat % LANES, :].reshape(flat.numel(), -1)[:, :inputs]
    else:
        rows = blocks[flat // LANES, :, flat % LANES]
    if scale is not None:
        rows = rows * scale[flat, None]
    return rows.reshape(*ids.shape, inputs)


def matmul(x: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x (rows, inputs), contiguous, times the packed matrix: (rows, padded outputs), in x's dtype, on torch's
    threads."""
    built = kernels()
    rows, inputs = x.shape
    y = x.new_empty(rows, blocks.shape[0] * LANES)
    threads = torch.get_num_threads()
    if blocks.dtype == torch.bfloat16:
        built.matmul_bf16(x.data_ptr(), rows, inputs, blocks.data_ptr(), blocks.shape[0], y.data_ptr(), threads)
    elif blocks.dtype == torch.int8:
        built.matmul_int8(x.data_ptr(), rows, inputs, blocks.data_ptr(), scale.data_ptr(), blocks.shape[0],
                          y.data_ptr(), threads)
    else:
        built.matmul_f32(x.data_ptr(), rows, inputs, blocks.data_ptr(), blocks.shape[0], y.data_ptr(), threads)
    return y
