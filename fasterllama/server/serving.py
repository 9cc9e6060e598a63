"""Running one API request through the EngineLoop, streamed (SSE) or whole.

A request becomes one engine request per prompt (each with n sequences); `Generation` merges
their outputs into choices (choice index = prompt index * n + sample index), keeps usage and
metrics, and leaves the JSON shapes to its subclasses (completions.py, chat.py). Whatever ends
a request early — the client going away, an engine error, shutdown — aborts its engine requests
so their KV slots are freed at once."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..engine.async_engine import (
    SHUTDOWN_MESSAGE,
    EngineLoop,
    EngineLoopClosed,
    RequestHandle,
    SequenceOutput,
)
from ..errors import ContextLengthError, FasterLlamaError
from ..sampling_params import SamplingParams
from .errors import APIError, error_body
from .logprobs import TokenTexts
from .metrics import ServerMetrics
from .protocol import GenerationRequest

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What the routes share: the engine loop, the served name, metrics, token texts."""

    loop: EngineLoop
    model_name: str
    metrics: ServerMetrics
    tokens: TokenTexts
    max_body_bytes: int
    trust_request_chat_template: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


# -- admission ---------------------------------------------------------------------------------
async def encode_prompts(loop: EngineLoop, render: Callable[[], list[list[int] | str]], param: str, body: GenerationRequest) -> list[list[int]]:
    """Token ids of each prompt (rendered and encoded off the event loop; only the last
    truncate_prompt_tokens where given); 400 when a prompt is empty, has ids outside the vocabulary
    or does not fit the context."""
    def work() -> list[list[int]]:
        return [loop.encode(p, body.truncate_prompt_tokens) for p in render()]

    try:
        return await run_in_threadpool(work)
    except ContextLengthError as e:
        raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
    except FasterLlamaError as e:
        raise APIError(400, str(e), param=param, code="invalid_value") from None


async def start_requests(state: ServerState, prompts: Seq[list[int]], body: GenerationRequest, max_tokens: int | None,
                         default_max_tokens: int | None, logprobs: int | None, request_id: str) -> list[RequestHandle]:
    """Check each prompt's max_tokens against the context, then queue one engine request per
    prompt (off the event loop: a large constraint takes seconds to compile). max_tokens None:
    default_max_tokens (None: the rest of the context), cut to fit."""
    loop = state.loop
    defaults = loop.engine.sampling_defaults
    default_max_tokens = defaults.get("max_tokens", default_max_tokens)  # (the model's max_new_tokens, where it has one)
    params: list[SamplingParams] = []
    for ids in prompts:
        room = loop.max_model_len - len(ids)
        if max_tokens is None and default_max_tokens is not None and body.min_tokens > default_max_tokens:
            raise APIError(400, f"min_tokens ({body.min_tokens}) is more than max_tokens' default ({default_max_tokens}): give max_tokens",
                           param="min_tokens", code="invalid_value")
        if max_tokens is None:
            budget = room if default_max_tokens is None else min(default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {loop.max_model_len} tokens. However, you requested "
                           f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the completion). "
                           f"Please reduce the prompt or {body.max_tokens_name}.", param=body.max_tokens_name, code="context_length_exceeded")
        else:
            budget = max(max_tokens, 1)  # (0: echo's prompt alone; the engine draws a token, which is dropped)
        try:
            params.append(body.sampling_params(budget, logprobs, defaults))
        except FasterLlamaError as e:
            raise APIError(400, str(e), param=body.param_of(str(e)), code="invalid_value") from None
    handles: list[RequestHandle] = []

    def add_all() -> None:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            handles.append(loop.add_request(ids, p, request_id=f"{request_id}-{i}"))

    try:
        await run_in_threadpool(add_all)
    except asyncio.CancelledError:  # (the client left meanwhile)
        _abort(handles)
        raise
    except EngineLoopClosed:
        _abort(handles)
        raise APIError(503, SHUTDOWN_MESSAGE, code="service_unavailable") from None
    except FasterLlamaError as e:
        _abort(handles)
        raise APIError(400, str(e), param=body.param_of(str(e)), code="invalid_value") from None
    state.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))
    return handles


def _abort(handles: Seq[RequestHandle]) -> None:
    for h in handles:
        h.abort()


# -- running -----------------------------------------------------------------------------------
class GenerationFailed(Exception):
    """An output ended a sequence with an error (engine failure, shutdown; or the request's own:
    its constraint failed, `request_error`)."""

    def __init__(self, message: str, request_error: bool = False) -> None:
        super().__init__(message)
        self.request_error = request_error


@dataclass
class Choice:
    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # (vLLM's: the stop token id or string that ended the choice)
    last_time: float | None = None
    extra: Any = None  # per-format state (logprobs accumulators)


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return f"data: {data}\n\n"


class Generation:
    """One API request in flight; subclasses define the JSON of chunks and of the response."""

    chunk_object = ""
    response_object = ""

    def __init__(self, state: ServerState, handles: list[RequestHandle], response_id: str, body: GenerationRequest) -> None:
        self.state = state
        self.handles = handles
        self.id = response_id
        self.created = int(time.time())
        self.include_usage, self.continuous_usage = body.include_usage, body.continuous_usage
        self.token_names_as_ids = body.return_tokens_as_token_ids  # logprobs' tokens as "token_id:<id>" (vLLM's)
        self.n = handles[0].params.n
        self.choices = [Choice(i) for i in range(len(handles) * self.n)]

    # -- format hooks --------------------------------------------------------------------------
    def start_chunks(self) -> list[dict[str, Any]]:
        """Choices sent before any token (chat: the assistant role)."""
        return []

    def add_logprobs(self, choice: Choice, handle: RequestHandle, out: SequenceOutput) -> Any:
        """Keep this output's logprobs in the choice (choice.extra) and return them for a chunk."""
        return None

    def chunk_choices(self, choice: Choice, out: SequenceOutput, logprobs: Any) -> list[dict[str, Any]]:
        """The streamed choices for one output (a chunk each), none when it carries nothing to send."""
        raise NotImplementedError

    def final_choice(self, choice: Choice, handle: RequestHandle) -> dict[str, Any]:
        raise NotImplementedError

    def end_chunks(self) -> list[dict[str, Any]]:
        """What a stream sends after the last output, before [DONE]: the usage chunk when asked."""
        return [{**self.envelope(self.chunk_object, []), "usage": self.usage()}] if self.include_usage else []

    # -- shared ----------------------------------------------------------------------------------
    def usage(self) -> dict[str, Any]:
        prompt = sum(len(h.prompt_token_ids) for h in self.handles)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(h.cached_tokens for h in self.handles)}}

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.model_name, "choices": choices}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        payload = self.envelope(self.chunk_object, choices)
        if self.include_usage:
            payload["usage"] = self.choice_usage(choices[0]["index"]) if self.continuous_usage and choices else None
        return payload

    def choice_usage(self, index: int) -> dict[str, Any]:
        """continuous_usage_stats' usage of a chunk, as vLLM counts it: its choice's prompt and
        tokens so far (the final usage chunk sums every choice)."""
        prompt, completion = len(self.handles[index // self.n].prompt_token_ids), self.choices[index].num_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def response(self) -> dict[str, Any]:
        choices = [self.final_choice(c, self.handles[c.index // self.n]) for c in self.choices]
        return {**self.envelope(self.response_object, choices), "usage": self.usage()}

    def abort(self) -> None:
        _abort(self.handles)

    async def outputs(self) -> AsyncIterator[tuple[int, SequenceOutput]]:
        """(prompt index, output) from every engine request, in arrival order."""
        if len(self.handles) == 1:
            async for out in self.handles[0]:
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, SequenceOutput | None]] = asyncio.Queue()

        async def pump(i: int, handle: RequestHandle) -> None:
            try:
                async for out in handle:
                    queue.put_nowait((i, out))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(self.handles)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def _apply(self, prompt_index: int, out: SequenceOutput) -> tuple[Choice, SequenceOutput, Any]:
        """Fold one output into its choice (returned with the output as the response shows it and
        its logprobs); GenerationFailed if it ends the sequence in error."""
        handle = self.handles[prompt_index]
        choice = self.choices[prompt_index * self.n + out.index]
        if out.finish_reason in ("error", "abort"):
            raise GenerationFailed(out.error or "the request was aborted", out.request_error)
        self.state.metrics.observe(handle, out, choice.last_time)
        if out.token_ids:
            choice.last_time = out.time
            choice.num_tokens += len(out.token_ids)
        choice.text.append(out.text)
        choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
        return choice, out, self.add_logprobs(choice, handle, out) if out.logprobs is not None else None

    # -- streaming ---------------------------------------------------------------------------------
    async def stream(self) -> AsyncIterator[str]:
        """SSE events: chunks, the usage chunk when asked, [DONE]; an error event instead if the
        generation fails. Closing it early (the client left) aborts the engine requests."""
        status: str | None = None
        try:
            for c in self.start_chunks():
                yield sse(self.chunk([c]))
            async with aclosing(self.outputs()) as outputs:
                async for i, out in outputs:
                    choice, out, logprobs = self._apply(i, out)
                    for piece in self.chunk_choices(choice, out, logprobs):
                        yield sse(self.chunk([piece]))
            for event in self.end_chunks():
                yield sse(event)
            status = "ok"
            yield sse("[DONE]")
        except GenerationFailed as e:
            status = "rejected" if e.request_error else "error"
            if e.request_error:
                yield sse(error_body(str(e), "invalid_request_error", code="invalid_value"))
            else:
                yield sse(error_body(str(e), "server_error", code="service_unavailable" if str(e) == SHUTDOWN_MESSAGE else None))
            yield sse("[DONE]")
        except Exception:
            logger.exception("streaming %s failed", self.id)
            status = "error"
            yield sse(error_body("The server had an error while processing your request.", "server_error"))
            yield sse("[DONE]")
        finally:
            self.abort()  # frees the KV slots if we stopped early; no-op once finished
            self.state.metrics.count(status or "aborted")

    def streaming_response(self) -> StreamingResponse:
        return StreamingResponse(self.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- whole ---------------------------------------------------------------------------------------
    async def collect(self) -> dict[str, Any]:
        async with aclosing(self.outputs()) as outputs:
            async for i, out in outputs:
                self._apply(i, out)
        return self.response()

    async def whole_response(self, request: Request) -> Response:
        """The full response; if the client disconnects first, abort and answer nobody (499)."""
        collect = asyncio.ensure_future(self.collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
            self.abort()
        if not collect.done() or collect.cancelled():
            self.state.metrics.count("aborted")
            return Response(status_code=499)
        try:
            body = collect.result()
        except GenerationFailed as e:
            if e.request_error:
                raise APIError(400, str(e), code="invalid_value") from None
            shutdown = str(e) == SHUTDOWN_MESSAGE
            raise APIError(503 if shutdown else 500, str(e), code="service_unavailable" if shutdown else None) from None
        self.state.metrics.count("ok")
        return JSONResponse(body)

    async def respond(self, request: Request, stream: bool) -> Response:
        return self.streaming_response() if stream else await self.whole_response(request)


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"The model '{model}' does not exist (this server serves '{state.model_name}').", param="model",
                       code="model_not_found")


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
