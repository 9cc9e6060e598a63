"""The integer decode GEMVs of quantization "gguf-a8" (backends/cuda/gemv_a8.py) against the
reference ops (x rounded to int8 per chunk, then the float product): on a GPU at real shapes, on
the CPU under TRITON_INTERPRET=1 at small ones (where a byte-by-byte product stands in for IDP4A)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")

from fasterllama.backends.cuda import gemv_a8
from fasterllama.ops import quantized
from fasterllama.quant.quantize import quantize_int4, quantize_int8

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
# (N, K): N not a multiple of any row block, a K tail past one tile, split-K
SHAPES = [(40, 96), (70, 1088)] if DEVICE == "cpu" else [(4096, 4096), (12288, 4096), (4096, 11008), (1728, 576)]
IN_LOOP = [c for c in gemv_a8.A8_CONFIGS if c.round_in_loop]  # (x rounded tile by tile in the K loop)
FIRST = [c for c in gemv_a8.A8_CONFIGS if c.round_first]  # (x rounded by a kernel of its own before the GEMV)
CONFIGS = ([*gemv_a8.A8_CONFIGS[:4:2], IN_LOOP[0], IN_LOOP[-1], FIRST[-1]] if DEVICE == "cpu" else [gemv_a8.A8_CONFIGS[0], IN_LOOP[0], FIRST[0]])


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape and got.dtype == ref.dtype and torch.isfinite(got.float()).all()
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def _x(rows: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """Activations with what rounding by chunk meets in a model: an outlier column, a chunk of
    zeros (its scale clamps at 1e-12 / 127), the rest normal."""
    x = torch.randn(rows, K, device=DEVICE)
    x[:, 3] *= 40.0
    x[:, 32:48] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("group,mins", [(None, False), (16, False), (16, True), (32, False), (32, True), (64, False)])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_int8_gemv_a8(shape, dtype, rows, group, mins, cfg) -> None:
    """int8 weights per channel or group (Q8_0, Q6_K's groups of 16 with x's chunks of 16; with
    mins: Q5_1 / Q5_K / Q2_K's values 0..31), x rounded by chunk: the reference's products, and
    not the unrounded x's (the rounding is really there)."""
    N, K = shape
    if group is not None and K % group:
        pytest.skip("group does not divide K")
    if mins:
        q = torch.randint(0, 32, (N, K), device=DEVICE, dtype=torch.int8)
        s, m = torch.rand(N, K // group, device=DEVICE) * 0.02, -torch.rand(N, K // group, device=DEVICE) * 0.3
    else:
        (q, s), m = quantize_int8(torch.randn(N, K, device=DEVICE), group), None
        s = s.half() if group is not None and dtype == torch.bfloat16 else s  # (as the CUDA backend holds them)
    x, b = _x(rows, K, dtype), torch.randn(N, device=DEVICE).to(dtype)
    ref = quantized.int8_weight_linear_a8(x.float(), q, s, b.float(), m).to(dtype)
    got = gemv_a8.int8_gemv_a8(x.unsqueeze(0), q, s, b, m, cfg)  # 3-D input: rows of a batch
    assert got.shape == (1, rows, N)
    assert _rel(got[0], ref) < _tol(dtype)
    if dtype == torch.float32:
        assert _rel(got[0], quantized.int8_weight_linear(x, q, s, b, m)) > 1e-4


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_int4_gemv_a8(shape, dtype, rows, cfg) -> None:
    """4-bit weights in groups of 32 with a scale and a min (Q4_0 / Q4_1 / Q4_K, w4-g32; pack_int4's
    bytes), x rounded by chunk of 32."""
    N, K = shape
    q, s, m = quantize_int4(torch.randn(N, K, device=DEVICE), 32)
    packed, s16, m16 = quantized.pack_int4(q, 32), s.half(), m.half()
    x, b = _x(rows, K, dtype), torch.randn(N, device=DEVICE).to(dtype)
    ref = quantized.int4_weight_linear_a8(x.float(), packed, s16, m16, 32, b.float()).to(dtype)
    got = gemv_a8.int4_gemv_a8(x, packed, s16, m16, 32, b, cfg)
    assert _rel(got, ref) < _tol(dtype)
    if dtype == torch.float32:
        assert _rel(got, quantized.int4_weight_linear(x, packed, s16, m16, 32, b)) > 1e-4


@pytest.mark.parametrize("cfg", CONFIGS)
def test_triton_int4_gemv_a8_symmetric_groups(cfg) -> None:
    """Q4_0's groups without their mins (the CUDA backend's form): min = -8 * scale, computed."""
    N, K = SHAPES[-1]
    q = torch.randint(0, 16, (N, K), device=DEVICE)
    s16 = (torch.rand(N, K // 32, device=DEVICE) * 0.02).half()
    packed = quantized.pack_int4(q, 32)
    x = _x(2, K, torch.bfloat16)
    ref = quantized.int4_weight_linear_a8(x.float(), packed, s16, s16 * -8, 32).to(torch.bfloat16)
    assert _rel(gemv_a8.int4_gemv_a8(x, packed, s16, None, 32, cfg=cfg), ref) < _tol(torch.bfloat16)


@pytest.mark.parametrize("cfg", CONFIGS[:2])
def test_triton_int4_gemv_a8_factored_scales(cfg) -> None:
    """Q4_K's factored scales and mins (int8 sub-block values times fp16 a super-block of 8 groups)."""
    N, K = 40, 512
    G = K // 32
    q = torch.randint(0, 16, (N, K), device=DEVICE)
    sub_s, sub_m = (torch.randint(0, 64, (N, G), device=DEVICE, dtype=torch.int8) for _ in range(2))
    sups = ((torch.rand(N, G // 8, device=DEVICE) * 1e-3).half(), (-torch.rand(N, G // 8, device=DEVICE) * 1e-3).half())
    packed, x = quantized.pack_int4(q, 32), _x(2, K, torch.bfloat16)
    ref = quantized.int4_weight_linear_a8(x.float(), packed, quantized.factored(sub_s, sups[0]), quantized.factored(sub_m, sups[1]), 32)
    assert _rel(gemv_a8.int4_gemv_a8(x, packed, sub_s, sub_m, 32, cfg=cfg, sups=sups), ref.to(torch.bfloat16)) < _tol(torch.bfloat16)


def test_triton_a8_dp4a_signed_and_unsigned_bytes() -> None:
    """Extreme values: int8 weights of -128 and 127 (quantize_int8 never makes -128, a GGUF's Q8_0
    may) against x's +-127 (a byte read with the wrong sign is off by 256 steps), and 4-bit values
    0 and 15 in both nibbles of a byte (each mask must keep its own four bits), in fp32."""
    N, K = 8, 256
    q = torch.tensor([-128, 127, -1, 0], dtype=torch.int8, device=DEVICE).repeat(N, K // 4)
    s = torch.ones(N, K // 32, device=DEVICE)
    x = torch.tensor([1.0, -1.0, 0.5, 1.0], device=DEVICE).repeat(1, K // 4)
    ref = quantized.int8_weight_linear_a8(x, q, s)
    assert _rel(gemv_a8.int8_gemv_a8(x, q, s), ref) < 1e-6
    q4 = torch.tensor([15, 0, 15, 15, 8, 1, 0, 15], device=DEVICE).repeat(N, K // 8)
    packed = quantized.pack_int4(q4, 32)
    ones, zeros = torch.ones(N, K // 32, device=DEVICE).half(), torch.zeros(N, K // 32, device=DEVICE).half()
    x = torch.tensor([1.0, -1.0, 0.25, 1.0, -0.5, 1.0, 1.0, -1.0], device=DEVICE).repeat(1, K // 8)
    ref = quantized.int4_weight_linear_a8(x, packed, ones, zeros, 32)
    assert _rel(gemv_a8.int4_gemv_a8(x, packed, ones, zeros, 32), ref) < 1e-6


def test_triton_a8_supports() -> None:
    assert gemv_a8.supports(4, 576, 32) and not gemv_a8.supports(4, 576, 64) and not gemv_a8.supports(4, 80, 32)
    assert gemv_a8.supports(8, 576, 16) and gemv_a8.supports(8, 576, None) and gemv_a8.supports(8, 4096, 128)
    assert not gemv_a8.supports(8, 576, 24) and not gemv_a8.supports(8, 80, 16)


def test_triton_a8_rounds_x_as_the_reference() -> None:
    """The kernel's x^ read back through identity weights (y = x^ exactly, in fp32): ties (x / scale
    a half, scale a power of two) go to the even neighbour as torch.round sends them, the outlier
    sets its chunk's scale, a chunk of zeros stays zero, and a random chunk rounds as the
    reference's IEEE division does (the kernel: a reciprocal and one FMA correction)."""
    K = 96
    halves = torch.arange(-15.5, 16.0, 1.0, device=DEVICE) / 8  # (k + 0.5) / 8: ties at scale 1/8
    halves[0] = -127 / 8  # the chunk's absmax: scale = 1/8 exactly
    x = torch.cat([halves, torch.zeros(32, device=DEVICE), torch.randn(32, device=DEVICE)])[None, :]
    eye = torch.eye(K, dtype=torch.int8, device=DEVICE)
    ref = quantized.round_activations(x, 32)
    assert torch.equal(ref[0, 1:32] * 8 % 2, torch.zeros(31, device=DEVICE))  # (ties went to even values)
    for cfg in CONFIGS:
        assert torch.equal(gemv_a8.int8_gemv_a8(x, eye, torch.ones(K, device=DEVICE), cfg=cfg), ref)
