"""Decode GEMVs with int8 activations (quantization "gguf-a8" on the GPU): llama.cpp's integer dot
products over int8 and 4-bit weights kept quantized.

The float-activation GEMVs (gemv.py) turn every weight into an fp32 number before its FMA: ~3.4
(4-bit) and ~4.5 (int8) sm_90 instructions a weight, as many as a batch-1 GEMV streaming 4 TB/s
has room for, so they stop short of the bandwidth (on an H200, 4-bit at 47% of it, int8 at 66%).
With x rounded to int8 per chunk of columns (ops.quantized.round_activations: scale absmax / 127,
halves to even, the CPU's a8_quantize_row), four weights meet four activations in one IDP4A
(int8 x int8 -> int32, exact), and a 4-bit word's eight values are two masks away from two of
them: 1.4-1.8 instructions a weight in the K loop (benchmarks/gpu_sass.py), a fifth to a third of
them the per-group scales' loads and arithmetic. Per chunk, sum w x = w_scale * x_scale * sum q xq
(+ w_min * x_scale * sum xq), in fp32, from the exact integer sum.

Each program first rounds the columns its K loop reads (its split's slice, every row) into a small
buffer: 32-bit words of four int8 values, the chunks' scales and scale * sum of their values (the
programs sharing a slice write the same bits; a barrier orders a program's writes before its
threads read them, as gemv._normed_rows does). That work is repeated by every row block (~1/BLOCK_N
of the weights' work, the reason the configs own 64-256 rows), and saves a launch a linear. The
round_in_loop configs round each tile's columns inside the K loop instead (no buffers, no serial
start before the loop), and the round_first ones launch a kernel that rounds x once, for every
program of the GEMV after it (a launch more, no rounding in the GEMV); tune() times all three.
On an H200 (2026-11-30) the first two lost to the float-activation GEMVs at K = 4,096 (4-bit qkv
18.3 µs against 10.4) and won at 11,008 (down, 9.8 against 11.2): the serial rounding before the
K loop is the suspect that round_first takes away.

The interpreter has no inline assembly: there (ASM False) a byte-by-byte product stands in for
IDP4A, so CI checks everything but the one PTX instruction (compiled for sm_90 in
tests/test_triton_compile.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops import quantized
from . import pdl, triton_linear
from .gemv import MAX_ROWS, Config, _int8_store, _launch, _rows, _rows_of, _store_rows
from .launch import cdiv
from .triton_norm import INTERPRET, RCP_127, quotient

# rows a program owns, bytes of each row a tile, warps, programs an SM before split-K. Many rows: the
# rounding of x, redone by every row block, costs 1/BLOCK_N of the weights' work; more programs an SM
# (split-K): shorter slices of x to round before a program's K loop starts, while its first weight
# tile is on its way (at 7B shapes one program's tile is ~2 us of its SM's share of the bandwidth);
# round_in_loop: each tile's columns rounded inside the K loop instead, no serial start; round_first:
# by a kernel of its own before (the fastest two slice configs' tiles). Eight: each config is a
# compile a shape (seconds) when tune() times it, and the benchmark's budget is minutes.
A8_CONFIGS = (Config(64, 256, 4, 2), Config(128, 128, 4, 2), Config(256, 64, 4, 2), Config(128, 128, 4, 4),
              Config(64, 256, 4, 2, round_in_loop=True), Config(128, 128, 4, 2, round_in_loop=True),
              Config(64, 256, 4, 2, round_first=True), Config(128, 128, 4, 4, round_first=True))
DEFAULT_A8_CONFIG = A8_CONFIGS[0]
QUANT_BLOCK = tl.constexpr(32)  # chunks of x a program rounds at a time


def supports(bits: int, K: int, group_size: int | None) -> bool:
    """int8 weights per channel or in groups of a power of two from 16; 4-bit in groups of 32."""
    if bits == 4:
        return group_size == 32 and K % 32 == 0
    g = group_size or 32
    return g >= 16 and g & (g - 1) == 0 and K % max(g, 32) == 0


@triton.jit
def _dp4a(a, b, c, SIGNED_A: tl.constexpr, ASM: tl.constexpr):
    """c + the dot product of a's four bytes (signed, or unsigned) with b's (signed): one IDP4A
    on the GPU, byte by byte in the interpreter."""
    if ASM:
        if SIGNED_A:
            r = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = c
        for j in tl.static_range(4):
            if SIGNED_A:
                aj = (a << (24 - 8 * j)) >> 24
            else:
                aj = (a >> (8 * j)) & 0xFF
            r += aj * ((b << (24 - 8 * j)) >> 24)
    return r


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _round_chunks(x, E: tl.constexpr, CH: tl.constexpr):
    """x [CH, E] (fp32) rounded per row (a chunk, round_activations): (words [CH, E/4] of four int8
    values, scales [CH], scale * the sum of each chunk's values [CH])."""
    scale = quotient(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), 127.0, RCP_127)
    # x / scale in -127..127 (|x| <= absmax), rounded (halves to even) by adding 1.5 * 2^23:
    # the bits of the sum hold 0x4B400000 + q, whose low byte is q's
    bits = (quotient(x, scale[:, None], tl.div_rn(1.0, scale)[:, None]) + 12582912.0).to(tl.int32, bitcast=True)
    shift = (8 * (tl.arange(0, E) % 4))[None, :]
    words = tl.reduce(tl.reshape((bits & 0xFF) << shift, [CH, E // 4, 4]), 2, _bit_or)
    return words, scale, tl.sum(bits - 0x4B400000, axis=1).to(tl.float32) * scale


@triton.jit
def _round_x(x_ptr, xw_ptr, xs_ptr, xsum_ptr, M, K, stride_xm, first, end, E: tl.constexpr, QB: tl.constexpr, BITS: tl.constexpr):
    """x[:, first:end] rounded to int8 per chunk of E columns (round_activations): words of four
    values into xw [M, K/4], each chunk's scale into xs [M, K/E] and scale * the sum of its values
    into xsum (the w_min term), then a barrier: this program's threads read them next. For 4-bit
    weights (E = 32) the words of a chunk's first 16 values go to xw's first half, of its last 16
    to the second: word f of either half meets word f of the weights' rows (16-byte loads)."""
    c = tl.arange(0, QB)
    j = tl.arange(0, E)
    for m in range(M):
        for c0 in range(first // E, end // E, QB):
            ch = c0 + c
            ok = ch < end // E
            x = tl.load(x_ptr + m * stride_xm + ch[:, None] * E + j[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            words, scale, xsum = _round_chunks(x, E, QB)
            i = tl.arange(0, E // 4)[None, :]
            if BITS == 4:  # (word i of a chunk: values 4i..4i+3; i < 4 low nibbles' partners, else high)
                dst = (i // 4) * (K // 8) + ch[:, None] * 4 + i % 4
            else:
                dst = ch[:, None] * (E // 4) + i
            tl.store(xw_ptr + m * (K // 4) + dst, words, mask=ok[:, None])
            tl.store(xs_ptr + m * (K // E) + ch, scale, mask=ok)
            tl.store(xsum_ptr + m * (K // E) + ch, xsum, mask=ok)
    tl.debug_barrier()


ROUND_CHUNKS = 8  # chunks of x a program of _round_x_kernel rounds


@triton.jit
def _round_x_kernel(x_ptr, xw_ptr, xs_ptr, xsum_ptr, M, K, stride_xm, E: tl.constexpr, QB: tl.constexpr, BITS: tl.constexpr,
                    PDL: tl.constexpr):
    """x rounded once, QB chunks a program, into the buffers the GEMV after it reads (round_first)."""
    pdl.wait_prior(PDL)
    first = tl.program_id(0) * QB * E
    _round_x(x_ptr, xw_ptr, xs_ptr, xsum_ptr, M, K, stride_xm, first, tl.minimum(first + QB * E, K), E, QB, BITS)


@triton.jit
def _tile_x(x_ptr, xw_ptr, xs_ptr, xsum_ptr, f, f_ok, u, u_ok, KW, K, BITS: tl.constexpr, E: tl.constexpr, WB: tl.constexpr,
            UNITS: tl.constexpr, ROUND_IN_LOOP: tl.constexpr):
    """A row's x for one tile: (x words meeting weight words f [WB] (4-bit: the low nibbles'), the
    high nibbles' [WB] (int8: the same), the chunks' scales [UNITS], their scale * sum [UNITS]),
    read from _round_x's buffers, or with ROUND_IN_LOOP rounded here from x (the tile's UNITS
    chunks of E columns; 4-bit: a chunk's words 0-3 meet the low nibbles of its group, 4-7 the high)."""
    if ROUND_IN_LOOP:
        x = tl.load(x_ptr + u[:, None] * E + tl.arange(0, E)[None, :], mask=u_ok[:, None], other=0.0).to(tl.float32)
        words, xs, xsum = _round_chunks(x, E, UNITS)
        if BITS == 8:
            xa = tl.reshape(words, [WB])
            xb = xa
        else:
            lo, hi = tl.split(tl.permute(tl.reshape(words, [UNITS, 2, 4]), (0, 2, 1)))
            xa, xb = tl.reshape(lo, [WB]), tl.reshape(hi, [WB])
    else:
        xa = tl.load(xw_ptr + f, mask=f_ok, other=0)
        xb = xa
        if BITS == 4:
            xb = tl.load(xw_ptr + KW + f, mask=f_ok, other=0)
        xs = tl.load(xs_ptr + u, mask=u_ok, other=0.0)
        xsum = tl.load(xsum_ptr + u, mask=u_ok, other=0.0)
    return xa, xb, xs, xsum


@triton.jit
def _unit_sums(w, xa, xb, BITS: tl.constexpr, BLOCK_N: tl.constexpr, WB: tl.constexpr, UNITS: tl.constexpr, ASM: tl.constexpr):
    """Exact int32 sums q . xq [rows, UNITS] of a tile's words w [rows, WB], per chunk of x (a
    unit). int8: a word is four columns, one IDP4A against x's word xa. 4-bit (groups of 32,
    pack_int4: word i of a group holds values 4i.. in its low nibbles, 16 + 4i.. in its high): two
    masks make two words of unsigned values, one IDP4A each against xa and xb."""
    if BITS == 8:
        d = _dp4a(w, xa[None, :], 0, True, ASM)
    else:
        d = _dp4a((w >> 4) & 0x0F0F0F0F, xb[None, :], _dp4a(w & 0x0F0F0F0F, xa[None, :], 0, False, ASM), False, ASM)
    return tl.sum(tl.reshape(d, [BLOCK_N, UNITS, WB // UNITS]), axis=2)


@triton.jit
def _add_row(acc, w, x_ptr, xw_ptr, xs_ptr, xsum_ptr, f, f_ok, u, u_ok, KW, K, sc, mn, BITS: tl.constexpr, E: tl.constexpr, WB: tl.constexpr,
             UNITS: tl.constexpr, PER_GROUP: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
             ROUND_IN_LOOP: tl.constexpr):
    """acc [rows, UNITS] += one activation row's tile: per chunk, isum * w_scale * x_scale (+ w_min *
    x_scale * sum xq), or isum * x_scale per channel (the channel's scale at the end)."""
    xa, xb, xs, xm = _tile_x(x_ptr, xw_ptr, xs_ptr, xsum_ptr, f, f_ok, u, u_ok, KW, K, BITS, E, WB, UNITS, ROUND_IN_LOOP)
    r = _unit_sums(w, xa, xb, BITS, BLOCK_N, WB, UNITS, ASM).to(tl.float32)
    if PER_GROUP:
        acc += r * (sc * xs[None, :])
        if HAS_MINS or BITS == 4:
            acc += mn * xm[None, :]
    else:
        acc += r * xs[None, :]
    return acc


@triton.jit
def _a8_tile(w, f, k0, acc0, acc1, x_ptr, stride_xm, xw_ptr, xs_ptr, xsum_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, offs_n, n_ok, K, G,
             BITS: tl.constexpr, E: tl.constexpr, GS: tl.constexpr, WB: tl.constexpr, UNITS: tl.constexpr, PER_GROUP: tl.constexpr,
             HAS_MINS: tl.constexpr, BLOCK_N: tl.constexpr, TWO: tl.constexpr, ASM: tl.constexpr, ROUND_IN_LOOP: tl.constexpr,
             GPS: tl.constexpr):
    """One tile: words w [rows, WB] at word indices f from column k0, its UNITS chunks of x added
    to the [rows, UNITS] sums of each activation row (_add_row)."""
    KW = K // (32 // BITS)
    f_ok = f < KW
    u = k0 // E + tl.arange(0, UNITS)  # the chunks of x
    u_ok = u < K // E
    sc, mn = tl.zeros([1, 1], dtype=tl.float32), tl.zeros([1, 1], dtype=tl.float32)
    if PER_GROUP:
        g_ok = n_ok[:, None] & u_ok[None, :]
        if BITS == 4:  # (float, symmetric or factored: triton_linear.q4_params)
            sc, mn = triton_linear.q4_params(s_ptr, mn_ptr, ss_ptr, ms_ptr, offs_n, u * E // GS, g_ok, G, HAS_MINS, GPS)
        else:
            g_off = offs_n[:, None] * G + (u * E // GS)[None, :]
            sc = tl.load(s_ptr + g_off, mask=g_ok, other=0.0).to(tl.float32)
            if HAS_MINS:
                mn = tl.load(mn_ptr + g_off, mask=g_ok, other=0.0).to(tl.float32)
    acc0 = _add_row(acc0, w, x_ptr, xw_ptr, xs_ptr, xsum_ptr, f, f_ok, u, u_ok, KW, K, sc, mn, BITS, E, WB, UNITS, PER_GROUP, HAS_MINS, BLOCK_N,
                    ASM, ROUND_IN_LOOP)
    if TWO:  # (the second row's x and its rounding: one row further on)
        acc1 = _add_row(acc1, w, x_ptr + stride_xm, xw_ptr + K // 4, xs_ptr + K // E, xsum_ptr + K // E, f, f_ok, u, u_ok, KW, K, sc, mn,
                        BITS, E, WB, UNITS, PER_GROUP, HAS_MINS, BLOCK_N, ASM, ROUND_IN_LOOP)
    return acc0, acc1


@triton.jit
def _a8_gemv_kernel(x_ptr, w_ptr, s_ptr, mn_ptr, out_ptr, M, N, K, stride_xm, K_SPLIT, G, xw_ptr, xs_ptr, xsum_ptr,
                    BITS: tl.constexpr, E: tl.constexpr, GS: tl.constexpr, WB: tl.constexpr, PER_GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
                    BLOCK_N: tl.constexpr, TWO: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, ROUND_IN_LOOP: tl.constexpr = False,
                    X_ROUNDED: tl.constexpr = False, part_ptr=None, bias_ptr=None, done_ptr=None, SPLITS_PAD: tl.constexpr = 1, HAS_BIAS: tl.constexpr = False,
                    ss_ptr=None, ms_ptr=None, GPS: tl.constexpr = 0):
    """y = W x^ over 32-bit words of W's rows (BITS 8: int8 [N, K]; 4: pack_int4's bytes [N, K/2]),
    WB words a row a tile; x^ = x rounded to int8 per chunk of E columns, by _round_x into the xw /
    xs / xsum buffers before the K loop, or (ROUND_IN_LOOP) tile by tile inside it: the same work,
    a few more instructions a tile, no serial start; X_ROUNDED: the buffers filled by
    _round_x_kernel before. K_SPLIT: columns a program's split owns."""
    VPW: tl.constexpr = 32 // BITS  # values a word
    UNITS: tl.constexpr = WB * VPW // E  # chunks of x a tile
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    KW = tl.multiple_of(K // VPW, 4)  # (K % 32 == 0: 16-byte aligned rows)
    words = w_ptr.to(tl.pointer_type(tl.int32)) + (offs_n.to(tl.int64) * KW)[:, None]
    offs_f = tl.arange(0, WB)
    acc0 = tl.zeros([BLOCK_N, UNITS], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, UNITS], dtype=tl.float32)
    first, end = pid_k * K_SPLIT, tl.minimum(pid_k * K_SPLIT + K_SPLIT, K)
    f = tl.multiple_of(first // VPW, 4) + offs_f  # (first: a multiple of a tile's columns)
    w = tl.load(words + f[None, :], mask=n_ok[:, None] & (f < KW)[None, :], other=0)  # (weights: no kernel writes them)
    pdl.wait_prior(PDL)  # the first tile was on its way while the kernel before ended
    if not ROUND_IN_LOOP and not X_ROUNDED:
        _round_x(x_ptr, xw_ptr, xs_ptr, xsum_ptr, M, K, stride_xm, first, end, E, QUANT_BLOCK, BITS)
    acc0, acc1 = _a8_tile(w, f, first, acc0, acc1, x_ptr, stride_xm, xw_ptr, xs_ptr, xsum_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, offs_n, n_ok, K, G, BITS,
                          E, GS, WB, UNITS, PER_GROUP, HAS_MINS, BLOCK_N, TWO, ASM, ROUND_IN_LOOP, GPS)
    for k0 in range(first + WB * VPW, end, WB * VPW):
        f = tl.multiple_of(k0 // VPW, 4) + offs_f
        w = tl.load(words + f[None, :], mask=n_ok[:, None] & (f < KW)[None, :], other=0)
        acc0, acc1 = _a8_tile(w, f, k0, acc0, acc1, x_ptr, stride_xm, xw_ptr, xs_ptr, xsum_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, offs_n, n_ok, K, G,
                              BITS, E, GS, WB, UNITS, PER_GROUP, HAS_MINS, BLOCK_N, TWO, ASM, ROUND_IN_LOOP, GPS)
    if BITS == 8:
        _int8_store(out_ptr, part_ptr, bias_ptr, done_ptr, s_ptr, acc0, acc1, offs_n, n_ok, N, pid_n, pid_k, M, PER_GROUP, TWO, SPLITS_PAD,
                    HAS_BIAS)
    else:
        _store_rows(out_ptr, part_ptr, bias_ptr, done_ptr, acc0, acc1, offs_n, n_ok, N, pid_n, pid_k, M, TWO, SPLITS_PAD, HAS_BIAS)


def _a8_launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None, bits: int, K: int,
               group_size: int | None, bias, cfg: Config, sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    N = weight.shape[0]
    x2 = _rows(x, K, False)
    E = quantized.panel_chunk(group_size or 32)  # columns of x a scale (ops.quantized.a8_input)
    M = x2.shape[0]
    if cfg.round_in_loop:  # (no buffers: the kernel reads x itself)
        xw = xs = xsum = x2
    else:
        xw = torch.empty(M, K // 4, dtype=torch.int32, device=x.device)  # x rounded: four int8 a word
        xs = torch.empty(M, K // E, dtype=torch.float32, device=x.device)
        xsum = torch.empty_like(xs)
        if cfg.round_first and M:
            _round_x_kernel[(cdiv(K // E, ROUND_CHUNKS),)](x2, xw, xs, xsum, M, K, x2.stride(0), E=E, QB=ROUND_CHUNKS, BITS=bits,
                                                                   num_warps=4, **pdl.launch_args(x2))
    wb = cfg.tile_bytes // 4
    (s, mn), q4 = triton_linear.q4_args(scale.reshape(N, -1), mins, sups)
    args = (weight.contiguous(), s, mn)
    out = _launch(_a8_gemv_kernel, cfg, x2, N, K, K, wb * 32 // bits, bias, x.dtype, args, G=s.shape[1], xw_ptr=xw, xs_ptr=xs,
                  xsum_ptr=xsum, BITS=bits, E=E, GS=group_size or E, WB=wb, PER_GROUP=group_size is not None,
                  ASM=not INTERPRET and x.is_cuda, ROUND_IN_LOOP=cfg.round_in_loop, X_ROUNDED=cfg.round_first, **q4)
    return out.view(*x.shape[:-1], N)


def int8_gemv_a8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 mins: torch.Tensor | None = None, cfg: Config = DEFAULT_A8_CONFIG) -> torch.Tensor:
    """x (1-2 rows) rounded to int8 per chunk, times int8 weights per channel ([N] scales) or group
    ([N, G], optionally with mins: w = q * scale + min)."""
    N, K = qweight.shape
    group = K // scale.shape[1] if scale.dim() == 2 else None
    return _a8_launch(x, qweight, scale, mins, 8, K, group, bias, cfg)


def int4_gemv_a8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                 bias: torch.Tensor | None = None, cfg: Config = DEFAULT_A8_CONFIG,
                 sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """x (1-2 rows) rounded to int8 per chunk of 32, times 4-bit weights in groups of 32 (pack_int4,
    w = scale * q + min; mins None: Q4_0's min = -8 * scale; sups: a K-quant's factored scales)."""
    return _a8_launch(x, packed, scales, mins, 4, packed.shape[1] * 2, group_size, bias, cfg, sups)


def usable(x: torch.Tensor, bits: int, K: int, group_size: int | None, weight: torch.Tensor) -> bool:
    """Whether the a8 GEMVs take this call: 1-2 rows, a supported shape, rows readable as words."""
    return _rows_of(x) <= MAX_ROWS and supports(bits, K, group_size) and weight.data_ptr() % 16 == 0
