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
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model.weights.catalog import settings

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
# this CPU's vector instructions; a*b + c as one fused multiply-add everywhere (the same bits in every tile)
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c++20", "-fopenmp", "-shared", "-fPIC")
BUILD_SECONDS = 60  # the build took about 1.3 s on this 2-core Xeon; past this the compiler is taken as hung
LANES = 16          # outputs in a block (kernels.cpp)
BLOCKS = 4          # blocks in a panel
ALIGN = 64          # bytes: each packed matrix starts on a cache line
HUGE_PAGE = 2**21   # bytes of a transparent huge page on x86-64 and arm64 Linux
MADV_HUGEPAGE = 14  # linux/mman.h
PROFILED = "decode_lab::"  # the kernels' ops in torch's profiler, each a mark of its own (profiled)

_build_lock = threading.Lock()
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
SIGNATURES = {"matmul_f32": (_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int),
              "matmul_int8": (_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _int),
              "matmul_bf16": (_ptr, _i64, _i64, _ptr, _i64, _ptr, _int),
              "matmul_bf16w": (_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int),
              "rms_norm": (_ptr, _i64, _i64, _ptr, ctypes.c_float, _int, _ptr),
              "attend_one": (_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                             ctypes.c_float, _ptr, _ptr),
              "attend_spans": (_ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64,
                               _i64, _ptr, _ptr, ctypes.c_float, _ptr, _ptr, _int),
              "attend_paged": (_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr,
                               _ptr, ctypes.c_float, _ptr, _int),
              "decode_in": (_ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _int),
              "decode_out": (_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _int),
              "layer_paged": (_ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr,
                              _ptr, _ptr, _ptr, _int),
              "silu_mul": (_ptr, _i64, _i64, _i64, _ptr),
              "op_seconds": (_ptr,), "bf16_instructions": (), "int8_instructions": ()}


class KernelsUnavailable(RuntimeError):
    """The products cannot be built here; the message says why (for the server log and the facts)."""


@dataclass(frozen=True)
class CpuFeatures:
    """What this CPU offers for the products, as Linux lists its flags in /proc/cpuinfo (None: not known, no
    /proc/cpuinfo to read)."""
    vector: str                 # torch's widest vector kernels here: "AVX512", "AVX2", "DEFAULT", ...
    avx512_bf16: bool | None    # a bfloat16 dot product in AVX-512 registers (vdpbf16ps)
    amx_bf16: bool | None       # AMX tiles with a bfloat16 matrix multiply (Sapphire Rapids and later)
    amx_tile: bool | None       # the AMX tile registers themselves
    avx512_vnni: bool | None    # int8 and int16 dot products in AVX-512 registers (vpdpbusd, vpdpwssd)
    avx_vnni: bool | None       # the same dot products in 256-bit registers only (Alder Lake and later)


def cpu_features(flags: frozenset[str] | None = None) -> CpuFeatures:
    """This CPU's features (flags None: read from /proc/cpuinfo; a set: those flags, as on another machine)."""
    flags = _cpu_flags() if flags is None else flags

    def has(flag: str) -> bool | None:
        return None if flags is None else flag in flags

    return CpuFeatures(torch.backends.cpu.get_cpu_capability(), has("avx512_bf16"), has("amx_bf16"),
                       has("amx_tile"), has("avx512_vnni"), has("avx_vnni"))


@dataclass(frozen=True)
class MachineProducts:
    """What this CPU offers and how each dtype's products run on it (bf16_products, int8_products)."""
    cpu: CpuFeatures
    bf16: str
    int8: str


def machine_products() -> MachineProducts:
    return MachineProducts(cpu_features(), bf16_products(), int8_products())


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform's guess: printed beside every timing."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def compiler() -> str | None:
    """The C++ compiler the kernels are built with: $CXX where set (None when it names no program), else c++ or g++
    on the PATH."""
    named = os.environ.get("CXX")
    return shutil.which(named) if named else shutil.which("c++") or shutil.which("g++")


@functools.cache
def _built() -> ctypes.CDLL | KernelsUnavailable:
    """The compiled products, loaded; built at the first call on a machine (kernels/<hash>.so in the cache folder,
    the hash of the source, the flags and this CPU's; where the cache folder cannot hold it, in a temporary folder
    deleted again once the library is loaded), or the KernelsUnavailable with the reason: any failure to build or load
    the library (no compiler, a build that fails or hangs, a folder that cannot be written, a damaged library), so
    that models then multiply with torch's product. The failure is returned, not raised, so that the cache keeps it
    for the process: a compiler that hangs holds one load for BUILD_SECONDS, not every later one."""
    program = compiler()
    if program is None:
        return KernelsUnavailable("no C++ compiler (c++, g++ or $CXX) on this machine")
    name = library_name(program)
    library = settings().cache_dir / "kernels" / name
    try:
        if not library.is_file():
            library = _build(program, library)
        return _loaded(library)
    except KernelsUnavailable as failed:
        return failed
    except OSError as failed:  # a read-only cache folder, a library cut short or made for another machine
        log.warning("the kernels at %s cannot be used (%s); building them in a temporary folder", library, failed)
    folder = Path(tempfile.mkdtemp(prefix="decode-lab-kernels-"))
    try:  # a loaded library stays mapped once its file is gone (Linux, macOS): nothing is left behind
        return _loaded(_build(program, folder / name))
    except KernelsUnavailable as failed:
        return failed
    except OSError as failed:
        log.error("the kernels cannot be built or loaded here: %s", failed)
        return KernelsUnavailable(f"{SOURCE.name} cannot be built or loaded here ({type(failed).__name__})")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def build_ahead() -> bool:
    """Whether the next kernels() call may compile the kernels (a wait of up to BUILD_SECONDS): this process has not
    settled them yet and the cache folder holds no library for this machine. A page says so while a model loads."""
    if _built.cache_info().currsize:
        return False
    program = compiler()
    return program is not None and not (settings().cache_dir / "kernels" / library_name(program)).is_file()


def library_name(program: str) -> str:
    """The library's file name: a hash of the source, the compiler, the flags and this CPU's."""
    key = hashlib.sha256("\n".join([SOURCE.read_text(), program, *FLAGS, *sorted(_cpu_flags() or ())]).encode())
    return f"{key.hexdigest()[:16]}.so"


def _build(program: str, library: Path) -> Path:
    """kernels.cpp compiled into `library` (whole or not at all, also when two processes build at once); OSError
    where the folder cannot take it, KernelsUnavailable where the compiler fails or runs past BUILD_SECONDS."""
    library.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(handle)
    log.warning("building the decode kernels (%s, once per machine; at most %d s)…", SOURCE.name, BUILD_SECONDS)
    try:
        subprocess.run([program, *FLAGS, str(SOURCE), "-o", partial], check=True, capture_output=True,
                       timeout=BUILD_SECONDS)
        os.replace(partial, library)
    except (OSError, subprocess.SubprocessError) as failed:
        detail = getattr(failed, "stderr", b"") or b""
        log.error("building %s failed: %s %s", SOURCE.name, failed, detail.decode(errors="replace")[-2000:])
        raise KernelsUnavailable(f"{SOURCE.name} did not build here ({type(failed).__name__})") from None
    finally:
        Path(partial).unlink(missing_ok=True)
    return library


def _loaded(library: Path) -> ctypes.CDLL:
    built = ctypes.CDLL(str(library))
    for name, arguments in SIGNATURES.items():
        getattr(built, name).argtypes = arguments
        getattr(built, name).restype = _int if name.endswith("_instructions") else None
    return built


def kernels() -> ctypes.CDLL:
    """The compiled products (see _built); one build at a time in the process; KernelsUnavailable where they cannot
    be had (a new exception each time, the remembered one's reason)."""
    with _build_lock:
        built = _built()
    if isinstance(built, KernelsUnavailable):
        raise KernelsUnavailable(str(built))
    return built


def unavailable_reason() -> str | None:
    """None when the products run here, else why not."""
    try:
        kernels()
    except KernelsUnavailable as reason:
        return str(reason)
    return None


def bf16_products() -> str:
    """How a bfloat16 product runs on this machine: "avx512_bf16" (the decode kernels on the CPU's own bf16 dot
    product, vdpbf16ps), "float32" (the decode kernels, each pair of bf16 numbers multiplied in float32 registers:
    the CPU has no bf16 instruction, or the compiler did not use it), "torch" (the kernels do not build: torch's own
    product)."""
    if unavailable_reason() is not None:
        return "torch"
    return "avx512_bf16" if kernels().bf16_instructions() else "float32"


def int8_products() -> str:
    """How an int8 product runs on this machine: "avx512_vnni" (the decode kernels on the CPU's own int16 dot product,
    vpdpwssd), "integer" (the decode kernels, whole-number multiply-adds: the same numbers, slower), "none" (the
    kernels do not build: int8 is refused)."""
    if unavailable_reason() is not None:
        return "none"
    return "avx512_vnni" if kernels().int8_instructions() else "integer"


# -- the layout --------------------------------------------------------------------------------------------------

# inputs side by side per output in the layout: float32 one, bfloat16 and int8 a pair (vdpbf16ps, vpdpwssd)
SIDE_BY_SIDE = {torch.float32: 1, torch.bfloat16: 2, torch.int8: 2}


@dataclass(frozen=True)
class Shape:
    """Where a packed (outputs, inputs) matrix's numbers lie (kernels.cpp): blocks of LANES outputs, panels of BLOCKS
    blocks (the last panel may hold fewer), within a panel input by input (by `side` inputs side by side)."""
    outputs: int
    inputs: int
    dtype: torch.dtype

    @property
    def side(self) -> int:
        return SIDE_BY_SIDE[self.dtype]

    @property
    def steps(self) -> int:
        """The inputs' steps of `side`, the last one filled up with zeros."""
        return -(-self.inputs // self.side)

    @property
    def blocks(self) -> int:
        return -(-self.outputs // LANES)

    @property
    def numel(self) -> int:
        return self.blocks * LANES * self.steps * self.side

    @property
    def nbytes(self) -> int:
        """Bytes of the packed matrix, int8's scale per output included, rounded up to ALIGN."""
        extra = 4 * self.blocks * LANES if self.dtype == torch.int8 else 0
        return -(-(self.numel * self.dtype.itemsize + extra) // ALIGN) * ALIGN

    def panels(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The flat numbers as (panels, steps, blocks in a panel, LANES, side) views: the full panels, then the
        short last one if any."""
        full, rest = divmod(self.blocks, BLOCKS)
        per_panel = BLOCKS * LANES * self.steps * self.side
        views = [flat[:full * per_panel].view(full, self.steps, BLOCKS, LANES, self.side)]
        if rest:
            views.append(flat[full * per_panel:].view(1, self.steps, rest, LANES, self.side))
        return views


def packed_nbytes(outputs: int, inputs: int, dtype: torch.dtype) -> int:
    return Shape(outputs, inputs, dtype).nbytes


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

    def take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """n numbers of `dtype`, starting on a cache line."""
        if self.taken + n * dtype.itemsize > self.buffer.numel():
            raise ValueError(f"the arena holds {self.buffer.numel():,} B; {self.taken + n * dtype.itemsize:,} asked")
        piece = self.buffer[self.taken:self.taken + n * dtype.itemsize].view(dtype)
        self.taken += -(-n * dtype.itemsize // ALIGN) * ALIGN
        return piece


@dataclass
class Packed:
    """A packed matrix: its shape, its numbers (a flat view into an arena) and, for int8, each output's float32
    scale."""
    shape: Shape
    flat: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.flat, self.scale) if t is not None)


def pack(weight: torch.Tensor, dtype: torch.dtype, arena: Arena) -> Packed:
    """weight (outputs, inputs) into the arena in `dtype`: float32 and bfloat16 as they round; int8 as round(W / s)
    with one float32 scale per output, s = max|W_row| / 127."""
    shape = Shape(*weight.shape, dtype)
    values = weight
    if (shape.blocks * LANES, shape.steps * shape.side) != tuple(weight.shape):
        values = weight.new_zeros(shape.blocks * LANES, shape.steps * shape.side)
        values[:shape.outputs, :shape.inputs] = weight
    scale = None
    if dtype == torch.int8:
        scale = arena.take(shape.blocks * LANES, torch.float32)
        scale.copy_((values.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny))
        values = torch.round(values / scale[:, None]).clamp_(-127, 127)
    flat = arena.take(shape.numel, dtype)
    first = 0
    for panel in shape.panels(flat):  # each (panels, steps, blocks, LANES, side) from the matrix's rows
        n = panel.shape[0] * panel.shape[2] * LANES
        panel.copy_(values[first:first + n].view(panel.shape[0], panel.shape[2], LANES, shape.steps, shape.side)
                    .permute(0, 3, 1, 2, 4))
        first += n
    return Packed(shape, flat, scale)


def unpack(packed: Packed, start: int, end: int) -> torch.Tensor:
    """Outputs start .. end − 1 of the packed matrix as a dense (end − start, inputs) tensor of its own: float32 and
    bfloat16 as stored, int8 as its float32 values q · s."""
    shape = packed.shape
    dense = torch.cat([panel.permute(0, 2, 3, 1, 4).reshape(-1, shape.steps * shape.side)
                       for panel in shape.panels(packed.flat)])[start:end, :shape.inputs]
    return dense * packed.scale[start:end, None] if packed.scale is not None else dense.contiguous()


def gather_rows(packed: Packed, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the packed matrix, (…, inputs): an embedding lookup in a tied LM head's weights (int8: q · s)."""
    shape, flat = packed.shape, ids.reshape(-1)
    panels = shape.panels(packed.flat)
    per_panel = BLOCKS * LANES
    panel, block, lane = flat // per_panel, flat % per_panel // LANES, flat % LANES
    if len(panels) == 1:
        rows = panels[0][panel, :, block, lane]                               # (n, steps, side)
    else:  # ids in the short last panel
        rows = packed.flat.new_empty(flat.numel(), shape.steps, shape.side)
        last = panel == panels[0].shape[0]
        rows[~last] = panels[0][panel[~last], :, block[~last], lane[~last]]
        rows[last] = panels[1][torch.zeros_like(block[last]), :, block[last], lane[last]]
    rows = rows.reshape(flat.numel(), -1)[:, :shape.inputs]
    if packed.scale is not None:
        rows = rows * packed.scale[flat, None]
    return rows.reshape(*ids.shape, shape.inputs)


def profiled(name: str | Callable[..., str]):
    """The kernel op `f` as an op of its own under torch's profiler, named PROFILED + name (or + name(*its
    arguments)); outside the profiler, the call alone."""
    def wrap(f):
        @functools.wraps(f)
        def op(*args):
            if torch.autograd._profiler_enabled():
                with torch.profiler.record_function(PROFILED + (name if isinstance(name, str) else name(*args))):
                    return f(*args)
            return f(*args)
        return op
    return wrap


@profiled(lambda x, packed: "matmul_" + str(packed.shape.dtype).removeprefix("torch."))
def matmul(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """x (…, inputs), contiguous, times the packed matrix: (…, 16 · blocks), in x's dtype, on torch's threads (the
    rows of x are all its numbers but the last dimension's; no reshape before or view after, a µs each of 121
    products in a decode step)."""
    built = kernels()
    inputs = x.shape[-1]
    rows = x.numel() // inputs
    blocks = packed.shape.blocks
    y = x.new_empty((*x.shape[:-1], blocks * LANES))
    threads = torch.get_num_threads()
    if packed.shape.dtype == torch.bfloat16 and x.dtype == torch.float32:  # bfloat16 weights, float32 arithmetic
        built.matmul_bf16w(x.data_ptr(), rows, inputs, packed.flat.data_ptr(), blocks, y.data_ptr(), None, threads)
    elif packed.shape.dtype == torch.bfloat16:
        built.matmul_bf16(x.data_ptr(), rows, inputs, packed.flat.data_ptr(), blocks, y.data_ptr(), threads)
    elif packed.shape.dtype == torch.int8:
        built.matmul_int8(x.data_ptr(), rows, inputs, packed.flat.data_ptr(), packed.scale.data_ptr(), blocks,
                          y.data_ptr(), None, threads)
    else:
        built.matmul_f32(x.data_ptr(), rows, inputs, packed.flat.data_ptr(), blocks, y.data_ptr(), None, threads)
    return y


@profiled("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool) -> torch.Tensor:
    """RMSNorm of each row of x (…, n), float32, in one pass (kernels.cpp): x / rms(x) · w, or · (1 + w) (Gemma's).
    A step's 61 norms as torch's seven small ops each took about 2 ms of SmolLM2's 27 ms decode step here."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    kernels().rms_norm(x.data_ptr(), x.numel() // n, n, weight.data_ptr(), eps, int(plus_one), y.data_ptr())
    return y


@profiled("attend_one")
def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ / scale)·v for one query per row, float32, in one op (kernels.cpp): q (B, n_heads, 1, d_head), k
    and v (B, n_kv, S, d_head) as they lie in the cache (each position's d_head numbers side by side, k and v at the
    same strides) -> out (B, 1, n_heads·d_head), weights (B, n_heads, 1, S)."""
    B, n_heads, _, d_head = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    out = q.new_empty(B, 1, n_heads * d_head)
    weights = q.new_empty(B, n_heads, 1, S)
    kernels().attend_one(q.data_ptr(), B, n_heads, d_head, q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),
                         n_kv, S, k.stride(0), k.stride(1), k.stride(2), scale, out.data_ptr(), weights.data_ptr())
    return out, weights


@profiled("attend_spans")
def attend_spans(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: torch.Tensor, end: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ / scale)·v for T queries per row, query t over keys first[t] .. end[t] − 1 alone, float32, in
    one op (kernels.cpp): each query as attend_one attends a decode step's, so a position comes out with the same bits
    in a prefill, a chunk of it or a decode step. q (B, n_heads, T, d_head), k and v (B, n_kv, S, d_head) at the same
    strides, first and end (T,) int64 -> out (B, T, n_heads·d_head), weights (B, n_heads, T, S), 0 outside a query's
    keys."""
    B, n_heads, T, d_head = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    out = q.new_empty(B, T, n_heads * d_head)
    weights = q.new_empty(B, n_heads, T, S)
    kernels().attend_spans(q.data_ptr(), B, n_heads, T, d_head, q.stride(0), q.stride(1), q.stride(2), k.data_ptr(),
                           v.data_ptr(), n_kv, S, k.stride(0), k.stride(1), k.stride(2), first.data_ptr(),
                           end.data_ptr(), scale, out.data_ptr(), weights.data_ptr(), torch.get_num_threads())
    return out, weights


@profiled("attend_paged")
def attend_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, row: torch.Tensor,
                 first: torch.Tensor, end: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·kᵀ / scale)·v for a flattened pass's N queries, float32, in one op (kernels.cpp), each query over
    positions first[t] .. end[t] − 1 of its request's keys read in place through its block table (no gather copy),
    each as attend_head attends a contiguous copy of them: the bits of attend_one's decode step and attend_spans'
    prefill. q (1, n_heads, N, d_head) (d_head's numbers side by side); k and v one layer's stores (n_kv, n_blocks,
    block_size, d_head), contiguous; tables (requests, width) int64 block ids by position // block_size; row, first,
    end (N,) int64: each query's row of tables and its span of positions -> out (1, N, n_heads·d_head)."""
    _, n_heads, N, d_head = q.shape
    n_kv, n_blocks, block_size = k.shape[0], k.shape[1], k.shape[2]
    out = q.new_empty(1, N, n_heads * d_head)
    kernels().attend_paged(q.data_ptr(), N, n_heads, d_head, q.stride(1), q.stride(2), k.data_ptr(), v.data_ptr(),
                           n_kv, n_blocks, block_size, tables.data_ptr(), tables.shape[1], row.data_ptr(),
                           first.data_ptr(), end.data_ptr(), scale, out.data_ptr(), torch.get_num_threads())
    return out


# -- where the time goes ------------------------------------------------------------------------------------------

OP_CLASSES = ("products", "attention", "small_ops")  # kernels.cpp's OpClass, in its order
_tile_seconds = threading.local()  # this thread's seconds in tile products (torch's, llama.PackedWeight)


def op_seconds() -> dict[str, float]:
    """This thread's running seconds by OP_CLASSES: the kernels' products (and the tile products torch runs for them,
    add_tile_seconds), their attention, and their small ops (norms, RoPE, SiLU); the difference of two readings is
    what ran between them. Zeros where the kernels do not run: a model's whole time is then torch's."""
    totals = (ctypes.c_double * 3)()
    if unavailable_reason() is None:
        kernels().op_seconds(totals)
    return dict(zip(OP_CLASSES, (totals[0] + getattr(_tile_seconds, "total", 0.0), totals[1], totals[2])))


def add_tile_seconds(seconds: float) -> None:
    _tile_seconds.total = getattr(_tile_seconds, "total", 0.0) + seconds


# -- a decode step's layer ----------------------------------------------------------------------------------------

class Matrix(ctypes.Structure):
    """One product's packed weights as decode_in and decode_out read them (kernels.cpp's struct Matrix)."""
    _fields_ = [("w", _ptr), ("scale", _ptr), ("blocks", _i64), ("kind", _i64)]


class Layer(ctypes.Structure):
    """What decode_in and decode_out read of a Llama block (kernels.cpp's struct Layer)."""
    _fields_ = [("norm_in", _ptr), ("norm_out", _ptr), ("qkv", Matrix), ("o", Matrix), ("gate_up", Matrix),
                ("down", Matrix), ("hidden", _i64), ("intermediate", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("d_head", _i64), ("plus_one", _i64), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


MATRIX_KINDS = {torch.float32: 0, torch.int8: 1, torch.bfloat16: 2}  # kernels.cpp's Matrix.kind


def _matrix(packed: Packed) -> Matrix:
    return Matrix(packed.flat.data_ptr(), packed.scale.data_ptr() if packed.scale is not None else None,
                  packed.shape.blocks, MATRIX_KINDS[packed.shape.dtype])


class DecodeLayer:
    """A Llama block's weights as decode_in and decode_out read them: a Layer of pointers into the shared model's
    norms and packed products, which it keeps alive. A copy of the block (deepcopy) gets None: its weights are its
    own (pack_linears makes its DecodeLayer anew)."""

    def __init__(self, norm_in: torch.Tensor, norm_out: torch.Tensor, plus_one: bool, eps: float, qkv: Packed,
                 o: Packed, gate_up: Packed, down: Packed, heads: int, kv_heads: int, d_head: int, scale: float):
        self.layer = Layer(norm_in.data_ptr(), norm_out.data_ptr(), _matrix(qkv), _matrix(o), _matrix(gate_up),
                           _matrix(down), o.shape.outputs, down.shape.inputs, heads, kv_heads, d_head, int(plus_one),
                           eps, scale)
        self.pointed_at = (norm_in, norm_out, qkv, o, gate_up, down)

    def __deepcopy__(self, memo):
        return None


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """cos and sin (B or 1 rows of d numbers) as decode_in's kernel reads them, (rows, d), and their row stride (0:
    one row for every row of x). The caller holds the tensors while the kernel reads them (a reshape may copy)."""
    cos, sin = cos.reshape(-1, d), sin.reshape(-1, d)
    return cos, sin, d if cos.shape[0] > 1 else 0


@profiled("decode_in")
def decode_in(decode: DecodeLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, 1, hidden) -> the q, k and v heads (B, 1, heads + 2·kv_heads, d_head), q and k turned by RoPE at cos and
    sin (B or 1 rows of d_head numbers): norm, product and RoPE in one op."""
    layer = decode.layer
    B, d = x.shape[0], layer.d_head
    qkv = x.new_empty(B, 1, layer.heads + 2 * layer.kv_heads, d)
    cos, sin, cs_row = rope_rows(cos, sin, d)
    kernels().decode_in(ctypes.byref(layer), x.data_ptr(), B, cos.data_ptr(), sin.data_ptr(), cs_row, qkv.data_ptr(),
                        torch.get_num_threads())
    return qkv


@profiled("decode_out")
def decode_out(decode: DecodeLayer, x: torch.Tensor, qkv: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               first: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of the layer in one op: attention of each row's query (in qkv) over its keys first[r] .. end[r] − 1
    of k and v (B, kv_heads, S, d_head), the output product plus the residual, the second norm, the gate/up product,
    silu_mul, the down product plus the residual -> the block's output (B, 1, hidden) and the attention weights (B,
    heads, 1, S), 0 outside a row's keys."""
    layer = decode.layer
    B, S = x.shape[0], k.shape[2]
    out, weights = torch.empty_like(x), x.new_empty(B, layer.heads, 1, S)
    kernels().decode_out(ctypes.byref(layer), x.data_ptr(), B, qkv.data_ptr(), k.data_ptr(), v.data_ptr(),
                         k.stride(0), k.stride(1), k.stride(2), first.data_ptr(), end.data_ptr(), S,
                         weights.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out, weights


@profiled("layer_paged")
def layer_paged(decode: DecodeLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, tables: torch.Tensor, row: torch.Tensor,
                first: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """A layer of a flattened pass's N positions (x (N, 1, hidden)) over a paged pool, in one op: decode_in, each
    position's new key and value written into its block (blocks, offsets (N,) int64) of the layer's stores k and v,
    the attention as attend_paged's (tables, row, first and end as there), then the rest of the layer as
    decode_out's -> the block's output (N, 1, hidden)."""
    layer = decode.layer
    out = torch.empty_like(x)
    cos, sin, cs_row = rope_rows(cos, sin, layer.d_head)
    kernels().layer_paged(ctypes.byref(layer), x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(), cs_row,
                          k.data_ptr(), v.data_ptr(), blocks.data_ptr(), offsets.data_ptr(), k.shape[1], k.shape[2],
                          tables.data_ptr(), tables.shape[1], row.data_ptr(), first.data_ptr(), end.data_ptr(),
                          out.data_ptr(), torch.get_num_threads())
    return out


@profiled("silu_mul")
def silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """SiLU(gate) · up of float32 gate_up (…, 2·width: gate, then up; its rows at any stride, their numbers side by
    side) -> (…, width), in one op (kernels.cpp): the shared model's SwiGLU, each number the same bits wherever it
    lies (torch's SiLU finishes a row's last width mod 16 numbers another way than the rest), within 3 float32 ulps
    of the exact value."""
    rows = gate_up.flatten(0, -2)  # a view where the rows lie at one stride (a packed product's output, sliced)
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    kernels().silu_mul(rows.data_ptr(), rows.shape[0], width, rows.stride(0), out.data_ptr())
    return out
