"""POST /v1/completions: prompts (strings or token ids) in, `text_completion` objects out."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..engine.async_engine import RequestHandle, SequenceOutput
from .body import read_json
from .logprobs import CompletionLogprobs
from .protocol import CompletionRequest
from .serving import (
    Choice,
    Generation,
    ServerState,
    check_model,
    encode_prompts,
    start_requests,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


class CompletionGeneration(Generation):
    chunk_object = response_object = "text_completion"

    def add_logprobs(self, choice: Choice, handle: RequestHandle, out: SequenceOutput) -> dict[str, list[Any]]:
        if choice.extra is None:
            choice.extra = CompletionLogprobs(self.state.tokens, self.token_names_as_ids)
        return choice.extra.add(out.token_ids, out.logprobs or [])

    def chunk_choices(self, choice: Choice, out: SequenceOutput, logprobs: Any) -> list[dict[str, Any]]:
        if not out.text and logprobs is None and out.finish_reason is None:
            return []
        return [{"index": choice.index, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason,
                 **({"stop_reason": out.stop_reason} if out.finish_reason else {})}]

    def final_choice(self, choice: Choice, handle: RequestHandle) -> dict[str, Any]:
        logprobs = None
        if handle.params.logprobs is not None:
            logprobs = (choice.extra or CompletionLogprobs(self.state.tokens, self.token_names_as_ids)).all
        return {"index": choice.index, "text": "".join(choice.text), "logprobs": logprobs, "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}


async def create_completion(request: Request, state: ServerState) -> Response:
    body = await read_json(request, CompletionRequest, state.max_body_bytes)
    check_model(state, body.model)
    prompts = await encode_prompts(state.loop, lambda: body.prompt, "prompt", body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    handles = await start_requests(state, prompts, body, body.max_tokens, DEFAULT_MAX_TOKENS, body.logprobs, request_id)
    return await CompletionGeneration(state, handles, request_id, body).respond(request, body.stream)
