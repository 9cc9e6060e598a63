"""The Triton quantized linears (fasterllama/backends/cuda/triton_linear.py) against the PyTorch
reference ops of the same names in fasterllama/ops/quantized.py. On a GPU at 7B shapes; without
one under TRITON_INTERPRET=1 on CPU tensors at small shapes (M, N, K chosen so that the GEMV and
the tl.dot kernels, split-K and a single slice, and K tails all run)."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),  # the interpreter's
]

from fasterllama.backends.cuda import triton_linear as tlin
from fasterllama.backends.cuda import triton_norm as tn
from fasterllama.ops import quantized as ref

DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
if DEVICE == "cuda":
    SHAPES = [(4096, 4096), (22016, 4096), (4096, 11008)]  # (N, K)
    ROWS = [1, 7, 16, 64, 300]
else:
    SHAPES = [(48, 64), (96, 256)]  # K = 64: one K slice; K = 256: split-K in both kernels
    ROWS = [1, 3, 17, 40]  # GEMV (M <= 2 or 4), then tl.dot with BLOCK_M 16, 32, 64
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tol: float | None = None) -> None:
    """Relative Frobenius error, and the largest error against the largest reference value."""
    assert out.shape == expected.shape and out.dtype == expected.dtype and out.device == expected.device
    out, expected = out.float(), expected.float()
    tol = tol or (1e-5 if dtype == torch.float32 else 1e-2)
    rel = ((out - expected).norm() / expected.norm()).item()
    worst = ((out - expected).abs().max() / expected.abs().max()).item()
    assert rel < tol and worst < 10 * tol, f"relative error {rel:.2e}, max abs error / max |ref| {worst:.2e}"


def _int8_weight(N: int, K: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 weights with fp32 scales [N] (groups == 0) or fp16 ones [N, groups] (as the CUDA
    backend holds Q8_0's and w8-g32's: compact_scales); outputs of order 1."""
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=DEVICE)
    scale = (torch.rand(N, max(groups, 1), device=DEVICE) + 0.5) / (127 * math.sqrt(K))
    return q, scale[:, 0].contiguous() if groups == 0 else scale.half()


def _int4_weight(N: int, K: int, group_size: int, q4_0: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random pack_int4 weights with fp16 scales and mins (GGUF Q4_0's min = -8 * scale, or any)."""
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=DEVICE)
    scales = (torch.rand(N, K // group_size, device=DEVICE) + 0.5) / (8 * math.sqrt(K))
    mins = -8 * scales if q4_0 else scales * (4 * torch.randn_like(scales) - 8)
    return ref.pack_int4(q, group_size), scales.half(), mins.half()


def _x(M: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(M, K, device=DEVICE).to(dtype)


def _bias(N: int, dtype: torch.dtype, with_bias: bool) -> torch.Tensor | None:
    return torch.randn(N, device=DEVICE).to(dtype) if with_bias else None


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("group_size", [0, 32, 64])  # 0: per output channel
@pytest.mark.parametrize("N,K", SHAPES)
def test_int8_weight_linear(N: int, K: int, group_size: int, M: int, dtype: torch.dtype, with_bias: bool) -> None:
    q, scale = _int8_weight(N, K, K // group_size if group_size else 0)
    x, bias = _x(M, K, dtype), _bias(N, dtype, with_bias)
    _check(tlin.int8_weight_linear(x, q, scale, bias), ref.int8_weight_linear(x, q, scale, bias), dtype)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("N,K,group_size,q4_0", [(N, K, g, q4_0) for N, K in SHAPES for g, q4_0 in [(32, True), (64, False), (128, False)] if K % g == 0])
def test_int4_weight_linear(N: int, K: int, group_size: int, q4_0: bool, M: int, dtype: torch.dtype, with_bias: bool) -> None:
    packed, scales, mins = _int4_weight(N, K, group_size, q4_0)
    x, bias = _x(M, K, dtype), _bias(N, dtype, with_bias)
    expected = ref.int4_weight_linear(x, packed, scales, mins, group_size, bias)
    _check(tlin.int4_weight_linear(x, packed, scales, mins, group_size, bias), expected, dtype)
    if q4_0:  # (without its mins, as the CUDA backend holds Q4_0's: the kernels compute -8 * scale)
        _check(tlin.int4_weight_linear(x, packed, scales, None, group_size, bias), expected, dtype)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_int8_gemm_dequant(N: int, K: int, M: int, dtype: torch.dtype, with_bias: bool) -> None:
    xq = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=DEVICE)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=DEVICE)
    x_scale = (torch.rand(M, device=DEVICE) + 0.5) / 127
    w_scale = (torch.rand(N, device=DEVICE) + 0.5) / (127 * math.sqrt(K))
    bias = _bias(N, dtype, with_bias)
    expected = ref.dequantize_gemm(ref.int8_gemm(xq, q.t()), x_scale, w_scale, bias, dtype)
    _check(tlin.int8_gemm_dequant(xq, x_scale, q, w_scale, bias, dtype), expected, dtype, tol=1e-6 if dtype == torch.float32 else None)


@pytest.mark.parametrize("M", ROWS)
def test_int8_gemm_is_exact(M: int) -> None:
    """Unit scales: the output is the int32 accumulator itself (as fp32), split-K or not."""
    N, K = SHAPES[-1]
    xq = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=DEVICE)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=DEVICE)
    ones_m, ones_n = torch.ones(M, device=DEVICE), torch.ones(N, device=DEVICE)
    out = tlin.int8_gemm_dequant(xq, ones_m, q, ones_n, None, torch.float32)
    assert torch.equal(out, ref.int8_gemm(xq, q.t()).float())


@pytest.mark.parametrize("config", tlin.PREFILL_INT8_CONFIGS)
def test_int8_gemm_prefill_configs_are_exact(config) -> None:
    """Every tile config tune_prefill() may pick gives the exact int32 sums (M, N not multiples of
    the tiles; K of the K block)."""
    M, (N, K) = (300, SHAPES[-1]) if DEVICE == "cpu" else (2100, SHAPES[0])
    xq = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=DEVICE)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=DEVICE)
    out = tlin.int8_gemm_dequant(xq, torch.ones(M, device=DEVICE), q, torch.ones(N, device=DEVICE), None, torch.float32, config)
    assert torch.equal(out, ref.int8_gemm(xq, q.t()).float())


@pytest.mark.parametrize("K", [208, 200])  # 208: two K tiles, the last partial (TMA reads 0 past K); 200: rows not 16-byte aligned
def test_int8_gemm_tma_walks_every_tile(monkeypatch, K: int) -> None:
    """The persistent TMA kernel: two programs walk six output tiles (partial ones at M's and N's
    ends) with the bias; a K whose rows TMA cannot address takes the tiled kernel. Exact either way."""
    monkeypatch.setattr(tlin, "_num_sms", lambda device: 2)
    grids = []
    launch = tlin._int8_gemm_tma
    monkeypatch.setattr(tlin, "_int8_gemm_tma", lambda *args: grids.append(args[-1]) or launch(*args))
    M, N = 300, 200
    xq = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=DEVICE)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=DEVICE)
    bias = torch.randint(-8, 8, (N,), device=DEVICE).float()
    out = tlin.int8_gemm_dequant(xq, torch.ones(M, device=DEVICE), q, torch.ones(N, device=DEVICE), bias, torch.float32, (128, 128, 128, 8, 3, tlin.TMA))
    assert torch.equal(out, ref.int8_gemm(xq, q.t()).float() + bias)
    assert grids == ([(128, 128, 128, 8, 3)] if K % 16 == 0 else [])  # (the TMA kernel ran, or the tiled one)


def test_tune_prefill_keeps_the_fastest(monkeypatch, tmp_path) -> None:
    """tune_prefill() times each config once per distinct W8A8 shape (timings faked: the choice,
    not the clock), and GEMMs of PREFILL_ROWS rows or more take the fastest, smaller ones the defaults."""
    import tiny_models as tm

    from fasterllama.backends.cuda import gemv
    from fasterllama.loading.model_loader import load_model
    from fasterllama.quant import QuantConfig, quantize_model
    from fasterllama.quant.linear import W8A8Linear

    path = tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["mha"]), str(tmp_path))
    net = load_model(path, torch.float32, torch.device(DEVICE), None, True, progress=False).model
    quantize_model(net, QuantConfig.parse("w8a8-nosq"))  # (no calibration run)
    fastest = tlin.PREFILL_INT8_CONFIGS[1]
    monkeypatch.setattr(gemv, "_time", lambda fn: 0.5 if (fn.__defaults__ or [None])[0] == fastest else 1.0)
    monkeypatch.setattr(tlin, "_PREFILL_INT8", {})
    monkeypatch.setattr(tn, "_SILU_TUNED", {})
    monkeypatch.setattr(tn, "SILU_QUANT_RECOMPUTE", False)
    timings = tlin.tune_prefill(net, rows=32)  # (the interpreter: few rows)
    shapes = {(m.out_features, m.in_features) for m in net.modules() if isinstance(m, W8A8Linear)}
    assert timings.pop(("w8a8 silu quant", net.layers[0].mlp.down_proj.in_features, 32)) == {"read back": 1.0, "made again": 1.0}
    assert {k[1:3] for k in timings} == shapes and all(len(t) == len(tlin.PREFILL_INT8_CONFIGS) for t in timings.values())
    assert tlin._PREFILL_INT8 == dict.fromkeys(shapes, fastest)
    N, K = next(iter(shapes))
    q, w_scale = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=DEVICE), torch.ones(N, device=DEVICE)
    launched = []
    monkeypatch.setattr(tlin, "_dot_config", lambda M, **kw: launched.append(M) or (16, 64, 128, 4, 4))
    for M in (tlin.PREFILL_ROWS, tlin.PREFILL_ROWS - 1):
        xq = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=DEVICE)
        out = tlin.int8_gemm_dequant(xq, torch.ones(M, device=DEVICE), q, w_scale, None, torch.float32)
        assert torch.equal(out, ref.int8_gemm(xq, q.t()).float())
    assert launched == [tlin.PREFILL_ROWS - 1]  # the tuned tiles from PREFILL_ROWS rows on


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [2, 40] if DEVICE == "cpu" else [1, 64])
def test_k_tails_and_batched_input(M: int, dtype: torch.dtype) -> None:
    """K not a multiple of the K block (per channel: any K; per group: fewer groups than a block),
    and x with leading batch dimensions, not contiguous."""
    N = 40 if DEVICE == "cpu" else 4000
    x = torch.randn(2, M, 200 + 7, device=DEVICE).to(dtype)[..., :200]
    q, scale = _int8_weight(N, 200, 0)
    bias = _bias(N, dtype, True)
    _check(tlin.int8_weight_linear(x, q, scale, bias), ref.int8_weight_linear(x, q, scale, bias), dtype)
    x = x[..., :96]
    q, scale = _int8_weight(N, 96, 96 // 32)
    _check(tlin.int8_weight_linear(x, q, scale), ref.int8_weight_linear(x, q, scale), dtype)
    packed, scales, mins = _int4_weight(N, 96, 32, False)
    _check(tlin.int4_weight_linear(x, packed, scales, mins, 32), ref.int4_weight_linear(x, packed, scales, mins, 32), dtype)


def test_empty_input() -> None:
    q, scale = _int8_weight(48, 64, 0)
    assert tlin.int8_weight_linear(torch.empty(0, 64, device=DEVICE), q, scale).shape == (0, 48)
    assert tlin.int8_gemm_dequant(torch.empty(0, 64, dtype=torch.int8, device=DEVICE), torch.empty(0, device=DEVICE), q, scale, None, torch.bfloat16).shape == (0, 48)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("M", [1, 16])
def test_cuda_graph_capture(M: int) -> None:
    """The launchers capture into a CUDA graph (no host syncs) and replay on new inputs."""
    N, K = 4096, 4096
    q, scale = _int8_weight(N, K, K // 32)
    packed, scales, mins = _int4_weight(N, K, 32, True)
    w_scale = (torch.rand(N, device=DEVICE) + 0.5) / (127 * math.sqrt(K))
    x = _x(M, K, torch.bfloat16)
    xq = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=DEVICE)
    x_scale = torch.rand(M, device=DEVICE) / 127

    def run() -> list[torch.Tensor]:
        return [
            tlin.int8_weight_linear(x, q, scale),
            tlin.int4_weight_linear(x, packed, scales, mins, 32),
            tlin.int8_gemm_dequant(xq, x_scale, q, w_scale, None, torch.bfloat16),
        ]

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    x.copy_(_x(M, K, torch.bfloat16))
    xq.copy_(torch.randint(-127, 128, (M, K), dtype=torch.int8, device=DEVICE))
    graph.replay()
    for out, expected in zip(outs, run()):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", ROWS)
def test_gguf_k_quant_layouts(M: int, dtype: torch.dtype) -> None:
    """A GGUF K-quant file's tensors off the CPU (quant/gguf_native.py): Q6_K / Q3_K as int8 in
    groups of 16, Q4_K as 4-bit with fp32 scales and mins (a K-quant's d * sc needs up to 17 bits)."""
    N, K = SHAPES[-1]
    q, scale = _int8_weight(N, K, K // 16)
    x = _x(M, K, dtype)
    _check(tlin.int8_weight_linear(x, q, scale, None), ref.int8_weight_linear(x, q, scale, None), dtype)
    packed, scales, mins = _int4_weight(N, K, 32, False)
    scales, mins = scales.float() * (1 + 2**-14), mins.float() * (1 - 2**-13)  # not fp16 values
    assert not torch.equal(scales.half().float(), scales)
    _check(tlin.int4_weight_linear(x, packed, scales, mins, 32, None), ref.int4_weight_linear(x, packed, scales, mins, 32, None), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("group,levels", [(32, 32), (16, 4)])  # Q5_1 / Q5_K values 0..31; Q2_K's 0..3 in groups of 16
def test_int8_weight_linear_with_mins(M: int, dtype: torch.dtype, group: int, levels: int) -> None:
    """Values with a min per group (w = q * scale + min), as Q5_1, Q5_K and Q2_K tensors load off
    the CPU: the min term of each group is min * sum(x) in the GEMV kernel, part of the dequantized
    tile in the tensor-core one."""
    N, K = SHAPES[-1]
    g = torch.Generator(device="cpu").manual_seed(N + M + group)
    q = torch.randint(0, levels, (N, K), generator=g, dtype=torch.int8).to(DEVICE)
    scale = (torch.rand(N, K // group, generator=g) * 0.02 + 0.001).to(DEVICE)
    mins = (-torch.rand(N, K // group, generator=g) * levels * 0.01).to(DEVICE)
    x, bias = _x(M, K, dtype), _bias(N, dtype, True)
    want = ref.int8_weight_linear(x, q, scale, bias, mins)
    no_mins = ref.int8_weight_linear(x, q, scale, bias)
    assert (want.float() - no_mins.float()).abs().max() > 0.1  # the mins matter
    _check(tlin.int8_weight_linear(x, q, scale, bias, mins), want, dtype)


@pytest.mark.parametrize("M", [1, 5, 40])  # the GEMV-like kernel, the tl.dot one, the dequantized weight + F.linear
def test_int4_weight_linear_factored_scales(monkeypatch, M: int) -> None:
    """Q4_K's scales and mins in their factored form (int8 sub-block values times fp16 a
    super-block of 8 groups, as the CUDA backend holds them): the results of their float products."""
    monkeypatch.setattr(tlin, "DEQUANT_MIN_M", 32)
    N, K = 48, 512
    G = K // 32
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=DEVICE)
    sub_s, sub_m = (torch.randint(0, 64, (N, G), device=DEVICE, dtype=torch.int8) for _ in range(2))
    sups = ((torch.rand(N, G // 8, device=DEVICE) * 2e-3).half(), (-torch.rand(N, G // 8, device=DEVICE) * 2e-3).half())
    packed, x = ref.pack_int4(q, 32), _x(M, K, torch.bfloat16)
    want = ref.int4_weight_linear(x, packed, ref.factored(sub_s, sups[0]), ref.factored(sub_m, sups[1]), 32)
    _check(tlin.int4_weight_linear(x, packed, sub_s, sub_m, 32, sups=sups), want, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_dequantizes_once_then_cublas(monkeypatch, dtype: torch.dtype) -> None:
    """From DEQUANT_MIN_M rows the weight is written out in float into the reused buffer, then
    F.linear: every layout (int8 per channel, per group, with mins; 4-bit with fp16 and fp32
    scales) against the reference op; the buffer is reused across shapes."""
    monkeypatch.setattr(tlin, "DEQUANT_MIN_M", 8)
    monkeypatch.setattr(tlin, "_FLOAT_WEIGHT", {})
    N, K = SHAPES[-1]
    M = 9 if DEVICE == "cpu" else 600
    x, bias = _x(M, K, dtype), _bias(N, dtype, True)
    for groups in (0, K // 32, K // 16):
        q, scale = _int8_weight(N, K, groups)
        _check(tlin.int8_weight_linear(x, q, scale, bias), ref.int8_weight_linear(x, q, scale, bias), dtype)
    mins = -torch.rand(N, K // 32, device=DEVICE) * 0.01
    q, scale = _int8_weight(N, K, K // 32)
    q = q.abs()
    _check(tlin.int8_weight_linear(x, q, scale, bias, mins), ref.int8_weight_linear(x, q, scale, bias, mins), dtype)
    for group, q4_0 in ((32, True), (64, False)):
        packed, scales, mins4 = _int4_weight(N, K, group, q4_0)
        _check(tlin.int4_weight_linear(x, packed, scales, mins4, group, bias), ref.int4_weight_linear(x, packed, scales, mins4, group, bias), dtype)
        _check(tlin.int4_weight_linear(x, packed, scales.float(), mins4.float(), group, None),
               ref.int4_weight_linear(x, packed, scales.float(), mins4.float(), group, None), dtype)
        if q4_0:
            _check(tlin.int4_weight_linear(x, packed, scales, None, group, bias), ref.int4_weight_linear(x, packed, scales, mins4, group, bias), dtype)
    small = _x(M, 64, dtype)  # a smaller weight after a larger one: a view of the same buffer
    q, scale = _int8_weight(N // 2, 64, 2)
    _check(tlin.int8_weight_linear(small, q, scale), ref.int8_weight_linear(small, q, scale), dtype)
    assert len(tlin._FLOAT_WEIGHT) == 1 and next(iter(tlin._FLOAT_WEIGHT.values())).numel() == N * K
