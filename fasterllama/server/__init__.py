"""OpenAI-compatible HTTP server over one always-on engine (`fasterllama serve`).

app.py builds the FastAPI app; protocol.py holds the request models; completions.py and chat.py
shape the responses; serving.py runs a request's sequences through the EngineLoop (streaming or
not); body.py, errors.py, logprobs.py and metrics.py do one job each; run.py runs uvicorn."""

from .app import create_app
from .run import serve

__all__ = ["create_app", "serve"]
