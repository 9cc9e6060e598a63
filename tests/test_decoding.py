"""Decoding with real models: packed mixed-length batches, seeded determinism, n samples,
logprobs, beam search against HF, and the finish conditions."""

from __future__ import annotations

import json
import os

import pytest
import tiny_models as tm
import torch
from conftest import decode_tolerance, rows_tolerance

from fasterllama import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring, then by punched cards, then by assembly language, and finally by high-level "
    "languages that let people describe what they wanted rather than how to do it. Each layer "
    "hid the details of the one below, and each made programmers more productive. "
) * 6


def mixed_prompts(llm: LLM) -> list[list[int]]:
    ids = llm.tokenizer.encode(TEXT)
    lengths = [3, 200, 17, 64, 5, 120, 33, 90]
    return [ids[i : i + n] for i, n in zip(range(0, 80, 10), lengths)]


def test_mixed_length_batch_equals_alone(default_llm):
    prompts = mixed_prompts(default_llm)
    assert min(map(len, prompts)) == 3 and max(map(len, prompts)) == 200
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = default_llm.generate(prompts, params)
    for prompt, out in zip(prompts, batched):
        alone = default_llm.generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids
        assert out.prompt_token_ids == prompt  # the prompt is not part of the output


def test_finished_sequences_leave_the_batch(default_llm):
    prompts = mixed_prompts(default_llm)[:4]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 9, 4, 6)]
    outs = default_llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [2, 9, 4, 6]
    assert all(o.finish_reason == "length" for o in outs)
    for prompt, p, out in zip(prompts, params, outs):
        assert default_llm.generate([prompt], p)[0].token_ids == out.token_ids


def test_seeded_request_is_independent_of_its_batch(default_llm):
    target = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=1234, ignore_eos=True)
    alone = default_llm.generate(["Tell me a story about a cat."], target)[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True) for n in (3, 12, 7)]
    prompts = ["Hello", "Tell me a story about a cat.", "def f(x):", "A long time ago in a galaxy far, far away"]
    outs = default_llm.generate(prompts, [others[0], target, others[1], others[2]])
    assert outs[1].token_ids == alone
    assert default_llm.generate(["Tell me a story about a cat."] * 3, target)[2].token_ids == alone
    different = default_llm.generate(["Tell me a story about a cat."], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=99, ignore_eos=True))[0]
    assert different.token_ids != alone


def test_n_samples_are_distinct_and_reproducible(default_llm):
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=7, ignore_eos=True)
    out = default_llm.generate(["My favourite colour is"], params)[0]
    assert len(out.outputs) == 3
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    again = default_llm.generate(["My favourite colour is"], params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_logprobs_equal_log_softmax_of_logits(default_llm):
    ids = default_llm.tokenizer.encode("The quick brown fox")
    out = default_llm.generate([ids], SamplingParams(temperature=0.9, max_tokens=6, logprobs=3, prompt_logprobs=2, seed=3, ignore_eos=True))[0]
    ref = torch.log_softmax(default_llm.compute_logits(ids + out.token_ids), dim=-1)
    assert len(out.logprobs) == len(out.token_ids)
    total, tol = 0.0, decode_tolerance()  # decode steps against the prompt's forward
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(ids) - 1 + i]
        assert abs(lp[tok] - row[tok].item()) < tol
        top = row.topk(3)
        for v, t in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(lp[t] - v) < tol
        total += row[tok].item()
    assert abs(out.cumulative_logprob - total) < len(out.token_ids) * tol
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    prompt_tol = rows_tolerance(len(ids), default_llm.config.hidden_size)  # (a 4-token prompt: the GEMVs' rows)
    for i in range(1, len(ids)):
        assert abs(out.prompt_logprobs[i][ids[i]] - ref[i - 1, ids[i]].item()) < prompt_tol


def test_min_tokens_and_stop_token_ids(default_llm):
    chat = default_llm.chat_prompt([{"role": "user", "content": "What is 2+2?"}])
    short = default_llm.generate([chat], SamplingParams(temperature=0, max_tokens=64))[0]
    assert short.finish_reason == "stop"
    n = len(short.token_ids)
    longer = default_llm.generate([chat], SamplingParams(temperature=0, max_tokens=80, min_tokens=n + 3))[0]
    assert len(longer.token_ids) >= n + 3
    assert not set(longer.token_ids[: n + 2]) & set(default_llm.config.eos_token_ids)
    stop_id = short.token_ids[1]
    cut = default_llm.generate([chat], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]))[0]
    assert cut.token_ids == short.token_ids[:2] and cut.finish_reason == "stop"


def test_logit_bias_and_allowed_token_ids(tiny_beam_model):
    """OpenAI's logit_bias (added to the logits before sampling; -100 bans, +100 forces) and vLLM's
    allowed_token_ids, greedy and sampled, each row its own beside plain rows in one batch; the
    logprobs stay the model's; ids outside the vocabulary are errors."""
    from fasterllama.errors import FasterLlamaError

    _, llm, prompt, eos = tiny_beam_model
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    plain = llm.generate([prompt], greedy)[0]
    first = plain.token_ids[0]
    logits = llm.compute_logits(prompt)[-1]
    second = int(logits.masked_fill(torch.arange(logits.shape[0]) == first, float("-inf")).argmax())
    banned, forced, allowed, same = llm.generate(
        [prompt] * 4,
        [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={first: -100}, logprobs=1),
         SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True, logit_bias={77: 100}),
         SamplingParams(temperature=1.0, seed=2, max_tokens=24, ignore_eos=True, allowed_token_ids=[40, 41, 42]),
         greedy])
    assert banned.token_ids[0] == second and first not in banned.token_ids
    assert banned.logprobs[0][second] == pytest.approx(torch.log_softmax(logits, -1)[second].item(), abs=1e-4)  # (the model's)
    assert forced.token_ids == [77] * 8
    assert set(allowed.token_ids) <= {40, 41, 42} and len(set(allowed.token_ids)) > 1
    assert same.token_ids == plain.token_ids
    for bad, message in (({"logit_bias": {10**6: 1.0}}, "outside the vocabulary"), ({"allowed_token_ids": [320]}, "outside the vocabulary"),
                         ({"allowed_token_ids": []}, "must not be empty"), ({"logit_bias": {1: float("inf")}}, "finite"),
                         ({"logit_bias": {1: 1.0}, "beam_width": 2}, "beam search"),
                         ({"allowed_token_ids": [eos, 7], "stop_token_ids": [7], "min_tokens": 1}, "no token could be drawn")):
        with pytest.raises(FasterLlamaError, match=message):
            llm.generate([prompt], SamplingParams(max_tokens=2, **bad))
    ends = llm.generate([prompt], SamplingParams(max_tokens=2, allowed_token_ids=[eos], min_tokens=0))[0]  # (no min_tokens: the end token)
    assert ends.token_ids == [eos] and ends.finish_reason == "stop"


def test_vllm_spellings_and_stop_rules(tiny_beam_model):
    """vLLM's behaviours a ported script relies on: the token that ends a sequence (a stop token
    id) keeps its id but not its text, unless include_stop_str_in_output, and stop_reason names it
    (or the stop string); Logprob objects (.logprob, .rank, .decoded_token) that are also floats;
    {"prompt": ...} / {"prompt_token_ids": ...} prompts; max_tokens=None runs to the context;
    seed=-1 is no seed; bad_words; LLM(seed=) repeats unseeded samples; clone, truncate_prompt_tokens,
    detokenize=False, use_tqdm; threads take turns (they crashed inside attention)."""
    import threading

    from fasterllama import Logprob
    from fasterllama.errors import FasterLlamaError

    _, llm, prompt, _ = tiny_beam_model
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    stop_id = free.token_ids[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id]))[0].outputs[0]
    first = free.token_ids.index(stop_id)
    assert out.token_ids == free.token_ids[: first + 1] and out.stop_reason == stop_id and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(free.token_ids[:first])
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id],
                                                 include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text.startswith(out.text) and kept.stop_reason == stop_id  # (the stop token's text after it, where it has a whole character)
    stop = free.text[2:4]
    cut, kept = (llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop], include_stop_str_in_output=inc))[0].outputs[0]
                 for inc in (False, True))
    assert (cut.text, kept.text, cut.stop_reason) == (free.text[:2], free.text[:4], stop)
    whole = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop]))[0]
    assert (whole.stop_reason, free.stop_reason) == (stop, None)  # (the best output's, as .text is)
    lp = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2, logprobs=3))[0].logprobs[0]
    top = max(lp, key=lambda t: lp[t])
    assert isinstance(lp[top], Logprob) and lp[top].rank == 1 and lp[top].logprob == float(lp[top]) and lp[top].decoded_token == llm.tokenizer.decode([top])
    assert sorted(v.rank for v in lp.values()) == list(range(1, len(lp) + 1))
    text = llm.tokenizer.decode(prompt)
    assert llm.generate([{"prompt": text}], SamplingParams(temperature=0, max_tokens=3), True)[0].prompt == text
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(prompt) + len(full.token_ids) == llm.engine.max_model_len
    assert SamplingParams(seed=-1).seed is None and SamplingParams(n=2).clone() == SamplingParams(n=2)
    word = llm.tokenizer.decode(free.token_ids[1:3])
    ids = llm.tokenizer.encode(word, add_special_tokens=False)
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word]))[0].token_ids
    assert banned[0] == free.token_ids[0] and not any(banned[i : i + len(ids)] == ids for i in range(len(banned)))
    short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=4, detokenize=False, logprobs=1))[0]
    assert short.prompt_token_ids == prompt[-4:] and short.text == "" and len(short.token_ids) == 3
    assert all(v.decoded_token is None for step in short.logprobs for v in step.values())  # (vLLM's: no text without detokenize)
    bars: list[dict] = []
    fits = llm.generate([prompt * 40], SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1),  # (-1: what the context holds)
                        use_tqdm=lambda **kw: bars.append(kw) or __import__("tqdm").tqdm(disable=True, **kw))[0]
    assert fits.prompt_token_ids == (prompt * 40)[-(llm.engine.max_model_len - 1):] and bars[0]["total"] == 1  # (a callable makes the bar, as vLLM's)
    with pytest.raises(FasterLlamaError, match="truncate_prompt_tokens must be -1"):
        SamplingParams(truncate_prompt_tokens=0)
    long = prompt * 40  # (past the context: truncated first, then checked)
    beams, sampled = (llm.generate([long], SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=5, **b))[0]
                      for b in ({"beam_width": 2}, {}))
    assert beams.prompt_token_ids == sampled.prompt_token_ids == long[-5:]
    for ending in ({"stop_token_ids": [stop_id]}, {"stop": [stop]}):  # beams end as sampled sequences do
        for inc in (False, True):
            beam = llm.generate([prompt], SamplingParams(beam_width=2, max_tokens=8, ignore_eos=True, include_stop_str_in_output=inc, **ending))[0].outputs[0]
            want = stop_id if "stop_token_ids" in ending else stop
            if beam.finish_reason == "stop":
                assert beam.stop_reason == want and (want in beam.token_ids if isinstance(want, int) else (stop in beam.text) == inc), (ending, inc, beam)
    sampled = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    runs = [LLM(llm.engine.model_path, progress=False, seed=5, gpu_memory_utilization=0.5).generate([prompt], sampled)[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1]  # (gpu_memory_utilization: taken, and on the CPU the cache keeps its default)
    with pytest.raises(FasterLlamaError, match="gpu_memory_utilization must be a number in"):
        LLM(llm.engine.model_path, progress=False, gpu_memory_utilization=1.5)
    eager = LLM(llm.engine.model_path, progress=False, enforce_eager=True, trust_remote_code=True)  # (vLLM scripts pass them)
    assert (eager.engine.runner.decode_plan is None) == (llm.engine.runner.decode_plan is None)  # the CPU's one-call decode is no graph: kept
    assert eager.generate([prompt], greedy_params := SamplingParams(temperature=0, max_tokens=6))[0].token_ids == llm.generate([prompt], greedy_params)[0].token_ids
    results: dict[int, list[int]] = {}
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, llm.generate([prompt], greedy)[0].token_ids)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert list(results.values()) == [llm.generate([prompt], greedy)[0].token_ids] * 3


# -- beam search --------------------------------------------------------------------------------
BEAM_CASES = [(1.0, False), (0.6, True), (2.0, "never"), (-0.5, False)]


def _hf_beam(model, ids, n_new, length_penalty, early_stopping, eos):
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), num_beams=4, do_sample=False,
        max_new_tokens=n_new, length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
        pad_token_id=0, num_return_sequences=1,
    )
    return out[0, len(ids):].tolist()


def _same_beam(ref: list[int], ours: list[int]) -> bool:
    """HF pads a shorter best beam; compare up to our length and require padding after it."""
    return ref[: len(ours)] == ours and all(t == 0 for t in ref[len(ours):])


@pytest.fixture(scope="module")
def tiny_beam_model(tmp_path_factory):
    """A tiny random model whose EOS is a token it emits often, so beams end at many lengths."""
    torch.set_num_threads(1)
    spec = tm.SPECS["gqa"]
    model = tm.build_hf_model(spec)
    prompt = list(range(10, 26))
    greedy = tm.hf_greedy(model, prompt, 24)
    eos = max(set(greedy), key=greedy.count)
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    folder = tm.save_hf_checkpoint(model, str(tmp_path_factory.mktemp("beam") / "hf"))
    yield model, LLM(folder, progress=False), prompt, eos
    torch.set_num_threads(2)


@pytest.mark.parametrize("length_penalty,early_stopping", BEAM_CASES)
def test_beam_search_matches_hf_tiny(tiny_beam_model, length_penalty, early_stopping):
    model, llm, prompt, eos = tiny_beam_model
    finished_early = 0
    for p in (prompt, prompt[3:11], [40, 41, 42]):
        ref = _hf_beam(model, p, 24, length_penalty, early_stopping, eos)
        out = llm.generate([p], SamplingParams(beam_width=4, max_tokens=24, length_penalty=length_penalty, early_stopping=early_stopping))[0]
        assert _same_beam(ref, out.token_ids), (ref, out.token_ids)
        finished_early += out.finish_reason == "stop"
    if length_penalty <= 1.0:  # (a large penalty rightly prefers beams that run to max_tokens)
        assert finished_early >= 1  # EOS really took part


def test_beam_search_returns_ranked_beams(tiny_beam_model):
    _, llm, prompt, _ = tiny_beam_model
    out = llm.generate([prompt], SamplingParams(beam_width=4, n=4, max_tokens=10))[0]
    assert len(out.outputs) == 4
    scores = [o.cumulative_logprob / len(o.token_ids) for o in out.outputs]
    assert scores == sorted(scores, reverse=True)
    ref = torch.log_softmax(llm.compute_logits(prompt + out.outputs[0].token_ids), dim=-1)
    true_lp = sum(ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.outputs[0].token_ids))
    assert abs(true_lp - out.outputs[0].cumulative_logprob) < 1e-3
    diverse = llm.generate([prompt], SamplingParams(beam_width=4, n=4, max_tokens=10, diversity_rate=2.0))[0]
    assert [o.token_ids for o in diverse.outputs] != [o.token_ids for o in out.outputs]


def test_beam_search_ends_as_sampling_does(tiny_beam_model):
    """Beams end at stop token ids (ignore_eos or not), at stop strings (their text cut before
    it), and not before min_tokens."""
    _, llm, prompt, eos = tiny_beam_model
    beams = dict(beam_width=4, n=4, max_tokens=24)
    plain = llm.generate([prompt], SamplingParams(**beams))[0]
    assert any(o.finish_reason == "stop" for o in plain.outputs)
    by_id = llm.generate([prompt], SamplingParams(**beams, ignore_eos=True, stop_token_ids=[eos]))[0]
    assert [o.token_ids for o in by_id.outputs] == [o.token_ids for o in plain.outputs]
    long = llm.generate([prompt], SamplingParams(**beams, min_tokens=16))[0]
    assert all(len(o.token_ids) >= 16 and eos not in o.token_ids[:15] for o in long.outputs)
    text = llm.generate([prompt], SamplingParams(**beams, ignore_eos=True))[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = llm.generate([prompt], SamplingParams(**beams, ignore_eos=True, stop=[stop]))[0]
    assert all(stop not in o.text for o in cut.outputs)
    assert cut.outputs[0].finish_reason == "stop" and stop in llm.tokenizer.decode(cut.outputs[0].token_ids)


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_matches_hf_default_model(default_llm, hf_default, length_penalty):
    model, _ = hf_default
    for messages in ([{"role": "user", "content": "What is 2+2?"}], [{"role": "user", "content": "Name a colour."}]):
        ids = default_llm.chat_prompt(messages)
        eos = default_llm.config.eos_token_ids
        ref = _hf_beam(model, ids, 24, length_penalty, False, eos)
        out = default_llm.generate([ids], SamplingParams(beam_width=4, max_tokens=24, length_penalty=length_penalty))[0]
        assert _same_beam(ref, out.token_ids), (ref, out.token_ids)


def test_sequence_token_ids_span_prompt_and_output():
    """The runner takes each step's tokens by position, across the prompt/output boundary too."""
    from fasterllama.engine.sequence import Sequence

    seq = Sequence([11, 12, 13, 14], SamplingParams(), None, 0)
    seq.output_token_ids += [15, 16, 17]
    full = [11, 12, 13, 14, 15, 16, 17]
    assert all(seq.token_ids(a, b) == full[a:b] for a in range(8) for b in range(a, 8))


def test_vllm_script_spellings(tiny_beam_model, tmp_path):
    """What scripts written for vLLM pass: structured_outputs / guided_decoding (a pydantic class as
    the schema too), LLM.beam_search with BeamSearchParams (tokens and text include the prompt's),
    engine options with no effect here (taken) or with one (refused in one line), unknown ones
    (TypeError), lora_request=None, a local tokenizer folder, errors that are ValueErrors, and
    chat outputs whose prompt is the rendered text."""
    import pydantic

    from fasterllama import BeamSearchParams, GuidedDecodingParams, StructuredOutputsParams
    from fasterllama.errors import FasterLlamaError

    _, llm, prompt, _ = tiny_beam_model
    for params in (SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                   SamplingParams(temperature=0, max_tokens=12, guided_decoding=GuidedDecodingParams(regex="(yes|no)"))):
        assert llm.generate([prompt], params)[0].text in ("yes", "no")

    class Answer(pydantic.BaseModel):
        ok: bool

    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=Answer, disable_additional_properties=True))
    assert json.loads(params.constraint[1])["additionalProperties"] is False  # (objects listing their properties: closed anyway)
    assert Answer.model_validate_json(llm.generate([prompt], params)[0].text)
    with pytest.raises(FasterLlamaError, match="give at most one of"):
        SamplingParams(regex="a", structured_outputs=StructuredOutputsParams(choice=["b"]))
    with pytest.raises(ValueError, match="temperature"):  # (FasterLlamaError is a ValueError, as vLLM raises)
        SamplingParams(temperature=-1)

    salted = {"prompt_token_ids": prompt, "multi_modal_data": None, "cache_salt": "user-1"}  # (vLLM prompt keys unset, or with no effect)
    assert llm.generate(salted, greedy0 := SamplingParams(temperature=0, max_tokens=3))[0].token_ids == llm.generate([prompt], greedy0)[0].token_ids
    (beams,) = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=6))
    ref = llm.generate([prompt], SamplingParams(beam_width=3, n=3, max_tokens=6))[0]
    assert [b.tokens for b in beams.sequences] == [prompt + o.token_ids for o in ref.outputs]
    assert [b.cum_logprob for b in beams.sequences] == [o.cumulative_logprob for o in ref.outputs]
    assert beams.sequences[0].text == llm.tokenizer.decode(prompt + ref.outputs[0].token_ids)
    with pytest.raises(FasterLlamaError, match="temperature must be 0"):
        llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7))
    one = [llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=6))[0].sequences[0].tokens for _ in range(3)]
    assert one[0] == one[1] == one[2] == prompt + llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].token_ids  # (it sampled)

    path = llm.engine.model_path
    taken = LLM(path, progress=False, swap_space=4, disable_log_stats=True, kv_cache_dtype="auto", enable_chunked_prefill=True)
    assert taken.generate([prompt], greedy := SamplingParams(temperature=0, max_tokens=4), lora_request=None)[0].token_ids == \
        llm.generate([prompt], greedy)[0].token_ids
    with pytest.raises(FasterLlamaError, match="kv_cache_dtype='fp8' is not supported here"):
        LLM(path, progress=False, kv_cache_dtype="fp8")
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        LLM(path, progress=False, no_such_option=1)
    with pytest.raises(FasterLlamaError, match="not a local folder"):
        LLM(path, progress=False, tokenizer="TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    folder = tmp_path / "tok"  # the model's tokenizer files, with a chat template
    folder.mkdir()
    for name in os.listdir(path):
        if name.startswith(("tokenizer", "special_tokens")):
            (folder / name).write_bytes(open(os.path.join(path, name), "rb").read())
    tm.add_chat_template(str(folder), "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    chatty = LLM(path, progress=False, tokenizer=str(folder))
    out = chatty.chat([{"role": "user", "content": "abc"}], greedy)[0]
    assert out.prompt == "<user>abc" and out.prompt_token_ids == chatty.chat_prompt([{"role": "user", "content": "abc"}])


def test_bad_words_spelled_as_vllm(tiny_beam_model):
    """vLLM's two spellings of a bad word: without its leading spaces, and after one space only
    where that has as many tokens and another first token."""
    _, llm, _, _ = tiny_beam_model
    tok, engine = llm.tokenizer, llm.engine

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    words = [w for w in ("the", "cat", "sat", "mat", "hello", "ab", "on") if ids(w)]
    same = next(w for w in words if len(ids(" " + w)) == len(ids(w)) and ids(" " + w)[0] != ids(w)[0])
    assert engine._bad_words_ids(SamplingParams(bad_words=[same])) == [ids(same), ids(" " + same)]
    assert engine._bad_words_ids(SamplingParams(bad_words=["  " + same])) == [ids(same), ids(" " + same)]  # (leading spaces dropped)
    longer = [w for w in words if len(ids(" " + w)) != len(ids(w))]
    for w in longer:
        assert engine._bad_words_ids(SamplingParams(bad_words=[w])) == [ids(w)]
    assert longer, "the tiny vocabulary spells no word with a space in more tokens"
