"""The decode GEMVs (backends/cuda/gemv.py) against the reference ops, one and two activation rows:
on a GPU at real shapes, on the CPU under TRITON_INTERPRET=1 at small ones."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")

from fasterllama.backends.cuda import gemv
from fasterllama.ops import quantized
from fasterllama.quant.quantize import quantize_int4, quantize_int8

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
# (N, K): a K tail past one tile, N not a multiple of the row block, split-K
SHAPES = [(40, 96), (70, 1088)] if DEVICE == "cpu" else [(4096, 4096), (12288, 4096), (4096, 11008), (32000, 4096), (1728, 576)]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape and got.dtype == ref.dtype and torch.isfinite(got.float()).all()
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


CONFIGS = gemv.CONFIGS if DEVICE == "cpu" else gemv.CONFIGS[:1]  # (on a GPU: real shapes, one config; the interpreter: every config)


def _skip_extra_shapes(words: bool, shape: tuple[int, int]) -> None:
    """On a GPU the word-wise kernels run at the first two real shapes only: each shape compiles
    again, and a lent GPU session's kernel tests share a few minutes."""
    if words and DEVICE == "cuda" and shape not in SHAPES[:2]:
        pytest.skip("word-wise kernels: two real shapes on a GPU")


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_float_gemv(shape, dtype, rows, cfg) -> None:
    N, K = shape
    x = torch.randn(rows, K, device=DEVICE).to(dtype)
    w = (torch.randn(N, K, device=DEVICE) * 0.05).to(dtype)
    b = torch.randn(N, device=DEVICE).to(dtype)
    ref = (x.float() @ w.float().t() + b.float()).to(dtype)
    assert _rel(gemv.float_gemv(x, w, b, cfg), ref) < _tol(dtype)


# (CPU: 64 rows split over K, 32 rows unsplit, 32 rows split over K and prefetching)
INT8_WORD_CONFIGS = gemv.INT8_WORD_CONFIGS[::2] if DEVICE == "cpu" else gemv.INT8_WORD_CONFIGS[:1]


@pytest.mark.parametrize(("words", "cfg"), [(False, c) for c in CONFIGS] + [(True, c) for c in INT8_WORD_CONFIGS])
@pytest.mark.parametrize("group", [None, 32, 64])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_int8_gemv(shape, dtype, rows, group, words, cfg) -> None:
    """words: the kernel reading 32-bit words (exact values: the same sums as the byte-wise one)."""
    _skip_extra_shapes(words, shape)
    N, K = shape
    if group is not None and K % group:
        pytest.skip("group does not divide K")
    q, s = quantize_int8(torch.randn(N, K, device=DEVICE), group)
    if group is not None and dtype == torch.bfloat16:
        s = s.half()  # (group scales in fp16, as the CUDA backend holds them: the same values)
    x = torch.randn(1, rows, K, device=DEVICE).to(dtype)  # 3-D input: rows of a batch
    ref = quantized.int8_weight_linear(x.float(), q, s).to(dtype)  # fp32 sums, as the kernel's
    assert _rel(gemv.int8_gemv(x, q, s, cfg=cfg, words=words), ref) < _tol(dtype)


@pytest.mark.parametrize(("words", "cfg"), [(False, c) for c in CONFIGS[:2]] + [(True, INT8_WORD_CONFIGS[0])])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_int8_gemv_with_mins(shape, rows, group, words, cfg) -> None:
    """w = q * scale + min per group (Q5_1 / Q5_K / Q2_K off the CPU): the min term is min * sum(x)."""
    _skip_extra_shapes(words, shape)
    N, K = shape
    if K % group:
        pytest.skip("group does not divide K")
    q = torch.randint(0, 32, (N, K), device=DEVICE, dtype=torch.int8)
    s = torch.rand(N, K // group, device=DEVICE) * 0.02
    m = -torch.rand(N, K // group, device=DEVICE) * 0.3
    x = torch.randn(rows, K, device=DEVICE).to(torch.bfloat16)
    ref = quantized.int8_weight_linear(x.float(), q, s, None, m).to(torch.bfloat16)
    assert _rel(gemv.int8_gemv(x, q, s, cfg=cfg, mins=m, words=words), ref) < _tol(torch.bfloat16)


WORD_CONFIGS = gemv.WORD_CONFIGS[::2] if DEVICE == "cpu" else gemv.WORD_CONFIGS[:1]  # (CPU: as INT8_WORD_CONFIGS)


@pytest.mark.parametrize(("words", "cfg"), [(False, c) for c in CONFIGS] + [(True, c) for c in WORD_CONFIGS])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_int4_gemv(shape, dtype, rows, group, words, cfg) -> None:
    """words: the kernel reading 32-bit words, whose sums carry an offset (S = sum (1 + q/16) x) that
    costs fp32 about 1e-6 relative (the byte-wise kernel: 3e-7)."""
    _skip_extra_shapes(words, shape)
    N, K = shape
    if K % group:
        pytest.skip("group does not divide K")
    q, s, m = quantize_int4(torch.randn(N, K, device=DEVICE), group)
    packed, s16, m16 = quantized.pack_int4(q, group), s.half(), m.half()
    x = torch.randn(rows, K, device=DEVICE).to(dtype)
    b = torch.randn(N, device=DEVICE).to(dtype)
    ref = quantized.int4_weight_linear(x.float(), packed, s16, m16, group, b.float()).to(dtype)  # fp32 sums, as the kernel's
    assert _rel(gemv.int4_gemv(x, packed, s16, m16, group, b, cfg, words), ref) < _tol(dtype)


@pytest.mark.parametrize(("words", "cfg"), [(False, CONFIGS[0]), (True, WORD_CONFIGS[0]), (True, WORD_CONFIGS[-1])])
@pytest.mark.parametrize("rows", [1, 2])
def test_triton_int4_gemv_symmetric_groups(rows, words, cfg) -> None:
    """Q4_0's groups without their mins (w = scale * (q - 8), as the CUDA backend holds them): the
    kernels compute the min, and give what they give with it read."""
    N, K = SHAPES[-1]
    q = torch.randint(0, 16, (N, K), device=DEVICE)
    s16 = (torch.rand(N, K // 32, device=DEVICE) * 0.02).half()
    packed, m16 = quantized.pack_int4(q, 32), s16 * -8
    x = torch.randn(rows, K, device=DEVICE).to(torch.bfloat16)
    ref = quantized.int4_weight_linear(x.float(), packed, s16, m16, 32).to(torch.bfloat16)
    got = gemv.int4_gemv(x, packed, s16, None, 32, cfg=cfg, words=words)
    assert _rel(got, ref) < _tol(torch.bfloat16)
    assert torch.equal(got, gemv.int4_gemv(x, packed, s16, m16, 32, cfg=cfg, words=words))


def _q4_k_like(N: int, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """4-bit values with Q4_K's factored scales and mins: 6-bit sub-block values (int8) times an
    fp16 d (scales) or -dmin (mins) a super-block of 8 groups of 32. (packed, sub scales, sub mins, sups)."""
    G = K // 32
    q = torch.randint(0, 16, (N, K), device=DEVICE)
    sub_s, sub_m = (torch.randint(0, 64, (N, G), device=DEVICE, dtype=torch.int8) for _ in range(2))
    d = (torch.rand(N, G // 8, device=DEVICE) * 1e-3).half()
    dmin = (-torch.rand(N, G // 8, device=DEVICE) * 1e-3).half()
    return quantized.pack_int4(q, 32), sub_s, sub_m, (d, dmin)


@pytest.mark.parametrize(("words", "cfg"), [(False, CONFIGS[0]), (True, WORD_CONFIGS[0]), (True, WORD_CONFIGS[-1])])
@pytest.mark.parametrize("rows", [1, 2])
def test_triton_int4_gemv_factored_scales(rows, words, cfg) -> None:
    """Q4_K's scales and mins in their own form (int8 sub-block values times fp16 a super-block,
    as the CUDA backend holds a GGUF's Q4_K): the same as with their float products."""
    N, K = 40, 512
    packed, sub_s, sub_m, sups = _q4_k_like(N, K)
    s32, m32 = quantized.factored(sub_s, sups[0]), quantized.factored(sub_m, sups[1])
    x = torch.randn(rows, K, device=DEVICE).to(torch.bfloat16)
    ref = quantized.int4_weight_linear(x.float(), packed, s32, m32, 32).to(torch.bfloat16)
    torch.testing.assert_close(quantized.int4_weight_linear(x.float(), packed, sub_s, sub_m, 32, sups=sups).to(torch.bfloat16), ref)
    got = gemv.int4_gemv(x, packed, sub_s, sub_m, 32, cfg=cfg, words=words, sups=sups)
    assert _rel(got, ref) < _tol(torch.bfloat16)
    assert torch.equal(got, gemv.int4_gemv(x, packed, s32, m32, 32, cfg=cfg, words=words))


@pytest.mark.parametrize("cfg", WORD_CONFIGS)
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_int4_words_gemv_half_activations_as_bytes(dtype, rows, cfg) -> None:
    """With half-precision activations the word-wise kernel reads the high nibbles' values with the
    low half's bits below them (one mask fewer a pair) and takes their known part back per group:
    against the fp32 reference it is as accurate as the byte-wise kernel (fp16 shows a missed
    correction 6-35x, bf16's coarser rounding 1.1-2.4x)."""
    N, K = SHAPES[1]
    q, s, m = quantize_int4(torch.randn(N, K, device=DEVICE), 32)
    packed, s16, m16 = quantized.pack_int4(q, 32), s.half(), m.half()
    x = torch.randn(rows, K, device=DEVICE).to(dtype)
    ref = quantized.int4_weight_linear(x.float(), packed, s16, m16, 32)
    bytewise = _rel(gemv.int4_gemv(x, packed, s16, m16, 32, cfg=gemv.CONFIGS[0]).float(), ref)
    assert _rel(gemv.int4_gemv(x, packed, s16, m16, 32, cfg=cfg, words=True).float(), ref) < 1.25 * bytewise


GATED_CASES = [("float", False, CONFIGS[0]), ("int8", False, CONFIGS[0]), ("int8", True, INT8_WORD_CONFIGS[0]),
               ("int8-mins", True, INT8_WORD_CONFIGS[-1]), ("int8-mins", False, CONFIGS[-1]), ("int4", False, CONFIGS[0]),
               ("int4", True, WORD_CONFIGS[0]), ("int4", True, WORD_CONFIGS[-1])]


def _fused_and_separate(kind: str, words: bool, cfg, N: int, K: int, fused_in: torch.Tensor, separate_in: torch.Tensor, **fused):
    """(a GEMV of random `kind` weights [N, K] making its input from fused_in itself (gated or
    norm), the same GEMV of separate_in, made by the separate kernel)."""
    if kind == "float":
        w = (torch.randn(N, K, device=DEVICE) * 0.05).to(torch.bfloat16)
        b = torch.randn(N, device=DEVICE).to(torch.bfloat16)
        return gemv.float_gemv(fused_in, w, b, cfg, **fused), gemv.float_gemv(separate_in, w, b, cfg)
    if kind.startswith("int8"):
        q, s = quantize_int8(torch.randn(N, K, device=DEVICE), 32)
        m = -torch.rand(N, K // 32, device=DEVICE) * 0.3 if kind == "int8-mins" else None
        return gemv.int8_gemv(fused_in, q, s, None, cfg, m, words=words, **fused), gemv.int8_gemv(separate_in, q, s, None, cfg, m, words=words)
    q, s, m = quantize_int4(torch.randn(N, K, device=DEVICE), 32)
    packed, s16, m16 = quantized.pack_int4(q, 32), s.half(), m.half()
    return (gemv.int4_gemv(fused_in, packed, s16, m16, 32, None, cfg, words, **fused),
            gemv.int4_gemv(separate_in, packed, s16, m16, 32, None, cfg, words))


@pytest.mark.parametrize(("kind", "words", "cfg"), GATED_CASES)
@pytest.mark.parametrize("rows", [1, 2])
def test_triton_gemv_gated_is_silu_mul_then_gemv(kind, words, cfg, rows) -> None:
    """gated: the GEMV reads a fused [gate | up] row and multiplies SiLU(gate) * up, rounded as the
    SiLU·mul kernel rounds it (the down projection without that kernel's launch): the same as the
    kernel then the GEMV."""
    from fasterllama.backends.cuda import triton_norm

    N, K = SHAPES[1] if DEVICE == "cpu" else SHAPES[2]
    gate_up = torch.randn(rows, 2 * K, device=DEVICE).to(torch.bfloat16)
    got, want = _fused_and_separate(kind, words, cfg, N, K, gate_up, triton_norm.silu_and_mul(gate_up), gated=True)
    assert got.shape == (rows, N) and _rel(got, want) < 1e-6


@pytest.mark.parametrize(("kind", "words", "cfg"), GATED_CASES)
@pytest.mark.parametrize(("rows", "residual"), [(2, True), (1, False)])
def test_triton_gemv_normed_is_rms_norm_then_gemv(kind, words, cfg, rows, residual, monkeypatch) -> None:
    """norm: the GEMV's programs make RMSNorm(h + residual) themselves and one stores h + residual
    (a layer's qkv and gate_up projections without the norm kernel's launch): the same as the norm
    kernel then the GEMV, to within the rounding of a sum of squares taken in another order."""
    from fasterllama.backends.cuda import triton_norm

    if kind == "int4" and cfg == WORD_CONFIGS[0]:
        monkeypatch.setattr(gemv, "NORM_BLOCK", 256)  # the prologue in chunks (past the hidden sizes of most models)
    N, K = SHAPES[1] if DEVICE == "cpu" else SHAPES[0]
    h, res = (torch.randn(rows, K, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    w_norm = (1 + 0.2 * torch.randn(K, device=DEVICE)).to(torch.bfloat16)
    if residual:
        x, want_res = triton_norm.add_rms_norm(h, res, w_norm, 1e-5)
        res_out = torch.empty_like(h)
    else:
        x, want_res, res_out = triton_norm.rms_norm(h, w_norm, 1e-5), h, h
    got, want = _fused_and_separate(kind, words, cfg, N, K, h, x, norm=gemv.Norm(res if residual else None, w_norm, 1e-5, res_out))
    assert got.shape == (rows, N) and _rel(got, want) < 2e-3
    assert torch.equal(res_out, want_res)


def test_triton_gemv_tune_keeps_the_fastest(monkeypatch, tmp_path) -> None:
    """tune() times every candidate of each distinct linear shape once and the ops dispatch on the
    fastest (timings faked here: the choice logic, not the clock)."""
    import tiny_models as tm

    from fasterllama.loading.model_loader import load_model
    from fasterllama.model.llama import Linear
    from fasterllama.quant import QuantConfig, quantize_model

    path = tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["mha"]), str(tmp_path))
    net = load_model(path, torch.float32, torch.device(DEVICE), None, True, progress=False).model  # (candidates run: on the GPU there)
    quantize_model(net, QuantConfig.parse("w4-g32-head4-noimatrix"))  # every linear int4, the head too (no calibration run)
    seen = []

    def fake_time(fn):
        seen.append(fn)
        return 1.0 if len(seen) % 3 else 0.5  # every third candidate is fastest

    monkeypatch.setattr(gemv, "_time", fake_time)
    monkeypatch.setattr(gemv, "_CHOICE", {})
    monkeypatch.setattr(gemv, "_GATED", {})
    monkeypatch.setattr(gemv, "_NORMED", {})
    if DEVICE == "cpu":  # every candidate run once under the interpreter: 14 s, for what the kernel tests check
        monkeypatch.setattr(gemv, "_checked", lambda key, fns: fns)
    timings = gemv.tune(net, torch.float32)
    shapes = {("int4", m.out_features, m.in_features, 32, torch.float32) for m in net.modules() if hasattr(m, "scales")}
    downs = {("int4", layer.mlp.down_proj.out_features, layer.mlp.down_proj.in_features, 32, torch.float32) for layer in net.layers}
    normed = {gemv._key(linear, torch.float32) for layer in net.layers for _, linear in layer.normed_linears()}
    assert set(timings) == shapes and len(normed) == 2 and not normed & downs  # once per distinct shape (the tied head: once)
    for key in shapes:
        assert len(timings[key]) == 1 + len(gemv.CONFIGS) + len(gemv.WORD_CONFIGS) + (2 if key in downs | normed else 0)
        kernel, cfg = gemv.choice(*key)
        assert timings[key][f"{kernel}{tuple(cfg) if kernel.startswith('gemv') else ''}"] == 0.5
    for key in downs:  # the down projection's GEMV makes SiLU·mul itself where that timed faster
        assert gemv._GATED[key] == (timings[key]["gated gemv"] < timings[key]["silu+gemv"])
    for key in normed:  # the qkv and gate_up GEMVs make the norm before them where that timed faster
        assert gemv._NORMED[key] == (timings[key]["normed gemv"] < timings[key]["norm+gemv"])
    assert not any(isinstance(m, Linear) for m in net.layers.modules())


def test_triton_gemv_tune_a8_times_the_integer_gemvs(monkeypatch, tmp_path) -> None:
    """Under "gguf-a8" (int8_activations) tune() times, per shape, x rounded before the
    float-activation op against each integer GEMV config, fuses nothing (an integer GEMV makes
    neither SiLU·mul nor a norm), and the a8 ops dispatch on the fastest: a config, or None (the
    rounded path) where that won."""
    import tiny_models as tm

    from fasterllama.backends.cuda import gemv_a8
    from fasterllama.loading.model_loader import load_model
    from fasterllama.quant import QuantConfig, quantize_model
    from fasterllama.quant.linear import Int4Linear, Int8Linear

    path = tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["mha"]), str(tmp_path))
    net = load_model(path, torch.float32, torch.device(DEVICE), None, True, progress=False).model
    quantize_model(net, QuantConfig.parse("w4-g32-noimatrix"))  # 4-bit layers, the head in int8 groups of 32
    linears = [m for m in net.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    for m in linears:
        m.int8_activations = True
    seen = []

    def fake_time(fn):
        seen.append(fn)
        return 0.5 if len(seen) % 4 == 1 else 1.0  # the first candidate of the first shape, then every fourth

    for name, value in (("_time", fake_time), ("_CHOICE", {}), ("_GATED", {}), ("_NORMED", {}), ("_checked", lambda key, fns: fns)):
        monkeypatch.setattr(gemv, name, value)
    timings = gemv.tune(net, torch.float32)
    kinds = {key[0] for key in timings}
    assert kinds == {"int4a8", "int8a8"} and not gemv._GATED and not gemv._NORMED
    for key, ms in timings.items():
        assert len(ms) == 1 + len(gemv_a8.A8_CONFIGS) and "rounded" in ms
        assert ms[f"{gemv._CHOICE[key][0]}{tuple(gemv._CHOICE[key][1]) if gemv._CHOICE[key][0] != 'rounded' else ''}"] == min(ms.values())
    m = next(m for m in linears if isinstance(m, Int4Linear))
    x = torch.randn(1, m.in_features, device=DEVICE)
    key = gemv._key(m, torch.float32)
    gemv._CHOICE[key] = ("rounded", gemv.DEFAULT_CONFIG)
    assert gemv.chosen_int4_a8(x, m.qweight, m.scales, m.mins, 32) is None
    gemv._CHOICE[key] = ("gemv-a8", gemv_a8.A8_CONFIGS[1])
    want = quantized.int4_weight_linear_a8(x, m.qweight, m.scales, m.mins, 32)
    assert _rel(gemv.chosen_int4_a8(x, m.qweight, m.scales, m.mins, 32), want) < 1e-5
    assert _rel(gemv.rounded_int4(x, m.qweight, m.scales, m.mins, 32), want) < 1e-5


@pytest.mark.parametrize("fails_at_rows", [1, 2, None])
def test_triton_gemv_tune_keeps_the_silu_kernel_when_the_gated_gemv_fails(monkeypatch, fails_at_rows) -> None:
    """A gated GEMV that fails to compile (or disagrees), at one row or at two (a kernel of its
    own), leaves the SiLU kernel in place, said in REJECTED, however fast it timed; one that
    works at both is kept where it is faster."""
    from fasterllama import ops

    monkeypatch.setattr(gemv, "REJECTED", [])

    def module_gemv(down, x, gated=False):
        if gated and x.shape[0] == fails_at_rows:
            raise RuntimeError("no such instruction")
        return ops.silu_and_mul(x)[..., :4] if gated else x[..., :4]

    monkeypatch.setattr(gemv, "_module_gemv", module_gemv)
    calls: list[int] = []
    monkeypatch.setattr(gemv, "_time", lambda fn: calls.append(1) or (0.5 if len(calls) == 2 else 1.0))  # (the fused call, timed second: faster)
    timings: dict = {}
    down = torch.nn.Linear(8, 4)
    got = gemv._time_gated(down, ("float", 4, 8), timings, torch.device("cpu"), torch.float32)
    assert got is (fails_at_rows is None)
    assert [r for r in gemv.REJECTED if "gated gemv: RuntimeError" in r] == ([] if fails_at_rows is None else gemv.REJECTED[:1])


def test_triton_gemv_tune_leaves_out_wrong_candidates(monkeypatch) -> None:
    """A candidate that fails to compile or disagrees with the first (cuBLAS / tiled) is never timed."""
    monkeypatch.setattr(gemv, "REJECTED", [])
    ref = torch.randn(1, 64)

    def broken() -> torch.Tensor:
        raise RuntimeError("no such instruction")

    fns = {"ref": lambda: ref, "wrong": lambda: ref * 1.5, "nan": lambda: ref * float("nan"), "broken": broken,
           "rounded": lambda: ref.bfloat16()}
    assert list(gemv._checked(("float", 64, 64), fns)) == ["ref", "rounded"]
    assert [r.split(": ")[0].split()[-1] for r in gemv.REJECTED] == ["wrong", "nan", "broken"]


@pytest.mark.parametrize("wrong_at_two_rows", [False, True])
def test_triton_gemv_tune_checks_the_choice_at_two_rows(monkeypatch, wrong_at_two_rows) -> None:
    """The one-row choice serves two rows too, by kernels of their own (two rows a program, two
    padded MMA rows): one that fails or disagrees there gives way to the reference (cuBLAS here)."""
    monkeypatch.setattr(gemv, "REJECTED", [])
    monkeypatch.setattr(gemv, "_CHOICE", {})
    refs = {rows: torch.randn(rows, 8) for rows in (1, 2)}

    def candidates(module, x):
        rows = x.shape[0]
        gemv_out = refs[rows] * (1.5 if wrong_at_two_rows and rows == 2 else 1.0)
        gemv_fn = lambda: gemv_out  # noqa: E731
        gemv_fn.fast = True
        return ("float", 8, 8, torch.float32), {("cublas", gemv.DEFAULT_CONFIG): lambda: refs[rows], ("gemv", gemv.CONFIGS[0]): gemv_fn}

    monkeypatch.setattr(gemv, "_candidates", candidates)
    monkeypatch.setattr(gemv, "_batch_candidates", lambda module, x: ((), {}))
    monkeypatch.setattr(gemv, "_time", lambda fn: 0.5 if getattr(fn, "fast", False) else 1.0)
    net = torch.nn.Module()
    net.norm = torch.nn.Module()
    net.norm.weight = torch.nn.Parameter(torch.ones(8))
    net.proj = torch.nn.Linear(8, 8)
    timings = gemv.tune(net, torch.float32)
    key = ("float", 8, 8, torch.float32)
    assert timings[key] == {"cublas": 1.0, f"gemv{tuple(gemv.CONFIGS[0])}": 0.5}  # (timed at one row, where both agree)
    assert gemv._CHOICE[key] == (("cublas", gemv.DEFAULT_CONFIG) if wrong_at_two_rows else ("gemv", gemv.CONFIGS[0]))
    assert any("relative error" in r for r in gemv.REJECTED) == wrong_at_two_rows
