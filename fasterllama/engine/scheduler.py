"""Scheduler: picks each step's work — one token for every decoding sequence plus prompt chunks
of waiting sequences — within a token budget and the KV cache's free slots."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_cache import KVCache
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens of this sequence computed in this step

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so it draws the next one."""
        return self.seq.num_cached + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, kv_cache: KVCache, max_num_batched_tokens: int) -> None:
        self.kv_cache = kv_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        for seq in self.running:  # decodes first, then prompts still being prefilled
            n = min(seq.num_tokens - seq.num_cached, budget)
            if n <= 0:
                break
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        while self.waiting and self.kv_cache.num_free and budget > 0:
            seq = self.waiting.popleft()
            seq.slot = self.kv_cache.allocate()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_cached, budget)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            self.kv_cache.free(seq.slot)
            seq.slot = None
