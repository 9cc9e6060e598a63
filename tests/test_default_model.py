"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF) against HF transformers on the same file."""

from __future__ import annotations

import pytest
import torch

from fasterllama import SamplingParams

TRICKY_STRINGS = [
    "Hello world",
    " leading space",
    "   three leading spaces and trailing  ",
    "emoji 🤖🎉👩‍👩‍👧 done",
    "中文字符测试，标点。",
    "日本語のテキストと한국어",
    "def f(x):\n\treturn x ** 2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "café naïve façade Ωμέγα",
    "numbers 1234567 and 3.14159, 1e-9",
    "indented digits:\n    42 = 6 *  7\n\t 1 2  3",  # (spaces before a digit: one piece, as SmolLM2's tokenizer splits them)
    "\n\n\nnewlines\r\nand tabs\t\there",
    "ünïcödé ⅞ ∑ ∫ √ ≠",
    "<|endoftext|>special in the middle<|im_end|>",
    "",
]

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello."}],
]


@pytest.mark.parametrize("text", TRICKY_STRINGS)
def test_tokenizer_matches_hf(default_llm, hf_tokenizer, text):
    hf_tok = hf_tokenizer
    ours = default_llm.tokenizer
    hf_ids = hf_tok(text)["input_ids"]
    assert ours.encode(text) == hf_ids
    assert ours.decode(hf_ids) == hf_tok.decode(hf_ids)
    assert ours.decode(hf_ids, skip_special_tokens=True) == hf_tok.decode(hf_ids, skip_special_tokens=True)


def test_chat_template_matches_hf(default_llm, hf_tokenizer):
    hf_tok = hf_tokenizer
    for messages in CHAT_PROMPTS + [CHAT_PROMPTS[0] + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]]:
        for gen in (True, False):
            expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert default_llm.tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False) == expected
        ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert default_llm.chat_prompt(messages) == list(ids)


def test_tokenizer_speaks_transformers(default_llm, hf_tokenizer):
    """What scripts written for vLLM call on llm.get_tokenizer(), as transformers' tokenizer answers
    (apply_chat_template's defaults: ids, no generation prompt)."""
    ours, hf = default_llm.get_tokenizer(), hf_tokenizer
    texts = ["Hello world", "  two\n\nlines 12345 ünï <|im_end|>"]
    assert ours(texts[0]).input_ids == hf(texts[0])["input_ids"] and ours(texts)["input_ids"] == hf(texts)["input_ids"]
    assert ours(texts[1])["attention_mask"] == [1] * len(ours.encode(texts[1]))
    ids = ours.encode(texts[1])
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids) and ours.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])
    assert ours.tokenize(texts[1]) == hf.tokenize(texts[1])
    assert ours.convert_tokens_to_ids(ours.tokenize(texts[1])) == hf.convert_tokens_to_ids(hf.tokenize(texts[1]))
    assert ours.convert_tokens_to_ids(["zzzunk", "Hello"]) == hf.convert_tokens_to_ids(["zzzunk", "Hello"])  # (unknown: the unk id)
    for text in (texts[0], [texts[0], texts[0]]):  # return_tensors="pt": [batch, length] int64 tensors
        got, want = ours(text, return_tensors="pt"), hf(text, return_tensors="pt")
        assert all(torch.equal(got[k], want[k]) for k in ("input_ids", "attention_mask"))
    assert ours.convert_tokens_to_string(ours.tokenize(texts[1])) == hf.convert_tokens_to_string(hf.tokenize(texts[1]))
    assert ours.batch_decode([ids, ids[:3]]) == hf.batch_decode([ids, ids[:3]]) and ours.decode(ids[0]) == hf.decode(ids[0])
    assert len(ours) == len(hf) and ours.get_vocab() == hf.get_vocab()
    assert (ours.eos_token_id, ours.bos_token_id, ours.unk_token_id, ours.pad_token_id) == (hf.eos_token_id, hf.bos_token_id, hf.unk_token_id, hf.pad_token_id)
    assert set(ours.all_special_ids) <= set(hf.all_special_ids) and ours.eos_token_id in ours.all_special_ids
    chat = CHAT_PROMPTS[0]
    want = hf.apply_chat_template(chat)
    assert ours.apply_chat_template(chat) == list(want["input_ids"] if hasattr(want, "keys") else want)


@pytest.fixture(params=["default", "fp32"])
def either_llm(request, default_llm, fp32_llm):
    """The default (the file's 4-bit tensors kept) and the fp32 expansion: both match HF."""
    return default_llm if request.param == "default" else fp32_llm


@pytest.mark.parametrize("prompt", PLAIN_PROMPTS)
def test_logits_match_hf(either_llm, hf_default, prompt):
    default_llm = either_llm
    model, tok = hf_default
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    ours = default_llm.compute_logits(ids)
    assert ours.shape == ref.shape
    assert (ours[-1] - ref[-1]).abs().max().item() < 1e-3
    assert (ours - ref).abs().max().item() < 1e-3


def test_decode_logprobs_match_hf(default_llm, hf_default):
    """Decode steps' log-probabilities (the GEMVs: on AVX2 CPUs with x rounded to int16 per 8
    columns) against HF's forward over the same tokens, within 1e-3 (measured: 6e-4 there, 2e-5
    with fp32 x)."""
    model, tok = hf_default
    for prompt in PLAIN_PROMPTS:
        ids = tok(prompt)["input_ids"]
        out = default_llm.generate([ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0))[0]
        with torch.no_grad():
            ref = model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1].float().log_softmax(-1)
        for i, (tok_id, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert abs(lp[tok_id] - ref[i, tok_id].item()) < 1e-3, (prompt, i)
            assert ref[i].argmax().item() == tok_id


def _hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # (the mask given: a prompt's token 0 is no padding)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("case", range(len(PLAIN_PROMPTS) + len(CHAT_PROMPTS)))
def test_greedy_matches_hf(either_llm, hf_default, case):
    default_llm = either_llm
    model, tok = hf_default
    if case < len(PLAIN_PROMPTS):
        ids = tok(PLAIN_PROMPTS[case])["input_ids"]
    else:
        ids = default_llm.chat_prompt(CHAT_PROMPTS[case - len(PLAIN_PROMPTS)])
    expected = _hf_greedy(model, ids, 16)
    out = default_llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert out.token_ids == expected
    assert out.finish_reason == "length"


def test_batch_equals_single(default_llm):
    prompts = PLAIN_PROMPTS + ["Water boils at", "Write a haiku about rain."]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = default_llm.generate(prompts, params)
    for prompt, out in zip(prompts, batched):
        assert default_llm.generate([prompt], params)[0].token_ids == out.token_ids


def test_chat_stops_at_eos(default_llm):
    out = default_llm.chat(CHAT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=64))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in default_llm.config.eos_token_ids
    assert "<|im_end|>" not in out.text and "4" in out.text


def test_stop_string_truncates_text(default_llm):
    full = default_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop = full.text[5:9]
    out = default_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]


def test_streaming_text_equals_decode(default_llm):
    stream = default_llm.stream("Write three emoji and a Chinese word:", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    deltas = list(stream)
    out = stream.output
    assert "".join(deltas) == out.text
    assert out.text == default_llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)
