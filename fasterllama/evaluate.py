"""Perplexity of a text under a model, with a sliding window (as HF's perplexity guide does)."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from .errors import FasterLlamaError


def perplexity(llm: Any, token_ids: list[int], context: int = 512, stride: int | None = None, progress: bool = True) -> dict[str, float]:
    """Windows of `context` tokens (at most the model's max_model_len) advance by `stride`
    (default: half a window); each token is scored once, by the first window that sees it with the
    most context. Returns ppl, mean NLL and the count of scored tokens."""
    if len(token_ids) < 2:
        raise FasterLlamaError("the text is too short to score (needs at least 2 tokens)")
    if context < 2:
        raise FasterLlamaError(f"context must be at least 2 tokens, got {context}")
    context = min(context, llm.engine.max_model_len)
    stride = context // 2 if stride is None else stride
    if not 1 <= stride <= context:
        raise FasterLlamaError(f"stride must be in [1, context], got {stride} (context {context})")
    starts = list(range(0, max(1, len(token_ids) - 1), stride))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(token_ids) - 1, desc="Perplexity", unit="tok", file=sys.stderr, leave=False)
    nll, count, scored_until = 0.0, 0, 0  # tokens < scored_until+1 already scored
    for start in starts:
        end = min(start + context, len(token_ids))
        window = token_ids[start:end]
        logits = llm.compute_logits(window)
        logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
        targets = torch.tensor(window[1:])
        first_new = max(scored_until - start, 0)  # positions (targets) not scored yet
        lp = logprobs[first_new:].gather(1, targets[first_new:, None]).squeeze(1)
        nll -= float(lp.double().sum())
        count += lp.numel()
        if bar is not None:
            bar.update(lp.numel())
        scored_until = end - 1
        if end == len(token_ids):
            break
    if bar is not None:
        bar.close()
    mean = nll / count
    return {"perplexity": math.exp(mean), "nll": mean, "tokens": count, "context": context, "stride": stride}
