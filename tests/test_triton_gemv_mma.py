"""The 4-bit decode GEMV on the tensor cores (backends/cuda/gemv_mma.py) against the reference ops and
the other GEMVs: on a GPU at real shapes, on the CPU under TRITON_INTERPRET=1 at small ones (there
the nibbles come from shifts in fp32 and the MMA is an fp32 dot: the inline PTX is compiled for
sm_90 in test_triton_compile.py)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")

from fasterllama.backends.cuda import gemv, gemv_mma, triton_norm
from fasterllama.ops import quantized
from fasterllama.quant.quantize import quantize_int4, quantize_int8

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
# (N, K): N past one row block and not a multiple of it, a K tail inside a tile, split-K; on a GPU qkv and down at 7B
SHAPES = [(40, 512), (150, 1088)] if DEVICE == "cpu" else [(12288, 4096), (4096, 11008)]
CONFIGS = gemv_mma.MMA_CONFIGS if DEVICE == "cpu" else gemv_mma.MMA_CONFIGS[:1]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape and got.dtype == ref.dtype and torch.isfinite(got.float()).all()
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def _weights(N: int, K: int, group: int):
    q, s, m = quantize_int4(torch.randn(N, K, device=DEVICE), group)
    return quantized.pack_int4(q, group), s.half(), m.half()


# (one and two rows in the GEMV's configs, a decode batch's rows in the batch configs: a tile of fewer groups)
ROW_CASES = [(r, c) for r in (1, 2) for c in CONFIGS] + [(3, gemv_mma.BATCH_CONFIGS[0]), (8, gemv_mma.BATCH_CONFIGS[-1]),
                                                          (16, gemv_mma.BATCH_CONFIGS[1])]


@pytest.mark.parametrize(("rows", "cfg"), ROW_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_int4_mma_gemv(shape, group, dtype, rows, cfg) -> None:
    """Every group size, both half-precision types (bf16 values 128 + q, fp16 1024 + q), 1 to 16
    rows, with a bias: the reference's fp32 sums, rounded once."""
    N, K = shape
    if K % group:
        pytest.skip("group does not divide K")
    packed, s16, m16 = _weights(N, K, group)
    x = torch.randn(rows, K, device=DEVICE).to(dtype)
    b = torch.randn(N, device=DEVICE).to(dtype)
    ref = quantized.int4_weight_linear(x.float(), packed, s16, m16, group, b.float()).to(dtype)
    got = gemv_mma.int4_gemv_mma(x, packed, s16, m16, group, b, cfg)
    assert _rel(got, ref) < 1e-2
    assert _rel(got, ref) < 1.5 * _rel(quantized.int4_weight_linear(x, packed, s16, m16, group, b), ref) + 1e-3  # as close as the reference in x's type


@pytest.mark.parametrize(("rows", "cfg"), [(1, CONFIGS[0]), (2, CONFIGS[-1]), (3, gemv_mma.BATCH_CONFIGS[0]), (8, gemv_mma.BATCH_CONFIGS[1]),
                                         (16, gemv_mma.BATCH_CONFIGS[-1])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [None, 32, 64, "mins"])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_int8_mma_gemv(shape, group, dtype, rows, cfg) -> None:
    """int8 weights as two nibble planes a byte (the high ones' top bit flipped, their activations x
    16): per channel, per group, per group with mins; the reference's fp32 sums, rounded once."""
    N, K = shape
    mins = None
    if group == "mins":
        q = torch.randint(-128, 128, (N, K), device=DEVICE, dtype=torch.int8)
        s = (torch.rand(N, K // 32, device=DEVICE) * 0.02).half()
        mins = (-torch.rand(N, K // 32, device=DEVICE) * 0.3).half()
    else:
        if group is not None and K % group:
            pytest.skip("group does not divide K")
        q, s = quantize_int8(torch.randn(N, K, device=DEVICE), group)
        s = s.half() if group is not None else s  # (group scales in fp16, as the CUDA backend holds them)
    x = torch.randn(rows, K, device=DEVICE).to(dtype)
    b = torch.randn(N, device=DEVICE).to(dtype)
    ref = quantized.int8_weight_linear(x.float(), q, s.float(), b.float(), None if mins is None else mins.float()).to(dtype)
    got = gemv_mma.int8_gemv_mma(x, q, s, b, cfg, mins)
    assert _rel(got, ref) < 1.5 * _rel(quantized.int8_weight_linear(x, q, s.to(dtype), b, None if mins is None else mins.to(dtype)), ref) + 1e-3


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_triton_int4_mma_gemv_symmetric_and_factored_scales(rows) -> None:
    """Q4_0's groups without mins (w = scale * (q - 8)) and Q4_K's factored scales and mins (int8
    sub-block values times fp16 a super-block): what the stored floats give."""
    N, K = SHAPES[0]
    x = torch.randn(rows, K, device=DEVICE).to(torch.bfloat16)
    q = torch.randint(0, 16, (N, K), device=DEVICE)
    s16 = (torch.rand(N, K // 32, device=DEVICE) * 0.02).half()
    packed = quantized.pack_int4(q, 32)
    ref = quantized.int4_weight_linear(x.float(), packed, s16, s16 * -8, 32).to(torch.bfloat16)
    cfg = CONFIGS[0] if rows <= 2 else gemv_mma.BATCH_CONFIGS[0]
    got = gemv_mma.int4_gemv_mma(x, packed, s16, None, 32, cfg=cfg)
    assert _rel(got, ref) < 1e-2
    assert torch.equal(got, gemv_mma.int4_gemv_mma(x, packed, s16, s16 * -8, 32, cfg=cfg))

    sub_s, sub_m = (torch.randint(0, 64, (N, K // 32), device=DEVICE, dtype=torch.int8) for _ in range(2))
    sups = ((torch.rand(N, K // 256, device=DEVICE) * 1e-3).half(), (-torch.rand(N, K // 256, device=DEVICE) * 1e-3).half())
    s32, m32 = quantized.factored(sub_s, sups[0]), quantized.factored(sub_m, sups[1])
    ref = quantized.int4_weight_linear(x.float(), packed, s32, m32, 32).to(torch.bfloat16)
    got = gemv_mma.int4_gemv_mma(x, packed, sub_s, sub_m, 32, cfg=cfg, sups=sups)
    assert _rel(got, ref) < 1e-2
    assert torch.equal(got, gemv_mma.int4_gemv_mma(x, packed, s32, m32, 32, cfg=cfg))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2])
def test_triton_mma_gemv_gated_and_normed(rows, bits) -> None:
    """gated (SiLU(gate) * up made as x is read) and norm (RMSNorm(h + residual) made by the
    programs), 4-bit and int8: the same as the SiLU·mul or norm kernel, then the GEMV."""
    N, K = SHAPES[1]
    if bits == 4:
        packed, s16, m16 = _weights(N, K, 32)
        gemv_of = lambda x, **k: gemv_mma.int4_gemv_mma(x, packed, s16, m16, 32, cfg=CONFIGS[-1], **k)  # noqa: E731
    else:
        q, s = quantize_int8(torch.randn(N, K, device=DEVICE), 32)
        gemv_of = lambda x, **k: gemv_mma.int8_gemv_mma(x, q, s.half(), cfg=CONFIGS[-1], **k)  # noqa: E731
    gate_up = torch.randn(rows, 2 * K, device=DEVICE).to(torch.bfloat16)
    assert _rel(gemv_of(gate_up, gated=True), gemv_of(triton_norm.silu_and_mul(gate_up))) < 1e-6

    h, res = (torch.randn(rows, K, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    w_norm = (1 + 0.2 * torch.randn(K, device=DEVICE)).to(torch.bfloat16)
    x, want_res = triton_norm.add_rms_norm(h, res, w_norm, 1e-5)
    res_out = torch.empty_like(h)
    assert _rel(gemv_of(h, norm=gemv.Norm(res, w_norm, 1e-5, res_out)), gemv_of(x)) < 2e-3
    assert torch.equal(res_out, want_res)


def test_triton_int4_mma_gemv_is_a_candidate_and_dispatched(monkeypatch) -> None:
    """tune() times it for half-precision activations (not fp32: the MMA's operands), at one row
    and at a decode batch (against the tiled kernel), and a linear whose shape chose it runs it:
    a batch of 3..16 rows too."""
    from fasterllama.quant.linear import Int4Linear

    N, K = SHAPES[0]
    q, s, m = quantize_int4(torch.randn(N, K, device=DEVICE), 32)
    module = Int4Linear(q, s, m).to(DEVICE)
    packed, s16, m16 = module.qweight, module.scales, module.mins
    x = torch.randn(1, K, device=DEVICE).to(torch.bfloat16)
    key, fns = gemv._candidates(module, x)
    assert {c for name, c in fns if name == "gemv-mma"} == set(gemv_mma.MMA_CONFIGS)
    assert not any(name == "gemv-mma" for name, _ in gemv._candidates(module, x.float())[1])
    batch_key, batch_fns = gemv._batch_candidates(module, x)
    assert batch_key[0] == "int4rows" and list(batch_fns)[0][0] == "tiled"  # (the reference _checked compares with)
    assert {c for name, c in batch_fns if name == "gemv-mma"} == set(gemv_mma.BATCH_CONFIGS)
    assert gemv._batch_candidates(module, x.float()) == ((), {})

    calls = []
    real = gemv_mma.int4_gemv_mma
    monkeypatch.setattr(gemv_mma, "int4_gemv_mma", lambda *a, **k: calls.append(a[6]) or real(*a, **k))
    cfg, batch_cfg = gemv_mma.MMA_CONFIGS[1], gemv_mma.BATCH_CONFIGS[1]
    monkeypatch.setitem(gemv._CHOICE, key, ("gemv-mma", cfg))
    assert torch.equal(gemv._module_gemv(module, x), real(x, packed, s16, m16, 32, cfg=cfg))
    xb = torch.randn(6, K, device=DEVICE).to(torch.bfloat16)
    assert gemv._module_gemv(module, xb) is None  # a batch: the tiled kernel until tune() times the MMA GEMV faster
    monkeypatch.setitem(gemv._CHOICE, batch_key, ("gemv-mma", batch_cfg))
    assert torch.equal(gemv._module_gemv(module, xb), real(xb, packed, s16, m16, 32, cfg=batch_cfg))
    assert gemv._module_gemv(module, torch.randn(17, K, device=DEVICE).to(torch.bfloat16)) is None
    assert calls == [cfg, batch_cfg]


def test_triton_int8_mma_gemv_is_a_candidate_and_dispatched(monkeypatch) -> None:
    """int8 linears as 4-bit ones: candidates at one row and at a batch, dispatched where chosen."""
    from fasterllama.quant.linear import Int8Linear

    N, K = SHAPES[0]
    q, s = quantize_int8(torch.randn(N, K, device=DEVICE), 32)
    module = Int8Linear(q, s.half()).to(DEVICE)
    x = torch.randn(1, K, device=DEVICE).to(torch.bfloat16)
    key, fns = gemv._candidates(module, x)
    assert {c for name, c in fns if name == "gemv-mma"} == set(gemv_mma.MMA_CONFIGS)
    batch_key, batch_fns = gemv._batch_candidates(module, x)
    assert batch_key[0] == "int8rows" and {c for name, c in batch_fns if name == "gemv-mma"} == set(gemv_mma.BATCH_CONFIGS)
    assert gemv._batch_candidates(module, x.float()) == ((), {})
    xb = torch.randn(8, K, device=DEVICE).to(torch.bfloat16)
    assert gemv._module_gemv(module, xb) is None
    monkeypatch.setitem(gemv._CHOICE, key, ("gemv-mma", gemv_mma.MMA_CONFIGS[0]))
    monkeypatch.setitem(gemv._CHOICE, batch_key, ("gemv-mma", gemv_mma.BATCH_CONFIGS[0]))
    qw, sw = module.qweight, module.weight_scale
    assert torch.equal(gemv._module_gemv(module, x), gemv_mma.int8_gemv_mma(x, qw, sw, cfg=gemv_mma.MMA_CONFIGS[0]))
    assert torch.equal(gemv._module_gemv(module, xb), gemv_mma.int8_gemv_mma(xb, qw, sw, cfg=gemv_mma.BATCH_CONFIGS[0]))
    assert gemv._serves_rows(module, ("gemv-mma", gemv_mma.BATCH_CONFIGS[0]), batch_key, x, batch=True)


def test_triton_int4_mma_gemv_checks_every_row_padding_it_serves(monkeypatch) -> None:
    """The batch config timed at 8 rows serves 3..16: tune() keeps it only where the kernels for 4
    and 16 rows (compiled apart) agree with the tiled kernel too; no rows give an empty output."""
    from fasterllama.quant.linear import Int4Linear

    N, K = SHAPES[0]
    q, s, m = quantize_int4(torch.randn(N, K, device=DEVICE), 32)
    module = Int4Linear(q, s, m).to(DEVICE)
    x = torch.randn(1, K, device=DEVICE).to(torch.bfloat16)
    key, cfg = gemv._batch_candidates(module, x)[0], gemv_mma.BATCH_CONFIGS[0]
    assert gemv_mma.int4_gemv_mma(x[:0], module.qweight, module.scales, module.mins, 32, cfg=cfg).shape == (0, N)
    assert gemv._serves_rows(module, ("gemv-mma", cfg), key, x, batch=True)
    real = gemv_mma.int4_gemv_mma
    monkeypatch.setattr(gemv_mma, "int4_gemv_mma", lambda xr, *a, **k: real(xr, *a, **k) * (2 if xr.shape[0] == 16 else 1))
    monkeypatch.setattr(gemv, "REJECTED", [])
    assert not gemv._serves_rows(module, ("gemv-mma", cfg), key, x, batch=True)
    assert gemv.REJECTED and "relative error" in gemv.REJECTED[0]
