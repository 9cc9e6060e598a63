"""POST /v1/responses: OpenAI's Responses API for text (what the Agents SDK and newer clients call
by default), run as the chat completion of the same conversation.

`input` (a string, or messages whose content is a string or text parts) after `instructions`
(a system message) goes through the chat template; max_output_tokens, temperature, top_p and
text.format (text, json_object, json_schema: structured output) apply. One message item comes
back, streamed as the API's events (response.created ... response.output_text.delta ...
response.completed). Nothing is stored: previous_response_id, background runs, tools and items
other than messages are refused (400), not ignored; vLLM's sampling extras (top_k, ignore_eos,
seed, stop...) apply as on chat."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import ConfigDict, Field, ValidationError, model_validator

from ..engine.async_engine import RequestHandle, SequenceOutput
from .body import read_json
from .chat import chat_renderer
from .errors import from_validation_error
from .protocol import ChatCompletionRequest, _refuse, _Strict
from .serving import Choice, Generation, ServerState, check_model, encode_prompts, start_requests


class InputPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat = TextFormat()


# vLLM's sampling extras a Responses request may carry, as /v1/chat/completions takes them
SAMPLING_EXTRAS = ("seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
                   "min_tokens", "stop_token_ids", "bad_words", "include_stop_str_in_output")


class ResponsesRequest(_Strict):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)  # (SAMPLING_EXTRAS pass on; other fields: ignored)
    model: str
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: TextOptions = TextOptions()
    tool_choice: Literal["auto", "none"] = "auto"
    store: bool = True  # (accepted; nothing is kept either way)
    metadata: dict[str, str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        """What this endpoint does not do is refused by name (ignored, the answer would be another)."""
        if not isinstance(data, dict):
            return data
        if data.get("tools"):
            raise _refuse("tools", "tools are not supported on /v1/responses: use /v1/chat/completions for tool calls")
        if data.get("previous_response_id") is not None:
            raise _refuse("previous_response_id", "responses are not stored: send the whole conversation as input")
        if data.get("background"):
            raise _refuse("background", "background responses are not supported")
        for item in data.get("input") if isinstance(data.get("input"), list) else ():
            kind = item.get("type", "message") if isinstance(item, dict) else None
            parts = item.get("content") if isinstance(item, dict) and isinstance(item.get("content"), list) else []
            other = next((p.get("type") for p in parts if isinstance(p, dict) and p.get("type") not in ("input_text", "output_text", "text")), None)
            if kind != "message" or other is not None:
                raise _refuse("input", f"input items of type {other or kind!r} are not supported: messages of text only")
        return data

    def chat_request(self) -> ChatCompletionRequest:
        """The same conversation and settings as a chat completion request."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": text})
        fmt = self.text.format
        response_format = None if fmt.type == "text" else {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_ or {}, "strict": fmt.strict}}
        extras = {k: v for k, v in (self.model_extra or {}).items() if k in SAMPLING_EXTRAS}
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_output_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "response_format": response_format, **extras}
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


class ResponsesGeneration(Generation):
    """One choice as a `response` object, or as the Responses API's stream of events."""

    def __init__(self, state: ServerState, handles: list[RequestHandle], response_id: str, chat: ChatCompletionRequest,
                 body: ResponsesRequest) -> None:
        super().__init__(state, handles, response_id, chat)
        self.body, self.item_id, self.sequence = body, f"msg_{uuid.uuid4().hex}", 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return choices[0]  # (each piece is a whole event)

    def _text(self) -> str:
        return "".join(self.choices[0].text)

    def _item(self, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [{"type": "output_text", "text": self._text(), "annotations": []}]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def start_chunks(self) -> list[dict[str, Any]]:
        snapshot = self.snapshot("in_progress", [])
        return [self.event("response.created", response=snapshot), self.event("response.in_progress", response=snapshot),
                self.event("response.output_item.added", output_index=0, item=self._item("in_progress")),
                self.event("response.content_part.added", **self._where(), part={"type": "output_text", "text": "", "annotations": []})]

    def chunk_choices(self, choice: Choice, out: SequenceOutput, logprobs: Any) -> list[dict[str, Any]]:
        return [self.event("response.output_text.delta", **self._where(), delta=out.text, logprobs=[])] if out.text else []

    def end_chunks(self) -> list[dict[str, Any]]:
        final = self.response()
        return [self.event("response.output_text.done", **self._where(), text=self._text(), logprobs=[]),
                self.event("response.content_part.done", **self._where(), part=final["output"][0]["content"][0]),
                self.event("response.output_item.done", output_index=0, item=final["output"][0]),
                self.event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)]

    def snapshot(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        b, fmt = self.body, self.body.text.format
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": incomplete, "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "model": self.state.model_name, "output": output, "parallel_tool_calls": True, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": b.temperature, "top_p": b.top_p,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)}, "tool_choice": b.tool_choice, "tools": [],
                "truncation": "disabled", "usage": usage, "metadata": b.metadata or {}}

    def response(self) -> dict[str, Any]:
        usage = self.usage()
        status = "incomplete" if self.choices[0].finish_reason == "length" else "completed"
        return self.snapshot(status, [self._item("completed")], {
            "input_tokens": usage["prompt_tokens"], "input_tokens_details": usage["prompt_tokens_details"],
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]})


async def create_response(request: Request, state: ServerState) -> Response:
    body = await read_json(request, ResponsesRequest, state.max_body_bytes)
    check_model(state, body.model)
    try:
        chat = body.chat_request()
    except ValidationError as e:
        raise from_validation_error(e) from None
    render = chat_renderer(state, chat)
    prompts = await encode_prompts(state.loop, lambda: [render()], "input", chat)
    response_id = f"resp_{uuid.uuid4().hex}"
    handles = await start_requests(state, prompts, chat, chat.requested_max_tokens, None, None, response_id)
    return await ResponsesGeneration(state, handles, response_id, chat, body).respond(request, body.stream)
