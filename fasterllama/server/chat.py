"""POST /v1/chat/completions: messages through the model's chat template, `chat.completion` out
(with tool calls read from the reply when the request gives tools: tools.py)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..conversation import chat_prompt_ids
from ..engine.async_engine import RequestHandle, SequenceOutput
from .body import read_json
from .errors import APIError
from .logprobs import chat_logprobs, prompt_logprobs
from .protocol import ChatCompletionRequest
from .serving import (
    Choice,
    Generation,
    ServerState,
    check_model,
    encode_prompts,
    start_requests,
)
from .tools import ToolCallReader


class ChatGeneration(Generation):
    chunk_object = "chat.completion.chunk"
    response_object = "chat.completion"

    def __init__(self, state: ServerState, handles: list[RequestHandle], response_id: str, body: ChatCompletionRequest) -> None:
        super().__init__(state, handles, response_id, body)
        self.tool_mode, self.forced_function, self.parallel_tool_calls = body.tool_mode, body.forced_function, body.parallel_tool_calls
        self.tool_names = [t.function.name for t in body.tools or []]
        self.readers: dict[int, ToolCallReader] = {}  # (streaming: each choice's, as it goes)
        self.want_prompt_logprobs = body.prompt_logprobs is not None

    def reader(self) -> ToolCallReader | None:
        return ToolCallReader(self.tool_mode, self.tool_names, self.parallel_tool_calls, self.forced_function) if self.tool_mode else None

    def start_chunks(self) -> list[dict[str, Any]]:
        content = None if self.tool_mode not in (None, "auto") else ""  # (a forced call has no content, as OpenAI's)
        return [{"index": c.index, "delta": {"role": "assistant", "content": content}, "logprobs": None, "finish_reason": None}
                for c in self.choices]

    def add_logprobs(self, choice: Choice, handle: RequestHandle, out: SequenceOutput) -> list[dict[str, Any]]:
        entries = chat_logprobs(self.state.tokens, out.token_ids, out.logprobs or [], handle.params.logprobs or 0, self.token_names_as_ids)
        if choice.extra is None:
            choice.extra = []
        choice.extra.extend(entries)
        return entries

    def chunk_choices(self, choice: Choice, out: SequenceOutput, logprobs: Any) -> list[dict[str, Any]]:
        reader = self.readers.setdefault(choice.index, self.reader()) if self.tool_mode else None
        if reader is None:
            deltas = [{"content": out.text}] if out.text else []
        else:
            deltas = reader.feed(out.text) + (reader.finish() if out.finish_reason else [])
        if out.finish_reason is not None and (not deltas or "tool_calls" in deltas[-1]):
            deltas.append({})  # (the finish on a chunk of its own, as OpenAI sends it: the SDK's stream helper closes calls there)
        if not deltas and logprobs is not None:
            deltas = [{}]
        pieces = [{"index": choice.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if pieces and logprobs is not None:
            pieces[0]["logprobs"] = {"content": logprobs}
        if pieces and out.finish_reason is not None:
            called = reader.finish_reason_for_calls if reader else None
            pieces[-1].update(finish_reason=called or out.finish_reason, stop_reason=out.stop_reason)
        return pieces

    def response(self) -> dict[str, Any]:
        """As for any request, with vLLM's prompt_logprobs of the rendered prompt where asked."""
        out = super().response()
        if self.want_prompt_logprobs:
            out["prompt_logprobs"] = prompt_logprobs(self.state.tokens, self.handles[0].prompt_logprobs or [])
        return out

    def final_choice(self, choice: Choice, handle: RequestHandle) -> dict[str, Any]:
        logprobs = {"content": choice.extra or []} if handle.params.logprobs is not None else None
        message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.text)}
        finish_reason = choice.finish_reason
        reader = self.reader()
        if reader is not None:  # (the whole reply read as the stream reads it)
            reader.feed(message["content"])
            reader.finish()
            message["content"] = "".join(reader.content) if reader.content or not reader.calls else None
            if reader.calls:
                message["tool_calls"] = reader.calls
                finish_reason = reader.finish_reason_for_calls or finish_reason
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": choice.stop_reason}


def chat_renderer(state: ServerState, body: ChatCompletionRequest, add_special_tokens: bool = False) -> Callable[[], list[int]]:
    """The call that renders the request's conversation by the chat template into token ids (run
    off the event loop: a template can take a while); 400 for a request's own template unless
    the server trusts them."""
    if body.chat_template is not None and not state.trust_request_chat_template:
        raise APIError(400, "a request's own chat_template is refused: start the server with --trust-request-chat-template to allow "
                       "it (a template is a program, and a short one can build gigabytes of text)", param="chat_template", code="invalid_value")
    messages = [m.template_dict() for m in body.messages]
    tools = body.template_tools()
    return lambda: chat_prompt_ids(state.loop.engine.tokenizer, messages, body.add_generation_prompt, body.chat_template_kwargs,
                                   chat_template=body.chat_template, continue_final_message=body.continue_final_message, tools=tools,
                                   add_special_tokens=add_special_tokens)


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    body = await read_json(request, ChatCompletionRequest, state.max_body_bytes)
    check_model(state, body.model)
    render = chat_renderer(state, body)
    prompts = await encode_prompts(state.loop, lambda: [render()], "messages", body)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    handles = await start_requests(state, prompts, body, body.requested_max_tokens, None, body.num_logprobs, request_id)
    generation = ChatGeneration(state, handles, request_id, body)
    return await generation.respond(request, body.stream)
