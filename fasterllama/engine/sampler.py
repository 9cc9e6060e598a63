"""Sampler: logits processors and draws over the whole batch's logits at once.

Order (as HF generate, after the request's logit biases and banned tokens): repetition penalty,
presence/frequency penalties, temperature, top-k, top-p, min-p, then a draw. Draws use a counter-based hash of (seed, step, token), so a seeded
request gets the same tokens whatever else is in its batch."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .. import ops
from ..sampling_params import SamplingParams
from .sequence import Sequence

_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685  # 0x94D049BB133111EB


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def hashed_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0,1) noise [B, vocab] from splitmix64 of (seed, step, token index): reproducible per row."""
    idx = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    x = (seeds[:, None] * _M1) ^ (steps[:, None] * _M2 + idx[None, :])
    x = x * _M1
    x = (x ^ _shr(x, 30)) * _M2
    x = (x ^ _shr(x, 27)) * _M3
    x = x ^ _shr(x, 31)
    return (_shr(x, 40).to(torch.float64) + 0.5) / float(1 << 24)


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors, built once per step by the engine."""

    temperature: torch.Tensor  # [B] (0 = greedy)
    top_k: torch.Tensor  # [B] int (0 = off)
    top_p: torch.Tensor  # [B]
    min_p: torch.Tensor  # [B]
    repetition_penalty: torch.Tensor  # [B]
    presence_penalty: torch.Tensor  # [B]
    frequency_penalty: torch.Tensor  # [B]
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64 (index of the token being drawn)
    prompt_tokens: torch.Tensor | None  # [B, Lp] padded with -1 (repetition penalty)
    output_tokens: torch.Tensor | None  # [B, Lo] padded with -1 (all penalties)
    suppress: torch.Tensor | None  # [B, V] bool, tokens banned this step (EOS before min_tokens)
    bias: torch.Tensor | None = None  # [B, V] added to the logits (logit_bias; -inf outside allowed_token_ids)

def penalizes(p: SamplingParams) -> bool:
    """Whether the params' penalties count the tokens drawn so far (repetition, presence, frequency)."""
    return p.repetition_penalty != 1 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def plain_logits(seq: Sequence, extra: int = 0) -> bool:
    """No logits processor changes this sequence's logits at its next token (after `extra` more):
    no penalty, no ban, no bias."""
    p = seq.params
    return not penalizes(p) and not p.biases_tokens and len(seq.output_token_ids) + extra >= p.min_tokens


def sampling_batch(rows: list[tuple[Sequence, list[int]]], vocab: int, eos_token_ids: Iterable[int], device: torch.device) -> SamplingBatch:
    """The batch for rows that each draw a sequence's next token after its output so far and the
    row's extra tokens (the drafts before it in a speculative step; usually none)."""

    def col(values: list, dtype: torch.dtype) -> torch.Tensor:  # (a copy that never waits for the device's queue: chained steps)
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    def padded(token_rows: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(r) for r in token_rows))
        return col([r + [-1] * (width - len(r)) for r in token_rows], torch.int64)

    ps = [s.params for s, _ in rows]
    f32 = torch.float32
    steps = [len(s.output_token_ids) + len(extra) for s, extra in rows]
    needs_output = any(penalizes(p) for p in ps)
    needs_prompt = any(p.repetition_penalty != 1 for p in ps)
    suppress = None
    banned = [_bad_word_ends(s, extra) for s, extra in rows]
    if any(n < p.min_tokens for n, p in zip(steps, ps)) or any(banned):
        suppress = torch.zeros(len(rows), vocab, dtype=torch.bool)
        for i, (n, p) in enumerate(zip(steps, ps)):
            ids = banned[i] | ({*eos_token_ids, *p.stop_token_ids} if n < p.min_tokens else set())
            suppress[i, [t for t in ids if 0 <= t < vocab]] = True
        suppress = suppress.to(device, non_blocking=True)
    bias = None
    if any(p.biases_tokens for p in ps):
        bias = torch.zeros(len(rows), vocab, dtype=torch.float32)
        for i, p in enumerate(ps):
            if p.allowed_token_ids is not None:
                bias[i] = float("-inf")
                bias[i, p.allowed_token_ids] = 0.0
            if p.logit_bias:
                ids = list(p.logit_bias)
                bias[i, ids] += torch.tensor([p.logit_bias[t] for t in ids])
        bias = bias.to(device, non_blocking=True)
    # the per-row numbers in two copies to the device (one per dtype), not nine
    floats = col([[p.temperature for p in ps], [p.top_p for p in ps], [p.min_p for p in ps], [p.repetition_penalty for p in ps],
                  [p.presence_penalty for p in ps], [p.frequency_penalty for p in ps]], f32)
    ints = col([[p.top_k for p in ps], [s.seed for s, _ in rows], steps], torch.int64)
    return SamplingBatch(
        temperature=floats[0],
        top_k=ints[0],
        top_p=floats[1],
        min_p=floats[2],
        repetition_penalty=floats[3],
        presence_penalty=floats[4],
        frequency_penalty=floats[5],
        seeds=ints[1],
        steps=ints[2],
        prompt_tokens=padded([s.prompt_token_ids for s, _ in rows]) if needs_prompt else None,
        output_tokens=padded([s.output_token_ids + extra for s, extra in rows]) if needs_output else None,
        suppress=suppress,
        bias=bias,
    )


def _bad_word_ends(seq: Sequence, extra: list[int]) -> set[int]:
    """The tokens that would finish one of seq's bad words after its output and `extra`: a word's
    last token where the output ends with the word's others (vLLM's rule)."""
    if not seq.bad_words_ids:
        return set()
    out = seq.output_token_ids + extra
    return {w[-1] for w in seq.bad_words_ids if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1 :] == w[:-1])}


def _seen_mask(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    counts = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, tokens.clamp(min=-1) % (vocab + 1), torch.ones_like(tokens, dtype=torch.float32))
    return counts[:, :vocab]  # index vocab is where the -1 padding landed


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    V = logits.shape[-1]
    if b.output_tokens is None and b.prompt_tokens is None:
        return logits
    out_counts = _seen_mask(b.output_tokens, V) if b.output_tokens is not None else torch.zeros_like(logits)
    if (b.repetition_penalty != 1).any():
        seen = out_counts > 0
        if b.prompt_tokens is not None:
            seen |= _seen_mask(b.prompt_tokens, V) > 0
        rp = b.repetition_penalty[:, None]
        penalized = torch.where(logits < 0, logits * rp, logits / rp)
        logits = torch.where(seen, penalized, logits)
    if (b.presence_penalty != 0).any() or (b.frequency_penalty != 0).any():
        logits = logits - b.frequency_penalty[:, None] * out_counts - b.presence_penalty[:, None] * (out_counts > 0)
    return logits


TOP_P_CANDIDATES = 256


def top_p_outside(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tokens outside each row's nucleus: those whose higher-ranked tokens hold top_p of the mass
    already (the top token always stays; HF's TopPLogitsWarper). The nucleus almost always lies
    within a few hundred tokens, so it is found among the top TOP_P_CANDIDATES (topk, sorted)
    instead of sorting the whole vocabulary; rows whose candidates hold less than top_p of the
    mass fall back to the full sort."""
    probs = logits.softmax(dim=-1)
    k = min(TOP_P_CANDIDATES, probs.shape[-1])
    top, idx = probs.topk(k, dim=-1)
    if bool((top.sum(dim=-1) >= top_p).all()):
        keep = (top.cumsum(dim=-1) - top) < top_p[:, None]  # mass above each candidate
        return torch.ones_like(probs, dtype=torch.bool).scatter(1, idx, ~keep)
    sorted_probs, sorted_idx = torch.sort(probs, descending=False)
    remove = sorted_probs.cumsum(dim=-1) <= (1 - top_p[:, None])
    remove[:, -1] = False
    return remove.scatter(1, sorted_idx, remove)


def apply_temperature_and_filters(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (-inf outside the kept set), HF semantics."""
    temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
    logits = logits / temp[:, None]
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    if (b.top_k > 0).any():
        V = logits.shape[-1]
        k = torch.where(b.top_k > 0, b.top_k.clamp(max=V), torch.full_like(b.top_k, V))
        kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        logits = torch.where(logits < kth, neg_inf, logits)
    if (b.top_p < 1).any():
        logits = torch.where(top_p_outside(logits, b.top_p), neg_inf, logits)
    if (b.min_p > 0).any():
        probs = logits.softmax(dim=-1)
        threshold = b.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = torch.where(probs < threshold, neg_inf, logits)
    return logits


HUGE_LOGIT = 1e30  # past it a logit / temperature may overflow to inf (and inf - inf to NaN in the softmax)


def penalized(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """fp32 logits after the biases, bans and penalties: what greedy rows take the argmax of.
    A huge bias or a tiny repetition penalty can push a logit toward the float range's end: such a
    row is shifted to a maximum of 0 (the same distribution), other rows are left as they are."""
    logits = logits.float()
    if b.bias is not None:
        logits = logits + b.bias
    if b.suppress is not None:
        logits = logits.masked_fill(b.suppress, float("-inf"))
    logits = apply_penalties(logits, b)
    if b.bias is not None or b.output_tokens is not None or b.prompt_tokens is not None:
        logits = logits.clamp(max=torch.finfo(torch.float32).max)  # (-inf: banned, kept)
        top = logits.amax(dim=-1, keepdim=True)
        logits = logits - torch.where(top > HUGE_LOGIT, top, torch.zeros_like(top))  # (no sync with the device: chained steps)
    return logits


def probabilities(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The distribution a sampled row draws from (penalties, temperature, top-k/p, min-p)."""
    return apply_temperature_and_filters(penalized(logits, b), b).softmax(dim=-1)


def draw(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One token per row from probs [B, V] by an exponential race (Gumbel-max) on the hashed noise
    of (seed, step): the same (probs, seed, step) always draw the same token."""
    noise = -torch.log(hashed_uniform(seeds, steps, probs.shape[-1])).to(probs.dtype)
    return ops.argmax(probs / noise)


def reference_sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Next token per row (argmax for greedy rows, a seeded draw otherwise) in PyTorch ops: what
    the backends' one-kernel samplers are checked against."""
    logits = penalized(logits, b)
    greedy = b.temperature == 0
    if bool(greedy.all()):
        return ops.argmax(logits)
    probs = apply_temperature_and_filters(logits, b).softmax(dim=-1)
    return torch.where(greedy, ops.argmax(logits), draw(probs, b.seeds, b.steps))


def sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Next token per row: argmax for greedy rows, a seeded draw otherwise; in one kernel where the
    backend has one (ops `sample_rows`: the same draw as reference_sample, up to rounding)."""
    fused = ops.registered("sample_rows", logits.device)
    if fused is not None and logits.dim() == 2:
        return fused(penalized(logits, b), b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps)
    return reference_sample(logits, b)


NO_TOKEN = -1  # next_tokens' token for a row whose every token is banned
NOT_FINITE = -2  # ... and for a row whose drawn logit is NaN or +inf (a model's fault: damaged weights, an overflow)


def next_tokens(logits: torch.Tensor, rows: list[tuple[Sequence, list[int]]], eos_token_ids: Iterable[int]) -> list[int]:
    """The token each row draws (rows as in sampling_batch): a plain argmax where every row is
    greedy with unprocessed logits (no per-row tensors), else `sample` on the rows' batch; NO_TOKEN
    where the row's bans (its -inf logits: a constraint's mask, allowed_token_ids, bad words, end
    tokens before min_tokens) leave no token, NOT_FINITE where the drawn token's logit is NaN or +inf."""
    if all(s.params.greedy and plain_logits(s, len(extra)) for s, extra in rows):
        return ops.argmax_tokens(logits)
    b = sampling_batch(rows, logits.shape[-1], eos_token_ids, logits.device)
    drawn = sample(logits, b)
    chosen = drawn[:, None]
    value = logits.gather(1, chosen).float()  # a row draws a banned token only when every token is banned
    if b.bias is not None:
        value = value + b.bias.gather(1, chosen)
    if b.suppress is not None:
        value = value.masked_fill(b.suppress.gather(1, chosen), float("-inf"))
    value = value[:, 0]
    return torch.where(value.isfinite(), drawn, torch.where(value == float("-inf"), NO_TOKEN, NOT_FINITE)).tolist()


def token_tensor(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Iterable[int], ahead: int = 0) -> torch.Tensor:
    """The tokens next_tokens draws for these sequences, left on the device (a chained step's
    input, LLMEngine), each `ahead` tokens past the output it has now (tokens drawn and not yet
    read). Not for penalties, which count the tokens drawn before."""
    if all(s.params.greedy and plain_logits(s, ahead) for s in seqs):
        return ops.argmax(logits)
    return sample(logits, sampling_batch([(s, [-1] * ahead) for s in seqs], logits.shape[-1], eos_token_ids, logits.device))
