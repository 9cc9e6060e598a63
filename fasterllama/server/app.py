"""create_app: the FastAPI app over one EngineLoop (routes, auth, errors, metrics)."""

from __future__ import annotations

import hmac
import re
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..engine.async_engine import EngineLoop
from .body import DEFAULT_MAX_BODY_BYTES
from .chat import create_chat_completion
from .completions import create_completion
from .errors import APIError, install_error_handlers
from .logprobs import TokenTexts
from .metrics import ServerMetrics
from .responses import create_response
from .serving import ServerState
from .tokenization import detokenize, tokenize, tokenizer_info

# Pages served from this machine (any port, http or https) may call the API from a browser, as
# Ollama allows by default; other origins only when named (`serve --allowed-origins`, '*': all).
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]+)?$"  # ($: some Starlette versions match only a prefix)


def _auth(api_key: str | None) -> Any:
    """A dependency that lets a request through only with `Authorization: Bearer <api_key>`."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key")

    return check


def create_app(loop: EngineLoop, model_name: str, api_key: str | None = None, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               trust_request_chat_template: bool = False, allowed_origins: Sequence[str] = ()) -> FastAPI:
    """The OpenAI-compatible API over `loop`, serving it as `model_name`.

    /v1/*, /tokenize, /detokenize and /tokenizer_info need the API key when one is given; /health, /metrics and
    /version never do (probes, scrapers).
    A request's own chat_template is refused unless trust_request_chat_template (a template is a
    program: a short one can build gigabytes of text). The loop is the caller's: the app does not
    shut it down. Browsers may call it from pages on this machine and from allowed_origins (CORS);
    a request from a page elsewhere is refused (403)."""
    state = ServerState(loop, model_name, ServerMetrics(loop), TokenTexts(loop.engine.tokenizer), max_body_bytes,
                        trust_request_chat_template)
    app = FastAPI(title="fasterllama", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, state.metrics.count_http_error)
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_origin_regex=LOCAL_ORIGINS,
                       allow_methods=["*"], allow_headers=["*"])
    origins = set(allowed_origins)

    @app.middleware("http")
    async def refuse_other_origins(request: Request, call_next: Any) -> Response:
        """A request a browser sends from a page of another origin (it says which: Origin) is
        refused before it runs: CORS only keeps the page from reading the answer, and a simple
        POST (text, a form, an untyped body) needs no preflight, so without this any page the
        user opens could make the server generate. Clients other than browsers send no Origin.
        Every response carries an x-request-id (the request's own, else a new one), as OpenAI's
        do, to match a client's trace with the server's log."""
        origin = request.headers.get("origin")
        if origin is None or "*" in origins or origin in origins or re.fullmatch(LOCAL_ORIGINS, origin):
            response = await call_next(request)
        elif request.method == "OPTIONS" and "access-control-request-method" in request.headers:
            response = await call_next(request)  # (a preflight: the CORS middleware refuses it)
        else:
            error = APIError(403, f"Requests from pages of {origin[:100]!r} are refused: start the server with --allowed-origins to allow them.",
                             code="origin_not_allowed")
            state.metrics.count_http_error(error.status)
            response = error.response()
        response.headers["x-request-id"] = request.headers.get("x-request-id", "")[:200] or uuid.uuid4().hex
        return response

    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: load balancers' probes)
    async def health() -> Response:
        if not loop.is_running:
            return JSONResponse({"status": "stopped"}, status_code=503)
        if loop.engine.failure is not None:  # a tensor-parallel rank died: no step can run
            return JSONResponse({"status": "failed", "error": loop.engine.failure}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_auth(api_key))])

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": state.created, "owned_by": "fasterllama",
                "max_model_len": loop.max_model_len}

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found")
        return model_card()

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(request, state)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, state)

    @v1.post("/responses")
    async def responses(request: Request) -> Response:
        return await create_response(request, state)

    app.include_router(v1)

    extras = APIRouter(dependencies=[Depends(_auth(api_key))])  # (vLLM's, outside /v1)

    @extras.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        return await tokenize(request, state)

    @extras.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        return await detokenize(request, state)

    @extras.get("/tokenizer_info")
    async def tokenizer_info_route() -> dict[str, Any]:
        return tokenizer_info(state)

    app.include_router(extras)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return app
