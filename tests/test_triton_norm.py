"""The row-wise Triton kernels (backends/cuda/triton_norm.py) against their PyTorch references:
on a GPU at real shapes, and on the CPU under TRITON_INTERPRET=1 at small ones."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")

from fasterllama.backends.cuda import triton_norm as tn
from fasterllama.ops import quantized, reference

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
SHAPES = [(1, 64), (5, 96), (3, 200)] if DEVICE == "cpu" else [(1, 576), (7, 4096), (300, 4096), (64, 11008)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def _assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, tol: float | None = None) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.isfinite(got.float()).all()
    tol = tol or (1e-6 if dtype == torch.float32 else 1e-2)
    err = (got.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)
    assert err.item() < tol, err.item()


def _assert_same_sum(h: torch.Tensor, ref: torch.Tensor) -> None:
    """The residual sum, rounded once to the dtype: bit-equal on a GPU (the interpreter truncates
    fp32 -> bf16/fp16 conversions instead of rounding them, so there it is one ulp off)."""
    if DEVICE == "cuda" or h.dtype == torch.float32:
        assert torch.equal(h, ref)
    else:
        _assert_close(h, ref, h.dtype)


def _assert_int8_close(q, s, q_ref, s_ref, strict_only_on_gpu=False) -> None:
    assert q.dtype == torch.int8 and q.shape == q_ref.shape
    if DEVICE == "cuda" or not strict_only_on_gpu:
        torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=0)
        diff = (q.int() - q_ref.int()).abs()
        assert diff.max().item() <= 1 and (diff > 0).float().mean().item() < 1e-3  # rounding ties of x / scale
    else:  # the interpreter truncates bf16 roundings before quantizing: compare the values held
        _assert_close(q.float() * s[..., None], q_ref.float() * s_ref[..., None], torch.bfloat16, 3e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_rms_norm(shape, dtype) -> None:
    x, w = _rand(*shape, dtype=dtype, scale=3), _rand(shape[-1], dtype=dtype)
    _assert_close(tn.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_add_rms_norm(shape, dtype) -> None:
    x, r, w = _rand(*shape, dtype=dtype), _rand(*shape, dtype=dtype, scale=4), _rand(shape[-1], dtype=dtype)
    out, h = tn.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_h = reference.add_rms_norm(x, r, w, 1e-6)
    _assert_same_sum(h, ref_h)
    _assert_close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [*SHAPES, (2, 2 * tn.SILU_BLOCK + 100)])  # the last: a row over three programs
def test_triton_silu_and_mul(shape, dtype) -> None:
    gu = _rand(shape[0], 2 * shape[1], dtype=dtype, scale=2)
    _assert_close(tn.silu_and_mul(gu), reference.silu_and_mul(gu), dtype)


@pytest.mark.parametrize("static", [None, "scale", "clip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_norm_quant(dtype, static) -> None:
    M, K = SHAPES[1]
    x, r, w = _rand(M, K, dtype=dtype), _rand(M, K, dtype=dtype), _rand(K, dtype=dtype)
    x[0] *= 50  # a row beyond the static range (an attention sink)
    scale = None if static is None else torch.tensor(0.02, device=DEVICE)
    clip = static == "clip"
    (q, s), h = tn.add_rms_norm_quant(x, r, w, 1e-5, scale, clip)
    (q_ref, s_ref), h_ref = quantized.add_rms_norm_quant(x, r, w, 1e-5, scale, clip)
    _assert_same_sum(h, h_ref)
    loose = dtype != torch.float32
    _assert_int8_close(q, s, q_ref, s_ref, loose)
    q, s = tn.rms_norm_quant(x, w, 1e-5, scale, clip)
    _assert_int8_close(q, s, *quantized.rms_norm_quant(x, w, 1e-5, scale, clip), loose)
    gu = _rand(M, 2 * K, dtype=dtype, scale=2)
    _assert_int8_close(*tn.silu_and_mul_quant(gu, scale, clip), *quantized.silu_and_mul_quant(gu, scale, clip), loose)
    _assert_int8_close(*tn.quantize_per_token(x, scale, clip), *quantized.quantize_per_token(x, scale, clip), loose)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("static", [None, "scale", "clip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_silu_and_mul_quant_in_chunks(monkeypatch, dtype, static, recompute) -> None:
    """The chunked kernel of many rows (a prefill's) quantizes as the reference does: rows of
    several chunks and a partial last one, a row whose absmax lies in a late chunk; SiLU·mul read
    back or made again."""
    M, K = (6, 3 * 32 + 8) if DEVICE == "cpu" else (300, 11008)
    monkeypatch.setattr(tn, "SILU_QUANT_ROWS", 1)
    monkeypatch.setattr(tn, "SILU_QUANT_RECOMPUTE", recompute)
    if DEVICE == "cpu":
        monkeypatch.setattr(tn, "SILU_QUANT_BLOCK", 32)
    gu = _rand(M, 2 * K, dtype=dtype, scale=2)
    gu[1, K - 3] = 40.0  # (gate) the second row's absmax in its last chunk
    scale = None if static is None else torch.tensor(0.02, device=DEVICE)
    kernel, grids = tn._silu_and_mul_quant_rows_kernel, []
    monkeypatch.setattr(tn, "_silu_and_mul_quant_rows_kernel", type("Spy", (), {"__getitem__": lambda self, grid: grids.append(grid) or kernel[grid]})())
    q, s = tn.silu_and_mul_quant(gu, scale, static == "clip")
    assert grids == [(M,)] and q.shape == (M, K) and s.shape == (M,)  # (the chunked kernel ran, a program a row)
    _assert_int8_close(q, s, *quantized.silu_and_mul_quant(gu, scale, static == "clip"), dtype != torch.float32)


def test_the_faster_silu_quant_way_is_kept(monkeypatch) -> None:
    """tune_silu_quant times both second passes and keeps "made again" only where it is 3% faster."""
    from fasterllama.backends.cuda import gemv

    for read_back, made_again, chosen in ((1.0, 0.5, True), (1.0, 0.98, False), (0.5, 1.0, False)):
        monkeypatch.setattr(gemv, "_time", lambda fn, a=made_again, b=read_back: a if tn.SILU_QUANT_RECOMPUTE else b)
        monkeypatch.setattr(tn, "SILU_QUANT_RECOMPUTE", not chosen)
        monkeypatch.setattr(tn, "_SILU_TUNED", {})
        got = tn.tune_silu_quant(40, torch.float32, torch.device(DEVICE), rows=4)
        assert got == {("w8a8 silu quant", 40, 4): {"read back": read_back, "made again": made_again}}
        assert tn.SILU_QUANT_RECOMPUTE is chosen
        monkeypatch.setattr(gemv, "_time", None)  # (timed once a shape)
        assert tn.tune_silu_quant(40, torch.float32, torch.device(DEVICE), rows=4) == got and tn.SILU_QUANT_RECOMPUTE is chosen


def test_triton_round_half_even() -> None:
    """Ties of x / scale round to even as torch.round does (1.5 -> 2, 2.5 -> 2, -0.5 -> 0)."""
    row = torch.tensor([[127.0, 1.5, 2.5, -0.5, -1.5, 3.5, 0.49, -126.5, 200.0]], device=DEVICE)
    one = torch.tensor(1.0, device=DEVICE)
    q, _ = tn.quantize_per_token(row, one, True)
    assert q.tolist() == [[127, 2, 2, 0, -2, 4, 0, -126, 127]]
    assert torch.equal(q, quantized.quantize_per_token(row, one, True)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_quantize_per_token_divides_as_torch(dtype) -> None:
    """Scales and int8 codes equal torch's bit for bit, near-ties of x / scale included: the kernel
    divides correctly rounded (a GPU's "/" is PTX div.full, 2 ulp: one step off at near-ties)."""
    M, K = SHAPES[1]
    x = _rand(M, K, dtype=dtype, scale=3)
    amax = x.float().abs().amax(dim=1, keepdim=True)
    k = torch.randint(-120, 120, (M, K), device=DEVICE).float()
    near = ((k + 0.5) * (amax / 127) * (1 + torch.randn(M, K, device=DEVICE) * 1e-7)).to(dtype)
    x = torch.where(torch.rand(M, K, device=DEVICE) < 0.5, near, x)
    x[:, 0] = amax[:, 0].to(dtype)  # (the absmax kept)
    q, s = tn.quantize_per_token(x)
    q_ref, s_ref = quantized.quantize_per_token(x)
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)
