"""Bad input to the Python API and the CLI ends in one clear FasterLlamaError naming the parameter
(and, on the command line, one `error:` line without a traceback), never a raw TypeError, an
IndexError or a silently wrong result; non-UTF-8 input still gives a prompt. Tiny random model."""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tiny_models as tm
import torch

from fasterllama import LLM, SamplingParams
from fasterllama.cli import main
from fasterllama.errors import FasterLlamaError

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny GQA model (context 512, vocabulary 320) with a minimal chat template."""
    path = str(tmp_path_factory.mktemp("tiny_gqa"))
    tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["gqa"]), path)
    tm.add_chat_template(path, TEMPLATE)
    return path


@pytest.fixture(scope="module")
def llm(model_path: str) -> LLM:
    return LLM(model=model_path, progress=False)


def run_cli(*args: str | bytes, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """`fasterllama ARGS` in a subprocess; bytes in and out (stdin may be invalid UTF-8)."""
    proc = subprocess.run([sys.executable, "-m", "fasterllama", *args], check=False, input=stdin, capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc.stdout, proc.stderr = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    return proc


def one_error_line(stderr: str, *fragments: str) -> None:
    """stderr ends in a single `error: ...` line holding every fragment, with no traceback."""
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), stderr
    for fragment in fragments:
        assert fragment in last, last


# -- 1-3: prompts ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompts,fragment",
    [
        ({"a": 1}, "no other keys"),  # generated from its key "a" before
        (None, "got None"),
        (5, "got int"),
        (b"hi", "decode bytes"),
        (["hi", 5], "mix token ids with strings or lists"),
        ([5, "hi"], "mix token ids with strings or lists"),
        ([[5, 6], 7], "mix token ids with strings or lists"),  # (was "got [5, 6] (list) at position 0")
        (["ok", [5, 400]], "prompt 1 of 2: token id 400"),
        (["hi", None], "prompt 1 must be a string or a list of token ids, got None"),
        ([1.5, 2], "integer token ids"),  # was truncated to [1, 2]
        ([True, 2], "integer token ids"),
        ([[3, 4], [np.float32(1.0)]], "integer token ids"),
        (torch.tensor([1.0, 2.0]), "integer token ids"),
        ([3, 400], "token id 400 (position 1 of prompt) is outside the vocabulary (0..319)"),
        ([[]], "empty"),
        ("\udcff hi", "not valid Unicode"),  # a lone surrogate: the tokenizer raised TypeError
    ],
)
def test_bad_prompts_are_one_clear_error(llm: LLM, prompts: object, fragment: str) -> None:
    with pytest.raises(FasterLlamaError) as info:
        llm.generate(prompts, GREEDY)
    assert fragment in str(info.value)
    assert not llm.engine.has_unfinished()


def test_integer_like_token_ids_are_accepted(llm: LLM) -> None:
    want = llm.generate([5, 3, 7], GREEDY)[0]
    for ids in ([np.int64(5), torch.tensor(3), 7], (5, 3, 7), np.array([5, 3, 7]), torch.tensor([5, 3, 7])):
        got = llm.generate(ids, GREEDY)
        assert len(got) == 1 and got[0].prompt_token_ids == [5, 3, 7] and got[0].token_ids == want.token_ids
    batch = llm.generate(["hello", [5, 3, 7]], GREEDY)
    assert [o.prompt_token_ids for o in batch][1] == [5, 3, 7] and batch[1].token_ids == want.token_ids
    assert llm.generate([], GREEDY) == []
    assert "".join(llm.stream([5, 3, 7], GREEDY)) == want.text


def test_bad_params_and_stream_prompts(llm: LLM) -> None:
    with pytest.raises(FasterLlamaError, match="params must be a SamplingParams"):
        llm.generate("hi", {"temperature": 0})
    with pytest.raises(FasterLlamaError, match="params must be a SamplingParams or a list of them"):
        llm.generate(["a", "b"], [GREEDY, None])
    with pytest.raises(FasterLlamaError, match="got None"):
        list(llm.stream(None, GREEDY))
    with pytest.raises(FasterLlamaError, match="stream takes one prompt"):
        list(llm.stream(["a", "b"], GREEDY))
    for params in (SamplingParams(n=2), SamplingParams(beam_width=2)):  # (it streamed one plain sample)
        with pytest.raises(FasterLlamaError, match="n must be 1 and beam search does not stream"):
            llm.stream("hi", params)


def test_seeds_span_int64_and_wrap(llm: LLM) -> None:
    """Any int64 seed is taken (OpenAI's range: the largest were refused, to leave room for
    seed + n - 1); sample k draws with seed + k wrapped into int64."""
    params = lambda seed, n: SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=6, ignore_eos=True)  # noqa: E731
    two = [o.token_ids for o in llm.generate([[5, 6, 7]], params(2**63 - 1, 2))[0].outputs]
    assert two[0] == llm.generate([[5, 6, 7]], params(2**63 - 1, 1))[0].outputs[0].token_ids
    assert two[1] == llm.generate([[5, 6, 7]], params(-(2**63), 1))[0].outputs[0].token_ids != two[0]


def test_stream_never_read_costs_nothing(llm: LLM) -> None:
    """A stream is queued when first read: one made and dropped is not decoded by the next call."""
    engine = llm.engine
    stream = llm.stream([5, 3, 7], SamplingParams(max_tokens=200, ignore_eos=True))
    assert not engine.has_unfinished()
    steps = []
    real_step = engine.step
    engine.step = lambda: steps.append(1) or real_step()  # type: ignore[method-assign]
    try:
        llm.generate([[7, 8]], SamplingParams(temperature=0, max_tokens=2))
    finally:
        engine.step = real_step  # type: ignore[method-assign]
    assert len(steps) <= 3
    reader = iter(stream)
    assert next(reader) and engine.has_unfinished()
    reader.close()  # (abandoned: aborted)
    assert not engine.has_unfinished() and engine.blocks.num_used == 0 and stream.output.finish_reason == "abort"


def test_min_tokens_holds_stop_strings_back(llm: LLM) -> None:
    """No stop string ends a sequence before min_tokens (as EOS and stop ids), as in vLLM; one
    whose text ended before min_tokens is not found later."""
    free = llm.generate([[5, 3, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    first = llm.tokenizer.decode(free.token_ids[:1])
    assert first
    stop = first[-1]
    cut = llm.generate([[5, 3, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert len(cut.token_ids) == 1 and cut.finish_reason == "stop"
    held = llm.generate([[5, 3, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop], min_tokens=4))[0]
    assert len(held.token_ids) >= 4 and held.token_ids[:4] == free.token_ids[:4]
    assert held.text.startswith(llm.tokenizer.decode(free.token_ids[:3]))


# -- 4: SamplingParams -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"temperature": "0.5"}, "temperature must be a finite number >= 0"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"max_tokens": -5}, "max_tokens must be an integer >= 1"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10.0}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": 2**40}, "top_k"),
        ({"top_p": 0}, "top_p must be a number in (0, 1]"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": "0"}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"frequency_penalty": None}, "frequency_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"best_of": 2}, "best_of other than n is not supported"),
        ({"logits_processors": [abs]}, "logits_processors are not supported"),
        ({"min_tokens": 300}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop": 5}, "stop must be a string, a list of strings or None"),
        ({"stop": [""]}, "stop must be a list of non-empty strings"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [2.0]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos must be True or False"),
        ({"logprobs": 21}, "logprobs must be an integer in [0, 20]"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": 50}, "prompt_logprobs"),
        ({"n": 0}, "n must be an integer >= 1"),
        ({"n": 1.0}, "n must be"),
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 2, "n": 3}, "cannot exceed beam_width"),
        ({"beam_width": 2, "logprobs": 1}, "do not combine with beam search"),
        ({"beam_width": 2, "prompt_logprobs": 0}, "do not combine with beam search"),
        ({"beam_width": 2, "repetition_penalty": 1.3}, "do not combine with beam search"),
        ({"beam_width": 2, "presence_penalty": 0.5}, "do not combine with beam search"),
        ({"beam_width": 2, "frequency_penalty": -0.5}, "do not combine with beam search"),
        ({"length_penalty": math.nan}, "length_penalty"),
        ({"length_penalty": "1"}, "length_penalty"),
        ({"early_stopping": 1}, "early_stopping"),
        ({"early_stopping": "always"}, "early_stopping"),
        ({"diversity_rate": -1}, "diversity_rate"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
    ],
)
def test_sampling_params_checks_every_field(kwargs: dict, fragment: str) -> None:
    with pytest.raises(FasterLlamaError) as info:
        SamplingParams(**kwargs)
    assert fragment in str(info.value)


def test_sampling_params_valid_values_still_work() -> None:
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"] and SamplingParams(stop_token_ids=None).stop_token_ids == []
    p = SamplingParams(max_tokens=np.int64(8), temperature=0, top_k=np.int32(5), top_p=np.float32(0.5), seed=-3, logprobs=0,
                       prompt_logprobs=20, stop_token_ids=(np.int64(2),), early_stopping="never", min_tokens=8)
    assert p.greedy and type(p.max_tokens) is int and p.max_tokens == 8 and type(p.top_k) is int and p.top_p == 0.5
    assert p.stop_token_ids == [2] and type(p.stop_token_ids[0]) is int and p.seed == -3
    assert SamplingParams(beam_width=4, n=4, early_stopping=True, length_penalty=-0.5).n == 4
    assert SamplingParams(temperature=2, presence_penalty=-2, frequency_penalty=2, min_p=1, top_p=1).temperature == 2.0
    assert SamplingParams(top_k=-1).top_k == 0  # (vLLM's "off")


def test_params_set_after_they_are_made_apply(llm: LLM) -> None:
    """vLLM scripts set fields on a SamplingParams after making it: a constraint given as
    structured_outputs then was dropped (free text), max_tokens = None or stop = None raised a
    TypeError deep in the engine; each request now checks a copy made anew. Beam-search outputs
    carry request ids (they were empty) and vLLM's prompt dicts are importable."""
    from fasterllama import StructuredOutputsParams, TextPrompt, TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=8)
    params.structured_outputs = StructuredOutputsParams(choice=["yes", "no"])
    assert llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), params)[0].text in ("yes", "no")
    assert params.structured_outputs is not None  # (it reads back as given)
    free = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    free.max_tokens, free.stop = None, None
    out = llm.generate([[5, 6, 7] * 160], free)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == llm.engine.max_model_len - 480
    assert llm.generate(TextPrompt(prompt="hi"), SamplingParams(max_tokens=1))[0].prompt == "hi"
    beams = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(beam_width=2, n=2, temperature=0, max_tokens=3))
    assert all(b.request_id for b in beams) and beams[0].request_id != beams[1].request_id
    # vLLM's keywords that ask nothing different here are taken; stop_token_ids are checked as the other ids are
    from fasterllama import BeamSearchParams

    quiet = SamplingParams(best_of=2, n=2, logits_processors=[], output_kind=2, extra_args={"x": 1}, max_tokens=2, seed=1)
    assert len(llm.generate([[5, 6, 7]], quiet)[0].outputs) == 2
    assert len(llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=None, concurrency_limit=4)[0].sequences) == 2
    assert llm.reset_prefix_cache() is True
    with pytest.raises(FasterLlamaError, match="stop_token_ids has token id 100000, outside the vocabulary"):
        llm.generate([[5, 6, 7]], SamplingParams(stop_token_ids=[100000]))


# -- 5, 8: LLM arguments -----------------------------------------------------------------------
def test_llm_arguments(model_path: str) -> None:
    for bad in (123, b"/some/model", ["model"]):
        with pytest.raises(FasterLlamaError, match="model must be a path or a known model name"):
            LLM(bad, progress=False)
    with pytest.raises(FasterLlamaError) as info:
        LLM(model=model_path, max_model_len=100_000, progress=False)
    assert "100000" in str(info.value) and "512" in str(info.value)
    assert LLM(model=pathlib.Path(model_path), max_model_len=512, progress=False).engine.max_model_len == 512
    for kwargs, fragment in (({"enable_prefix_caching": "false"}, "enable_prefix_caching must be True or False"),
                             ({"progress": "no"}, "progress must be True or False"), ({"dtype": ["x"]}, "unknown dtype"),
                             ({"kv_cache_memory": "1000TiB"}, "kv_cache_memory of 1024000.0 GiB exceeds"),
                             ({"max_logprobs": 50}, "max_logprobs=50 is not supported here")):
        with pytest.raises(FasterLlamaError, match=fragment):
            LLM(model=model_path, **{"progress": False, **kwargs})
    llm = LLM(model=model_path, dtype="float", enable_prefix_caching=None, max_logprobs=20, progress=False)  # (vLLM's spellings)
    assert llm.engine.dtype == torch.float32 and llm.engine.blocks.prefix_caching


def test_kv_cache_size_checked_before_the_load(model_path: str, monkeypatch) -> None:
    """A KV cache that cannot fit, or no size at all, fails before the weights load (a 1.1B model
    took 50-90 s to load before saying so)."""
    import fasterllama.engine.llm_engine as le

    monkeypatch.setattr(le, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    for size, fragment in (("1000TiB", "exceeds the"), ("lots", "is not a size")):
        with pytest.raises(FasterLlamaError, match=fragment):
            LLM(model=model_path, kv_cache_memory=size, progress=False)


# -- 6: chat messages --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "messages,fragment",
    [
        ([{"role": "user"}], "message 0 (user) has no 'content'"),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": None}], "message 1 (user) has no 'content'"),  # (None: not set, as transformers reads it)
        ([{"role": "user", "content": ["hi"]}], "content must be a string (or a list of text parts), got list"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "content parts of type 'image_url' are not supported (text only)"),
        ([{"role": 5, "content": "hi"}], "role must be a non-empty string"),  # (any name: the template decides, as in transformers)
        ([{"content": "hi"}], "role must be a non-empty string"),
        ([{"role": "user", "content": "hi"}, "hi"], "message 1 must be a dict"),
        ([[{"role": "user", "content": "hi"}], []], "at least one message"),
        ({"role": "user", "content": "hi"}, "messages must be a list"),
        ("hi", "messages must be a list"),
        ([{"role": "user", "content": "\ud800"}], "not valid Unicode"),
    ],
)
def test_bad_chat_messages(llm: LLM, messages: object, fragment: str) -> None:
    with pytest.raises(FasterLlamaError) as info:
        llm.chat(messages, GREEDY)
    assert fragment in str(info.value)


def test_good_chat_matches_its_template(llm: LLM) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = llm.tokenizer.encode("<s>system\nbe brief</s>\n<s>user\nhi</s>\n<s>assistant\n", add_special_tokens=False)
    assert llm.chat_prompt(messages) == ids
    assert llm.chat(messages, GREEDY)[0].token_ids == llm.generate(ids, GREEDY)[0].token_ids
    # vLLM's spellings: content parts, the developer role, sampling_params=, add_generation_prompt, get_tokenizer()
    parts = [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}, {"role": "user", "content": "hi"}]  # (parts join by "\n")
    assert llm.chat(parts, sampling_params=GREEDY)[0].token_ids == llm.generate(ids, sampling_params=GREEDY)[0].token_ids
    assert llm.chat_prompt(messages, add_generation_prompt=False) == ids[: -len(llm.tokenizer.encode("<s>assistant\n", add_special_tokens=False))]
    assert llm.get_tokenizer() is llm.tokenizer
    with pytest.raises(FasterLlamaError, match="not both"):
        llm.generate("hi", GREEDY, sampling_params=GREEDY)


# -- 7: compute_logits -------------------------------------------------------------------------
def test_compute_logits_checks_ids(llm: LLM) -> None:
    with pytest.raises(FasterLlamaError, match=r"token id 320 \(position 1 of token_ids\) is outside the vocabulary \(0..319\)"):
        llm.compute_logits([1, 320])
    with pytest.raises(FasterLlamaError, match="outside the vocabulary"):
        llm.compute_logits([-1])
    with pytest.raises(FasterLlamaError, match="integer token ids"):
        llm.compute_logits([1, 2.5])
    with pytest.raises(FasterLlamaError, match="token_ids must be a list of token ids, got str"):
        llm.compute_logits("hello")
    assert torch.equal(llm.compute_logits(np.array([1, 2, 3])), llm.compute_logits([1, 2, 3]))


# -- 8-10: the command line --------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,fragments",
    [
        (["--temperature", "nan"], ["temperature"]),
        (["--temperature", "inf"], ["temperature"]),
        (["--top-p", "0"], ["top_p"]),
        (["--max-tokens", "-3"], ["max_tokens"]),
        (["--max-model-len", "100000"], ["100000", "512"]),
    ],
)
def test_cli_errors_are_one_line(model_path: str, capsys: pytest.CaptureFixture, args: list[str], fragments: list[str]) -> None:
    assert main(["generate", "-q", "--model", model_path, *args, "hi"]) == 1
    one_error_line(capsys.readouterr().err, *fragments)


def test_cli_debug_after_the_subcommand(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    missing = str(tmp_path / "nope")
    assert main(["generate", "--model", missing, "hi"]) == 1  # no --debug: one line
    one_error_line(capsys.readouterr().err, "no such model")
    for argv in (["--debug", "generate", "--model", missing, "hi"], ["generate", "--debug", "--model", missing, "hi"]):
        with pytest.raises(FasterLlamaError, match="no such model"):  # --debug re-raises: the traceback
            main(argv)
    proc = run_cli("generate", "--model", missing, "--debug", "hi")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_cli_non_utf8_stdin_and_argv(llm: LLM, model_path: str) -> None:
    flags = ["-q", "--model", model_path, "-t", "0", "-n", "4", "--ignore-eos"]
    want = llm.generate("\ufffd\ufffd hi", GREEDY)[0].text + "\n"
    proc = run_cli("generate", *flags, "-", stdin=b"\xff\xfe hi")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == want
    proc = run_cli("generate", *flags, b"\xff\xfe hi")  # undecodable bytes in argv too
    assert proc.returncode == 0 and proc.stdout == want, proc.stderr
    chat = run_cli("chat", *flags, stdin=b"a\xff b\n")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == llm.chat([{"role": "user", "content": "a\ufffd b"}], GREEDY)[0].text + "\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="says what happens without a GPU")
def test_a_cuda_device_without_a_gpu_is_named() -> None:
    """`--device cuda:3` without a GPU names the device asked for (it said 'cuda')."""
    from fasterllama.engine.llm_engine import resolve_device

    for device in ("cuda", "cuda:3"):
        with pytest.raises(FasterLlamaError, match=f"device '{device}' requested but no CUDA GPU"):
            resolve_device(device)
