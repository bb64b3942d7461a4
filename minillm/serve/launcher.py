"""Starting the HTTP server: in the foreground for ``minillm serve``, or on a background thread for a
notebook or a test (``ServerThread``), both on uvicorn.

``minillm serve`` freezes the heap it has built by the time it serves (model, tokenizer, CUDA graphs: hundreds
of thousands of objects that live as long as the process): Python's garbage collector then never walks them
again, where one full collection of that heap stalls the engine thread for a few hundred milliseconds in the
middle of a step (vLLM's server does the same).

Shutdown is graceful in both: the listening socket closes first, the requests in flight get
``shutdown_timeout`` seconds to finish (None: as long as they need), and whatever is left is then cancelled,
which aborts it in the engine and frees its KV blocks.
"""

from __future__ import annotations

import gc
import signal
import socket
import threading
import time

import uvicorn

from minillm.serve.api_server import build_app
from minillm.serve.async_llm import AsyncLLM


def _config(async_llm: AsyncLLM, served_model_name: str | None, shutdown_timeout: float | None,
            log_level: str) -> uvicorn.Config:
    app = build_app(async_llm, served_model_name=served_model_name)
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout, lifespan="off")


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def run_server(async_llm: AsyncLLM, *, host: str = "127.0.0.1", port: int = 8000,
               served_model_name: str | None = None, shutdown_timeout: float | None = None,
               log_level: str = "info") -> None:
    """Serve until Ctrl-C / SIGTERM, then shut down gracefully, the engine last. Call it from the main thread."""
    server = uvicorn.Server(_config(async_llm, served_model_name, shutdown_timeout, log_level))
    sock = _listen(host, port)
    print(f"minillm: serving {server.config.app.title} on http://{host}:{sock.getsockname()[1]}/v1", flush=True)
    # uvicorn handles the signal itself, shuts down gracefully, then raises the signal again: end quietly then.
    handlers = {sig: signal.signal(sig, _exit_quietly) for sig in (signal.SIGINT, signal.SIGTERM)}
    gc.collect()
    gc.freeze()
    try:
        server.run(sockets=[sock])
    finally:
        async_llm.shutdown(timeout=0)
        gc.unfreeze()  # what the process built may go at exit as usual
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _exit_quietly(signum, frame) -> None:
    raise SystemExit(0)


class ServerThread:
    """``ServerThread(async_llm, port=0)``: the API served on a background thread (port 0 = any free port;
    ``.url`` says which). ``stop()`` shuts the server down gracefully; the AsyncLLM stays up, so the caller
    shuts it down when done with it."""

    def __init__(self, async_llm: AsyncLLM, *, host: str = "127.0.0.1", port: int = 0,
                 served_model_name: str | None = None, shutdown_timeout: float | None = None,
                 log_level: str = "warning"):
        self.server = uvicorn.Server(_config(async_llm, served_model_name, shutdown_timeout, log_level))
        self._socket = _listen(host, port)
        self.host, self.port = host, self._socket.getsockname()[1]
        self._thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self._socket]),
                                        name="minillm-http", daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server on {self.host}:{self.port} did not start; see the log above")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        """The API's base URL, as the ``openai`` client takes it."""
        return f"http://{self.host}:{self.port}/v1"

    def stop(self, timeout: float | None = None) -> None:
        """Close the socket, let the requests in flight finish, and wait (at most ``timeout`` s) for the thread."""
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
