"""Reference quantized ops: the int8/int4 matmuls and the seeds' fused quantize/dequantize ops,
each beside its float twin in reference.py and tested against the unfused composition."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from . import reference


# -- int4 packing: per group of g values, byte j holds value j (low nibble) and j + g/2 (high) -------
def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """q int [N, K] in 0..15 -> uint8 [N, K/2]; unpacking a group is one concat, no interleave."""
    N, K = q.shape
    g = q.to(torch.uint8).view(N, K // group_size, group_size)
    half = group_size // 2
    return (g[..., :half] | (g[..., half:] << 4)).reshape(N, K // 2).contiguous()


def unpack_int4_rows(packed: torch.Tensor, rows: torch.Tensor | slice, group_size: int) -> torch.Tensor:
    """The 4-bit values of some rows, as uint8 [rows, K/g, g]."""
    b = packed[rows]
    b = b.view(b.shape[0], -1, group_size // 2)
    return torch.cat((b & 15, b >> 4), dim=-1)


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    return unpack_int4_rows(packed, slice(None), group_size)


# -- panels (the CPU kernels' layout, csrc/cpu_kernels.c): rows in panels of 32, column by column -----
PANEL = 32


def _panel_order(t: torch.Tensor) -> torch.Tensor:
    """Per-row values [N, G] -> [P, G, 32], padded with zero rows. One strided copy, in numpy: a
    load orders every linear's scales (tens of millions at 1B weights), and torch's pad, transpose
    and copy took ~4x as long."""
    N, G = t.shape
    P = -(-N // PANEL)
    if t.device.type != "cpu" or t.dtype == torch.bfloat16:  # (numpy has no bf16)
        return F.pad(t, (0, 0, 0, P * PANEL - N)).view(P, PANEL, G).transpose(1, 2).contiguous()
    out = torch.empty(P, G, PANEL, dtype=t.dtype)  # (torch's allocation: 64-byte aligned, as the kernels' loads want)
    src, dst = t.detach().contiguous().numpy(), out.numpy().transpose(0, 2, 1)  # dst: [P, 32, G], a view of out
    full = N // PANEL
    dst[:full] = src[: full * PANEL].reshape(full, PANEL, G)
    if full < P:
        dst[full, : N - full * PANEL] = src[full * PANEL :]
        dst[full, N - full * PANEL :] = 0
    return out


def to_panels(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit row layout (pack_int4, scales/mins [N, G]) -> panels: uint8 [P, G, g, 16], byte j of
    a column holding row j (low nibble) and row j + 16 (high), and scales/mins [P, G, 32].
    A pure permutation: from_panels inverts it."""
    N, G = scales.shape
    q = F.pad(unpack_int4(packed, group_size), (0, 0, 0, 0, 0, -N % PANEL))
    q = q.view(-1, PANEL, G, group_size).permute(0, 2, 3, 1)
    return (q[..., :16] | (q[..., 16:] << 4)).contiguous(), _panel_order(scales), _panel_order(mins)


def panel_rows(qp: torch.Tensor, sp: torch.Tensor, mp: torch.Tensor, rows: torch.Tensor | slice, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Some rows of a 4-bit panel matrix: (values uint8 [R, G, g], scales [R, G], mins [R, G])."""
    idx = torch.arange(n, device=qp.device)[rows]
    p, j = idx // PANEL, idx % PANEL
    q = (qp[p, :, :, j % 16] >> (4 * (j // 16)).to(torch.uint8)[:, None, None]) & 15
    return q, sp[p, :, j], mp[p, :, j]


def from_panels(qp: torch.Tensor, sp: torch.Tensor, mp: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit panels -> the row layout of pack_int4 (packed [N, K/2], scales and mins [N, G])."""
    q, s, m = panel_rows(qp, sp, mp, slice(None), n)
    return pack_int4(q.reshape(n, -1), q.shape[-1]), s.contiguous(), m.contiguous()


def int8_to_panels(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] with scales [N] (per channel: one group of K) or [N, G] -> int8 [P, G, g, 32]
    and scales [P, G, 32]."""
    N, K = q.shape
    s = scale.reshape(N, -1)
    qp = F.pad(q, (0, 0, 0, -N % PANEL)).view(-1, PANEL, s.shape[1], K // s.shape[1]).permute(0, 2, 3, 1)
    return qp.contiguous(), _panel_order(s)


def int8_panel_rows(qp: torch.Tensor, sp: torch.Tensor, rows: torch.Tensor | slice, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Some rows of an int8 panel matrix: (values int8 [R, K], scales [R, G])."""
    idx = torch.arange(n, device=qp.device)[rows]
    p, j = idx // PANEL, idx % PANEL
    return qp[p, :, :, j].reshape(len(idx), -1), sp[p, :, j]


# Width code of 4-bit indices into IQ4_NL's 16 int8 values (llama.cpp's kvalues_iq4nl): a 4-bit
# panel whose values go through the table, w = scale * NL4_VALUES[q] (GGUF's IQ4_NL and IQ4_XS).
NL4 = 9
NL4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


# 5 and 6-bit panels in the lanes of the AVX2 int16 GEMV (the C kernels' width codes L5 and L6, the
# CPU kernels' choice: kernels.value_lanes()): blocks of eight columns, vector v = 4 p + h of a
# block holding column pair p's rows 8 h .. 8 h + 7, lane 2 r + e = column 2 p + e, row 8 h + r.
# L5: vectors 0-14 three to a 16-bit lane (bits 0-4, 5-9, 10-14) of five 32-byte words, vector 15
# as 16 bytes (176 bytes, 5.5 bits a value). L6: vectors 0-11 two to a lane (bits 0-5, 6-11) of six
# words, 12-15 in the lanes' top four bits (cpu_kernels.c: 192 bytes, 6 bits a value). A panel
# matrix in lanes is int16 [P, G, g, 11 or 12] (its bytes: the blocks); in planes uint8.
L5, L6 = 10, 11
_LANE_VECTOR = np.arange(16)[:, None]
_LANE_LANE = np.arange(16)[None, :]
LANE_COLUMN = 2 * (_LANE_VECTOR // 4) + _LANE_LANE % 2  # [vector, lane] -> column of the block's eight
LANE_ROW = 8 * (_LANE_VECTOR % 4) + _LANE_LANE // 2  # [vector, lane] -> row of the panel's 32
LANE_BLOCK = {5: 176, 6: 192}  # bytes of eight columns


def in_lanes(qp: torch.Tensor) -> bool:
    """Whether a panel matrix is in lanes (L5, L6): told by its dtype, int16."""
    return qp.dtype == torch.int16


def kernel_width(qp: torch.Tensor, bits: int) -> int:
    """The C kernels' width code of a panel matrix: L5 / L6 for 5 / 6 bits in lanes, else `bits`."""
    return (L5 if value_bits(bits) == 5 else L6) if in_lanes(qp) else bits


def _pack_lanes(v: np.ndarray, bits: int) -> np.ndarray:
    """Values [..., 8 columns, 32 rows] (< 2^bits) -> lane blocks [..., LANE_BLOCK[bits]] (uint8)."""
    vec = v[..., LANE_COLUMN, LANE_ROW].astype(np.uint16)  # [..., 16 vectors, 16 lanes]
    if bits == 5:
        words = vec[..., 0:15:3, :] | (vec[..., 1:15:3, :] << 5) | (vec[..., 2:15:3, :] << 10)
        tail = vec[..., 15, :].astype(np.uint8)
    else:
        v12, v13, v14, v15 = (vec[..., i, :] for i in range(12, 16))
        spare = np.stack((v12 & 15, (v12 >> 4) | ((v13 & 3) << 2), v13 >> 2, v14 & 15, (v14 >> 4) | ((v15 & 3) << 2), v15 >> 2), axis=-2)
        words = vec[..., 0:12:2, :] | (vec[..., 1:12:2, :] << 6) | (spare << 12)
        tail = np.zeros((*v.shape[:-2], 0), np.uint8)
    return np.concatenate((np.ascontiguousarray(words, dtype="<u2").view(np.uint8).reshape(*v.shape[:-2], -1), tail), axis=-1)


def _unpack_lanes(blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """Lane blocks [..., LANE_BLOCK[bits]] (uint8) -> values [..., 8 columns, 32 rows] (int32)."""
    lead = blocks.shape[:-1]
    nw = 5 if bits == 5 else 6
    w = blocks[..., : 32 * nw].reshape(*lead, 16 * nw, 2).to(torch.int32)
    w = (w[..., 0] | (w[..., 1] << 8)).reshape(*lead, nw, 16)
    if bits == 5:
        vec = torch.cat((torch.stack([(w >> (5 * s)) & 31 for s in range(3)], dim=-2).reshape(*lead, 15, 16), blocks[..., None, 160:].to(torch.int32)), dim=-2)
    else:
        sp = w >> 12
        top = torch.stack((sp[..., 0, :] | ((sp[..., 1, :] & 3) << 4), (sp[..., 1, :] >> 2) | (sp[..., 2, :] << 2),
                           sp[..., 3, :] | ((sp[..., 4, :] & 3) << 4), (sp[..., 4, :] >> 2) | (sp[..., 5, :] << 2)), dim=-2)
        vec = torch.cat((torch.stack((w & 63, (w >> 6) & 63), dim=-2).reshape(*lead, 12, 16), top), dim=-2)
    out = torch.empty(*lead, 8, PANEL, dtype=torch.int32, device=blocks.device)
    out[..., torch.from_numpy(LANE_COLUMN).to(blocks.device), torch.from_numpy(LANE_ROW).to(blocks.device)] = vec
    return out


def value_bits(bits: int) -> int:
    """The bits a value of width code `bits` takes in a panel (NL4: 4, L5: 5, L6: 6)."""
    return 4 if bits == NL4 else 5 if bits == L5 else 6 if bits == L6 else bits


def low_bits(bits: int) -> int:
    """Bits of a panel column's first plane: nibbles for 4-6 bits, 2-bit crumbs for 2-3 (each
    further bit a plane of its own; 6 bits' top two are crumbs, see pack_panels)."""
    return 4 if bits >= 4 else 2


def bit_planes(bits: int) -> int:
    """The one-bit planes after a panel column's first plane: 3 and 5 bits' top bit."""
    bits = value_bits(bits)
    return 0 if bits in (6, 8) else bits - low_bits(bits)


def _unit_columns(bits: int) -> int:
    """Columns whose bytes go together in a panel (2-5 bits): eight with a bit plane, a pair of 2-bit
    ones sharing their crumbs, or one."""
    return 8 if bit_planes(bits) else 2 if low_bits(bits) == 2 else 1


def _first_plane(v: np.ndarray, low: int) -> np.ndarray:
    """Values [..., g, 32] -> the first plane's 16 bytes a column (nibbles) or a pair of columns
    (crumbs), [..., g or g / 2, 16]."""
    if low == 4:
        return (v[..., :16] & 15) | ((v[..., 16:] & 15) << 4)
    pair = v.reshape(*v.shape[:-2], -1, 2, PANEL) & 3
    a, b = pair[..., 0, :], pair[..., 1, :]
    return a[..., :16] | (b[..., :16] << 2) | (a[..., 16:] << 4) | (b[..., 16:] << 6)


def pack_panels(q: torch.Tensor, group_size: int, bits: int, lanes: bool = False) -> torch.Tensor:
    """Values [N, K] (2-6 bits: 0 .. 2^bits - 1; 8 bits: int8) -> the CPU kernels' panels, uint8
    [P, G, g, 4 * bits]: a column of 4 bits is 16 bytes of nibbles (byte j: row j low, row j + 16
    high); columns of 2 bits go in pairs, 16 bytes of crumbs (byte j: row j of the first, of the
    second, row j + 16 of the first, of the second, from bit 0 up); columns of 6 bits too, each
    one's nibbles then the pair's top two bits as crumbs; a column of int8 is 32 bytes, row j at
    byte j (NL4: 4-bit panels of the indices). 3 and 5 bits go by eight columns (g a multiple of
    8): their first planes as 2 and 4 bits', then the top bits as a plane of 32 bytes (byte j: bit
    c is row j's of column c), which the kernels move into place with one shift for any column.
    Int8 panels equal int8_to_panels', 4-bit panels to_panels'. Packed 64 panels at a time: the
    temporaries stay small beside a vocabulary-sized matrix. In numpy (the panels are CPU memory):
    torch's uint8 kernels would map ~5 MB more of its code into every process that loads a model.
    lanes: 5 and 6 bits in lanes (above) instead of the planes: int16 [P, G, g, 11 or 12]."""
    N, K = q.shape
    G = K // group_size
    P = -(-N // PANEL)
    bits = value_bits(bits)
    lanes = lanes and bits in LANE_BLOCK
    src = q.cpu().numpy()
    if lanes:
        packed = torch.empty(P, G, group_size, LANE_BLOCK[bits] // 16, dtype=torch.int16)  # torch's allocation: 64-byte aligned, as the kernels' loads want
        out = packed.view(torch.uint8).numpy()
    else:
        packed = torch.empty(P, G, group_size, 4 * bits, dtype=torch.uint8)
        out = packed.numpy()
    low, planes = low_bits(bits), bit_planes(bits)
    if (planes or lanes) and group_size % 8:
        raise ValueError(f"{bits}-bit panels take groups of a multiple of 8 columns, not {group_size}")
    for p0 in range(0, P, 64):
        p1 = min(P, p0 + 64)
        rows = src[p0 * PANEL : p1 * PANEL]
        if rows.shape[0] < (p1 - p0) * PANEL:
            rows = np.pad(rows, ((0, (p1 - p0) * PANEL - rows.shape[0]), (0, 0)))
        v = rows.reshape(p1 - p0, PANEL, G, group_size).transpose(0, 2, 3, 1)  # [panels, G, g, 32]
        if bits == 8:
            out[p0:p1] = v.astype(np.int8).view(np.uint8)
            continue
        v = v.astype(np.uint8)
        if lanes:
            out[p0:p1].reshape(p1 - p0, G, group_size // 8, LANE_BLOCK[bits])[...] = _pack_lanes(v.reshape(p1 - p0, G, group_size // 8, 8, PANEL), bits)
            continue
        if bits == 6:  # pairs: each column's nibbles, then both columns' top two bits as crumbs
            pair = out[p0:p1].reshape(p1 - p0, G, group_size // 2, 48)
            nib = _first_plane(v, 4).reshape(*pair.shape[:-1], 32)
            pair[..., :32] = nib
            pair[..., 32:] = _first_plane(v >> 4, 2)
            continue
        if not planes:
            dst = out[p0:p1] if low == 4 else out[p0:p1].reshape(p1 - p0, G, group_size // 2, 16)  # a column, or a pair
            dst[...] = _first_plane(v, low)
            continue
        v8 = v.reshape(p1 - p0, G, group_size // 8, 8, PANEL)  # eight columns
        dst = out[p0:p1].reshape(p1 - p0, G, group_size // 8, 32 * bits)
        first = 16 * low * 2  # 8 columns' nibbles, or 4 pairs' crumbs
        dst[..., :first] = _first_plane(v8, low).reshape(*dst.shape[:-1], first)
        for b in range(planes):  # byte j: bit c is column c's bit low + b of row j
            dst[..., first + 32 * b : first + 32 * (b + 1)] = np.bitwise_or.reduce(((v8 >> (low + b)) & 1) << _COLUMN_BITS, axis=-2)
    return packed.to(q.device)


_COLUMN_BITS = np.arange(8, dtype=np.uint8)[:, None]  # column c of eight -> bit c of a plane's bytes


def panel_values(qp: torch.Tensor, bits: int, rows: torch.Tensor | slice, n: int) -> torch.Tensor:
    """The values of some rows of a panel matrix (pack_panels), int32 [R, G, g] (NL4: the indices)."""
    lanes = in_lanes(qp)
    bits = value_bits(bits)
    idx = torch.arange(n, device=qp.device)[rows]
    p, j = idx // PANEL, idx % PANEL
    cols = qp[p]  # [R, G, g, 4 * bits]
    jj = j[:, None, None]
    if lanes:
        R, G, g, _ = cols.shape
        v = _unpack_lanes(cols.view(torch.uint8).reshape(R, G, g // 8, LANE_BLOCK[bits]), bits).reshape(R, G, g, PANEL)
        return torch.gather(v, 3, jj.expand(R, G, g)[..., None])[..., 0]
    if bits == 8:
        return torch.gather(cols, 3, jj.expand(*cols.shape[:3])[..., None])[..., 0].view(torch.int8).to(torch.int32)
    low = low_bits(bits)
    if bits == 6:  # pairs: the column's nibbles, the pair's crumbs of the top two bits
        R, G, g, _ = cols.shape
        pair = cols.reshape(R, G, g // 2, 48).to(torch.int32)
        odd = torch.arange(g, device=qp.device) % 2
        nib = pair[..., :32].reshape(R, G, g, 16)
        top = pair[..., None, 32:].expand(R, G, g // 2, 2, 16).reshape(R, G, g, 16)
        at = lambda t, i: torch.gather(t, 3, i.expand(*t.shape[:3])[..., None])[..., 0]  # noqa: E731
        return ((at(nib, jj % 16) >> (4 * (jj // 16))) & 15) | (((at(top, jj % 16) >> (2 * odd + 4 * (jj // 16))) & 3) << 4)
    R, G, g, _ = cols.shape
    per = _unit_columns(bits)
    unit = cols.reshape(R, G, g // per, per * 4 * bits).to(torch.int32)
    jj = j[:, None, None, None]
    c = torch.arange(per, device=qp.device)  # a column's place in its unit

    def byte(i: torch.Tensor) -> torch.Tensor:  # i [R, 1, 1, n] -> the bytes [R, G, g / per, n]
        return torch.gather(unit, 3, i.expand(R, G, g // per, i.shape[-1]))

    first = byte(jj % 16 + 16 * (c // 2 if low == 2 else c))  # the first-plane byte of row j: the column's, or its pair's
    v = (first >> (2 * (c % 2) * (low == 2) + 4 * (jj // 16))) & ((1 << low) - 1)
    for b in range(bit_planes(bits)):
        v = v | ((byte(jj + 32 * low + 32 * b) >> c) & 1) << (low + b)
    return v.reshape(R, G, g)


def unpack_panels(qp: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Every row's values [n, K] (uint8 for 2-6 bits, int8 for 8) back from pack_panels' layout,
    64 panels at a time (panel_values reads any rows, but holds each row's whole panel column)."""
    P, G, g, _ = qp.shape
    lanes = in_lanes(qp)
    bits = value_bits(bits)
    out = torch.empty(P * PANEL, G * g, dtype=torch.int8 if bits == 8 else torch.uint8, device=qp.device)
    shifts = torch.arange(8, dtype=torch.uint8, device=qp.device)
    low = low_bits(bits)
    for p0 in range(0, P, 64):
        cols = qp[p0 : p0 + 64]  # [p, G, g, 4 * bits]
        if bits == 8:
            v = cols.view(torch.int8)
        elif lanes:
            v = _unpack_lanes(cols.view(torch.uint8).reshape(*cols.shape[:2], g // 8, LANE_BLOCK[bits]), bits).reshape(*cols.shape[:3], PANEL).to(torch.uint8)
        elif bits == 6:  # pairs: each column's nibbles, then the pair's crumbs of the top two bits
            pair = cols.reshape(*cols.shape[:2], g // 2, 48)
            nib = pair[..., :32].reshape(*cols.shape[:3], 16)
            c = pair[..., 32:]
            top = torch.stack((torch.cat((c & 3, (c >> 4) & 3), -1), torch.cat(((c >> 2) & 3, c >> 6), -1)), dim=-2).reshape(*cols.shape[:3], PANEL)
            v = torch.cat((nib & 15, nib >> 4), dim=-1) | (top << 4)
        else:  # by units of `per` columns: their first planes, then any bit planes
            per = _unit_columns(bits)
            unit = cols.reshape(*cols.shape[:2], g // per, 4 * bits * per)
            if low == 4:
                nib = unit[..., : 16 * per].reshape(*unit.shape[:3], per, 16)
                v = torch.cat((nib & 15, nib >> 4), dim=-1)  # [p, G, g / per, per, 32]: rows 0-15 low nibbles, 16-31 high
            else:  # pairs' crumbs
                c = unit[..., : 8 * per].reshape(*unit.shape[:3], per // 2, 16)
                v = torch.stack((torch.cat((c & 3, (c >> 4) & 3), -1), torch.cat(((c >> 2) & 3, c >> 6), -1)), dim=-2).reshape(*unit.shape[:3], per, 32)
            for b in range(bit_planes(bits)):  # plane b: bit c of byte j is column c's bit low + b of row j
                plane = unit[..., 32 * low + 32 * b : 32 * low + 32 * (b + 1)]
                v = v | (((plane[..., None, :] >> shifts[:, None]) & 1) << (low + b))
            v = v.reshape(*cols.shape[:3], PANEL)
        out[p0 * PANEL : (p0 + cols.shape[0]) * PANEL] = v.permute(0, 3, 1, 2).reshape(-1, G * g)
    return out[:n]


def panel_centre(bits: int) -> int:
    """The offset of values stored without mins: w = s * (q - centre) (0 for int8)."""
    return 0 if bits >= 8 else 1 << (bits - 1)


def panel_scales(sp: torch.Tensor, n: int) -> torch.Tensor:
    """Per-row values [N, G] back from their panel order [P, G, 32] (inverts _panel_order)."""
    return sp.transpose(1, 2).reshape(-1, sp.shape[1])[:n].contiguous()


def factored(sub: torch.Tensor, sup: torch.Tensor | None) -> torch.Tensor:
    """Scales or mins as floats, from stored floats, or (sup given) from a K-quant's factored form:
    int8 sub-block values [.., G, ..] times an fp16 scale per G / S groups, sup [.., S, ..] (dim 1 of
    both). int8 times fp16 is exact in fp32: the same floats as d * sc."""
    if sup is None:
        return sub.float()
    return sub.float() * sup.float().repeat_interleave(sub.shape[1] // sup.shape[1], dim=1)


def dequantize_panel_rows(qp: torch.Tensor, sp: torch.Tensor, mp: torch.Tensor | None, bits: int, rows: torch.Tensor | slice, n: int,
                          dtype: torch.dtype = torch.float32, sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """Float weights [R, K] of some rows: scale * q + min per group (min: stored, or -centre * scale;
    sups: the super-block scales of factored scales and mins, PackedLinear)."""
    idx = torch.arange(n, device=qp.device)[rows]
    p, j = idx // PANEL, idx % PANEL
    sup_s, sup_m = (None, None) if sups is None else sups
    s = factored(sp[p, :, j], None if sup_s is None else sup_s[p, :, j])[..., None]
    m = -panel_centre(bits) * s if mp is None else factored(mp[p, :, j], None if sup_m is None else sup_m[p, :, j])[..., None]
    q = panel_values(qp, bits, rows, n)
    if bits == NL4:
        q = torch.tensor(NL4_VALUES, dtype=torch.int32, device=q.device)[q]
    w = q.float() * s + m
    return w.reshape(len(idx), -1).to(dtype)


# -- weight-only matmuls ----------------------------------------------------------------------------
_ROWS_PER_CHUNK_ELEMS = 1 << 20  # dequantize ~1M weights (4 MB fp32) at a time: stays in cache


def _chunked_dequant_linear(x2: torch.Tensor, n: int, dequant_rows, bias: torch.Tensor | None) -> torch.Tensor:
    k = x2.shape[1]
    step = max(64, _ROWS_PER_CHUNK_ELEMS // k)
    out = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        out[:, lo:hi] = F.linear(x2, dequant_rows(lo, hi))
    return out if bias is None else out + bias


def int8_weight_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                       mins: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (q * scale + min)^T for int8 q with per-channel [N] or per-group [N, K/g] scales (and,
    with per-group scales, optionally per-group mins).

    Dequantizes a block of rows at a time into cache-sized float tiles and runs the float GEMM:
    on AVX2 CPUs this beats torch's int8-weight kernel with float activations by far."""
    N, K = qweight.shape
    G = 1 if scale.dim() == 1 else scale.shape[1]
    sc = scale.view(N, G, 1).to(x.dtype)
    mn = None if mins is None else mins.view(N, G, 1).to(x.dtype)

    def rows(lo: int, hi: int) -> torch.Tensor:
        w = qweight[lo:hi].view(hi - lo, G, K // G).to(x.dtype) * sc[lo:hi]
        return (w if mn is None else w + mn[lo:hi]).view(hi - lo, K)

    return _chunked_dequant_linear(x.reshape(-1, K), N, rows, bias).view(*x.shape[:-1], N)


def side_by_side(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b's elements each follow a's in memory: [.., 2] pairs, views of one tensor."""
    return a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride() and a.stride()[-1] == 2 \
        and a.stride()[0] == 2 * a.shape[-1] and b.data_ptr() == a.data_ptr() + a.element_size()


def interleave(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a and b as views of one [.., 2] tensor of pairs (side_by_side)."""
    pairs = torch.stack((a, b), dim=-1).contiguous()
    return pairs[..., 0], pairs[..., 1]


def symmetric_mins(scales: torch.Tensor) -> torch.Tensor:
    """The mins of Q4_0's symmetric groups, w = scale * (q - 8): -8 * scale (exact)."""
    return scales * -8


def dequantize_int4_tile(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [rows, G, g/2] + fp16 scale/min [rows, G] -> float weights [rows, G, g]."""
    q = torch.cat((packed & 15, packed >> 4), dim=-1).to(dtype)
    return torch.addcmul(mins[..., None].to(dtype), q, scales[..., None].to(dtype))


def int4_weight_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                       bias: torch.Tensor | None = None, sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """x @ W^T with W = scale * q + min per group of `group_size` input columns, q in 0..15 (mins
    None: Q4_0's symmetric groups, min = -8 * scale; sups: scales and mins in a K-quant's
    factored form, int8 sub-block values times (scale_super, min_super))."""
    if sups is not None:
        scales, mins = factored(scales, sups[0]), None if mins is None else factored(mins, sups[1])
    mins = symmetric_mins(scales) if mins is None else mins
    N, G = scales.shape
    K = G * group_size

    def rows(lo: int, hi: int) -> torch.Tensor:
        tile = packed[lo:hi].view(hi - lo, G, group_size // 2)
        return dequantize_int4_tile(tile, scales[lo:hi], mins[lo:hi], x.dtype).view(hi - lo, K)

    return _chunked_dequant_linear(x.reshape(-1, K), N, rows, bias).view(*x.shape[:-1], N)


def panel_linear(x: torch.Tensor, qp: torch.Tensor, sp: torch.Tensor, mp: torch.Tensor | None, n: int, bits: int,
                 bias: torch.Tensor | None = None, sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """x @ W^T for W in panels (pack_panels), dequantized a block of rows at a time."""
    k = qp.shape[1] * qp.shape[2]
    rows = lambda lo, hi: dequantize_panel_rows(qp, sp, mp, bits, slice(lo, hi), n, x.dtype, sups)  # noqa: E731
    return _chunked_dequant_linear(x.reshape(-1, k), n, rows, bias).view(*x.shape[:-1], n)


def round_activations(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """x with each row rounded to int8 per chunk of `chunk` columns (scale absmax / 127, rounded
    half to even), returned as floats: what llama.cpp's integer dot products multiply."""
    k = x.shape[-1]
    xc = x.float().reshape(-1, k // chunk, chunk)
    scale = xc.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    return (torch.round(xc / scale).clamp(-127, 127) * scale).reshape(x.shape)


def panel_chunk(group_size: int) -> int:
    """The columns of x that share one int8 scale under panel_linear_a8: a weight group, at most 32."""
    return min(group_size, 32)


def a8_input(x: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """x as quantization "gguf-a8" multiplies it by weights in groups of group_size (None: per
    channel): rounded to int8 per chunk of panel_chunk(group) columns, as floats (fp32)."""
    return round_activations(x, panel_chunk(group_size or 32))


def panel_linear_a8(x: torch.Tensor, qp: torch.Tensor, sp: torch.Tensor, mp: torch.Tensor | None, n: int, bits: int,
                    bias: torch.Tensor | None = None, sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """panel_linear of x rounded to int8 (round_activations, chunks of panel_chunk(g) columns): the
    weights stay exactly the file's, the activations take llama.cpp's 8 bits (prefill under
    quantization "gguf-a8"), in fp32, returned in x's dtype."""
    return panel_linear(round_activations(x, panel_chunk(qp.shape[2])), qp, sp, mp, n, bits, bias, sups).to(x.dtype)


def int8_weight_linear_a8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                          mins: torch.Tensor | None = None) -> torch.Tensor:
    """int8_weight_linear of x rounded to int8 per chunk of panel_chunk(group) columns (32 per
    channel), in fp32: quantization "gguf-a8" off the CPU (the GPU's integer dot products)."""
    group = qweight.shape[1] // scale.shape[1] if scale.dim() == 2 else None
    return int8_weight_linear(a8_input(x, group), qweight, scale, bias, mins).to(x.dtype)


def int4_weight_linear_a8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                          bias: torch.Tensor | None = None, sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """int4_weight_linear of x rounded to int8 per chunk of panel_chunk(group_size) columns, in fp32."""
    return int4_weight_linear(a8_input(x, group_size), packed, scales, mins, group_size, bias, sups).to(x.dtype)


def quantize_per_token(x: torch.Tensor, static_scale: torch.Tensor | None = None, clip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows with a dynamic absmax/127 scale per token, or one static (calibrated) scale.
    Under a static scale, a row beyond its range (absmax > 127 * scale: an attention sink or a
    massive-activation token, ~10-100x the rest) takes its own absmax/127 scale, unless `clip`."""
    x = x.float()
    scale = per_token_scales(x.abs().amax(dim=-1), static_scale, clip)
    return torch.round(x / scale[..., None]).clamp(-127, 127).to(torch.int8), scale


def per_token_scales(amax: torch.Tensor, static_scale: torch.Tensor | None = None, clip: bool = False) -> torch.Tensor:
    """quantize_per_token's scale of each row from the row's absmax (the maximum over every
    tensor-parallel rank's part of the row, in parallel/sharding.py)."""
    if static_scale is not None and clip:
        return static_scale.float().expand(amax.shape)
    scale = amax.clamp(min=1e-12) / 127
    if static_scale is None:
        return scale
    static = static_scale.float().expand(amax.shape)
    return torch.where(amax > static * 127, scale, static)


def int8_gemm(xq: torch.Tensor, qweight_t: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] x int8 [K, N] -> exact int32 [M, N]."""
    M = xq.shape[0]
    if xq.device.type == "cuda" and M <= 16:  # cuBLASLt int8 needs M > 16
        padded = torch.zeros(17, xq.shape[1], dtype=torch.int8, device=xq.device)
        padded[:M] = xq
        return torch._int_mm(padded, qweight_t)[:M]
    return torch._int_mm(xq, qweight_t)


def dequantize_gemm(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    y = acc.float() * x_scale[:, None] * w_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def int8_linear(xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """FasterLLaMA's INT8 GEMM with its dequantizing epilogue: int8 [M, K] x int8 [N, K]^T -> dtype [M, N]."""
    from . import get_op

    acc = get_op("int8_gemm", xq.device)(xq, qweight.t())
    return get_op("dequantize_gemm", acc.device)(acc, x_scale, w_scale, bias, dtype)


# -- the seeds' fused ops (FasterLLaMA), reference versions ---------------------------------------------
def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, static_scale: torch.Tensor | None = None, clip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """resNormQuantized: RMSNorm, then per-token int8 quantization."""
    return quantize_per_token(reference.rms_norm(x, weight, eps), static_scale, clip)


def add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, static_scale: torch.Tensor | None = None, clip: bool = False
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The residual add, then resNormQuantized: ((int8 normed rows, their scales), x + residual)."""
    h = x + residual
    return rms_norm_quant(h, weight, eps, static_scale, clip), h


def silu_and_mul_quant(gate_up: torch.Tensor, static_scale: torch.Tensor | None = None, clip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(gate)*up then per-token quantization (the float half of DequantizedSiluMultifyQuantized)."""
    return quantize_per_token(reference.silu_and_mul(gate_up), static_scale, clip)
