"""`fasterllama bench`: prefill and decode speed, batch throughput, time to first token and peak
memory, on fixed prompt token ids (so other engines can be fed the very same ids)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .errors import FasterLlamaError
from .sampling_params import SamplingParams


def fixed_prompt_ids(n: int, vocab_size: int, seed: int = 0) -> list[int]:
    """n deterministic token ids (a linear congruential walk over the vocabulary, skipping the
    first 100 ids where special tokens usually live)."""
    span = max(1, vocab_size - 100)
    x, out = seed, []
    for _ in range(n):
        x = (1103515245 * x + 12345) % (1 << 31)
        out.append(100 + x % span if vocab_size > 100 else x % vocab_size)
    return out


def _peak_rss_mb() -> float:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _prefill_seconds(llm: Any, ids: list[int]) -> float:
    """Time to the first generated token of one request (prefill + one sampling step), computing
    the whole prompt: the prefix cache would otherwise hold it from the previous repeat."""
    engine = llm.engine
    engine.blocks.reset_prefix_cache()
    seq = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    t = time.perf_counter()
    while not seq.is_finished:
        engine.step()
    return time.perf_counter() - t


def _decode_rate(llm: Any, prompts: list[list[int]], steps: int) -> float:
    """Generated tokens per second once every request is prefilled (greedy, no early stop): the
    tokens made after that moment over the time they took."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(not s.output_token_ids for s in seqs):
        engine.step()
    t, before = time.perf_counter(), sum(len(s.output_token_ids) for s in seqs)
    while engine.has_unfinished():
        engine.step()
    return (sum(len(s.output_token_ids) for s in seqs) - before) / (time.perf_counter() - t)


def run_bench(llm: Any, prompt_lens: list[int], batch_sizes: list[int], decode_steps: int, repeats: int) -> dict[str, Any]:
    """Prompts longer than the context leaves room for (its length less the decode steps) are cut
    to fit; each prefill entry records the tokens it really ran (`prompt_tokens`)."""
    vocab = llm.config.vocab_size
    limit = llm.engine.max_model_len - decode_steps - 2
    if limit < 1:
        raise FasterLlamaError(f"{decode_steps} decode steps leave no room for a prompt in a context of "
                               f"{llm.engine.max_model_len} tokens: lower --decode-steps or raise --max-model-len")
    result: dict[str, Any] = {"prompt_ids_seed": 0, "decode_steps": decode_steps, "repeats": repeats}
    base = fixed_prompt_ids(min(128, limit), vocab)
    blocks = llm.engine.blocks
    per_seq = -(-(len(base) + decode_steps + 1) // blocks.block_size)
    if max(batch_sizes, default=1) * per_seq > blocks.num_blocks:  # (a batch that does not fit runs in waves: not that batch's speed)
        raise FasterLlamaError(f"a batch of {max(batch_sizes, default=1)} does not fit the KV cache at once ({blocks.num_blocks // per_seq} sequences "
                               f"of {len(base) + decode_steps + 1} tokens do): raise --kv-cache-memory or lower --batch-sizes")
    _prefill_seconds(llm, fixed_prompt_ids(min(16, limit), vocab))  # warm-up
    prefill = {}
    for n in prompt_lens:
        ids = fixed_prompt_ids(min(n, limit), vocab)
        secs = statistics.median(_prefill_seconds(llm, ids) for _ in range(repeats))
        prefill[n] = {"prompt_tokens": len(ids), "tokens_per_s": len(ids) / secs, "time_to_first_token_s": secs}
    result["prefill"] = prefill
    throughput = {}
    for b in batch_sizes:
        prompts = [fixed_prompt_ids(len(base), vocab, seed=i) for i in range(b)]
        throughput[b] = statistics.median(_decode_rate(llm, prompts, decode_steps) for _ in range(repeats))
    result["decode_tokens_per_s"] = throughput.get(1) or _decode_rate(llm, [base], decode_steps)
    result["throughput_tokens_per_s"] = throughput
    result["peak_rss_mb"] = _peak_rss_mb()
    return result
