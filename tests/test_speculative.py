"""Speculative decoding (engine/speculative.py): drafted tokens verified in one step keep the
model's outputs exactly.

Greedy outputs with speculation equal those without, token for token, on tiny random models (in
packed batches, across block boundaries, under preemption, with drafts that are wrong on purpose)
and on the default model over the core-engine prompts; seeded samples too, with prompt lookup and
with a draft model (whose draws share the target's noise: the same model drafting is always
right); rejected drafts never reach the prefix cache. Also the config's errors, the n-gram index
against a brute-force search, how many tokens the speculator drafts, and the CLI flag."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import tiny_models as tm  # noqa: E402

from fasterllama import LLM, SamplingParams  # noqa: E402
from fasterllama.engine.kv_cache import KVCache  # noqa: E402
from fasterllama.engine.proposers import NgramProposer  # noqa: E402
from fasterllama.engine.sequence import Sequence  # noqa: E402
from fasterllama.engine.speculative import SpeculativeConfig, Speculator  # noqa: E402
from fasterllama.errors import FasterLlamaError  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompt(length: int, seed: int, vocab: int = 320) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(len(tm.SPECIAL_TOKENS), vocab) for _ in range(length)]


# prompts that repeat themselves (so n-gram lookups find drafts), of lengths around the 8-token blocks
PROMPTS = [_prompt(6, 1) * 3, _prompt(13, 2) * 2 + _prompt(3, 3), _prompt(5, 4), _prompt(9, 5) * 4]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("spec_models")
    out = {name: tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS[name]), str(root / name)) for name in ("gqa", "mqa", "tied")}
    wide = tm.TinySpec("gqa_hd32", hidden_size=128, num_heads=4, num_kv_heads=2, seed=21)  # head_dim 32: the vector kernels' widths
    out[wide.name] = tm.save_hf_checkpoint(tm.build_hf_model(wide), str(root / wide.name))
    return out


def _always_draft(llm: LLM) -> LLM:
    """Draft as much as allowed whatever the measured cost, so every test exercises verification."""
    llm.engine.speculator.row_cost = llm.engine.speculator.draft_cost = 0.0
    return llm


def _outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


# -- config -------------------------------------------------------------------------------------
def test_config_parses_vllm_style_dicts_and_json() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 8}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 8, 3, 6)
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 2)
    cfg = SpeculativeConfig.parse({"method": "draft_model", "model": "x.gguf", "num_speculative_tokens": 3, "quantization": "w4"})
    assert (cfg.model, cfg.quantization) == ("x.gguf", "w4")
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value,message", [
    ('{"method": ', "not valid JSON"),
    ("[1]", "must be a dict"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, draft_model"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer in \\[1, 15\\], got None"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max must be an integer in \\[3, 64\\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"}, "unknown speculative_config key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "x", "quantization": "bogus"}, "quantization: unknown quantization mode 'bogus'"),
])
def test_config_errors_are_one_line(value: object, message: str) -> None:
    with pytest.raises(FasterLlamaError, match=message):
        SpeculativeConfig.parse(value)


def test_bad_config_fails_before_the_model_loads(paths) -> None:
    with pytest.raises(FasterLlamaError, match="method must be one of"):
        LLM(paths["gqa"], progress=False, speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(FasterLlamaError, match="no such model file or folder"):
        LLM(paths["gqa"], progress=False, speculative_config={"method": "draft_model", "model": "/no/such/draft", "num_speculative_tokens": 2})
    with pytest.raises(FasterLlamaError, match="the draft model's vocabulary has 384 tokens, the model's 320: a draft model must share"):
        LLM(paths["gqa"], progress=False, speculative_config={"method": "draft_model", "model": paths["tied"], "num_speculative_tokens": 2})


# -- the n-gram proposer and the draft lengths -------------------------------------------------------
def _brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The continuation of the latest earlier occurrence of the longest suffix of lo..hi tokens."""
    end = len(tokens)
    for n in range(min(hi, end - 1), lo - 1, -1):
        suffix = tokens[end - n :]
        for e in range(end - 1, n - 1, -1):
            if tokens[e - n : e] == suffix:
                return tokens[e : e + k]
    return []


@pytest.mark.parametrize("lo,hi", [(1, 3), (2, 4), (3, 3)])
def test_ngram_lookup_matches_a_brute_force_search(lo: int, hi: int) -> None:
    g = random.Random(lo * 10 + hi)
    proposer = NgramProposer(lo, hi)
    for trial in range(20):
        seq = Sequence([g.randrange(4) for _ in range(g.randrange(1, 12))], SamplingParams(), None, 0)
        for _ in range(40):  # the index grows with the sequence, a few tokens at a time
            k = g.randrange(0, 6)
            proposer.propose([seq], [k])
            tokens = seq.prompt_token_ids + seq.output_token_ids
            assert seq.draft_token_ids == (_brute_force(tokens, k, lo, hi) if k else []), (trial, tokens)
            seq.output_token_ids += [g.randrange(4) for _ in range(g.randrange(1, 4))]


def test_draft_lengths_follow_acceptance_and_cost() -> None:
    def lengths(rates: list[tuple[float, float]], caps: list[int], cost: float, max_rows: int = 16, probe: float | None = None,
                draft_cost: float = 0.0) -> list[int]:
        return Speculator(None, 15, cost, max_rows, draft_cost)._lengths([(a, b, a if probe is None else probe) for a, b in rates], caps)

    assert lengths([(0.99, 0.99)], [15], 0.35) == [15]  # a copy going on: as many as allowed
    assert lengths([(0.99, 0.99)], [6], 0.35) == [6]  # the cap (tokens the request may still emit)
    assert lengths([(0.3, 0.9)], [15], 0.35) == [0]  # a first draft less likely than its cost
    assert lengths([(0.3, 0.9)], [15], 0.35, probe=0.8) == [1]  # ... unless little tried: one draft, a probe
    assert 1 <= lengths([(0.7, 0.7)], [15], 0.35)[0] <= 4
    assert lengths([(0.5, 0.5)], [15], 0.0) == [15]  # rows for free (a GPU's decode): draft all
    both = lengths([(0.99, 0.99), (0.6, 0.6)], [15, 15], 0.35)
    assert sum(both) + 2 <= 16 and both[0] > both[1]  # rows go where they pay most, within the step's limit
    assert lengths([(0.7, 0.9)] * 6, [15] * 6, 0.35) == [0] * 6  # in a batch a draft must beat a higher bar
    assert lengths([(0.99, 0.99)] * 16, [15] * 16, 0.0) == [0] * 16  # the batch fills the rows already
    # a draft model's steps count: one as slow as the target (a model drafting for itself) never pays,
    # even every draft right; a 10x faster one does where drafts hold, less where they do not
    assert lengths([(0.999, 0.999)], [15], 0.35, draft_cost=1.0) == [0]
    assert lengths([(0.999, 0.999)], [15], 0.35, probe=1.0, draft_cost=1.0) == [0]
    assert lengths([(0.99, 0.99)], [15], 0.35, draft_cost=0.1)[0] >= 12
    assert 0 < lengths([(0.8, 0.8)], [15], 0.35, draft_cost=0.1)[0] < lengths([(0.8, 0.8)], [15], 0.35)[0]
    assert lengths([(0.9, 0.9)], [15], 0.0, draft_cost=0.3)[0] < 15  # free rows on a GPU, but the draft steps are not


def test_draft_cost_follows_the_draft_steps() -> None:
    """A draft model's cost d is timed in the steps it drafts (a batch's step counted as its rows
    cost): slow steps price drafts out; then, with nothing drafted and so nothing timed, d drifts
    back toward the start's measure and drafting resumes (it stayed off for good after a stall)."""

    class Seq:
        def __init__(self, i: int) -> None:
            self.acceptance, self.draft_token_ids, self.is_finished, self.seq_id = None, [], False, i

    class TimedProposer:
        seconds = 0.0

        def propose(self, seqs: list, limits: list[int]) -> float | None:
            for seq, k in zip(seqs, limits):
                seq.draft_token_ids = [0] * k
            return self.seconds if any(limits) else None

    step, c = 0.05, 0.35
    proposer, seqs = TimedProposer(), [Seq(0)]
    spec = Speculator(proposer, 5, c, 16, draft_cost=0.2, step_seconds=step)

    def run(n: int, d: float) -> list[int]:
        proposer.seconds, drafted = d * step * (1 + spec.row_cost * (len(seqs) - 1)), []
        for _ in range(n):
            spec.propose(seqs, [100] * len(seqs))
            drafted.append(sum(len(s.draft_token_ids) for s in seqs))
            for s in seqs:
                if s.draft_token_ids:
                    spec.record(s, len(s.draft_token_ids), len(s.draft_token_ids))  # every draft right
        return drafted

    assert run(10, 0.2)[-1] == 5 and spec.draft_cost == pytest.approx(0.2)
    assert run(10, 5.0)[-1] == 0 and spec.draft_cost > 0.5  # stalled draft steps: drafting stops
    assert sum(run(300, 0.2)[-50:]) > 0 and spec.draft_cost == pytest.approx(0.2, abs=0.02)  # and comes back
    seqs[:] = [Seq(i) for i in range(4)]
    spec.row_cost = 0.05  # (rows nearly free: all four draft)
    assert run(50, 0.2)[-1] >= 4 and spec.draft_cost == pytest.approx(0.2, abs=0.02)  # a four-row draft step is not four times d


# -- exactness on tiny models ----------------------------------------------------------------------
class OracleProposer:
    """Drafts the reference continuation, every `wrong`-th draft of it changed: accepted and
    rejected drafts, at every offset, across block boundaries."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], wrong: int) -> None:
        self.reference, self.wrong, self.calls = reference, wrong, 0

    def propose(self, seqs: list[Sequence], limits: list[int]) -> None:
        for seq, k in zip(seqs, limits):
            want = self.reference.get(tuple(seq.prompt_token_ids), [])
            n = len(seq.output_token_ids)
            drafts = list(want[n : n + k])
            for i in range(len(drafts)):
                self.calls += 1
                if self.calls % self.wrong == 0:
                    drafts[i] = (drafts[i] + 1) % 320
            seq.draft_token_ids = drafts

    def release(self, seq: Sequence) -> None:
        pass


@pytest.mark.parametrize("name,wrong", [("gqa", 3), ("gqa", 7), ("gqa", 1000), ("gqa_hd32", 3), ("gqa_hd32", 1000)])
def test_greedy_identical_with_right_and_wrong_drafts(paths, name: str, wrong: int) -> None:
    """Packed batches of prompts around the 8-token blocks, a cache so small that sequences are
    preempted, drafts wrong every `wrong` tokens: the outputs are plain decoding's (head_dim 8 and 32)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(paths[name], progress=False, block_size=8)
    want = _outputs(plain, PROMPTS, params)
    reference = {tuple(p): w[0] for p, w in zip(PROMPTS, want)}
    per_block = KVCache.bytes_per_block(plain.engine.config, 8, torch.float32)
    for cache in (None, 14 * per_block):  # room for all; for 14 blocks of 8 tokens (the longest request needs 10: preemptions)
        spec = _always_draft(LLM(paths[name], progress=False, block_size=8, kv_cache_memory=cache, speculative_config=NGRAM))
        oracle = spec.engine.speculator.proposer = OracleProposer(reference, wrong)
        assert _outputs(spec, PROMPTS, params) == want
        s = spec.engine.speculator
        assert s.num_accepted_tokens > 0 and oracle.calls > 0
        if wrong < 1000:
            assert s.num_accepted_tokens < s.num_draft_tokens  # some drafts were rejected
        if cache is not None:
            assert spec.engine.scheduler.num_preemptions > 0


def test_drafts_end_at_an_end_token(paths) -> None:
    """Nothing follows an accepted end token: drafts are cut after a stop token (or EOS), so a
    sequence that stops drafts no rows past its end."""
    prompt = PROMPTS[0]
    long = LLM(paths["gqa"], progress=False).generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].token_ids
    stop = long[9]
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop], ignore_eos=True)
    want = LLM(paths["gqa"], progress=False).generate([prompt], params)[0].token_ids
    assert want[-1] == stop and len(want) < 30
    spec = _always_draft(LLM(paths["gqa"], progress=False, speculative_config={**NGRAM, "num_speculative_tokens": 15}))
    spec.engine.speculator.proposer = OracleProposer({tuple(prompt): long}, 1000)  # right drafts, 15 of them: past the stop
    assert spec.generate([prompt], params)[0].token_ids == want
    s = spec.engine.speculator
    assert s.num_accepted_tokens == s.num_draft_tokens == len(want) - 1  # every draft up to the stop, none after it


def test_rejected_drafts_never_reach_the_prefix_cache(paths) -> None:
    """After speculative runs with many wrong drafts, prompts that reuse their blocks (prompt +
    output as a new prompt) continue as with no prefix cache at all."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(paths["gqa"], progress=False, block_size=8, enable_prefix_caching=False)
    first = _outputs(plain, PROMPTS, params)
    reference = {tuple(p): w[0] for p, w in zip(PROMPTS, first)}
    spec = _always_draft(LLM(paths["gqa"], progress=False, block_size=8, speculative_config=NGRAM))
    spec.engine.speculator.proposer = OracleProposer(reference, 2)
    assert _outputs(spec, PROMPTS, params) == first
    again = [p + w[0] for p, w in zip(PROMPTS, first)]
    hits = spec.engine.scheduler.prefix_hit_tokens
    assert _outputs(spec, again, params) == _outputs(plain, again, params)
    assert spec.engine.scheduler.prefix_hit_tokens - hits >= sum(len(p) for p in again) // 2  # their blocks were found


def test_ngram_keeps_greedy_seeded_samples_and_logprobs(paths) -> None:
    """Prompt lookup drafts are fixed guesses: a sampled row's token is the draw plain decoding
    makes with the same seed and step, so seeded samples (n > 1 too) and logprobs are identical."""
    plain = LLM(paths["gqa"], progress=False)
    spec = _always_draft(LLM(paths["gqa"], progress=False, speculative_config=NGRAM))
    cases = [
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.7, top_k=20, seed=5, n=3, max_tokens=48, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=9, max_tokens=40, repetition_penalty=1.3, min_tokens=20),
    ]
    for params in cases:
        got, want = spec.generate(PROMPTS, params), plain.generate(PROMPTS, params)
        assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
        if params.logprobs:
            for g, w in zip(got, want):
                assert [sorted(d) for d in g.outputs[0].logprobs] == [sorted(d) for d in w.outputs[0].logprobs]
                np.testing.assert_allclose([v for d in g.outputs[0].logprobs for v in d.values()],
                                           [v for d in w.outputs[0].logprobs for v in d.values()], atol=1e-5)
    s = spec.engine.speculator
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens


def test_structured_output_with_drafts(paths) -> None:
    """Constrained sequences draft too: rows are masked as after the drafts before them, guesses
    the constraint refuses are cut; outputs (greedy, seeded) equal plain decoding's."""
    import re

    grammar = 'start: item ("," item)*\nitem: "ab" | "cd" | "e"'
    plain = LLM(paths["gqa"], progress=False)
    spec = _always_draft(LLM(paths["gqa"], progress=False, speculative_config=NGRAM))
    for extra in ({"temperature": 0}, {"temperature": 1.0, "top_k": 50, "repetition_penalty": 1.2, "seed": 4, "n": 3}):
        for constraint in ({"grammar": grammar}, {"regex": "(ab|cd|e)(,(ab|cd|e)){8,30}"}):
            params = SamplingParams(max_tokens=64, **constraint, **extra)
            got = spec.generate(PROMPTS, params)
            assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in plain.generate(PROMPTS, params)]
            assert all(re.fullmatch(r"(ab|cd|e)(,(ab|cd|e))*", c.text) for o in got for c in o.outputs)
    s = spec.engine.speculator
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    draft = _always_draft(LLM(paths["gqa"], progress=False, speculative_config={"method": "draft_model", "model": paths["mqa"], "num_speculative_tokens": 3}))
    params = SamplingParams(max_tokens=48, grammar=grammar, temperature=1.0, seed=7, n=2)
    outs = [[c.text for c in o.outputs] for o in draft.generate(PROMPTS, params)]
    assert outs == [[c.text for c in o.outputs] for o in draft.generate(PROMPTS, params)]
    assert all(re.fullmatch(r"(ab|cd|e)(,(ab|cd|e))*", t) for o in outs for t in o)


def test_tensor_parallel_verify_steps(paths) -> None:
    """Verify steps split over two ranks (rank 0 drafts and sends the rows): plain decoding's output."""
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), SamplingParams(temperature=0.9, seed=2, n=2, max_tokens=24, ignore_eos=True)]
    plain = LLM(paths["gqa"], progress=False)
    two = _always_draft(LLM(paths["gqa"], progress=False, tensor_parallel_size=2, speculative_config=NGRAM))
    try:
        for p in params:
            assert _outputs(two, PROMPTS, p) == _outputs(plain, PROMPTS, p)
        assert 0 < two.engine.speculator.num_accepted_tokens < two.engine.speculator.num_draft_tokens
    finally:
        two.engine.shutdown()


def test_draft_model_outputs_identical_greedy_and_seeded(paths) -> None:
    """A different tiny model of the same tokenizer drafts (its guesses often wrong), or the same
    model (always right, sampled drafts too: they are drawn with the target's noise); greedy and
    seeded outputs are the target's own, token for token."""
    plain = LLM(paths["gqa"], progress=False, block_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=4, n=2, max_tokens=30, ignore_eos=True)
    for draft, k in (("mqa", 3), ("gqa", 5)):
        spec = _always_draft(LLM(paths["gqa"], progress=False, block_size=8,
                                 speculative_config={"method": "draft_model", "model": paths[draft], "num_speculative_tokens": k}))
        s = spec.engine.speculator
        for params in (greedy, sampled):
            before = s.num_draft_tokens, s.num_accepted_tokens
            assert _outputs(spec, PROMPTS, params) == _outputs(plain, PROMPTS, params)
            drafted, accepted = s.num_draft_tokens - before[0], s.num_accepted_tokens - before[1]
            assert accepted == drafted > 0 if draft == "gqa" else 0 < accepted < drafted
        draft = spec.engine.speculator.proposer.draft
        assert not spec.engine.speculator.proposer.shadows and draft.blocks.num_used == 0  # finished: twins gone, blocks back


def test_small_token_budgets_prompt_logprobs_and_stops(paths) -> None:
    """Token budgets below the drafts: a draft model verified on fewer drafts than it made (its
    twin then held every token the model emitted: an IndexError), and a prompt whose last chunk is
    one token, drafted after, with prompt logprobs (its sampling row was taken from the drafts:
    an IndexError); outputs and prompt logprobs are plain decoding's. Drafts after a stop string
    are not counted as accepted (15 of 15 were, for 7 tokens shown)."""
    plain = LLM(paths["gqa"], progress=False, block_size=16)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [_prompt(40, 3), _prompt(25, 4)]
    want = _outputs(plain, prompts, greedy)
    for budget in (2, 3):
        spec = _always_draft(LLM(paths["gqa"], progress=False, block_size=16, max_num_batched_tokens=budget,
                                 speculative_config={"method": "draft_model", "model": paths["gqa"], "num_speculative_tokens": 4}))
        assert _outputs(spec, prompts, greedy) == want, budget
    repetitive = ([11, 12, 13, 14, 15] * 20)[:97]  # 12 chunks of 8, then 1 token (prompt lookup always drafts)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    spec = _always_draft(LLM(paths["gqa"], progress=False, block_size=16, max_num_batched_tokens=8, speculative_config=ngram))
    chunked = LLM(paths["gqa"], progress=False, block_size=16, max_num_batched_tokens=8)  # (the same chunks: the same rounding)
    got, ref = spec.generate([repetitive], params)[0], chunked.generate([repetitive], params)[0]
    assert got.token_ids == ref.token_ids and got.prompt_logprobs == ref.prompt_logprobs
    stop = plain.generate([repetitive], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    text = stop.outputs[0].text
    s = spec.engine.speculator
    before = s.num_accepted_tokens
    if len(text) > 6:
        out = spec.generate([repetitive], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[text[3:6]]))[0]
        assert out.text == text[: text.index(text[3:6])]
        assert s.num_accepted_tokens - before <= len(out.token_ids)


# -- the default model and the CLI ------------------------------------------------------------------
def test_default_model_greedy_identical(default_llm) -> None:
    """Prompt lookup on SmolLM2-135M: greedy tokens identical to decoding without speculation on the
    core-engine prompts, a copy task and a JSON extraction, drafting all it may; choosing for a
    CPU's row cost, the copy task alone accepts most of its drafts."""
    from test_default_model import CHAT_PROMPTS, PLAIN_PROMPTS

    paragraph = ("Our team meets every Monday morning to plan the work of the week. Each person shares what they finished, what they are "
                 "working on, and anything that is blocking them. The meeting should take no more than thirty minutes.")
    copy = default_llm.chat_prompt([{"role": "user", "content": f"Repeat this paragraph exactly:\n\n{paragraph}"}])
    prompts = [default_llm.tokenizer.encode(p) for p in PLAIN_PROMPTS] + [default_llm.chat_prompt(m) for m in CHAT_PROMPTS] + [copy]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    spec = LLM(progress=False, speculative_config={"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1})
    _always_draft(spec)
    assert _outputs(spec, prompts, params) == _outputs(default_llm, prompts, params)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}}, "required": ["name", "city"],
              "additionalProperties": False}
    extract = default_llm.chat_prompt([{"role": "user", "content": "Extract the name and the city as JSON: Margaret Hamilton lives in Boston."}])
    constrained = SamplingParams(temperature=0, max_tokens=40, json_schema=schema)
    assert _outputs(spec, [extract], constrained) == _outputs(default_llm, [extract], constrained)
    s = spec.engine.speculator
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    s.row_cost = 0.4  # what a row costs on a 2-core CPU (the measured value moves with the machine's load)
    drafted, accepted = s.num_draft_tokens, s.num_accepted_tokens
    assert _outputs(spec, [copy], SamplingParams(temperature=0, max_tokens=80)) == _outputs(default_llm, [copy], SamplingParams(temperature=0, max_tokens=80))
    assert s.num_accepted_tokens - accepted > 25 and s.num_accepted_tokens - accepted > (s.num_draft_tokens - drafted) / 2


def test_cli_speculative_config(paths) -> None:
    from test_cli import run_cli

    args = ("generate", "-m", paths["gqa"], "-t", "0", "-n", "24", "--ignore-eos", "--quiet", "a b c a b c a b")
    plain = run_cli(*args)
    spec = run_cli(*args, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}')
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and plain.stdout.strip()
    bad = run_cli(*args, "--speculative-config", '{"method": "ngram"}')
    assert bad.returncode == 1 and bad.stderr.startswith("error: speculative_config num_speculative_tokens") and "Traceback" not in bad.stderr
