"""GGUF's quantized block formats read as integer values with a scale and a min per group, the
form the CPU kernels compute with (quant/linear.py PackedLinear): w = scale * q + min.

Every format here is exact in that form: scale * q needs at most 23 significant bits, so it is an
fp32 value, and the kernels' fma(scale, q, min) rounds once where gguf's dequantizers compute
scale * q and then add the min (or have none). Byte layouts follow ggml's block structs
(ggml-common.h) and gguf-py's dequantizers, which tests/test_gguf_blocks.py checks against."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ops.quantized import NL4
from ..ops.quantized import NL4_VALUES as _NL4_VALUES

QK_K = 256
NL4_VALUES = np.array(_NL4_VALUES, dtype=np.int8)  # IQ4_NL / IQ4_XS: w = scale * NL4_VALUES[q], width code NL4


@dataclass
class Factors:
    """A K-quant's scales (and mins) as the file holds them: int8 sub-block values [rows, G] times
    one fp16 value per super-block of G / S groups [rows, S] (its d; -dmin, or -4 d, for mins).
    Exact: every product is the fp32 scale (min) itself."""

    scale_sub: np.ndarray
    scale_super: np.ndarray
    min_sub: np.ndarray | None
    min_super: np.ndarray | None

    def products(self, sub: np.ndarray, sup: np.ndarray) -> np.ndarray:
        return sub.astype(np.float32) * np.repeat(sup.astype(np.float32), sub.shape[1] // sup.shape[1], axis=1)


def _factors(scale: np.ndarray, mins: np.ndarray | None, sub: np.ndarray, sup: np.ndarray, min_sub: np.ndarray | None = None,
             min_super: np.ndarray | None = None) -> Factors | None:
    """Factors of [rows, G] scales and mins from sub-block values and per-super-block values
    [rows, S, 1] or [rows, S]; None where a product is not exactly the scale (an fp16 overflow)."""
    rows = scale.shape[0]
    f = Factors(sub.reshape(rows, -1).astype(np.int8), sup.reshape(rows, -1).astype(np.float16),
                None if min_sub is None else min_sub.reshape(rows, -1).astype(np.int8), None if min_super is None else min_super.reshape(rows, -1).astype(np.float16))
    exact = np.array_equal(f.products(f.scale_sub, f.scale_super), scale) and (
        (mins is None) == (f.min_sub is None) and (mins is None or np.array_equal(f.products(f.min_sub, f.min_super), mins)))
    return f if exact else None


@dataclass
class Blocks:
    """A [rows, K] tensor as q (uint8 values of `bits` bits; int8 for 8 bits; 4-bit indices for
    bits == NL4) with scale and min [rows, K / group] float32. mins None: w = scale * (q -
    centre), centre = 2^(bits-1) below 8 bits, 0 for int8; NL4: w = scale * NL4_VALUES[q].
    factors: the K-quants' scales and mins in their compact form too."""

    q: np.ndarray
    scale: np.ndarray
    mins: np.ndarray | None
    bits: int
    factors: Factors | None = None

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @property
    def centre(self) -> int:
        return 0 if self.bits >= 8 else 1 << (self.bits - 1)

    def map_rows(self, fn) -> None:
        """Reorder the rows of every per-row array alike (fn: [rows, ...] -> [rows, ...]; q/k's RoPE
        row permutation)."""
        self.q, self.scale = fn(self.q), fn(self.scale)
        self.mins = None if self.mins is None else fn(self.mins)
        f = self.factors
        if f is not None:
            self.factors = Factors(*(None if a is None else fn(a) for a in (f.scale_sub, f.scale_super, f.min_sub, f.min_super)))

    def explicit_mins(self) -> np.ndarray:
        return -np.float32(self.centre) * self.scale if self.mins is None else self.mins

    def values(self) -> np.ndarray:
        """The float32 weights (the reference for tests; never used on the model's path)."""
        rows, k = self.q.shape
        q = (NL4_VALUES[self.q] if self.bits == NL4 else self.q).astype(np.float32).reshape(rows, -1, self.group)
        if self.mins is None and self.bits < 8:
            q = q - np.float32(self.centre)
            return (q * self.scale[..., None]).reshape(rows, k)
        return (q * self.scale[..., None] + (0 if self.mins is None else self.mins[..., None])).reshape(rows, k)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry (last axis) as fp16 -> float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _bits_of(b: np.ndarray, count: int) -> np.ndarray:
    """Bytes [..., n] -> their bits [..., n, count] from bit 0 up (little-endian order)."""
    return (b[..., None] >> np.arange(count, dtype=np.uint8)) & 1


def _q8_0(b: np.ndarray) -> Blocks:
    return Blocks(b[..., 2:].copy().view(np.int8).reshape(b.shape[0], -1), _f16(b[..., 0:2]), None, 8)


def _q4_0(b: np.ndarray) -> Blocks:  # d, 16 bytes: element j low nibble, j + 16 high
    q = np.concatenate((b[..., 2:] & 15, b[..., 2:] >> 4), axis=-1)
    return Blocks(q.reshape(b.shape[0], -1), _f16(b[..., 0:2]), None, 4)


def _q4_1(b: np.ndarray) -> Blocks:  # d, m, nibbles
    q = np.concatenate((b[..., 4:] & 15, b[..., 4:] >> 4), axis=-1)
    return Blocks(q.reshape(b.shape[0], -1), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes of fifth bits (bit j for element j) -> [..., 32] of 0/16."""
    return (_bits_of(qh, 8).reshape(*qh.shape[:-1], 32) << 4).astype(np.uint8)


def _q5_0(b: np.ndarray) -> Blocks:  # d, 4 bytes of fifth bits, nibbles
    q = np.concatenate((b[..., 6:] & 15, b[..., 6:] >> 4), axis=-1) | _fifth_bits(b[..., 2:6])
    return Blocks(q.reshape(b.shape[0], -1), _f16(b[..., 0:2]), None, 5)


def _q5_1(b: np.ndarray) -> Blocks:  # d, m, 4 bytes of fifth bits, nibbles
    q = np.concatenate((b[..., 8:] & 15, b[..., 8:] >> 4), axis=-1) | _fifth_bits(b[..., 4:8])
    return Blocks(q.reshape(b.shape[0], -1), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 5)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins: sub-blocks 0-3 in the low 6
    bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11, their top 2 bits
    in the top bits of bytes 0-3 and 4-7."""
    lo, hi = s[..., 0:4].astype(np.int32), s[..., 4:8].astype(np.int32)
    last = s[..., 8:12].astype(np.int32)
    sc = np.concatenate((lo & 63, (last & 15) | ((lo >> 6) << 4)), axis=-1)
    mn = np.concatenate((hi & 63, (last >> 4) | ((hi >> 6) << 4)), axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 values: each 32-byte chunk gives 32 values from its low nibbles, then 32
    from its high nibbles."""
    c = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate((c & 15, c >> 4), axis=-2).reshape(*qs.shape[:-1], QK_K)


def _q4_k(b: np.ndarray) -> Blocks:  # d, dmin, 12 bytes of scales/mins, 128 bytes of nibbles
    rows = b.shape[0]
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _scale_min_k4(b[..., 4:16])
    scale, mins = (d * sc).reshape(rows, -1), (-(dmin * mn)).reshape(rows, -1)
    return Blocks(_k_nibbles(b[..., 16:144]).reshape(rows, -1), scale, mins, 4, _factors(scale, mins, sc, d, mn, -dmin))


def _q5_k(b: np.ndarray) -> Blocks:  # d, dmin, scales, 32 bytes of fifth bits, 128 bytes of nibbles
    rows = b.shape[0]
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _scale_min_k4(b[..., 4:16])
    # element l of sub-block i takes bit i of qh[l]
    high = np.swapaxes(_bits_of(b[..., 16:48], 8), -1, -2).reshape(*b.shape[:-1], QK_K) << 4
    q = _k_nibbles(b[..., 48:176]) | high.astype(np.uint8)
    scale, mins = (d * sc).reshape(rows, -1), (-(dmin * mn)).reshape(rows, -1)
    return Blocks(q.reshape(rows, -1), scale, mins, 5, _factors(scale, mins, sc, d, mn, -dmin))


def _q6_k(b: np.ndarray) -> Blocks:  # 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d
    rows = b.shape[0]
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32)  # [half, 32-byte run, byte]
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    low = np.stack((ql[..., 0, :] & 15, ql[..., 1, :] & 15, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4), axis=-2)  # [.., 2, 4, 32]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [.., 2, 4, 32]
    q = (low | (high << 4)).reshape(rows, -1)
    sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])[..., None]
    scale = (d * sc).reshape(rows, -1)
    return Blocks(q, scale, None, 6, _factors(scale, None, sc, d))


def _q2_k(b: np.ndarray) -> Blocks:  # 16 bytes of 4-bit scale | 4-bit min, 64 bytes of 2-bit values, d, dmin
    rows = b.shape[0]
    qs = b[..., 16:80].reshape(*b.shape[:-1], 2, 1, 32)
    q = ((qs >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(rows, -1)
    d, dmin = _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
    sc, mn = (b[..., 0:16] & 15).astype(np.float32), (b[..., 0:16] >> 4).astype(np.float32)
    scale, mins = (d * sc).reshape(rows, -1), (-(dmin * mn)).reshape(rows, -1)
    return Blocks(q, scale, mins, 2, _factors(scale, mins, sc, d, mn, -dmin))


def _q3_k(b: np.ndarray) -> Blocks:  # 32 bytes of third bits, 64 bytes of 2-bit values, 12 bytes of 6-bit scales, d
    rows = b.shape[0]
    qs = b[..., 32:96].reshape(*b.shape[:-1], 2, 1, 32)
    low = (qs >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [.., 2, 4, 32]
    hbit = _bits_of(b[..., 0:32], 8)  # [.., 32, 8]: bit 4n + j of hmask[l] for value 128n + 32j + l
    hbit = np.swapaxes(hbit, -1, -2).reshape(*b.shape[:-1], 2, 4, 32)
    q = (low | (hbit << 2)).reshape(rows, -1)  # w = s * (q - 4)
    s = b[..., 96:108]
    i = np.arange(16)
    sc = ((s[..., i % 8] >> (4 * (i // 8)).astype(np.uint8)) & 15) | (((s[..., 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 3) << 4)
    d, sub = _f16(b[..., 108:110])[..., None], sc.astype(np.float32) - 32
    scale = (d * sub).reshape(rows, -1)
    return Blocks(q, scale, None, 3, _factors(scale, None, sub, d))


def _iq4_nl(b: np.ndarray) -> Blocks:  # d, 16 bytes: element j low nibble, j + 16 high (Q4_0's layout)
    q = np.concatenate((b[..., 2:] & 15, b[..., 2:] >> 4), axis=-1)
    return Blocks(q.reshape(b.shape[0], -1), _f16(b[..., 0:2]), None, NL4)


def _iq4_xs(b: np.ndarray) -> Blocks:  # d, 2 bytes of scales' high bits, 4 of low nibbles, 8 x 16 bytes of IQ4_NL nibbles
    rows = b.shape[0]
    d = _f16(b[..., 0:2])[..., None]
    high = (np.ascontiguousarray(b[..., 2:4]).view(np.uint16)[..., :1] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    low = (b[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(*b.shape[:-1], 8) & 15
    sub = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32
    qs = b[..., 8:136].reshape(*b.shape[:-1], 8, 16)
    q = np.concatenate((qs & 15, qs >> 4), axis=-1).reshape(rows, -1)
    scale = (d * sub).reshape(rows, -1)
    return Blocks(q, scale, None, NL4, _factors(scale, None, sub, d))


# type -> (bytes per block, values per block, decoder)
FORMATS = {
    "Q8_0": (34, 32, _q8_0), "Q4_0": (18, 32, _q4_0), "Q4_1": (20, 32, _q4_1), "Q5_0": (22, 32, _q5_0), "Q5_1": (24, 32, _q5_1),
    "Q2_K": (84, QK_K, _q2_k), "Q3_K": (110, QK_K, _q3_k), "Q4_K": (144, QK_K, _q4_k), "Q5_K": (176, QK_K, _q5_k), "Q6_K": (210, QK_K, _q6_k),
    "IQ4_NL": (18, 32, _iq4_nl), "IQ4_XS": (136, QK_K, _iq4_xs),
}


def decode(data: np.ndarray, type_name: str, rows: int) -> Blocks:
    """Raw GGUF blocks of a [rows, K] tensor -> Blocks."""
    size, _, fn = FORMATS[type_name]
    return fn(np.ascontiguousarray(data).reshape(rows, -1, size))


def combine(parts: list[Blocks]) -> Blocks:
    """Row-wise concatenation of tensors of possibly different formats (a fused projection whose
    parts a _K_M file quantized differently) in the narrowest form that holds each exactly: the
    widest values, the finest groups, mins stored unless every part is centred alike."""
    if len(parts) == 1:
        return parts[0]
    if all(p.factors is not None for p in parts) and len({(p.bits, p.group, p.factors.scale_super.shape[1], p.mins is None) for p in parts}) == 1:
        fs = [p.factors for p in parts]  # one K-quant type: stack, factors included
        cat = lambda key: None if getattr(fs[0], key) is None else np.concatenate([getattr(f, key) for f in fs])  # noqa: E731
        return Blocks(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]),
                      None if parts[0].mins is None else np.concatenate([p.mins for p in parts]), parts[0].bits,
                      Factors(cat("scale_sub"), cat("scale_super"), cat("min_sub"), cat("min_super")))
    bits = max(p.bits for p in parts)
    if bits == NL4 and any(p.bits != NL4 for p in parts):
        bits = 8  # IQ4 values are int8 ones
    group = min(p.group for p in parts)
    centred = all(p.mins is None and (p.bits == bits or bits == 8) for p in parts)
    qs, scales, mins = [], [], []
    for p in parts:
        rep = p.group // group
        s = np.repeat(p.scale, rep, axis=1)
        if bits == 8 and p.bits == NL4:
            q, m = NL4_VALUES[p.q], None
        elif bits == 8 and p.bits < 8:  # as int8: centred values shift, others keep mins
            q = p.q.astype(np.int16) - (p.centre if p.mins is None else 0)
            m = None if p.mins is None else np.repeat(p.mins, rep, axis=1)
        else:
            q, m = p.q, None if centred else np.repeat(p.explicit_mins(), rep, axis=1)
        if bits == 8 and not centred and m is None:
            m = np.zeros_like(s)
        qs.append(q.astype(np.int8) if bits == 8 else q)
        scales.append(s)
        mins.append(m)
    return Blocks(np.concatenate(qs), np.concatenate(scales), None if centred else np.concatenate(mins), bits)
