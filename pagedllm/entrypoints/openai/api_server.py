"""The OpenAI-compatible HTTP server: ``pagedllm serve`` (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models[/{id}]``, ``POST /tokenize``,
``POST /detokenize``, ``GET /health``, ``GET /version``, ``GET /metrics``, ``POST /reset_prefix_cache``; and from
``pagedllm.entrypoints.web``: ``GET /stats``, the playground (``/``, ``/ui``) and the dashboard (``/dashboard``).

Every error is ``{"error": {"message", "type", "param", "code"}}``: 400 for any invalid request (schema and JSON
errors too, instead of FastAPI's 422; bounds in the README's "Request bounds"), 401 without the ``--api-key`` (every
route but ``/health``), 404 for an unknown model or route, 413 for a body over ``--max-request-body-bytes``, 429
with ``Retry-After`` when the admission queue is full, 500 for a request whose own processing failed in the engine
(the engine runs on), 503 once the engine has died or while the server drains for shutdown. After a stream has
started an error is sent as an SSE event followed by ``data: [DONE]``.

``/health`` is 503 when the engine is dead, or has work but has not finished a step for ``--health-step-timeout``
seconds (a watchdog). If the engine dies, ``pagedllm serve`` ends every stream with an error event and exits 1, so a
supervisor restarts it. On SIGTERM/SIGINT the server stops admitting (503), lets in-flight requests finish for up
to ``--graceful-shutdown-timeout`` seconds, then ends the rest with an error event and ``[DONE]``, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import envs
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.exceptions import (
    EngineDeadError,
    EngineShuttingDownError,
    QueueFullError,
    RequestFailedError,
)
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
from pagedllm.entrypoints.openai.guards import ApiKeyAuth, BodyGuard, load_api_keys
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
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
# A stop signal within this many seconds of the first is the same stop delivered twice (the process group's and the
# parent's), not an operator's second signal asking to exit at once.
SIGNAL_REPEAT_S = 1.0


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


async def _warm_up(engine) -> None:
    """Asks the engine to start building its grammar backend (in its pool) while the server waits for requests."""
    try:
        await engine.call_in_engine("warm_up_structured_outputs")
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - only a head start: the first constrained request builds it anyway
        logger.debug("structured outputs warm-up skipped: %s", e)


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


def build_app(engine: Union[AsyncLLM, EngineArgs], api_key: Optional[Union[str, Sequence[str]]] = None,
              served_model_names: Optional[Sequence[str]] = None, chat_template: Optional[str] = None,
              shutdown_engine: bool = True, enable_frontend: bool = True, *,
              enable_auto_tool_choice: bool = False, tool_call_parser: Optional[str] = None,
              allow_unauthenticated_metrics: bool = False, server_dev_mode: bool = False,
              trust_request_chat_template: bool = False, enable_prompt_tokens_details: bool = False,
              health_step_timeout: float = 60.0) -> FastAPI:
    """The FastAPI app over ``engine`` (an ``AsyncLLM``, or ``EngineArgs`` to build one now).

    Args:
        api_key: a key or several; if set, every route but ``/health`` (and the web pages' static files) requires
            ``Authorization: Bearer <key>``.
        served_model_names: names accepted in ``model`` (default: the config's served model name).
        chat_template: overrides the model's chat template.
        enable_frontend: serve the web playground and dashboard (``/stats`` is served either way).
        shutdown_engine: stop the engine thread when the app shuts down.
        allow_unauthenticated_metrics: leave ``/metrics`` open (for a scraper) when keys are set.
        server_dev_mode: add ``/reset_prefix_cache`` (vLLM keeps it behind ``VLLM_SERVER_DEV_MODE``).
        trust_request_chat_template: accept a request's own ``chat_template`` (vLLM's flag).
        enable_prompt_tokens_details: report ``usage.prompt_tokens_details.cached_tokens`` (vLLM's flag): it
            reveals whether someone else recently sent the same prefix.
        health_step_timeout: ``/health`` answers 503 when the engine has work but no step finished for this long.
        enable_auto_tool_choice, tool_call_parser: vLLM's flags (``tool_choice: auto`` parses the model's calls
            with the named parser; ``required`` and a named tool work without them).

    Raises:
        ValueError: for an unknown tool-call parser, or auto tool choice without one.
    """
    if isinstance(engine, EngineArgs):
        engine = AsyncLLM.from_engine_args(engine)
    mc = engine.config.model
    names = list(served_model_names or [mc.served_model_name])
    completion = OpenAIServingCompletion(engine, names, enable_prompt_tokens_details)
    chat = OpenAIServingChat(engine, names, chat_template=chat_template,
                             enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                             trust_request_chat_template=trust_request_chat_template,
                             enable_prompt_tokens_details=enable_prompt_tokens_details)

    async def watch_engine(app: FastAPI) -> None:
        """If the engine dies (not shut down by us): let the streams send their error event, then ask the server
        to exit non-zero (``app.state.on_engine_dead``, set by ``run_server``)."""
        while not engine.is_dead:
            await asyncio.sleep(0.2)
        if app.state.shutting_down:
            return
        logger.error("the engine died: %s; stopping the server", engine.dead_error)
        await asyncio.sleep(0.5)
        callback = app.state.on_engine_dead
        if callback is not None:
            callback()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loop = asyncio.get_running_loop()
        watcher = asyncio.ensure_future(watch_engine(app))
        warm = asyncio.ensure_future(_warm_up(engine))  # never holds up start-up
        yield
        warm.cancel()
        app.state.shutting_down = True
        watcher.cancel()
        if shutdown_engine:
            engine.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=_version(), lifespan=lifespan)
    app.state.engine = engine
    app.state.started = int(time.time())
    app.state.shutting_down = False
    app.state.on_engine_dead = None
    app.state.loop = None

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

    # Middlewares: the last added runs first (auth, then the body guard, then the routes).
    app.add_middleware(BodyGuard, max_body_bytes=engine.input_processor.limits.max_request_body_bytes)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if keys:
        open_paths = ["/health"] + (["/metrics"] if allow_unauthenticated_metrics else [])
        if enable_frontend:  # the web pages and their assets hold no data; they ask for the key themselves
            from pagedllm.entrypoints.web import PUBLIC_PATHS

            open_paths += sorted(PUBLIC_PATHS)
        app.add_middleware(ApiKeyAuth, api_keys=keys, open_paths=open_paths)

    # ------------------------------------------------------------------ plain endpoints
    @app.get("/health")
    async def health():
        if engine.is_dead:
            return _error_response(engine_error(engine.dead_error))
        stalled = engine.seconds_since_progress()
        if stalled > health_step_timeout:
            return _error_response(OpenAIServingError(
                f"the engine has had work for {stalled:.0f} s without finishing a step (--health-step-timeout="
                f"{health_step_timeout:g}).", 503, code="engine_stalled"))
        if engine.is_draining:
            return _error_response(engine_error(EngineShuttingDownError("the server is shutting down.")))
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

    if server_dev_mode:
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            chat.check_engine()
            ok = await engine.reset_prefix_cache()
            return {"success": bool(ok)}

    def _tokenize(req: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> list[int]:
        tok = engine.tokenizer
        if isinstance(req, TokenizeChatRequest):
            chat.check_template_args(req.chat_template, req.chat_template_kwargs, req.add_generation_prompt,
                                     req.continue_final_message)
            return chat.tokenize_messages(req.messages, req.add_generation_prompt, req.continue_final_message,
                                          req.chat_template, req.chat_template_kwargs, req.tools,
                                          req.add_special_tokens)
        if len(req.prompt) > 64 * mc.max_model_len:
            raise OpenAIServingError(f"prompt is {len(req.prompt)} characters long, far more than max_model_len="
                                     f"{mc.max_model_len} tokens.", 400, param="prompt",
                                     code="context_length_exceeded")
        return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)

    @app.post("/tokenize")
    async def tokenize(req: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> TokenizeResponse:
        chat.check_model(req.model)
        ids = await asyncio.to_thread(_tokenize, req)  # templates and the tokenizer run off the event loop
        strs = engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=mc.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        chat.check_model(req.model)
        if len(req.tokens) > mc.max_model_len:
            raise OpenAIServingError(f"tokens holds {len(req.tokens)} ids, more than max_model_len="
                                     f"{mc.max_model_len}.", 400, param="tokens", code="invalid_value")
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
        try:
            result = await _until_disconnect(request, make)
        except (OpenAIServingError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 - answered here: the catch-all handler would drop the connection
            if not isinstance(e, (EngineDeadError, EngineShuttingDownError, QueueFullError, RequestFailedError)):
                logger.exception("unhandled error")
            raise engine_error(e) from None
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
    g.add_argument("--api-key", action="append", default=None,
                   help="If set, every route but /health needs 'Authorization: Bearer <key>' (else 401). Repeat for "
                        "several keys. Default: $PAGEDLLM_API_KEY.")
    g.add_argument("--api-key-file", default=None,
                   help="A file of accepted API keys, one per line ('#' lines ignored), added to --api-key.")
    g.add_argument("--allow-unauthenticated-metrics", action="store_true",
                   help="Leave /metrics open without the API key (for a Prometheus scraper).")
    g.add_argument("--server-dev-mode", action="store_true",
                   help="Add development endpoints (/reset_prefix_cache), as VLLM_SERVER_DEV_MODE does.")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="Accept a request's own chat_template (a template is code; refused by default).")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="Report usage.prompt_tokens_details.cached_tokens (it shows whether someone else recently "
                        "sent the same prefix).")
    g.add_argument("--health-step-timeout", type=float, default=60.0,
                   help="/health answers 503 when the engine has work but finished no step for this many seconds "
                        "(default 60).")
    g.add_argument("--fault-injection", action="store_true", help=argparse.SUPPRESS)  # tests only
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default info).")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="Don't log every HTTP request.")
    g.add_argument("--graceful-shutdown-timeout", type=float, default=5.0,
                   help="Seconds in-flight requests get to finish after SIGINT/SIGTERM (new ones get 503) before "
                        "each remaining stream ends with an error event (default 5).")
    g.add_argument("--engine-mode", default="thread", choices=["thread", "process"],
                   help="Where the engine loop runs: a thread beside the event loop (default), or a child process "
                        "(outputs cross a pipe; the HTTP side then never competes with the step for the GIL).")
    g.add_argument("--disable-frontend", action="store_true",
                   help="Don't serve the web playground (/, /ui) and dashboard (/dashboard); /stats stays.")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="Let the model decide to call tools (tool_choice auto); needs --tool-call-parser.")
    g.add_argument("--tool-call-parser", default=None,
                   help="How to read the model's tool calls: hermes (Qwen2.5/Qwen3), llama3_json, mistral, pythonic.")
    add_engine_args(p)
    p.set_defaults(func=run_server)
    return p


def run_server(ns: argparse.Namespace) -> int:
    """Loads the model, then serves until SIGINT/SIGTERM; returns 0 after a clean shutdown, 1 if the engine died
    (so a supervisor restarts the server), 2 if it could not start."""
    import uvicorn

    from pagedllm.entrypoints.cli import engine_args_from_namespace

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = engine_args_from_namespace(ns)
    if ns.model is not None:
        args.model = ns.model
    if ns.tool_call_parser is not None or ns.enable_auto_tool_choice:
        from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager

        try:
            if ns.tool_call_parser is None:
                raise ValueError("--enable-auto-tool-choice needs --tool-call-parser.")
            ToolParserManager.get_tool_parser(ns.tool_call_parser)
        except ValueError as e:
            logger.error("cannot start: %s", e)
            return 2
    try:
        env_key = envs.get("PAGEDLLM_API_KEY")
        keys = load_api_keys(ns.api_key if ns.api_key is not None else ([env_key] if env_key else []),
                             ns.api_key_file)
    except (OSError, ValueError) as e:
        logger.error("cannot start: %s", e)
        return 2
    if getattr(ns, "fault_injection", False):
        from pagedllm.engine import fault_injection

        fault_injection.enable()
    t0 = time.perf_counter()
    try:
        engine = AsyncLLM.from_engine_args(args, engine_mode=ns.engine_mode)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        logger.error("cannot start: %s", e)
        return 2
    cfg = engine.config
    num_blocks = engine.num_kv_blocks
    dtype = str(cfg.model.dtype).replace("torch.", "")
    app = build_app(engine, api_key=keys, enable_frontend=not ns.disable_frontend,
                    enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser,
                    allow_unauthenticated_metrics=ns.allow_unauthenticated_metrics,
                    server_dev_mode=ns.server_dev_mode, trust_request_chat_template=ns.trust_request_chat_template,
                    enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
                    health_step_timeout=ns.health_step_timeout)
    # The model, tokenizer and app live as long as the process: take them out of the cyclic GC's generations so
    # collections during serving don't rescan them between engine steps (as vLLM's server does after start-up).
    gc.collect()
    gc.freeze()
    exit_code = 0
    grace = ns.graceful_shutdown_timeout

    class _Server(uvicorn.Server):
        """On SIGINT/SIGTERM: stop admitting (503), let in-flight requests finish for up to ``grace`` s, end the
        rest with an error event, then let uvicorn close (a second signal exits at once). uvicorn re-raises a
        caught signal after its shutdown (so the process dies by the signal); we exit 0 instead.

        A signal within ``SIGNAL_REPEAT_S`` of the first is the same request, not a second one: a process manager
        or ``make`` signals the process group and then forwards the signal to its child, so one stop arrives twice
        (seen as two "draining" lines and two drain tasks: the second handler ran inside the first's log call)."""

        draining_since: Optional[float] = None

        def handle_exit(self, sig, frame) -> None:
            loop = app.state.loop
            now = time.monotonic()
            if self.draining_since is not None and now - self.draining_since < SIGNAL_REPEAT_S:
                pass  # the same stop, delivered twice
            elif self.draining_since is not None or loop is None or self.should_exit:
                super().handle_exit(sig, frame)
            else:
                self.draining_since = now  # first: a signal arriving during the log call below sees it
                logger.info("signal %d: draining (up to %g s), then shutting down", sig, grace)
                engine.start_draining()
                loop.call_soon_threadsafe(self._start_drain)
            self._captured_signals.clear()

        def _start_drain(self) -> None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())  # held: the loop keeps weak refs

        async def _drain_then_exit(self) -> None:
            cut = await engine.drain(grace)
            if cut:
                logger.warning("%d requests were cut at shutdown", cut)
                await asyncio.sleep(0.2)  # their streams send the error event and [DONE]
            self.should_exit = True

    def on_engine_dead() -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    app.state.on_engine_dead = on_engine_dead
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                            access_log=not ns.disable_uvicorn_access_log, timeout_graceful_shutdown=2)
    server = _Server(config)
    sc = cfg.scheduler
    logger.info("pagedllm serving model %s (%s) dtype=%s KV blocks=%d x %d tokens max_model_len=%d "
                "max_num_seqs=%d max_num_batched_tokens=%d%s%s engine=%s at http://%s:%d (loaded in %.1f s)",
                cfg.model.served_model_name, cfg.model.model, dtype, num_blocks, cfg.cache.block_size,
                cfg.model.max_model_len, sc.max_num_seqs, sc.max_num_batched_tokens,
                "" if sc.enable_chunked_prefill else " (no chunked prefill)",
                f" long_prefill_token_threshold={sc.long_prefill_token_threshold}"
                if sc.long_prefill_token_threshold else "", engine.engine_mode, ns.host, ns.port,
                time.perf_counter() - t0)
    server.run()
    engine.shutdown()
    if exit_code:
        logger.error("pagedllm server stopped: the engine died (exit %d)", exit_code)
    else:
        logger.info("pagedllm server stopped")
    return exit_code
