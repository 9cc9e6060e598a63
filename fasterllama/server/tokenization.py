"""vLLM's POST /tokenize and /detokenize: a prompt or a conversation in the model's tokens, and
token ids back to text, without generating (clients count tokens and check a prompt fits the
context before they send it: the answer carries max_model_len); GET /tokenizer_info: the special
tokens, the chat template and the context."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from ..engine.llm_engine import check_text
from ..errors import FasterLlamaError
from .body import parse_json, read_body
from .chat import chat_renderer
from .errors import APIError
from .protocol import ChatCompletionRequest, _Strict
from .serving import ServerState, check_model


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # (a BOS where the model's tokenizer adds one)
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """A conversation as /v1/chat/completions renders it (the template writes any BOS itself;
    add_special_tokens adds the tokenizer's too, as vLLM's option does)."""

    refused: ClassVar[dict[str, Any]] = {k: v for k, v in ChatCompletionRequest.refused.items() if k != "add_special_tokens"}
    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _tokenizer(state: ServerState):
    tokenizer = state.loop.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer", code="invalid_value")
    return tokenizer


async def tokenize(request: Request, state: ServerState) -> dict:
    """{"count", "max_model_len", "tokens", "token_strs"} of a prompt ({"prompt": ...}) or of a
    conversation ({"messages": ...}, with chat's template fields)."""
    raw = await read_body(request, state.max_body_bytes)
    try:
        chat = isinstance(data := json.loads(raw), dict) and data.get("messages") is not None  # (null: unset, as everywhere)
    except (ValueError, RecursionError):
        chat = False  # (the parse below says what is wrong)
    body = parse_json(raw, TokenizeChatRequest if chat else TokenizeRequest)
    if body.model is not None:
        check_model(state, body.model)
    tokenizer = _tokenizer(state)
    if chat:
        work = chat_renderer(state, body, body.add_special_tokens)
    else:
        work = lambda: tokenizer.encode(check_text(body.prompt, "the prompt"), add_special_tokens=body.add_special_tokens)  # noqa: E731
    try:
        ids = await run_in_threadpool(work)
    except FasterLlamaError as e:
        raise APIError(400, str(e), param="messages" if chat else "prompt", code="invalid_value") from None
    return {"count": len(ids), "max_model_len": state.loop.max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}


def tokenizer_info(state: ServerState) -> dict[str, Any]:
    """vLLM's /tokenizer_info: what a client needs to count and end texts as the server does
    (lm-evaluation-harness's "remote" tokenizer reads its eos_token here, then uses /tokenize)."""
    tokenizer = _tokenizer(state)
    return {"tokenizer_class": "PreTrainedTokenizerFast", **dict.fromkeys(("bos_token", "eos_token", "pad_token", "unk_token")),
            **tokenizer.special_tokens_map, "add_bos_token": tokenizer.adds_bos, "vocab_size": state.loop.engine.config.vocab_size,
            "model_max_length": state.loop.max_model_len, "chat_template": tokenizer.chat_template,
            **({"named_chat_templates": tokenizer.named_templates} if tokenizer.named_templates else {})}


async def detokenize(request: Request, state: ServerState) -> dict:
    """{"prompt": the text of the token ids} (special tokens shown, as a prompt's text holds them)."""
    body = parse_json(await read_body(request, state.max_body_bytes), DetokenizeRequest)
    if body.model is not None:
        check_model(state, body.model)
    tokenizer = _tokenizer(state)
    try:
        ids = state.loop.engine.check_token_ids(body.tokens, "tokens")
    except FasterLlamaError as e:
        raise APIError(400, str(e), param="tokens", code="invalid_value") from None
    return {"prompt": await run_in_threadpool(tokenizer.decode, ids)}
