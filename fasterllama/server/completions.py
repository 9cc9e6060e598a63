"""POST /v1/completions: prompts (strings or token ids) in, `text_completion` objects out.

echo puts each prompt's text before its completion, and with logprobs its tokens' logprobs
before the completion's (null for the first); max_tokens 0 with echo returns the prompt alone
(how lm-evaluation-harness scores a text: its tokens' logprobs given the ones before)."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..engine.async_engine import RequestHandle, SequenceOutput
from .body import read_json
from .logprobs import CompletionLogprobs, prompt_logprobs
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

    def __init__(self, state: ServerState, handles: list[RequestHandle], response_id: str, body: CompletionRequest) -> None:
        super().__init__(state, handles, response_id, body)
        self.echo, self.echo_only = body.echo, body.echo and body.max_tokens == 0
        self.num_logprobs, self.num_prompt_logprobs = body.logprobs, body.prompt_logprobs
        tokenizer = state.loop.engine.tokenizer
        as_sent = [isinstance(p, str) and body.truncate_prompt_tokens is None for p in body.prompt]
        # the text echoed: the prompt as sent, or its tokens' (special ones shown: each token's text in it, as text_offset counts)
        self.prompt_texts = [p if sent else tokenizer.decode(h.prompt_token_ids) if tokenizer else ""
                             for p, h, sent in zip(body.prompt, handles, as_sent)]
        self.zero_width = [_added_specials(tokenizer, p, h.prompt_token_ids) if sent and tokenizer else 0
                           for p, h, sent in zip(body.prompt, handles, as_sent)]
        self.started: set[int] = set()  # choices that had an output
        self.prompt_logprobs_sent: set[int] = set()  # (streaming)

    def logprobs_of(self, choice: Choice) -> CompletionLogprobs:
        if choice.extra is None:
            choice.extra = CompletionLogprobs(self.state.tokens, self.token_names_as_ids)
        return choice.extra

    def _apply(self, prompt_index: int, out: SequenceOutput) -> tuple[Choice, SequenceOutput, Any]:
        """As for any request, and on a choice's first output with echo the prompt before it; with
        max_tokens 0 the token drawn is dropped."""
        handle, choice = self.handles[prompt_index], self.choices[prompt_index * self.n + out.index]
        echoed: dict[str, list[Any]] | None = None
        if self.echo and choice.index not in self.started and out.finish_reason not in ("error", "abort"):
            if self.num_logprobs is not None:
                echoed = self.logprobs_of(choice).add(handle.prompt_token_ids, handle.prompt_logprobs or [], self.num_logprobs,
                                                      self.zero_width[prompt_index])
            prefix = self.prompt_texts[prompt_index]
        else:
            prefix = ""
        self.started.add(choice.index)
        if self.echo_only and out.finish_reason not in ("error", "abort"):
            out = dataclasses.replace(out, text="", token_ids=[], logprobs=None, stop_reason=None,
                                      finish_reason=None if out.finish_reason is None else "length")
        choice, out, logprobs = super()._apply(prompt_index, dataclasses.replace(out, text=prefix + out.text))
        if echoed is not None:
            logprobs = echoed if logprobs is None else {k: echoed[k] + logprobs[k] for k in echoed}
        return choice, out, logprobs

    def add_logprobs(self, choice: Choice, handle: RequestHandle, out: SequenceOutput) -> dict[str, list[Any]]:
        return self.logprobs_of(choice).add(out.token_ids, out.logprobs or [])

    def prompt_logprobs(self, handle: RequestHandle) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs of a choice's prompt (the token and the top prompt_logprobs)."""
        if self.num_prompt_logprobs is None:
            return None
        n, ids = self.num_prompt_logprobs, handle.prompt_token_ids
        entries = [None if e is None else {t: lp for t, lp in e.items() if t == tok or getattr(lp, "rank", 0) <= n}
                   for e, tok in zip(handle.prompt_logprobs or [], ids)]
        return prompt_logprobs(self.state.tokens, entries)

    def chunk_choices(self, choice: Choice, out: SequenceOutput, logprobs: Any) -> list[dict[str, Any]]:
        first = self.num_prompt_logprobs is not None and choice.index not in self.prompt_logprobs_sent
        if not out.text and logprobs is None and out.finish_reason is None and not first:
            return []
        piece = {"index": choice.index, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason,
                 **({"stop_reason": out.stop_reason} if out.finish_reason else {})}
        if first:
            self.prompt_logprobs_sent.add(choice.index)
            piece["prompt_logprobs"] = self.prompt_logprobs(self.handles[choice.index // self.n])
        return [piece]

    def final_choice(self, choice: Choice, handle: RequestHandle) -> dict[str, Any]:
        logprobs = self.logprobs_of(choice).all if self.num_logprobs is not None else None
        final = {"index": choice.index, "text": "".join(choice.text), "logprobs": logprobs, "finish_reason": choice.finish_reason,
                 "stop_reason": choice.stop_reason}
        if self.num_prompt_logprobs is not None:
            final["prompt_logprobs"] = self.prompt_logprobs(handle)
        return final


def _added_specials(tokenizer: Any, text: str, ids: list[int]) -> int:
    """How many of a prompt's leading tokens are special ones the tokenizer added (a BOS), not in
    its text."""
    special, n = set(tokenizer.all_special_ids), 0
    while n < len(ids) and ids[n] in special and not text.startswith(tokenizer.decode([ids[n]])):
        n += 1
    return n


async def create_completion(request: Request, state: ServerState) -> Response:
    body = await read_json(request, CompletionRequest, state.max_body_bytes)
    check_model(state, body.model)
    prompts = await encode_prompts(state.loop, lambda: body.prompt, "prompt", body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    handles = await start_requests(state, prompts, body, body.max_tokens, DEFAULT_MAX_TOKENS, body.logprobs, request_id)
    return await CompletionGeneration(state, handles, request_id, body).respond(request, body.stream)
