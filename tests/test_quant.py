"""Quantization: error bounds per mode, the int8 GEMM exact against int32, every fused op equal to
its unfused composition, calibrators, and quantized models against their float twin."""

from __future__ import annotations

import pytest
import torch

from fasterllama import ops
from fasterllama.errors import FasterLlamaError
from fasterllama.ops import quantized as qops
from fasterllama.ops import reference as ref
from fasterllama.quant import QuantConfig
from fasterllama.quant.calibrate import ActivationStats, smooth, threshold
from fasterllama.quant.linear import Int4Linear, Int8Linear, W8A8Linear
from fasterllama.quant.quantize import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8, quantize_q4_0

torch.manual_seed(0)
W = torch.randn(192, 256) * 0.05
X = torch.randn(7, 256)


def test_int8_per_channel_error_bound():
    q, s = quantize_int8(W)
    assert q.dtype == torch.int8 and s.shape == (192,)
    err = (dequantize_int8(q, s) - W).abs()
    assert torch.all(err <= s[:, None] / 2 + 1e-7)  # round-to-nearest: half a step per row


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int8_group_error_bound(group):
    q, s = quantize_int8(W, group)
    assert s.shape == (192, 256 // group)
    err = (dequantize_int8(q, s) - W).abs().view(192, -1, group)
    assert torch.all(err <= s[..., None] / 2 + 1e-7)
    assert torch.equal(s.half().float(), s)  # fp16 values, as Q8_0's


def test_int8_group_scales_fp16_even_for_tiny_groups():
    """A group under fp16's normal range keeps a subnormal scale (its values rounded with it), an
    all-zero group a zero one: no division by zero; the error stays under half a step plus what
    the scale's rounding to fp16's subnormal spacing (2^-24) costs at 127 steps."""
    w = W[:4].clone()
    w[0, :32] = 0.0
    w[1, :32] *= 1e-4
    q, s = quantize_int8(w, 32)
    assert torch.equal(s.half().float(), s) and s[0, 0] == 0 and 0 < s[1, 0] < 2**-14
    assert torch.isfinite(dequantize_int8(q, s)).all()
    err = (dequantize_int8(q, s) - w).abs().view(4, -1, 32)
    assert torch.all(err <= s[..., None] / 2 + 127 * 2**-24)


def test_cuda_backend_compacts_scales_and_drops_symmetric_mins():
    """compact_scales: int8 group scales in fp16 where every one (and every min) is an fp16 value
    (per-channel and inexact ones stay fp32); 4-bit mins dropped where all are -8 * scale (Q4_0's),
    kept otherwise. The weights they stand for, a layer's output and its saved state are unchanged
    (the kernels reading the compact forms: test_triton_gemv.py, test_triton_linear.py)."""
    from fasterllama.backends.cuda import compact_scales

    grouped = Int8Linear(*quantize_int8(W, 32))
    channel = Int8Linear(*quantize_int8(W))
    inexact = Int8Linear(quantize_int8(W, 32)[0], quantize_int8(W, 32)[1] * (1 + 2**-20))
    q4 = torch.randint(0, 16, (192, 256))
    d = torch.rand(192, 8) * 0.01
    q4_0 = Int4Linear(q4, d, -8 * d.half().float())
    q4_1 = Int4Linear(*quantize_int4(W, 32))
    model = torch.nn.ModuleList([grouped, channel, inexact, q4_0, q4_1])
    x = torch.randn(3, 256)
    before = [(m.dequantize(), m.state_dict()) for m in model]
    y_q4_0 = q4_0(x)
    assert compact_scales(model) == 2
    assert grouped.weight_scale.dtype == torch.float16
    assert channel.weight_scale.dtype == torch.float32 and inexact.weight_scale.dtype == torch.float32
    assert q4_0.mins is None and q4_1.mins is not None
    for m, (w, state) in zip(model, before):
        assert torch.equal(m.dequantize(), w)
        after = m.state_dict()
        assert after.keys() == state.keys() and all(torch.equal(after[k].float(), state[k].float()) for k in state)
    torch.testing.assert_close(q4_0(x), y_q4_0, rtol=0, atol=0)


def test_cuda_backend_lays_factored_scales_out_in_pairs():
    """A K-quant's factored scales and mins (Q4_K's) in an Int4Linear: compact_scales puts each
    group's sub-block scale beside its min and each super-block's d beside -dmin (one load each
    in the kernels); the weights, the output and the saved values are unchanged."""
    from fasterllama.backends.cuda import compact_scales

    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (48, 512), generator=g)
    sub_s, sub_m = (torch.randint(0, 64, (48, 16), generator=g) for _ in range(2))
    d, dmin = (torch.rand(48, 2, generator=g) * 1e-3).half(), (-torch.rand(48, 2, generator=g) * 1e-3).half()
    lin = Int4Linear(q, sub_s, sub_m, scale_super=d, min_super=dmin)
    x = torch.randn(3, 512, generator=g)
    w, y, state = lin.dequantize(), lin(x), {k: v.clone() for k, v in lin.state_dict().items()}
    assert torch.equal(w, dequantize_int4(q, qops.factored(sub_s, d), qops.factored(sub_m, dmin)))
    assert not qops.side_by_side(lin.scales, lin.mins)
    assert compact_scales(torch.nn.ModuleList([lin])) == 1
    assert qops.side_by_side(lin.scales, lin.mins) and qops.side_by_side(lin.scale_super, lin.min_super)
    assert torch.equal(lin.dequantize(), w) and torch.equal(lin(x), y)
    assert all(torch.equal(v, state[k]) for k, v in lin.state_dict().items())


def test_q4_0_quantization_is_llama_cpps():
    """quantize_q4_0 gives the values gguf's (llama.cpp's reference) Q4_0 quantizer gives, an
    all-zero group and a tiny one included; its mins are -8 * scale."""
    from gguf import GGMLQuantizationType, quants

    w = W.clone()
    w[0, :32], w[1, :32] = 0.0, w[1, :32] * 1e-6
    q, s, m = quantize_q4_0(w, 32)
    assert q.min() >= 0 and q.max() <= 15 and torch.equal(m, -8 * s) and torch.equal(s.half().float(), s)
    theirs = quants.dequantize(quants.quantize(w.numpy(), GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    assert torch.equal(dequantize_int4(q, s, m), torch.from_numpy(theirs.reshape(w.shape)))


def test_w4_sym_spec():
    cfg = QuantConfig.parse("w4-sym")
    assert cfg.symmetric and cfg.group_size == 32 and not cfg.imatrix and not cfg.needs_calibration
    assert str(cfg) == "w4-g32-sym" and QuantConfig.parse(str(cfg)) == cfg
    for bad in ("w8-sym", "w8a8-sym"):
        with pytest.raises(FasterLlamaError, match="w4 only"):
            QuantConfig.parse(bad)


def _minmax_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """The plain min..max 16-level grid per group, dequantized (the searched one's baseline)."""
    g = w.view(w.shape[0], -1, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    return (torch.round((g - lo) / s).clamp(0, 15) * s + lo).view_as(w)


def test_scale_search_keeps_the_candidate_of_least_error():
    """search_scale_min_torch scores candidates by their squared error taken from the group sums: for
    every group, its (scale, min, levels) has the least explicitly computed error among all 22
    candidates up to the sums' fp32 noise (near-ties within 0.02% can go either way), with chunks of
    groups equal to one pass, and the absolute-error search the same."""
    from fasterllama.quant.quantize import search_scale_min_torch

    x = torch.randn(3000, 32) * torch.rand(3000, 1)
    x[5] = 0.0  # a dead group
    w = torch.sqrt(2 * (x * x).mean(1, keepdim=True) + x * x)
    s, m, lv = search_scale_min_torch(x, w, 15)
    assert torch.equal(lv, torch.round(lv).clamp(0, 15)) and torch.all(m <= 0) and s[5] == 0 and torch.all(lv[5] == 0)
    err = lambda s, m, lv: (w * (s[:, None] * lv + m[:, None] - x) ** 2).sum(1)  # noqa: E731
    got = err(s, m, lv)
    xmin = x.amin(1).clamp(max=0)
    rng = x.amax(1) - xmin
    inv = torch.where(rng > 0, 1 / torch.where(rng > 0, rng, 1.0), 0.0)
    best = err(rng / 15, xmin, torch.round(15 * inv[:, None] * (x - xmin[:, None])).clamp(0, 15))
    for step in range(21):  # each candidate's levels, refitted as the search does
        lv_c = torch.round((14 + 0.1 * step) * inv[:, None] * (x - xmin[:, None])).clamp(0, 15)
        sw, sl, sl2, sx, sxl = w.sum(1), (w * lv_c).sum(1), (w * lv_c * lv_c).sum(1), (w * x).sum(1), (w * lv_c * x).sum(1)
        det = sw * sl2 - sl * sl
        sc, mn = (sw * sxl - sx * sl) / det, (sl2 * sx - sl * sxl) / det
        sc, mn = torch.where(mn > 0, sxl / sl2, sc), torch.where(mn > 0, 0.0, mn)
        best = torch.where(det > 0, torch.minimum(best, err(sc, mn, lv_c)), best)
    live = rng > 0
    assert torch.all(got[live] <= best[live] * (1 + 1e-3) + 1e-9) and got[live].sum() <= best[live].sum() * (1 + 1e-6)
    chunked = search_scale_min_torch(x, w, 15, groups_per_chunk=1000)
    assert all(torch.equal(a, b) for a, b in zip(chunked, (s, m, lv)))
    one = search_scale_min_torch(x, w.abs(), 3, -0.5, 0.1, 15, use_mad=True)
    assert all(torch.equal(a, b) for a, b in zip(one, search_scale_min_torch(x, w.abs(), 3, -0.5, 0.1, 15, use_mad=True, groups_per_chunk=7)))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_group_error_bound(group):
    """Searched scales and mins: values on their fp16 grid (q in 0..15, the nearest level within
    the grid's range), and less squared error than the plain min..max grid, weighted or not."""
    q, s, m = quantize_int4(W, group)
    assert int(q.min()) >= 0 and int(q.max()) <= 15 and s.dtype == m.dtype == torch.float32
    assert torch.equal(s, s.half().float()) and torch.equal(m, m.half().float())
    deq = dequantize_int4(q, s, m)
    inside = (W.view(192, -1, group) >= m[..., None]) & (W.view(192, -1, group) <= (m + 15 * s)[..., None])
    err = (deq - W).abs().view(192, -1, group)
    assert torch.all(err[inside] <= s[..., None].expand_as(err)[inside] / 2 + 1e-6)
    assert ((deq - W) ** 2).sum() < ((_minmax_int4(W, group) - W) ** 2).sum()
    importance = torch.rand(256) ** 4 * 100  # a few input columns matter far more
    qi, si, mi = quantize_int4(W, group, importance)
    weighted = lambda d: (((d - W) ** 2) * importance).sum()  # noqa: E731
    assert weighted(dequantize_int4(qi, si, mi)) < weighted(deq)
    lin = Int4Linear(q, s, m)
    assert lin.qweight.dtype == torch.uint8 and lin.qweight.numel() == W.numel() // 2
    w_fp16_scales = dequantize_int4(q, s.half(), m.half())
    torch.testing.assert_close(lin.dequantize(), w_fp16_scales)
    torch.testing.assert_close(lin(X), X @ w_fp16_scales.t(), rtol=1e-5, atol=1e-5)
    rows = torch.tensor([5, 0, 191, 64])
    torch.testing.assert_close(lin.dequantize_rows(rows, torch.float32), w_fp16_scales[rows])


@pytest.mark.parametrize("group", [None, 32])
def test_int8_linear_matches_dequantized_weights(group):
    q, s = quantize_int8(W, group)
    lin = Int8Linear(q, s, bias=torch.randn(192))
    torch.testing.assert_close(lin(X), X @ dequantize_int8(q, s).t() + lin.bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", ["int4", "int8-g32", "int8-channel"])
def test_panel_storage_keeps_the_module_behaviour(make):
    """use_panels() changes how a weight-only linear stores its matrix, nothing it computes or saves."""
    w = W[:70]  # 70 rows: a padded last panel
    if make == "int4":
        lin = Int4Linear(*quantize_int4(w, 32))
    else:
        lin = Int8Linear(*quantize_int8(w, 32 if make == "int8-g32" else None))
    rows = torch.tensor([69, 0, 33, 31, 32])
    before = (lin(X), lin.dequantize(), lin.dequantize_rows(rows, torch.float32), lin.state_dict())
    lin.use_panels()
    assert lin.panels and lin.qweight.shape[0] == 3  # ceil(70 / 32) panels
    torch.testing.assert_close(lin(X), before[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(lin.dequantize(), before[1]) and torch.equal(lin.dequantize_rows(rows, torch.float32), before[2])
    state = lin.state_dict()
    assert state.keys() == before[3].keys() and all(torch.equal(state[k], before[3][k]) for k in state)


def test_holds_exactly_finds_a_lossless_int8_head():
    """w8a8 keeps the lm_head as int8 groups of 32 only where they hold it exactly (a GGUF Q8_0)."""
    from fasterllama.quant.convert import holds_exactly

    q = torch.randint(-127, 128, (100, 64), dtype=torch.int8)
    q[:, ::32] = 127  # Q8_0: each block's largest value is +-127 steps of its fp16 scale
    d = (torch.rand(100, 2) * 0.01).half().float()
    q8_0 = dequantize_int8(q, d)
    assert holds_exactly(Int8Linear(*quantize_int8(q8_0, 32)), q8_0, rows=16)
    assert not holds_exactly(Int8Linear(*quantize_int8(W, 32)), W, rows=16)


def test_int8_gemm_is_exact():
    a = torch.randint(-127, 128, (9, 256), dtype=torch.int8)
    b = torch.randint(-127, 128, (256, 40), dtype=torch.int8)
    assert torch.equal(ops.int8_gemm(a, b), a.int() @ b.int())


def test_w8a8_linear_dynamic_and_static():
    q, s = quantize_int8(W)
    lin = W8A8Linear(q, s)
    xq, xs = qops.quantize_per_token(X)
    expected = (xq.int() @ q.int().t()).float() * xs[:, None] * s[None, :]
    torch.testing.assert_close(lin(X), expected)
    rel = (lin(X) - X @ W.t()).norm() / (X @ W.t()).norm()
    assert rel < 0.02
    static = W8A8Linear(q, s, input_scale=X.abs().max() / 127)
    assert (static(X) - X @ W.t()).norm() / (X @ W.t()).norm() < 0.05


def test_quantize_per_token_bounds():
    q, s = qops.quantize_per_token(X)
    assert torch.all((q.float() * s[:, None] - X).abs() <= s[:, None] / 2 + 1e-6)
    assert torch.all(q.abs().amax(dim=1) == 127)


def test_static_scale_gives_out_of_range_rows_their_own_scale():
    """Under a static scale, a row beyond its range (an attention sink, a massive-activation
    token) gets its own absmax scale; rows within it keep the static one. With clip, it saturates."""
    x = torch.randn(5, 64)
    x[1] *= 100
    static = torch.tensor(x[[0, 2, 3, 4]].abs().max().item() / 127 * 1.01)
    q, s = qops.quantize_per_token(x, static)
    assert s[1] == x[1].abs().max() / 127 and torch.all(s[[0, 2, 3, 4]] == static)
    assert torch.all((q.float() * s[:, None] - x).abs() <= s[:, None] / 2 + 1e-5)  # nothing clipped
    q2, s2 = qops.quantize_per_token(x, static, clip=True)
    assert torch.all(s2 == static) and torch.equal(q2[[0, 2, 3, 4]], q[[0, 2, 3, 4]])
    assert (q2[1].abs() == 127).sum() > 10 * max(1, int((q[1].abs() == 127).sum()))
    q3, s3 = qops.rms_norm_quant(x, torch.ones(64), 1e-5, torch.tensor(0.002))
    assert torch.all(s3 > 0.002)  # normalized rows reach ~3: every row is beyond 0.002 * 127


def test_first_token_rows_are_the_sequence_starts():
    # three sequences: a fresh prompt (rows 0-2), a decode (row 3), a second prompt chunk (4-5), a fresh one (6)
    starts, offsets = [0, 5, 3, 0], [0, 3, 4, 6, 7]
    positions = [0, 1, 2, 5, 3, 4, 0]
    meta = ops.AttentionMetadata(torch.tensor(positions), torch.tensor(positions), ops.block_tables_tensor([[0]] * 4, "cpu"), starts, offsets)
    assert meta.first_token_rows.tolist() == [0, 6]


# -- fused ops == unfused compositions -------------------------------------------------------------
def test_rms_norm_quant_is_norm_then_quant():
    x, w = torch.randn(6, 64), torch.rand(64) + 0.5
    q, s = qops.rms_norm_quant(x, w, 1e-5)
    q2, s2 = qops.quantize_per_token(ref.rms_norm(x, w, 1e-5))
    assert torch.equal(q, q2) and torch.equal(s, s2)






def test_silu_mul_quant_fused():
    gu = torch.randn(5, 128)
    q1, s1 = qops.silu_and_mul_quant(gu, torch.tensor(0.02))
    q2, s2 = qops.quantize_per_token(ref.silu_and_mul(gu), torch.tensor(0.02))
    assert torch.equal(q1, q2) and torch.equal(s1, s2)




# -- calibration -------------------------------------------------------------------------------------
def _stats_with_outliers() -> ActivationStats:
    st = ActivationStats(64)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(256, 64, generator=g)
        x[0, 3] = 40.0  # one rare outlier
        st.add(x)
    return st


def test_calibrators_order_and_range():
    st = _stats_with_outliers()
    t_max = threshold(st, "max")
    assert t_max == pytest.approx(40.0)
    t_pct = threshold(st, "percentile", 99.9)
    t_mse = threshold(st, "mse")
    t_kl = threshold(st, "entropy")
    for t in (t_pct, t_mse, t_kl):
        assert 1.0 < t < t_max  # all clip the outlier, none clips the bulk
    assert threshold(st, "percentile", 100.0) == pytest.approx(40.0)


def test_mse_calibrator_minimizes_error():
    st = _stats_with_outliers()
    v = st.values()
    import numpy as np

    def err(c):
        s = c / 127
        return float(np.mean((v - np.clip(np.round(v / s), -127, 127) * s) ** 2))

    best = threshold(st, "mse")
    assert err(best) <= err(st.amax) and err(best) <= err(best * 0.8) and err(best) <= err(min(best * 1.2, st.amax))


def test_smoothquant_preserves_the_product():
    x = torch.randn(10, 64)
    x[:, 5] *= 30
    norm_w, lin_w = torch.rand(64) + 0.5, torch.randn(32, 64)
    new_norm, new_w = smooth(norm_w, lin_w, (x * norm_w).abs().amax(0), 0.5)
    torch.testing.assert_close((x * new_norm) @ new_w.t(), (x * norm_w) @ lin_w.t(), rtol=1e-4, atol=1e-4)
    assert (x * new_norm).abs().amax(0)[5] < (x * norm_w).abs().amax(0)[5]


def test_quant_config_parse():
    c = QuantConfig.parse("w8a8-static-percentile99.9-sq0.5")
    assert (c.mode, c.static_activations, c.calibrator, c.percentile, c.smoothquant_alpha) == ("w8a8", True, "percentile", 99.9, 0.5)
    assert QuantConfig.parse("w4").group_size == 32 and QuantConfig.parse("w4-g128").group_size == 128
    assert QuantConfig.parse(str(c)) == c
    clip = QuantConfig.parse("w8a8-static-max-clip")
    assert clip.clip and not QuantConfig.parse("w8a8-static").clip and QuantConfig.parse("w8a8-static-nosink").clip
    assert QuantConfig.parse(str(clip)) == clip and str(clip) == "w8a8-static-max-clip-sq0.7"
    w4 = QuantConfig.parse("w4-g64")
    assert w4.imatrix and w4.needs_calibration and str(w4) == "w4-g64"
    plain = QuantConfig.parse("w4-g64-noimatrix")
    assert not plain.imatrix and not plain.needs_calibration and QuantConfig.parse(str(plain)) == plain
    assert not QuantConfig.parse("w8").needs_calibration
    for bad in ("w3", "w4-g48", "w8-static", "w8a8-g32", "w8a8-bogus", "w8-noimatrix"):
        with pytest.raises(FasterLlamaError):
            QuantConfig.parse(bad)


def test_calibration_passes_leave_no_float_kv_in_the_prefix_cache(tmp_path):
    """Quantizing with calibration runs the float model over the calibration text (every position
    computed, as compute_logits does); none of those K/V stay findable in the prefix cache after."""
    import tiny_models as tm

    from fasterllama import LLM, SamplingParams

    folder = tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["gqa"]), str(tmp_path / "hf"))
    text = " ".join(f"word{i % 37}" for i in range(300))
    llm = LLM(folder, quantization="none", progress=False)
    ids = llm.tokenizer.encode(text)[:200]
    llm.engine.quantize("w8a8-static", calibration_text=text)
    assert not llm.engine.blocks.cached
    fresh = LLM(folder, quantization="w8a8-static", calibration_text=text, progress=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert llm.generate([ids], params)[0].token_ids == fresh.generate([ids], params)[0].token_ids
    assert llm.engine.blocks.cached  # the prompt's own blocks are cached as usual


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8, torch.bfloat16])
def test_panel_order_and_the_fp16_check(dtype):
    """_panel_order (numpy's strided copy) lays rows out as the torch formula it replaced, every
    shape and dtype, its last panel padded with zero rows; panel_scales inverts it. PackedLinear
    keeps scales in fp16 exactly where every one is an fp16 value."""
    import torch.nn.functional as F

    from fasterllama.ops import quantized
    from fasterllama.quant.linear import _as, _fp16_exact

    for n, g in ((1, 3), (31, 5), (32, 2), (33, 7), (100, 18)):
        t = (torch.randn(n, g) * 10).to(dtype)
        p = -(-n // 32)
        want = F.pad(t, (0, 0, 0, p * 32 - n)).view(p, 32, g).transpose(1, 2).contiguous()
        got = quantized._panel_order(t)
        assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, want)
        assert torch.equal(quantized.panel_scales(got, n), t)
    half = torch.randn(64, 4).half().float()
    assert _fp16_exact(half) and _as(half, torch.float16).dtype == torch.float16 and torch.equal(_as(half, torch.float16).float(), half)
    assert not _fp16_exact(half + 1e-6) and not _fp16_exact(torch.tensor([[70000.0]])) and _fp16_exact(torch.tensor([[65504.0]]))
    assert _as(torch.tensor([[3, -4]], dtype=torch.int16), torch.int8).dtype == torch.int8  # (other dtypes: torch's .to)
