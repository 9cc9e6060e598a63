"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Handlers installed on the app turn our APIError, Starlette's HTTP errors (unknown route, wrong
method) and anything unexpected (a 500) into that body, so clients never see another shape."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

logger = logging.getLogger(__name__)

class APIError(Exception):
    """An error the API reports as is: an HTTP status and an OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_validation_error(e: ValidationError) -> APIError:
    """The first problem pydantic found, named the way OpenAI names parameters."""
    first = e.errors(include_url=False)[0]
    kind, msg = first["type"], str(first["msg"]).removeprefix("Value error, ")
    if kind == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request: {msg}")
    if kind == "model_type" and not first["loc"]:
        return APIError(400, "The request body must be a JSON object.")
    # drop pydantic's union member tags ('str', 'list[int]', ...) from the location
    parts = [str(p) for p in first["loc"] if isinstance(p, int) or (p.isidentifier() and p not in _UNION_TAGS)]
    param = (first.get("ctx") or {}).get("param") or ".".join(parts) or None  # ctx: a rule across fields names its own
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if param is None:
        return APIError(400, f"Invalid request: {msg}.", code="invalid_value")
    return APIError(400, f"Invalid value for '{param}': {msg}.", param=param, code="invalid_value")


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None]) -> None:
    """Register the handlers; on_error(status) is told of every error response (for metrics)."""

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        on_error(exc.status)
        return exc.response()

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        on_error(exc.status_code)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def request_validation_error(_: Request, exc: Exception) -> JSONResponse:
        on_error(400)
        return JSONResponse(error_body(f"Invalid request: {exc}", "invalid_request_error"), status_code=400)

    async def client_left(_: Request, exc: Exception) -> Response:
        on_error(499)  # (the client closed the connection while still sending its request: no one to answer)
        return Response(status_code=499)

    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error", exc_info=exc)
        on_error(500)
        return JSONResponse(error_body("The server had an error while processing your request.", "server_error"), status_code=500)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, request_validation_error)
    app.add_exception_handler(ClientDisconnect, client_left)
    app.add_exception_handler(Exception, internal_error)
