"""GGUF block quantizers in numpy, K-quants included (Q2_K, Q4_K, Q5_K, Q6_K).

`gguf.quants.quantize` writes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 but raises NotImplementedError for the
K-quants, which is what most downloaded files (`Q4_K_M`, `Q5_K_M`, `Q6_K`) hold. Tests and
`fasterllama quantize` need to write such files without llama.cpp, so this module writes the
exact block bytes of the format as ggml defines it (ggml-common.h / ggml-quants.c):

* Q4_K / Q5_K: super-blocks of 256 = 8 sub-blocks of 32; each sub-block has a 6-bit scale and a
  6-bit min (packed into 12 bytes) relative to the fp16 super-block `d` and `dmin`;
  value = d*sc*q - dmin*m with q in [0, 15] (Q4_K) or [0, 31] (Q5_K, 5th bit in `qh`).
* Q6_K: 16 sub-blocks of 16 with int8 scales and an fp16 `d`; value = d*sc*(q - 32), q in [0, 63]
  split into low nibbles `ql` and 2 high bits `qh`.
* Q2_K: 16 sub-blocks of 16 with 4-bit scale and 4-bit min; value = d*sc*q - dmin*m, q in [0, 3].
* Q3_K: 16 sub-blocks of 16 with 6-bit signed scales (sc - 32) and an fp16 `d`; value =
  d*(sc - 32)*(q - 4), q in [0, 7] split into 2-bit `qs` and a high bit in `hmask`.
* IQ4_NL: blocks of 32 with an fp16 `d`; value = d*NL4_VALUES[q], q a 4-bit index into 16 int8
  values spaced for normally distributed weights. IQ4_XS: super-blocks of 256 with an fp16 `d`
  and 6-bit sub-block scales ls per 32; value = d*(ls - 32)*NL4_VALUES[q].

Scales and mins are chosen as llama.cpp's reference quantizers choose them (no importance
matrix): a least-squares search over candidate inverse scales per sub-block (make_qkx2_quants for
the min/scale types, make_qx_quants for Q6_K), then the sub-block scales are themselves quantized
against the super-block maximum and the weights are re-rounded with the final scales. Everything
is vectorized over blocks, so a 50k x 512 matrix quantizes in seconds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..ops.quantized import NL4_VALUES
from .quantize import search_scale_min

QK_K = 256
K_QUANT_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
IQ4_TYPES = ("IQ4_NL", "IQ4_XS")
BLOCK32_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # delegated to gguf.quants

_CHUNK_SUPERBLOCKS = 4096  # super-blocks per vectorized step: ~4 MB float32 temporaries

_EPS = np.float32(1e-15)  # ggml's GROUP_MAX_EPS: a group this small counts as all zero


def _rint(a: np.ndarray) -> np.ndarray:
    """Round half to even, like ggml's nearest_int (the 1.5*2^23 trick under the default FPU mode)."""
    return np.rint(a)


def _fp16(a: np.ndarray) -> np.ndarray:
    """fp16 bits of `a` and the float32 they read back as (the value later math must use)."""
    h = np.asarray(a, dtype=np.float32).astype(np.float16)
    return h, h.astype(np.float32)


# -- scale searches -------------------------------------------------------------------------------
def _search_symmetric(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, levels) per group for value = scale*L, L in [-nmax, nmax-1] (make_qx_quants, rmse 1).

    The element of largest magnitude maps to -nmax (the side with one more level); candidate
    inverse scales -(nmax + 0.1*i)/max, i in -9..9, are tried and the one whose least-squares
    scale (weights x^2, so large weights matter most) explains the most of the group is kept."""
    idx = np.abs(x).argmax(axis=1)
    signed_max = np.take_along_axis(x, idx[:, None], axis=1)[:, 0]
    live = np.abs(signed_max) >= _EPS
    inv_max = np.zeros_like(signed_max)
    inv_max[live] = 1.0 / signed_max[live]
    w = x * x

    def fit(factor: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        levels = np.clip(_rint((np.float32(-factor) * inv_max)[:, None] * x), -nmax, nmax - 1).astype(np.float32)
        wl = w * levels
        return levels, (wl * x).sum(axis=1), (wl * levels).sum(axis=1)

    levels, sumlx, suml2 = fit(nmax)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 > 0, sumlx / suml2, np.float32(0)).astype(np.float32)
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            cand, c_lx, c_l2 = fit(nmax + 0.1 * step)
            take = live & (c_l2 > 0) & (c_lx * c_lx > best * c_l2)
            if take.any():
                c_scale = c_lx / c_l2
                scale = np.where(take, c_scale, scale).astype(np.float32)
                best = np.where(take, c_scale * c_lx, best)
                levels[take] = cand[take]
    levels[~live] = -nmax  # ggml leaves an all-zero group's stored levels at 0, i.e. -nmax here
    return np.where(live, scale, np.float32(0)).astype(np.float32), levels


def _quantize_sub_scales(values: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sub-block scales (or mins) [nb, n] -> (integer codes in [0, top], fp16 super scale, its float).

    The largest one maps to `top`: codes = round(top/max * v), super scale = max/top."""
    vmax = values.max(axis=1)
    inv = np.zeros_like(vmax)
    pos = vmax > 0
    inv[pos] = np.float32(top) / vmax[pos]
    codes = np.clip(_rint(inv[:, None] * values), 0, top).astype(np.uint8)
    h, f = _fp16(np.where(pos, vmax / np.float32(top), np.float32(0)))
    return codes, h, f


def _requantize(x: np.ndarray, step: np.ndarray, offset: np.ndarray, levels: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Round x to the final grid offset + step*L (step, offset per group); groups with step 0 keep
    the search's levels, as ggml does (they dequantize to the offset whatever the levels are)."""
    live = step != 0
    safe = np.where(live, step, np.float32(1))
    out = np.clip(_rint((x - offset[:, None]) / safe[:, None]), lo, hi).astype(np.float32)
    return np.where(live[:, None], out, levels)


# -- per-type quantizers: float32 super-blocks [nb, 256] -> parts ----------------------------------
def _parts_min_type(
    x: np.ndarray, group: int, nmax: int, top: int, rmin: float, nstep: int, mad: bool
) -> dict[str, np.ndarray]:
    """Shared by Q2_K, Q4_K and Q5_K: per-group scale/min search, then quantized sub-scales.

    Q4_K/Q5_K weight the squared error by rms(group) + |x| (large weights matter more, small ones
    still count); Q2_K, with only 4 levels, weights the absolute error by |x|."""
    nb = x.shape[0]
    g = x.reshape(-1, group)
    w = np.abs(g) if mad else np.sqrt((g * g).mean(axis=1, keepdims=True)) + np.abs(g)
    s, mn, lv = search_scale_min(torch.tensor(g, dtype=torch.float32), torch.tensor(w, dtype=torch.float32), nmax, rmin, 0.1, nstep, mad)
    scale, mins, levels = s.numpy(), (-mn).numpy(), lv.numpy()
    ls, d_h, d = _quantize_sub_scales(scale.reshape(nb, -1), top)
    lm, dmin_h, dmin = _quantize_sub_scales(mins.reshape(nb, -1), top)
    step = (d[:, None] * ls.astype(np.float32)).reshape(-1)
    offset = -(dmin[:, None] * lm.astype(np.float32)).reshape(-1)
    q = _requantize(g, step, offset, levels, 0, nmax).astype(np.uint8).reshape(nb, QK_K)
    return {"d": d_h, "dmin": dmin_h, "sc": ls, "m": lm, "q": q}


def _parts_q4_k(x: np.ndarray) -> dict[str, np.ndarray]:
    return _parts_min_type(x, group=32, nmax=15, top=63, rmin=-1.0, nstep=20, mad=False)


def _parts_q5_k(x: np.ndarray) -> dict[str, np.ndarray]:
    return _parts_min_type(x, group=32, nmax=31, top=63, rmin=-0.5, nstep=15, mad=False)


def _parts_q2_k(x: np.ndarray) -> dict[str, np.ndarray]:
    return _parts_min_type(x, group=16, nmax=3, top=15, rmin=-0.5, nstep=15, mad=True)


def _parts_symmetric(x: np.ndarray, nmax: int, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shared by Q6_K and Q3_K: a symmetric search per 16 (levels -nmax..nmax-1), then the 16 scales
    as signed codes in [-top, top - 1] against the super-block's largest, which maps to -top (the
    extra negative level), its sign folded into d. Returns (d fp16, codes, values + nmax, live)."""
    nb = x.shape[0]
    g = x.reshape(-1, 16)
    scale, levels = _search_symmetric(g, nmax)
    scale = scale.reshape(nb, 16)
    idx = np.abs(scale).argmax(axis=1)
    max_scale = np.take_along_axis(scale, idx[:, None], axis=1)[:, 0]
    live = np.abs(max_scale) >= _EPS
    iscale = np.zeros_like(max_scale)
    iscale[live] = np.float32(-top) / max_scale[live]
    sc = np.clip(_rint(iscale[:, None] * scale), -top, top - 1).astype(np.int32)
    d_h, d = _fp16(np.where(live, -max_scale / np.float32(top), np.float32(0)))
    step = (d[:, None] * sc.astype(np.float32)).reshape(-1)
    q = (_requantize(g, step, np.zeros_like(step), levels, -nmax, nmax - 1) + nmax).astype(np.uint8).reshape(nb, QK_K)
    q[~live] = 0  # ggml zeroes a whole super-block whose scales are all ~0
    return d_h, sc, q, live


def _parts_q6_k(x: np.ndarray) -> dict[str, np.ndarray]:
    d_h, sc, q, live = _parts_symmetric(x, 32, 128)
    sc[~live] = 0
    return {"d": d_h, "sc": sc.astype(np.int8), "q": q}


def _parts_q3_k(x: np.ndarray) -> dict[str, np.ndarray]:
    """Q6_K's way at 3 bits: levels -4..3, 6-bit signed scale codes (stored + 32)."""
    d_h, sc, q, live = _parts_symmetric(x, 4, 32)
    sc[~live] = -32  # an all-~0 super-block: zero bytes
    return {"d": d_h, "sc": (sc + 32).astype(np.uint8), "q": q}


# -- byte packing (the inverse of ggml's dequantize_row_*) ------------------------------------------
def _pack_scale_min_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit mins -> 12 bytes: bytes 0-3 low 6 bits of scales 0-3 (top 2
    bits: high bits of scales 4-7), bytes 4-7 the same for mins, bytes 8-11 the low nibbles of
    scales 4-7 and mins 4-7."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _f16_bytes(h: np.ndarray) -> np.ndarray:
    return h.astype("<f2").reshape(-1, 1).view(np.uint8)


def _nibbles_q4(q: np.ndarray) -> np.ndarray:
    """Levels [nb, 256] -> 128 bytes: each 64-value chunk's first 32 in low nibbles, next 32 high."""
    q = q.reshape(-1, 4, 2, 32) & 15
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _pack_q4_k(p: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([_f16_bytes(p["d"]), _f16_bytes(p["dmin"]), _pack_scale_min_k4(p["sc"], p["m"]), _nibbles_q4(p["q"])], axis=1)


def _pack_q5_k(p: dict[str, np.ndarray]) -> np.ndarray:
    q = p["q"]
    high = (q.reshape(-1, 8, 32) >> 4).astype(np.uint8)  # bit j of qh[l] = 5th bit of sub-block j's l-th value
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate(
        [_f16_bytes(p["d"]), _f16_bytes(p["dmin"]), _pack_scale_min_k4(p["sc"], p["m"]), qh, _nibbles_q4(q)], axis=1
    )


def _pack_q6_k(p: dict[str, np.ndarray]) -> np.ndarray:
    q = p["q"].reshape(-1, 2, 4, 32)  # two halves of 128, four runs of 32
    low, high = q & 15, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)  # [nb, 2, 64]
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)  # [nb, 2, 32]
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), p["sc"].view(np.uint8), _f16_bytes(p["d"])], axis=1)


def _pack_q2_k(p: dict[str, np.ndarray]) -> np.ndarray:
    q = p["q"].reshape(-1, 2, 4, 32)  # 2 bits each: four runs of 32 share 32 bytes per half
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    scales = (p["sc"] & 15) | (p["m"] << 4)
    return np.concatenate([scales, qs.reshape(-1, 64), _f16_bytes(p["d"]), _f16_bytes(p["dmin"])], axis=1)


def _pack_q3_k(p: dict[str, np.ndarray]) -> np.ndarray:
    q = p["q"].reshape(-1, 2, 4, 32)  # value 128 n + 32 j + l
    low, high = q & 3, (q >> 2) & 1
    qs = low[:, :, 0] | (low[:, :, 1] << 2) | (low[:, :, 2] << 4) | (low[:, :, 3] << 6)  # [nb, 2, 32]
    hmask = np.zeros((q.shape[0], 32), np.uint8)  # bit 4 n + j of byte l
    for n in range(2):
        for j in range(4):
            hmask |= high[:, n, j] << (4 * n + j)
    sc = p["sc"]
    scales = np.zeros((sc.shape[0], 12), np.uint8)
    scales[:, :8] = (sc[:, :8] & 15) | ((sc[:, 8:] & 15) << 4)
    for i in range(16):
        scales[:, 8 + i % 4] |= ((sc[:, i] >> 4) & 3) << (2 * (i // 4))
    return np.concatenate([hmask, qs.reshape(-1, 64), scales, _f16_bytes(p["d"])], axis=1)


def _values(type_name: str, p: dict[str, np.ndarray]) -> np.ndarray:
    """The float32 values the parts stand for, computed as gguf's dequantizers compute them."""
    q = p["q"].astype(np.float32)
    d = p["d"].astype(np.float32)[:, None]
    if type_name == "Q3_K":
        step = d * (p["sc"].astype(np.float32) - 32)
        return (step[:, :, None] * (q.reshape(-1, 16, 16) - 4)).reshape(-1, QK_K)
    if type_name == "Q6_K":
        step = d * p["sc"].astype(np.float32)
        return (step[:, :, None] * (q.reshape(-1, 16, 16) - 32)).reshape(-1, QK_K)
    group = 16 if type_name == "Q2_K" else 32
    step = d * p["sc"].astype(np.float32)
    offset = p["dmin"].astype(np.float32)[:, None] * p["m"].astype(np.float32)
    return (step[:, :, None] * q.reshape(q.shape[0], -1, group) - offset[:, :, None]).reshape(-1, QK_K)


_K: dict[str, tuple[Callable, Callable, int]] = {  # type -> (parts, pack, bytes per super-block)
    "Q2_K": (_parts_q2_k, _pack_q2_k, 84),
    "Q3_K": (_parts_q3_k, _pack_q3_k, 110),
    "Q4_K": (_parts_q4_k, _pack_q4_k, 144),
    "Q5_K": (_parts_q5_k, _pack_q5_k, 176),
    "Q6_K": (_parts_q6_k, _pack_q6_k, 210),
}


def _k_blocks(arr: np.ndarray, type_name: str, with_values: bool) -> tuple[np.ndarray, np.ndarray | None]:
    parts_fn, pack_fn, nbytes = _K[type_name]
    rows, k = arr.shape
    x = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1, QK_K)
    out = np.empty((x.shape[0], nbytes), np.uint8)
    vals = np.empty_like(x) if with_values else None
    for lo in range(0, x.shape[0], _CHUNK_SUPERBLOCKS):
        parts = parts_fn(x[lo : lo + _CHUNK_SUPERBLOCKS])
        out[lo : lo + _CHUNK_SUPERBLOCKS] = pack_fn(parts)
        if vals is not None:
            vals[lo : lo + _CHUNK_SUPERBLOCKS] = _values(type_name, parts)
    return out.reshape(rows, -1), None if vals is None else vals.reshape(rows, k)


# -- IQ4_NL / IQ4_XS ---------------------------------------------------------------------------------
_NL = np.array(NL4_VALUES, dtype=np.float32)
_NL_MIDS = (_NL[1:] + _NL[:-1]) / 2  # half-integers or integers, one at most in [f, f + 1)
_FLOORS = np.arange(-128, 129, dtype=np.float32)
_MIDS_BELOW = np.searchsorted(_NL_MIDS, _FLOORS).astype(np.uint8)  # per floor f: how many midpoints lie below f
_MID_IN = np.array([next((m for m in _NL_MIDS if f <= m < f + 1), np.inf) for f in _FLOORS], dtype=np.float32)  # the one in [f, f + 1)


def _nl_index(v: np.ndarray) -> np.ndarray:
    """The index of the table value nearest each of v: how many midpoints lie below it (np.searchsorted's
    answer, by two lookups at v's floor instead of a search per value)."""
    f = (np.floor(np.clip(v, -128, 128)) + 128).astype(np.int16)
    return _MIDS_BELOW[f] + (_MID_IN[f] < v)


def _search_nl(x: np.ndarray) -> np.ndarray:
    """The scale per group of 32 [n] for value = scale * NL4_VALUES[q] (llama.cpp's
    quantize_row_iq4_nl_impl without an importance matrix): the largest-magnitude element maps to
    the table's ends at 15 candidate inverse scales, each gets its least-squares scale (weights
    x^2), and the one that explains the most of the group is kept."""
    idx = np.abs(x).argmax(axis=1)
    signed_max = np.take_along_axis(x, idx[:, None], axis=1)[:, 0]
    live = np.abs(signed_max) >= _EPS
    safe = np.where(live, signed_max, np.float32(1))
    w = x * x
    best_d, best = np.zeros(x.shape[0], np.float32), np.full(x.shape[0], -np.inf, np.float32)
    for inv in [-_NL[0] / safe] + [(np.float32(t) + _NL[0]) / safe for t in range(-7, 8)]:
        q = _NL[_nl_index(inv[:, None] * x)]
        sumqx, sumq2 = (w * q * x).sum(axis=1), (w * q * q).sum(axis=1)
        ok = sumq2 > 0
        d = np.where(ok, sumqx / np.where(ok, sumq2, 1), 0)
        score = np.where(ok, d * sumqx, -np.inf)
        better = score > best
        best_d, best = np.where(better, d, best_d), np.where(better, score, best)
    return np.where(live, best_d, np.float32(0)).astype(np.float32)


def _nl_indices(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Indices [n, 32] of x [n, 32] against value = step * NL4_VALUES[q] (step 0: index of 1, value 0)."""
    safe = np.where(step == 0, np.float32(1), step)
    return np.where(step[:, None] == 0, np.uint8(8), _nl_index(x / safe[:, None]))


def _nl_nibbles(q: np.ndarray) -> np.ndarray:
    """Indices [n, 32] -> 16 bytes each: element j in the low nibble of byte j, j + 16 in the high."""
    return q[:, :16] | (q[:, 16:] << 4)


def _iq4_blocks(arr: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, values) of a float [rows, K] matrix in IQ4_NL (K % 32 == 0) or IQ4_XS (K % 256)."""
    rows, k = arr.shape
    x = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1, 32)
    scale = _search_nl(x)
    if type_name == "IQ4_NL":
        dh, d = _fp16(scale)
        q = _nl_indices(x, d)
        blocks = np.concatenate([_f16_bytes(dh), _nl_nibbles(q)], axis=1)
        return blocks.reshape(rows, -1), (d[:, None] * _NL[q]).reshape(rows, k)
    sub = scale.reshape(-1, 8)  # the 8 scales of each super-block, against its d
    idx = np.abs(sub).argmax(axis=1)
    dh, d = _fp16(-np.take_along_axis(sub, idx[:, None], axis=1)[:, 0] / 32)
    ls = np.clip(_rint(sub / np.where(d == 0, np.float32(1), d)[:, None]), -32, 31).astype(np.int32) + 32  # [nb, 8]
    step = (d[:, None] * (ls - 32).astype(np.float32)).reshape(-1)
    q = _nl_indices(x, step)
    scales_h = np.zeros(ls.shape[0], np.uint16)
    for ib in range(8):
        scales_h |= ((ls[:, ib] >> 4) << (2 * ib)).astype(np.uint16)
    scales_l = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
    blocks = np.concatenate([_f16_bytes(dh), scales_h.astype("<u2").reshape(-1, 1).view(np.uint8), scales_l.astype(np.uint8),
                             _nl_nibbles(q).reshape(-1, 128)], axis=1)
    return blocks.reshape(rows, -1), (step[:, None] * _NL[q]).reshape(rows, k)


def _check(arr: np.ndarray, type_name: str) -> tuple[np.ndarray, str]:
    name = type_name.upper()
    if name not in K_QUANT_TYPES + BLOCK32_TYPES + IQ4_TYPES:
        raise ValueError(f"unsupported quantization type {type_name!r}; expected one of {K_QUANT_TYPES + BLOCK32_TYPES + IQ4_TYPES}")
    arr = np.asarray(arr)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2:
        raise ValueError(f"expected a [rows, K] matrix, got shape {arr.shape}")
    block = QK_K if name in K_QUANT_TYPES or name == "IQ4_XS" else 32
    if arr.shape[1] % block:
        hint = " (llama.cpp falls back to Q5_0/Q5_1/Q8_0 for such tensors)" if block == QK_K else ""
        raise ValueError(f"{name} needs rows whose length is a multiple of {block}, got K={arr.shape[1]}{hint}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"cannot quantize non-finite values to {name}")
    return arr.astype(np.float32, copy=False), name


def quantize(arr: np.ndarray, type_name: str) -> np.ndarray:
    """Quantize a float [rows, K] matrix to GGUF blocks: uint8 [rows, K/block * bytes per block].

    K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4_XS need K % 256 == 0, IQ4_NL K % 32, and are computed here; Q4_0, Q4_1, Q5_0,
    Q5_1 and Q8_0 (K % 32 == 0) are delegated to `gguf.quants.quantize`. The result is what a GGUF
    tensor of that type stores, ready for `GGUFWriter.add_tensor(..., raw_dtype=...)`."""
    arr, name = _check(arr, type_name)
    if name in K_QUANT_TYPES:
        return _k_blocks(arr, name, with_values=False)[0]
    if name in IQ4_TYPES:
        return _iq4_blocks(arr, name)[0]
    from gguf import GGMLQuantizationType, quants

    return np.asarray(quants.quantize(arr, GGMLQuantizationType[name]), dtype=np.uint8)


def quantize_with_values(arr: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, the float32 values they dequantize to), the values computed from the chosen codes
    rather than by reading the bytes back, so tests can check the packing against a dequantizer."""
    arr, name = _check(arr, type_name)
    if name in IQ4_TYPES:
        return _iq4_blocks(arr, name)
    if name not in K_QUANT_TYPES:
        from gguf import GGMLQuantizationType, quants

        qt = GGMLQuantizationType[name]
        blocks = np.asarray(quants.quantize(arr, qt), dtype=np.uint8)
        return blocks, quants.dequantize(blocks, qt).reshape(arr.shape).astype(np.float32)
    blocks, values = _k_blocks(arr, name, with_values=True)
    assert values is not None
    return blocks, values


# -- which type each tensor of a mixed file gets ----------------------------------------------------
# llama.cpp's fallback when a tensor's rows are not whole 256-element super-blocks
K_FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "iq4_xs": "iq4_nl"}


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for which layers' attn_v / ffn_down get Q6_K in a _K_M file: the first
    and last eighth of the layers and every third one in between."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


def tensor_type(name: str, row_len: int, weight_type: str, n_layers: int, tied: bool, n_gqa: int = 1) -> str:
    """The (lowercase) GGML type a 2-D weight named `name` (GGUF naming) gets in a file of
    `weight_type`, following llama.cpp's choices (without an importance matrix): for "q4_k_m",
    Q6_K for the output matrix (the token embedding when tied), attn_v and ffn_down in the
    use_more_bits layers, Q4_K for the rest; for "iq4_nl" / "iq4_xs", Q6_K for the output matrix,
    Q5_K for the first eighth of the layers' ffn_down and for attn_v where 4 or more query heads
    share a KV head (n_gqa), the IQ4 type for the rest; K types and IQ4_XS whose rows are not a
    multiple of 256 fall back as in K_FALLBACK."""
    t = weight_type
    parts = name.split(".")
    is_output = name == "output.weight" or (tied and name == "token_embd.weight")
    kind, layer = (parts[2], int(parts[1])) if parts[0] == "blk" else ("", -1)
    if weight_type == "q4_k_m":
        more_bits = kind in ("attn_v", "ffn_down") and use_more_bits(layer, n_layers)
        t = "q6_k" if is_output or more_bits else "q4_k"
    elif weight_type in ("iq4_nl", "iq4_xs"):
        more_bits = (kind == "ffn_down" and layer < n_layers // 8) or (kind == "attn_v" and n_gqa >= 4)
        t = "q6_k" if is_output else "q5_k" if more_bits else weight_type
    if t in K_FALLBACK and row_len % 256:
        t = K_FALLBACK[t]
    return t


def export_tensor_type(name: str, row_len: int, mode: str, n_layers: int, tied: bool, n_gqa: int = 1) -> str:
    """The type `fasterllama quantize --mode MODE` gives a weight: tensor_type's, and llama.cpp's
    other per-tensor rules (without an importance matrix): Q6_K for the output matrix (the token
    embedding when tied) in every file but q8_0 (q2_k's perplexity of the default model on 2,048
    tokens of GPL-3: 111.6 with a Q4_0 embedding; docs/quantization.md); in "q4_k" (Q4_K_S) files
    Q5_K for the first 4 layers' attn_v and the first eighth's ffn_down; in "q2_k" files Q3_K for
    attn_output, ffn_down and attn_v (Q4_K where 4 or more query heads share a KV head). Rows
    that are not a multiple of 256 fall back as in K_FALLBACK, and rows no block type fits (not a
    multiple of 32) stay F16, as llama.cpp leaves them."""
    parts = name.split(".")
    kind, layer = (parts[2], int(parts[1])) if parts[0] == "blk" else ("", -1)
    t = tensor_type(name, row_len, mode, n_layers, tied, n_gqa)
    if (name == "output.weight" or (tied and name == "token_embd.weight")) and mode != "q8_0":
        t = "q6_k"
    elif mode == "q4_k" and ((kind == "attn_v" and layer < 4) or (kind == "ffn_down" and layer < n_layers // 8)):
        t = "q5_k"
    elif mode == "q2_k" and kind in ("attn_v", "attn_output", "ffn_down"):
        t = "q4_k" if kind == "attn_v" and n_gqa >= 4 else "q3_k"
    if row_len % 32:
        return "f16"
    return K_FALLBACK[t] if t in K_FALLBACK and row_len % 256 else t
