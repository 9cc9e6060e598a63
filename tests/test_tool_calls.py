"""Tool calls read from a model's reply (server/tools.py): the formats chat templates teach, text
that is not a call left as content, and the stream (any split of the reply) agreeing with the whole."""

from __future__ import annotations

import json
import random

import pytest

from fasterllama.server.tools import ToolCallReader, forced_call_schema

NAMES = ["get_weather", "add"]


def read(text: str, mode: str = "auto", pieces: list[str] | None = None) -> tuple[str | None, list[tuple[str, dict]], list[dict]]:
    """(content, [(name, arguments)], deltas) of a reply fed whole or in `pieces`."""
    reader = ToolCallReader(mode, NAMES)
    deltas = [d for piece in (pieces if pieces is not None else [text]) for d in reader.feed(piece)] + reader.finish()
    content = "".join(reader.content) if reader.content or not reader.calls else None
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reader.calls], deltas


CASES = [
    # Hermes / Qwen / SmolLM2: tagged calls, one or several, text around them, the last tag left open at the stop
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
     '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    ('<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]', None, [("add", {"a": 1, "b": 2})]),
    # Llama 3.1 (`parameters`), Mistral (a list after [TOOL_CALLS], which the detokenizer drops), several joined by ';'
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    (' [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
     None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]),
    ('{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}', None, [("add", {"a": 1}), ("add", {"a": 2})]),
    ('{"name": "add", "arguments": "{\\"a\\": 3}"}', None, [("add", {"a": 3})]),  # arguments as a JSON string
    ('{"name": "add"}', None, [("add", {})]),
    # not calls: content, whole
    ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call
    ('{"name": "delete_everything", "arguments": {}}', '{"name": "delete_everything", "arguments": {}}', []),  # not a tool of the request
    ('{"name": "add", "arguments": {"a": 1}} and more', '{"name": "add", "arguments": {"a": 1}} and more', []),
    ('{"name": "add", "arguments": {"a": 1', '{"name": "add", "arguments": {"a": 1', []),  # cut off
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', []),
    ("a < b and <tool", "a < b and <tool", []),
    ("", "", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_reply_read_for_calls(text: str, content: str | None, calls: list) -> None:
    got_content, got_calls, _ = read(text)
    assert (got_content, got_calls) == (content, calls)


@pytest.mark.parametrize("seed", range(20))
def test_stream_in_any_pieces_agrees_with_the_whole(seed: int) -> None:
    """Content and calls are the same however the reply is split; the content deltas are the content."""
    rng = random.Random(seed)
    for text, _, _ in CASES:
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        content, calls, deltas = read(text, pieces=pieces)
        assert (content, calls) == read(text)[:2], pieces
        assert "".join(d.get("content", "") for d in deltas) == (content or "")
        sent = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in sent] == calls


def test_content_streams_before_a_call_is_seen() -> None:
    """Plain text goes out as it comes (only a possible tag start is held back); a call's text does not."""
    reader = ToolCallReader("auto", NAMES)
    assert reader.feed("Sure, ") == [{"content": "Sure, "}]
    assert reader.feed("one moment <tool") == [{"content": "one moment "}]
    assert reader.feed('_call>{"name": "add", ') == []
    assert reader.feed('"arguments": {"a": 1}}</tool_call>') == []
    deltas = reader.finish()
    assert [c["function"]["name"] for c in deltas[-1]["tool_calls"]] == ["add"] and reader.finish_reason_for_calls == "tool_calls"
    reader = ToolCallReader("auto", NAMES)
    assert reader.feed("  ") == [] and reader.feed("{") == [] and reader.feed("}") == []
    assert reader.finish() == [{"content": "  {}"}] and reader.finish_reason_for_calls is None


def test_named_function_streams_its_arguments() -> None:
    reader = ToolCallReader("named", NAMES, function="add")
    first = reader.feed('{"a": ')
    assert first[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": '}
    assert first[0]["tool_calls"][0]["id"].startswith("call_") and first[0]["tool_calls"][0]["type"] == "function"
    assert reader.feed("1}") == [{"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}]
    assert reader.finish() == [] and reader.calls[0]["function"]["arguments"] == '{"a": 1}'
    assert reader.finish_reason_for_calls is None  # (a forced call finishes as "stop", as OpenAI's does)


def test_required_reads_the_constrained_array() -> None:
    content, calls, _ = read('[{"name": "add", "parameters": {"a": 1, "b": 2}}]', mode="required")
    assert content is None and calls == [("add", {"a": 1, "b": 2})]
    content, calls, deltas = read('[{"name": "add", "parameters": {"a": 1', mode="required")  # cut off before a call is whole:
    assert (content, calls, deltas) == ("", [], [])  # no content either (the constraint's JSON is no reply; it was sent as one)


def test_forced_call_schemas() -> None:
    """A named call follows its function's schema and "required" an array of calls, objects closed
    to their own properties; each function's schema moves under $defs with its references rebased
    ("$defs" of a pydantic tool could not be found from the array's root: a 400)."""
    import llguidance

    add = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = {"add": add, "get_weather": None}
    assert forced_call_schema(params, "named", True, "add") == {**add, "additionalProperties": False}
    assert forced_call_schema(params, "named", True, "get_weather") == {"type": "object", "properties": {}, "additionalProperties": False}
    schema = forced_call_schema(params, "required", False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [["add"], ["get_weather"]]
    assert [s["properties"]["parameters"] for s in schema["items"]["anyOf"]] == [{"$ref": "#/$defs/tool_0"}, {"$ref": "#/$defs/tool_1"}]
    assert schema["$defs"]["tool_0"] == {**add, "additionalProperties": False}
    assert "maxItems" not in forced_call_schema(params, "required", True)
    untyped = {"properties": {"a": {"type": "integer"}}, "required": ["a"]}  # (no "type": an object, as OpenAI reads it; it allowed a number)
    assert forced_call_schema({"f": untyped}, "named", True, "f") == {"type": "object", **untyped, "additionalProperties": False}
    assert forced_call_schema({"f": untyped}, "required", True)["$defs"]["tool_0"]["type"] == "object"
    pydantic_tool = {"type": "object", "properties": {"home": {"$ref": "#/$defs/Address"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                     "required": ["home"], "$defs": {"Address": {"type": "object", "properties": {"street": {"type": "string"}}}}}
    schema = forced_call_schema({"move": pydantic_tool}, "required", True)
    tool = schema["$defs"]["tool_0"]
    assert tool["properties"]["home"] == {"$ref": "#/$defs/tool_0/$defs/Address"}
    assert tool["properties"]["next"]["anyOf"][0] == {"$ref": "#/$defs/tool_0"}
    assert tool["$defs"]["Address"]["additionalProperties"] is False
    for s in (schema, forced_call_schema({"move": pydantic_tool}, "named", True, "move")):
        assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s))) == ""


def test_closed_objects_reads_schema_keywords_only() -> None:
    """Properties named like keywords stay properties; open or pattern objects stay open; what
    takes properties from elsewhere stays open: allOf members at their own level (closed, each
    would refuse the others' keys), a parent with allOf / anyOf / if / $ref, definitions an allOf
    combines (they made valid tool schemas unsatisfiable); checked on llguidance's matcher."""
    import llguidance

    from fasterllama.json_schemas import closed_objects, rebased

    schema = {"type": "object", "properties": {"properties": {"type": "string"}, "type": {"type": "object", "properties": {}}},
              "$defs": {"Open": {"type": "object", "additionalProperties": True}, "Map": {"type": "object", "patternProperties": {"^a": {}}}}}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False and out["properties"]["properties"] == {"type": "string"}
    assert out["properties"]["type"] == {"type": "object", "properties": {}, "additionalProperties": False}
    assert out["$defs"] == schema["$defs"] and "additionalProperties" not in schema  # (a copy)

    def accepts(schema: dict, text: str) -> bool:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
        except ValueError:
            return False
        return llguidance.LLMatcher.validate_grammar(grammar) == "" and _matches(grammar, text)

    combined = [({"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}]}, '{"a":1}'),
                ({"type": "object", "properties": {"a": {"type": "integer"}}, "allOf": [{"properties": {"b": {"type": "integer"}}}]}, '{"a":1,"b":2}'),
                ({"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"extra": {"type": "integer"}}}],
                  "$defs": {"Base": {"type": "object", "properties": {"a": {"type": "integer"}}}}}, '{"a":1,"extra":2}'),
                ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"properties": {"b": {"type": "integer"}}}]}, '{"a":1,"b":2}')]
    for schema, text in combined:
        assert accepts(schema, text) and accepts(closed_objects(schema), text), schema
    plain = {"type": "object", "properties": {"a": {"type": "integer"}}}
    optional = {"anyOf": [plain, {"type": "null"}]}  # (alternatives whole in themselves: closed)
    assert closed_objects(optional)["anyOf"][0]["additionalProperties"] is False
    assert accepts(plain, '{"a":1,"z":2}') and not accepts(closed_objects(plain), '{"a":1,"z":2}') and accepts(closed_objects(plain), '{"a":1}')
    assert rebased({"$ref": "#node", "items": {"$ref": "#/$defs/X"}, "not": {"$ref": "#"}}, "#/$defs/t") == \
        {"$ref": "#node", "items": {"$ref": "#/$defs/t/$defs/X"}, "not": {"$ref": "#/$defs/t"}}


def _matches(grammar: str, text: str) -> bool:
    """Whether llguidance's matcher over a byte tokenizer takes text whole."""
    import llguidance

    tok = _byte_tokenizer()
    matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
    for b in text.encode():
        if not matcher.consume_token(b):
            return False
    return matcher.is_accepting()


def _byte_tokenizer():
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


class _Bytes:
    """A tokenizer of 256 byte tokens and an EOS, for llguidance."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: str) -> list[int]:
        return list(text.encode())


def test_required_cut_off_keeps_the_calls_written_whole() -> None:
    """max_tokens ending a "required" array: the whole calls are returned, the finish stays "length"."""
    reader = ToolCallReader("required", NAMES)
    reader.feed('[{"name": "add", "parameters": {"a": 1}}, {"name": "get_weather", "parameters": {"city": "Par')
    deltas = reader.finish()
    assert [c["function"]["name"] for c in deltas[0]["tool_calls"]] == ["add"] and not reader.content
    assert reader.finish_reason_for_calls is None


def test_one_call_without_parallel_tool_calls() -> None:
    """parallel_tool_calls false: the first of the calls a model wrote ("required" says it in the schema)."""
    text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    reader = ToolCallReader("auto", NAMES, parallel=False)
    reader.feed(text)
    reader.finish()
    assert [json.loads(c["function"]["arguments"]) for c in reader.calls] == [{"a": 1}]


def test_earlier_calls_reach_the_template_as_objects() -> None:
    """OpenAI clients send a call's arguments back as JSON text: the template is given the object
    (its `tojson` wrote the text encoded twice), as vLLM does; other text is left as it was."""
    from fasterllama.conversation import check_messages

    calls = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
             {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "not json"}}]
    (message,) = check_messages([{"role": "assistant", "content": None, "tool_calls": calls}])
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [{"a": 1}, "not json"]
    assert calls[0]["function"]["arguments"] == '{"a": 1}'  # (the caller's messages untouched)
