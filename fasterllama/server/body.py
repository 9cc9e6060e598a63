"""Reading a JSON request body with a size limit, validated into a pydantic model.

The routes read their bodies here rather than through FastAPI's body parameters so that bad
JSON, wrong types and oversized bodies all get OpenAI-style 400/413 errors (not FastAPI's 422)."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from .errors import APIError, from_validation_error

M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_DRAIN_LIMIT = 64 * 1024 * 1024  # read (and drop) an oversized body up to this so the client sees the 413


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {limit} bytes.", code="request_too_large")


def _not_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return bool(media) and media != "application/json" and not (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or a 413 as soon as it is known to exceed limit bytes; a 415 for a body that
    says it is not JSON (text/plain, a form): a browser sends those from any page without asking
    (no CORS preflight), so a page from anywhere could make the server generate, as FastAPI's own
    body parsing refuses them for (CVE-2021-32677). A body with no Content-Type is read as JSON."""
    if _not_json(request.headers.get("content-type")):
        declared = request.headers.get("content-length", "")
        await _drain(request, int(declared) if declared.isdigit() else _DRAIN_LIMIT + 1)  # (no length: not read)
        raise APIError(415, f"The request body must be JSON: send 'Content-Type: application/json' (got {request.headers['content-type'][:100]!r}).",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await _drain(request, int(declared))
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():  # no (or a false) Content-Length: count as it comes
        size += len(chunk)
        if size > _DRAIN_LIMIT:
            break
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise _too_large(limit)
    return b"".join(chunks)


async def _drain(request: Request, declared: int) -> None:
    """Consume a body we refuse (up to a point), so the client is not cut off while still
    sending it and reads the 413 instead of a reset connection."""
    if declared > _DRAIN_LIMIT:
        return
    async for _ in request.stream():
        pass


async def read_json(request: Request, model: type[M], limit: int) -> M:
    """The body parsed and validated as `model` (400 on bad JSON or values, 413 when too big)."""
    return parse_json(await read_body(request, limit), model)


def parse_json(raw: bytes, model: type[M]) -> M:
    """raw parsed and validated as `model` (400 on bad JSON or values)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation_error(e) from None
