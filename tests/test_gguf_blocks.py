"""GGUF block formats read as integers with a scale and a min per group (quant/gguf_blocks.py):
exactly gguf-py's floats for every type, alone and combined into fused projections."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from fasterllama.quant import gguf_blocks  # noqa: E402

# where each type keeps its fp16 fields (d, and dmin / m): set to sane values in random blocks
_FP16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q2_K": [80, 82], "Q3_K": [108],
                "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0]}
_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6,
         "IQ4_NL": gguf_blocks.NL4, "IQ4_XS": gguf_blocks.NL4}


def _random_blocks(type_name: str, rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    size, per_block, _ = gguf_blocks.FORMATS[type_name]
    raw = rng.integers(0, 256, (rows, k // per_block, size), dtype=np.uint8)
    for off in _FP16_FIELDS[type_name]:
        half = rng.uniform(-0.1, 0.1, raw.shape[:2]).astype(np.float16)
        raw[..., off:off + 2] = np.ascontiguousarray(half).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def _fma_values(b: gguf_blocks.Blocks) -> np.ndarray:
    """scale * q + min rounded once, as the kernels' fma computes it."""
    rows, k = b.q.shape
    q = (gguf_blocks.NL4_VALUES[b.q] if b.bits == gguf_blocks.NL4 else b.q).astype(np.float64).reshape(rows, -1, b.group)
    w = q * b.scale.astype(np.float64)[..., None] + b.explicit_mins().astype(np.float64)[..., None]
    return w.astype(np.float32).reshape(rows, k)


def _gguf_values(raw: np.ndarray, type_name: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("type_name", list(gguf_blocks.FORMATS))
def test_decode_is_gguf_dequantize_exactly(type_name):
    rows, k = 6, 512
    raw = _random_blocks(type_name, rows, k, seed=len(type_name) + rows)
    b = gguf_blocks.decode(raw, type_name, rows)
    want = _gguf_values(raw, type_name)
    assert b.bits == _BITS[type_name] and b.q.shape == (rows, k)
    assert b.q.min() >= (-128 if b.bits == 8 else 0) and b.q.max() < (128 if b.bits == 8 else 16 if b.bits == gguf_blocks.NL4 else 1 << b.bits)
    assert np.array_equal(b.values(), want)
    assert np.array_equal(_fma_values(b), want)
    f = b.factors  # the K-quants' compact form: int8 sub-block values times an fp16 value per 256 columns
    assert (f is not None) == (type_name.endswith("_K") or type_name == "IQ4_XS")
    if f is not None:
        assert f.scale_sub.dtype == np.int8 and f.scale_super.dtype == np.float16 and f.scale_super.shape == (rows, k // 256)
        assert np.array_equal(f.products(f.scale_sub, f.scale_super), b.scale)
        assert (f.min_sub is None) == (b.mins is None)
        if b.mins is not None:
            assert np.array_equal(f.products(f.min_sub, f.min_super), b.mins)


@pytest.mark.parametrize("types", [("Q5_0", "Q5_0", "Q8_0"), ("Q4_K", "Q6_K"), ("Q4_0", "Q5_0"), ("Q5_0", "Q6_K", "Q4_1"), ("Q6_K", "Q6_K"),
                                   ("Q3_K", "Q8_0"), ("Q4_K", "Q4_K", "Q4_K"), ("IQ4_NL", "Q5_0", "Q8_0"), ("IQ4_XS", "IQ4_XS"), ("IQ4_NL", "IQ4_XS")])
def test_combine_holds_every_part_exactly(types):
    """A fused projection's parts of different types in one form: the values of each part."""
    k = 512
    parts = [gguf_blocks.decode(_random_blocks(t, 4 + i, k, seed=i), t, 4 + i) for i, t in enumerate(types)]
    want = np.concatenate([p.values() for p in parts])
    both = gguf_blocks.combine(parts)
    widest = max(_BITS[t] for t in types)
    assert both.bits == (8 if widest == gguf_blocks.NL4 and len({_BITS[t] for t in types}) > 1 else widest)  # IQ4 beside others: int8
    assert both.group == min(p.group for p in parts)
    assert np.array_equal(_fma_values(both), want)
    if len(set(types)) == 1 and types[0] in ("Q5_0", "Q6_K", "Q8_0", "Q4_0"):
        assert both.mins is None  # centred alike: no mins stored
    assert (both.factors is not None) == (len(set(types)) == 1 and types[0] in ("Q4_K", "Q6_K", "IQ4_XS"))  # one K-quant type keeps its compact scales


@pytest.mark.parametrize("types,kind", [(("Q5_0", "Q8_0"), "Int8Linear"), (("Q4_1", "Q4_0"), "Int4Linear"), (("Q6_K",), "Int8Linear"),
                                        (("Q4_K",), "Int4Linear"), (("Q3_K",), "Int8Linear"), (("Q6_K", "Q5_0", "Q8_0"), "Int8Linear"),
                                        (("Q4_0", "Q5_0"), "Int8Linear"), (("Q5_K",), "Int8Linear"), (("Q5_1",), "Int8Linear"), (("Q2_K",), "Int8Linear"),
                                        (("Q4_K", "Q6_K"), "Int8Linear"), (("Q4_1", "Q5_1", "Q8_0"), "Int8Linear"),
                                        (("IQ4_NL",), "Int8Linear"), (("IQ4_XS", "Q8_0"), "Int8Linear")])
def test_gpu_modules_are_the_row_layouts(types, kind):
    """Off the CPU the file's blocks load as the row layouts the GPU kernels read, exactly: 4-bit
    with mins in groups of 32 (Q4_K's scales and mins in its own factored form: int8 sub-block
    values times fp16 a super-block), int8 for centred values in groups of 16 or more (Q3_K's
    centred 3-bit values too), and int8 with a min per group for values with mins that 4 bits in
    groups of 32 cannot hold (Q5_1, Q5_K, Q2_K's groups of 16, mixes with them). Their forward
    (the reference ops) is x @ the file's weights."""
    import torch

    from fasterllama.quant import gguf_native

    parts = [gguf_blocks.decode(_random_blocks(t, 32, 256, seed=i), t, 32) for i, t in enumerate(types)]
    module = gguf_native._module(parts, torch.device("cuda"))
    assert (None if module is None else type(module).__name__) == kind
    if module is not None:
        want = np.concatenate([p.values() for p in parts])
        assert np.array_equal(module.dequantize().numpy(), want)
        x = torch.randn(3, 256)
        torch.testing.assert_close(module(x), x @ torch.from_numpy(want).T, rtol=1e-4, atol=1e-4)
        if types == ("Q4_K",):  # about the file's 4.5 bits a weight, not 6
            assert module.sups is not None and module.scales.dtype == torch.int8
            assert sum(t.numel() * t.element_size() for t in module.parameters()) * 8 / want.size <= 4.65
    cpu = gguf_native._module(parts, torch.device("cpu"))
    assert np.array_equal(cpu.dequantize().numpy(), np.concatenate([p.values() for p in parts]))


@pytest.mark.parametrize("type_name,most", [("Q4_K", 1.03), ("Q5_K", 1.03), ("Q6_K", 1.0), ("Q8_0", 1.0), ("Q5_0", 1.0), ("Q4_1", 1.0),
                                            ("Q3_K", 1.04), ("Q2_K", 1.2), ("IQ4_NL", 1.0), ("IQ4_XS", 1.03)])
def test_cpu_module_is_about_the_file_size(type_name, most):
    """On the CPU a tensor takes about its bytes in the file: values in 2-6 bit planes or int8, and
    a K-quant's scales in its own form (int8 sub-block values, fp16 per 256 columns), not fp32 per
    group (which made Q4_K 6 bits a weight against the file's 4.5; Q2_K / Q3_K's values in 4-bit
    planes took 5.1 bits against 2.6 / 3.4; Q2_K's 4-bit scales and mins as int8: 3.1). 5-bit values
    in the AVX2 build's L5 lanes take half a bit more by design (1.09x a Q5_0 file)."""
    import torch

    from fasterllama.quant import gguf_native

    rows, k = 64, 1024
    raw = _random_blocks(type_name, rows, k, seed=3)
    module = gguf_native._module([gguf_blocks.decode(raw, type_name, rows)], torch.device("cpu"))
    held = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    if getattr(module, "bits", None) == 5 and module.qweight.dtype == torch.int16:  # L5 lanes (AVX2 builds): 5.5 bits a value, 0.5 above the planes
        held -= module.qweight.numel() * 2 // 11
    assert 0.9 * raw.size * raw.itemsize <= held <= most * raw.size * raw.itemsize


@pytest.mark.parametrize("types", [("Q5_0", "Q5_0", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K")])
def test_mixed_parts_keep_their_own_width(types):
    """A fused projection of parts of different types (a _K_M file's q/k beside v) keeps each run of
    alike parts in its own form: its size stays the parts' size in the file (widened to the widest,
    Q5_0 q/k took int8: 1.5x; Q4_K q/k took 6-bit values with fp32 scales per 16: ~2x)."""
    import torch

    from fasterllama.quant import gguf_native
    from fasterllama.quant.linear import FusedLinear

    raws = [_random_blocks(t, 64, 512, seed=i) for i, t in enumerate(types)]
    parts = [gguf_blocks.decode(r, t, 64) for r, t in zip(raws, types)]
    module = gguf_native._module(parts, torch.device("cpu"))
    assert isinstance(module, FusedLinear) and [p.bits for p in module.parts] == [_BITS[types[0]], _BITS[types[2]]]
    assert np.array_equal(module.dequantize().numpy(), np.concatenate([p.values() for p in parts]))
    held = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    held -= sum(p.qweight.numel() * 2 // 11 for p in module.parts if p.bits == 5 and p.qweight.dtype == torch.int16)  # (L5 lanes' half bit)
    assert 0.9 * sum(r.size * r.itemsize for r in raws) <= held <= 1.03 * sum(r.size * r.itemsize for r in raws)
    from fasterllama.backends.cpu import kernels

    x = torch.randn(3, 512)
    # the C kernels where they build (the decode step's), else the reference ops. AVX2's GEMVs round
    # x as gemv_x and sum unsigned 5-bit values before taking their centre off: ~2e-5 of the largest output
    rounded = kernels.load() is not None and kernels.gemv_x_block()
    want = (kernels.gemv_x(x, 16) if rounded else x) @ module.dequantize().t()
    assert (module(x) - want).abs().max() <= (1e-4 if rounded else 1e-5) * want.abs().max()
