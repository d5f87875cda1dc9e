"""AsyncLLM: drives the synchronous ``LLMEngine`` beside the asyncio event loop, for the server.

Where the engine loop runs (``engine_mode``):
- "thread" (default): a thread of this process. Only it touches the engine's mutable state (scheduler, KV blocks,
  output processor). It loops: take the inbox -> add/abort requests -> ``step()`` -> hand the step's outputs to the
  event loop in one ``call_soon_threadsafe`` -> update metrics. With nothing to do it sleeps on a ``Condition``;
  a new request or abort wakes it. No busy-wait.
- "process": the same loop in a spawned child process (requests down one pipe, step outputs and scheduler stats
  back up another, read by a thread here). Measured with 16 concurrent streams on this 2-core machine (shared with
  other jobs, load ~9): no difference beyond run-to-run noise, so the simpler thread is the default.

The *event loop thread* validates and tokenizes prompts (``process_prompt`` / ``validate_params`` only read the
config and the tokenizer), so a bad request fails in its caller before anything is queued or streamed, and the
engine step never waits on tokenization. Each request gets a ``RequestOutputCollector`` (its queue).
Aborts (client gone, generator closed or cancelled) go through the inbox; the engine loop applies them before its
next step, so the request's KV blocks are free within one step. If the loop raises (or the child dies), the engine
is dead: every in-flight request gets ``EngineDeadError``, new ones are refused, and ``is_dead`` turns true (the
server's ``/health`` answers 503).

The engine always runs requests in DELTA mode, whatever the caller asked: the collector merges deltas for a consumer
that is behind (a slow client gets fewer, larger chunks instead of a backlog) and for FINAL_ONLY callers delivers
only the merged final output. This also lets the metrics see every token's arrival for every request.

Note on torch threads: the thread that steps the engine also builds it (model load included), in both modes. libgomp
keeps one OpenMP thread pool per thread that starts parallel regions, and once it manages more threads than there
are CPUs it cuts every worker's spin-wait to a "throttled" count. A pool left in the main thread by loading the model
there (2 masters + 2 workers on this 2-core machine) made every decode step of the engine thread wait for sleeping
workers: SmolLM2 int4, batch 1, step median 18.4-19.2 ms, vs 11.6-13.2 ms with the engine built in its stepping
thread and 11.3-12.0 ms offline (one quiet period, interleaved runs). ``pagedllm serve``
bounds the spin itself (``GOMP_SPINCOUNT``, see ``entrypoints/cli.py``) for the cores it shares with its clients.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional

from pagedllm.engine.llm_engine import LLMEngine, ProcessedPrompt, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "RequestOutputCollector"]

# A step that returns nothing this fast did no work (e.g. a waiting request that can't be scheduled yet); the loop
# then waits this long (or until the inbox changes) instead of spinning.
_EMPTY_STEP_S = 0.001
_EMPTY_STEP_BACKOFF_S = 0.01


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (it crashed or was shut down); no request can be served."""


def _merge_output(dst: RequestOutput, src: RequestOutput) -> None:
    """Appends the DELTA output ``src`` to ``dst`` (which then covers both), choice by choice."""
    by_index = {c.index: c for c in dst.outputs}
    for c in src.outputs:
        d = by_index.get(c.index)
        if d is None:
            dst.outputs.append(c)
            by_index[c.index] = c
            continue
        # DELTA lists are fresh slices owned by this output, so extending them in place is safe.
        d.text += c.text
        d.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if d.logprobs is None:
                d.logprobs = []
            d.logprobs.extend(c.logprobs)
        d.cumulative_logprob = c.cumulative_logprob
        d.finish_reason = c.finish_reason
        d.stop_reason = c.stop_reason
    dst.finished = src.finished
    dst.num_cached_tokens = src.num_cached_tokens
    dst.metrics = src.metrics
    if src.prompt_logprobs is not None:
        dst.prompt_logprobs = src.prompt_logprobs


class RequestOutputCollector:
    """One request's queue. ``put`` (event loop thread) merges into what the consumer hasn't taken yet."""

    __slots__ = ("kind", "output", "ready")

    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self.output: Optional[RequestOutput | BaseException] = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self.output, BaseException):
            return  # an error is final
        if isinstance(item, BaseException) or self.output is None:
            self.output = item
        else:
            _merge_output(self.output, item)
        if self.kind != RequestOutputKind.FINAL_ONLY or isinstance(item, BaseException) or item.finished:
            self.ready.set()

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        out = self.output
        self.output = None
        self.ready.clear()
        if isinstance(out, BaseException):
            raise out
        return out


# ---------------------------------------------------------------------------------------------------- engine side
# Messages into the engine loop: ("add", request_id, ProcessedPrompt, SamplingParams, arrival_time, cache_salt),
# ("abort", request_id), ("call", method_name, args, call_id). Messages out of it (to ``AsyncLLM._on_engine``):
# ("step", outputs, SchedulerStats, time), ("add_error", request_id, exc), ("result", call_id, result, exc).
_CALLABLE = frozenset({"reset_prefix_cache"})


def _engine_loop(engine: LLMEngine, get_inbox: Callable[[bool, float], Optional[list]],
                 emit: Callable[[tuple], None]) -> None:
    """Runs until ``get_inbox`` returns None (stop). ``get_inbox(block, timeout)``: with ``block``, wait until a
    message (or stop) arrives; else wait at most ``timeout`` s (0: don't wait) and return what is there."""
    backoff = 0.0
    while True:
        idle = not engine.has_unfinished_requests()
        inbox = get_inbox(idle, backoff)
        if inbox is None:
            return
        outputs: list[RequestOutput] = []
        for item in inbox:
            kind = item[0]
            if kind == "add":
                _, rid, pp, params, arrival, salt = item
                try:
                    engine.add_request(rid, pp, params, arrival_time=arrival, cache_salt=salt)
                except ValueError as e:
                    emit(("add_error", rid, e))
            elif kind == "abort":
                outputs.extend(engine.abort_request(item[1]))
            elif kind == "call":
                _, name, args, call_id = item
                try:
                    if name not in _CALLABLE:
                        raise ValueError(f"engine method {name!r} can't be called remotely")
                    result, exc = getattr(engine, name)(*args), None
                except Exception as e:  # noqa: BLE001 - the caller gets it; the engine is fine
                    result, exc = None, e
                emit(("result", call_id, result, exc))
        backoff = 0.0
        if engine.has_unfinished_requests():
            t0 = time.perf_counter()
            step_outputs = engine.step()
            if not step_outputs and time.perf_counter() - t0 < _EMPTY_STEP_S:
                backoff = _EMPTY_STEP_BACKOFF_S
            outputs.extend(step_outputs)
        emit(("step", outputs, engine.engine_core.make_stats(), time.time()))


class _ThreadBackend:
    """The engine loop in a thread of this process; the inbox is a list guarded by a Condition."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], on_message: Callable[[tuple], None],
                 on_dead: Callable[[EngineDeadError], None]) -> None:
        """``engine``: an engine, or a function that builds one; it is then called in the engine thread (see the
        module note on torch threads) and its exception, if any, is raised here."""
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []
        self._stopping = False
        self._on_message = on_message
        self._on_dead = on_dead
        self._built = threading.Event()
        self._build_error: Optional[BaseException] = None
        factory = engine if callable(engine) and not hasattr(engine, "step") else None
        self.engine = None if factory is not None else engine
        self.thread = threading.Thread(target=self._run, args=(factory,), name="pagedllm-engine", daemon=True)
        self.thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        self.num_kv_blocks = self.engine.engine_core.num_blocks
        executor = getattr(self.engine.engine_core, "executor", None)
        if executor is not None:  # a worker process that dies while the engine is idle is reported at once
            executor.on_death(on_dead)

    def submit(self, item: tuple) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    def _get_inbox(self, block: bool, timeout: float) -> Optional[list]:
        with self._cond:
            if block:
                while not self._inbox and not self._stopping:
                    self._cond.wait()
            elif timeout and not self._inbox and not self._stopping:
                self._cond.wait(timeout)
            if self._stopping:
                return None
            inbox, self._inbox = self._inbox, []
            return inbox

    def _run(self, factory: Optional[Callable[[], LLMEngine]]) -> None:
        if factory is not None:
            try:
                self.engine = factory()
            except BaseException as e:  # noqa: BLE001 - raised in the constructor's thread
                self._build_error = e
        self._built.set()
        if self._build_error is not None:
            return
        try:
            _engine_loop(self.engine, self._get_inbox, self._on_message)
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine; tell everyone
            logger.exception("engine thread crashed")
            err = EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}")
            err.__cause__ = e
            self._on_dead(err)
            return
        self._on_dead(EngineDeadError("the engine was shut down"))

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def shutdown(self, timeout: float) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
            executor = getattr(self.engine.engine_core, "executor", None)
            if executor is not None and not self.thread.is_alive():
                executor.shutdown()  # the worker processes of a parallel engine


def _engine_process_main(config, requests, replies) -> None:
    """Child process: builds the engine from ``config`` and runs the loop over two pipes, both in one non-main
    thread (see the module note on torch threads)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        with send_lock:
            replies.send(msg)

    def get_inbox(block: bool, timeout: float) -> Optional[list]:
        items = []
        if block or timeout:
            if not requests.poll(None if block else timeout):
                return items
        while requests.poll(0):
            item = requests.recv()
            if item[0] == "stop":
                return None
            items.append(item)
        return items

    def run() -> None:
        try:
            engine = LLMEngine(config)
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
            replies.send(("failed", f"{type(e).__name__}: {e}"))
            return
        send(("ready", engine.engine_core.num_blocks))
        executor = engine.engine_core.executor
        if executor is not None:  # a dead worker (also while idle) takes the engine down
            executor.on_death(lambda err: send(("dead", str(err))))
        try:
            _engine_loop(engine, get_inbox, send)
        except EOFError:
            return  # the parent is gone
        except BaseException as e:  # noqa: BLE001
            logger.exception("engine process crashed")
            try:
                send(("dead", f"{type(e).__name__}: {e}"))
            except OSError:
                pass

    t = threading.Thread(target=run, name="pagedllm-engine")
    t.start()
    t.join()


class _ProcessBackend:
    """The engine loop in a child process (spawned: no forked torch state). Requests go down one pipe; a reader
    thread here receives step outputs from the other and hands them to ``on_message``."""

    def __init__(self, config, on_message: Callable[[tuple], None],
                 on_dead: Callable[[EngineDeadError], None]) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        req_r, self._req_w = ctx.Pipe(duplex=False)
        self._rep_r, rep_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_engine_process_main, args=(config, req_r, rep_w), name="pagedllm-engine",
                                # a daemon can't start the worker processes of a tensor/pipeline-parallel engine
                                daemon=not config.parallel.is_parallel)
        self.proc.start()
        req_r.close()
        rep_w.close()
        try:
            msg = self._rep_r.recv()
        except EOFError:
            msg = ("failed", f"exit code {self.proc.exitcode}")
        if msg[0] != "ready":
            self.proc.join(5)
            raise RuntimeError(f"the engine process failed to start: {msg[1]}")
        self.num_kv_blocks = msg[1]
        self._send_lock = threading.Lock()
        self._on_message = on_message
        self._on_dead = on_dead
        self._stopping = False
        self.thread = threading.Thread(target=self._read, name="pagedllm-engine-reader", daemon=True)
        self.thread.start()

    def submit(self, item: tuple) -> None:
        try:
            with self._send_lock:
                self._req_w.send(item)
        except OSError:
            pass  # the child is gone; the reader reports it

    def _read(self) -> None:
        try:
            while True:
                msg = self._rep_r.recv()
                if msg[0] == "dead":
                    self._on_dead(EngineDeadError(f"the engine stopped: {msg[1]}"))
                    return
                self._on_message(msg)
        except (EOFError, OSError):
            reason = "was shut down" if self._stopping else f"process exited ({self.proc.exitcode})"
            self._on_dead(EngineDeadError(f"the engine {reason}"))

    def is_alive(self) -> bool:
        return self.proc.is_alive() and self.thread.is_alive()

    def shutdown(self, timeout: float) -> None:
        self._stopping = True
        self.submit(("stop",))
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


class _Frontend:
    """What the caller side needs from the engine in process mode: config, tokenizer, prompt validation."""

    process_prompt = LLMEngine.process_prompt
    validate_params = LLMEngine.validate_params

    def __init__(self, config) -> None:
        from pagedllm.tokenizer import get_tokenizer

        self.config = config
        self.tokenizer = get_tokenizer(config.model.tokenizer)


# ---------------------------------------------------------------------------------------------------- caller side
class AsyncLLM:
    """Async front of an ``LLMEngine`` whose loop runs beside the event loop.

    Args:
        engine: run this ``LLMEngine`` in a background thread (from now on only that thread may mutate it), or a
            function that builds one, called in that thread (faster steps: see the module note on torch threads).
        log_stats: keep Prometheus metrics (``self.metrics``, an ``EngineMetrics`` with its own registry).
        config: instead of ``engine``: an ``EngineConfig``; the engine is built and run in a child process.
    """

    def __init__(self, engine: Optional[LLMEngine | Callable[[], LLMEngine]] = None, log_stats: bool = True, *,
                 config=None) -> None:
        if (engine is None) == (config is None):
            raise ValueError("give either engine (thread mode) or config (process mode)")
        self.engine_mode = "thread" if engine is not None else "process"
        self.metrics = None  # set below, once the config is known (no request can arrive before that)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._dead: Optional[EngineDeadError] = None
        if engine is not None:
            self._backend = _ThreadBackend(engine, self._on_engine, self._on_dead)
            self.engine = self._backend.engine
        else:
            self._backend = _ProcessBackend(config, self._on_engine, self._on_dead)
            self.engine = _Frontend(config)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        if log_stats:
            from pagedllm.metrics import EngineMetrics

            mc = self.config.model
            self.metrics = EngineMetrics(mc.served_model_name, mc.max_model_len)

    @classmethod
    def from_engine_args(cls, args, log_stats: bool = True, engine_mode: str = "thread") -> "AsyncLLM":
        """``engine_mode``: "thread" (the engine steps in a thread of this process) or "process" (a child)."""
        if engine_mode == "process":
            return cls(config=args.create_engine_config(), log_stats=log_stats)
        if engine_mode != "thread":
            raise ValueError(f"engine_mode must be 'thread' or 'process', got {engine_mode!r}.")
        return cls(lambda: LLMEngine.from_engine_args(args), log_stats=log_stats)

    # ------------------------------------------------------------------ state
    @property
    def num_kv_blocks(self) -> int:
        return self._backend.num_kv_blocks

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> Optional[EngineDeadError]:
        return self._dead

    def check_health(self) -> None:
        """Raises ``EngineDeadError`` if the engine loop is not running."""
        if self._dead is not None:
            raise self._dead
        if not self._backend.is_alive():
            raise EngineDeadError("the engine is not running")

    @property
    def num_in_flight(self) -> int:
        return len(self._collectors)

    # ------------------------------------------------------------------ caller side (event loop thread)
    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Tokenizes and validates ``prompt`` in the caller's thread. Raises ValueError naming the field."""
        return self.engine.process_prompt(prompt)

    def validate_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """Raises ValueError naming the field."""
        self.engine.validate_params(params, num_prompt_tokens)

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("AsyncLLM is bound to another event loop")
        return loop

    async def generate(
        self,
        prompt: PromptType | ProcessedPrompt,
        params: SamplingParams,
        request_id: str,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs as the engine produces them (DELTA: only what is new; FINAL_ONLY: one
        output; CUMULATIVE: everything so far), the last one with ``finished=True``.

        Closing or cancelling the iterator before it finishes aborts the request.

        Raises:
            ValueError: bad prompt or parameters (before anything is queued), or a duplicate ``request_id``.
            EngineDeadError: the engine stopped.
        """
        self._bind_loop()
        if self._dead is not None:
            raise self._dead
        if request_id in self._collectors:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        pp = prompt if isinstance(prompt, ProcessedPrompt) else self.engine.process_prompt(prompt)
        self.engine.validate_params(params, len(pp.prompt_token_ids))
        kind = params.output_kind
        engine_params = copy.copy(params)
        engine_params.output_kind = RequestOutputKind.DELTA
        arrival_time = time.time() if arrival_time is None else arrival_time
        collector = RequestOutputCollector(kind)
        self._collectors[request_id] = collector
        self._backend.submit(("add", request_id, pp, engine_params, arrival_time, cache_salt))
        finished = False
        total: Optional[RequestOutput] = None
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                if kind == RequestOutputKind.CUMULATIVE:
                    if total is None:
                        total = out
                    else:
                        _merge_output(total, out)
                    out = copy.deepcopy(total)
                yield out
        finally:
            if not finished:
                self._collectors.pop(request_id, None)
                if self._dead is None:
                    self._backend.submit(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        """Aborts a request (its generator, if still iterated, then waits forever: prefer closing it)."""
        self._bind_loop()
        self._collectors.pop(request_id, None)
        self._backend.submit(("abort", request_id))

    async def call_in_engine(self, method: str, *args: Any) -> Any:
        """Runs ``engine.<method>(*args)`` in the engine loop between two steps and returns its result."""
        loop = self._bind_loop()
        if self._dead is not None:
            raise self._dead
        call_id = next(self._call_ids)
        fut = self._calls[call_id] = loop.create_future()
        self._backend.submit(("call", method, args, call_id))
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    async def reset_prefix_cache(self) -> bool:
        return await self.call_in_engine("reset_prefix_cache")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine loop (after its current step); in-flight requests get ``EngineDeadError``."""
        self._backend.shutdown(timeout)

    # ------------------------------------------------------------------ engine side -> event loop
    def _on_engine(self, msg: tuple) -> None:
        """A message from the engine loop; runs on the engine thread (or the process backend's reader thread)."""
        kind = msg[0]
        if kind == "step":
            _, outputs, stats, now = msg
            if outputs:
                self._post(self._deliver, outputs)
            if self.metrics is not None:
                self.metrics.record_outputs(outputs, now)
                self.metrics.record_scheduler_stats(stats)
        elif kind == "add_error":
            self._post(self._fail, msg[1], msg[2])
        elif kind == "result":
            self._post(self._resolve_call, msg[1], msg[2], msg[3])

    def _on_dead(self, err: EngineDeadError) -> None:
        self._dead = err
        self._post(self._fail_all, err)

    def _post(self, fn: Callable, *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: nobody is left to tell

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        collectors = self._collectors
        for ro in outputs:
            c = collectors.get(ro.request_id)
            if c is None:
                continue  # aborted: nobody is listening
            if ro.finished:
                del collectors[ro.request_id]
            c.put(ro)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        c = self._collectors.pop(request_id, None)
        if c is not None:
            c.put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        collectors, self._collectors = self._collectors, {}
        for c in collectors.values():
            c.put(exc)
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(exc)

    def _resolve_call(self, call_id: int, result: Any, exc: Optional[BaseException]) -> None:
        fut = self._calls.get(call_id)
        if fut is None or fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
