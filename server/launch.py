"""Running the app with uvicorn: :func:`serve` blocks (the CLI), :func:`start_server` runs it on a
background thread (a notebook, a test) and hands back a :class:`RunningServer`.

On SIGTERM or Ctrl-C (``serve``) or ``stop()`` (``start_server``), uvicorn stops accepting
connections and lets requests in flight finish for up to ``drain_timeout`` seconds; streams still
open then are cancelled, which aborts their engine requests.
"""
from __future__ import annotations

import gc
import socket
import sys
import threading
import time

import uvicorn

from .app import create_app

DEFAULT_HOST = "127.0.0.1"  # loopback unless told otherwise: an engine is not a public service by default
DEFAULT_PORT = 8000
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def serve(model: str = "default", *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
          drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S, log_level: str = "info",
          switch_interval: float | None = None, **app_kwargs) -> None:
    """Serve ``model`` until SIGTERM/Ctrl-C; ``app_kwargs`` go to :func:`create_app`.

    ``switch_interval`` (seconds) sets this process's ``sys.setswitchinterval``: the longest an
    engine thread that is ready to run waits for the HTTP loop to hand back the interpreter lock
    (Python's default is 0.005). ``serve`` owns its process, so it may set it; ``start_server``
    leaves it alone.

    >>> from hearth_llm.server import serve
    >>> serve("default", port=8000, api_key="sk-local")     # blocks; http://127.0.0.1:8000/v1
    """
    if switch_interval is not None:
        if not switch_interval > 0:
            raise ValueError(f"switch_interval must be > 0 seconds, got {switch_interval!r}")
        sys.setswitchinterval(switch_interval)
    # access_log off: the server middleware writes one JSON line per request, with its request id
    config = uvicorn.Config(create_app(model, **app_kwargs), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout, access_log=False)
    _HeapFreezingServer(config).run()


class _HeapFreezingServer(uvicorn.Server):
    """uvicorn's server, which once the app started (the models loaded) moves every object alive
    then out of the garbage collector's sight (``gc.freeze``, as vLLM does after its start).

    Why: with torch, transformers and a model loaded the heap holds ~240k objects, and each full
    collection walks them all: 65-500 ms on the 2-core CPU machine, with the interpreter lock held,
    so every stream and the engine stop meanwhile (seen 7 times in 20 s of 256 streams). Only
    ``serve`` does it: it owns its process, and these objects live as long as it does.
    """

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        freeze_heap()


def freeze_heap() -> None:
    """Collect once, then keep the survivors out of later collections (they are never freed by
    the collector again: only for objects that live as long as the process)."""
    gc.collect()
    gc.freeze()


class RunningServer:
    """A server on a background thread.

    >>> with start_server("default") as server:
    ...     client = openai.OpenAI(base_url=server.url, api_key="unused")
    ...     client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}])
    """

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, host: str, port: int, app):
        self._server = server
        self._thread = thread
        self.host = host
        self.port = port
        self.app = app

    @property
    def url(self) -> str:
        """The OpenAI base URL, ``http://HOST:PORT/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop accepting requests, let those in flight finish (up to ``drain_timeout``), and join."""
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def start_server(model: str = "default", *, host: str = DEFAULT_HOST, port: int = 0,
                 drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S, log_level: str = "warning",
                 startup_timeout: float = 300.0, **app_kwargs) -> RunningServer:
    """Serve ``model`` on a background thread; returns once it answers (the model loaded).
    ``port=0`` picks a free port (``server.port``)."""
    app = create_app(model, **app_kwargs)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout, access_log=False)
    server = uvicorn.Server(config)
    # uvicorn leaves the process's signal handlers alone off the main thread
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="hearth-server", daemon=True)
    thread.start()
    _wait_until_started(server, thread, startup_timeout)
    return RunningServer(server, thread, host, sock.getsockname()[1], app)


def _wait_until_started(server: uvicorn.Server, thread: threading.Thread, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the server did not start (see its log): the model may have failed to load")
        time.sleep(0.02)
