"""Kernels compiled for Hopper (sm_90) without a GPU, by Triton's own ptxas. The interpreter runs a
kernel's Python, not the compiler: what only a compile rejects (a constexpr reassigned, a type
the code generator refuses) would otherwise first show on a lent GPU. Kernels new since the last
GPU session go here; the compile runs in a process without TRITON_INTERPRET. Every kernel is
compiled with programmatic dependent launch on (PDL, as on Hopper): its wait for the kernel
before must come before its first global memory access, but for weights (a GEMV's first tile, a
norm's weight)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import pytest

pytest.importorskip("triton")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CHUNK_STATS = {"st_m_ptr": "*fp32", "st_s_ptr": "*fp32", "st_thr_ptr": "*i64", "st_n_ptr": "*i32"}
SAMPLE = {"x_ptr": "*bf16", "t_ptr": "*fp32", "k_ptr": "*i64", "p_ptr": "*fp32", "mp_ptr": "*fp32", "seed_ptr": "*i64", "step_ptr": "*i64",
          "out_ptr": "*i64", "cx_ptr": "*bf16", "ci_ptr": "*i32", "cand_x_ptr": "*bf16", "cand_i_ptr": "*i32", **CHUNK_STATS, "V": "i32",
          "stride_x": "i32", "P": "i32", "BLOCK": "constexpr", "CAP": "constexpr", "LOCAL_CAP": "constexpr", "P_PAD": "constexpr", "PDL": "constexpr"}
SAMPLE_CHUNKS = {"x_ptr": "*bf16", "t_ptr": "*fp32", "k_ptr": "*i64", "p_ptr": "*fp32", "cand_x_ptr": "*bf16", "cand_i_ptr": "*i32", **CHUNK_STATS,
                 "V": "i32", "stride_x": "i32", "P": "i32", "CHUNK": "constexpr", "LOCAL_CAP": "constexpr", "PDL": "constexpr"}
INT8_DEQUANT = {"w_ptr": "*i8", "s_ptr": "*fp32", "mn_ptr": "*fp32", "out_ptr": "*bf16", "N": "i32", "K": "i32", "G": "i32",
                "PER_GROUP": "constexpr", "GS": "constexpr", "HAS_MINS": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "PDL": "constexpr"}
INT4_DEQUANT = {"p_ptr": "*u8", "s_ptr": "*fp16", "mn_ptr": "*fp16", "out_ptr": "*bf16", "N": "i32", "K": "i32", "GS": "constexpr",
                "BLOCK_N": "constexpr", "BLOCK_B": "constexpr", "PDL": "constexpr"}
NORM = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32",
        "static_ptr": "*fp32", "K": "i32", "eps": "fp32", "BLOCK": "constexpr", "HAS_RESIDUAL": "constexpr", "QUANT": "constexpr",
        "HAS_STATIC": "constexpr", "CLIP": "constexpr", "PDL": "constexpr"}
SPLIT = {"part_ptr": "*fp32", "bias_ptr": "*bf16", "done_ptr": "*i32"}  # (every GEMV's: where a split-K launch's parts go)
WORDS = {"x_ptr": "*bf16", "p_ptr": "*u8", "s_ptr": "*fp32", "mn_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
         "KB_SPLIT": "i32", "ONES": "i32", "GS": "constexpr", "GPB": "constexpr", "BLOCK_N": "constexpr", "TWO": "constexpr", "PDL": "constexpr", **SPLIT}
MMA = {**{k: v for k, v in WORDS.items() if k not in ("ONES", "TWO")}, "M_PAD": "constexpr"}
INT8_WORDS = {"x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*fp32", "mn_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
              "stride_xm": "i32", "K_SPLIT": "i32", "G": "i32", "LOW": "i32", "HIGH": "i32", "GS": "constexpr", "GPB": "constexpr",
              "PER_GROUP": "constexpr", "BLOCK_N": "constexpr", "TWO": "constexpr", "HAS_MINS": "constexpr", "PDL": "constexpr", **SPLIT}
FLOAT_GEMV = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "K_SPLIT": "i32",
              "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "TWO": "constexpr", "PDL": "constexpr", **SPLIT}
NORMED = {"h_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "res_out_ptr": "*bf16", "eps": "fp32", "NORM": "constexpr", "HAS_RES": "constexpr",
          "NORM_BLOCK": "constexpr", "NORM_ONE_PASS": "constexpr"}
DECODE = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16",
          "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "qk_scale": "fp32", "stride_qb": "i32",
          "stride_qh": "i32", "stride_ob": "i32", "stride_oh": "i32", "stride_cb": "i32", "stride_ch": "i32", "stride_cs": "i32", "stride_bt": "i32",
          "block_size": "i32", **dict.fromkeys(("H", "GROUP", "GROUP_PAD", "D", "BLOCK_D", "BLOCK_N", "NUM_SPLITS", "USE_DOT", "UPCAST",
                                                  "PRECISION", "PDL"), "constexpr")}
ROPE = {"qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_out_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
        "slot_ptr": "*i64", "stride_qkv_t": "i32", "stride_cos_t": "i32", "stride_sin_t": "i32", "stride_qo_t": "i32", "stride_qo_h": "i32",
        "stride_cb": "i32", "stride_ch": "i32", "stride_cs": "i32", "block_size": "i32",
        **dict.fromkeys(("H", "KVH", "D", "BLOCK_HQ", "BLOCK_HK", "BLOCK_HALF", "PDL"), "constexpr")}
A8 = {"x_ptr": "*bf16", "s_ptr": "*fp16", "mn_ptr": "*fp16", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
      "K_SPLIT": "i32", "G": "i32", "xw_ptr": "*i32", "xs_ptr": "*fp32", "xsum_ptr": "*fp32",
      **dict.fromkeys(("BITS", "E", "GS", "WB", "PER_GROUP", "HAS_MINS", "BLOCK_N", "TWO", "PDL", "ASM", "ROUND_IN_LOOP"), "constexpr"), **SPLIT}
SILU_QUANT_ROWS = {"gu_ptr": "*bf16", "y_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32", "static_ptr": "*fp32", "K": "i32",
                   **dict.fromkeys(("BLOCK", "HAS_STATIC", "CLIP", "RECOMPUTE", "PDL"), "constexpr")}
CASES = {  # name: (module, kernel, signature, constexprs, warps)
    "sampler": ("triton_sampling", "_sample_kernel", SAMPLE, {"BLOCK": 4096, "CAP": 256, "LOCAL_CAP": 64, "P_PAD": 32, "PDL": True}, 8),
    "sampler's chunks": ("triton_sampling", "_chunk_kernel", SAMPLE_CHUNKS, {"CHUNK": 2048, "LOCAL_CAP": 64, "PDL": True}, 8),
    "decode attention, split": ("triton_attention", "_decode_kernel", DECODE,
                                {"H": 32, "GROUP": 1, "GROUP_PAD": 16, "D": 128, "BLOCK_D": 128, "BLOCK_N": 64, "NUM_SPLITS": 40,
                                 "USE_DOT": True, "UPCAST": False, "PRECISION": "tf32", "PDL": True}, 4),
    "decode attention, split, RoPE + KV store of the new tokens inside, a bucket of 64 rows": (
        "triton_attention", "_decode_kernel", dict(DECODE, cos_ptr="*fp32", sin_ptr="*fp32", slot_ptr="*i64", stride_cos="i32", stride_sin="i32",
                                                   ROPE="constexpr", B_PAD="constexpr"),
        {"H": 32, "GROUP": 4, "GROUP_PAD": 16, "D": 128, "BLOCK_D": 128, "BLOCK_N": 64, "NUM_SPLITS": 16, "USE_DOT": True, "UPCAST": False,
         "PRECISION": "tf32", "PDL": True, "ROPE": True, "B_PAD": 64}, 4),
    "int8 dequant, groups with mins": ("triton_linear", "_int8_dequant_kernel", INT8_DEQUANT,
                                       {"PER_GROUP": True, "GS": 32, "HAS_MINS": True, "BLOCK_N": 32, "BLOCK_K": 256, "PDL": True}, 4),
    "int8 dequant, per channel": ("triton_linear", "_int8_dequant_kernel", INT8_DEQUANT,
                                  {"PER_GROUP": False, "GS": 1, "HAS_MINS": False, "BLOCK_N": 32, "BLOCK_K": 256, "PDL": True}, 4),
    "int4 dequant": ("triton_linear", "_int4_dequant_kernel", INT4_DEQUANT, {"GS": 32, "BLOCK_N": 32, "BLOCK_B": 128, "PDL": True}, 4),
    "RoPE + KV store": ("triton_attention", "_rope_store_kernel", ROPE,
                        {"H": 32, "KVH": 8, "D": 128, "BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_HALF": 64, "PDL": True}, 4),
    "RoPE tables": ("triton_attention", "_rope_tables_kernel", {"pos_ptr": "*i64", "inv_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                                                            "T": "i32", "HALF": "constexpr", "BLOCK_T": "constexpr", "BLOCK_HALF": "constexpr",
                                                            "PDL": "constexpr"}, {"HALF": 64, "BLOCK_T": 32, "BLOCK_HALF": 64, "PDL": True}, 4),
    "residual add + RMSNorm": ("triton_norm", "_rms_norm_kernel", NORM,
                               {"BLOCK": 4096, "HAS_RESIDUAL": True, "QUANT": False, "HAS_STATIC": False, "CLIP": False, "PDL": True}, 8),
    "SiLU·mul quantized in chunks": ("triton_norm", "_silu_and_mul_quant_rows_kernel", SILU_QUANT_ROWS,
                                     {"BLOCK": 2048, "HAS_STATIC": True, "CLIP": False, "RECOMPUTE": False, "PDL": True}, 8),
    "SiLU·mul quantized in chunks, made twice": ("triton_norm", "_silu_and_mul_quant_rows_kernel", SILU_QUANT_ROWS,
                                                 {"BLOCK": 2048, "HAS_STATIC": True, "CLIP": False, "RECOMPUTE": True, "PDL": True}, 8),
    "W8A8 GEMM, persistent, TMA": ("triton_linear", "_int8_gemm_tma_kernel",
                                   {"a_desc": "tensordesc<i8[128, 128]>", "w_desc": "tensordesc<i8[256, 128]>", "xs_ptr": "*fp32", "ws_ptr": "*fp32",
                                    "b_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                                    **dict.fromkeys(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "HAS_BIAS", "PDL"), "constexpr")},
                                   {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "HAS_BIAS": True, "PDL": True}, 8),
    "4-bit words GEMV": ("gemv", "_int4_words_gemv_kernel", dict(WORDS, HAS_MINS="constexpr"),
                         {"GS": 32, "GPB": 32, "BLOCK_N": 32, "TWO": False, "PDL": True, "HAS_MINS": True}, 4),
    "4-bit words GEMV, Q4_K's factored scales": ("gemv", "_int4_words_gemv_kernel",
                                                 dict(WORDS, s_ptr="*i8", mn_ptr="*i8", ss_ptr="*fp16", ms_ptr="*fp16", HAS_MINS="constexpr",
                                                      GPS="constexpr"),
                                                 {"GS": 32, "GPB": 32, "BLOCK_N": 32, "TWO": False, "PDL": True, "HAS_MINS": True, "GPS": 8}, 4),
    "4-bit words GEMV, Q4_0's groups (no mins)": ("gemv", "_int4_words_gemv_kernel", dict(WORDS, HAS_MINS="constexpr"),
                                                  {"GS": 32, "GPB": 32, "BLOCK_N": 64, "TWO": False, "PDL": True, "HAS_MINS": False}, 4),
    "float GEMV": ("gemv", "_float_gemv_kernel", FLOAT_GEMV, {"BLOCK_N": 8, "BLOCK_K": 512, "TWO": False, "PDL": True}, 4),
    "int8 words GEMV": ("gemv", "_int8_words_gemv_kernel", INT8_WORDS,
                        {"GS": 32, "GPB": 16, "PER_GROUP": True, "BLOCK_N": 32, "TWO": False, "HAS_MINS": False, "PDL": True}, 4),
    "int8 words GEMV, prefetching": ("gemv", "_int8_words_gemv_kernel", dict(INT8_WORDS, PREFETCH="constexpr"),
                                     {"GS": 32, "GPB": 16, "PER_GROUP": True, "BLOCK_N": 32, "TWO": False, "HAS_MINS": False, "PDL": True,
                                      "PREFETCH": True}, 4),
    "4-bit words GEMV, prefetching": ("gemv", "_int4_words_gemv_kernel", dict(WORDS, PREFETCH="constexpr"),
                                      {"GS": 32, "GPB": 32, "BLOCK_N": 32, "TWO": False, "PDL": True, "PREFETCH": True}, 4),
    "4-bit words GEMV, gated (SiLU·mul made as it reads)": ("gemv", "_int4_words_gemv_kernel", dict(WORDS, GATED="constexpr"),
                                                           {"GS": 32, "GPB": 32, "BLOCK_N": 64, "TWO": False, "PDL": True, "GATED": True}, 4),
    "int8 words GEMV, gated, with mins": ("gemv", "_int8_words_gemv_kernel", dict(INT8_WORDS, GATED="constexpr"),
                                          {"GS": 32, "GPB": 16, "PER_GROUP": True, "BLOCK_N": 32, "TWO": True, "HAS_MINS": True, "PDL": True,
                                           "GATED": True}, 4),
    "float GEMV, gated": ("gemv", "_float_gemv_kernel", dict(FLOAT_GEMV, GATED="constexpr"),
                          {"BLOCK_N": 8, "BLOCK_K": 512, "TWO": False, "PDL": True, "GATED": True}, 4),
    "4-bit words GEMV, normed (RMSNorm made by its programs)": ("gemv", "_int4_words_gemv_kernel", dict(WORDS, **NORMED),
                                                               {"GS": 32, "GPB": 32, "BLOCK_N": 64, "TWO": False, "PDL": True, "NORM": True,
                                                                "HAS_RES": True, "NORM_BLOCK": 4096, "NORM_ONE_PASS": True}, 4),
    "int8 words GEMV, normed in chunks, two rows": ("gemv", "_int8_words_gemv_kernel", dict(INT8_WORDS, **NORMED),
                                                    {"GS": 32, "GPB": 16, "PER_GROUP": True, "BLOCK_N": 32, "TWO": True, "HAS_MINS": False,
                                                     "PDL": True, "NORM": True, "HAS_RES": True, "NORM_BLOCK": 4096, "NORM_ONE_PASS": False}, 4),
    "4-bit words GEMV, split-K merged by the last": ("gemv", "_int4_words_gemv_kernel", dict(WORDS),
                                                   {"GS": 32, "GPB": 32, "BLOCK_N": 32, "TWO": True, "PDL": True, "SPLITS_PAD": 4,
                                                    "HAS_BIAS": True}, 4),
    "int8 words GEMV, per channel, split-K merged by the last": ("gemv", "_int8_words_gemv_kernel", dict(INT8_WORDS),
                                                               {"GS": 32, "GPB": 16, "PER_GROUP": False, "BLOCK_N": 64, "TWO": False,
                                                                "HAS_MINS": False, "PDL": True, "SPLITS_PAD": 8, "HAS_BIAS": False}, 4),
    "4-bit a8 GEMV (IDP4A)": ("gemv_a8", "_a8_gemv_kernel", dict(A8, w_ptr="*u8"),
                              {"BITS": 4, "E": 32, "GS": 32, "WB": 64, "PER_GROUP": True, "HAS_MINS": True, "BLOCK_N": 64, "TWO": False,
                               "PDL": True, "ASM": True, "ROUND_IN_LOOP": False}, 4),
    "4-bit a8 GEMV (IDP4A), x rounded in the loop, two rows": ("gemv_a8", "_a8_gemv_kernel", dict(A8, w_ptr="*u8"),
                                                              {"BITS": 4, "E": 32, "GS": 32, "WB": 32, "PER_GROUP": True, "HAS_MINS": True,
                                                               "BLOCK_N": 128, "TWO": True, "PDL": True, "ASM": True, "ROUND_IN_LOOP": True}, 4),
    "4-bit a8 GEMV (IDP4A), x rounded by the kernel before": ("gemv_a8", "_a8_gemv_kernel", dict(A8, w_ptr="*u8", X_ROUNDED="constexpr"),
                                                            {"BITS": 4, "E": 32, "GS": 32, "WB": 64, "PER_GROUP": True, "HAS_MINS": True,
                                                             "BLOCK_N": 64, "TWO": False, "PDL": True, "ASM": True, "ROUND_IN_LOOP": False,
                                                             "X_ROUNDED": True}, 4),
    "4-bit MMA GEMV": ("gemv_mma", "_mma_gemv_kernel", dict(MMA, ASM="constexpr"),
                       {"GS": 32, "GPB": 8, "BLOCK_N": 128, "M_PAD": 1, "PDL": True, "ASM": True}, 4),
    "4-bit MMA GEMV, fp16, Q4_0's groups, two rows, split-K merged by the last": (
        "gemv_mma", "_mma_gemv_kernel", dict(MMA, x_ptr="*fp16", out_ptr="*fp16", bias_ptr="*fp16", HAS_MINS="constexpr",
                                                  ASM="constexpr"),
        {"GS": 32, "GPB": 4, "BLOCK_N": 256, "M_PAD": 2, "PDL": True, "HAS_MINS": False, "ASM": True, "SPLITS_PAD": 4, "HAS_BIAS": True}, 8),
    "4-bit MMA GEMV, Q4_K's factored scales, gated": (
        "gemv_mma", "_mma_gemv_kernel", dict(MMA, s_ptr="*i8", mn_ptr="*i8", ss_ptr="*fp16", ms_ptr="*fp16", GPS="constexpr",
                                                  GATED="constexpr", ASM="constexpr"),
        {"GS": 32, "GPB": 8, "BLOCK_N": 128, "M_PAD": 1, "PDL": True, "GPS": 8, "GATED": True, "ASM": True}, 4),
    "4-bit MMA GEMV, normed, groups of 128": ("gemv_mma", "_mma_gemv_kernel", dict(MMA, ASM="constexpr", **NORMED),
                                              {"GS": 128, "GPB": 8, "BLOCK_N": 64, "M_PAD": 1, "PDL": True, "ASM": True, "NORM": True,
                                               "HAS_RES": True, "NORM_BLOCK": 4096, "NORM_ONE_PASS": True}, 4),
    "4-bit MMA GEMV, a decode batch of 8 rows, split-K merged by the last": (
        "gemv_mma", "_mma_gemv_kernel", dict(MMA, ASM="constexpr"),
        {"GS": 32, "GPB": 2, "BLOCK_N": 256, "M_PAD": 8, "PDL": True, "ASM": True, "SPLITS_PAD": 8, "HAS_BIAS": True}, 8),
    "int8 MMA GEMV (nibble planes), groups of 32, gated": (
        "gemv_mma", "_mma_gemv_kernel", dict(MMA, p_ptr="*i8", ASM="constexpr", GATED="constexpr", BITS="constexpr", PER_GROUP="constexpr"),
        {"GS": 32, "GPB": 8, "BLOCK_N": 128, "M_PAD": 1, "PDL": True, "ASM": True, "GATED": True, "BITS": 8, "PER_GROUP": True, "HAS_MINS": False}, 4),
    "int8 MMA GEMV, per channel, fp16, a decode batch of 16 rows, split-K merged by the last": (
        "gemv_mma", "_mma_gemv_kernel", dict(MMA, p_ptr="*i8", x_ptr="*fp16", out_ptr="*fp16", bias_ptr="*fp16", s_ptr="*fp32", ASM="constexpr",
                                             BITS="constexpr", PER_GROUP="constexpr"),
        {"GS": 32, "GPB": 2, "BLOCK_N": 256, "M_PAD": 16, "PDL": True, "ASM": True, "BITS": 8, "PER_GROUP": False, "HAS_MINS": False, "SPLITS_PAD": 8,
         "HAS_BIAS": True}, 8),
    "x rounded to int8 for the a8 kernels": ("gemv_a8", "_round_x_kernel",
                                {"x_ptr": "*bf16", "xw_ptr": "*i32", "xs_ptr": "*fp32", "xsum_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32",
                                 "E": "constexpr", "QB": "constexpr", "BITS": "constexpr", "PDL": "constexpr"},
                                {"E": 32, "QB": 8, "BITS": 4, "PDL": True}, 4),
    "int8 a8 GEMV (IDP4A), groups of 16 with mins, two rows, split-K merged by the last": (
        "gemv_a8", "_a8_gemv_kernel", dict(A8, w_ptr="*i8", s_ptr="*fp32", mn_ptr="*fp32"),
        {"BITS": 8, "E": 16, "GS": 16, "WB": 32, "PER_GROUP": True, "HAS_MINS": True, "BLOCK_N": 128, "TWO": True, "PDL": True, "ASM": True,
         "ROUND_IN_LOOP": False, "SPLITS_PAD": 4, "HAS_BIAS": True}, 4),
}
for _module, _kernel, _sig, _consts, _warps in CASES.values():  # a GEMV's launch says whether it splits K (the compile takes no defaults)
    if _module in ("gemv", "gemv_a8", "gemv_mma") and _kernel.endswith("gemv_kernel"):
        _sig.update(SPLITS_PAD="constexpr", HAS_BIAS="constexpr")
        _consts.setdefault("SPLITS_PAD", 1)
        _consts.setdefault("HAS_BIAS", False)
CODE = """
import importlib, json, sys, traceback
sys.path.insert(0, "benchmarks")
from gpu_sass import compile_sm90


def findings(module, kernel, sig, consts, warps):
    fn = getattr(importlib.import_module("fasterllama.backends.cuda." + module), kernel)
    sass, usage, shared = compile_sm90(fn, sig, consts, warps)
    words = [line.split("*/")[1].split() for line in sass.splitlines() if line.strip().startswith("/*") and "*/" in line]
    ops = [w[1] if w[0].startswith("@") else w[0] for w in words if len(w) > 1]  # (the opcode after any predicate)
    wait = next((i for i, o in enumerate(ops) if o == "ACQBULK"), len(ops))
    memory = [o for o in ops[:wait] if o.split(".")[0] in {"LDG", "STG", "ATOMG", "RED", "LDGSTS", "UTMALDG", "LDL", "STL"}]
    atom = next((i for i, o in enumerate(ops) if o.startswith("ATOMG")), None)  # a global atomic's stores-then-barrier-then-fence
    last = lambda prefix: max((i for i, o in enumerate(ops[:atom]) if o.startswith(prefix)), default=-1)
    fenced = None if atom is None else last("STG") < last("BAR.SYNC") < last("MEMBAR.ALL.GPU")
    first_store = next((i for i, o in enumerate(ops) if o.startswith("STG")), len(ops))
    late_loads = sum(o.startswith("LDG") for o in ops[first_store:])  # (a load after a store waits for it: it may alias)
    return {"spills": "LOCAL:0" not in usage, "shared": shared, "atomics": "ATOMS" in sass, "instructions": sass.count(";"),
            "wait": wait < len(ops), "release": "PREEXIT" in ops, "before_wait": memory, "fenced_atomic": fenced,
            "loads_after_a_store": late_loads, "dp4a": sum(o.startswith("IDP.4A") for o in ops),
            "tma": sum(o.startswith("UTMALDG") for o in ops), "wgmma": sum(o.startswith(("HGMMA", "IGMMA")) for o in ops),
            "mma": sum(o.startswith("HMMA") for o in ops), "lop3": sum(o.startswith("LOP3") for o in ops)}


for line in sys.stdin:  # a case a line, its findings a line (one process for all: torch and triton imported once)
    try:
        out = {"findings": findings(*json.loads(line))}
    except FileNotFoundError as e:
        out = {"skip": f"no sm_90 toolchain: {e}"}
    except Exception:
        out = {"error": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(out), flush=True)
"""


SHARED_LIMIT = 232_448  # bytes of shared memory a block may have on sm_90 (H100, H200): more fails at launch
_compiler: subprocess.Popen | None = None  # this pytest process's CODE process, started at its first compile


@pytest.fixture(scope="module", autouse=True)
def _stop_the_compiler():
    yield
    if _compiler is not None:
        _compiler.stdin.close()
        _compiler.wait(30)


def _compile(case: tuple) -> dict:
    """The compile's findings (CODE's JSON), in a process without TRITON_INTERPRET (one for all
    the cases a pytest process runs: a process a case spent ~3 s of each ~5 importing torch)."""
    global _compiler
    if _compiler is None or _compiler.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        _compiler = subprocess.Popen([sys.executable, "-c", CODE], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    _compiler.stdin.write(json.dumps(case) + "\n")
    _compiler.stdin.flush()
    deadline = time.monotonic() + 300
    while True:
        ready, _, _ = select.select([_compiler.stdout], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, "the compile took over 300 s"
        line = _compiler.stdout.readline()
        assert line, "the compile process died"
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT "):])
            break
    if "skip" in out:
        pytest.skip(out["skip"])
    assert "error" not in out, out["error"]
    return out["findings"]


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_compiles_for_sm90(name: str) -> None:
    got = _compile(CASES[name])
    assert not got["spills"] and got["instructions"] > 10
    assert got["shared"] <= SHARED_LIMIT, got["shared"]
    assert got["wait"] and got["release"]  # PDL: the kernel waits for the one before, then lets the next launch
    if name in ("RoPE + KV store", "residual add + RMSNorm"):  # every load out before the first store: one trip to memory
        assert got["loads_after_a_store"] == 0, got
    if "merged by the last" in name:  # partials stored (barrier), a GPU fence, the count
        assert got["fenced_atomic"] is True, got
    if "GEMV" in name or "RMSNorm" in name:  # only weights (128-bit loads: nothing writes them; a GEMV's first tile) before the wait
        assert got["before_wait"] and set(got["before_wait"]) == {"LDG.E.128"}, got["before_wait"]
    elif name == "RoPE tables":  # inv_freq (which nothing writes) only
        assert got["before_wait"] and all(o.startswith("LDG") for o in got["before_wait"]), got["before_wait"]
    else:  # nothing read or written before it
        assert got["before_wait"] == [], got["before_wait"]
    if "TMA" in name:  # operand tiles by the TMA engine into int8 wgmma
        assert got["tma"] > 0 and got["wgmma"] > 0, got
    if "MMA GEMV" in name:  # the tensor cores' products (HMMA, or wgmma at 16 columns and more) of the nibbles the inline PTX made
        assert got["mma"] + got["wgmma"] > 0 and got["lop3"] > 0, got
    if "IDP4A" in name:  # the inline PTX dp4a: an integer dot product a word
        assert got["dp4a"] > 0, got
    if name == "sampler":
        assert got["atomics"]  # the radix select's digit counts: shared-memory atomics


@pytest.mark.parametrize("bits", [4, 8])
def test_triton_mma_gemv_tiles_fit_in_shared_memory(bits: int) -> None:
    """The MMA GEMV's largest tile that gemv_mma.fitting() lets tune() try (at one activation row,
    where a tile holds the most groups) launches on sm_90; the smallest it turns away would not."""
    from fasterllama.backends.cuda import gemv_mma

    def case(cfg, gs: int) -> tuple:
        sig = dict(MMA, ASM="constexpr", BITS="constexpr", PER_GROUP="constexpr", SPLITS_PAD="constexpr", HAS_BIAS="constexpr")
        if bits == 8:
            sig["p_ptr"] = "*i8"
        consts = {"GS": gs, "GPB": gemv_mma.groups_a_tile(cfg, gs, 1, bits), "BLOCK_N": cfg.block_n, "M_PAD": 1, "PDL": True, "ASM": True,
                  "BITS": bits, "PER_GROUP": True, "SPLITS_PAD": 1, "HAS_BIAS": False}
        return "gemv_mma", "_mma_gemv_kernel", sig, consts, cfg.warps

    pairs = [(cfg, gs) for gs in (32, 64, 128) for cfg in gemv_mma.MMA_CONFIGS]
    fits = [(c, gs) for c, gs in pairs if c in gemv_mma.fitting(gemv_mma.MMA_CONFIGS, gs, bits, 1)]
    refused = [pair for pair in pairs if pair not in fits]
    assert fits and refused  # (groups of 128 at one row: 8 of them a tile, 128-256 rows, too many for some configs)
    assert _compile(case(*max(fits, key=lambda p: gemv_mma.weight_tile_bytes(*p, bits, 1))))["shared"] <= SHARED_LIMIT
    assert _compile(case(*min(refused, key=lambda p: gemv_mma.weight_tile_bytes(*p, bits, 1))))["shared"] > SHARED_LIMIT
