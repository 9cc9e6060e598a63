"""The paged KV cache: the block manager's bookkeeping (reference counts, prefix caching, LRU,
copy-on-write), and the engine on top of it: prefix reuse, preemption, forked samples and
beams give the tokens they give without any of it."""

from __future__ import annotations

import time

import pytest
import tiny_models as tm
import torch

from fasterllama import LLM, SamplingParams
from fasterllama.engine.block_manager import BlockManager
from fasterllama.engine.kv_cache import parse_memory
from fasterllama.engine.sequence import Sequence
from fasterllama.errors import FasterLlamaError


def _seq(tokens: list[int], **params) -> Sequence:
    return Sequence(tokens, SamplingParams(**params), None, 0)


class _Copies:
    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int]]] = []

    def __call__(self, src: list[int], dst: list[int]) -> None:
        self.calls.append((list(src), list(dst)))


def _computed(bm: BlockManager, seq: Sequence, upto: int) -> None:
    """What the scheduler and a step do for seq's tokens up to `upto`."""
    assert bm.reserve(seq, upto)
    seq.num_cached = upto
    bm.commit(seq)


# -- BlockManager ---------------------------------------------------------------------------------
def test_reserve_and_free_count_blocks():
    bm = BlockManager(8, 4, _Copies())
    a = _seq(list(range(10)))
    assert bm.reserve(a, 10) and len(a.block_table) == 3 and bm.num_used == 3
    assert bm.reserve(a, 12) and len(a.block_table) == 3  # still fits the third block
    assert bm.reserve(a, 13) and len(a.block_table) == 4
    b = _seq(list(range(20)))
    assert not bm.reserve(b, 20) and b.block_table == [] and bm.num_used == 4  # 5 needed, 4 free: nothing taken
    bm.free(a)
    assert bm.num_used == 0 and a.block_table == [] and a.num_cached == 0
    assert bm.reserve(b, 20) and len(set(b.block_table)) == 5


def test_prefix_reuse_takes_only_full_matching_blocks():
    bm = BlockManager(16, 4, _Copies())
    a = _seq(list(range(14)))
    _computed(bm, a, 14)  # blocks 0-2 full (12 tokens), the fourth half full
    b = _seq(list(range(9)) + [99, 98, 97])  # shares 9 tokens: two full blocks
    bm.reuse_prefix(b)
    assert b.block_table == a.block_table[:2] and b.num_cached == 8
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1, 1]
    c = _seq(list(range(12)))  # all of its 3 blocks cached: the last one is computed anyway
    bm.reuse_prefix(c)
    assert c.num_cached == 8
    d = _seq([5] + list(range(1, 14)))  # equal later blocks after a different first block: no hit (chained hashes)
    bm.reuse_prefix(d)
    assert d.num_cached == 0
    e = _seq(list(range(14)), prompt_logprobs=1)  # prompt logprobs need every prompt position computed
    bm.reuse_prefix(e)
    assert e.num_cached == 0


def test_freed_blocks_stay_cached_until_needed_lru():
    bm = BlockManager(4, 4, _Copies())
    a = _seq(list(range(8)) + [1])
    _computed(bm, a, 9)  # 2 full blocks (cached) + 1 partial
    full = a.block_table[:2]
    bm.free(a)
    assert bm.num_used == 0
    b = _seq([50, 51, 52, 53])
    assert bm.reserve(b, 4)  # takes the unused block, not a cached one
    assert b.block_table[0] not in full
    again = _seq(list(range(8)) + [7])
    bm.reuse_prefix(again)
    assert again.block_table == full  # still findable after its owner left
    bm.free(again)
    assert _reuse(bm, list(range(8)) + [7]) == 8
    c = _seq(list(range(100, 112)))
    assert bm.reserve(c, 12)  # needs 3 of the 3 free blocks: evicts the cached ones
    assert _reuse(bm, list(range(8)) + [7]) == 0


def test_blocks_are_handed_out_lowest_first():
    """A sequence's blocks stay ascending in memory however earlier sequences came and went (the
    CPU attention streams them; out of order it runs slower)."""
    bm = BlockManager(12, 4, _Copies())
    a, b = _seq(list(range(12))), _seq(list(range(100, 112)))
    _computed(bm, a, 12)
    _computed(bm, b, 12)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    bm.free(b)
    bm.free(a)  # all six cached (findable), the least recently freed (b's, tail first) to go first
    bm.reset_prefix_cache()  # nothing findable any more: all free blocks are alike
    c = _seq(list(range(200, 228)))
    assert bm.reserve(c, 20) and c.block_table == [0, 1, 2, 3, 4]
    for n in (24, 28):  # growing a token at a time takes the lowest free block each time
        assert bm.reserve(c, n)
    assert c.block_table == [0, 1, 2, 3, 4, 5, 6]
    d = _seq(list(range(300, 309)))
    _computed(bm, d, 9)  # blocks 7, 8 cached, 9 partial (nothing findable)
    bm.free(d)
    e = _seq(list(range(400, 404)))
    assert bm.reserve(e, 4) and e.block_table == [9]  # empty blocks before cached ones, lowest first
    f = _seq(list(range(500, 512)))
    assert bm.reserve(f, 12) and f.block_table == [10, 11, 8]  # then evicts cached: the tail first


def _reuse(bm: BlockManager, tokens: list[int]) -> int:
    s = _seq(tokens)
    bm.reuse_prefix(s)
    hit = s.num_cached
    bm.free(s)
    return hit


def test_shared_partial_block_is_copied_before_a_write():
    copies = _Copies()
    bm = BlockManager(8, 4, copies)
    parent = _seq(list(range(6)))
    _computed(bm, parent, 6)
    child = _seq(list(range(6)))
    bm.share([child], [parent])
    assert child.block_table == parent.block_table and child.num_cached == 6
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2]
    parent.output_token_ids.append(7)
    assert bm.reserve(parent, 7)  # writes position 6: in the shared second block
    assert copies.calls == [([child.block_table[1]], [parent.block_table[1]])]
    assert parent.block_table[0] == child.block_table[0] and parent.block_table[1] != child.block_table[1]
    assert [bm.ref_counts[b] for b in child.block_table] == [2, 1]
    child.output_token_ids.append(8)
    assert bm.reserve(child, 7) and len(copies.calls) == 1  # the child's block is its own now: no copy


def test_share_lets_beams_swap_blocks():
    bm = BlockManager(8, 4, _Copies())
    beams = [_seq(list(range(5))) for _ in range(2)]
    for s in beams:
        _computed(bm, s, 5)
    tables = [list(s.block_table) for s in beams]
    bm.share(beams, [beams[1], beams[1]])  # both continue beam 1
    assert beams[0].block_table == beams[1].block_table == tables[1]
    assert bm.num_used == 2 and all(bm.ref_counts[b] == 2 for b in tables[1])


def test_drafts_never_cost_a_later_sequence_its_next_token():
    """Two decoding sequences, one free block left: the first's drafts would need it, the second's
    next token does. The second gets it, the drafts are dropped, no one is preempted (a stress
    audit's case: the drafts took it first and the second was preempted). Drafts that fit the
    blocks a sequence holds still run."""
    from fasterllama.engine.scheduler import Scheduler

    bm = BlockManager(5, 4, _Copies())
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq(list(range(6))), _seq(list(range(100, 109)))
    for seq in (a, b):  # a: token 6 of 6 next (2 blocks); b: token 9 of 9 next (2 blocks full: it needs a third)
        _computed(bm, seq, seq.num_tokens - 1)
        sched.running.append(seq)
    a.draft_token_ids = [1, 2, 3]  # a's 6 + 3 = 9 tokens: a third block too
    assert bm.num_free == 1
    batch = sched.schedule()
    assert [(item.seq, item.num_tokens, item.drafts) for item in batch] == [(a, 1, []), (b, 1, [])]
    assert sched.num_preemptions == 0 and sched.running == [a, b] and bm.num_free == 0
    a.draft_token_ids = [1, 2]  # 8 tokens: a's second block holds them
    batch = sched.schedule()
    assert [(item.seq, item.num_tokens, item.drafts) for item in batch] == [(a, 3, [1, 2]), (b, 1, [])]


def test_a_short_prompt_starts_beside_a_long_one_being_prefilled():
    """Head-of-line blocking: a 300-token prompt prefills at the whole budget (64) while nothing
    waits; a 5-token request arriving behind it starts at the next step, the long one taking a
    quarter of the budget then (a short step), and the whole budget back after."""
    from fasterllama.engine.scheduler import Scheduler

    bm = BlockManager(64, 16, _Copies())
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    long = _seq(list(range(300)))
    sched.add(long)

    def step() -> list[tuple[Sequence, int]]:
        batch = sched.schedule()
        sched.advance(batch)
        return [(item.seq, item.num_tokens) for item in batch]

    assert step() == [(long, 64)]
    short = _seq(list(range(500, 505)))
    sched.add(short)
    assert step() == [(long, 16), (short, 5)]
    sched.finish(short, "length")  # (its one token drawn)
    assert step() == [(long, 64)]
    shorts = [_seq(list(range(600 + 30 * k, 620 + 30 * k))) for k in range(3)]
    for seq in shorts:
        sched.add(seq)
    assert step() == [(long, 16), (shorts[0], 20), (shorts[1], 20), (shorts[2], 8)]
    # one that waits for the prefix the long one is filling does not start: the long one keeps the whole budget
    bm2 = BlockManager(64, 16, _Copies())
    sched = Scheduler(bm2, max_num_seqs=8, max_num_batched_tokens=64)
    first, second = _seq(list(range(300))), _seq(list(range(300)) + [7])
    sched.add(first)
    assert step() == [(first, 64)]
    sched.add(second)
    steps = [step() for _ in range(4)]
    assert steps[:3] == [[(first, 64)]] * 3 and steps[3] == [(first, 44)] + steps[3][1:], steps  # (the prefix computed once)


def test_parse_memory():
    assert parse_memory("2GiB") == 2 << 30 and parse_memory("512MB") == 512 * 10**6 and parse_memory("0.5") == 0.5
    assert parse_memory(1 << 20) == 1 << 20 and parse_memory(0.25) == 0.25 and parse_memory("1e9") == 10**9 and parse_memory("1.5e9") == 1.5e9
    for bad in ("lots", "2 parsecs", -1, 0, 1.5, "1.5", "0", True, None):
        with pytest.raises(FasterLlamaError):
            parse_memory(bad)


# -- the engine -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    model = tm.build_hf_model(tm.SPECS["gqa"])
    return tm.save_hf_checkpoint(model, str(tmp_path_factory.mktemp("paged") / "hf"))


def _llm(folder: str, **kwargs) -> LLM:
    return LLM(folder, progress=False, max_model_len=512, block_size=16, **kwargs)


def test_prefix_cache_computes_only_the_new_tokens(tiny_folder):
    """A second request sharing a 256-token prefix computes only its own tokens and returns what
    it returns with caching off."""
    llm = _llm(tiny_folder)
    engine = llm.engine
    prefix = [(11 * i) % 300 + 10 for i in range(256)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    computed: list[int] = []
    real_execute = engine.runner.execute

    def counting(batch, rows=None):
        computed.append(sum(item.num_tokens for item in batch))
        return real_execute(batch, rows)

    engine.runner.execute = counting
    llm.generate([prefix + [1, 2, 3]], params)
    assert computed == [259]
    computed.clear()
    seq = engine.add_request(prefix + [9, 8, 7, 6, 5], params)
    while engine.has_unfinished():
        engine.step()
    assert computed == [5] and seq.num_prefix_cached == 256  # 256 tokens from the cache
    engine.runner.execute = real_execute
    off = _llm(tiny_folder, enable_prefix_caching=False).generate([prefix + [9, 8, 7, 6, 5]], params)[0]
    assert seq.output_token_ids == off.token_ids


def test_prompts_arriving_together_compute_their_shared_prefix_once(tiny_folder):
    """Requests sharing a prefix submitted at once: the first computes it, the others wait a step
    and take it from the cache (and a long prompt's later chunks the same, a step behind); each
    returns what it returns with caching off."""
    llm = _llm(tiny_folder, max_num_batched_tokens=128)
    engine = llm.engine
    prefix = [(7 * i) % 300 + 10 for i in range(200)]  # 12 full blocks and 8 tokens
    prompts = [prefix + [k, k + 1] for k in range(4)] + [[5, 6, 7] + prefix]  # the last shares nothing
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    computed: list[int] = []
    real_execute = engine.runner.execute

    def counting(batch, rows=None):
        computed.append(sum(item.num_tokens - len(item.drafts) for item in batch))
        return real_execute(batch, rows)

    engine.runner.execute = counting
    outs = llm.generate(prompts, params)
    engine.runner.execute = real_execute
    assert [o.num_cached_tokens for o in outs] == [0, 192, 192, 192, 0]  # (vLLM's RequestOutput field)
    # the shared 192 tokens once, then each shared prompt's own 10 (the block after its last full
    # one), the unrelated prompt whole, and 2 decode steps of 5 tokens
    assert sum(computed) == 202 + 3 * 10 + 203 + 2 * 5, computed
    off = _llm(tiny_folder, enable_prefix_caching=False).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in off]
    assert engine.blocks.num_used == 0


def test_preemption_gives_every_request_its_tokens(tiny_folder):
    """A cache too small for all running requests: the newest are preempted and recomputed, and
    each request still gets the tokens it gets alone. The prefix-cache counters count each
    prompt once (a preempted sequence's return counted its prompt and output again)."""
    roomy = _llm(tiny_folder)
    per_block = roomy.engine.kv_cache.bytes_per_block(roomy.engine.config, 16, torch.float32)
    tight = _llm(tiny_folder, kv_cache_memory=40 * per_block, enable_prefix_caching=False)  # 640 tokens for 6 x ~170
    prompts = [[(13 * i + 5 * k) % 300 + 10 for i in range(40 + 9 * k)] for k in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=120, ignore_eos=True)
    for params in (greedy, seeded):
        queried = tight.engine.scheduler.prefix_queried_tokens
        outs = tight.generate(prompts, params)
        assert tight.engine.scheduler.num_preemptions > 0
        assert tight.engine.scheduler.prefix_queried_tokens - queried == sum(map(len, prompts))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == roomy.generate([prompt], params)[0].token_ids
        assert tight.engine.blocks.num_used == 0


def test_n_samples_fork_from_one_prefill(tiny_folder):
    """n samples prefill the prompt once and share its blocks; each gets the tokens a lone
    sequence with its seed gets."""
    llm = _llm(tiny_folder, enable_prefix_caching=False)
    engine = llm.engine
    prompt = [(3 * i) % 300 + 10 for i in range(70)]
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=20, ignore_eos=True)
    computed: list[int] = []
    real_execute = engine.runner.execute

    def counting(batch, rows=None):
        computed.append(sum(item.num_tokens for item in batch))
        if len(batch) == 3:  # the samples decode on the prompt's shared blocks
            tables = [item.seq.block_table for item in batch]
            assert tables[0][:4] == tables[1][:4] == tables[2][:4]
        return real_execute(batch, rows)

    engine.runner.execute = counting
    outs = llm.generate([prompt], params)[0].outputs
    engine.runner.execute = real_execute
    assert computed[0] == 70 and sum(computed) == 70 + 3 * 19
    for k, out in enumerate(outs):
        seq = engine.add_request(prompt, params, sample_index=k)
        while engine.has_unfinished():
            engine.step()
        assert out.token_ids == seq.output_token_ids
    assert len({tuple(o.token_ids) for o in outs}) == 3
    assert engine.blocks.num_used == 0


def test_forks_keep_their_seats_while_the_prompt_is_prefilled_in_chunks(tiny_folder):
    """An n = 4 request whose prompt takes three steps holds all four seats: the requests behind
    it wait (they took the forks' seats, and the forks started on top: 7 running of 4)."""
    llm = _llm(tiny_folder, max_num_seqs=4, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_group(list(range(10, 50)), SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=5, ignore_eos=True))
    for k in range(3):
        engine.add_group([50 + k, 60 + k], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 4 and engine.blocks.num_used == 0


@pytest.mark.parametrize("steps_before", [0, 1])  # aborted while waiting / with its prompt half prefilled
def test_aborting_the_first_sample_leaves_the_others_their_tokens(tiny_folder, steps_before):
    """An n = 3 request's first sample aborted before its prompt is in: the other two prefill from
    the second and draw the tokens they draw when nothing is aborted (their seeds)."""
    llm = _llm(tiny_folder, max_num_seqs=4, max_num_batched_tokens=16, enable_prefix_caching=False)  # (the prompt: three steps each time)
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5, ignore_eos=True)
    prompt = list(range(10, 50))
    want = [s.output_token_ids for s in _run_group(engine, prompt, params)]
    seqs = engine.add_group(prompt, params)
    for _ in range(steps_before):
        engine.step()
    assert not seqs[0].output_token_ids
    engine.abort(seqs[0])
    while engine.has_unfinished():
        engine.step()
    assert seqs[0].finish_reason == "abort" and [s.finish_reason for s in seqs[1:]] == ["length", "length"]
    assert [s.output_token_ids for s in seqs[1:]] == want[1:]
    assert engine.blocks.num_used == 0


def _run_group(engine, prompt, params):
    seqs = engine.add_group(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return seqs


def test_beam_search_needs_no_seats_and_frees_its_blocks(tiny_folder):
    llm = _llm(tiny_folder, max_num_seqs=1)
    prompt = [(5 * i) % 300 + 10 for i in range(30)]
    out = llm.generate([prompt], SamplingParams(beam_width=4, n=2, max_tokens=20))[0]
    assert len(out.outputs) == 2
    assert llm.engine.blocks.num_used == 0


def test_a_cache_smaller_than_the_context_is_the_context(tiny_folder):
    """A kv_cache_memory that holds fewer tokens than max_model_len lowers max_model_len to what it
    holds: a prompt past that is refused naming kv_cache_memory, and a request running into it
    ends with "length", as at any context limit (never a request that waits for room forever)."""
    llm = _llm(tiny_folder, kv_cache_memory="64KiB")
    engine = llm.engine
    holds = engine.blocks.num_blocks * engine.blocks.block_size
    assert holds < 512 and engine.max_model_len == holds
    with pytest.raises(FasterLlamaError, match="kv_cache_memory"):
        llm.generate([[10] * holds], SamplingParams(max_tokens=1))
    out = llm.generate([[10] * (holds - 20)], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert len(out.token_ids) == 20 and out.finish_reason == "length"
    assert engine.blocks.num_used == 0
    with pytest.raises(FasterLlamaError, match="kv_cache_memory"):
        _llm(tiny_folder, kv_cache_memory="1KiB")


def test_more_samples_than_seats_run_in_groups(tiny_folder):
    """n above max_num_seqs: the samples start in groups of max_num_seqs (a group needs all its
    seats at once, so one of n > max_num_seqs would never start), each sample the tokens its seed
    gives alone."""
    llm = _llm(tiny_folder, max_num_seqs=2)
    prompt = [(3 * i) % 300 + 10 for i in range(20)]
    params = SamplingParams(temperature=1.0, seed=5, n=5, max_tokens=8, ignore_eos=True)
    outs = llm.generate([prompt], params)[0].outputs
    alone = _llm(tiny_folder).generate([prompt], params)[0].outputs
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in outs}) == 5
    assert llm.engine.blocks.num_used == 0


def test_compute_logits_and_streams_beside_preempting_requests(tiny_folder):
    """compute_logits while a stream runs in a cache so small that sequences are preempted (its
    rows once each, not again after every recompute), and streams read in turns, with
    compute_logits between: each stream yields all its text (it yielded only the pieces of the
    steps it ran itself)."""
    roomy = _llm(tiny_folder)
    per_block = roomy.engine.kv_cache.bytes_per_block(roomy.engine.config, 8, torch.float32)
    tight = LLM(tiny_folder, progress=False, block_size=8, kv_cache_memory=40 * per_block, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = [[(3 * i) % 300 + 10 for i in range(100)], [(5 * i) % 300 + 10 for i in range(60)]]
    want = [o.text for o in roomy.generate(prompts, params)]
    probe = [(7 * i) % 300 + 10 for i in range(250)]
    readers = [iter(tight.stream(p, params)) for p in prompts]
    got, live, rounds = ["", ""], [0, 1], 0
    while live:
        for k in list(live):
            try:
                got[k] += next(readers[k])
            except StopIteration:
                live.remove(k)
        rounds += 1
        if rounds == 2:
            logits = tight.compute_logits(probe)
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want
    assert torch.allclose(logits, roomy.compute_logits(probe), atol=1e-4)
    assert tight.engine.blocks.num_used == 0


def test_compute_logits_is_a_request_like_others(tiny_folder):
    """compute_logits runs through the scheduler beside running requests: chunked by the token
    budget, nothing taken from the prefix cache, its blocks freed after, the others unaffected."""
    prompt = [(7 * i) % 200 + 3 for i in range(300)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = _llm(tiny_folder)
    ref_logits = alone.compute_logits(prompt)
    ref_tokens = alone.generate([prompt[:50]], params)[0].token_ids
    llm = _llm(tiny_folder, max_num_batched_tokens=128)
    engine = llm.engine
    engine.add_request(prompt[:280], SamplingParams(temperature=0, max_tokens=1))  # fills the prefix cache
    while engine.has_unfinished():
        engine.step()
    running = engine.add_request(prompt[:50], params)
    for _ in range(5):
        engine.step()
    queried, hits = engine.scheduler.prefix_queried_tokens, engine.scheduler.prefix_hit_tokens
    logits = llm.compute_logits(prompt)  # 300 tokens in chunks of at most 128, beside `running`
    assert engine.scheduler.prefix_queried_tokens == queried + 300  # admitted by the scheduler
    assert engine.scheduler.prefix_hit_tokens == hits  # with the first 256 tokens cached, none taken
    assert logits.shape == ref_logits.shape == (300, llm.config.vocab_size)
    assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    while engine.has_unfinished():
        engine.step()
    assert running.output_token_ids == ref_tokens
    assert engine.blocks.num_used == 0


def test_aborting_n_samples_before_they_start_ends_each(tiny_folder):
    """An n=3 request aborted while its prompt is still prefilling (its samples 1 and 2 not forked
    yet) gives every sample its final "abort" output: only sample 0 got one, and reading the handle
    hung forever."""
    import threading

    from fasterllama.engine.async_engine import EngineLoop

    llm = _llm(tiny_folder, max_num_batched_tokens=8)  # 400 prompt tokens: 50 steps of prefill
    loop = EngineLoop(llm.engine)
    try:
        handle = loop.add_request([(7 * i) % 300 + 10 for i in range(400)], SamplingParams(n=3, max_tokens=20, seed=1))
        deadline = time.monotonic() + 30
        while loop.stats.steps < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        handle.abort()
        finals: list[tuple[int, str | None]] = []
        reader = threading.Thread(target=lambda: finals.extend((o.index, o.finish_reason) for o in handle), daemon=True)
        reader.start()
        reader.join(30)
        assert not reader.is_alive() and handle.finished
        assert sorted(finals) == [(0, "abort"), (1, "abort"), (2, "abort")]
        assert llm.engine.blocks.num_used == 0 and not llm.engine.has_unfinished()
    finally:
        loop.shutdown(timeout=15)


def test_cached_tokens_are_counted_at_first_admission(tiny_folder):
    """A prompt never seen before, preempted mid-prefill and admitted again, reports 0 prompt
    tokens from the prefix cache, as alone (it reported the blocks it had computed itself, as
    vLLM does not); its tokens are those it gets alone."""
    roomy = _llm(tiny_folder)
    per_block = roomy.engine.kv_cache.bytes_per_block(roomy.engine.config, 16, torch.float32)
    engine = _llm(tiny_folder, kv_cache_memory=17 * per_block, max_num_batched_tokens=16).engine
    greedy = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    engine.add_request([(3 * i) % 300 + 10 for i in range(100)], greedy)
    for _ in range(8):
        engine.step()
    prompt = [(11 * i) % 290 + 20 for i in range(200)]  # shares nothing with the first
    late = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions >= 1
    assert late.num_prefix_cached == 0
    assert late.output_token_ids == roomy.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0].token_ids


def test_beam_search_runs_in_a_cache_of_exactly_the_blocks_it_needs(tiny_folder):
    """W beams need the prompt's full blocks once and W blocks each of their own: the prompt's
    partial last block is copied by W - 1 beams, the last writes the original (it asked one
    block more, refusing searches that fit)."""
    from fasterllama.engine.kv_cache import KVCache

    probe = _llm(tiny_folder)
    per_block = KVCache.bytes_per_block(probe.engine.config, 16, probe.engine.dtype)
    prompt = [(7 * i) % 300 + 10 for i in range(20)]  # one full block of 16, four tokens in a second
    llm = _llm(tiny_folder, kv_cache_memory=4 * per_block)  # 1 + 3 beams x 1 block (30 tokens: 2 blocks a beam)
    assert llm.engine.blocks.num_blocks == 4
    params = SamplingParams(beam_width=3, n=3, max_tokens=10, ignore_eos=True)
    got = llm.generate([prompt], params)[0]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in probe.generate([prompt], params)[0].outputs]
    assert llm.engine.blocks.num_used == 0


def test_beam_search_wider_than_the_vocabulary_returns_only_real_hypotheses(tiny_folder):
    """Beams past the vocabulary's candidates (the first step's padding beams) are no hypotheses:
    each returned one is distinct and ranked, as HF gives them -1e9 scores."""
    llm = _llm(tiny_folder, max_num_seqs=400)
    vocab = llm.config.vocab_size
    outs = llm.generate([[10, 11, 12]], SamplingParams(beam_width=vocab + 40, n=vocab + 40, max_tokens=1, ignore_eos=True))[0].outputs
    assert len(outs) == vocab and len({tuple(o.token_ids) for o in outs}) == vocab
    scores = [o.cumulative_logprob for o in outs]
    assert scores == sorted(scores, reverse=True)
    diverse = llm.generate([[10, 11, 12]], SamplingParams(beam_width=4, n=4, max_tokens=4, ignore_eos=True, diversity_rate=1e9))[0].outputs
    assert len(diverse) == 4  # (real beams, however far the diversity penalty ranks them down)
