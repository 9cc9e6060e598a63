"""A decode GEMV over 4-bit and int8 weights on the tensor cores: the weights' values go to the MMA
as they are, the activations come block-diagonal, and the scales meet the sums a group at a time.

The word-wise GEMV (gemv.py) turns each weight into an fp32 number and multiplies it by its
activation with an FMA: ~3.4-3.6 sm_90 instructions a weight, about as many as a batch-1 GEMV
streaming an H200's 4 TB/s of 4-bit weights has room for (its GEMVs ran at 44-73% of it). Here a
weight costs ~7/8 of an integer instruction: one LOP3 (after a shift for three of a word's four
nibbles) makes two of them bf16 numbers 128 + q, a pair in one 32-bit register as an MMA operand
holds them (the 16-bit words' nibble c of two neighbouring words: (w >> 4c) & 0x000F000F |
0x43004300, inline PTX). The tensor cores do the products, in fp32.

A row's sums must stay apart per group until its scale multiplies them, and a decode step has 1-16
activation rows where an MMA takes 8 or more columns. So the second operand is the tile's
activations laid out block-diagonally, [words, groups x rows]: column (g, m) holds row m's
activations of group g and zeros elsewhere (masked loads: the zeros cost no memory traffic), and
one MMA gives every row's per-group sums S[n, (g, m)] = sum (128 + q) x at once. Per group,
sum w x = scale * (S - 128 X) + min * X, X the group's sum of x. The k order inside a tile is
whatever the masks give: nibble c of 16-bit word j (bits 4c..4c+3) holds value
2j' + c // 2 + (c % 2) * GS / 2 of its group (pack_int4's layout, j' = j within the group), and the
activations come in that order. A tile holds fewer groups the more rows there are (groups_a_tile),
so that one or two rows keep the MMA 8 columns wide. The operand goes through shared memory once a
tile for all of a program's rows: the configs own 128-256 rows. For one or two rows it competes
with the word-wise GEMV; for 3-16 (a decode batch) with the tiled kernel, which dequantizes every
weight into shared memory for tl.dot (gemv.tune times both).

int8 weights go as two nibble planes a byte, the same PTX but for the high nibbles' top bit, flipped
(lop3 (a & b) ^ c), so that 16 * high + low = q + 128; the high planes' activations are x times 16
(exact), and per group sum q x = S - (17 * 128 + 128) X. fp16 activations take fp16 values
1024 + q (0x6400 | q); fp32 ones the other GEMVs. The interpreter
has no inline assembly: there (ASM False) the same values come from shifts and masks in fp32 and
the MMA is an fp32 dot, so CI checks all but the PTX (compiled for sm_90 in
tests/test_triton_compile.py; tune() compares every candidate with the tiled kernel on the device
before timing it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl, triton_linear
from .gemv import BATCH_MAX_ROWS, Config, Norm, _act, _launch, _normed_rows, _rows, arrived_last, reset_counter
from .launch import cdiv, next_power_of_2
from .triton_norm import INTERPRET

# rows a program owns, bytes of each row a tile (at one activation row: groups_a_tile), warps,
# programs an SM before split-K. The block-diagonal operand is made once a tile for all of a
# program's rows, so many rows; sm_90, groups of 32: 2.24-2.34 instructions a weight at 128 rows,
# 2.12-2.19 at 256 (the word-wise GEMV: 3.41-3.68; 64 rows: 3.02-3.22, no better, not a candidate;
# benchmarks/gpu_sass.py). Three a kind: each is a compile when tune() first times it (seconds),
# and the benchmark's budget is minutes.
MMA_CONFIGS = (Config(128, 128, 4, 2), Config(256, 128, 8, 2), Config(128, 128, 4, 4))
# a decode batch (tune() times them at gemv.BATCH_ROWS rows): at 8 rows 2 or 4 groups of 32 a tile,
# 16 or 32 columns; sm_90, 8 rows: 5.30-5.94 instructions a weight (each serving the 8 rows), the
# tiled kernel's dequantizing tl.dot 13.09 (int8: 6.91-7.61 against 15.06; at one row 3.56-3.63
# against the word-wise GEMV's 4.56-4.81)
BATCH_CONFIGS = (Config(256, 256, 8, 2), Config(256, 512, 8, 2), Config(128, 256, 4, 2))

_PAIRS_BF16 = tl.constexpr("""{
.reg .b32 t;
lop3.b32 $0, $4, 0x000F000F, 0x43004300, 0xea;
shr.b32 t, $4, 4;
lop3.b32 $1, t, 0x000F000F, 0x43004300, 0xea;
shr.b32 t, $4, 8;
lop3.b32 $2, t, 0x000F000F, 0x43004300, 0xea;
shr.b32 t, $4, 12;
lop3.b32 $3, t, 0x000F000F, 0x43004300, 0xea;
}""")  # (lop3 0xea: (a & b) | c)
_PAIRS_FP16 = tl.constexpr(_PAIRS_BF16.value.replace("0x43004300", "0x64006400"))
# int8 weights, two nibble planes a byte: the high nibbles' top bit flipped (lop3 0x6a: (a & b) ^ c),
# so that 16 * high + low = q + 128, the byte offset-binary
_PAIRS8_BF16 = tl.constexpr(_PAIRS_BF16.value.replace("$1, t, 0x000F000F, 0x43004300, 0xea", "$1, t, 0x000F000F, 0x43084308, 0x6a")
                            .replace("$3, t, 0x000F000F, 0x43004300, 0xea", "$3, t, 0x000F000F, 0x43084308, 0x6a"))
_PAIRS8_FP16 = tl.constexpr(_PAIRS8_BF16.value.replace("0x43004300", "0x64006400").replace("0x43084308", "0x64086408"))


def supports(K: int, group_size: int, dtype: torch.dtype) -> bool:
    """Groups of 32..128 dividing K (int8 per channel: blocks of 32), half-precision activations (the
    MMA's operands); of the configs, those whose tiles fit (fitting())."""
    return group_size in (32, 64, 128) and K % group_size == 0 and dtype in (torch.bfloat16, torch.float16)


@triton.jit
def _nibbles(h, OFF: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Nibbles c = 0..3 of the 16-bit words h [rows, words] (bits 4c..4c+3) as numbers OFF + q: bf16
    (OFF 128) or fp16 (1024), two of them a register as the MMA reads them; fp32 without ASM. Of
    int8 weights (BITS 8) the high nibbles (c odd) with their top bit flipped: 16 * high + low is
    the byte plus 128."""
    if ASM:
        if BITS == 8:
            if OFF == 128:
                a = tl.inline_asm_elementwise(_PAIRS8_BF16, "=r,=r,=r,=r,r", [h], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
            else:
                a = tl.inline_asm_elementwise(_PAIRS8_FP16, "=r,=r,=r,=r,r", [h], dtype=(tl.float16,) * 4, is_pure=True, pack=2)
        elif OFF == 128:
            a = tl.inline_asm_elementwise(_PAIRS_BF16, "=r,=r,=r,=r,r", [h], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
        else:
            a = tl.inline_asm_elementwise(_PAIRS_FP16, "=r,=r,=r,=r,r", [h], dtype=(tl.float16,) * 4, is_pure=True, pack=2)
    else:
        u = h.to(tl.int32) & 0xFFFF
        flip: tl.constexpr = 8 if BITS == 8 else 0
        a = ((u & 15).to(tl.float32) + OFF, (((u >> 4) & 15) ^ flip).to(tl.float32) + OFF, ((u >> 8) & 15).to(tl.float32) + OFF,
             (((u >> 12) & 15) ^ flip).to(tl.float32) + OFF)
    return a


@triton.jit
def _operand(x_ptr, k, k_ok, diag, stride_xm, M, K, GPT: tl.constexpr, M_PAD: tl.constexpr, GATED: tl.constexpr):
    """The block-diagonal activations [words, GPT * M_PAD] in their own type (the MMA's operand):
    column g * M_PAD + m holds row m's columns k [words] where diag marks group g, 0 elsewhere;
    masked loads, but with GATED SiLU(gate) * up made once a value (a row's [words, M_PAD]) and
    spread over the groups' columns (made a column at a time, the gated GEMV's loop took 6.2-6.5
    sm_90 instructions a weight; now 2.9-3.6)."""
    col = tl.arange(0, GPT * M_PAD)
    if GATED:
        m = tl.arange(0, M_PAD)
        dense = _act(x_ptr, m[None, :] * stride_xm + k[:, None], k_ok[:, None] & (m < M)[None, :], K, GATED).to(x_ptr.dtype.element_ty)
        spread = tl.reshape(tl.broadcast_to(dense[:, None, :], [k.shape[0], GPT, M_PAD]), [k.shape[0], GPT * M_PAD])
        return tl.where(diag, spread, 0.0)
    return tl.load(x_ptr + (col % M_PAD)[None, :] * stride_xm + k[:, None], mask=diag & k_ok[:, None] & ((col % M_PAD) < M)[None, :], other=0.0)


@triton.jit
def _dot(a, b, S, ASM: tl.constexpr, TIMES: tl.constexpr = 1):
    """S += a @ (b * TIMES) on the tensor cores (an fp32 dot in the interpreter, whose bf16 dots are
    wrong); TIMES a power of two (exact: an int8 byte's high nibbles stand for 16 x their value)."""
    if ASM:
        if TIMES != 1:
            b = (b * TIMES).to(a.dtype)
        S = tl.dot(a, b, S)
    else:
        S = tl.dot(a, b.to(tl.float32) * TIMES, S, input_precision="ieee")
    return S


@triton.jit
def _int8_params(s_ptr, mn_ptr, offs_n, n_ok, g, G, PER_GROUP: tl.constexpr, HAS_MINS: tl.constexpr):
    """int8 weights' scales and mins [rows, columns] as fp32: per group (g of G a row) or per channel."""
    mask = n_ok[:, None] & (g < G)[None, :]
    off = offs_n[:, None] * G + g[None, :] if PER_GROUP else offs_n[:, None] + 0 * g[None, :]
    s = tl.load(s_ptr + off, mask=mask, other=0.0).to(tl.float32)
    mn = tl.zeros_like(s)
    if HAS_MINS:
        mn = tl.load(mn_ptr + off, mask=mask, other=0.0).to(tl.float32)
    return s, mn


@triton.jit
def _mma_tile(h, b0, acc, x_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, stride_xm, offs_n, n_ok, M, K, G, GS: tl.constexpr, GPT: tl.constexpr,
              BLOCK_N: tl.constexpr, M_PAD: tl.constexpr, GATED: tl.constexpr, HAS_MINS: tl.constexpr, GPS: tl.constexpr, OFF: tl.constexpr,
              BITS: tl.constexpr, PER_GROUP: tl.constexpr, ASM: tl.constexpr):
    """One tile: the 16-bit words h [rows, GPT groups' words] from byte b0 of the rows, added to
    acc [rows, GPT * M_PAD] (column g * M_PAD + m: group g of activation row m)."""
    BPG: tl.constexpr = GS * BITS // 8  # bytes of a row a group
    HPG: tl.constexpr = BPG // 2  # 16-bit words a group
    C: tl.constexpr = GPT * M_PAD
    j = tl.arange(0, GPT * HPG)
    col = tl.arange(0, C)
    g = b0 // BPG + col // M_PAD  # each column's group
    xrow = (col % M_PAD) * stride_xm
    if BITS == 4:
        s, mn = triton_linear.q4_params(s_ptr, mn_ptr, ss_ptr, ms_ptr, offs_n, g, n_ok[:, None] & (g < G)[None, :], G, HAS_MINS, GPS)
        SUB: tl.constexpr = OFF  # sum (OFF + q) x = sum q x + OFF * X
    else:
        s, mn = _int8_params(s_ptr, mn_ptr, offs_n, n_ok, g, G, PER_GROUP, HAS_MINS)
        SUB: tl.constexpr = 17 * OFF + 128  # sum (OFF + low) x + 16 sum (OFF + high) x = sum (q + 128) x + 17 OFF X
    # the block-diagonal operands, every load first (none waits behind the MMAs' barriers): column
    # (g, m) of x_c holds row m's values of group g that nibble c of each word stands for, 0 elsewhere
    k0 = (b0 // BPG + j // HPG) * GS + 2 * (j % HPG)  # the column of each word's first value (its low byte's low nibble)
    diag = (j // HPG)[:, None] == (col // M_PAD)[None, :]
    k_ok = k0 < K
    x0 = _operand(x_ptr, k0, k_ok, diag, stride_xm, M, K, GPT, M_PAD, GATED)
    if BITS == 4:  # nibble c of a word: value 2j' + c // 2 + (c % 2) * GS / 2 of its group
        x1 = _operand(x_ptr, k0 + GS // 2, k_ok, diag, stride_xm, M, K, GPT, M_PAD, GATED)
        x2 = _operand(x_ptr, k0 + 1, k_ok, diag, stride_xm, M, K, GPT, M_PAD, GATED)
        x3 = _operand(x_ptr, k0 + 1 + GS // 2, k_ok, diag, stride_xm, M, K, GPT, M_PAD, GATED)
    else:  # nibble c: the low (c even) or high half of byte 2j' + c // 2 (the high ones: 16 x theirs, below)
        x1 = x0
        x2 = _operand(x_ptr, k0 + 1, k_ok, diag, stride_xm, M, K, GPT, M_PAD, GATED)
        x3 = x2
    kx = g[:, None] * GS + tl.arange(0, GS)[None, :]  # each column's group sum of x, from a [columns, GS] tile
    X = tl.sum(_act(x_ptr, xrow[:, None] + kx, (kx < K) & ((col % M_PAD) < M)[:, None], K, GATED), axis=1)
    a = _nibbles(h, OFF, BITS, ASM)
    S = tl.zeros([BLOCK_N, C], dtype=tl.float32)
    HIGH: tl.constexpr = 16 if BITS == 8 else 1
    S = _dot(a[0], x0, S, ASM)
    S = _dot(a[1], x1, S, ASM, HIGH)
    S = _dot(a[2], x2, S, ASM)
    S = _dot(a[3], x3, S, ASM, HIGH)
    return acc + s * S + (mn - SUB * s) * X[None, :]  # sum w x = scale * (S - SUB * X) + min * X


@triton.jit
def _store_tile(out_ptr, part_ptr, bias_ptr, done_ptr, r, offs_n, n_ok, N, pid_n, pid_k, M, M_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """Rows r [rows, M_PAD] (+ bias) -> out [M, N], as gemv._store_rows stores one or two: split over
    K, each program stores its part and the last of a row block adds them up in split order."""
    m = tl.arange(0, M_PAD)
    ok = n_ok[:, None] & (m < M)[None, :]
    at = m[None, :] * N + offs_n[:, None]
    last = True
    if SPLITS_PAD > 1:
        tl.store(part_ptr + pid_k * M * N + at, r, mask=ok)
        last = arrived_last(done_ptr + pid_n, tl.num_programs(1))
        if last:
            r = tl.zeros_like(r)
            for sp in range(tl.num_programs(1)):
                r += tl.load(part_ptr + sp * M * N + at, mask=ok, other=0.0, cache_modifier=".cg")  # (.cg: past L1, other programs wrote them)
    if last:
        if HAS_BIAS:
            r += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + at, r.to(out_ptr.dtype.element_ty), mask=ok)
        if SPLITS_PAD > 1:
            reset_counter(done_ptr + pid_n)


@triton.jit
def _mma_gemv_kernel(x_ptr, p_ptr, s_ptr, mn_ptr, out_ptr, M, N, K, stride_xm, KB_SPLIT,
                     GS: tl.constexpr, GPB: tl.constexpr, BLOCK_N: tl.constexpr, M_PAD: tl.constexpr, PDL: tl.constexpr,
                     GATED: tl.constexpr = False,
                     h_ptr=None, res_ptr=None, nw_ptr=None, res_out_ptr=None, eps=0.0, NORM: tl.constexpr = False,
                     HAS_RES: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 1, NORM_ONE_PASS: tl.constexpr = True, part_ptr=None,
                     bias_ptr=None, done_ptr=None, SPLITS_PAD: tl.constexpr = 1, HAS_BIAS: tl.constexpr = False,
                     HAS_MINS: tl.constexpr = True, ss_ptr=None, ms_ptr=None, GPS: tl.constexpr = 0, ASM: tl.constexpr = True,
                     BITS: tl.constexpr = 4, PER_GROUP: tl.constexpr = True):
    """Row blocks of BLOCK_N, tiles of GPB groups of GS values read as 16-bit words, M (<= M_PAD)
    activation rows (the module's docstring); 4-bit (pack_int4) or int8 (BITS) weights; split-K,
    the normed prologue, the gated activations and the scale forms as gemv.py's kernels."""
    BPG: tl.constexpr = GS * BITS // 8  # bytes of a row a group
    WT: tl.constexpr = GPB * BPG // 2  # 16-bit words of a row a tile
    OFF: tl.constexpr = 128.0 if x_ptr.dtype.element_ty == tl.bfloat16 else 1024.0
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    KH = tl.multiple_of(K * BITS // 16, BPG // 2)  # 16-bit words a row
    words = p_ptr.to(tl.pointer_type(tl.int16)) + offs_n.to(tl.int64)[:, None] * KH
    j = tl.arange(0, WT)
    acc = tl.zeros([BLOCK_N, GPB * M_PAD], dtype=tl.float32)
    first, end = pid_k * KB_SPLIT, tl.minimum(pid_k * KB_SPLIT + KB_SPLIT, K * BITS // 8)
    f = first // 2 + j
    h = tl.load(words + f[None, :], mask=n_ok[:, None] & (f < KH)[None, :], other=0)  # (weights: no kernel writes them)
    pdl.wait_prior(PDL)  # the first tile was on its way while the kernel before ended
    if NORM:  # (x_ptr: the normed rows, made here)
        _normed_rows(x_ptr, h_ptr, res_ptr, nw_ptr, res_out_ptr, M, K, eps, first * 8 // BITS, end * 8 // BITS, (pid_n == 0) & (pid_k == 0), HAS_RES,
                     NORM_BLOCK, NORM_ONE_PASS)
    acc = _mma_tile(h, first, acc, x_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, stride_xm, offs_n, n_ok, M, K, K // GS, GS, GPB, BLOCK_N, M_PAD, GATED,
                    HAS_MINS, GPS, OFF, BITS, PER_GROUP, ASM)
    for b0 in range(first + GPB * BPG, end, GPB * BPG):
        f = b0 // 2 + j
        h = tl.load(words + f[None, :], mask=n_ok[:, None] & (f < KH)[None, :], other=0)
        acc = _mma_tile(h, b0, acc, x_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, stride_xm, offs_n, n_ok, M, K, K // GS, GS, GPB, BLOCK_N, M_PAD, GATED,
                        HAS_MINS, GPS, OFF, BITS, PER_GROUP, ASM)
    r = tl.sum(tl.reshape(acc, [BLOCK_N, GPB, M_PAD]), axis=1)
    _store_tile(out_ptr, part_ptr, bias_ptr, done_ptr, r, offs_n, n_ok, N, pid_n, pid_k, M, M_PAD, SPLITS_PAD, HAS_BIAS)


def groups_a_tile(cfg: Config, group_size: int, rows: int = 1, bits: int = 4) -> int:
    """Groups of a row a tile: the config's bytes (of 4-bit weights) over the activation rows padded
    to a power of two (the MMA's columns are groups x rows: 8 for one or two rows, one MMA an
    8-column tile, sm_90's HMMA with 80-170 registers; 16 columns went to wgmma at 255), at least
    16 words deep and 8 columns."""
    m_pad = next_power_of_2(rows)
    return max(cfg.tile_bytes * 2 // group_size // m_pad, cdiv(256, group_size * bits), cdiv(8, m_pad))


# a tile's weight bytes (program rows x groups_a_tile x a group's bytes) at most: sm_90's ptxas gave
# 64 KiB tiles 135 KB of shared memory, 128 KiB ones 266-278 KB, over an H200's 227 KB (launches
# then fail; groups of 64-128 at one or two rows, where the 8-column floor holds 8 groups a tile)
MAX_TILE_BYTES = 64 * 1024


def weight_tile_bytes(cfg: Config, group_size: int, bits: int, rows: int) -> int:
    return cfg.block_n * groups_a_tile(cfg, group_size, rows, bits) * group_size * bits // 8


def fitting(configs: tuple[Config, ...], group_size: int, bits: int, rows: int) -> tuple[Config, ...]:
    """The configs whose tiles fit in shared memory at `rows` activation rows (and so at more: a tile
    holds fewer groups the more rows there are)."""
    return tuple(c for c in configs if weight_tile_bytes(c, group_size, bits, rows) <= MAX_TILE_BYTES)


def int4_gemv_mma(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                  bias: torch.Tensor | None = None, cfg: Config = MMA_CONFIGS[0], gated: bool = False, norm: Norm | None = None,
                  sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """gemv.int4_gemv's contract for up to BATCH_MAX_ROWS rows of bf16 or fp16 activations (supports())."""
    N, K = packed.shape[0], packed.shape[1] * 2
    assert supports(K, group_size, x.dtype) and x.numel() // x.shape[-1] <= BATCH_MAX_ROWS, (K, group_size, x.dtype, x.shape)
    (s, mn), extra = triton_linear.q4_args(scales, mins, sups)
    return _mma(x, packed, (s, mn), N, K, group_size, 4, bias, cfg, gated, norm, **extra)


def int8_gemv_mma(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, cfg: Config = MMA_CONFIGS[0],
                  mins: torch.Tensor | None = None, gated: bool = False, norm: Norm | None = None) -> torch.Tensor:
    """gemv.int8_gemv's contract (scales per channel or per group, optional mins) for up to
    BATCH_MAX_ROWS rows of bf16 or fp16 activations (supports(): per channel, K a multiple of 32)."""
    N, K = qweight.shape
    s = scale.reshape(N, -1)
    group = K // s.shape[1] if s.shape[1] > 1 else 32  # (per channel: the MMA's blocks are still groups of 32)
    assert supports(K, group, x.dtype) and x.numel() // x.shape[-1] <= BATCH_MAX_ROWS, (K, group, x.dtype, x.shape)
    args = (s.contiguous(), s if mins is None else mins.contiguous())
    return _mma(x, qweight, args, N, K, group, 8, bias, cfg, gated, norm, HAS_MINS=mins is not None, PER_GROUP=s.shape[1] > 1)


def _mma(x: torch.Tensor, weight: torch.Tensor, scales: tuple, N: int, K: int, group_size: int, bits: int, bias, cfg: Config, gated: bool,
         norm: Norm | None, **meta) -> torch.Tensor:
    weight = weight.contiguous() if weight.data_ptr() % 2 == 0 else weight.clone(memory_format=torch.contiguous_format)  # (read as 16-bit words)
    x2 = _rows(x, K, gated, norm)
    gpt = groups_a_tile(cfg, group_size, max(1, x2.shape[0]), bits)  # (no rows: _launch returns the empty output)
    bpg = group_size * bits // 8
    out = _launch(_mma_gemv_kernel, cfg, x2, N, K, K * bits // 8, gpt * bpg, bias, x.dtype, (weight, *scales), norm, pad_rows=True,
                  GS=group_size, GPB=gpt, GATED=gated, BITS=bits, ASM=not INTERPRET and x.is_cuda, **meta)
    return out.view(*x.shape[:-1], N)
