"""The C kernels (backends/cpu/kernels.py) against their PyTorch references, op by op and through a model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import decode_tolerance

from fasterllama import ops
from fasterllama.backends.cpu import kernels as ck
from fasterllama.ops import quantized as qops
from fasterllama.ops import reference as ref

pytestmark = pytest.mark.skipif(ck.load() is None, reason="C kernels cannot be built here")
torch.manual_seed(0)

ROWS = [1, 2, 3, 4, 5, 8, 16, 17, 40]  # tails of the 4-row tiles, and the large-M GEMM
SHAPES = [(96, 64, 32), (70, 256, 64), (33, 256, 128), (40, 1600, 32), (20, 2304, 128)]  # (N, K, group); K > 1024: x rows longer than L1 holds at 8+ rows


def _close(out: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() <= tol * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k,g", SHAPES)
def test_int4_linear(m, n, k, g):
    x = torch.randn(m, k)
    packed = qops.pack_int4(torch.randint(0, 16, (n, k)), g)
    scales, mins = (torch.rand(n, k // g) * 0.1).half(), (-torch.rand(n, k // g) * 0.1).half()
    bias = torch.randn(n)
    panels = qops.to_panels(packed, scales, mins, g)
    _close(ck.panel_linear(x, *panels, n, 4, bias), qops.int4_weight_linear(ck.gemv_x(x, g), packed, scales, mins, g, bias))


def test_gemv_x_rounding_edges():
    """The GEMVs' x (kernels.gemv_x): on AVX2 builds within half a step (1/65534 of the block's largest
    |x|) of x; blocks of tiny values count as zeros instead of overflowing; a NaN reaches the output
    rows it is in, as with fp32 x; other rows stay finite."""
    n, k, g = 64, 256, 32
    q, s, m = _panel_weights(n, k, g, 4, True, torch.float16)
    from fasterllama.quant.linear import PackedLinear

    lin = PackedLinear(q, s, m, 4)
    w = lin.dequantize()
    x = torch.randn(2, k) * torch.logspace(-3, 3, k)  # blocks of very different sizes
    x[1, 40:48] = 1e-38  # a block of tiny values
    xr = ck.gemv_x(x, g)
    block = ck.gemv_x_block()
    if block:
        top = x.view(2, -1, block).abs().amax(-1, keepdim=True)
        err = (xr - x).view(2, -1, block).abs()
        assert ((err <= top / 65534 + top * 1e-6) | (top < 1e-30)).all()  # half a step, and fp32 rounding
        assert (xr[1, 40:48] == 0).all()
    else:
        assert torch.equal(xr, x)
    _close(ck.panel_linear(x, lin.qweight, lin.scales, lin.mins, n, 4), xr @ w.t())
    x[0, 100] = float("nan")
    y = ck.panel_linear(x, lin.qweight, lin.scales, lin.mins, n, 4)
    assert torch.isnan(y[0]).all() and torch.isfinite(y[1]).all()


@pytest.mark.parametrize("n,g", [(96, 32), (33, 64), (5, 128)])
def test_panels_are_a_permutation(n, g):
    """to_panels / from_panels invert each other, and panel_rows (int8_panel_rows) read any rows back."""
    k = 256
    packed = qops.pack_int4(torch.randint(0, 16, (n, k)), g)
    scales, mins = torch.randn(n, k // g).half(), torch.randn(n, k // g).half()
    panels = qops.to_panels(packed, scales, mins, g)
    assert panels[0].shape == (-(-n // 32), k // g, g, 16) and panels[1].shape == (-(-n // 32), k // g, 32)
    for got, want in zip(qops.from_panels(*panels, n), (packed, scales, mins)):
        assert torch.equal(got, want)
    rows = torch.tensor([n - 1, 0, n // 2, n - 1])
    q, s, m = qops.panel_rows(*panels, rows, n)
    assert torch.equal(q, qops.unpack_int4_rows(packed, rows, g)) and torch.equal(s, scales[rows]) and torch.equal(m, mins[rows])
    q8, s8 = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.randn(n, k // g)
    p8 = qops.int8_to_panels(q8, s8)
    assert p8[0].shape == (-(-n // 32), k // g, g, 32) and p8[1].shape == (-(-n // 32), k // g, 32)
    q, s = qops.int8_panel_rows(*p8, rows, n)
    assert torch.equal(q, q8[rows]) and torch.equal(s, s8[rows])


def _panel_weights(n: int, k: int, g: int, bits: int, mins: bool, scale_dtype: torch.dtype):
    """Random values of `bits` bits with scales (fp16 values, or fp32 ones that are not) and mins."""
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8) if bits == 8 else torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
    s = (torch.rand(n, k // g) * 0.01 + 1e-3).half().float()
    if scale_dtype == torch.float32:
        s = s * (1 + torch.randint(1, 64, s.shape) / 64)  # 17 significant bits, as a K-quant's d * sc
    m = (torch.randn(n, k // g) * 0.01).half().float() if mins else None
    return q, s, m


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("n,k,g", [(70, 256, 16), (33, 512, 32), (40, 1536, 64)])
@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_panel_linear_every_format(bits, n, k, g, mins, scale_dtype):
    """The one panel kernel for every width (GGUF's 4, 5, 6-bit and int8 blocks), group (K-quants'
    16), fp16 / fp32 scales, stored or implied mins: against the float weights the format defines
    (w = s * q + m; without mins w = s * (q - 2^(bits-1)), int8 w = s * q), at every row count."""
    from fasterllama.quant.linear import PackedLinear

    q, s, m = _panel_weights(n, k, g, bits, mins, scale_dtype)
    lin = PackedLinear(q, s, m, bits)
    assert lin.scales.dtype == scale_dtype
    qf = q.float().view(n, -1, g)
    w = (qf * s[..., None] + m[..., None]) if mins else (qf - (0 if bits == 8 else 1 << (bits - 1))) * s[..., None]
    w = w.view(n, k)
    assert torch.equal(lin.dequantize(), w)
    rows = torch.tensor([n - 1, 0, 5])
    assert torch.equal(lin.dequantize_rows(rows, torch.float32), w[rows])
    for m_rows in ROWS:
        x = torch.randn(m_rows, k)
        _close(ck.panel_linear(x, lin.qweight, lin.scales, lin.mins, n, bits), ck.gemv_x(x, g) @ w.t())
    x = torch.randn(3, k)
    _close(qops.panel_linear(x, lin.qweight, lin.scales, lin.mins, n, bits), x @ w.t())


@pytest.mark.parametrize("bits,g,gps", [(4, 32, 8), (5, 32, 8), (6, 16, 16), (4, 16, 16), (2, 16, 16), (3, 16, 16)])
@pytest.mark.parametrize("mins", [False, True])
def test_factored_scales(bits, g, gps, mins):
    """Scales and mins as a K-quant holds them (int8 sub-block values times an fp16 value per gps
    groups, PackedLinear's factored form): every kernel (GEMV at each row count, the prefill GEMM)
    and the float reference against the weights the products define; a quarter of fp32's bytes."""
    from fasterllama.quant.linear import PackedLinear

    n, k = 70, 1024
    G = k // g
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
    sub, sup = torch.randint(-32, 64, (n, G), dtype=torch.int8), (torch.rand(n, G // gps) * 0.01 + 1e-3).half()
    msub, msup = (torch.randint(0, 64, (n, G), dtype=torch.int8), (-torch.rand(n, G // gps) * 0.01).half()) if mins else (None, None)
    lin = PackedLinear(q, sub, msub, bits, scale_super=sup, min_super=msup)
    s = sub.float() * sup.float().repeat_interleave(gps, 1)
    m = msub.float() * msup.float().repeat_interleave(gps, 1) if mins else -(1 << (bits - 1)) * s
    w = (q.float().view(n, G, g) * s[..., None] + m[..., None]).view(n, k)
    assert lin.scales.dtype == torch.int8 and torch.equal(lin.dequantize(), w)
    rows = torch.tensor([n - 1, 0, 37])
    assert torch.equal(lin.dequantize_rows(rows, torch.float32), w[rows])
    assert all(torch.equal(a, b) for a, b in zip(lin.rows_layout(), (q, s, m if mins else None)) if b is not None)
    scale_bytes = sum(t.numel() * t.element_size() for t in (lin.scales, lin.mins, lin.scale_super, lin.min_super) if t is not None)
    padded = -(-n // 32) * 32  # panels of 32 rows
    assert scale_bytes * 8 / (padded * k) == (2 if mins else 1) * (8 + 16 / gps) / g  # int8 + fp16 / gps a group: not fp32's 32
    for m_rows in ROWS:
        x = torch.randn(m_rows, k)
        _close(ck.panel_linear(x, lin.qweight, lin.scales, lin.mins, n, bits, None, lin.sups), ck.gemv_x(x, g) @ w.t())
    x = torch.randn(3, k)
    _close(qops.panel_linear(x, lin.qweight, lin.scales, lin.mins, n, bits, None, lin.sups), x @ w.t())


@pytest.mark.parametrize("factored", [False, True])
@pytest.mark.parametrize("n,k", [(70, 256), (33, 1536)])
def test_nl4_values_through_the_table(n, k, factored):
    """Width code NL4 (GGUF's IQ4_NL and IQ4_XS): 4-bit indices into IQ4_NL's 16 int8 values, w =
    scale * NL4_VALUES[q], with fp16 scales per 32 (IQ4_NL) or int8 x fp16 per 256 (IQ4_XS): every
    kernel (GEMV at each row count, the prefill GEMM) and the float reference against the table."""
    from fasterllama.quant.linear import PackedLinear

    g, G = 32, k // 32
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    if factored:
        sub, sup = torch.randint(-32, 32, (n, G), dtype=torch.int8), (torch.rand(n, G // 8) * 0.01 + 1e-3).half()
        lin = PackedLinear(q, sub, None, qops.NL4, scale_super=sup)
        s = sub.float() * sup.float().repeat_interleave(8, 1)
    else:
        s = (torch.rand(n, G) * 0.01 + 1e-3).half().float()
        lin = PackedLinear(q, s, None, qops.NL4)
    w = (torch.tensor(qops.NL4_VALUES, dtype=torch.float32)[q.long()].view(n, G, g) * s[..., None]).view(n, k)
    assert torch.equal(lin.dequantize(), w) and lin.qweight.shape[-1] == 16  # 4-bit panels
    assert torch.equal(lin.dequantize_rows(torch.tensor([n - 1, 0]), torch.float32), w[[n - 1, 0]])
    for m_rows in ROWS + [200]:
        x = torch.randn(m_rows, k)
        _close(ck.panel_linear(x, lin.qweight, lin.scales, lin.mins, n, qops.NL4, None, lin.sups), ck.gemv_x(x, g) @ w.t())


@pytest.mark.parametrize("n,g", [(96, 32), (33, 64)])
def test_pack_panels_is_the_int4_and_int8_layout(n, g):
    """pack_panels at 4 and 8 bits is to_panels' and int8_to_panels' layout: one kernel serves all."""
    k = 256
    q4 = torch.randint(0, 16, (n, k))
    s, m = torch.randn(n, k // g).half(), torch.randn(n, k // g).half()
    assert torch.equal(qops.pack_panels(q4, g, 4), qops.to_panels(qops.pack_int4(q4, g), s, m, g)[0])
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    assert torch.equal(qops.pack_panels(q8, g, 8).view(torch.int8), qops.int8_to_panels(q8, torch.randn(n, k // g))[0])


@pytest.mark.parametrize("bits", [5, 6])
@pytest.mark.parametrize("n,k,g,factored,mins", [(70, 256, 16, True, True), (33, 1600, 32, False, False), (40, 512, 64, False, True),
                                                (64, 1024, 32, True, False), (96, 576, 32, False, True)])
def test_value_lanes_equal_planes(bits, n, k, g, factored, mins):
    """5 and 6-bit values in lanes (L5, L6: the AVX2 build's layout, pack_panels(lanes=True)) give
    bit for bit what the same values in bit planes give, through every kernel: the GEMV at each row
    count (its int16 x reads the lanes as stored), the prefill GEMM, gguf-a8's GEMVs and GEMM, the
    embedding lookup; with factored and fp32 scales, stored and implied mins, groups of 16-64, a
    padded last panel. The reference reads the lanes back (unpack_panels, panel_values)."""
    import copy

    from fasterllama.quant.linear import PackedLinear

    G = k // g
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
    if factored:
        sups = (torch.rand(n, G // (256 // g)) * 0.01 + 1e-3).half(), (-torch.rand(n, G // (256 // g)) * 0.01).half() if mins else None
        planes = PackedLinear(q, torch.randint(-32, 64, (n, G), dtype=torch.int8), torch.randint(0, 64, (n, G), dtype=torch.int8) if mins else None, bits,
                              scale_super=sups[0], min_super=sups[1])
    else:
        _, s, m = _panel_weights(n, k, g, bits, mins, torch.float32)
        planes = PackedLinear(q, s, m, bits)
    planes.qweight = torch.nn.Parameter(qops.pack_panels(q, g, bits, lanes=False), requires_grad=False)
    lanes = copy.deepcopy(planes)
    lanes.qweight = torch.nn.Parameter(qops.pack_panels(q, g, bits, lanes=True), requires_grad=False)
    assert planes.qweight.dtype == torch.uint8 and lanes.qweight.dtype == torch.int16 and lanes.qweight.data_ptr() % 64 == 0
    assert lanes.qweight.numel() * 2 == -(-n // 32) * 32 * k * {5: 11, 6: 12}[bits] // 16  # 5.5 / 6 bits a value
    assert torch.equal(qops.unpack_panels(lanes.qweight, bits, n), q)
    rows = torch.tensor([n - 1, 0, 31, 32])
    assert torch.equal(qops.panel_values(lanes.qweight, bits, rows, n), q[rows].view(-1, G, g).int())
    assert torch.equal(lanes.dequantize(), planes.dequantize())
    both = [(lin.qweight, lin.scales, lin.mins, n, bits, None, lin.sups) for lin in (planes, lanes)]
    for m_rows in (1, 2, 3, 17, 200):
        x = torch.randn(m_rows, k)
        assert torch.equal(*(ck.panel_linear(x, *args) for args in both))
        if g == 16 or g % 32 == 0:
            assert torch.equal(*(ck.panel_linear_a8(x, *args) for args in both))
    ids = torch.tensor([0, n - 1, 31, 32, 5, 5])
    assert torch.equal(*(ck.dequantize_panel_rows(lin.qweight, lin.scales, lin.mins, bits, ids, n, torch.float32, lin.sups) for lin in (planes, lanes)))


def test_packed_panels_are_cache_line_aligned():
    """Panels start on a 64-byte boundary, large ones included (a vocabulary-sized table stays where
    packing put it): misaligned, every vector load of the GEMV kernels splits across two cache
    lines (numpy's allocation at 16 bytes past a page cost decode steps ~8% through the lm_head)."""
    for n, k in ((64, 64), (8192, 576)):
        assert qops.pack_panels(torch.randint(0, 32, (n, k)), 32, 5).data_ptr() % 64 == 0


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k,g", SHAPES)
@pytest.mark.parametrize("per_channel", [False, True])
def test_int8_linear(m, n, k, g, per_channel):
    x = torch.randn(m, k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) if per_channel else torch.rand(n, k // g)
    _close(ck.panel_linear(x, *qops.int8_to_panels(q, scale), None, n, 8), qops.int8_weight_linear(ck.gemv_x(x, k if per_channel else g), q, scale))


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 8])
@pytest.mark.parametrize("m,n,k,g", [(403, 70, 1600, 32), (200, 33, 512, 16), (29, 96, 576, 576)])
def test_panel_gemm_blocks(bits, m, n, k, g):
    """The prefill GEMM (more than GEMV_MAX_ROWS rows) over its blocks: rows past one pass of
    GEMM_MC (192) and not a multiple of the register tile (the threads' shares of (rows, panel)
    items, taken from each other's backs when done), columns in several dequantized blocks of
    unequal size (50 groups of 32: 17 + 17 + 16), groups of 16, one group per row (per channel: a
    block of its own), a padded last panel, a bias."""
    from fasterllama.quant.linear import PackedLinear

    q, s, mins = _panel_weights(n, k, g, bits, True, torch.float32)
    lin = PackedLinear(q, s, mins, bits)
    x, bias = torch.randn(m, k), torch.randn(n)
    _close(ck.panel_linear(x, lin.qweight, lin.scales, lin.mins, n, bits, bias), x @ lin.dequantize().t() + bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 40])
def test_panel_kernels_take_16_bit_x_in_fp32(monkeypatch, dtype, m):
    """bf16/fp16 x (a 16-bit model on the CPU): the kernels on x in fp32, the result rounded to x's
    dtype; never the reference, which dequantizes every weight each call (~3 s a token)."""
    from fasterllama.quant.linear import PackedLinear

    n, k, g = 70, 256, 32
    q, s, mins = _panel_weights(n, k, g, 4, True, torch.float32)
    lin = PackedLinear(q, s, mins, 4)
    x, bias = torch.randn(m, k).to(dtype), torch.randn(n)
    args = (lin.qweight, lin.scales, lin.mins, n, 4, bias)
    want = ck.panel_linear(x.float(), *args).to(dtype), ck.panel_linear_a8(x.float(), *args).to(dtype)
    monkeypatch.setattr(qops, "panel_linear", None)  # (the reference: a call would raise)
    monkeypatch.setattr(qops, "panel_linear_a8", None)
    got = ck.panel_linear(x, *args), ck.panel_linear_a8(x, *args)
    assert [t.dtype for t in got] == [dtype, dtype]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8, qops.NL4])
@pytest.mark.parametrize("m,n,k,g,factored", [(17, 70, 256, 16, True), (300, 33, 1600, 32, False), (40, 96, 576, 576, False),
                                              (29, 40, 512, 64, False), (60, 64, 1024, 32, True),
                                              (1, 70, 256, 16, True), (2, 33, 1600, 32, False), (1, 96, 576, 576, False),
                                              (2, 40, 512, 64, False), (1, 64, 1024, 32, True)])
@pytest.mark.parametrize("mins", [False, True])
def test_panel_gemm_a8(bits, m, n, k, g, factored, mins):
    """quantization "gguf-a8"'s GEMM, and its GEMVs (1-2 rows): x rounded to int8 per chunk of
    min(g, 32) columns, integer dot products against every width's values, the scales per chunk.
    Against its reference (the float panel product of round_activations(x)): row blocks past A8_MC
    (256) and not a multiple of the register tile, columns in several blocks with a short last one,
    groups of 16 / 32 / 64 / a whole row, factored K-quant scales, stored and implied mins, a bias,
    a padded last panel; an all-zero row, an outlier."""
    from fasterllama.quant.linear import PackedLinear

    if mins and bits in (8, qops.NL4):
        pytest.skip("int8 and IQ4 values have no mins")
    G = k // g
    vbits = 4 if bits == qops.NL4 else bits
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8) if bits == 8 else torch.randint(0, 1 << vbits, (n, k), dtype=torch.uint8)
    if factored:
        gps = 256 // g
        sups = (torch.rand(n, G // gps) * 0.01 + 1e-3).half(), (-torch.rand(n, G // gps) * 0.01).half() if mins else None
        subs = torch.randint(-32, 64, (n, G), dtype=torch.int8), torch.randint(0, 64, (n, G), dtype=torch.int8) if mins else None
        lin = PackedLinear(q, subs[0], subs[1], bits, scale_super=sups[0], min_super=sups[1])
    else:
        q_, s, mn = _panel_weights(n, k, g, 8, mins, torch.float32)
        lin = PackedLinear(q, s, mn, bits)
    x, bias = torch.randn(m, k), torch.randn(n)
    x[0, : k if m > 1 else k // 2] = 0  # (one row: its first half)
    x[-1, 3 + k // 2] = 50.0  # one chunk's scale 50 / 127: its other values round coarsely, other chunks not
    want = qops.panel_linear_a8(x, lin.qweight, lin.scales, lin.mins, n, bits, bias, lin.sups)
    _close(want, qops.round_activations(x, min(g, 32)) @ lin.dequantize().t() + bias)
    _close(ck.panel_linear_a8(x, lin.qweight, lin.scales, lin.mins, n, bits, bias, lin.sups), want)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8, qops.NL4])
@pytest.mark.parametrize("g,factored,mins", [(32, False, False), (32, False, True), (16, True, True), (32, True, False)])
def test_panel_rows_lookup(bits, g, factored, mins):
    """The quantized embedding's lookup in C (rows read from their panels) equals the reference's
    floats bit for bit: every width, fp16 and factored scales, stored and implied mins, repeated ids,
    both ends of the table; ids out of range raise as the reference does."""
    from fasterllama.quant.linear import PackedLinear

    if mins and bits in (8, qops.NL4):
        pytest.skip("int8 and IQ4 values have no mins")
    n, k = 100, 512
    G = k // g
    vbits = 4 if bits == qops.NL4 else bits
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8) if bits == 8 else torch.randint(0, 1 << vbits, (n, k), dtype=torch.uint8)
    if factored:
        sups = (torch.rand(n, G // (256 // g)) * 0.01).half(), (torch.rand(n, G // (256 // g)) * 0.01).half() if mins else None
        lin = PackedLinear(q, torch.randint(1, 60, (n, G)).to(torch.int8), torch.randint(-60, 0, (n, G)).to(torch.int8) if mins else None, bits,
                           scale_super=sups[0], min_super=sups[1])
    else:
        lin = PackedLinear(q, (torch.rand(n, G) * 0.01).half().float(), (torch.rand(n, G) * 0.01).half().float() if mins else None, bits)
    args = (lin.qweight, lin.scales, lin.mins, bits)
    ids = torch.tensor([0, 99, 31, 32, 64, 5, 5])
    got = ck.dequantize_panel_rows(*args, ids, n, torch.float32, lin.sups)
    assert torch.equal(got, qops.dequantize_panel_rows(*args, ids, n, torch.float32, lin.sups))
    assert torch.equal(got, lin.dequantize()[ids])
    with pytest.raises(IndexError):
        ck.dequantize_panel_rows(*args, torch.tensor([3, n]), n, torch.float32, lin.sups)


def test_round_activations():
    """int8 per chunk, scale absmax / 127: every value a multiple of its chunk's scale within half a
    step of x, |q| <= 127, the absmax kept to fp32 rounding (127 * (a / 127) is not always a: 3% of
    random inputs), zero chunks zero."""
    torch.manual_seed(15)  # (a seed whose absmax does not come back exactly)
    x = torch.randn(5, 64) * torch.tensor([1.0, 100.0]).repeat_interleave(32)
    x[2, :32] = 0
    r = qops.round_activations(x, 32)
    scale = x.view(5, 2, 32).abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    steps = (r.view(5, 2, 32) / scale).round()
    assert torch.equal(steps * scale, r.view(5, 2, 32)) and steps.abs().max() <= 127
    assert ((r - x).view(5, 2, 32).abs() <= scale / 2 * (1 + 1e-5)).all()
    torch.testing.assert_close(r.abs().amax(-1), x.abs().amax(-1), rtol=2**-23, atol=0)
    assert torch.equal(r[2, :32], torch.zeros(32))


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("k", [128, 1056])  # 1056: long rows, walked in column blocks when m > 4
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_linear(m, k, dtype):
    """fp32 x times weights in fp32, or fp16 / bf16 as a checkpoint stores them: a 16-bit matrix
    gives its fp32 copy's result to the bit (exact widening, the same sums)."""
    x, w, b = torch.randn(2, m, k), torch.randn(73, k).to(dtype), torch.randn(73)  # odd: a last single row
    y = ck.linear(x, w, b)
    _close(y, F.linear(x, w.float(), b))
    assert torch.equal(y, ck.linear(x, w.float(), b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sgemm_widens_16bit_weights_in_blocks(monkeypatch, dtype):
    """Prefill rows times a 16-bit matrix: widened in one piece where it fits WIDEN_BYTES (the fp32
    copy's product to the bit), else a block of rows at a time (here 7 rows of 96, so blocks and a
    last short one; the GEMM may sum a narrower block in another order), the bias cut with them."""
    x, w, b = torch.randn(40, 96), torch.randn(50, 96).to(dtype), torch.randn(50)
    expected = ck.sgemm(x, w.float(), b)
    assert torch.equal(ck.sgemm(x, w, b), expected)
    assert torch.equal(ck.linear(x, w), ck.sgemm(x, w.float()))  # (40 rows: past the GEMV's)
    monkeypatch.setattr(ck, "WIDEN_BYTES", 7 * 96 * 4)
    _close(ck.sgemm(x, w, b), expected)
    _close(ck.sgemm(x, w), ck.sgemm(x, w.float()))


@pytest.mark.parametrize("m", [17, 128])
def test_sgemm_is_fp32_accurate_and_keeps_autograd(m):
    """The many-row GEMM (oneDNN where torch has it) must be an fp32 GEMM: a bf16 or TF32-like one
    misses the fp64 result by ~1e-3 of its scale, fp32 by ~1e-6."""
    x, w, b = torch.randn(m, 576), torch.randn(200, 576), torch.randn(200)
    _close(ck.sgemm(x, w, b).double(), F.linear(x.double(), w.double(), b.double()), 1e-5)
    w.requires_grad_()
    ck.sgemm(x, w, b).sum().backward()
    assert torch.allclose(w.grad, x.sum(0).expand_as(w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("k", [64, 96, 1536])  # 96: a last 32 columns
def test_w8a8_linear_is_exact(m, k):
    """int8 x int8 sums are exact: the kernel equals the int32 reference GEMM, dequantized."""
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    q = torch.randint(-127, 128, (70, k), dtype=torch.int8)
    xs, ws, bias = torch.rand(m) + 0.01, torch.rand(70) + 0.01, torch.randn(70)
    expected = qops.dequantize_gemm(qops.int8_gemm(xq, q.t()), xs, ws, bias, torch.float32)
    assert torch.equal(ck.w8a8_linear(xq, xs, q, ws, bias), expected)
    assert torch.equal(ck.w8a8_linear(xq, xs, q, ws), qops.dequantize_gemm(qops.int8_gemm(xq, q.t()), xs, ws, None, torch.float32))


@pytest.mark.parametrize("m,k", [(17, 96), (40, 1024), (33, 2500)])  # 2500: two whole chunks of K and a part
def test_int8_gemm_via_fp32_is_exact(m, k):
    """The int8 GEMM of CPUs without VNNI (fp32 GEMMs over chunks of K) equals torch._int_mm to the
    last bit, at the extremes too: every product -128 x -128 sums to exactly 2^24 in a chunk."""
    xq = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    q = torch.randint(-128, 128, (24, k), dtype=torch.int8)
    xq[0], q[0], q[1] = -128, -128, 127
    got = ck.int8_gemm_via_fp32(xq, q.t())
    assert got.dtype == torch.int32 and torch.equal(got, torch._int_mm(xq, q.t()))
    assert got[0, 0].item() == 128 * 128 * k
    from fasterllama.backends import get_backend

    get_backend(torch.device("cpu")).register_ops()
    assert (ops.get_op("int8_gemm", xq.device) is ck.int8_gemm_via_fp32) == (ck.load() is not None and not ck.has_vnni())


@pytest.mark.parametrize("static,clip", [(False, False), (True, False), (True, True)])
def test_quantize_rows_matches_reference(static, clip):
    x = torch.randn(5, 96) * torch.logspace(-2, 2, 5)[:, None]  # rows within and beyond the static range
    x[0, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 1e9, -1e9, 0.0]) * x[0].abs().max() / 127  # ties, clamping
    scale = torch.tensor(0.013) if static else None
    q, s = ck.quantize_rows(x, scale, clip)
    q_ref, s_ref = qops.quantize_per_token(x, scale, clip)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


def test_rms_norm_and_silu():
    x, w = torch.randn(5, 3, 96) * 3, torch.randn(96)
    _close(ck.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    r = torch.randn(5, 3, 96)
    (out, h), (out_ref, h_ref) = ck.add_rms_norm(x, r, w, 1e-5), ref.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, h_ref) and h.shape == x.shape  # the sum the residual stream carries on: exact
    _close(out, out_ref)
    gate_up = torch.randn(7, 2 * 40) * 6
    _close(ck.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))
    extreme = torch.tensor([[-100.0, -30, -1e-3, 0, 1e-3, 30, 100, 88] * 2])
    _close(ck.silu_and_mul(extreme), ref.silu_and_mul(extreme))



def test_quantized_silu_quantizes_the_c_silu():
    """w8a8 on the CPU quantizes the C SiLU·mul's values, as a tensor-parallel rank does (its
    SiluAndMul runs the C op and RowParallel quantizes the whole row): a row whose absmax is one
    where torch's SiLU and the C one differ in the last bit takes the same scale on both paths."""
    gates = torch.linspace(-6, 6, 4096).reshape(-1, 8)
    gate_up = torch.cat([gates, torch.ones_like(gates)], dim=1)
    differs = (ck.silu_and_mul(gate_up) != ref.silu_and_mul(gate_up)).any(dim=1)
    assert differs.any()  # (else this test could not tell the two apart)
    g = gate_up[differs]
    mask = ck.silu_and_mul(g) != ref.silu_and_mul(g)
    g[:, :8] = torch.where(mask, g[:, :8], 0.0)  # each row's absmax: an element where they differ
    from fasterllama.backends import get_backend

    get_backend(torch.device("cpu")).register_ops()
    q, s = ops.get_op("silu_and_mul_quant", torch.device("cpu"))(g)
    q_c, s_c = qops.quantize_per_token(ck.silu_and_mul(g))
    assert torch.equal(s, s_c) and torch.equal(q, q_c)
    assert not torch.equal(s, qops.quantize_per_token(ref.silu_and_mul(g))[1])


@pytest.mark.parametrize("n", [1, 7, 32, 77, 40001, 49152])
def test_argmax_is_torch_argmax(n):
    """Greedy decoding's argmax: torch's index on random rows, ties (the first), -inf rows and NaN
    (the first NaN), with lengths that leave a tail after the 32-wide loop; in long rows a NaN far
    after the largest value, and the largest value both early and late."""
    x = torch.randn(8, n)
    x[6, 0], x[6, n - 2] = 100.0, float("nan")  # the largest first, a NaN last: the NaN
    x[7, min(1, n - 1)] = x[7, n - 5 if n > 5 else 0] = 100.0  # the same largest value early and late: the first
    x[1] = x[1].round()  # ties, many of them
    x[2] = float("-inf")
    x[3, n // 2] = float("nan")
    x[4, n - 1] = x[4].max() + 1  # the largest in the tail
    x[5, : min(n, 3)] = float("inf")
    assert ck.argmax(x).tolist() == ref.argmax(x).tolist()
    assert ck.argmax(x[2:3]).tolist() == [0]
    assert ck.argmax_tokens(x) == ref.argmax_tokens(x) == ref.argmax(x).tolist()  # the sampler's list form
    assert ck.argmax_tokens(x[4:5]) == [n - 1]

def _to_paged(dense: torch.Tensor, bs: int = 16, seed: int = 0, head_major: bool = True) -> tuple[torch.Tensor, list[list[int]]]:
    """A per-sequence cache [seqs, kv_heads, max_len, d] as a paged one [blocks, kv_heads, bs, d]
    whose blocks are shuffled, and each sequence's block table. head_major: laid out as the engine
    does ([kv_heads, blocks, ...] in memory), else block after block."""
    S, KVH, L, d = dense.shape
    nb = -(-L // bs)
    perm = torch.randperm(S * nb, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [perm[s * nb : (s + 1) * nb] for s in range(S)]
    padded = torch.full((S, KVH, nb * bs, d), float("nan"))
    padded[:, :, :L] = dense
    paged = torch.empty(KVH, S * nb, bs, d).transpose(0, 1) if head_major else torch.empty(S * nb, KVH, bs, d)
    for s in range(S):
        for j, block in enumerate(tables[s]):
            paged[block] = padded[s, :, j * bs : (j + 1) * bs]
    return paged, tables


def _meta(starts: list[int], news: list[int], tables: list[list[int]], bs: int = 16) -> ops.AttentionMetadata:
    """A step whose sequence i has starts[i] tokens cached, news[i] new ones, blocks tables[i]."""
    positions, slot_mapping, offsets = [], [], [0]
    for start, n, table in zip(starts, news, tables):
        positions += range(start, start + n)
        slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        offsets.append(offsets[-1] + n)
    return ops.AttentionMetadata(torch.tensor(slot_mapping), torch.tensor(positions), ops.block_tables_tensor(tables, "cpu"), starts, offsets)


@pytest.mark.parametrize("d", [16, 24, 64])  # 16, 64: 512-bit attention loops on AVX-512; 24: 256-bit ones
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("bs,head_major", [(8, True), (16, False), (64, True)])
def test_rope_store_and_attention(heads, kv_heads, d, bs, head_major):
    """A mixed step (two decodes, one prefill chunk, one fresh prompt) through both op sets, on
    either cache layout."""
    paged, tables = _to_paged(torch.randn(4, kv_heads, 80, d), bs, head_major=head_major)
    order = [3, 0, 2, 1]
    meta = _meta([40, 7, 20, 0], [1, 1, 9, 13], [tables[i] for i in order], bs)
    T = meta.token_offsets[-1]
    qkv = torch.randn(T, (heads + 2 * kv_heads) * d)
    ang = meta.positions.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None]
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    caches = [paged, paged.clone().normal_()]
    mine = [c.clone() for c in caches]
    q_ref = ref.rope_and_store_kv(qkv, cos, sin, *caches, meta, heads, kv_heads, d)
    q = ck.rope_and_store_kv(qkv, cos, sin, *mine, meta, heads, kv_heads, d)
    _close(q, q_ref)
    torch.testing.assert_close(mine[0], caches[0], equal_nan=True, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine[1], caches[1], equal_nan=True, atol=1e-5, rtol=1e-5)
    _close(ck.attention(q, *mine, meta, d**-0.5), ref.attention(q_ref, *caches, meta, d**-0.5))
    decode_only = _meta([40, 7], [1, 1], [tables[3], tables[0]], bs)
    qd = torch.randn(2, heads, d)
    _close(ck.attention(qd, *mine, decode_only, 0.3), ref.attention(qd, *caches, decode_only, 0.3))


def test_rope_store_skips_padding_rows():
    """Slot -1 (a CUDA-graph padding row) rotates q but stores nothing."""
    heads, kv_heads, d, bs = 2, 1, 16, 8
    meta = ops.AttentionMetadata(torch.tensor([5, -1]), torch.tensor([5, 3]), ops.block_tables_tensor([[0], [1]], "cpu"), [5, 3], [0, 1, 2])
    qkv = torch.randn(2, (heads + 2 * kv_heads) * d)
    cos, sin = torch.rand(2, d), torch.rand(2, d)
    caches = [torch.zeros(2, kv_heads, bs, d) for _ in range(2)]
    mine = [c.clone() for c in caches]
    _close(ck.rope_and_store_kv(qkv, cos, sin, *mine, meta, heads, kv_heads, d), ref.rope_and_store_kv(qkv, cos, sin, *caches, meta, heads, kv_heads, d))
    assert torch.equal(mine[0], caches[0]) and torch.equal(mine[1], caches[1])
    assert mine[1][0, 0, 5].abs().sum() > 0 and mine[1][1].abs().sum() == 0


def _three_ways(llm, prompts, params) -> list[tuple[list[list[int]], list]]:
    """(token ids, logprobs) of greedy runs three ways: decode steps as one C call (the default on
    CPU), the C kernels op by op, and the PyTorch reference ops."""
    runner = llm.engine.runner
    assert runner.decode_plan is not None

    def run() -> tuple[list[list[int]], list]:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [o.token_ids for o in outs], [o.logprobs for o in outs]

    results = [run()]
    runner.decode_plan, plan = None, runner.decode_plan
    saved = dict(ops._BACKENDS.get("cpu", {}))
    try:
        results.append(run())
        ops._BACKENDS["cpu"] = {}
        results.append(run())
    finally:
        ops._BACKENDS["cpu"] = saved
        runner.decode_plan = plan
    return results


def _with_and_without_plan(llm, prompts, params) -> list[list]:
    """llm.generate's outputs through the one-call C step, then op by op (the plan set aside)."""
    runner = llm.engine.runner
    plan, runs = runner.decode_plan, []
    try:
        for use_plan in (True, False):
            runner.decode_plan = plan if use_plan else None
            llm.engine.blocks.reset_prefix_cache()
            runs.append(llm.generate(prompts, params))
    finally:
        runner.decode_plan = plan
    return runs


@pytest.mark.parametrize("weights", ["q4_0", "q4_k_m"])
def test_prompts_in_one_call_equal_op_by_op(tmp_path, weights):
    """Steps with prompts go through the one-call C step too where the linears are panels: prompts
    chunked over several steps (attention over a cached prefix), prompt and decode rows in one
    step, a lone token, and only the rows that need logits. The prompts' log-probabilities equal
    the op-by-op forward's to the bit (the same kernels and RoPE tables), the tokens are the same."""
    import tiny_models as tm

    from fasterllama import LLM, SamplingParams

    # GQA with a head size of 16: the prefill attention kernel takes multiples of the vector width
    # (16 floats on AVX-512; the "gqa" spec's 8 run op by op there)
    path = tm.write_gguf(tm.build_hf_model(tm.SPECS["tied"]), str(tmp_path / "m.gguf"), weights)
    llm = LLM(path, progress=False, max_num_batched_tokens=24)
    plan = llm.engine.runner.decode_plan
    assert plan is not None and plan.prefill_rows > 0
    steps = []
    forward = plan.forward
    plan.forward = lambda ids, meta, rows=None: steps.append((meta.all_decode, ids.numel(), rows)) or forward(ids, meta, rows)
    prompts = [list(range(3, 60)), [5], [7, 8, 9] * 7]
    with_prompt = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)  # its last row's logits only
    params = [plain, with_prompt, with_prompt]  # the first step: the long prompt's first chunk, no row sampling
    runs = _with_and_without_plan(llm, prompts, params)
    prompt_steps = [s for s in steps if not s[0]]
    assert len(prompt_steps) >= 3 and all(n <= 24 for _, n, _ in prompt_steps)  # chunks, each through the plan
    assert any(rows == [] for _, _, rows in prompt_steps) and any(rows for _, _, rows in prompt_steps)
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs == b.prompt_logprobs
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-4 for k in x)


@pytest.mark.parametrize("quantization", [None, "w8-g32", "w4-g32", "w8a8", "w8a8-static-max", "w8a8-static-percentile99-clip"])
def test_model_same_with_and_without_kernels(tmp_path, quantization):
    """A tiny GQA model generates the same tokens and logits three ways: decode steps as one C call
    (the default on CPU), the C kernels op by op, and the PyTorch reference ops."""
    import tiny_models as tm

    from fasterllama import LLM, SamplingParams

    spec = tm.TinySpec("bias", num_heads=4, num_kv_heads=2, intermediate_size=96, attention_bias=True, mlp_bias=True)
    hf = tm.build_hf_model(spec)
    path = tm.save_hf_checkpoint(hf, str(tmp_path / "hf"))
    prompts = [list(range(3, 40)), [5, 9, 11], [7] * 20]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    (one_call, one_call_lp), (op_by_op, op_by_op_lp), (reference, reference_lp) = _three_ways(LLM(path, quantization=quantization), prompts, params)
    assert one_call == op_by_op == reference
    if quantization is None:  # and the float model is HF's
        assert one_call == [tm.hf_greedy(hf, p, 12) for p in prompts]
    # int8 activations: an ulp of difference before a quantizer (the C step's norm, SiLU and
    # attention sum in another order) can move one activation across a rounding boundary, one
    # int8 step; the integer kernels themselves are exact (test_w8a8_linear_is_exact). Weights in
    # panels: the AVX2 GEMVs round x to int16 (these steps' 3 rows; decode_tolerance)
    tol = 3e-2 if quantization and quantization.startswith("w8a8") else decode_tolerance() if quantization else 1e-4
    for a, b, c in zip(one_call_lp, op_by_op_lp, reference_lp):
        for sa, sb, sc in zip(a, b, c):
            for tok in sc:
                assert abs(sa[tok] - sc[tok]) < tol and abs(sb[tok] - sc[tok]) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_checkpoint_kept_as_stored(tmp_path, dtype):
    """A HF folder of bf16 / fp16 safetensors loads as stored by default (matrices, embedding and
    tied head 16-bit; norms, biases, activations and the KV cache fp32): half the fp32 copy's
    bytes, and its exact logits and tokens, in the one-call decode step, op by op and through the
    reference ops; the tokens are HF's on the same weights. quantization="none" expands to fp32."""
    import tiny_models as tm

    from fasterllama import LLM, SamplingParams

    spec = tm.TinySpec("bias16", num_heads=4, num_kv_heads=2, intermediate_size=96, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    hf = tm.build_hf_model(spec).to(dtype)
    path = tm.save_hf_checkpoint(hf, str(tmp_path / "hf"))
    hf = hf.float()
    kept, expanded = LLM(path, progress=False), LLM(path, quantization="none", progress=False)
    model = kept.engine.model
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == model.embed_tokens.weight.dtype == dtype
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[0].self_attn.qkv_proj.bias.dtype == model.norm.weight.dtype == kept.engine.kv_cache.layers[0][0].dtype == torch.float32
    assert expanded.engine.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    weight_bytes = [sum(p.numel() * p.element_size() for p in llm.engine.model.parameters()) for llm in (kept, expanded)]
    assert weight_bytes[0] < 0.55 * weight_bytes[1]
    prompts = [list(range(3, 40)), [5, 9, 11], [7] * 20]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    assert torch.equal(kept.compute_logits(prompts[0]), expanded.compute_logits(prompts[0]))
    (one_call, one_call_lp), (op_by_op, op_by_op_lp), (reference, reference_lp) = _three_ways(kept, prompts, params)
    assert one_call == op_by_op == reference == [tm.hf_greedy(hf, p, 10) for p in prompts]
    assert [o.outputs[0].logprobs for o in expanded.generate(prompts, params)] == one_call_lp  # to the bit
    for a, b in zip(one_call_lp, reference_lp):
        for sa, sb in zip(a, b):
            assert all(abs(sa[t] - sb[t]) < 1e-4 for t in sb)


def test_decode_inputs_in_the_plans_buffers(tmp_path):
    """Decode steps fill the plan's own input buffers (no tensors a step): block tables outgrowing
    the buffers' width (set to 2 blocks here), sequences of different lengths
    finishing at different steps (the batch shrinking from 3 to 1). Tokens and logprobs equal
    the op-by-op forward's."""
    import tiny_models as tm

    from fasterllama import LLM, SamplingParams

    path = tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["gqa"]), str(tmp_path / "hf"))
    llm = LLM(path, progress=False, block_size=8)
    plan = llm.engine.runner.decode_plan
    plan.decode_inputs.grow(2)
    fills = []
    fill = plan.decode_inputs.fill
    plan.decode_inputs.fill = lambda batch: fills.append(len(batch)) or fill(batch)
    prompts = [list(range(3, 170)), [5, 9], [7] * 30]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in (12, 5, 9)]
    runs = _with_and_without_plan(llm, prompts, params)
    assert plan.decode_inputs.width >= 23 and {1, 2, 3} <= set(fills)  # (179 tokens: 23 blocks)
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-4 for k in x)


@pytest.mark.parametrize("quantization", ["w4-g32", "w8-g32"])
def test_decode_step_past_eight_rows(tmp_path, quantization):
    """12 sequences decoding at once through a down projection of K = 1088 (past 2 x 512): the one
    C call runs such quantized linears 8 rows at a time, and gives the kernels' op-by-op tokens
    and logprobs."""
    import tiny_models as tm

    from fasterllama import LLM, SamplingParams

    spec = tm.TinySpec("long-rows", num_heads=4, num_kv_heads=2, intermediate_size=1088, mlp_bias=True)
    path = tm.save_hf_checkpoint(tm.build_hf_model(spec), str(tmp_path / "hf"))
    prompts = [[3 + i, 5 + 2 * i, 7] * (1 + i % 3) for i in range(12)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    (one_call, one_call_lp), (op_by_op, op_by_op_lp), _ = _three_ways(LLM(path, quantization=quantization), prompts, params)
    assert one_call == op_by_op
    for a, b in zip(one_call_lp, op_by_op_lp):
        for sa, sb in zip(a, b):
            for tok in sb:
                assert abs(sa[tok] - sb[tok]) < 1e-4


def test_decode_attention_ignores_rows_past_each_sequence():
    """Cache rows past a sequence's length may hold anything (torch.empty), NaN included; batched
    decode attention must not read them into the result (0 * NaN = NaN)."""
    d, lengths, order = 16, [5, 30, 12], [2, 0, 1]
    dense_k = torch.full((3, 2, 40, d), float("nan"))
    dense_v = torch.full((3, 2, 40, d), float("nan"))
    for s, n in zip(order, lengths):
        dense_k[s, :, :n] = torch.randn(2, n, d)
        dense_v[s, :, :n] = torch.randn(2, n, d)
    (k_cache, tables), (v_cache, _) = _to_paged(dense_k), _to_paged(dense_v)
    meta = _meta([n - 1 for n in lengths], [1, 1, 1], [tables[s] for s in order])
    q = torch.randn(3, 4, d)
    expected = torch.stack([
        F.scaled_dot_product_attention(q[i, :, None], dense_k[s, :, :n].repeat_interleave(2, 0), dense_v[s, :, :n].repeat_interleave(2, 0), scale=0.25)[:, 0]
        for i, (s, n) in enumerate(zip(order, lengths))
    ])
    _close(ref.attention(q, k_cache, v_cache, meta, 0.25), expected)
    _close(ck.attention(q, k_cache, v_cache, meta, 0.25), expected)


@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("group", range(1, 10))
@pytest.mark.parametrize("batch,kv_heads,threads", [(4, 2, 2), (1, 3, 2), (1, 2, 3), (1, 1, 2), (3, 1, 1)])
def test_decode_attention_every_group_size(group, d, batch, kv_heads, threads):
    """Batched decode attention against torch's SDPA for 1-9 query heads per KV head: with
    AVX-512 the heads of a group run together (1-8), else head by head. Where the (sequence, KV
    head) pairs do not divide between the threads, each pair's keys are split into parts and
    merged; lengths cover key tails of every size, a single key, and parts of unequal length,
    over shuffled cache blocks."""
    lengths = [1, 9, 300, 37][:batch] if batch > 1 else [259]
    order = [3, 0, 2, 1][:batch]
    dense_k, dense_v = torch.randn(4, kv_heads, 300, d), torch.randn(4, kv_heads, 300, d)
    (k_cache, tables), (v_cache, _) = _to_paged(dense_k), _to_paged(dense_v)
    q = torch.randn(batch, kv_heads * group, d)
    meta = _meta([n - 1 for n in lengths], [1] * batch, [tables[s] for s in order])
    expected = torch.stack([
        F.scaled_dot_product_attention(q[i, :, None], dense_k[s, :, :n].repeat_interleave(group, 0),
                                       dense_v[s, :, :n].repeat_interleave(group, 0), scale=0.3)[:, 0]
        for i, (s, n) in enumerate(zip(order, lengths))
    ])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the OpenMP pool the kernels share
    try:
        _close(ck.attention(q, k_cache, v_cache, meta, 0.3), expected)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 9])
@pytest.mark.parametrize("start,n", [(0, 2), (0, 150), (70, 13), (5, 100)])
def test_prefill_attention(group, d, start, n):
    """A sequence's new queries against its cache (a whole prompt, or a chunk after cached tokens)
    through the C kernel (where the head dim fills whole vectors) and through SDPA: the same
    outputs, and cache rows past the sequence (NaN here) never read in."""
    kv_heads = 2
    dense_k = torch.full((3, kv_heads, 260, d), float("nan"))
    dense_v = torch.full((3, kv_heads, 260, d), float("nan"))
    dense_k[1, :, : start + n] = torch.randn(kv_heads, start + n, d)
    dense_v[1, :, : start + n] = torch.randn(kv_heads, start + n, d)
    (k_cache, tables), (v_cache, _) = _to_paged(dense_k), _to_paged(dense_v)
    q = torch.randn(n, kv_heads * group, d)
    meta = _meta([start], [n], [tables[1]])
    _close(ck.attention(q, k_cache, v_cache, meta, 0.3), ref.attention(q, k_cache, v_cache, meta, 0.3))


def test_sample_rows_draws_the_reference_samplers_tokens():
    """The one-pass C sampler against the PyTorch sampler (engine/sampler.py) on rows of every
    kind: greedy, temperatures, top-k (1, some, past the vocabulary), top-p through the top-256
    candidates and through the full-sort fallback (a flat distribution), min-p, mixes. Tokens are
    equal except where the reference's two best scores tie to 1e-5 (rounding may order them apart)."""
    from fasterllama import SamplingParams
    from fasterllama.engine import sampler
    from fasterllama.engine.sequence import Sequence

    V, g = 3000, torch.Generator().manual_seed(3)
    rows, logits = [], []
    for i in range(96):
        params = SamplingParams(temperature=[0.0, 0.3, 0.8, 1.5][i % 4], top_k=[0, 1, 7, 50, V + 10][i % 5], top_p=[1.0, 0.9, 0.5, 0.99][i // 4 % 4],
                                min_p=[0.0, 0.05, 0.3][i // 16 % 3], seed=int(torch.randint(0, 2**62, (1,), generator=g)))
        seq = Sequence([1, 2, 3], params, None, params.seed)
        seq.output_token_ids = list(range(i % 7))  # steps 0..6
        rows.append((seq, []))
        logits.append(torch.randn(V, generator=g) * (0.01 if i % 6 == 5 else 4.0))  # every sixth flat: top-p falls back to the full sort
    logits = torch.stack(logits)
    b = sampler.sampling_batch(rows, V, [2], logits.device)
    want = sampler.reference_sample(logits, b)
    got = ck.sample_rows(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps)
    probs = sampler.probabilities(logits, b)
    scores = (probs / -torch.log(sampler.hashed_uniform(b.seeds, b.steps, V)).float()).topk(2, dim=-1).values
    near_tie = (scores[:, 0] - scores[:, 1]) <= 1e-5 * scores[:, 0]
    assert ((got == want) | near_tie).all()
    assert (got == want).float().mean() > 0.98
    assert len(set(want.tolist())) > 40  # the rows draw different tokens (not all the argmax)
    assert not torch.equal(want, logits.argmax(-1))


@pytest.mark.parametrize("g,nmax,rmin,nstep,use_mad", [(32, 15, -1.0, 20, False), (32, 31, -0.5, 15, False), (16, 3, -0.5, 15, True), (256, 15, -1.0, 20, False)])
def test_search_scale_min_is_the_reference(g, nmax, rmin, nstep, use_mad):
    """The quantizers' scale/min search (w4, Q4_K, Q5_K, Q2_K settings) in C picks what the torch
    steps pick: the same levels, scale and min for nearly every group (sums in another order move
    only near-ties), a worse candidate in none by more than the sums' fp32 noise; groups past a
    multiple of 8, dead, constant and all-positive groups included."""
    from fasterllama.quant.quantize import search_scale_min, search_scale_min_torch

    n = 2003
    x = torch.randn(n, g) * torch.rand(n, 1) * 4
    x[5] = 0.0
    x[7] = x[7].abs() + 0.5  # all positive: the min never goes above 0
    x[n - 1] = 1.0  # a constant group
    w = x.abs() if use_mad else torch.sqrt(2 * (x * x).mean(1, keepdim=True) + x * x)
    want = search_scale_min_torch(x, w, nmax, rmin, 0.1, nstep, use_mad)
    got = ck.search_scale_min(x, w, nmax, rmin, 0.1, nstep, use_mad)
    assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(got, want))
    assert torch.equal(got[2], torch.round(got[2]).clamp(0, nmax)) and torch.all(got[1] <= 0)
    same = (got[2] == want[2]).all(1)
    assert same.float().mean() > 0.97 and bool(same[[5, n - 1]].all())
    span = (want[0] * nmax - want[1])[same]  # refits divide differences of products: compare them to the group's range
    assert ((got[0][same] - want[0][same]).abs() <= 5e-4 * span + 1e-9).all()
    assert ((got[1][same] - want[1][same]).abs() <= 5e-4 * span + 1e-9).all()
    err = lambda s, m, lv: (w * ((s[:, None] * lv + m[:, None] - x).abs() if use_mad else (s[:, None] * lv + m[:, None] - x) ** 2)).sum(1)  # noqa: E731
    # both compare candidates by errors from sums that cancel (fp32 sums of g terms: noise up to ~g eps of the
    # group's sum of w x^2, 0.3% of a typical error at 32 levels): near-ties go either way; over all groups the errors agree
    noise = 4 * g * torch.finfo(torch.float32).eps * (w * x * x).sum(1)
    assert torch.all(err(*got) <= err(*want) * (1 + 1e-2) + noise) and err(*got).sum() <= err(*want).sum() * (1 + 1e-5)
    ck.register(ops.register)  # (as the CPU backend does): what the quantizers then call
    assert ops.registered("search_scale_min", "cpu") is ck.search_scale_min
    assert all(torch.equal(a, b) for a, b in zip(search_scale_min(x, w, nmax, rmin, 0.1, nstep, use_mad), got))


@pytest.mark.skipif(bool(os.environ.get("FASTERLLAMA_CFLAGS")), reason="already a custom build")
@pytest.mark.skipif("avx512f" not in ck._cpu_signature().split(), reason="no AVX-512: the native build is the AVX2 build, tested by every test")
def test_avx2_build_matches_reference():
    """The AVX2 code paths (the CI machine may lack AVX-512) pass the same op tests, built with
    -mno-avx512f into their own cached library."""
    env = {**os.environ, "FASTERLLAMA_CFLAGS": "-mno-avx512f"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not model and not avx2"],
        env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
