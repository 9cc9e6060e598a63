"""Scheduler: picks each step's work — one token for every decoding sequence plus prompt chunks
of waiting sequences — within a token budget, max_num_seqs and the KV cache's free blocks.
A waiting sequence whose next uncached block another sequence is filling (in this step, or a
later one for a prompt in chunks) waits, and takes it from the prefix cache: prompts sharing a
prefix that arrive together (a system prompt, n requests of one prompt) compute it once.

A long prompt is prefilled in chunks of the step's budget, but of a quarter of it in a step where
a waiting request starts: a short request arriving behind an 8,000-token prompt starts at the
next step, a short one, not after the whole prompt (head-of-line blocking; vLLM's
long_prefill_token_threshold). Where none can start (it waits for the prefix the prompt is
computing, or for blocks) the prompt takes the whole budget after all.

When blocks run out the newest running sequence is preempted: its blocks are freed and it waits
at the front of the queue to be recomputed (prompt and output so far; the prefix cache usually
still holds most of it). No request fails because the cache is momentarily full."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

LONG_PREFILL_SHARE = 4  # a prompt being prefilled takes 1 / this of a step's budget while others wait to start


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed in this step, its drafts included
    drafts: list[int] = field(default_factory=list)  # speculative tokens after its last one, verified by this step

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so it draws the next one."""
        return self.seq.num_cached + self.num_tokens - len(self.drafts) == self.seq.num_tokens


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, found there (not computed)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted, i = self.num_preemptions, 0
        prefill_cap = max(1, budget // LONG_PREFILL_SHARE) if self._starts_waiting() else budget
        capped: list[ScheduledSeq] = []  # prefills cut to the cap (the budget goes back to them if no waiting sequence starts)
        while i < len(self.running) and budget > 0:  # decodes first, then prompts still being prefilled
            seq = self.running[i]
            left = seq.num_tokens - seq.num_cached
            n = min(left, budget, left if left == 1 else prefill_cap)
            if not self._reserve(seq, seq.num_cached + n):
                break  # seq itself was preempted, and everything after it
            batch.append(ScheduledSeq(seq, n))
            if n < min(left, budget):
                capped.append(batch[-1])
            budget -= n
            i += 1
        if self.num_preemptions != preempted:
            return batch  # short of blocks: admit nothing new (nor drafts)
        budget = self._add_drafts(batch, budget)
        # (a running parent's forks start once its prompt is in: their seats stay taken while it is
        # prefilled in chunks)
        seats = self._free_seats()
        # the block each running sequence fills next, in this step or (a prompt in chunks) a later one
        computing = {self.blocks.next_block_hash(item.seq, item.seq.num_tokens) for item in batch}
        deferred: list[Sequence] = []
        admitted_from = len(batch)
        while self.waiting and budget > 0 and seats >= 1 + len(self.waiting[0].forks):
            seq = self.waiting[0]
            self.blocks.reuse_prefix(seq)
            upcoming = self.blocks.next_block_hash(seq, seq.num_tokens - 1) if self.blocks.reuses(seq) else None
            if upcoming is not None and upcoming in computing:  # another computes it now: in the cache next step
                self.blocks.free(seq)
                deferred.append(self.waiting.popleft())
                continue
            n = min(seq.num_tokens - seq.num_cached, budget)
            if not self.blocks.reserve(seq, seq.num_cached + n):
                self.blocks.free(seq)
                break
            self.waiting.popleft()
            computing.add(self.blocks.next_block_hash(seq, seq.num_tokens))
            if not seq.admitted:  # (not a preempted sequence coming back: what it finds, it computed itself; as vLLM counts)
                seq.num_prefix_cached, seq.admitted = seq.num_cached, True
                self.prefix_queried_tokens += seq.num_tokens
                self.prefix_hit_tokens += seq.num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seats -= 1 + len(seq.forks)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # first in the queue next step, in their order
        if len(batch) == admitted_from:  # none started (one waits for a prefix being computed, too few blocks)
            self._give_back(capped, budget)
        return batch

    def _give_back(self, capped: list[ScheduledSeq], budget: int) -> None:
        """The budget back to the prefills capped for waiting sequences that did not start, as far
        as free blocks go (never a cause of preemption). Where one did start, the step stays short:
        its first token comes sooner."""
        for item in capped:
            seq = item.seq
            extra = min(seq.num_tokens - seq.num_cached - item.num_tokens, budget)
            if extra > 0 and self.blocks.reserve(seq, seq.num_cached + item.num_tokens + extra):
                item.num_tokens += extra
                budget -= extra

    def _free_seats(self) -> int:
        return self.max_num_seqs - len(self.running) - sum(not child.is_finished for seq in self.running for child in seq.forks)

    def _starts_waiting(self) -> bool:
        """Whether a waiting sequence has the seats to start now."""
        return bool(self.waiting) and self._free_seats() >= 1 + len(self.waiting[0].forks)

    def _add_drafts(self, batch: list[ScheduledSeq], budget: int) -> int:
        """Speculative tokens for the decoding sequences, from the budget and blocks every running
        sequence's own tokens left: a draft that does not fit is dropped, never a cause of
        preemption. Returns the budget left."""
        for item in batch:
            seq = item.seq
            drafts = seq.draft_token_ids[:budget] if seq.num_cached + 1 == seq.num_tokens else []
            if drafts and self.blocks.reserve(seq, seq.num_tokens + len(drafts)):
                item.drafts, item.num_tokens = drafts, item.num_tokens + len(drafts)
                budget -= len(drafts)
        return budget

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for seq's tokens, preempting the newest running sequences until they fit; False
        if seq itself had to go."""
        while not self.blocks.reserve(seq, num_tokens):
            victim = self.running.pop()
            self.blocks.free(victim)
            victim.status = SequenceStatus.WAITING
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
            if victim is seq:
                return False
        return True

    def advance(self, batch: list[ScheduledSeq]) -> None:
        """After a step ran: its tokens are cached, and the blocks they filled can be found. Drafts
        count once accepted (accept)."""
        for item in batch:
            item.seq.num_cached += item.num_tokens - len(item.drafts)
            self.blocks.commit(item.seq)

    def accept(self, seq: Sequence, num_accepted: int) -> None:
        """The first num_accepted drafts of seq's step were right (and are its tokens now): their
        K/V, computed in the step, count as cached. The rest's slots are written over later."""
        if num_accepted and not seq.is_finished:
            seq.num_cached += num_accepted
            self.blocks.commit(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child (another sample of parent's request) starts running on parent's blocks."""
        self.blocks.share([child], [parent])
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        place = 0  # (where in the queue the first of its unstarted samples takes its place)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            place = self.waiting.index(seq)
            self.waiting.remove(seq)
        self.blocks.free(seq)
        forks, seq.forks = [child for child in seq.forks if not child.is_finished], []
        if forks and reason == "abort":  # one sample aborted before its prompt was in: the others go on, the first prefilling
            forks[0].forks = forks[1:]
            self.waiting.insert(place, forks[0])
        else:  # (a failure ends the samples that never started with it)
            for child in forks:
                child.status, child.finish_reason = SequenceStatus.FINISHED, reason
