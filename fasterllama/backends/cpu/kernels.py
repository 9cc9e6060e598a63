"""The C kernels of csrc/cpu_kernels.c: built once per machine with the system C compiler, loaded
with ctypes, and registered as the CPU versions of the op layer's matmuls.

Why C: at decode time every linear is a matrix-vector product that must stream its weights at
memory speed on all cores; MKL's fp32 GEMV uses one core for these shapes and torch has no fast
AVX2 kernel for 4-bit or int8 weights with float activations. The build takes about a minute and
is cached (FASTERLLAMA_CACHE, default ~/.cache/fasterllama; where that cannot be written, each
process builds its own copy in a temporary folder). Without a compiler or AVX2, or with
FASTERLLAMA_NO_COMPILE=1, `load()` returns None and the PyTorch reference ops run instead."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from ...ops import quantized, reference

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
# -ffp-contract=off: scalar code rounds as written (as torch does), FMAs only where intrinsics ask
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]  # + FASTERLLAMA_CFLAGS, e.g. -mno-avx512f
WEIGHT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # float weights the GEMVs read (csrc: W_F32, W_F16, W_BF16)
GEMV_MAX_ROWS = 16  # up to this many activation rows the GEMV kernels (weights streamed once); beyond, the GEMM

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "fl_panel_linear": [_P, _I, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _P],
    "fl_panel_gemm": [_P, _I, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _P],
    "fl_panel_gemm_a8": [_P, _I, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _P],
    "fl_panel_rows": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _P, _I, _P],
    "fl_float_linear": [_P, _I, _I, _P, _I, _I, _P],
    "fl_rms_norm": [_P, _P, ctypes.c_float, _I, _I, _P],
    "fl_silu_and_mul": [_P, _I, _I, _P],
    "fl_add_rms_norm": [_P, _P, _P, ctypes.c_float, _I, _I, _P, _P],
    "fl_argmax_rows": [_P, _I, _I, _P],
    "fl_sample_rows": [_P, _I, _I, _P, _P, _P, _P, _P, _P, _P],
    "fl_rope_store_kv": [_P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _I, _I, _I, _P],
    "fl_decode_attention": [_P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float, _P],
    "fl_prefill_attention": [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float, _P],
    "fl_w8a8_linear": [_P, _P, _I, _I, _P, _P, _P, _I, _P, _P],
    "fl_quantize_rows": [_P, _I, _I, _P, _I, _P, _P],
    "fl_search_scale_min": [_P, _P, _I, _I, _I, ctypes.c_float, ctypes.c_float, _I, _I, _P, _P, _P],
    "fl_decode_forward": [_P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float, _P, _P, _P, _P, _I, _P, _I, _P, _P, _I, _P, _P, _P, _P, _P, _P, _P],
}
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_signature() -> str:
    """Flags of this CPU: -march=native code must not be reused on a different CPU."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return os.uname().machine


def _cache_dir() -> Path:
    base = os.environ.get("FASTERLLAMA_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "fasterllama")
    return Path(base)


def _compile(cc: str, flags: list[str], source: Path, out: Path) -> None:
    proc = subprocess.run([cc, *flags, str(source), "-o", str(out), "-lm"], check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "compiler failed")


def compiler() -> tuple[str, list[str]]:
    """The C compiler ($CC, else gcc or cc) and the library's flags (CFLAGS + $FASTERLLAMA_CFLAGS)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler found")
    return cc, CFLAGS + os.environ.get("FASTERLLAMA_CFLAGS", "").split()


@contextlib.contextmanager
def _one_builder(folder: Path) -> Iterator[None]:
    """Held while building into `folder`: processes starting together (pytest-xdist workers, a
    tensor-parallel group, two servers) wait for one build instead of each compiling its own."""
    with open(folder / "build.lock", "a") as fh:
        try:
            import fcntl

            fcntl.flock(fh, fcntl.LOCK_EX)
        except (ImportError, OSError):  # (no flock here: each builds, as before)
            pass
        yield


def _build(cc: str, flags: list[str], source: Path, out: Path) -> None:
    """Compile, saying so first: -O3 over every row-count variant of the kernels takes a minute or
    more (78 s on a 2-core AVX2 VM), once per machine and kernel version."""
    log.warning("fasterllama: building the C kernels for this CPU (once per machine and version: about a minute)")
    _compile(cc, flags, source, out)


def _build_and_open(source: Path) -> ctypes.CDLL:
    """The library of `source` from the cache, built into it first if missing. Where the cache
    cannot be written (read-only home, permission denied) it is built in a temporary folder,
    removed once loaded: a minute of compiling per process beats the ~5x slower PyTorch ops."""
    cc, flags = compiler()
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with _one_builder(target.parent):
                if not target.exists():  # (another process may have built it while this one waited)
                    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                        out = Path(tmp) / target.name
                        _build(cc, flags, source, out)
                        os.replace(out, target)  # atomic: a process not waiting on the lock never loads a half-written file
        except OSError as exc:
            log.warning("fasterllama: kernel cache %s is not writable (%s); building the C kernels in a temporary "
                        "folder (set FASTERLLAMA_CACHE to a writable folder to keep them)", target.parent, exc)
            with tempfile.TemporaryDirectory(prefix="fasterllama-") as tmp:
                out = Path(tmp) / target.name
                _build(cc, flags, source, out)
                return ctypes.CDLL(str(out))  # mapped now: the file may go with its folder
    return ctypes.CDLL(str(target))


def open_library(source: Path) -> ctypes.CDLL:
    """Build (or find in the cache) and open the library of a kernel source file: SOURCE for the
    engine, an edited copy for benchmarks/ab_kernels.py."""
    lib = _build_and_open(source)
    for name, argtypes in _SIGNATURES.items():
        if source != SOURCE and not hasattr(lib, name):  # an older source (an A/B baseline) lacks newer kernels
            continue
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    lib.fl_vector_lanes.argtypes, lib.fl_vector_lanes.restype = [], ctypes.c_int64
    lib.fl_gemv_x_block.argtypes, lib.fl_gemv_x_block.restype = [_I, _I, _I], ctypes.c_int64
    lib.fl_value_lanes.argtypes, lib.fl_value_lanes.restype = [], ctypes.c_int64
    return lib


_WITHOUT_KERNELS = "the same results 10-20x slower (GGUF and 16-bit weights load as fp32 floats)"


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None where it cannot run (then torch ops run)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("FASTERLLAMA_NO_COMPILE") == "1":
        log.warning("fasterllama: C kernels off (FASTERLLAMA_NO_COMPILE=1); using PyTorch ops, %s", _WITHOUT_KERNELS)
        return None
    try:
        _lib = open_library(SOURCE)
    except Exception as exc:  # no compiler, no AVX2...: the reference ops are correct
        log.warning("fasterllama: C kernels unavailable (%s); using PyTorch ops, %s", exc, _WITHOUT_KERNELS)
    return _lib


@functools.cache
def _onednn_linear() -> Callable | None:
    """oneDNN's fp32 linear, where torch has it (probed on first use: a model of quantized weights
    never needs it, and the probe alone maps ~6 MB of torch's code). torch's default CPU sgemm is MKL's, and MKL runs
    AVX2 code on AMD CPUs: on this project's Zen 5 machine oneDNN's AVX-512 GEMM is 2.0-2.5x faster
    at prefill shapes (benchmarks/gemm_cpu.py). Same fp32 arithmetic, another summation order."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    if op is None:
        return None
    try:
        x, w, b = torch.ones(2, 4), torch.ones(3, 4), torch.ones(3)
        if torch.equal(op(x, w, b, "none", [], ""), torch.full((2, 3), 5.0)):
            return lambda x, w, b: op(x, w, b, "none", [], "")
    except RuntimeError:
        pass
    return None



WIDEN_BYTES = 32 << 20  # a 16-bit matrix widens to fp32 for a GEMM this many bytes of rows at a time
_scratch = threading.local()


def _widened(weight: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows lo:hi of a 16-bit matrix in fp32, in a buffer this thread reuses call after call: a
    fresh one page-faults on every call (a 46 MB block widened in 15-18 ms, against 2.8 into the
    warm buffer)."""
    need = (hi - lo) * weight.shape[1]
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < need:
        buf = _scratch.buf = torch.empty(need, dtype=torch.float32)
    return buf[:need].view(hi - lo, weight.shape[1]).copy_(weight[lo:hi])


def sgemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) in fp32 for many rows (prefill); F.linear where oneDNN is missing or autograd is on.
    A 16-bit W (a checkpoint's fp16/bf16 matrix kept as stored) widens exactly to fp32 a block of
    rows at a time: the fp32 copy's products, without ever holding that copy."""
    if weight.dtype in WEIGHT_TYPES and weight.dtype != x.dtype and x.dtype == torch.float32:
        n, k = weight.shape
        rows = max(1, WIDEN_BYTES // (4 * k))
        if rows >= n:
            return sgemm(x, _widened(weight, 0, n), bias)
        out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            out[..., lo:hi] = sgemm(x, _widened(weight, lo, hi), None if bias is None else bias[lo:hi])
        return out
    if x.dtype == weight.dtype == torch.float32 and not (x.requires_grad or weight.requires_grad) and _onednn_linear() is not None:
        return _onednn_linear()(x, weight, bias)
    return F.linear(x, weight, bias)


INT8_GEMM_CHUNK = 1024  # 128 * 128 * 1024 = 2^24: every partial sum of a chunk's int8 products is an exact fp32 integer


def int8_gemm_via_fp32(xq: torch.Tensor, qweight_t: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] x int8 [K, N] -> exact int32 [M, N] by fp32 GEMMs over chunks of K. Where the CPU
    has no VNNI, torch._int_mm runs a scalar loop: ~3.6 G multiply-adds a second on a Zen 1 EPYC,
    0.25 s for one 512-row projection of the default model, against ~35 through oneDNN's fp32
    GEMM. A chunk's products sum to at most 2^24 in magnitude, so its fp32 result is exact
    whatever the summation order, and the chunks add in int32."""
    acc = None
    for k0 in range(0, xq.shape[1], INT8_GEMM_CHUNK):
        k1 = k0 + INT8_GEMM_CHUNK
        part = sgemm(xq[:, k0:k1].float(), qweight_t[k0:k1].t().float()).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc


def has_vnni() -> bool:
    """Whether the CPU has 8-bit dot-product instructions (AVX-512 VNNI or AVX-VNNI), which
    torch._int_mm's oneDNN kernels use."""
    flags = _cpu_signature().split()
    return "avx512_vnni" in flags or "avx_vnni" in flags


def _usable(x: torch.Tensor, k: int) -> bool:
    return _lib is not None and x.dtype == torch.float32 and k % 32 == 0 and not x.requires_grad


def _half(x: torch.Tensor) -> bool:
    """A bf16/fp16 x the quantized-weight kernels take in fp32 (the reference would dequantize
    every weight each call: ~3 s a token for the default model)."""
    return _lib is not None and x.dtype in (torch.bfloat16, torch.float16) and not x.requires_grad


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(-1, k).contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for fp32 x and W in fp32, or in fp16 / bf16 as a checkpoint stores it (widened
    in registers: the fp32 copy's sums from half the bytes): the GEMV up to GEMV_MAX_ROWS rows."""
    n, k = weight.shape
    if not _usable(x, k) or weight.dtype not in WEIGHT_TYPES or not weight.is_contiguous() or x.numel() // k > GEMV_MAX_ROWS:
        return sgemm(x, weight, bias)
    x2 = _rows(x, k)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    _lib.fl_float_linear(x2.data_ptr(), x2.shape[0], k, weight.data_ptr(), WEIGHT_TYPES[weight.dtype], n, y.data_ptr())
    y = y.view(*x.shape[:-1], n)
    return y if bias is None else y + bias


def panel_linear(x: torch.Tensor, qp: torch.Tensor, sp: torch.Tensor, mp: torch.Tensor | None, n: int, bits: int,
                 bias: torch.Tensor | None = None, sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """x @ W^T for W in panels (quantized.pack_panels): the GEMV kernel up to GEMV_MAX_ROWS rows,
    beyond them (prefill) the GEMM that dequantizes the panels a block at a time in cache: within
    10% of oneDNN's sgemm on the float weights (0.91-1.17x, benchmarks/quant_gemm_cpu.py) with no
    float copy of them to make or hold. 16-bit x: the kernels in fp32, the result rounded back."""
    if _half(x):
        return panel_linear(x.float(), qp, sp, mp, n, bits, bias, sups).to(x.dtype)
    g = qp.shape[2]
    k = qp.shape[1] * g
    if not _usable(x, k) or g % 4 != 0 or sp.dtype not in (torch.float16, torch.float32, torch.int8) or (mp is not None and mp.dtype != sp.dtype):
        return quantized.panel_linear(x, qp, sp, mp, n, bits, bias, sups)
    x2 = _rows(x, k)
    args = (qp.data_ptr(), sp.data_ptr(), ptr(mp), sp.element_size(), *super_scales(sp, sups))
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    kernel = _lib.fl_panel_linear if x2.shape[0] <= GEMV_MAX_ROWS else _lib.fl_panel_gemm
    kernel(x2.data_ptr(), x2.shape[0], k, *args, n, g, quantized.kernel_width(qp, bits), y.data_ptr())
    y = y.view(*x.shape[:-1], n)
    return y if bias is None else y + bias


def gemv_x_block() -> int:
    """The columns a block of x is rounded to int16 by in the 1-4 row GEMVs (gemv_x); 0 where they
    compute with fp32 x (AVX-512 builds) or the C kernels do not run."""
    return int(_lib.fl_gemv_x_block(1, 4096, 32)) if load() is not None else 0


def gemv_x(x: torch.Tensor, g: int) -> torch.Tensor:
    """x as panel_linear computes with it for weights in groups of g: on AVX2 builds 1-4 rows are
    rounded to int16 per block of 8 columns, scaled by the block's largest |x| (cpu_kernels.c's
    x_to_i16: integer dot products run twice as fast there as float ones); otherwise x itself. The
    reference the kernel tests hold the GEMVs to."""
    x2 = x.reshape(-1, x.shape[-1])
    block = _lib.fl_gemv_x_block(x2.shape[0], x2.shape[1], g)
    if not block:
        return x
    xb = x2.view(x2.shape[0], -1, block)
    top = xb.abs().amax(-1, keepdim=True)
    whole = top >= 1e-30  # (a tinier block counts as zeros: cpu_kernels.c's X_I16_TINY)
    inv = torch.where(whole, 32767.0 / top, torch.zeros_like(top))  # fp32 throughout, as the kernel
    return (torch.round(xb * inv) * torch.where(whole, top / 32767.0, torch.zeros_like(top))).view_as(x)


def panel_linear_a8(x: torch.Tensor, qp: torch.Tensor, sp: torch.Tensor, mp: torch.Tensor | None, n: int, bits: int,
                    bias: torch.Tensor | None = None, sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """quantized.panel_linear_a8 in one call: x rounded to int8 by chunk, then integer dot products
    against the panels' values (AVX-512 VNNI's vpdpbusd; AVX2's maddubs), one float multiply-add
    per chunk for the scales. 16-bit x: rounded from its fp32 value, the result rounded back."""
    if _half(x):
        return panel_linear_a8(x.float(), qp, sp, mp, n, bits, bias, sups).to(x.dtype)
    g = qp.shape[2]
    k = qp.shape[1] * g
    if not _usable(x, k) or (g != 16 and g % 32 != 0) or sp.dtype not in (torch.float16, torch.float32, torch.int8) or (mp is not None and mp.dtype != sp.dtype):
        return quantized.panel_linear_a8(x, qp, sp, mp, n, bits, bias, sups)
    x2 = _rows(x, k)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    _lib.fl_panel_gemm_a8(x2.data_ptr(), x2.shape[0], k, qp.data_ptr(), sp.data_ptr(), ptr(mp), sp.element_size(), *super_scales(sp, sups),
                          n, g, quantized.kernel_width(qp, bits), y.data_ptr())
    y = y.view(*x.shape[:-1], n)
    return y if bias is None else y + bias


def dequantize_panel_rows(qp: torch.Tensor, sp: torch.Tensor, mp: torch.Tensor | None, bits: int, rows: torch.Tensor | slice, n: int,
                          dtype: torch.dtype = torch.float32, sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """quantized.dequantize_panel_rows for a list of row ids (the quantized embedding's lookup): each
    row read from its panel in C, where the reference gathers whole panels (a 2,048-token prompt's
    lookup in a Q8_0 table: 38 MB of them; 4-bit ones widened to int32: ~100 MB)."""
    ok = (isinstance(rows, torch.Tensor) and rows.dim() == 1 and not rows.dtype.is_floating_point and rows.dtype != torch.bool
          and dtype == torch.float32 and qp.shape[2] % 4 == 0 and sp.dtype in (torch.float16, torch.float32, torch.int8)
          and (mp is None or mp.dtype == sp.dtype) and rows.numel() > 0)
    if not ok or int(rows.min()) < 0 or int(rows.max()) >= n:
        return quantized.dequantize_panel_rows(qp, sp, mp, bits, rows, n, dtype, sups)
    g = qp.shape[2]
    k = qp.shape[1] * g
    ids = rows.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    _lib.fl_panel_rows(qp.data_ptr(), sp.data_ptr(), ptr(mp), sp.element_size(), *super_scales(sp, sups), k, g, quantized.kernel_width(qp, bits), ids.data_ptr(), ids.numel(),
                       out.data_ptr())
    return out


def super_scales(sp: torch.Tensor, sups: tuple[torch.Tensor, torch.Tensor | None] | None) -> tuple[int | None, int | None, int]:
    """The C kernels' (sup_s, sup_m, gps) arguments: the fp16 super-block scales of int8 scales and
    mins (PackedLinear's factored K-quant form) and the groups each covers; NULLs otherwise."""
    if sups is None:
        return None, None, 0
    gps = sp.shape[1] // sups[0].shape[1]
    if gps & (gps - 1) or gps * sups[0].shape[1] != sp.shape[1]:
        raise ValueError(f"factored scales need a power-of-two number of groups per super-block, got {sp.shape[1]} / {sups[0].shape[1]}")
    return sups[0].data_ptr(), ptr(sups[1]), gps


def w8a8_linear(xq: torch.Tensor, xs: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float(xq @ qweight^T) * xs[:, None] * weight_scale (+ bias): the one-call decode step's int8
    GEMV, exposed for its tests (the op-by-op path uses torch._int_mm)."""
    m, k = xq.shape
    n = qweight.shape[0]
    wsum = qweight.sum(dim=1, dtype=torch.int32)
    y = torch.empty(m, n, dtype=torch.float32)
    _lib.fl_w8a8_linear(xq.data_ptr(), xs.data_ptr(), m, k, qweight.data_ptr(), weight_scale.data_ptr(), wsum.data_ptr(), n, ptr(bias), y.data_ptr())
    return y


def quantize_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None, clip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The C step's per-token int8 quantization (quantized.quantize_per_token)."""
    m, k = x.shape
    q, s = torch.empty(m, k, dtype=torch.int8), torch.empty(m, dtype=torch.float32)
    _lib.fl_quantize_rows(x.data_ptr(), m, k, ptr(static_scale), int(clip), q.data_ptr(), s.data_ptr())
    return q, s


def search_scale_min(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                     use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantizers' scale and min search (quant.quantize.search_scale_min), all groups in one call."""
    x, weights = x.float().contiguous(), weights.float().contiguous()
    n, g = x.shape
    scale, mins, levels = torch.empty(n), torch.empty(n), torch.empty(n, g)
    _lib.fl_search_scale_min(x.data_ptr(), weights.data_ptr(), n, g, nmax, rmin, rdelta, nstep, int(use_mad), scale.data_ptr(),
                             mins.data_ptr(), levels.data_ptr())
    return scale, mins, levels


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for a C pointer argument, NULL for None."""
    return None if t is None else t.data_ptr()


def _f32(*tensors: torch.Tensor) -> bool:
    return _lib is not None and all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    k = x.shape[-1]
    if not _f32(x, weight) or k % 8 != 0:
        return reference.rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    _lib.fl_rms_norm(x.data_ptr(), weight.data_ptr(), eps, x.numel() // k, k, out.data_ptr())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    if not _f32(x, residual, weight) or x.shape != residual.shape or k % 8 != 0:
        return reference.add_rms_norm(x, residual, weight, eps)
    h, out = torch.empty_like(x), torch.empty_like(x)
    _lib.fl_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, x.numel() // k, k, h.data_ptr(), out.data_ptr())
    return out, h


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    i = gate_up.shape[-1] // 2
    if not _f32(gate_up) or i % 8 != 0:
        return reference.silu_and_mul(gate_up)
    out = torch.empty(*gate_up.shape[:-1], i, dtype=torch.float32)
    _lib.fl_silu_and_mul(gate_up.data_ptr(), gate_up.numel() // (2 * i), i, out.data_ptr())
    return out


def silu_and_mul_quant(gate_up: torch.Tensor, static_scale: torch.Tensor | None = None, clip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """quantized.silu_and_mul_quant from this build's SiLU·mul: the float row a tensor-parallel
    rank's SiluAndMul gives RowParallel, so both quantize the same values (torch's SiLU and the C
    one differ in the last bit, and a row's absmax took it into its scale)."""
    return quantized.quantize_per_token(silu_and_mul(gate_up), static_scale, clip)


def argmax(x: torch.Tensor) -> torch.Tensor:
    if not _f32(x) or x.dim() != 2 or x.shape[1] == 0:
        return reference.argmax(x)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib.fl_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def argmax_tokens(x: torch.Tensor) -> list[int]:
    """argmax as Python ints through a ctypes array: no tensor made (torch.empty and tolist cost
    ~80 us a decode step with the caches cold from the step's weights)."""
    if not _f32(x) or x.dim() != 2 or x.shape[1] == 0:
        return reference.argmax_tokens(x)
    out = (ctypes.c_int64 * x.shape[0])()
    _lib.fl_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], ctypes.addressof(out))
    return out[:]


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The next token of each row of fp32 logits [B, V] (penalties already applied): the reference
    sampler's draw (engine/sampler.py: reference_sample) in one C pass per row."""
    B, V = logits.shape
    assert logits.dtype == torch.float32 and 0 < V < 1 << 31
    args = [t.contiguous() for t in (temperature.float(), top_k.long(), top_p.float(), min_p.float(), seeds.long(), steps.long())]
    out = torch.empty(B, dtype=torch.int64)
    _lib.fl_sample_rows(logits.contiguous().data_ptr(), B, V, *(a.data_ptr() for a in args), out.data_ptr())
    return out


def paged(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Caches the C kernels read: fp32 [blocks, kv_heads, block_size, head_dim] views whose rows
    are contiguous (blocks and heads at any strides, the same for K and V), blocks of a power of
    two of at least 8 rows (addressed with shifts)."""
    bs, d = k_cache.shape[2], k_cache.shape[3]
    return (_lib is not None and k_cache.dtype == v_cache.dtype == torch.float32 and k_cache.stride() == v_cache.stride()
            and k_cache.stride(3) == 1 and k_cache.stride(2) == d and bs >= 8 and bs & (bs - 1) == 0)


def rope_and_store_kv(qkv, cos, sin, k_cache, v_cache, meta, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    if not _f32(qkv, cos, sin) or head_dim % 2 != 0 or not paged(k_cache, v_cache):
        return reference.rope_and_store_kv(qkv, cos, sin, k_cache, v_cache, meta, num_heads, num_kv_heads, head_dim)
    T = qkv.shape[0]
    q = torch.empty(T, num_heads, head_dim, dtype=torch.float32)
    _lib.fl_rope_store_kv(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
        T, num_heads, num_kv_heads, head_dim, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[2], k_cache.stride(0), k_cache.stride(1),
        q.data_ptr(),
    )
    return q


def decode_attention(q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    B, H, D = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    tables = meta.decode_block_tables
    _lib.fl_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0), meta.decode_lengths.data_ptr(),
        B, H, k_cache.shape[1], D, k_cache.shape[2], k_cache.stride(0), k_cache.stride(1), scale, out.data_ptr(),
    )
    return out


def prefill_attention(q, k_cache, v_cache, table: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """One sequence's new queries q [n, H, D] (positions start .. start + n - 1) against its cache
    blocks `table` (int32, contiguous)."""
    n, H, D = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    _lib.fl_prefill_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), start, n, H, k_cache.shape[1], D,
                              k_cache.shape[2], k_cache.stride(0), k_cache.stride(1), scale, out.data_ptr())
    return out


def attention(q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    if not paged(k_cache, v_cache) or q.dtype != torch.float32 or q.shape[-1] % 8 != 0 or q.shape[-1] > 256:
        return reference.attention(q, k_cache, v_cache, meta, scale)
    prefill = prefill_attention if q.shape[-1] % vector_lanes() == 0 else None
    return reference.attention(q, k_cache, v_cache, meta, scale, decode=decode_attention, prefill=prefill)


def vector_lanes() -> int:
    """Floats a vector register holds in the C build (8 AVX2, 16 AVX-512): prefill attention takes
    head sizes that are a multiple of it."""
    return int(_lib.fl_vector_lanes())


def value_lanes() -> bool:
    """Whether 5 and 6-bit panels go in lanes here (quantized.pack_panels(lanes=True)): where the
    GEMVs take int16 x (AVX2 builds), which read them as stored: their decode GEMVs 1.4-1.7x faster
    on Zen 1."""
    return load() is not None and bool(_lib.fl_value_lanes())


OPS = {
    "linear": linear, "panel_linear": panel_linear, "panel_linear_a8": panel_linear_a8, "dequantize_panel_rows": dequantize_panel_rows,
    "rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "silu_and_mul": silu_and_mul, "silu_and_mul_quant": silu_and_mul_quant,
    "argmax": argmax, "argmax_tokens": argmax_tokens, "sample_rows": sample_rows,
    "rope_and_store_kv": rope_and_store_kv, "attention": attention, "search_scale_min": search_scale_min,
}


def register(register_op) -> bool:
    """Build/load the library and register its ops for CPU tensors; False if unavailable."""
    if load() is None:
        return False
    for name, fn in OPS.items():
        register_op("cpu", name, fn)
    if not has_vnni():
        register_op("cpu", "int8_gemm", int8_gemm_via_fp32)
    return True
