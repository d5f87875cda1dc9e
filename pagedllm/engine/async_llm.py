"""AsyncLLM: drives the synchronous ``LLMEngine`` from a background thread for the asyncio server.

Threads and ownership:
- The *engine thread* is the only one that touches the engine's mutable state (scheduler, KV blocks, output
  processor). It loops: take the inbox -> add/abort requests -> ``step()`` -> hand the step's outputs to the event
  loop in one ``call_soon_threadsafe`` -> update metrics. With nothing to do it sleeps on a ``Condition``; a new
  request or abort wakes it. No busy-wait.
- The *event loop thread* validates and tokenizes prompts (``process_prompt`` / ``validate_params`` only read the
  config and the tokenizer), so a bad request fails in its caller before anything is queued or streamed, and the
  engine step never waits on tokenization. Each request gets a ``RequestOutputCollector`` (its queue).
- Aborts (client gone, generator closed or cancelled) go through the inbox; the engine thread applies them before
  its next step, so the request's KV blocks are free within one step.
- If the engine thread raises, the engine is dead: every in-flight request gets ``EngineDeadError``, new ones are
  refused, and ``is_dead`` turns true (the server's ``/health`` answers 503).

The engine always runs requests in DELTA mode, whatever the caller asked: the collector merges deltas for a consumer
that is behind (a slow client gets fewer, larger chunks instead of a backlog) and for FINAL_ONLY callers delivers
only the merged final output. This also lets the metrics see every token's arrival for every request.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional

from pagedllm.engine.llm_engine import LLMEngine, ProcessedPrompt, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "RequestOutputCollector"]

# A step that returns nothing this fast did no work (e.g. a waiting request that can't be scheduled yet); the engine
# thread then waits this long (or until the inbox changes) instead of spinning.
_EMPTY_STEP_S = 0.001
_EMPTY_STEP_BACKOFF_S = 0.01


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (it crashed or was shut down); no request can be served."""


def _merge_output(dst: RequestOutput, src: RequestOutput) -> None:
    """Appends the DELTA output ``src`` to ``dst`` (which then covers both), choice by choice."""
    by_index = {c.index: c for c in dst.outputs}
    for c in src.outputs:
        d = by_index.get(c.index)
        if d is None:
            dst.outputs.append(c)
            by_index[c.index] = c
            continue
        d.text += c.text
        d.token_ids = d.token_ids + c.token_ids
        if c.logprobs is not None:
            d.logprobs = (d.logprobs or []) + c.logprobs
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


class AsyncLLM:
    """Async front of an ``LLMEngine`` whose loop runs in a background thread.

    Args:
        engine: the ``LLMEngine`` to drive; from now on only the engine thread may call its mutating methods.
        log_stats: keep Prometheus metrics (``self.metrics``, an ``EngineMetrics`` with its own registry).
    """

    def __init__(self, engine: LLMEngine, log_stats: bool = True) -> None:
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.metrics = None
        if log_stats:
            from pagedllm.metrics import EngineMetrics

            mc = engine.config.model
            self.metrics = EngineMetrics(mc.served_model_name, mc.max_model_len)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []
        self._stopping = False
        self._dead: Optional[EngineDeadError] = None
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args, log_stats: bool = True) -> "AsyncLLM":
        return cls(LLMEngine.from_engine_args(args), log_stats=log_stats)

    # ------------------------------------------------------------------ state
    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> Optional[EngineDeadError]:
        return self._dead

    def check_health(self) -> None:
        """Raises ``EngineDeadError`` if the engine thread is not running."""
        if self._dead is not None:
            raise self._dead
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")

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

    def _submit(self, item: tuple) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

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
            EngineDeadError: the engine thread stopped.
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
        self._submit(("add", request_id, pp, engine_params, arrival_time, cache_salt))
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
                    self._submit(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        """Aborts a request (its generator, if still iterated, then waits forever: prefer closing it)."""
        self._bind_loop()
        self._collectors.pop(request_id, None)
        self._submit(("abort", request_id))

    async def call_in_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs ``fn(engine)`` on the engine thread between two steps and returns its result."""
        loop = self._bind_loop()
        if self._dead is not None:
            raise self._dead
        fut = loop.create_future()
        self._submit(("call", fn, fut))
        return await fut

    async def reset_prefix_cache(self) -> bool:
        return await self.call_in_engine(lambda eng: eng.reset_prefix_cache())

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine thread (after its current step); in-flight requests get ``EngineDeadError``."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ event loop callbacks
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

    @staticmethod
    def _set_future(fut: asyncio.Future, result: Any, exc: Optional[BaseException]) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _post(self, fn: Callable, *args: Any) -> None:
        """Schedules ``fn(*args)`` on the event loop (from the engine thread)."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: nobody is left to tell

    # ------------------------------------------------------------------ engine thread
    def _process_inbox(self, inbox: list[tuple], outputs: list[RequestOutput]) -> None:
        eng = self.engine
        for item in inbox:
            kind = item[0]
            if kind == "add":
                _, rid, pp, params, arrival, salt = item
                try:
                    eng.add_request(rid, pp, params, arrival_time=arrival, cache_salt=salt)
                except ValueError as e:
                    self._post(self._fail, rid, e)
            elif kind == "abort":
                outputs.extend(eng.abort_request(item[1]))
            else:  # "call"
                _, fn, fut = item
                try:
                    result, exc = fn(eng), None
                except Exception as e:  # the caller gets it; the engine is fine
                    result, exc = None, e
                self._post(self._set_future, fut, result, exc)

    def _run(self) -> None:
        eng = self.engine
        cond = self._cond
        metrics = self.metrics
        backoff = 0.0
        try:
            while True:
                with cond:
                    if backoff and not self._inbox and not self._stopping:
                        cond.wait(backoff)
                    while not self._inbox and not self._stopping and not eng.has_unfinished_requests():
                        cond.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                outputs: list[RequestOutput] = []
                if inbox:
                    self._process_inbox(inbox, outputs)
                backoff = 0.0
                if eng.has_unfinished_requests():
                    t0 = time.perf_counter()
                    step_outputs = eng.step()
                    if not step_outputs and time.perf_counter() - t0 < _EMPTY_STEP_S:
                        backoff = _EMPTY_STEP_BACKOFF_S
                    outputs.extend(step_outputs)
                if outputs:
                    self._post(self._deliver, outputs)
                if metrics is not None:
                    metrics.record_outputs(outputs, time.time())
                    metrics.record_scheduler_stats(eng.engine_core.make_stats())
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine; tell everyone
            logger.exception("engine thread crashed")
            err = EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}")
            err.__cause__ = e
            self._dead = err
            self._post(self._fail_all, err)
            self._fail_pending_calls(err)
            return
        err = EngineDeadError("the engine was shut down")
        self._dead = err
        self._post(self._fail_all, err)
        self._fail_pending_calls(err)

    def _fail_pending_calls(self, err: EngineDeadError) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if item[0] == "call":
                self._post(self._set_future, item[2], None, err)
