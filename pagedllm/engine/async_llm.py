"""AsyncLLM: drives the synchronous ``LLMEngine`` beside the asyncio event loop, for the server.

Where the engine loop runs (``engine_mode``):
- "thread" (default): a thread of this process. Only it touches the engine's mutable state (scheduler, KV blocks,
  output processor). It loops: take the inbox -> add/abort requests -> ``step()`` -> hand the step's outputs to the
  event loop in one ``call_soon_threadsafe`` -> update metrics. With nothing to do it sleeps on a ``Condition``;
  a new request or abort wakes it. No busy-wait.
- "process": the same loop in a spawned child process (requests down one pipe, step outputs and scheduler stats
  back up another, read by a thread here). Measured with 16 concurrent streams on this 2-core machine (shared with
  other jobs, load ~9): no difference beyond run-to-run noise, so the simpler thread is the default.

The *event loop thread* runs the ``InputProcessor`` (it only reads the config and the tokenizer): a request is
validated and tokenized into a typed ``EngineCoreRequest`` there, so a bad request fails in its caller before
anything is queued or streamed, the engine thread never sees unvalidated input, and the step never waits on
tokenization. Messages into the engine loop are typed (``AddRequest``, ``AbortRequest``, ``UtilityCall``), and so
are those out of it (``StepOutputs``, ``AddError``, ``CallResult``). Each request gets a
``RequestOutputCollector`` (its queue).

Admission is bounded (vLLM's ``--max-num-queued-reqs`` / ``--max-num-queued-tokens``): a request counts as queued
from ``generate`` until its first output (or its end); past either bound ``generate`` raises ``QueueFullError``
(the server's 429), unless the queue is empty (so one large request is never refused forever).
A request whose own processing raises in the engine fails alone (``RequestFailedError``, see ``llm_engine``).
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

from dataclasses import dataclass, field

from pagedllm.engine.exceptions import (
    EngineDeadError,
    EngineShuttingDownError,
    InvalidRequestError,
    QueueFullError,
)
from pagedllm.engine.input_processor import EngineCoreRequest, InputProcessor, ProcessedPrompt, PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AbortRequest", "AddError", "AddRequest", "AsyncLLM", "CallResult", "EngineDeadError",
           "RequestOutputCollector", "StepOutputs", "UtilityCall"]

# A step that returns nothing this fast did no work (e.g. a waiting request that can't be scheduled yet); the loop
# then waits this long (or until the inbox changes) instead of spinning.
_EMPTY_STEP_S = 0.001
_EMPTY_STEP_BACKOFF_S = 0.01


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
# Messages into the engine loop.
@dataclass
class AddRequest:
    request: EngineCoreRequest  # validated by the InputProcessor


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class UtilityCall:
    method: str  # one of _CALLABLE
    args: tuple
    call_id: int


# Messages out of it (to ``AsyncLLM._on_engine``).
@dataclass
class StepOutputs:
    outputs: list[RequestOutput]
    stats: Any  # SchedulerStats
    time: float
    errors: list = field(default_factory=list)  # (request_id, RequestFailedError): requests that failed alone


@dataclass
class AddError:
    request_id: str
    error: BaseException


@dataclass
class CallResult:
    call_id: int
    result: Any
    error: Optional[BaseException]


_CALLABLE = frozenset({"reset_prefix_cache", "warm_up_structured_outputs"})


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
            if isinstance(item, AddRequest):
                try:
                    engine.add_core_request(item.request)
                except Exception as e:  # noqa: BLE001 - this request's set-up failed; nothing was queued
                    emit(AddError(item.request.request_id, e))
            elif isinstance(item, AbortRequest):
                outputs.extend(engine.abort_request(item.request_id))
            elif isinstance(item, UtilityCall):
                try:
                    if item.method not in _CALLABLE:
                        raise ValueError(f"engine method {item.method!r} can't be called remotely")
                    result, exc = getattr(engine, item.method)(*item.args), None
                except Exception as e:  # noqa: BLE001 - the caller gets it; the engine is fine
                    result, exc = None, e
                emit(CallResult(item.call_id, result, exc))
        backoff = 0.0
        errors: list = []
        if engine.has_unfinished_requests():
            t0 = time.perf_counter()
            step_outputs = engine.step()  # a fault here (the forward) is no one request's: it ends the loop
            if not step_outputs and time.perf_counter() - t0 < _EMPTY_STEP_S:
                backoff = _EMPTY_STEP_BACKOFF_S
            outputs.extend(step_outputs)
            errors = engine.take_request_errors()
        emit(StepOutputs(outputs, engine.engine_core.make_stats(), time.time(), errors))


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

    def submit(self, item: Any) -> None:
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
            if item == ("stop",):
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

    def submit(self, item: Any) -> None:
        try:
            with self._send_lock:
                self._req_w.send(item)
        except OSError:
            pass  # the child is gone; the reader reports it

    def _read(self) -> None:
        try:
            while True:
                msg = self._rep_r.recv()
                if isinstance(msg, tuple) and msg[0] == "dead":
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
    """What the caller side needs from the engine in process mode: config and tokenizer."""

    def __init__(self, config) -> None:
        from pagedllm.tokenizer import get_tokenizer

        self.config = config
        self.tokenizer = get_tokenizer(config.model.tokenizer)


# ---------------------------------------------------------------------------------------------------- caller side
class RequestStream:
    """The outputs of one request (``AsyncLLM.add_request``): an async iterator; ``aclose()`` (or an error)
    before the last output aborts the request."""

    __slots__ = ("_llm", "request_id", "_collector", "_kind", "_total", "_done")

    def __init__(self, llm: "AsyncLLM", request_id: str, collector: RequestOutputCollector,
                 kind: RequestOutputKind) -> None:
        self._llm = llm
        self.request_id = request_id
        self._collector = collector
        self._kind = kind
        self._total: Optional[RequestOutput] = None
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._collector.get()
        except BaseException:
            self._done = True
            self._llm.abort_stream(self.request_id)
            raise
        if out.finished:
            self._done = True
            self._llm._unqueue(self.request_id)
        if self._kind == RequestOutputKind.CUMULATIVE:
            if self._total is None:
                self._total = out
            else:
                _merge_output(self._total, out)
            out = copy.deepcopy(self._total)
        return out

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._llm.abort_stream(self.request_id)


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
        self._draining = False
        # Admission queue (see the module note): request id -> (children, prompt tokens of all children).
        self._queued: dict[str, tuple[int, int]] = {}
        self._num_queued_reqs = 0
        self._num_queued_tokens = 0
        self._last_progress = time.monotonic()  # the last step's end, or when work arrived at an idle engine
        if engine is not None:
            self._backend = _ThreadBackend(engine, self._on_engine, self._on_dead)
            self.engine = self._backend.engine
        else:
            self._backend = _ProcessBackend(config, self._on_engine, self._on_dead)
            self.engine = _Frontend(config)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.limits = self.input_processor.limits
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

    @property
    def num_queued(self) -> tuple[int, int]:
        """(requests, prompt tokens) admitted but not yet producing output."""
        return self._num_queued_reqs, self._num_queued_tokens

    def seconds_since_progress(self) -> float:
        """Seconds the engine has had work without finishing a step (0 when it has none): the ``/health``
        watchdog's measure."""
        if not self._collectors:
            return 0.0
        return max(0.0, time.monotonic() - self._last_progress)

    @property
    def is_draining(self) -> bool:
        return self._draining

    # ------------------------------------------------------------------ caller side (event loop thread)
    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Tokenizes and validates ``prompt`` in the caller's thread. Raises ValueError naming the field."""
        return self.input_processor.process_prompt(prompt)

    def validate_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """Raises ValueError naming the field."""
        self.input_processor.process_params(params, num_prompt_tokens)

    def _admit(self, request_id: str, n: int, num_prompt_tokens: int) -> None:
        """Counts the request into the admission queue, or raises ``QueueFullError``."""
        lim = self.limits
        reqs, toks = self._num_queued_reqs, self._num_queued_tokens
        tokens = n * num_prompt_tokens
        if reqs and ((lim.max_num_queued_reqs and reqs + n > lim.max_num_queued_reqs)
                     or (lim.max_num_queued_tokens and toks + tokens > lim.max_num_queued_tokens)):
            raise QueueFullError(
                f"the server's request queue is full ({reqs} requests, {toks} prompt tokens waiting; "
                f"--max-num-queued-reqs={lim.max_num_queued_reqs}, --max-num-queued-tokens="
                f"{lim.max_num_queued_tokens}); retry later.")
        self._queued[request_id] = (n, tokens)
        self._num_queued_reqs = reqs + n
        self._num_queued_tokens = toks + tokens

    def _unqueue(self, request_id: str) -> None:
        q = self._queued.pop(request_id, None)
        if q is not None:
            self._num_queued_reqs -= q[0]
            self._num_queued_tokens -= q[1]

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("AsyncLLM is bound to another event loop")
        return loop

    def add_request(
        self,
        prompt: PromptType | ProcessedPrompt,
        params: SamplingParams,
        request_id: str,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
    ) -> "RequestStream":
        """Validates the request (``InputProcessor``), admits it (the bounded queue) and queues it, now; returns
        the stream of its outputs. Nothing is queued if it raises. Must run on the event loop's thread.

        Raises:
            ValueError (``InvalidRequestError``): bad prompt or parameters, or a duplicate ``request_id``.
            QueueFullError: the admission queue is full.
            EngineShuttingDownError: the server is draining.
            EngineDeadError: the engine stopped.
        """
        self._bind_loop()
        if self._dead is not None:
            raise self._dead
        if self._draining:
            raise EngineShuttingDownError("the server is shutting down; no new requests are admitted.")
        if request_id in self._collectors:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use.", param="request_id")
        kind = params.output_kind
        engine_params = copy.copy(params)
        engine_params.output_kind = RequestOutputKind.DELTA
        request = self.input_processor.make_request(request_id, prompt, engine_params, arrival_time, cache_salt)
        self._admit(request_id, params.n, len(request.prompt_token_ids))
        collector = RequestOutputCollector(kind)
        if not self._collectors:
            self._last_progress = time.monotonic()
        self._collectors[request_id] = collector
        self._backend.submit(AddRequest(request))
        return RequestStream(self, request_id, collector, kind)

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
            QueueFullError, EngineShuttingDownError: not admitted (see ``add_request``).
            RequestFailedError: the request's own processing failed in the engine (the engine runs on).
            EngineDeadError: the engine stopped.
        """
        stream = self.add_request(prompt, params, request_id, arrival_time, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort_stream(self, request_id: str) -> None:
        """A stream closed before its request finished: abort the request."""
        self._unqueue(request_id)
        self._collectors.pop(request_id, None)
        if self._dead is None:
            self._backend.submit(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        """Aborts a request (its generator, if still iterated, then waits forever: prefer closing it)."""
        self._bind_loop()
        self._collectors.pop(request_id, None)
        self._unqueue(request_id)
        self._backend.submit(AbortRequest(request_id))

    async def call_in_engine(self, method: str, *args: Any) -> Any:
        """Runs ``engine.<method>(*args)`` in the engine loop between two steps and returns its result."""
        loop = self._bind_loop()
        if self._dead is not None:
            raise self._dead
        call_id = next(self._call_ids)
        fut = self._calls[call_id] = loop.create_future()
        self._backend.submit(UtilityCall(method, args, call_id))
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    async def reset_prefix_cache(self) -> bool:
        return await self.call_in_engine("reset_prefix_cache")

    def start_draining(self) -> None:
        """Stops admission: from now on ``generate`` raises ``EngineShuttingDownError`` (the server's 503)."""
        self._draining = True

    async def drain(self, timeout: float) -> int:
        """Stops admission and waits up to ``timeout`` s for the requests in flight to finish; the rest then end
        with ``EngineDeadError`` (a stream gets an error event and ``[DONE]``). Returns how many were cut."""
        self._bind_loop()
        self._draining = True
        deadline = time.monotonic() + timeout
        while self._collectors and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cut = len(self._collectors)
        if cut:
            self._fail_all(EngineDeadError(f"the server shut down before this request finished "
                                           f"(--graceful-shutdown-timeout={timeout:g} s)."))
            await asyncio.sleep(0)  # let the streams take their error
        return cut

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine loop (after its current step); in-flight requests get ``EngineDeadError``."""
        self._backend.shutdown(timeout)

    # ------------------------------------------------------------------ engine side -> event loop
    def _on_engine(self, msg: tuple) -> None:
        """A message from the engine loop; runs on the engine thread (or the process backend's reader thread)."""
        if isinstance(msg, StepOutputs):
            self._last_progress = time.monotonic()
            if self.metrics is not None:  # first: a client never sees a token its /metrics don't count yet
                self.metrics.record_outputs(msg.outputs, msg.time)
                self.metrics.record_scheduler_stats(msg.stats)
            for rid, err in msg.errors:  # before the outputs, so the failed request's final output finds no one
                self._post(self._fail, rid, err)
            if msg.outputs:
                self._post(self._deliver, msg.outputs)
        elif isinstance(msg, AddError):
            self._post(self._fail, msg.request_id, msg.error)
        elif isinstance(msg, CallResult):
            self._post(self._resolve_call, msg.call_id, msg.result, msg.error)

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
            if ro.request_id in self._queued:
                self._unqueue(ro.request_id)
            if ro.finished:
                del collectors[ro.request_id]
            c.put(ro)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        self._unqueue(request_id)
        c = self._collectors.pop(request_id, None)
        if c is not None:
            c.put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        collectors, self._collectors = self._collectors, {}
        self._queued.clear()
        self._num_queued_reqs = self._num_queued_tokens = 0
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
