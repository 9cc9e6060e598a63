"""Chained decode steps (LLMEngine.chain_steps, on by default where the backend's kernels queue
behind the host): step n+1 is launched with step n's sampled ids, still on the device, before
the host reads them. On the CPU the engine runs them when asked, through the reference ops, so
the bookkeeping is tested here: the same tokens and finish reasons as unchained steps whatever
ends a sequence, requests arriving or aborted mid-chain, blocks all freed."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from fasterllama import SamplingParams
from fasterllama.engine.llm_engine import LLMEngine
from fasterllama.loading.model_loader import load_model

PROMPTS = [[5, 7, 9, 11], [6, 7, 9, 12, 40, 41], [7, 7], [8, 7, 9, 14, 3, 3, 3]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["gqa"]), str(tmp_path_factory.mktemp("chained") / "gqa"))
    return load_model(path, torch.float32, torch.device("cpu"), None, False, progress=False)


def _engine(model, chain: bool, max_model_len: int = 64) -> tuple[LLMEngine, list[int]]:
    """An engine and the row counts of the chained steps it launches."""
    engine = LLMEngine.from_model(model.model, model.tokenizer, max_model_len=max_model_len, max_num_seqs=4)
    engine.chain_steps = chain
    rows: list[int] = []
    launch = engine.runner.execute_chained

    def counted(inputs, tokens, source_rows):
        rows.append(len(source_rows))
        return launch(inputs, tokens, source_rows)

    engine.runner.execute_chained = counted
    return engine, rows


def _run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple[list[int], str]]:
    seqs = [engine.add_request(p, params) for p, params in requests]
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_used == 0
    return [(s.output_token_ids, s.finish_reason) for s in seqs]


def test_chained_steps_give_the_tokens_of_unchained_steps(model) -> None:
    """Greedy and seeded rows, each ending another way: max_tokens, a stop token (its row in the
    step already launched is wasted), the context limit, min_tokens banning the end before it."""
    plain, _ = _engine(model, chain=False, max_model_len=24)
    first = _run(plain, [(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))])[0][0]
    stop = first[3]  # a token the greedy row emits: it ends there
    requests = [
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], ignore_eos=True)),
        (PROMPTS[2], SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True)),  # to the context's end
        (PROMPTS[3], SamplingParams(temperature=0.8, min_p=0.05, seed=4, max_tokens=9, min_tokens=6, stop_token_ids=[first[0]])),
    ]
    want = _run(plain, requests)
    assert want[1] == (first[: first.index(stop) + 1], "stop") and want[2][1] == "length" and len(want[2][0]) == 24 - len(PROMPTS[2])
    chained, rows = _engine(model, chain=True, max_model_len=24)
    assert _run(chained, requests) == want
    assert rows[0] == 4 and len(rows) > 10  # every step after the first decode was chained


@pytest.mark.parametrize("max_tokens,max_model_len", [(5, 64), (50, 12)])
def test_the_next_step_is_launched_before_the_tokens_are_read(model, max_tokens: int, max_model_len: int) -> None:
    """Five tokens, ended by max_tokens or by the context (7 prompt tokens of 12): the prefill's
    token is read at once, each decode step's after the next step's launch, and nothing is
    launched after the step whose token surely ends the sequence."""
    engine, _ = _engine(model, chain=True, max_model_len=max_model_len)
    events: list[str] = []
    launch, later = engine.runner.execute_chained, engine.backend.tokens_later

    def logged_launch(*args):
        events.append("launch")
        return launch(*args)

    def logged_later(tokens):
        read = later(tokens)
        return lambda: (events.append("read"), read())[1]

    engine.runner.execute_chained, engine.backend.tokens_later = logged_launch, logged_later
    (tokens, reason), = _run(engine, [(PROMPTS[3], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))])
    assert len(tokens) == 5 and reason == "length"
    assert events == ["launch", "read"] * 3 + ["read"]


def test_requests_arriving_and_aborted_mid_chain(model) -> None:
    """A request added while steps are chained starts at the next step the scheduler makes and
    gets the tokens it gets alone; an aborted sequence emits nothing more; blocks all freed."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = [_run(_engine(model, chain=False)[0], [(p, greedy)])[0][0] for p in PROMPTS[:3]]
    engine, rows = _engine(model, chain=True)
    a, b = engine.add_request(PROMPTS[0], greedy), engine.add_request(PROMPTS[1], greedy)
    for _ in range(4):
        engine.step()
    late = engine.add_request(PROMPTS[2], greedy)
    engine.step()
    engine.abort(b)
    emitted_after_abort = []
    while engine.has_unfinished():
        emitted_after_abort += [u.seq for u in engine.step() if u.seq is b]
    assert a.output_token_ids == alone[0] and late.output_token_ids == alone[2]
    assert b.finish_reason == "abort" and not emitted_after_abort and b.output_token_ids == alone[1][: len(b.output_token_ids)]
    assert engine.blocks.num_used == 0 and rows


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=4, logprobs=2),
                                    SamplingParams(temperature=0.7, seed=1, max_tokens=4, repetition_penalty=1.3)])
def test_steps_needing_the_tokens_are_not_chained(model, params) -> None:
    """Logprobs and penalties read the tokens before the next step: no chaining, same tokens."""
    engine, rows = _engine(model, chain=True)
    got = _run(engine, [(PROMPTS[0], params), (PROMPTS[1], params)])
    assert not rows and got == _run(_engine(model, chain=False)[0], [(PROMPTS[0], params), (PROMPTS[1], params)])
