"""serve(): run the app with uvicorn until SIGTERM / Ctrl-C, then end the streams and return.

On the signal uvicorn stops accepting connections and waits for the open ones; we also shut the
engine loop down and end every open request with an error at once (not after the step in
progress, which may outlast uvicorn's graceful wait), so streams close instead of running on to
max_tokens. uvicorn re-raises the signal after its
shutdown; we absorb it, so `fasterllama serve` exits 0."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn

from ..engine.async_engine import EngineLoop
from ..errors import FasterLlamaError
from .app import create_app

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, loop: EngineLoop) -> None:
        super().__init__(config)
        self.engine_loop = loop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self.engine_loop.shutdown(wait=False)  # only sets a flag: safe in a signal handler
        try:  # the open requests' errors now, from the event loop (outside this handler), not after the step in progress
            asyncio.get_running_loop().call_soon_threadsafe(self.engine_loop.end_open_requests)
        except RuntimeError:  # (no event loop running in this thread)
            pass


def release_openmp_threads() -> bool:
    """Free the calling thread's idle OpenMP worker threads (OpenMP 5.0 omp_pause_resource_all, in
    the runtime torch has already loaded); True if it did.

    The model loads (and warms up) in the main thread, whose OpenMP team then stays in libgomp's
    pool while the engine loop thread runs every step with a team of its own. With more OpenMP
    threads than CPUs, libgomp cuts its idle spin from GOMP_SPINCOUNT to 100 rounds, so the many
    parallel regions of a decode step wake their threads through the kernel: 43 ms per 16-sequence
    step instead of LLM.generate's 33 ms (SmolLM2-135M, 2 cores; docs/performance.md, Serving).
    Without the idle team the engine's is libgomp's only one, and it spins as LLM.generate's does.
    A later parallel region in this thread would build a new team; the server runs none."""
    for name in ("libgomp.so.1", "libomp.so", "libiomp5.so", "libomp.dylib"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)  # only one already loaded
        except (OSError, AttributeError):  # not loaded; no RTLD_NOLOAD (Windows)
            continue
        pause = getattr(lib, "omp_pause_resource_all", None)
        if pause is not None:
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return pause(2) == 0  # omp_pause_hard
    return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, bound before uvicorn starts so a busy port is one clear error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        raise FasterLlamaError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(loop: EngineLoop, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "info", sock: socket.socket | None = None, trust_request_chat_template: bool = False,
          allowed_origins: Sequence[str] = ()) -> None:
    """Serve until a signal; the loop is shut down on return. sock: already bound by bind()
    (the CLI binds before the slow model load, so a busy port fails at once)."""
    sock = sock or bind(host, port)
    release_openmp_threads()
    app = create_app(loop, model_name, api_key, trust_request_chat_template=trust_request_chat_template,
                     allowed_origins=allowed_origins)
    colors = sys.stderr.isatty() and not os.environ.get("NO_COLOR")  # (no-color.org)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10, lifespan="off", use_colors=colors)
    server = _Server(config, loop)
    previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    try:
        for sig in _SIGNALS:  # uvicorn restores these and re-raises the signal it got: ignore it then
            signal.signal(sig, lambda *_: None)
        shown = f"[{host}]" if ":" in host else host
        print(f"serving {model_name} at http://{shown}:{sock.getsockname()[1]}/v1 (Ctrl-C or SIGTERM stops)", file=sys.stderr, flush=True)
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        loop.shutdown()
        sock.close()
