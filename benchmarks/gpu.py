"""The GPU benchmark: one script for a lent H100/H200 that finishes within 5 minutes and writes one
JSON file (to $OUT, or --out).

    python benchmarks/gpu.py [--out results.json] [--budget 270] [--quick]

Measured in the same run:
- the device's ceilings: device-to-device copy bandwidth (bytes read + written) and the bf16
  matmul rate (8192^3, random data);
- LLaMA-2-7B-shaped random weights built on the device (32 layers, hidden 4096, 32 heads MHA,
  intermediate 11008, vocab 32000) in bf16, Q8_0-like int8 (w8-g32: fp16 scales, 8.5 bits a
  weight), Q4_0-like 4-bit (w4-g32-sym: Q4_0's values, a scale per group of 32 and no min, 4.5
  bits) and w8a8 (dynamic per-token int8 activations); and decode only: Q4_1-like 4-bit (w4-g32,
  a scale and a min, 5 bits), Q4_K-like 4-bit (a K-quant's factored scales and mins, 4.6 bits),
  and the int8 and 4-bit weights with x rounded to int8 per chunk of
  32 as quantization "gguf-a8" (llama.cpp's products): decode tok/s through the engine (LLMEngine.step:
  scheduler, CUDA-graph replay, greedy sampling) at batch 1, 8 and 64 over a 512-token context,
  and prefill tok/s of one 2,048-token prompt; each as a fraction of its hardware limit (decode:
  weight + KV bytes per step over the copy bandwidth; prefill: FLOPs over the matmul rate);
- the same at the default model's shapes (SmolLM2-135M: 30 layers, hidden 576, 9/3 heads) at
  batch 1 and 16;
- peers on the same shapes: HF transformers bf16 (eager, its own KV cache), and this project's
  reference ops in a gpt-fast-style static-cache decode under torch.compile(mode="reduce-overhead").
`--quick` runs tiny shapes (a dry run; on the CPU too, where the engine runs the reference ops)."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fasterllama import SamplingParams
from fasterllama.config import ModelConfig
from fasterllama.engine.llm_engine import LLMEngine
from fasterllama.model import LlamaForCausalLM
from fasterllama.ops import reference
from fasterllama.quant import QuantConfig, quantize_model
from fasterllama.quant.linear import Int4Linear, Int8Linear

LLAMA2_7B = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
                        head_dim=128, max_position_embeddings=4096)
SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                           head_dim=64, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
TUNED: dict = {}  # the decode GEMV choice's timings, {linear shape: {kernel: ms}}
Q4_0_LIKE = "4-bit (w4-g32-sym, Q4_0-like)"
MODES = {"bf16": None, "int8 (w8-g32, Q8_0-like)": "w8-g32", Q4_0_LIKE: "w4-g32-sym", "w8a8 (dynamic)": "w8a8-nosq"}
# decode only (7B shapes, batch 1 and 8; no prefill): 4-bit groups with a min, and the weights
# above with x rounded to int8 per chunk of 32 as quantization "gguf-a8" (llama.cpp's products:
# the integer GEMVs)
EXTRA_MODES = {"4-bit (Q4_K-like: factored scales)": "q4_k-like", "4-bit (w4-g32, Q4_1-like)": "w4-g32",
               "int8 a8 (w8-g32, x int8 as gguf-a8)": "w8-g32+a8",
               "4-bit a8 (w4-g32-sym, x int8 as gguf-a8)": "w4-g32-sym+a8"}


class Clock:
    def __init__(self, budget: float) -> None:
        self.start, self.budget = time.perf_counter(), budget

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    """Median seconds of fn() over reps runs after one warm-up, synchronized around each."""
    fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# -- ceilings -----------------------------------------------------------------------------------------
def ceilings(device: torch.device, quick: bool) -> dict:
    n = (1 << 20) if quick else (1 << 30)
    src = torch.randn(n // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), 3 if quick else 20)
    size = 512 if quick else 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    tm = timed(lambda: a @ b, 3 if quick else 20)
    return {"copy_bandwidth_GBps": 2 * src.numel() * 2 / t / 1e9, "bf16_matmul_TFLOPs": 2 * size**3 / tm / 1e12}


# -- models ---------------------------------------------------------------------------------------------
def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LlamaForCausalLM:
    """Random weights at a real model's shapes, made on the device (no file travels)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    for name, _p in list(model.named_parameters()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        new = model._materialize(name, dtype, device)
        if name.endswith("norm.weight"):
            new.data.uniform_(0.8, 1.2)
        else:
            new.data.normal_(0, 0.02)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = model.inv_freq.to(device)
    return model.eval()


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads: all but the token embedding's table (B rows of it)
    unless it is tied to the lm_head."""
    seen, total = set(), 0
    embed = {p.data_ptr() for p in model.embed_tokens.parameters()}
    head = {p.data_ptr() for p in model.lm_head.parameters()}
    for p in model.parameters():
        ptr = p.data_ptr()
        if ptr in seen or (ptr in embed and ptr not in head):
            continue
        seen.add(ptr)
        total += p.numel() * p.element_size()
    return total


def q4_k_like(model: LlamaForCausalLM) -> None:
    """Each 4-bit linear's scales and mins in a GGUF Q4_K's factored form (random 6-bit sub-block
    values, an fp16 d and -dmin a super-block of 8 groups of 32): the layout a Q4_K file loads in
    on the GPU, its values of no account here (random weights)."""
    for m in model.modules():
        if isinstance(m, Int4Linear):
            (n, g), device = m.scales.shape, m.scales.device
            sub, sup = torch.randint(0, 64, (2, n, g), dtype=torch.int8, device=device), torch.rand(n, g // math.gcd(8, g), device=device) * 1e-3
            params = (sub[0], sub[1], sup.half(), (-sup).half())
            m.scales, m.mins, m.scale_super, m.min_super = (torch.nn.Parameter(t.contiguous(), requires_grad=False) for t in params)


def build(cfg: ModelConfig, mode: str | None, device: torch.device) -> LlamaForCausalLM:
    """mode: a QuantConfig spec, "+a8" after it: its int8/4-bit linears take x rounded to int8;
    "q4_k-like": w4-g32-sym's linears with Q4_K's factored scales (q4_k_like)."""
    model = random_model(cfg, torch.bfloat16, device)
    if mode == "q4_k-like":
        build_q4_k = True
        mode = "w4-g32-sym"
    else:
        build_q4_k = False
    if mode is not None:
        spec, a8 = mode.removesuffix("+a8"), mode.endswith("+a8")
        cfg = QuantConfig.parse(spec)
        cfg.imatrix = False if cfg.mode == "w4" else cfg.imatrix  # random weights: no calibration text to weight by
        quantize_model(model, cfg)
        for m in model.modules():
            if a8 and isinstance(m, (Int8Linear, Int4Linear)):
                m.int8_activations = True
        if build_q4_k:
            q4_k_like(model)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return model


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- the engine ------------------------------------------------------------------------------------------
def engine_decode(model, cfg: ModelConfig, batch: int, ctx: int, steps: int, temperature: float = 0.0) -> float:
    """Decode tok/s of `batch` sequences with `ctx` tokens cached, through LLMEngine.step()
    (greedy; temperature > 0: sampled with the CLI's other defaults: top-k 40, top-p 0.95, min-p 0.05)."""
    warm = 3
    engine = LLMEngine.from_model(model, max_model_len=ctx + warm + steps + 48, max_num_seqs=batch, max_num_batched_tokens=max(2048, ctx))
    filters = {"top_k": 40, "top_p": 0.95, "min_p": 0.05} if temperature else {}
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=warm + steps + 40, ignore_eos=True, **filters)  # (prompts admitted late lag behind)
    seqs = [engine.add_request(prompt(ctx, cfg.vocab_size, i), params) for i in range(batch)]
    while any(not s.output_token_ids for s in seqs):
        engine.step()
    for _ in range(warm):  # captures this batch's graph
        engine.step()
    before = sum(len(s.output_token_ids) for s in seqs)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t  # each step ends reading the sampled ids: synchronized
    made = sum(len(s.output_token_ids) for s in seqs) - before
    assert made == batch * steps, (made, batch * steps)  # no sequence finished inside the timed steps
    TUNED.update({str(k): v for k, v in getattr(engine.backend, "gemv_timings", {}).items()})
    del engine
    return made / elapsed


def engine_prefill(model, cfg: ModelConfig, n: int, reps: int) -> float:
    """Prefill tok/s of an n-token prompt, a new one each repetition and no prefix cache: the same
    prompt again would be served from the cache (the 2026-11-27 run's prefill figures were)."""
    engine = LLMEngine.from_model(model, max_model_len=n + 8, max_num_seqs=1, max_num_batched_tokens=n, enable_prefix_caching=False)
    times = []
    for rep in range(reps + 1):
        ids = prompt(n, cfg.vocab_size, 99 + rep)
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
        sync()
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    del engine
    return n / statistics.median(times[1:])


def decode_limit(model, cfg: ModelConfig, batch: int, ctx: int, copy_bw: float, elem: int = 2) -> float:
    kv = batch * ctx * cfg.num_layers * 2 * cfg.kv_size * elem
    return batch / ((weight_bytes_read(model) + kv) / (copy_bw * 1e9))


def prefill_flops(cfg: ModelConfig, n: int) -> float:
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    attention = 2 * 2 * cfg.num_heads * cfg.head_dim * n * n / 2  # QK^T and PV, causal half
    return cfg.num_layers * (2 * n * per_layer + attention) + 2 * cfg.hidden_size * cfg.vocab_size


# -- peers -----------------------------------------------------------------------------------------------
def hf_peer(cfg: ModelConfig, device: torch.device, batches: list[int], ctx: int, steps: int, prefill_n: int | None) -> dict:
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings, rope_theta=cfg.rope_theta,
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(old)
    out: dict = {}
    with torch.inference_mode():
        for b in batches:
            ids = torch.randint(3, cfg.vocab_size, (b, ctx), device=device)
            res = model(ids, use_cache=True, logits_to_keep=1)
            past, nxt = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
            for i in range(3 + steps):
                if i == 3:
                    sync()
                    t = time.perf_counter()
                res = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
            nxt.tolist()
            out[f"decode_b{b}_tok_s"] = b * steps / (time.perf_counter() - t)
            del past, res
        if prefill_n:
            ids = torch.randint(3, cfg.vocab_size, (1, prefill_n), device=device)
            out["prefill_tok_s"] = prefill_n / timed(lambda: model(ids, use_cache=False, logits_to_keep=1), 3)
    return out


class StaticCacheDecoder:
    """gpt-fast's recipe on this project's reference ops: a static KV cache and fixed shapes, so
    torch.compile(mode="reduce-overhead") captures the whole step into one CUDA graph."""

    def __init__(self, model: LlamaForCausalLM, batch: int, max_len: int) -> None:
        cfg = model.config
        self.model, self.cfg = model, cfg
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        dev, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
        self.caches = [(torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev)) for _ in model.layers]
        self.positions = torch.arange(max_len, device=dev)
        self.gqa = cfg.num_heads != cfg.num_kv_heads
        self.dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_size, cfg.kv_size, cfg.rms_norm_eps)

    def step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [B, 1] at position pos (a 1-element tensor, the same for the batch) -> logits [B, V]."""
        m = self.model
        heads, kv_heads, head_dim, q_size, kv_size, eps = self.dims
        B = ids.shape[0]
        freqs = pos.float()[:, None] * m.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        h = m.embed_tokens(ids[:, 0])
        mask = (self.positions <= pos)[None, None, None, :]
        for layer, (kc, vc) in zip(m.layers, self.caches):
            x = reference.rms_norm(h, layer.input_layernorm.weight, eps)
            q, k, v = F.linear(x, layer.self_attn.qkv_proj.weight).split([q_size, kv_size, kv_size], dim=-1)
            q = reference.apply_rope(q.view(B, heads, head_dim), cos, sin)
            k = reference.apply_rope(k.view(B, kv_heads, head_dim), cos, sin)
            kc.index_copy_(2, pos, k[:, :, None])
            vc.index_copy_(2, pos, v.view(B, kv_heads, 1, head_dim))
            o = F.scaled_dot_product_attention(q[:, :, None], kc, vc, attn_mask=mask, enable_gqa=self.gqa)
            h = h + F.linear(o.reshape(B, q_size), layer.self_attn.o_proj.weight)
            x = reference.rms_norm(h, layer.post_attention_layernorm.weight, eps)
            h = h + F.linear(reference.silu_and_mul(F.linear(x, layer.mlp.gate_up_proj.weight)), layer.mlp.down_proj.weight)
        return F.linear(reference.rms_norm(h, m.norm.weight, eps), m.lm_head.weight).float()


def compile_peer(model: LlamaForCausalLM, batch: int, ctx: int, steps: int) -> dict:
    dec = StaticCacheDecoder(model, batch, ctx + steps + 8)
    torch._dynamo.reset()  # a fresh compile for these shapes
    step = torch.compile(dec.step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    dev = model.embed_tokens.weight.device
    ids = torch.randint(3, model.config.vocab_size, (batch, 1), device=dev)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(3):  # compiles, records, replays
            ids = step(ids, torch.tensor([ctx + i], device=dev)).argmax(-1, keepdim=True).clone()
        compile_s = time.perf_counter() - t0
        sync()
        t = time.perf_counter()
        for i in range(steps):
            ids = step(ids, torch.tensor([ctx + 3 + i], device=dev)).argmax(-1, keepdim=True).clone()
        ids.tolist()
    return {f"decode_b{batch}_tok_s": batch * steps / (time.perf_counter() - t), "compile_seconds": compile_s}


# -- the run ---------------------------------------------------------------------------------------------
def pdl_on(device: torch.device) -> bool:
    """Whether the kernels launch with programmatic dependent launch here (backends/cuda/pdl.py)."""
    if device.type != "cuda":
        return False
    from fasterllama.backends.cuda import pdl

    return pdl.launch_args(torch.zeros(1, device=device))["PDL"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_bench.json"))
    ap.add_argument("--budget", type=float, default=270.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a dry run (also on the CPU)")
    ap.add_argument("--skip", default="", help="comma-separated sections or section groups to skip, e.g. hf,compile:small")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    clock = Clock(args.budget)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "command": "python benchmarks/gpu.py " + " ".join(sys.argv[1:]), "errors": [],
                 "pdl": pdl_on(device)}

    def save() -> None:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)

    def section(name: str, fn) -> None:
        if name in skip or name.split(":")[0] in skip:
            return
        if clock.left() < 0:
            res["errors"].append(f"{name}: skipped, out of time")
            return
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- one failing section must not lose the others' numbers
            res["errors"].append(f"{name}: {type(e).__name__}: {e}")
            traceback.print_exc()
        print(f"[{time.perf_counter() - clock.start:6.1f}s] {name} ({time.perf_counter() - t:.1f}s)", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()

    res["decode_gemv_choice_ms"] = TUNED  # (filled as the models are prepared; saved after every section)
    if device.type == "cuda":
        from fasterllama.backends.cuda import gemv

        res["decode_gemv_rejected"] = gemv.REJECTED  # candidates that failed to compile or disagreed with cuBLAS / tiled
    section("ceilings", lambda: res.update(ceilings(device, args.quick)))
    bw = res.get("copy_bandwidth_GBps", 1.0)
    peak = res.get("bf16_matmul_TFLOPs", 1.0)
    big = TINY if args.quick else LLAMA2_7B
    small = TINY if args.quick else SMOLLM2_135M
    ctx, prefill_n = (32, 64) if args.quick else (512, 2048)
    steps = 4 if args.quick else 32
    plans = [("7b", big, [1, 8, 64], prefill_n), ("small", small, [1, 16], prefill_n)]
    def measure(key: str, cfg: ModelConfig, batches: list[int], n: int, label: str, mode: str | None, decode_only: bool = False) -> None:
        entry = res.setdefault(key, {}).setdefault(label, {})

        def run() -> None:
            model = build(cfg, mode, device)
            for b in batches[:2] if decode_only else batches:
                tok_s = engine_decode(model, cfg, b, ctx, steps)
                limit = decode_limit(model, cfg, b, ctx + 3 + steps // 2, bw)
                entry[f"decode_b{b}_tok_s"] = tok_s
                entry[f"decode_b{b}_of_bandwidth_limit"] = tok_s / limit
            if key == "small" and mode is None:  # what sampling (the CLI's defaults) costs a step (sample_rows: one launch)
                entry["decode_b1_sampled_cli_defaults_tok_s"] = engine_decode(model, cfg, 1, ctx, steps, temperature=0.8)
            if decode_only:
                return
            tok_s = engine_prefill(model, cfg, n, 8)
            entry["prefill_tok_s"] = tok_s
            entry["prefill_of_matmul_peak"] = prefill_flops(cfg, n) * tok_s / n / (peak * 1e12)
            entry["weight_bytes_read_per_step"] = weight_bytes_read(model)

        section(f"{key}:{label}", run)

    for plan in plans:
        for label, mode in MODES.items():
            measure(*plan, label, mode)
    for key, cfg, batches, n in plans:
        section(f"hf:{key}", lambda cfg=cfg, key=key, batches=batches, n=n: res.setdefault(key, {}).__setitem__(
            "HF transformers bf16", hf_peer(cfg, device, batches[:2], ctx, steps, n)))
    for label, mode in EXTRA_MODES.items():  # (after the rows and peers)
        measure(*plans[0], label, mode, decode_only=True)
    if device.type == "cuda":
        for key, cfg in (("small", small), ("7b", big)):
            def run_compiled(cfg=cfg, key=key) -> None:
                model = random_model(cfg, torch.bfloat16, device)
                res.setdefault(key, {})["reference ops, torch.compile reduce-overhead"] = compile_peer(model, 1, ctx, steps)

            section(f"compile:{key}", run_compiled)
    b7 = res.get("7b", {})
    bf16 = b7.get("bf16", {})
    if bf16:
        def ratio(label: str, field: str) -> float | None:
            a, b = b7.get(label, {}).get(field), bf16.get(field)
            return a / b if a and b else None

        res["targets"] = {
            "7b bf16 decode b1 of copy bandwidth (>= 0.80)": bf16.get("decode_b1_of_bandwidth_limit"),
            "7b bf16 decode b1 / HF (>= 2)": (bf16.get("decode_b1_tok_s", 0) / b7["HF transformers bf16"]["decode_b1_tok_s"])
            if b7.get("HF transformers bf16", {}).get("decode_b1_tok_s") else None,
            "4-bit decode b1 / bf16 (>= 2.6)": ratio(Q4_0_LIKE, "decode_b1_tok_s"),
            "int8 decode b1 / bf16 (>= 1.7)": ratio("int8 (w8-g32, Q8_0-like)", "decode_b1_tok_s"),
            "4-bit Q4_1-like decode b1 / bf16": ratio("4-bit (w4-g32, Q4_1-like)", "decode_b1_tok_s"),
            "4-bit Q4_K-like decode b1 / bf16": ratio("4-bit (Q4_K-like: factored scales)", "decode_b1_tok_s"),
            "4-bit a8 decode b1 / bf16 (x int8 as gguf-a8)": ratio("4-bit a8 (w4-g32-sym, x int8 as gguf-a8)", "decode_b1_tok_s"),
            "int8 a8 decode b1 / bf16 (x int8 as gguf-a8)": ratio("int8 a8 (w8-g32, x int8 as gguf-a8)", "decode_b1_tok_s"),
            "w8a8 prefill / bf16 (>= 1.5)": ratio("w8a8 (dynamic)", "prefill_tok_s"),
            "bf16 prefill of matmul peak (>= 0.60)": bf16.get("prefill_of_matmul_peak"),
            "bf16 decode b64 / b1 (>= 25)": (bf16["decode_b64_tok_s"] / bf16["decode_b1_tok_s"]) if "decode_b64_tok_s" in bf16 else None,
            "default shapes bf16 decode b1 tok/s (>= 1000)": res.get("small", {}).get("bf16", {}).get("decode_b1_tok_s"),
        }
    res["seconds"] = time.perf_counter() - clock.start
    save()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
