"""The OpenAI-compatible HTTP server: ``pagedllm serve`` (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models[/{id}]``, ``POST /tokenize``,
``POST /detokenize``, ``GET /health``, ``GET /version``, ``GET /metrics``, ``POST /reset_prefix_cache``; and from
``pagedllm.entrypoints.web``: ``GET /stats``, the playground (``/``, ``/ui``) and the dashboard (``/dashboard``).

Every error is ``{"error": {"message", "type", "param", "code"}}``: 400 for any invalid request (schema and JSON
errors too, instead of FastAPI's 422), 401 on ``/v1/*`` without the ``--api-key``, 404 for an unknown model or
route, 503 once the engine has died (``/health`` too). After a stream has started an error is sent as an SSE event
followed by ``data: [DONE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import (
    OpenAIServingError,
    _ERROR_TYPES,
    bad_request,
    engine_error,
    error_body,
)

logger = logging.getLogger("pagedllm.serve")

__all__ = ["add_serve_parser", "build_app", "run_server"]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pagedllm")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "0.0.0"


def _error_response(err: OpenAIServingError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str], str]:
    """(message, param, code) for FastAPI's request validation errors (one line per error)."""
    parts, param, code = [], None, "invalid_type"
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # Union members add their type name to the path (e.g. prompt.list[int].0); keep the field path.
        loc = [x for x in loc if "[" not in x and x not in _TYPE_TAGS]
        where = ".".join(loc)
        if err.get("type") == "json_invalid":
            code = "invalid_json"
            parts.append(f"Invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        if param is None and loc:
            param = loc[0]
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    seen = []
    for p in parts:
        if p not in seen:
            seen.append(p)
    return "; ".join(seen[:5]) or "Invalid request", param, code


async def _until_disconnect(request: Request, work: Awaitable) -> Any:
    """Runs ``work``; if the client disconnects first, cancels it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


def build_app(engine: Union[AsyncLLM, EngineArgs], api_key: Optional[str] = None,
              served_model_names: Optional[Sequence[str]] = None, chat_template: Optional[str] = None,
              shutdown_engine: bool = True, enable_frontend: bool = True) -> FastAPI:
    """The FastAPI app over ``engine`` (an ``AsyncLLM``, or ``EngineArgs`` to build one now).

    Args:
        api_key: if set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``.
        served_model_names: names accepted in ``model`` (default: the config's served model name).
        chat_template: overrides the model's chat template.
        enable_frontend: serve the web playground and dashboard (``/stats`` is served either way).
        shutdown_engine: stop the engine thread when the app shuts down.
    """
    if isinstance(engine, EngineArgs):
        engine = AsyncLLM.from_engine_args(engine)
    mc = engine.config.model
    names = list(served_model_names or [mc.served_model_name])
    completion = OpenAIServingCompletion(engine, names)
    chat = OpenAIServingChat(engine, names, chat_template=chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if shutdown_engine:
            engine.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=_version(), lifespan=lifespan)
    app.state.engine = engine
    app.state.started = int(time.time())

    # ------------------------------------------------------------------ errors
    @app.exception_handler(OpenAIServingError)
    async def _serving_error(_: Request, exc: OpenAIServingError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        message, param, code = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param, code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        err_type = _ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        return JSONResponse(error_body(str(exc.detail), err_type, None, None), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError):
        return _error_response(bad_request(exc))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("unhandled error")
        return _error_response(engine_error(exc))

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if request.method != "OPTIONS" and request.url.path.startswith("/v1"):
                got = request.headers.get("authorization", "").encode()
                if not secrets.compare_digest(got, expected):
                    return JSONResponse(error_body("Incorrect API key provided.", "authentication_error", None,
                                                   "invalid_api_key"), status_code=401)
            return await call_next(request)

    # ------------------------------------------------------------------ plain endpoints
    @app.get("/health")
    async def health():
        if engine.is_dead:
            return _error_response(engine_error(engine.dead_error))
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": _version()}

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, created=app.state.started, root=mc.model, max_model_len=mc.max_model_len,
                         architecture=mc.architecture)

    @app.get("/v1/models")
    async def list_models():
        return ModelList(data=[model_card(n) for n in names])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        completion.check_model(model_id)
        return model_card(model_id)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if engine.metrics is None:
            return Response("", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        chat.check_engine()
        ok = await engine.reset_prefix_cache()
        return {"success": bool(ok)}

    @app.post("/tokenize")
    async def tokenize(req: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> TokenizeResponse:
        chat.check_model(req.model)
        tok = engine.tokenizer
        if isinstance(req, TokenizeChatRequest):
            add_gen = req.add_generation_prompt and not req.continue_final_message
            ids = chat.tokenize_messages(req.messages, add_gen, req.continue_final_message, req.chat_template,
                                         req.chat_template_kwargs, req.tools, req.add_special_tokens)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=mc.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        chat.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < mc.vocab_size]
        if bad:
            raise OpenAIServingError(f"tokens has token ids outside the vocabulary [0, {mc.vocab_size}): "
                                     f"{bad[:5]}.", 400, param="tokens", code="invalid_value")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens))

    # ------------------------------------------------------------------ generation
    async def respond(request: Request, make: Awaitable, stream: bool):
        if stream:
            result = await make
            return StreamingResponse(result, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        result = await _until_disconnect(request, make)
        if result is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(result.model_dump(mode="json"))

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, request: Request):
        return await respond(request, completion.create_completion(req), req.stream)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        return await respond(request, chat.create_chat_completion(req), req.stream)

    from pagedllm.entrypoints.web import build_web_router

    app.include_router(build_web_router(engine, api_key=api_key, enable_frontend=enable_frontend, version=_version()))
    return app


# ---------------------------------------------------------------------------------------------------- CLI
def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Adds ``pagedllm serve`` (engine flags with vLLM's names, plus the server's own)."""
    from pagedllm.entrypoints.cli import add_engine_args

    p = subparsers.add_parser(
        "serve", help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Start the OpenAI-compatible server (completions, chat, tokenize, metrics).")
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file or Hugging Face folder (default: the bundled SmolLM2-135M-Instruct).")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="Address to listen on (default 127.0.0.1; 0.0.0.0 for all interfaces).")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000).")
    g.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"),
                   help="If set, /v1/* requests must send 'Authorization: Bearer <key>' (else 401). "
                        "Default: $PAGEDLLM_API_KEY.")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default info).")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="Don't log every HTTP request.")
    g.add_argument("--graceful-shutdown-timeout", type=float, default=5.0,
                   help="Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are cut "
                        "(default 5).")
    g.add_argument("--engine-mode", default="thread", choices=["thread", "process"],
                   help="Where the engine loop runs: a thread beside the event loop (default), or a child process "
                        "(outputs cross a pipe; the HTTP side then never competes with the step for the GIL).")
    g.add_argument("--disable-frontend", action="store_true",
                   help="Don't serve the web playground (/, /ui) and dashboard (/dashboard); /stats stays.")
    add_engine_args(p)
    p.set_defaults(func=run_server)
    return p


def run_server(ns: argparse.Namespace) -> int:
    """Loads the model, then serves until SIGINT/SIGTERM; returns 0 after a clean shutdown."""
    import uvicorn

    from pagedllm.entrypoints.cli import engine_args_from_namespace

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = engine_args_from_namespace(ns)
    if ns.model is not None:
        args.model = ns.model
    t0 = time.perf_counter()
    try:
        engine = AsyncLLM.from_engine_args(args, engine_mode=ns.engine_mode)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        logger.error("cannot start: %s", e)
        return 2
    cfg = engine.config
    num_blocks = engine.num_kv_blocks
    dtype = str(cfg.model.dtype).replace("torch.", "")
    app = build_app(engine, api_key=ns.api_key, enable_frontend=not ns.disable_frontend)
    # The model, tokenizer and app live as long as the process: take them out of the cyclic GC's generations so
    # collections during serving don't rescan them between engine steps (as vLLM's server does after start-up).
    gc.collect()
    gc.freeze()

    class _Server(uvicorn.Server):
        """uvicorn re-raises a caught SIGINT/SIGTERM after its graceful shutdown (so the process dies by the
        signal); we shut down and exit 0 instead."""

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                logger.info("signal %d: shutting down", sig)
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                            access_log=not ns.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=ns.graceful_shutdown_timeout)
    server = _Server(config)
    logger.info("pagedllm serving model %s (%s) dtype=%s KV blocks=%d x %d tokens max_model_len=%d "
                "engine=%s at http://%s:%d (loaded in %.1f s)", cfg.model.served_model_name, cfg.model.model,
                dtype, num_blocks, cfg.cache.block_size, cfg.model.max_model_len, engine.engine_mode, ns.host,
                ns.port, time.perf_counter() - t0)
    server.run()
    engine.shutdown()
    logger.info("pagedllm server stopped")
    return 0
