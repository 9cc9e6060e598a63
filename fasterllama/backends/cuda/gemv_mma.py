"""A decode GEMV over 4-bit weights on the tensor cores: the weights' values go to the MMA as they
are, the activations come block-diagonal, and the scales meet the sums a group at a time.

The word-wise GEMV (gemv.py) turns each weight into an fp32 number and multiplies it by its
activation with an FMA: ~3.4-3.6 sm_90 instructions a weight, about as many as a batch-1 GEMV
streaming an H200's 4 TB/s of 4-bit weights has room for (its GEMVs ran at 44-73% of it). Here a
weight costs ~7/8 of an integer instruction: one LOP3 (after a shift for three of a word's four
nibbles) makes two of them bf16 numbers 128 + q, a pair in one 32-bit register as an MMA operand
holds them (the 16-bit words' nibble c of two neighbouring words: (w >> 4c) & 0x000F000F |
0x43004300, inline PTX). The tensor cores do the products, in fp32.

A row's sums must stay apart per group until its scale multiplies them, and a GEMV has one
activation row where an MMA takes 8 or more columns. So the second operand is the tile's
activations laid out block-diagonally, [words, groups]: column g holds group g's activations and
zeros elsewhere, and one MMA gives every row's per-group sums S[n, g] = sum (128 + q) x at once.
Per group, sum w x = scale * (S - 128 X) + min * X, X the group's sum of x. The k order inside a
tile is whatever the masks give: nibble c of 16-bit word j (bits 4c..4c+3)
holds value 2j' + c // 2 + (c % 2) * GS / 2 of its group (pack_int4's layout, j' = j within the
group), and the activations come in that order. The activations' operand is made by each program
for its tile (a select a value and a trip through shared memory), once for all of its rows: the
configs own 64-256 rows.

fp16 activations take fp16 values 1024 + q (0x6400 | q); fp32 ones the other GEMVs. The interpreter
has no inline assembly: there (ASM False) the same values come from shifts and masks in fp32 and
the MMA is an fp32 dot, so CI checks all but the PTX (compiled for sm_90 in
tests/test_triton_compile.py; tune() compares every candidate with the tiled kernel on the device
before timing it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl, triton_linear
from .gemv import Config, Norm, _act, _launch, _normed_rows, _rows, _store_rows
from .triton_norm import INTERPRET

# rows a program owns, bytes of each row a tile (at least 8 groups: the MMA's columns), warps,
# programs an SM before split-K. The block-diagonal operand is made once a tile for all of a
# program's rows, so many rows; sm_90, groups of 32: 2.33-2.48 instructions a weight at 128 rows,
# 2.16-2.27 at 256 (the word-wise GEMV: 3.41-3.68; benchmarks/gpu_sass.py).
MMA_CONFIGS = (Config(128, 128, 4, 2), Config(256, 128, 8, 2), Config(128, 128, 4, 4), Config(64, 128, 4, 2))

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


def supports(K: int, group_size: int, dtype: torch.dtype) -> bool:
    """Groups of 32..128 dividing K, half-precision activations (the MMA's operands)."""
    return group_size in (32, 64, 128) and K % group_size == 0 and dtype in (torch.bfloat16, torch.float16)


@triton.jit
def _nibbles(h, OFF: tl.constexpr, ASM: tl.constexpr):
    """Values c = 0..3 of the 16-bit words h [rows, words] (bits 4c..4c+3) as numbers OFF + q: bf16
    (OFF 128) or fp16 (1024), two of them a register as the MMA reads them; fp32 without ASM."""
    if ASM:
        if OFF == 128:
            a = tl.inline_asm_elementwise(_PAIRS_BF16, "=r,=r,=r,=r,r", [h], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
        else:
            a = tl.inline_asm_elementwise(_PAIRS_FP16, "=r,=r,=r,=r,r", [h], dtype=(tl.float16,) * 4, is_pure=True, pack=2)
    else:
        u = h.to(tl.int32) & 0xFFFF
        a = ((u & 15).to(tl.float32) + OFF, ((u >> 4) & 15).to(tl.float32) + OFF, ((u >> 8) & 15).to(tl.float32) + OFF,
             ((u >> 12) & 15).to(tl.float32) + OFF)
    return a


@triton.jit
def _group_sums(a, x, diag, S, ASM: tl.constexpr):
    """S [rows, groups] += a [rows, words] times x [words] laid out block-diagonally (diag)."""
    b = tl.where(diag, x[:, None], 0.0)
    if ASM:
        S = tl.dot(a, b.to(a.dtype), S)
    else:
        S = tl.dot(a, b, S, input_precision="ieee")
    return S


@triton.jit
def _mma_tile(h, b0, acc0, acc1, x_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, stride_xm, offs_n, n_ok, K, G, GS: tl.constexpr, GPT: tl.constexpr,
              BLOCK_N: tl.constexpr, TWO: tl.constexpr, GATED: tl.constexpr, HAS_MINS: tl.constexpr, GPS: tl.constexpr, OFF: tl.constexpr,
              ASM: tl.constexpr):
    """One tile: the 16-bit words h [rows, GPT groups' words] from byte b0 of the rows, added to
    the [rows, groups] sums acc0 (and acc1, the second activation row)."""
    H: tl.constexpr = GS // 2
    HPG: tl.constexpr = GS // 4  # 16-bit words a group
    j = tl.arange(0, GPT * HPG)
    g = b0 // H + tl.arange(0, GPT)
    s, mn = triton_linear.q4_params(s_ptr, mn_ptr, ss_ptr, ms_ptr, offs_n, g, n_ok[:, None] & (g < G)[None, :], G, HAS_MINS, GPS)
    k0 = (b0 // H + j // HPG) * GS + 2 * (j % HPG)  # the column of each word's value 0 (its first byte's low nibble)
    k_ok = k0 < K
    diag = (j // HPG)[:, None] == tl.arange(0, GPT)[None, :]
    x0 = (_act(x_ptr, k0, k_ok, K, GATED), _act(x_ptr, k0 + H, k_ok, K, GATED), _act(x_ptr, k0 + 1, k_ok, K, GATED),
          _act(x_ptr, k0 + 1 + H, k_ok, K, GATED))  # (every load first: none waits behind the MMAs' barriers)
    x1 = x0
    if TWO:
        x1 = (_act(x_ptr + stride_xm, k0, k_ok, K, GATED), _act(x_ptr + stride_xm, k0 + H, k_ok, K, GATED),
              _act(x_ptr + stride_xm, k0 + 1, k_ok, K, GATED), _act(x_ptr + stride_xm, k0 + 1 + H, k_ok, K, GATED))
    g_x = (b0 // H) * GS + tl.arange(0, GPT * GS)  # the groups' sums of x, from one [groups, GS] tile
    xs0 = tl.sum(tl.reshape(_act(x_ptr, g_x, g_x < K, K, GATED), [GPT, GS]), axis=1)
    xs1 = xs0
    if TWO:
        xs1 = tl.sum(tl.reshape(_act(x_ptr + stride_xm, g_x, g_x < K, K, GATED), [GPT, GS]), axis=1)
    a = _nibbles(h, OFF, ASM)
    S0 = tl.zeros([BLOCK_N, GPT], dtype=tl.float32)
    S1 = S0
    for c in tl.static_range(4):  # nibble c of a word: value 2j' + c // 2 + (c % 2) * H of its group
        S0 = _group_sums(a[c], x0[c], diag, S0, ASM)
        if TWO:
            S1 = _group_sums(a[c], x1[c], diag, S1, ASM)
    mn -= OFF * s  # sum w x = scale * S + (min - OFF * scale) * X
    acc0 += s * S0 + mn * xs0[None, :]
    if TWO:
        acc1 += s * S1 + mn * xs1[None, :]
    return acc0, acc1


@triton.jit
def _int4_mma_gemv_kernel(x_ptr, p_ptr, s_ptr, mn_ptr, out_ptr, M, N, K, stride_xm, KB_SPLIT,
                          GS: tl.constexpr, GPB: tl.constexpr, BLOCK_N: tl.constexpr, TWO: tl.constexpr, PDL: tl.constexpr,
                          GATED: tl.constexpr = False,
                          h_ptr=None, res_ptr=None, nw_ptr=None, res_out_ptr=None, eps=0.0, NORM: tl.constexpr = False,
                          HAS_RES: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 1, NORM_ONE_PASS: tl.constexpr = True, part_ptr=None,
                          bias_ptr=None, done_ptr=None, SPLITS_PAD: tl.constexpr = 1, HAS_BIAS: tl.constexpr = False,
                          HAS_MINS: tl.constexpr = True, ss_ptr=None, ms_ptr=None, GPS: tl.constexpr = 0, ASM: tl.constexpr = True):
    """Row blocks of BLOCK_N, tiles of GPB groups read as 16-bit words (the module's docstring);
    split-K, the normed prologue, the gated activations and the scale forms as gemv.py's kernels."""
    H: tl.constexpr = GS // 2
    WT: tl.constexpr = GPB * (GS // 4)  # 16-bit words of a row a tile
    OFF: tl.constexpr = 128.0 if x_ptr.dtype.element_ty == tl.bfloat16 else 1024.0
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    KH = tl.multiple_of(K // 4, GS // 4)
    words = p_ptr.to(tl.pointer_type(tl.int16)) + offs_n.to(tl.int64)[:, None] * KH
    j = tl.arange(0, WT)
    acc0 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    first, end = pid_k * KB_SPLIT, tl.minimum(pid_k * KB_SPLIT + KB_SPLIT, K // 2)
    f = first // 2 + j
    h = tl.load(words + f[None, :], mask=n_ok[:, None] & (f < KH)[None, :], other=0)  # (weights: no kernel writes them)
    pdl.wait_prior(PDL)  # the first tile was on its way while the kernel before ended
    if NORM:  # (x_ptr: the normed rows, made here)
        _normed_rows(x_ptr, h_ptr, res_ptr, nw_ptr, res_out_ptr, M, K, eps, 2 * first, 2 * end, (pid_n == 0) & (pid_k == 0), HAS_RES, NORM_BLOCK,
                     NORM_ONE_PASS)
    acc0, acc1 = _mma_tile(h, first, acc0, acc1, x_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, stride_xm, offs_n, n_ok, K, K // GS, GS, GPB, BLOCK_N, TWO,
                           GATED, HAS_MINS, GPS, OFF, ASM)
    for b0 in range(first + GPB * H, end, GPB * H):
        f = b0 // 2 + j
        h = tl.load(words + f[None, :], mask=n_ok[:, None] & (f < KH)[None, :], other=0)
        acc0, acc1 = _mma_tile(h, b0, acc0, acc1, x_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, stride_xm, offs_n, n_ok, K, K // GS, GS, GPB, BLOCK_N,
                               TWO, GATED, HAS_MINS, GPS, OFF, ASM)
    _store_rows(out_ptr, part_ptr, bias_ptr, done_ptr, acc0, acc1, offs_n, n_ok, N, pid_n, pid_k, M, TWO, SPLITS_PAD, HAS_BIAS)


def groups_a_tile(cfg: Config, group_size: int) -> int:
    """Groups of a row a tile: the config's bytes, at least 8 (the MMA's columns)."""
    return max(8, cfg.tile_bytes * 2 // group_size)


def int4_gemv_mma(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                  bias: torch.Tensor | None = None, cfg: Config = MMA_CONFIGS[0], gated: bool = False, norm: Norm | None = None,
                  sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """gemv.int4_gemv's contract (one or two rows of bf16 or fp16 activations, supports())."""
    N, K = packed.shape[0], packed.shape[1] * 2
    assert supports(K, group_size, x.dtype), (K, group_size, x.dtype)
    packed = packed.contiguous() if packed.data_ptr() % 2 == 0 else packed.clone()  # (read as 16-bit words)
    x2 = _rows(x, K, gated, norm)
    gpt = groups_a_tile(cfg, group_size)
    (s, mn), extra = triton_linear.q4_args(scales, mins, sups)
    out = _launch(_int4_mma_gemv_kernel, cfg, x2, N, K, K // 2, gpt * group_size // 2, bias, x.dtype, (packed, s, mn), norm,
                  GS=group_size, GPB=gpt, GATED=gated, ASM=not INTERPRET and x.is_cuda, **extra)
    return out.view(*x.shape[:-1], N)
