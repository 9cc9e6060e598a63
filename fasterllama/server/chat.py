"""POST /v1/chat/completions: messages through the model's chat template, `chat.completion` out."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..engine.async_engine import RequestHandle, SequenceOutput
from ..errors import FasterLlamaError
from .body import read_json
from .logprobs import chat_logprobs
from .protocol import ChatCompletionRequest
from .serving import (
    Choice,
    Generation,
    ServerState,
    check_model,
    encode_prompts,
    start_requests,
)


class ChatGeneration(Generation):
    chunk_object = "chat.completion.chunk"
    response_object = "chat.completion"

    def start_chunks(self) -> list[dict[str, Any]]:
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for c in self.choices]

    def add_logprobs(self, choice: Choice, handle: RequestHandle, out: SequenceOutput) -> list[dict[str, Any]]:
        entries = chat_logprobs(self.state.tokens, out.token_ids, out.logprobs or [], handle.params.logprobs or 0)
        if choice.extra is None:
            choice.extra = []
        choice.extra.extend(entries)
        return entries

    def chunk_choice(self, choice: Choice, out: SequenceOutput, logprobs: Any) -> dict[str, Any] | None:
        if not out.text and logprobs is None and out.finish_reason is None:
            return None
        delta = {"content": out.text} if out.text else {}
        return {"index": choice.index, "delta": delta, "logprobs": {"content": logprobs} if logprobs is not None else None,
                "finish_reason": out.finish_reason, **({"stop_reason": out.stop_reason} if out.finish_reason else {})}

    def final_choice(self, choice: Choice, handle: RequestHandle) -> dict[str, Any]:
        logprobs = {"content": choice.extra or []} if handle.params.logprobs is not None else None
        return {"index": choice.index, "message": {"role": "assistant", "content": "".join(choice.text)},
                "logprobs": logprobs, "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    body = await read_json(request, ChatCompletionRequest, state.max_body_bytes)
    check_model(state, body.model)
    tokenizer = state.loop.engine.tokenizer
    messages = [m.template_dict() for m in body.messages]

    def render() -> list[list[int] | str]:
        from jinja2 import TemplateError

        if tokenizer is None:
            raise FasterLlamaError("this model has no tokenizer, so it cannot chat")
        try:  # as LLM.chat_prompt does
            return [tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, tokenize=True,
                                                  chat_template=body.chat_template, continue_final_message=body.continue_final_message,
                                                  **(body.chat_template_kwargs or {}))]
        except TemplateError as e:  # the template refused these messages
            raise FasterLlamaError(f"chat template: {e}") from None

    prompts = await encode_prompts(state.loop, render, "messages")
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    handles = await start_requests(state, prompts, body, body.requested_max_tokens, None, body.num_logprobs, request_id)
    return await ChatGeneration(state, handles, request_id, body.include_usage).respond(request, body.stream)
