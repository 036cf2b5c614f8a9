"""``create_app``: the FastAPI app with every endpoint, its error handlers and the server middleware."""
from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from hearth_llm.engine import RateLimit, TenantRateLimiter

from .chat import create_chat_completion
from .completions import create_completion
from .embeddings import create_embeddings
from .errors import APIError
from .middleware import ServerMiddleware
from .protocol import REFUSED_FIELDS
from .quotas import APIKey
from .settings import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_N, ServerSettings
from .state import ServerState
from .tokenize import detokenize, tokenize


def create_app(model: str = "default", *, embedding_model: str | None = "default",
               api_key: str | APIKey | list[str | APIKey] | None = None, served_model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_n: int = DEFAULT_MAX_N,
               max_tokens_limit: int | None = None, request_timeout: float | None = None,
               rate_limit: RateLimit | TenantRateLimiter | None = None, max_queued_requests: int | None = None,
               tracer_provider=None, preload: bool = True,
               embedding_kwargs: dict | None = None, **engine_kwargs):
    """An ASGI app serving ``model`` (and ``embedding_model``) the OpenAI way; run it with any
    ASGI server, or use :func:`serve` / :func:`start_server`.

    >>> from hearth_llm.server import create_app
    >>> app = create_app("default", api_key="sk-local", max_tokens_limit=1024)
    >>> # uvicorn.run(app, host="127.0.0.1", port=8000)

    ``api_key``: one key or several (None: no key needed), each a string or an :class:`APIKey`
    with its requests and tokens per minute (``APIKey("sk-a", 60, 40_000)``). The other arguments are
    :class:`ServerSettings` fields; any further keyword is an :class:`EngineConfig` field, and the
    server shares its engine with every ``LLM``/``ChatHearth`` on the same model and config.
    """
    keys = () if api_key is None else (api_key,) if isinstance(api_key, (str, APIKey)) else tuple(api_key)
    settings = ServerSettings(model=model, served_model_name=served_model_name, embedding_model=embedding_model,
                              api_keys=keys, max_body_bytes=max_body_bytes, max_n=max_n,
                              max_tokens_limit=max_tokens_limit, request_timeout=request_timeout,
                              rate_limit=rate_limit, max_queued_requests=max_queued_requests, preload=preload,
                              tracer_provider=tracer_provider, engine_kwargs=engine_kwargs,
                              embedding_kwargs=dict(embedding_kwargs or {}))
    return app_for(settings)


def app_for(settings: ServerSettings) -> FastAPI:
    """The app for ``settings`` (what :func:`create_app` builds); ``app.state.hearth`` holds its engines."""
    state = ServerState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title="hearth-llm", summary="OpenAI-compatible API over the in-process hearth engine",
                  lifespan=lifespan)
    app.state.hearth = state
    _add_routes(app)
    _add_error_handlers(app)
    app.add_middleware(ServerMiddleware, api_keys=tuple(key.key for key in settings.api_keys),
                       max_body_bytes=settings.max_body_bytes, tracer_provider=settings.tracer_provider)
    return app


def _add_routes(app: FastAPI) -> None:
    app.post("/v1/chat/completions")(create_chat_completion)
    app.post("/v1/completions")(create_completion)
    app.post("/v1/embeddings")(create_embeddings)
    app.post("/tokenize")(tokenize)
    app.post("/detokenize")(detokenize)
    app.get("/v1/models")(list_models)
    app.get("/v1/models/{model_id:path}")(retrieve_model)
    app.get("/health")(health)
    app.get("/metrics")(metrics)


async def list_models(request: Request):
    state: ServerState = request.app.state.hearth
    return JSONResponse({"object": "list", "data": _models(state)})


async def retrieve_model(model_id: str, request: Request):
    state: ServerState = request.app.state.hearth
    for entry in _models(state):
        if entry["id"] == model_id:
            return JSONResponse(entry)
    raise APIError(404, f"model {model_id!r} is not served here", param="model", code="model_not_found")


def _models(state: ServerState) -> list[dict]:
    entries = [{"id": state.settings.chat_model_name, "object": "model", "created": state.created,
                "owned_by": "hearth-llm"}]
    if state.embedding_engine is not None:
        entries.append({"id": state.settings.embedding_model_name, "object": "model", "created": state.created,
                        "owned_by": "hearth-llm"})
    return entries


async def health(request: Request):
    """200 while the chat engine can serve (loaded or loading), 503 once it has stopped."""
    state: ServerState = request.app.state.hearth
    if state.core.is_stopped:
        return JSONResponse({"status": "stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request):
    """The engine's Prometheus metrics (vLLM's names), when prometheus_client is installed."""
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
    except ImportError:
        raise APIError(404, "metrics need prometheus_client: pip install 'hearth-llm[metrics]'") from None
    core = request.app.state.hearth.core
    if hasattr(core, "metrics_text"):  # an engine in its own process counts in that process's registry
        text = await asyncio.to_thread(core.metrics_text)
        return Response(text or b"", media_type=CONTENT_TYPE_LATEST)
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and not content_type.startswith("application/json"):
            failure = APIError(400, f"send the body as JSON with 'Content-Type: application/json' "
                                    f"(got {content_type or 'no Content-Type'!r})")
        else:
            failure = validation_error(error.errors())
        return JSONResponse(failure.body(), status_code=400)


def validation_error(errors) -> APIError:
    """A 400 for the first field wrong in a body, naming it (every way it could have been right, for a union)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}")
    location = _field_path(first.get("loc", ()))
    if not location:
        return APIError(400, f"the request body must be a JSON object: {first.get('msg')}")
    name = str(location[0])
    path = name + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in location[1:])
    if first.get("type") == "extra_forbidden":
        reason = REFUSED_FIELDS.get(name, "unknown parameter; this server refuses what it does not know")
        return APIError(400, f"{path}: {reason}", param=name)
    messages = dict.fromkeys(error.get("msg") for error in errors if _field_path(error.get("loc", ()))[:1] == [name])
    return APIError(400, f"{path}: {' or '.join(messages)}", param=name)


def _field_path(location) -> list:
    """The location without "body" and without pydantic's union-member tags (``str``, ``list[int]``)."""
    return [part for part in location if part != "body" and not (isinstance(part, str) and (
        "[" in part or part in ("str", "int", "float", "bool", "none", "dict")))]
