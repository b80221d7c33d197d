"""The FastAPI application: OpenAI routes, feedback and weight reload, health, metrics, the playground page,
and the guards around them.

Guards run as one plain ASGI middleware (so streaming and disconnect detection are untouched): the body
size limit, the optional bearer token for `/v1/*`, and the request counter by status. Every error a client
can cause is answered in the OpenAI error shape with a 4xx; anything else is logged and answered 500.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from unified.serve.conversation_log import ConversationLog
from unified.serve.errors import APIError
from unified.serve.metrics import ServerMetrics
from unified.serve.online_api import router as online_router
from unified.serve.openai_api import router as openai_router
from unified.serve import rollout_api
from unified.serve.responses import Health, describe_limits, documented
from unified.serve.startup import Startup

log = logging.getLogger(__name__)


class ServerState:
    def __init__(self, cfg):
        self.cfg, self.limits = cfg, cfg.serve
        self.model_name = cfg.serve.model_name or Path(str(cfg.model)).name
        self.metrics = ServerMetrics()
        self.startup = Startup()
        self.api_key = os.environ.get(cfg.serve.api_key_env) or None
        self.conversations = ConversationLog(cfg.serve.conversation_log) if cfg.serve.conversation_log else None
        self.reloading = asyncio.Lock()  # one weight change at a time (reload, or a trainer's update)
        self.weight_version = "0"  # the served policy's name: a trainer's weight_version, or the update count
        self.sleeping = False  # POST /sleep (recipe=rollout): generation requests get 503 until /wake_up
        self.sleep_changes = asyncio.Lock()  # one /sleep or /wake_up at a time, each carried through

    def require_ready(self, generating: bool = True):
        """The engine loop, once started; for `generating` requests also awake and holding weights."""
        if not self.startup.ready:
            raise APIError(f"the server is starting ({self.startup.phase}); retry shortly", status=503,
                           type="server_unavailable", headers={"Retry-After": str(self.limits.retry_after_s)})
        loop = self.startup.loop
        if generating and self.sleeping:
            raise APIError("the server is asleep (POST /sleep) while its trainer uses the memory; POST /wake_up "
                           "first", status=503, type="server_unavailable", code="sleeping")
        if generating and loop.engine.link.weights_missing:
            raise APIError("the server has no weights: sleep level 2 freed them; send them with "
                           "POST /update_weights_from_distributed or /update_weights_from_disk", status=503,
                           type="server_unavailable", code="no_weights")
        return loop

    def weights_replaced(self, version: str) -> str:
        """Names the policy now served (`version`) where clients and /metrics see it."""
        self.weight_version = version
        self.metrics.weight_version.info({"version": version})
        return version

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(f"the model {name!r} does not exist here; this server serves {self.model_name!r} "
                           f"(see GET /v1/models)", status=404, param="model", code="model_not_found")


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    # Of a union's branches (content: a string or a list of parts) the deepest error is the one that matters.
    # At equal depth, a broken bound says more than the type mismatch of a union's other branches.
    first = max(err.errors(), key=lambda e: (len(e.get("loc", ())), not str(e.get("type")).endswith("_type")))
    where = [str(p) for p in first.get("loc", ()) if p != "body" and "[" not in str(p)]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if first.get("type") == "extra_forbidden":
        return f"unknown field {'.'.join(where)!r}; see the OpenAPI document at /openapi.json", where[-1] if where else None
    field = ".".join(where) or "body"
    message = str(first.get("msg")).removeprefix("Value error, ")
    return f"{field}: {message}", where[0] if where else None


class Guards:
    """Body size limit, bearer-token check on /v1/*, and the request counter."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        self._rollout_paths = rollout_api.PATHS if state.limits.rollout_endpoints else set()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in _ENDPOINTS else "other"
        status = {"code": 500}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                if self._rollout_paths:  # which policy answered: a trainer's weight_version, or the update count
                    version = self.state.weight_version.encode("latin-1", "replace")
                    message = {**message, "headers": [*message.get("headers", []), (b"x-weight-version", version)]}
            await send(message)

        try:
            refusal = self._refusal(scope, path)
            if refusal is not None:
                return await _error_response(refusal)(scope, receive, counting_send)
            await self.app(scope, self._limited(receive, path), counting_send)
        finally:
            self.state.metrics.requests.labels(endpoint, str(status["code"])).inc()

    def _refusal(self, scope, path: str) -> APIError | None:
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self._body_limit(path):
            return self._too_large(path)
        if self.state.api_key and (path.startswith("/v1/") or path in self._rollout_paths):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            expected = self.state.api_key.encode()
            # The scheme name is case-insensitive (RFC 9110 11.1); the token is compared in constant time.
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected)):
                return APIError("missing or wrong API key: send 'Authorization: Bearer <key>'", status=401,
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None

    def _limited(self, receive, path: str):
        limit, seen = self._body_limit(path), 0

        async def receive_limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise self._too_large(path)
            return message

        return receive_limited

    def _images_allowed(self, path: str) -> bool:
        """Chat bodies may carry images on top of max_body_bytes, unless the model takes none (the handler
        then checks each image, and the rest of the body against max_body_bytes; see serve.images)."""
        startup = self.state.startup
        return path == _CHAT and not (startup.ready and startup.loop.engine.image_processor is None)

    def _body_limit(self, path: str) -> int:
        limits = self.state.limits
        return limits.max_body_bytes + (limits.max_images * limits.max_image_bytes if self._images_allowed(path) else 0)

    def _too_large(self, path: str) -> APIError:
        if self._images_allowed(path):
            return APIError(f"the request body is larger than {self._body_limit(path)} bytes (serve.max_body_bytes "
                            f"plus serve.max_images x serve.max_image_bytes for images)", status=413)
        return APIError(f"the request body is larger than {self.state.limits.max_body_bytes} bytes "
                        f"(serve.max_body_bytes)", status=413)

_CHAT = "/v1/chat/completions"


_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/feedback", "/v1/admin/reload_weights",
              "/health", "/metrics", "/", *rollout_api.PATHS}
_HTTP_ERRORS = {404: ("not_found", "there is no route {method} {path}; the OpenAPI document at /openapi.json lists them"),
                405: ("method_not_allowed", "{path} does not take {method}; the OpenAPI document at /openapi.json "
                                            "lists what it takes")}


def _http_error(request: Request, err: HTTPException) -> APIError:
    """Starlette's own errors (no route, wrong method, an unreadable body) in the OpenAI shape."""
    if err.status_code in _HTTP_ERRORS:
        code, message = _HTTP_ERRORS[err.status_code]
        return APIError(message.format(method=request.method, path=request.url.path), status=err.status_code,
                        code=code, headers=err.headers)
    if err.status_code == 400:  # FastAPI could not decode the body: its cause says why
        cause = err.__cause__
        if isinstance(cause, APIError):  # the body guard's own refusal (a chunked body over the limit)
            return cause
        if isinstance(cause, UnicodeDecodeError):
            why = f"it is not valid UTF-8 (byte {cause.start})"
        elif isinstance(cause, RecursionError):
            why = "its JSON is nested too deeply"
        else:
            why = f"{err.detail}"
        return APIError(f"the body could not be read: {why}; send a UTF-8 JSON object", code="invalid_body")
    return APIError(str(err.detail), status=err.status_code, headers=err.headers,
                    type="invalid_request_error" if err.status_code < 500 else "server_error")


def create_app(cfg) -> FastAPI:
    state = ServerState(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.startup.start(cfg, state.metrics.engine_step)
        yield
        if state.startup.loop is not None:
            state.startup.loop.stop(timeout=cfg.serve.shutdown_timeout_s)
        if state.conversations is not None:
            state.conversations.close()

    app = FastAPI(title="unified", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible serving of the shared model definition.")
    app.state.server = state
    app.openapi_schema = None

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = describe_limits(get_openapi(title=app.title, version=app.version,
                                                             description=app.description, routes=app.routes),
                                                 state.model_name, state.limits)
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(Guards, state=state)
    app.include_router(openai_router)
    app.include_router(online_router)
    if cfg.serve.rollout_endpoints:
        app.include_router(rollout_api.router)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError):
        message, param = _validation_message(err)
        return _error_response(APIError(message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        return _error_response(_http_error(request, err))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(APIError(f"internal error ({type(err).__name__}); the server log has details",
                                        status=500, type="server_error"))

    @app.get("/health", responses={**documented(Health), 503: {"model": Health, "description": "not ready yet"}})
    async def health():
        report = state.startup.report()
        if state.startup.ready:
            report["model"] = state.model_name
            report["weights_version"] = state.startup.loop.engine.weights_version
            if cfg.serve.rollout_endpoints:
                report.update(sleeping=state.sleeping, weight_version=state.weight_version)
            return JSONResponse(report)
        return JSONResponse(report, status_code=503, headers={"Retry-After": str(cfg.serve.retry_after_s)})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse(resources.files("unified.serve").joinpath("static/index.html").read_text())

    return app

