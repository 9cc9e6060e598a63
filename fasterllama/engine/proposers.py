"""Speculative proposers: where drafts come from (engine/speculative.py verifies them).

NgramProposer looks the sequence's last tokens up in its prompt and output; DraftModelProposer
decodes them with a smaller model in an engine of its own. Both set each sequence's
draft_token_ids."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..errors import FasterLlamaError
from . import sampler
from .scheduler import ScheduledSeq
from .sequence import Sequence

if TYPE_CHECKING:
    from .llm_engine import LLMEngine


class _NgramIndex:
    """A sequence's tokens and, for every n-gram of the lookup sizes, where its latest occurrence
    ends (the position its continuation starts at). Grown as the sequence grows: a step costs the
    new tokens' n-grams, not a search of the whole context."""

    __slots__ = ("tokens", "ends", "indexed")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before every position below this are in `ends`


class NgramProposer:
    """Prompt lookup decoding (Saxena 2023): find the sequence's last n tokens earlier in its
    prompt or output (longest n first, latest occurrence) and draft the tokens that followed."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], limits: list[int]) -> float | None:
        """Set each sequence's draft_token_ids (at most its limit); the seconds a draft step took
        (None: no model ran; lookups cost next to nothing)."""
        for seq, k in zip(seqs, limits):
            seq.draft_token_ids = self._lookup(seq, k) if k > 0 else []
        return None

    @staticmethod
    def release(seq: Sequence) -> None:
        """seq finished: its index goes."""
        seq.proposer_state = None

    def _lookup(self, seq: Sequence, k: int) -> list[int]:
        index = seq.proposer_state
        if not isinstance(index, _NgramIndex):
            index = seq.proposer_state = _NgramIndex()
        tokens = index.tokens
        if len(tokens) < seq.num_tokens:
            tokens += seq.token_ids(len(tokens), seq.num_tokens)
        end = len(tokens)
        for e in range(max(index.indexed, self.min_n), end):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                index.ends[tuple(tokens[e - n : e])] = e
        index.indexed = end
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            e = index.ends.get(tuple(tokens[end - n :]))
            if e is not None:
                return tokens[e : e + k]
        return []


class _Shadow:
    """A target sequence's twin in the draft model's engine, and how much of it is known to be
    the target's tokens (the rest are drafts, rolled back when the target rejects them)."""

    __slots__ = ("seq", "synced")

    def __init__(self, target: Sequence) -> None:
        self.seq = Sequence(target.prompt_token_ids, target.params, None, target.seed)
        self.synced = len(target.prompt_token_ids)


class DraftModelProposer:
    """A smaller model with the same tokenizer (or the same model, cheaper) drafts k tokens by
    decoding them, each sequence in its own paged cache of the draft engine: first what it has not
    seen of the target's tokens (the prompt, then the tokens the last step emitted), then one
    token at a time. Greedy sequences draft the argmax; sampled ones draw from the draft's
    distribution with the noise the model's sampler uses at that position (the sequence's seed and
    step): where the two distributions are close, the two draws mostly agree (a Gumbel-max
    coupling), and a draft is accepted where it is the model's own draw."""

    def __init__(self, draft: LLMEngine) -> None:
        self.draft = draft
        self.shadows: dict[int, _Shadow] = {}  # by the target sequence's id

    def release(self, seq: Sequence) -> None:
        """seq finished: its twin's blocks go back to the draft engine's cache."""
        entry = self.shadows.pop(seq.seq_id, None)
        if entry is not None:
            self.draft.blocks.free(entry.seq)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> float | None:
        """Set each sequence's draft_token_ids; the seconds a draft step took on average (its
        forward pass, sampling and bookkeeping; steps that also read a new prompt left out), None
        if none such ran."""
        engine = self.draft
        active: list[tuple[Sequence, _Shadow, int]] = []
        for seq, k in zip(seqs, limits):
            seq.draft_token_ids = []
            if k <= 0:
                continue
            shadow = self.shadows.get(seq.seq_id)
            if shadow is None:
                shadow = self.shadows[seq.seq_id] = _Shadow(seq)
            self._sync(seq, shadow)
            # K/V for the tokens it has not seen and k - 1 drafts (the last draft is never fed)
            if engine.blocks.reserve(shadow.seq, shadow.seq.num_tokens + k - 1):
                active.append((seq, shadow, k))
        if not active:
            return None
        self._catch_up([shadow.seq for _, shadow, _ in active])
        seconds, passes = 0.0, 0
        drafts: list[list[int]] = [[] for _ in active]
        batch = [ScheduledSeq(shadow.seq, shadow.seq.num_tokens - shadow.seq.num_cached) for _, shadow, _ in active]
        live = list(range(len(active)))
        while live:
            start = time.perf_counter()
            decoding = sum(item.num_tokens for item in batch) <= 2 * len(batch)  # (a pass that also reads a new prompt is not timed)
            logits = engine.runner.execute(batch, self._last_rows(batch))
            engine.scheduler.advance(batch)
            rows = [(active[i][0], drafts[i]) for i in live]
            tokens = sampler.next_tokens(logits, rows, self.draft.eos_token_ids)
            ended = {i for j, i in enumerate(live) if tokens[j] in (sampler.NO_TOKEN, sampler.NOT_FINITE)}  # (no token to draft)
            for j, i in enumerate(live):
                drafts[i] += [] if i in ended else [tokens[j]]
            live = [i for i in live if i not in ended and len(drafts[i]) < active[i][2]]
            for i in live:
                active[i][1].seq.output_token_ids.append(drafts[i][-1])
            batch = [ScheduledSeq(active[i][1].seq, 1) for i in live]
            if decoding:
                seconds, passes = seconds + time.perf_counter() - start, passes + 1
        for (seq, _, _), tokens in zip(active, drafts):
            seq.draft_token_ids = tokens
        return seconds / passes if passes else None

    def _sync(self, target: Sequence, shadow: _Shadow) -> None:
        """Make the shadow's tokens the target's: keep the drafts the target accepted, roll back
        the K/V of the rest, add the tokens the target emitted after them. The last token's K/V
        is always computed again (its logits give the first draft), also where the target's
        tokens are all among the shadow's (fewer drafts verified than it made: a token budget)."""
        seq = shadow.seq
        mine = seq.token_ids(shadow.synced, seq.num_tokens)
        theirs = target.token_ids(shadow.synced, target.num_tokens)
        same = 0
        while same < min(len(mine), len(theirs)) and mine[same] == theirs[same]:
            same += 1
        keep = shadow.synced + same
        del seq.output_token_ids[keep - len(seq.prompt_token_ids) :]
        seq.output_token_ids += theirs[same:]
        self.draft.blocks.rollback(seq, min(keep, seq.num_tokens - 1))
        shadow.synced = target.num_tokens

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Compute all but the last unseen token of long catch-ups (new prompts) in chunks of the
        draft engine's token budget, so the first draft step's batch stays within it."""
        engine = self.draft
        share = max(1, engine.scheduler.max_num_batched_tokens // len(seqs))
        for seq in seqs:
            while seq.num_tokens - seq.num_cached > share:
                chunk = [ScheduledSeq(seq, min(seq.num_tokens - seq.num_cached - 1, engine.scheduler.max_num_batched_tokens))]
                engine.runner.execute(chunk, [])
                engine.scheduler.advance(chunk)

    @staticmethod
    def _last_rows(batch: list[ScheduledSeq]) -> list[int]:
        rows, offset = [], 0
        for item in batch:
            offset += item.num_tokens
            rows.append(offset - 1)
        return rows


def load_draft_model(model: str, quantization: str | None, target: LLMEngine, progress: bool) -> LLMEngine:
    """The draft model's engine: on the target's device, as many sequences and as long a context."""
    from ..loading.model_loader import keeps_16bit_for, load_model
    from .llm_engine import LLMEngine

    loaded = load_model(model, target.dtype, target.device, None if quantization is None else "none",
                        target.backend.keeps_gguf_quantized(target.dtype), progress, keep_16bit=target.backend.keeps_16bit_weights(target.dtype) and keeps_16bit_for(quantization))
    if loaded.config.vocab_size != target.config.vocab_size:
        raise FasterLlamaError(f"the draft model's vocabulary has {loaded.config.vocab_size} tokens, the model's {target.config.vocab_size}: "
                               "a draft model must share the model's tokenizer")
    if loaded.tokenizer is not None and target.tokenizer is not None and loaded.tokenizer.backend.get_vocab() != target.tokenizer.backend.get_vocab():
        raise FasterLlamaError("the draft model's tokenizer differs from the model's: a draft model must share its tokenizer")
    if loaded.config.max_position_embeddings < target.max_model_len:
        raise FasterLlamaError(f"the draft model's context ({loaded.config.max_position_embeddings} tokens) is shorter than max_model_len "
                               f"{target.max_model_len}; lower max_model_len")
    limits = target.limits
    draft = LLMEngine.from_model(loaded.model, loaded.tokenizer, max_model_len=target.max_model_len, max_num_seqs=limits.max_num_seqs,
                                 max_num_batched_tokens=limits.max_num_batched_tokens, block_size=limits.block_size)
    if quantization is not None:
        draft.quantize(quantization)
    return draft
