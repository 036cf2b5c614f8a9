"""``hearth-llm serve MODEL``: the OpenAI-compatible server from the command line.

    hearth-llm serve default                                  # http://127.0.0.1:8000/v1
    HEARTH_API_KEY=sk-local hearth-llm serve ./model.gguf --port 9000 --max-num-seqs 32
    hearth-llm serve default --api-key sk-team-a:60:40000 --api-keys-file keys.txt   # KEY:RPM:TPM quotas

Importing this module needs nothing of the [server] extra; running the command does.
"""
from __future__ import annotations

import argparse
import logging
import logging.handlers
import os
import queue

API_KEY_ENV = "HEARTH_API_KEY"


def add_serve_command(commands: argparse._SubParsersAction) -> None:
    """Adds ``serve`` to a ``hearth-llm`` subcommand table."""
    parser = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (needs hearth-llm[server])")
    parser.add_argument("model", nargs="?", default="default",
                        help="'default' (SmolLM2-135M-Instruct), a HF directory, a .gguf file or a hub id")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", action="append", default=None,
                        help=f"a key clients must send as 'Authorization: Bearer KEY', optionally with its "
                             f"quotas as KEY:RPM:TPM (requests and tokens per minute; empty: no limit; past "
                             f"them 429); repeatable; default ${API_KEY_ENV}; none: no key needed")
    parser.add_argument("--api-keys-file", default=None,
                        help="a file of keys, one KEY[:RPM[:TPM]] per line (# comments): keeps them out of "
                             "the process list")
    parser.add_argument("--served-model-name", default=None, help="the chat model's id in /v1/models")
    parser.add_argument("--embedding-model", default="default",
                        help="'default' (all-MiniLM-L6-v2), a sentence-transformers directory, or 'none'")
    parser.add_argument("--max-tokens-limit", type=int, default=None, help="cap on max_tokens of every request")
    parser.add_argument("--request-timeout", type=float, default=None, help="seconds per request")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="while this many sequences wait for the engine, new requests get 503 with "
                             "Retry-After (the engine stays shared; --max-waiting-requests is its own bound)")
    parser.add_argument("--max-body-bytes", type=int, default=None)
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds requests in flight may finish after SIGTERM")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the server process, in seconds (Python's default "
                             "0.005): how long a ready engine thread may wait for the HTTP loop's GIL")
    engine = parser.add_argument_group("engine options (EngineConfig fields)")
    engine.add_argument("--dtype", default=None)
    engine.add_argument("--device", default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--kv-cache-memory", default=None, help="bytes or e.g. '2GiB'")
    engine.add_argument("--num-threads", type=int, default=None,
                        help="the CPU engine's torch threads (default: the cores this process may use)")
    engine.add_argument("--max-waiting-requests", type=int, default=None,
                        help="queue bound; past it requests get 503 with Retry-After")
    engine.add_argument("--engine-core", choices=("thread", "process"), default=None,
                        help="where the engine loop runs: its own process (the default on CUDA: the HTTP event "
                             "loop and the engine then do not share one interpreter lock) or a thread of the "
                             "server (the default on the CPU, where a second process competes for its cores)")
    parser.set_defaults(run=run_serve)


_ENGINE_OPTIONS = ("dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory",
                   "num_threads", "max_waiting_requests", "engine_core")


def serve_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``hearth_llm.server.serve`` for parsed ``args``: keys without
    quotas as strings, keys with them as ``APIKey``."""
    kwargs = {"host": args.host, "port": args.port, "api_key": api_keys(args),
              "served_model_name": args.served_model_name,
              "embedding_model": None if args.embedding_model == "none" else args.embedding_model,
              "max_tokens_limit": args.max_tokens_limit, "request_timeout": args.request_timeout,
              "max_queued_requests": args.max_queued_requests, "drain_timeout": args.drain_timeout}
    if args.switch_interval is not None:
        kwargs["switch_interval"] = args.switch_interval
    if args.max_body_bytes is not None:
        kwargs["max_body_bytes"] = args.max_body_bytes
    kwargs.update({name: getattr(args, name) for name in _ENGINE_OPTIONS if getattr(args, name) is not None})
    if args.engine_core is None and _serves_on_cuda(args):
        kwargs["engine_core"] = "process"
    return kwargs


def _serves_on_cuda(args: argparse.Namespace) -> bool:
    """Whether the engine would run on a GPU (``--device`` or, for ``auto``, one is there)."""
    device = args.device or "auto"
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def api_keys(args: argparse.Namespace) -> list | None:
    """``--api-key`` specs and ``--api-keys-file`` lines, else ``$HEARTH_API_KEY``; None: no key."""
    from hearth_llm.server.quotas import APIKey, read_keys_file  # needs nothing of the [server] extra

    keys = [APIKey.parse(spec) for spec in args.api_key or []]
    if args.api_keys_file:
        keys += read_keys_file(args.api_keys_file)
    if not keys and os.environ.get(API_KEY_ENV):
        keys = [APIKey.parse(os.environ[API_KEY_ENV])]
    return [key if key.has_quota else key.key for key in keys] or None


def run_serve(args: argparse.Namespace) -> None:
    from hearth_llm.server import serve

    listener = log_from_a_thread()  # one JSON line per request
    try:
        serve(args.model, **serve_kwargs(args))
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has drained and shut down, then re-raised it; no traceback
        raise SystemExit(130) from None
    finally:
        listener.stop()  # what is queued is written first


def log_from_a_thread() -> logging.handlers.QueueListener:
    """INFO and up to stderr, written by a thread of their own: the event loop only queues a record.
    A write lets go of the interpreter lock, and taking it back can wait for the engine thread."""
    records = queue.SimpleQueue()
    to_stderr = logging.StreamHandler()
    to_stderr.setFormatter(logging.Formatter("%(message)s"))
    listener = logging.handlers.QueueListener(records, to_stderr)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(logging.handlers.QueueHandler(records))
    listener.start()
    return listener
