"""BlockManager: hands out the paged KV cache's blocks, counts their references, and keeps full
blocks findable by content (prefix caching).

Every sequence has a block table: key position p lives in block table[p // block_size]. Blocks
are shared by reference count: a prompt's full blocks between requests with the same prefix, and
everything a forked sequence (the n samples of a request, beams) inherits from its parent. A
shared block is copied before a sequence writes into it (copy-on-write; only a last, partial
block is ever written again).

Prefix caching: once a block is full its content is keyed by a hash chained over all the tokens
before it (so equal keys mean equal prefixes); a new sequence takes the longest run of cached
blocks that starts its tokens and computes only the rest. A block whose last user is gone stays
findable in the free list until its memory is needed; blocks holding no cached content are handed
out first, the lowest-numbered first, then cached ones, the least recently freed first (LRU).
Lowest first keeps a sequence's blocks ascending in memory, as they mostly are: the CPU's
attention streams them, and out of order it ran 1.2x slower (docs/performance.md)."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from .sequence import Sequence

BlockKey = tuple[int | None, tuple[int, ...]]  # (hash of the blocks before, this block's tokens)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, copy_blocks: Callable[[list[int], list[int]], None],
                 prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.copy_blocks = copy_blocks  # the cache's copy, for copy-on-write
        self.prefix_caching = prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[BlockKey | None] = [None] * num_blocks  # the content of a cached block
        self.cached: dict[int, int] = {}  # hash of a key -> the block holding it
        self.free_empty: list[int] = list(range(num_blocks))  # a heap of free blocks holding nothing cached
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # free blocks still findable; first out: least recently freed

    @property
    def num_free(self) -> int:
        return len(self.free_empty) + len(self.free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix caching ---------------------------------------------------------------------
    def _key(self, seq: Sequence, i: int, parent: int | None) -> BlockKey:
        bs = self.block_size
        return parent, tuple(seq.token_ids(i * bs, (i + 1) * bs))

    def reuses(self, seq: Sequence) -> bool:
        return self.prefix_caching and not seq.needs_prompt_rows and not seq.uncached_prompt

    def reuse_prefix(self, seq: Sequence) -> None:
        """Give a sequence with no blocks the cached blocks its tokens start with (never all of its
        tokens: the last one is computed, its logits sample the next). A sequence that asked for
        prompt logprobs or logits (or runs a calibration pass: uncached_prompt) computes its whole prompt."""
        if not self.reuses(seq):
            return
        parent, hits, hashes = None, [], []
        for i in range((seq.num_tokens - 1) // self.block_size):
            key = self._key(seq, i, parent)
            h = hash(key)
            block = self.cached.get(h)
            if block is None or self.block_keys[block] != key:
                break
            hits.append(block)
            hashes.append(h)
            parent = h
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free_cached[block]
            self.ref_counts[block] += 1
        seq.block_table, seq.block_hashes = hits, hashes
        seq.num_cached = len(hits) * self.block_size

    def next_block_hash(self, seq: Sequence, upto: int) -> int | None:
        """The key hash of seq's first block past its cached tokens, if its tokens before `upto`
        fill that block (None otherwise, or without prefix caching)."""
        i = seq.num_cached // self.block_size
        if not self.prefix_caching or len(seq.block_hashes) != i or (i + 1) * self.block_size > upto:
            return None
        return hash(self._key(seq, i, seq.block_hashes[-1] if i else None))

    def commit(self, seq: Sequence) -> None:
        """After a step: key the blocks the step filled, so later sequences can find them."""
        full = seq.num_cached // self.block_size
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            key = self._key(seq, i, seq.block_hashes[-1] if i else None)
            h = hash(key)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if self.prefix_caching and self.block_keys[block] is None and h not in self.cached:
                self.cached[h] = block
                self.block_keys[block] = key

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """seq keeps the K/V of its first num_tokens tokens only (a draft model's rejected drafts):
        the blocks after are written over, so the ones only it holds stop being findable."""
        if seq.num_cached <= num_tokens:
            return
        seq.num_cached = num_tokens
        first = num_tokens // self.block_size
        for block in seq.block_table[first : len(seq.block_hashes)]:
            key = self.block_keys[block]
            if key is not None and self.ref_counts[block] == 1:
                if self.cached.get(hash(key)) == block:
                    del self.cached[hash(key)]
                self.block_keys[block] = None
        del seq.block_hashes[first:]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block's content (benchmarks that time the same prompt twice)."""
        self.cached.clear()
        self.block_keys = [None] * self.num_blocks
        self.free_empty += self.free_cached
        heapq.heapify(self.free_empty)
        self.free_cached.clear()

    # -- allocation ---------------------------------------------------------------------------
    def _take_free(self) -> int:
        if self.free_empty:
            block = heapq.heappop(self.free_empty)
        else:  # evict the least recently freed cached content
            block, _ = self.free_cached.popitem(last=False)
        key = self.block_keys[block]
        if key is not None:
            self.block_keys[block] = None
            h = hash(key)
            if self.cached.get(h) == block:
                del self.cached[h]
        self.ref_counts[block] = 1
        return block

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make seq's block table cover positions 0..num_tokens-1 with blocks it alone writes (the
        shared ones from position seq.num_cached on are copied first). False, changing nothing,
        when too few blocks are free."""
        table = seq.block_table
        end = self.blocks_for(num_tokens)
        shared = [i for i in range(seq.num_cached // self.block_size, min(end, len(table))) if self.ref_counts[table[i]] > 1]
        if max(0, end - len(table)) + len(shared) > self.num_free:
            return False
        if shared:
            new = [self._take_free() for _ in shared]
            self.copy_blocks([table[i] for i in shared], new)
            for i, block in zip(shared, new):
                self.ref_counts[table[i]] -= 1
                table[i] = block
        while len(table) < end:
            table.append(self._take_free())
        return True

    def free(self, seq: Sequence) -> None:
        """Let go of a sequence's blocks; it has nothing cached after."""
        for block in reversed(seq.block_table):  # a prefix's tail is evicted before its head
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_keys[block] is None:  # nothing to find in it: hand it out first
                    heapq.heappush(self.free_empty, block)
                else:
                    self.free_cached[block] = None
        seq.block_table, seq.block_hashes, seq.num_cached = [], [], 0

    def share(self, seqs: list[Sequence], sources: list[Sequence]) -> None:
        """seqs[i] drops its blocks and shares those of sources[i], which are taken before any is
        let go (a source may be among seqs): forking n samples, reordering beams."""
        states = [(list(s.block_table), list(s.block_hashes), s.num_cached) for s in sources]
        for table, _, _ in states:
            for block in table:
                self.ref_counts[block] += 1
        for seq in seqs:
            self.free(seq)
        for seq, (table, hashes, num_cached) in zip(seqs, states):
            seq.block_table, seq.block_hashes, seq.num_cached = table, hashes, num_cached
