"""Structured output (engine/structured.py, llguidance): JSON schemas, regexes and Lark grammars
constrain the sampled tokens; every output parses; constraints compose with sampling, n > 1,
seeds and batching; a bad constraint is a clear error."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("llguidance")

import tiny_models as tm  # noqa: E402

from fasterllama import LLM, SamplingParams  # noqa: E402
from fasterllama.errors import FasterLlamaError  # noqa: E402

TINY_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "n"],
               "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                              "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["gqa"]), str(tmp_path_factory.mktemp("so") / "gqa"))
    return LLM(path, progress=False)


def test_params_take_one_constraint() -> None:
    assert SamplingParams(json_schema={"type": "integer"}).constraint == ("json", '{"type": "integer"}')
    assert SamplingParams(json_object=True).constraint == ("json", '{"type": "object"}')
    listed = {"type": "object", "properties": {"a": {"type": "integer"}}}  # (closed: vLLM's default backend's reading; it invented keys)
    assert SamplingParams(json_schema=listed).constraint == ("json", json.dumps({**listed, "additionalProperties": False}))
    assert SamplingParams(regex="a+").constraint == ("regex", "a+") and SamplingParams().constraint is None
    for kwargs, fragment in (({"regex": "a", "grammar": 'start: "a"'}, "at most one"), ({"json_schema": "{nope"}, "not valid JSON"),
                             ({"json_schema": {"enum": {1, 2}}}, "JSON values only"), ({"json_schema": '{"maximum": NaN}'}, "NaN is not JSON"),
                             ({"choice": []}, "non-empty list of strings"), ({"choice": ["a"], "regex": "a"}, "at most one"),
                             ({"json_schema": "[1]"}, "JSON object"), ({"json_schema": 3}, "dict or its JSON text"),
                             ({"regex": ""}, "non-empty"), ({"json_object": 1}, "True or False"),
                             ({"regex": "a", "beam_width": 2}, "beam search")):
        with pytest.raises(FasterLlamaError, match=fragment):
            SamplingParams(**kwargs)


def test_bad_constraints_are_clear_errors(tiny: LLM) -> None:
    """One line each, with the reason (llguidance's regex errors span lines of caret diagrams of
    its internal grammar, and their reason is on a line of its own)."""
    for kwargs, fragment in (({"json_schema": {"type": "objectx"}}, "cannot compile the json constraint: Invalid type: objectx"),
                             ({"grammar": "start: (("}, "cannot compile the lark constraint"),
                             ({"regex": "a("}, 'cannot compile the regex constraint: invalid regex "a\\(" .*: unclosed group$')):
        with pytest.raises(FasterLlamaError, match=fragment) as error:
            tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **kwargs))
        assert "\n" not in str(error.value)
    assert not tiny.engine.has_unfinished()


def test_regex_grammar_and_schema_hold_greedy_and_sampled(tiny: LLM) -> None:
    """A random model's every output matches its constraint and ends there ("stop"), greedy and
    sampled, n = 3, with penalties and top-k/p on; seeded runs repeat."""
    prompts = [[5, 6, 7], [100, 200, 33, 4], [9] * 12]
    cases = [({"regex": r"(yes|no|maybe) [0-9]{2}"}, lambda t: re.fullmatch(r"(yes|no|maybe) [0-9]{2}", t)),
             ({"grammar": 'start: item ("," item)*\nitem: "ab" | "cd" | "e"'}, lambda t: re.fullmatch(r"(ab|cd|e)(,(ab|cd|e))*", t)),
             ({"json_schema": TINY_SCHEMA}, lambda t: _valid(json.loads(t), TINY_SCHEMA)),
             ({"choice": ["yes", 'say "hi"\n', "naïve"]}, lambda t: t in ("yes", 'say "hi"\n', "naïve")),
             ({"grammar": 'root ::= ("ab" | "cd") [0-9]'}, lambda t: re.fullmatch(r"(ab|cd)[0-9]", t))]  # GBNF (llama.cpp's)
    assert tiny.generate(prompts, SamplingParams(max_tokens=4, json_schema="true"))  # (a boolean schema: any JSON; it failed to compile)
    for constraint, check in cases:
        for extra in ({"temperature": 0}, {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "repetition_penalty": 1.2, "seed": 4, "n": 3}):
            params = SamplingParams(max_tokens=48, **constraint, **extra)
            outs = tiny.generate(prompts, params)
            for out in outs:
                for c in out.outputs:
                    assert c.finish_reason == "stop", (constraint, c.text)
                    assert check(c.text), (constraint, c.text)
            if "seed" in extra:
                assert [[c.text for c in o.outputs] for o in tiny.generate(prompts, params)] == [[c.text for c in o.outputs] for o in outs]


def test_special_token_strings_in_a_constraint_are_text(tiny: LLM) -> None:
    """A constraint whose text holds a special token's string ("</s>" in a choice, a const, a
    regex) is written with ordinary tokens: llguidance tokenized the forced text into the special
    token, which its grammar then refused, and every such request failed at that token."""
    eos = tiny.tokenizer.eos_token
    assert tiny.tokenizer.encode(eos, add_special_tokens=False) == [tiny.tokenizer.eos_token_id]
    for constraint in ({"choice": [f"say {eos} now"]}, {"json_schema": {"const": eos}}, {"regex": re.escape(f"{eos}<s>")}):
        for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
            out = tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=32, **constraint, **extra))[0].outputs[0]
            want = {"choice": f"say {eos} now", "json_schema": json.dumps(eos), "regex": f"{eos}<s>"}[next(iter(constraint))]
            assert (out.text, out.finish_reason) == (want, "stop"), constraint
            assert tiny.tokenizer.eos_token_id not in out.token_ids[:-1] and tiny.tokenizer.bos_token_id not in out.token_ids


def test_forced_text_a_normalizer_would_change(tmp_path) -> None:
    """A vocabulary whose normalizer changes text (lowercase, NFC: Qwen2's): the text a constraint
    forces keeps its own bytes (it was tokenized normalized, "title" for "Title", which the grammar
    refused: the request failed)."""
    from tokenizers import normalizers

    from fasterllama.tokenizer import Tokenizer

    folder = tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["gqa"]), str(tmp_path / "m"))
    for normalizer, choice in ((normalizers.Lowercase(), "Title Case"), (normalizers.NFC(), "cafe\u0301")):
        llm = LLM(folder, progress=False)
        tokenizer = Tokenizer.from_folder(folder)
        tokenizer.backend.normalizer = normalizer
        llm.engine.use_tokenizer(tokenizer)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=32, temperature=0, choice=[choice]))[0].outputs[0]
        assert (out.text, out.finish_reason) == (choice, "stop")


@pytest.mark.parametrize("form", ["metaspace", "prepend"])
def test_sentencepiece_vocabularies_take_constraints(tmp_path, form: str) -> None:
    """A LLaMA-2-style SentencePiece vocabulary (tokenizer.model; or tokenizer.json with the dummy
    prefix as a Prepend normalizer, Llama-2's HF form): constrained outputs hold and end. The text a
    constraint forces is a fragment, tokenized without the prompt's leading "▁": with it every
    constraint failed at its first token. The output's text is read after the prompt's last tokens, as
    vLLM reads it, so a first token "▁yes" is " yes" (decoded alone, "yes": no longer the choice)."""
    import dataclasses
    import glob
    import os

    spm = pytest.importorskip("sentencepiece")
    texts = [open(p, encoding="utf-8", errors="ignore").read() for p in sorted(glob.glob("/usr/share/common-licenses/*")) if os.path.isfile(p)]
    (tmp_path / "corpus.txt").write_text("\n".join(texts) or "hello world, yes or no " * 1000, encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "m"), vocab_size=1000, model_type="bpe",
                                   byte_fallback=True, add_dummy_prefix=True, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    folder = tmp_path / "model"
    tm.build_hf_model(dataclasses.replace(tm.SPECS["gqa"], vocab_size=1000)).save_pretrained(str(folder))
    os.rename(tmp_path / "m.model", folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}))
    if form == "prepend":
        from fasterllama.tokenizer import Tokenizer

        spec = json.loads(Tokenizer.from_folder(str(folder)).backend.to_str())
        spec["pre_tokenizer"] = None
        spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                                  {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
        (folder / "tokenizer.json").write_text(json.dumps(spec))
    llm = LLM(str(folder), progress=False)
    if form == "prepend":
        assert "Prepend" in str(llm.tokenizer.backend.normalizer)
    cases = [({"json_schema": TINY_SCHEMA}, lambda t: _valid(json.loads(t), TINY_SCHEMA)), ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
             ({"regex": r"(ab|cd) [0-9]"}, lambda t: re.fullmatch(r"(ab|cd) [0-9]", t)), ({"choice": ["say </s> now"]}, lambda t: t == "say </s> now"),
             ({"choice": [" yes", " no"]}, lambda t: t in (" yes", " no")),  # (a leading "▁" is a space after the prompt: it was dropped)
             ({"regex": r" [A-Z][a-z]{1,4}\."}, lambda t: re.fullmatch(r" [A-Z][a-z]{1,4}\.", t))]
    for constraint, check in cases:
        for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 2}):
            out = llm.generate(["Hello"], SamplingParams(max_tokens=48, **constraint, **extra))[0].outputs[0]
            assert out.finish_reason == "stop" and check(out.text), (constraint, out.text)


def test_a_constraint_failing_mid_way_ends_its_own_sequence(tiny: LLM, monkeypatch) -> None:
    """A constraint that compiles but passes llguidance's parser limits once a token is taken
    (2,001 alternatives: "Current row has 2002 items; max is 2000"), or allowed_token_ids it never
    allows, ends its own sequence with finish_reason "error" and its reason; the others in the
    step run to their ends (the step raised for the whole batch, and the server answered 500 to
    every request in it). generate raises it, naming the prompt; the engine is left clean. A
    constraint is compiled once, then copied for each sequence."""
    from fasterllama.engine import structured

    engine = tiny.engine
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = tiny.generate([[40, 41]], free)[0].token_ids
    for constraint, error in (({"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(2001))}, "structured output failed at output token 1: token "),
                              ({"regex": "[a-c]+", "allowed_token_ids": [5, 6, 7]}, "no token is allowed at output token 1: ")):
        for temperature in (0.0, 1.0):  # (with nothing allowed, the argmax and the draw took token 0)
            params = SamplingParams(max_tokens=12, temperature=temperature, top_p=0.9 if temperature else 1.0, **constraint)  # (top-p over no token: the C kernel)
            seqs = [engine.add_request([40, 41], free), engine.add_request([8, 9], params)]
            while engine.has_unfinished():
                engine.step()
            assert seqs[0].output_token_ids == alone and seqs[0].finish_reason == "length"
            assert seqs[1].finish_reason == "error" and seqs[1].error.startswith(error)
            assert len(seqs[1].output_token_ids) == error.startswith("structured")  # (a banned token is never appended)
            assert engine.blocks.num_used == 0
        with pytest.raises(FasterLlamaError, match=f"prompt 1 of 2: {error}"):
            tiny.generate([[40, 41], [8, 9]], [free, SamplingParams(max_tokens=12, **constraint)])
    compiled = []
    monkeypatch.setattr(structured, "_grammar", lambda kind, text, real=structured._grammar: compiled.append(text) or real(kind, text))
    regex = SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=8, regex="(x|y)[0-9]{3}")
    outs = tiny.generate([[5, 6], [7, 8]], regex)
    assert compiled == ["(x|y)[0-9]{3}"] and all(re.fullmatch("(x|y)[0-9]{3}", c.text) for o in outs for c in o.outputs)


def test_logprobs_are_the_models_not_the_constraints(tiny: LLM) -> None:
    """As vLLM's (raw logprobs): the constraint picks the token, its logprob and the top ones are
    the model's own (they had been taken after the constraint's mask: 0.0 for a forced token)."""
    out = tiny.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, choice=["yes", "no"], logprobs=2))[0]
    model = torch.log_softmax(tiny.compute_logits([5, 6, 7])[-1], dim=-1)
    first = out.token_ids[0]
    assert out.logprobs[0][first] == pytest.approx(model[first].item(), abs=1e-4) and model[first] < -0.01
    assert [t for t in out.logprobs[0] if t != first] == [t for t in model.topk(2).indices.tolist() if t != first][: len(out.logprobs[0]) - 1]


def test_stop_string_cuts_the_text_also_where_the_constraint_ends(tiny: LLM) -> None:
    """A stop string completed by the constraint's last token still ends the text before it."""
    for tail in ("x", "xy"):
        out = tiny.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=16, regex="[0-9]{3}" + tail, stop=["x"]))[0]
        assert re.fullmatch("[0-9]{3}", out.text) and out.finish_reason == "stop", out.text


def test_an_ending_token_that_completes_the_constraint_ends_the_output_as_one(tiny: LLM) -> None:
    """EOS or a stop token id that completes the constraint: its text is not the output's (unless
    include_stop_str_in_output) and stop_reason names the stop token, as without a constraint
    (the constraint's own end kept "</s>" in the text and stop_reason None); under ignore_eos, EOS
    is refused while the constraint allows more (it completed the constraint: the output ended)."""
    eos, newline = tiny.engine.tokenizer.eos_token_id, tiny.engine.tokenizer.encode("\n", add_special_tokens=False)[-1]
    pushed = {eos: 50.0, newline: 50.0}
    for params, text, reason in (
        (SamplingParams(temperature=0, max_tokens=12, regex="[a-z]+", logit_bias={eos: 50.0}, skip_special_tokens=False), "[a-z]+", None),
        (SamplingParams(temperature=0, max_tokens=12, regex="[0-9]+\n", stop_token_ids=[newline], logit_bias=pushed), "[0-9]+", newline),
        (SamplingParams(temperature=0, max_tokens=12, regex="[0-9]+\n", stop_token_ids=[newline], logit_bias=pushed,
                        include_stop_str_in_output=True), "[0-9]+\n", newline),
    ):
        out = tiny.generate([[5, 6, 7]], params)[0]
        assert re.fullmatch(text, out.text) and out.finish_reason == "stop" and out.stop_reason == reason, (out.text, out.stop_reason)
        assert out.token_ids[-1] in (eos, newline) and len(out.token_ids) >= 2
    out = tiny.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, regex="[a-z]+", logit_bias={eos: 50.0}, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and eos not in out.token_ids and out.finish_reason == "length" and re.fullmatch("[a-z]+", out.text)
    out = tiny.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, choice=["ab"], logit_bias={eos: 50.0}, ignore_eos=True))[0]
    assert out.text == "ab" and out.finish_reason == "stop"  # (nothing but EOS left: the finished constraint ends it)


def test_the_true_schema_is_compact_json(tiny: LLM) -> None:
    """The boolean schema `true` (any JSON) writes compact JSON as {} does (it took llguidance's free whitespace)."""
    newline, bracket = (tiny.engine.tokenizer.encode(c, add_special_tokens=False)[-1] for c in ("\n", "["))
    for schema in ("true", "{}"):  # (a raw newline is only ever JSON's free whitespace: in a string it is "\\n")
        params = SamplingParams(temperature=0, max_tokens=12, json_schema=schema, logit_bias={bracket: 20.0, newline: 40.0})
        out = tiny.generate([[5, 6, 7]], params)[0]
        assert "\n" not in out.text and len(out.token_ids) > 1, (schema, out.text)


def test_free_requests_in_a_constrained_batch_get_their_own_tokens(tiny: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [o.token_ids for o in tiny.generate([[5, 6, 7], [40, 41]], free)]
    mixed = tiny.generate([[5, 6, 7], [8, 9], [40, 41]], [free, SamplingParams(temperature=0, max_tokens=48, json_schema=TINY_SCHEMA), free])
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    assert _valid(json.loads(mixed[1].text), TINY_SCHEMA)


def test_cli_flags(tiny: LLM, tmp_path) -> None:
    """`generate --regex / --json-schema @FILE` end to end, `--grammar / --choice` as the params
    they make (a process each took ~6 s), and a bad constraint: exit 1, one line."""
    import subprocess
    import sys

    from fasterllama.cli import _sampling_params, build_parser

    cmd = [sys.executable, "-m", "fasterllama", "generate", "--model", tiny.engine.model_path, "-q", "-t", "0", "-n", "48"]
    (tmp_path / "s.json").write_text(json.dumps(TINY_SCHEMA))
    for flags, check in ((["--regex", "(yes|no)!"], lambda t: t in ("yes!", "no!")),
                         (["--json-schema", f"@{tmp_path / 's.json'}"], lambda t: _valid(json.loads(t), TINY_SCHEMA))):
        out = subprocess.run(cmd + flags + ["hello"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and check(out.stdout.strip()), (flags, out.stdout, out.stderr)
    for flags, check in ((["--grammar", 'start: "a" "b"*'], lambda t: re.fullmatch("ab*", t)),
                         (["--choice", "up", "--choice", "down"], lambda t: t in ("up", "down"))):
        params = _sampling_params(build_parser().parse_args(["generate", "-t", "0", "-n", "48", *flags, "hello"]))
        assert check(tiny.generate(["hello"], params)[0].text.strip()), flags
    bad = subprocess.run(cmd + ["--json-schema", '{"type": "objectx"}', "hello"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "cannot compile the json constraint" in bad.stderr and "Traceback" not in bad.stderr


def _valid(value: object, schema: dict) -> bool:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, schema)
    return True


# -- the default model: 200 requests over 20 schemas -------------------------------------------------
_S = {"type": "string", "maxLength": 24}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Rome", "Tokyo"]}, "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"]},
    {"type": "object", "properties": {"title": _S, "tags": {"type": "array", "items": _S, "minItems": 1, "maxItems": 3}}, "required": ["title", "tags"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": _S}, "required": ["ok"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"first": _S, "last": _S}, "required": ["first", "last"]},
                                      "email": {"type": "string", "pattern": "^[a-z]{2,10}@[a-z]{2,10}\\.com$"}}, "required": ["person", "email"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 3, "maxItems": 5},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}, "event": _S}, "required": ["date", "event"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
     "required": ["color", "hex"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "name": _S, "price": {"type": "number", "minimum": 0, "maximum": 1000}}, "required": ["name", "price"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"answer": {"type": "integer"}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"language": {"enum": ["python", "rust", "go", "c"]}, "version": {"type": "string", "pattern": "^[0-9]\\.[0-9]{1,2}$"}},
     "required": ["language", "version"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "label": {"const": "severity"}}, "required": ["level", "label"]},
    {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 2, "maxItems": 4}},
     "required": ["steps"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "integer"}},
                                                                                  "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"valid": {"type": "boolean"}, "errors": {"type": "array", "items": _S, "maxItems": 2}}, "required": ["valid", "errors"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"enum": ["C", "F"]}},
     "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "count": {"type": "integer", "minimum": 1, "maximum": 10}},
     "required": ["id", "count"]},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}, "score": {"type": "number"}},
     "required": ["sentiment"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": {"type": "integer"}}}},
     "required": ["matrix"]},
]
TASKS = ["Describe it as JSON.", "Give an example as JSON.", "Answer in JSON only.", "Fill in this JSON for a test case.", "Reply with JSON."]


def _closed(schema: object) -> object:
    """The schema with every object closed to its listed properties (OpenAI's strict mode) and
    every number bounded (a range, and quarters for non-integers): a 135M model otherwise writes
    digits until max_tokens, which the grammar allows (llguidance enforces ranges and multipleOf)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    kind = out.get("type")
    if kind == "object":
        out.setdefault("additionalProperties", False)
    if kind in ("number", "integer") and "enum" not in out:
        out.setdefault("minimum", -1000)
        out.setdefault("maximum", 1000)
        if kind == "number":
            out.setdefault("multipleOf", 0.25)  # exact in binary: jsonschema checks it in floats
    return out


@pytest.fixture(scope="module")
def wide_llm(default_llm) -> LLM:
    """The default model decoding up to 64 sequences a step (the 200 requests finish sooner), with
    16-token KV blocks: the requests' 5 chat prompts (36 tokens) share two blocks through the prefix
    cache, so their prompts are computed once, not 40 times each (the CPU's 128-token blocks hold
    none of them whole: 52 s of this test's 29 s were those prompts)."""
    return LLM(progress=False, max_num_seqs=64, block_size=16)


def test_200_requests_over_20_schemas_all_validate(wide_llm) -> None:
    """Each schema (nested objects, arrays, enums, numbers, required fields, string patterns; objects
    closed, as OpenAI's strict mode has them) with 5 chat prompts at temperature 0 and 1: 200
    requests in one batch, every text valid JSON that validates against its schema."""
    jsonschema = pytest.importorskip("jsonschema")
    prompts, params = [], []
    for i, schema in enumerate(_closed(SCHEMAS)):
        for j, task in enumerate(TASKS):
            for temperature in (0.0, 1.0):
                prompts.append(wide_llm.chat_prompt([{"role": "user", "content": task}]))  # the constraint alone shapes the JSON
                params.append(SamplingParams(temperature=temperature, seed=100 * i + j, max_tokens=200, json_schema=schema))
    outs = wide_llm.generate(prompts, params)
    assert len(outs) == 200
    for out, p in zip(outs, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), p.json_schema)
