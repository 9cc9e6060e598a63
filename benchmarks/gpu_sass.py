"""Instructions a weight in the decode GEMVs' K loops, from sm_90 SASS compiled on this machine
(no GPU needed: Triton's own ptxas and cuobjdump). A proxy for the GEMVs' speed between GPU
sessions: a batch-1 GEMV streaming 4 TB/s of 4-bit weights on an H100/H200 has room for about 3.5
instructions a weight, of int8 weights about 7 (docs/gpu.md).

    python benchmarks/gpu_sass.py [--dtype bf16] [--group 32]

The 4-bit rows include the tensor-core GEMV (gemv_mma.py: "int4 mma"): its products are HMMA
instructions, one for every 4 of a thread's weights.
Prints, per kernel and config: the loop's instructions, the weights a thread handles per
iteration, their ratio, the loop's global loads that wait behind a barrier, and the registers and
spill stack cuobjdump reports."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fasterllama.backends.cuda import gemv, gemv_a8, gemv_mma, triton_linear

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ALIGNED = ("x_ptr", "p_ptr", "w_ptr", "s_ptr", "mn_ptr", "out_ptr", "N", "K", "stride_xm", "K_SPLIT", "KB_SPLIT", "G",  # as launches specialize them
           "q_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr", "part_acc_ptr", "part_m_ptr", "part_l_ptr", "done_ptr",
           "stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_cb", "stride_ch", "stride_cs", "stride_bt", "block_size",
           "res_ptr", "res_out_ptr", "qkv_ptr", "cos_ptr", "sin_ptr", "q_out_ptr", "slot_ptr", "stride_qkv_t", "stride_cos_t", "stride_sin_t",
           "stride_qo_t", "stride_qo_h", "xw_ptr", "xs_ptr", "xsum_ptr")


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int) -> tuple[str, str, int]:
    """(SASS, resource usage, shared memory bytes) of one specialization. Constexprs left out take
    their defaults, as a launch does (ASTSource would compile them as None). The shared memory is
    Triton's dynamic allocation, which cuobjdump's usage leaves out: over the device's limit (an
    H100/H200: 232,448 bytes) the launch fails, not the compile."""
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    signature = {**{p.name: "constexpr" for p in fn.params if p.is_constexpr and p.has_default}, **signature}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED if n in signature}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return sass, usage, kernel.metadata.shared


def k_loop(sass: str, marker: str = "") -> list[str]:
    """The instructions of the longest backward-branch loop (the K loop), of those with `marker`
    (the integer GEMVs' IDP: their longest may be the rounding of x)."""
    addr_re = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/")
    lines = [(int(m.group(1), 16), line) for line in sass.splitlines() if (m := addr_re.match(line))]
    best: list[str] = []
    for addr, line in lines:
        target = re.search(r"BRA\s+.*?0x([0-9a-f]+)", line)
        if target and int(target.group(1), 16) < addr:
            body = [text for a, text in lines if int(target.group(1), 16) <= a <= addr]
            if any(marker in text for text in body):
                best = max(best, body, key=len)
    return best


def loop_length(sass: str, marker: str = "") -> int:
    return len(k_loop(sass, marker))


def loads_behind_barrier(sass: str, marker: str = "") -> int:
    """Global loads of the K loop issued after its first barrier: a barrier of a layout conversion
    waits for the loads its data came from, so each such load is a trip to memory that starts
    only when an earlier one has ended (the word-wise GEMVs had 7-40 until 2026-11-29: 0)."""
    body = k_loop(sass, marker)
    first = next((i for i, line in enumerate(body) if "BAR.SYNC" in line), len(body))
    return sum("LDG" in line for line in body[first:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="activations")
    ap.add_argument("--group", type=int, default=32)
    args = ap.parse_args()
    x = f"*{args.dtype}"
    common = {"x_ptr": x, "s_ptr": "*fp16", "mn_ptr": "*fp16", "out_ptr": x, "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "PDL": "constexpr",
              "part_ptr": "*fp32", "bias_ptr": x, "done_ptr": "*i32", "SPLITS_PAD": "constexpr", "HAS_BIAS": "constexpr"}
    int4 = dict(common, p_ptr="*u8", KB_SPLIT="i32", GS="constexpr", GPB="constexpr", BLOCK_N="constexpr", TWO="constexpr", HAS_MINS="constexpr")
    int8 = dict(common, w_ptr="*i8", K_SPLIT="i32", G="i32", GS="constexpr", GPB="constexpr", PER_GROUP="constexpr", BLOCK_N="constexpr",
                TWO="constexpr", HAS_MINS="constexpr")
    g = args.group
    cases = [("int4 bytes", gemv._int4_gemv_kernel, int4, c) for c in gemv.CONFIGS[:3]]

    def distinct(configs):  # (split-K is a launch choice, not a compiled one)
        return list(dict.fromkeys(c._replace(programs_per_sm=2) for c in configs))

    cases += [("int4 words", gemv._int4_words_gemv_kernel, dict(int4, ONES="i32", PREFETCH="constexpr"), c) for c in distinct(gemv.WORD_CONFIGS)]
    cases += [("int4 words, no mins (Q4_0)", gemv._int4_words_gemv_kernel, dict(int4, ONES="i32", PREFETCH="constexpr"), c)
              for c in distinct(gemv.WORD_CONFIGS)]
    q4_k = dict(int4, ONES="i32", PREFETCH="constexpr", s_ptr="*i8", mn_ptr="*i8", ss_ptr="*fp16", ms_ptr="*fp16", GPS="constexpr")
    cases += [("int4 words, factored (Q4_K)", gemv._int4_words_gemv_kernel, q4_k, c) for c in distinct(gemv.WORD_CONFIGS)]
    mma = {**{k: v for k, v in int4.items() if k != "TWO"}, "M_PAD": "constexpr", "ASM": "constexpr", "GATED": "constexpr"}
    cases += [(f"int4 mma{sym}", gemv_mma._mma_gemv_kernel, mma, c) for sym in ("", ", no mins (Q4_0)") for c in distinct(gemv_mma.MMA_CONFIGS)]
    mma_k = dict(mma, s_ptr="*i8", mn_ptr="*i8", ss_ptr="*fp16", ms_ptr="*fp16", GPS="constexpr")
    cases += [("int4 mma, factored (Q4_K)", gemv_mma._mma_gemv_kernel, mma_k, c) for c in distinct(gemv_mma.MMA_CONFIGS)]
    cases += [("int4 mma, 2 rows (Q4_0)", gemv_mma._mma_gemv_kernel, mma, c) for c in distinct(gemv_mma.MMA_CONFIGS)]
    cases += [(f"int4 mma, {rows} rows (Q4_0)", gemv_mma._mma_gemv_kernel, mma, c) for rows in (8, 16) for c in distinct(gemv_mma.BATCH_CONFIGS)]
    mma8 = dict(mma, p_ptr="*i8", BITS="constexpr", PER_GROUP="constexpr")
    cases += [("int8 mma (g32)", gemv_mma._mma_gemv_kernel, mma8, c) for c in distinct(gemv_mma.MMA_CONFIGS)]
    cases += [(f"int8 mma, {rows} rows (g32)", gemv_mma._mma_gemv_kernel, mma8, c) for rows in (8, 16) for c in distinct(gemv_mma.BATCH_CONFIGS)]
    tiled = {"x_ptr": x, "p_ptr": "*u8", "s_ptr": "*fp16", "mn_ptr": "*fp16", "b_ptr": x, "out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
             "stride_xm": "i32", "kb_split": "i32", **dict.fromkeys(("GS", "GPB", "HT", "BLOCK_M", "BLOCK_N", "GROUP_M", "HAS_BIAS", "PRECISION",
                                                                    "INTERPRET", "PDL", "HAS_MINS"), "constexpr")}
    cases += [("int4 tiled tl.dot, up to 16 rows (Q4_0)", triton_linear._int4_linear_kernel, tiled, gemv.Config(64, 64, 4, 2))]  # (_dot_config(M <= 16))
    tiled8 = {**{k: v for k, v in tiled.items() if k not in ("p_ptr", "kb_split", "HT")}, "w_ptr": "*i8", "G": "i32", "k_split": "i32",
              "PER_GROUP": "constexpr", "GS_T": "constexpr"}
    cases += [("int8 tiled tl.dot, up to 16 rows (g32)", triton_linear._int8_linear_kernel, tiled8, gemv.Config(64, 128, 4, 2))]
    cases += [("int8 bytes", gemv._int8_gemv_kernel, int8, c) for c in gemv.CONFIGS[:3]]
    cases += [("int8 words", gemv._int8_words_gemv_kernel, dict(int8, LOW="i32", HIGH="i32", PREFETCH="constexpr"), c)
              for c in distinct(gemv.INT8_WORD_CONFIGS)]
    a8 = dict(common, K_SPLIT="i32", G="i32", xw_ptr="*i32", xs_ptr="*fp32", xsum_ptr="*fp32", **dict.fromkeys(
        ("BITS", "E", "GS", "WB", "PER_GROUP", "HAS_MINS", "BLOCK_N", "TWO", "ASM", "ROUND_IN_LOOP"), "constexpr"))
    how = lambda c: ", x rounded in the loop" if c.round_in_loop else ", x rounded before" if c.round_first else ""  # noqa: E731
    cases += [(f"int{bits} a8{how(c)}", gemv_a8._a8_gemv_kernel, dict(a8, w_ptr="*i8" if bits == 8 else "*u8", X_ROUNDED="constexpr"), c)
              for bits in (4, 8) for c in distinct(gemv_a8.A8_CONFIGS)]
    print("| kernel | rows, tile bytes, warps, prefetch | loop instructions | weights a thread | a weight | loads behind a barrier |"
          " registers, stack |\n|---|---|---:|---:|---:|---:|---|")
    for name, fn, sig, cfg in cases:
        gpb = cfg.tile_bytes // g if "int8" in name else cfg.tile_bytes // 2 // (g // 2)  # as int8_gemv / int4_gemv launch
        consts = {"GS": g, "GPB": gpb, "BLOCK_N": cfg.block_n, "TWO": False, "PDL": True, "SPLITS_PAD": 1, "HAS_BIAS": False}
        if "mma" in name:  # (the activation rows padded to a power of two: the batch configs' rows are a weight's)
            rows = int(name.split(" rows")[0].split()[-1]) if " rows" in name else 1
            bits = 8 if name.startswith("int8") else 4
            gpb = gemv_mma.groups_a_tile(cfg, g, rows, bits)
            consts = {k: v for k, v in consts.items() if k != "TWO"} | {"GPB": gpb, "M_PAD": rows, "HAS_MINS": "Q4_0" not in name and bits == 4}
            if bits == 8:
                consts.update(BITS=8, PER_GROUP=True)
        if "tiled" in name:  # (as triton_linear's int4/int8_weight_linear launch 3..16 rows: 16 x 64 x 128 tiles)
            consts = {"GS": g, "GPB": 64 // (g // 2), "HT": g // 2, "BLOCK_M": 16, "BLOCK_N": 64, "GROUP_M": 8, "HAS_BIAS": False, "PRECISION": "ieee",
                      "INTERPRET": False, "PDL": True, "HAS_MINS": False}
            if name.startswith("int8"):
                consts = {k: v for k, v in consts.items() if k != "HT"} | {"GPB": 128 // g, "GS_T": g, "PER_GROUP": True}
            gpb = 128 // g
        if "a8" in name:  # (as gemv_a8._a8_launch: a tile is tile_bytes of each row, in words)
            bits = 8 if "int8" in name else 4
            consts = {k: v for k, v in consts.items() if k != "GPB"}
            consts.update(BITS=bits, E=min(g, 32), WB=cfg.tile_bytes // 4, PER_GROUP=True, HAS_MINS=bits == 4, ASM=True,
                          ROUND_IN_LOOP=cfg.round_in_loop, X_ROUNDED=cfg.round_first)
            gpb = cfg.tile_bytes * 8 // bits // g
        elif "int8" in name:
            consts.update(PER_GROUP=True, HAS_MINS=False)
        if "words" in name:
            consts.update(PREFETCH=cfg.prefetch)
        if "no mins" in name:
            consts.update(HAS_MINS=False)
        if "factored" in name:
            consts.update(GPS=256 // g)
        weights = cfg.block_n * gpb * g / (32 * cfg.warps)
        sass, usage, _ = compile_sm90(fn, sig, consts, cfg.warps)
        marker = "IDP" if "a8" in name else ""
        n = loop_length(sass, marker)
        res = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        print(f"| {name} | {cfg.block_n}, {cfg.tile_bytes}, {cfg.warps}, {'yes' if cfg.prefetch else 'no'} | {n} | {weights:.0f} | "
              f"{n / weights:.2f} | {loads_behind_barrier(sass, marker)} | {res.group(1)}, {res.group(2)} |")

if __name__ == "__main__":
    main()
