"""OpenAI tool calling on /v1/chat/completions: tool_choice to a constraint, replies to tool calls.

tool_choice decides how a call is made (vLLM's semantics):
- a named function: the reply is constrained to that function's arguments schema and returned as
  its one call (finish_reason "stop", as OpenAI answers a forced call);
- "required": the reply is constrained to a JSON array of one or more `{"name", "parameters"}`
  objects naming the tools (one only with parallel_tool_calls false);
- "auto" (the default with tools): the model decides, told of the tools by its chat template;
  its reply is read for calls in the formats templates teach: `<tool_call>{...}</tool_call>`
  blocks (Hermes, Qwen, SmolLM2) or a reply that is only JSON objects or lists of
  `{"name", "arguments" | "parameters"}` (Llama 3.1's, Mistral's after its [TOOL_CALLS] token),
  naming a function of the request's tools (the first only with parallel_tool_calls false);
- "none": no call (the template is still shown the tools).
Forced calls work with any model (the constraint writes them); "auto" works with models whose
template describes the tools."""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Mapping
from typing import Any

from ..json_schemas import closed_objects, rebased

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def forced_call_schema(parameters: Mapping[str, dict[str, Any] | None], mode: str, parallel: bool, function: str | None = None) -> dict[str, Any]:
    """The JSON schema a forced call's reply follows: ("named") the function's arguments, or
    ("required") an array of calls to any of the functions (`parameters`: name -> arguments schema). Objects that
    do not say otherwise take no properties beyond their own (as OpenAI's strict mode, vLLM's default
    backend and llama.cpp read them: a small model otherwise invents arguments)."""
    if mode == "named":
        return _arguments_schema(parameters[function])
    # each function's schema under $defs, its own "#..." references rebased there
    defs = {f"tool_{i}": rebased(_arguments_schema(schema), f"#/$defs/tool_{i}") for i, schema in enumerate(parameters.values())}
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": {"$ref": f"#/$defs/tool_{i}"}},
              "required": ["name", "parameters"], "additionalProperties": False} for i, name in enumerate(parameters)]
    return {"$defs": defs, "type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}


def _arguments_schema(schema: dict[str, Any] | None) -> dict[str, Any]:
    """A function's arguments as the constraint takes them: an object always (parameters that
    leave "type" out mean one, as OpenAI reads them; the schema alone allowed a bare number), closed."""
    if not schema:
        return NO_ARGUMENTS
    return closed_objects(schema if "type" in schema else {"type": "object", **schema})


def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolCallReader:
    """One choice's reply read for tool calls as it streams: `feed` each piece of text and `finish`
    at the end; both return the deltas to send ({"content"} or {"tool_calls"}). The whole reply fed
    at once gives the same content and calls as the stream, so streamed and whole answers agree.

    In "auto" mode, text is sent as content as it comes, except what may start a call: leading
    whitespace, a reply that begins as JSON, a partial `<tool_call>` tag; from a call's start on,
    the rest is read at the end (content again if it holds no valid call)."""

    def __init__(self, mode: str, names: Collection[str], parallel: bool = True, function: str | None = None) -> None:
        self.mode = mode  # "auto", "required" or "named" (the function given)
        self.function = function
        self.names = set(names)
        self.parallel = parallel  # (False: the first call only, where the model wrote several)
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self._held = ""
        self._in_call = False
        self.cut_off = False  # ("required": the array was cut off; the calls are those written whole)

    @property
    def finish_reason_for_calls(self) -> str | None:
        """"tool_calls" when the model chose to call (auto, required); a forced named call keeps its own."""
        return "tool_calls" if self.calls and self.mode in ("auto", "required") and not self.cut_off else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.mode == "named":
            return self._arguments(text)
        self._held += text
        return [] if self.mode == "required" or self._in_call else self._release()

    def finish(self) -> list[dict[str, Any]]:
        if self.mode == "named":
            return [] if self.calls else self._arguments("")
        held, self._held = self._held, ""
        found = _read_calls(held, self.names) if self._in_call or self.mode == "required" else None
        if found is None and self.mode == "required":  # (cut off by max_tokens: the calls written whole)
            found = _array_prefix_calls(held, self.names)
            self.cut_off = True
            if found is None:  # (not one whole call: no content either, the constraint's JSON is not the reply)
                return []
        if found is None:
            return self._send(held)
        calls, outside = found
        deltas = self._send(outside) if outside.strip() else []
        self.calls = [new_call(name, arguments) for name, arguments in calls[: None if self.parallel else 1]]
        return [*deltas, {"tool_calls": [{"index": i, **call} for i, call in enumerate(self.calls)]}]

    # -- internals ---------------------------------------------------------------------------------
    def _arguments(self, text: str) -> list[dict[str, Any]]:
        """A named function's reply: its arguments, streamed into its one call."""
        if not self.calls:
            self.calls.append(new_call(self.function, text))
            return [{"tool_calls": [{"index": 0, **self.calls[0]}]}]
        self.calls[0]["function"]["arguments"] += text
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]

    def _release(self) -> list[dict[str, Any]]:
        held = self._held
        if not self.content:
            start = held.lstrip()
            if not start:
                return []
            if start[0] in "{[":  # (a JSON reply: a call, or content, decided at the end)
                self._in_call = True
                return []
        at = held.find(CALL_OPEN)
        if at >= 0:
            self._in_call = True
        else:  # (keep back what may be the start of the tag)
            at = len(held) - next((k for k in range(min(len(held), len(CALL_OPEN) - 1), 0, -1) if CALL_OPEN.startswith(held[-k:])), 0)
        self._held = held[at:]
        return self._send(held[:at])

    def _send(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.content.append(text)
        return [{"content": text}]


def _read_calls(text: str, names: set[str]) -> tuple[list[tuple[str, str]], str] | None:
    """(calls as (name, arguments JSON), the text outside them), or None if the text holds no valid
    call: `<tool_call>` blocks (the last may be left unclosed), or else JSON values only."""
    if CALL_OPEN not in text:
        calls = _json_calls(text, names)
        return (calls, "") if calls else None
    calls, outside, pos = [], [], 0
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        outside.append(text[pos:start])
        end = text.find(CALL_CLOSE, start)
        body_end = len(text) if end < 0 else end
        found = _json_calls(text[start + len(CALL_OPEN) : body_end], names)
        if not found:
            return None
        calls.extend(found)
        pos = body_end if end < 0 else end + len(CALL_CLOSE)
    outside.append(text[pos:])
    return calls, "".join(outside).strip()


def _json_calls(text: str, names: set[str]) -> list[tuple[str, str]] | None:
    """Calls in text made only of JSON objects or lists of them (separated by whitespace, ';' or
    ','), each {"name": a known function, "arguments" | "parameters": an object or its JSON}."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos, n = 0, len(text)
    while True:
        while pos < n and (text[pos].isspace() or (values and text[pos] in ";,")):
            pos += 1
        if pos == n:
            break
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.extend(value if isinstance(value, list) else [value])
    return _calls_of(values, names)


def _array_prefix_calls(text: str, names: set[str]) -> tuple[list[tuple[str, str]], str] | None:
    """The calls written whole at the start of a JSON array that was cut off."""
    decoder = json.JSONDecoder()
    pos, values = text.find("[") + 1, []
    if pos == 0 or text[:pos - 1].strip():
        return None
    while True:
        while pos < len(text) and (text[pos].isspace() or (values and text[pos] == ",")):
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        values.append(value)
    calls = _calls_of(values, names)
    return (calls, "") if calls else None


def _calls_of(values: list[Any], names: set[str]) -> list[tuple[str, str]] | None:
    calls = []
    for value in values:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append((value["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None
