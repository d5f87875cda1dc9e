"""Structured outputs in the engine: compile off the engine thread, one matcher per request, one bitmask per step.

Life of a constrained request (``SamplingParams.structured_outputs`` set):
1. ``EngineCore.add_request`` calls ``add_request``: the grammar compiles in a thread pool (``(kind, spec,
   whitespace)`` is the cache key, so a schema compiles once). The request enters the scheduler at once, and its
   whole prompt prefills while the grammar compiles: the compile overlaps the prefill's forward pass rather than
   adding to TTFT, and the batch never waits on it beyond a bound.
2. The step that computes the logits of the request's first sampled token needs its mask only after the forward
   pass (``grammar_bitmask_async``). If the compile isn't done by then, the mask thread waits for it at most
   ``StructuredOutputsConfig.max_sample_wait_ms`` more. Done in time: the request gets its matcher there and then
   (``finish_step`` hands it over) and samples in that step. Not done: it doesn't sample (``GrammarBitmask
   .unsampled``: the runner draws nothing for it and the scheduler counts its last token as not computed), and
   it holds that token back (``awaiting_grammar``) until ``take_ready`` (each step, before scheduling) finds the
   grammar ready; then that one token is computed again and sampled. (With a runner in other processes, tensor or
   pipeline parallel, the mask is filled before the forward and a compiling request always holds back.)
   ``take_ready`` also finishes requests whose compile failed (aborted; the front end validated the spec, so this
   is rare).
3. Each step ``grammar_bitmask`` fills one int32 bitmask ``[num_constrained_rows, ceil(V / 32)]`` for the
   scheduled constrained requests that sample this step; the model runner sets the disallowed logits to -inf before
   sampling (EOS is allowed only where the grammar may end).
4. ``accept_tokens`` advances a matcher over each step's accepted tokens. Preemption (recompute) keeps the output
   tokens, so the matcher state stays right; ``n > 1`` children are separate requests with separate matchers over
   one compiled grammar.

Reasoning (``--reasoning-parser``): the grammar applies only after the reasoning end (``</think>``); tokens up to
and including it are not fed to the matcher and get no mask.

Threads: compiles run in the pool; everything else runs on the engine thread. The backend itself (xgrammar's
``TokenizerInfo``, ~1.5 s for a 152k vocabulary) is built in the pool: at start-up for the server (``warm_up``:
measured on a fresh SmolLM2 server, the opening burst of 16 json-schema requests otherwise waited ~0.5 s more than
the same requests unconstrained), else on the first constrained request, so offline engines that never see one
don't pay for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

from pagedllm.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar

logger = logging.getLogger(__name__)

# Compiled grammars kept (LRU). A compiled JSON-schema grammar over a 152k vocabulary is ~0.1-1 MB.
MAX_CACHED_GRAMMARS = 256


@dataclass
class _RequestState:
    grammar: StructuredOutputGrammar
    # reasoning: "done" (the grammar applies), "thinking" (inside <think>), "maybe" (qwen3: the model may open a
    # <think> with its first token)
    reasoning: str = "done"
    failed: bool = False


class GrammarBitmask(NamedTuple):
    """One step's masks: ``bitmask`` int32 ``[R, ceil(V / 32)]`` (or None when no row is constrained), row
    ``row_of[request id]`` for each constrained request that samples; ``unsampled``: requests whose logits were
    computed this step while their grammar was still compiling: they must not sample (see the module docstring)."""

    bitmask: Any
    row_of: dict
    unsampled: frozenset = frozenset()


class _SampleDeadline:
    """Set by the runner when it needs the mask (``needed_at``, monotonic s); wakes the mask thread's wait."""

    __slots__ = ("needed_at", "wake")

    def __init__(self) -> None:
        self.needed_at: Optional[float] = None
        self.wake = threading.Event()


class _MaskFuture:
    """``grammar_bitmask_async``'s handle: ``result()`` tells the mask thread the mask is needed now, then waits."""

    __slots__ = ("deadline", "future")

    def __init__(self, deadline: _SampleDeadline, future: Future) -> None:
        self.deadline = deadline
        self.future = future

    def result(self) -> Optional[GrammarBitmask]:
        self.deadline.needed_at = time.monotonic()
        self.deadline.wake.set()
        return self.future.result()


class ReasoningEnd:
    """Finds where a reasoning section ends in token ids (``</think>`` as one token, the case for the models these
    parsers are for; otherwise by decoded text)."""

    def __init__(self, tokenizer, parser_name: str, start: str = "<think>", end: str = "</think>") -> None:
        self.parser_name = parser_name
        self.tokenizer = tokenizer
        self.end = end
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        self.start_id: Optional[int] = vocab.get(start)
        self.end_id: Optional[int] = vocab.get(end)

    def initial_state(self, prompt_token_ids: Sequence[int]) -> str:
        """``thinking`` when the prompt leaves a <think> open (its template opened it), ``done`` when it closed the
        last one, else deepseek_r1: ``thinking`` (R1 models start thinking), qwen3: ``maybe``."""
        if self.start_id is not None and self.end_id is not None:
            ids = list(prompt_token_ids)
            last_start = max((i for i, t in enumerate(ids) if t == self.start_id), default=-1)
            last_end = max((i for i, t in enumerate(ids) if t == self.end_id), default=-1)
            if last_start > last_end:
                return "thinking"
            if last_end >= 0:
                return "done"
        return "thinking" if self.parser_name == "deepseek_r1" else "maybe"

    def split_after_end(self, token_ids: Sequence[int], history: Callable[[], list[int]]) -> Optional[int]:
        """Index in ``token_ids`` just after the end marker, or None if it isn't there. ``history()`` gives the
        output so far (for a marker spread over several tokens)."""
        if self.end_id is not None:
            for i, t in enumerate(token_ids):
                if t == self.end_id:
                    return i + 1
            return None
        ids = history()
        n_new = len(token_ids)
        for k in range(n_new):
            upto = len(ids) - n_new + k + 1
            if self.end in self.tokenizer.decode(ids[max(0, upto - 16):upto]):
                return k + 1
        return None


class StructuredOutputManager:
    """Owns the backend, the compile pool, the compiled-grammar cache and each constrained request's matcher."""

    def __init__(self, config, make_backend: Callable[[], StructuredOutputBackend],
                 reasoning_end: Optional[ReasoningEnd] = None) -> None:
        """``config``: a ``StructuredOutputsConfig``; ``make_backend`` builds the backend (called once, in the
        pool)."""
        self.config = config
        self._make_backend = make_backend
        self._backend: Optional[StructuredOutputBackend] = None
        self._backend_future: Optional[Future] = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, config.max_compile_threads),
                                        thread_name_prefix="pagedllm-grammar",
                                        initializer=_lower_thread_priority,
                                        initargs=(getattr(config, "compile_thread_nice", 0),))
        self._mask_pool: Optional[ThreadPoolExecutor] = None  # one thread: bitmask fills beside the forward pass
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._pending: dict[str, tuple[Any, Future]] = {}  # request id -> (request, compile future)
        self._states: dict[str, _RequestState] = {}
        self.reasoning_end = reasoning_end
        self.num_compiles = 0  # cache misses (a stat for tests and benchmarks)
        # Requests whose grammar finished compiling in the mask thread during this step: (request, state), handed
        # over on the engine thread by finish_step.
        self._adopted: dict[str, tuple[Any, _RequestState]] = {}
        self.sample_wait_s = max(0.0, getattr(config, "max_sample_wait_ms", 20.0)) / 1000.0
        self.num_unsampled = 0  # sampling steps missed because a compile wasn't done (a stat for tests)

    # ------------------------------------------------------------------ compile
    def _backend_now(self) -> StructuredOutputBackend:
        if self._backend is None:
            with self._backend_lock:  # the warm-up and a compile may ask at once
                if self._backend is None:
                    self._backend = self._make_backend()
        return self._backend

    def warm_up(self) -> None:
        """Builds the backend (xgrammar's ``TokenizerInfo``: ~0.5 s for a 49k vocabulary, ~1.5 s for 152k) in the
        pool now, without waiting, so the first constrained request doesn't pay for it. The server calls this at
        start-up; offline engines build it on first use."""
        self._pool.submit(self._backend_now)

    def _key(self, params) -> tuple:
        any_ws = params.disable_any_whitespace
        if any_ws is None:
            any_ws = self.config.disable_any_whitespace
        return (params.kind, params.spec, not any_ws)

    def _compile(self, key: tuple) -> Any:
        self.num_compiles += 1
        return self._backend_now().compile(*key)

    def add_request(self, request) -> bool:
        """Starts compiling ``request``'s grammar (a cache hit is ready at once); it is handed over by the next
        ``take_ready``. Returns True (the request must not sample before then).

        Raises:
            ValueError: if the request id is already waiting for a grammar.
        """
        if request.request_id in self._pending or request.request_id in self._states:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        key = self._key(request.sampling_params.structured_outputs)
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._pool.submit(self._compile, key)
            self._cache[key] = fut
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        self._pending[request.request_id] = (request, fut)
        return True

    def has_pending(self) -> bool:
        return bool(self._pending)

    def take_ready(self) -> tuple[list[Any], list[tuple[Any, str]]]:
        """``(ready requests, [(failed request, error message)])`` among those waiting for their grammar."""
        ready, failed = [], []
        for rid in [r for r, (_, f) in self._pending.items() if f.done()]:
            req, fut = self._pending.pop(rid)
            exc = fut.exception()
            if exc is not None:
                failed.append((req, str(exc)))
                continue
            self._states[rid] = self._new_state(req, fut.result())
            # A request resumed here after output already exists (not the case today) replays it.
            if req.output_token_ids:
                self.accept_tokens(rid, req.output_token_ids, lambda: list(req.output_token_ids))
            ready.append(req)
        return ready, failed

    def _new_state(self, req, compiled) -> _RequestState:
        state = _RequestState(self._backend_now().new_grammar(compiled))
        if self.reasoning_end is not None:
            state.reasoning = self.reasoning_end.initial_state(req.prompt_token_ids)
        return state

    def wait_pending(self, timeout: Optional[float] = None) -> None:
        """Blocks until one pending compile is done, or ``timeout`` s."""
        from concurrent.futures import FIRST_COMPLETED, wait

        futs = [f for _, f in self._pending.values()]
        if futs:
            wait(futs, timeout=timeout, return_when=FIRST_COMPLETED)

    def remove_requests(self, request_ids) -> list[Any]:
        """Forgets finished or aborted requests; returns those that were still waiting for a grammar."""
        out = []
        for rid in request_ids:
            self._states.pop(rid, None)
            p = self._pending.pop(rid, None)
            if p is not None:
                out.append(p[0])
        return out

    # ------------------------------------------------------------------ per step
    def has_constrained(self) -> bool:
        return bool(self._states)

    def grammar_bitmask(self, scheduler_output, requests: dict,
                        deadline: Optional[_SampleDeadline] = None) -> Optional[GrammarBitmask]:
        """The masks of the constrained requests of this step that sample (their last scheduled token is their last
        known token), or None if there are none.

        A request among them whose grammar is still compiling: with ``deadline`` (the mask thread, beside the
        forward pass) its compile gets until the runner needs the mask plus ``sample_wait_s``; without, only what is
        done now. Those whose compile is done get their matcher here (handed over by ``finish_step``), the rest are
        ``unsampled``."""
        rows: list[str] = []
        compiling: list[str] = []
        states = self._states
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = requests.get(rid)
            if req is None or req.num_computed_tokens + n < req.num_tokens:
                continue  # a prompt chunk that doesn't sample yet
            st = states.get(rid)
            if st is None:
                if rid in self._pending:
                    compiling.append(rid)
                continue
            if st.failed or st.reasoning == "thinking":
                continue
            rows.append(rid)
        if not rows and not compiling:
            return None
        bitmask = self._backend_now().allocate_bitmask(len(rows) + len(compiling)) if rows else None
        for j, rid in enumerate(rows):
            self._fill_row(states[rid], bitmask, j)
        unsampled = frozenset()
        if compiling:
            ready = self._await_compiles(compiling, deadline)
            unsampled = frozenset(compiling) - ready.keys()
            for rid, state in ready.items():
                self._adopted[rid] = (requests[rid], state)
                if state.reasoning == "thinking":
                    continue
                if bitmask is None:
                    bitmask = self._backend_now().allocate_bitmask(len(compiling))
                self._fill_row(state, bitmask, len(rows))
                rows.append(rid)
        if not rows and not unsampled:
            return None
        return GrammarBitmask(bitmask, {rid: j for j, rid in enumerate(rows)}, unsampled)

    def _fill_row(self, st: _RequestState, bitmask, j: int) -> None:
        if st.grammar.is_terminated():
            return  # allow everything: the request ends on this EOS (see accept_tokens)
        st.grammar.fill_bitmask(bitmask, j)
        if st.reasoning == "maybe" and self.reasoning_end.start_id is not None:
            t = self.reasoning_end.start_id
            bitmask[j, t // 32] |= _bit(t % 32)

    def _await_compiles(self, rids: list[str], deadline: Optional[_SampleDeadline]) -> dict[str, _RequestState]:
        """The requests among ``rids`` whose grammar compiled, each with a new matcher state (see
        ``grammar_bitmask`` for how long this waits)."""
        futs = {rid: self._pending[rid] for rid in rids}
        if deadline is not None:
            wake = deadline.wake
            for _, f in futs.values():
                if not f.done():
                    f.add_done_callback(lambda _f: wake.set())
            while True:
                wake.clear()
                if all(f.done() for _, f in futs.values()):
                    break
                if deadline.needed_at is None:
                    wake.wait()
                    continue
                left = deadline.needed_at + self.sample_wait_s - time.monotonic()
                if left <= 0:
                    break
                wake.wait(left)
        ready = {}
        for rid, (req, f) in futs.items():
            if f.done() and f.exception() is None:
                ready[rid] = self._new_state(req, f.result())
        self.num_unsampled += len(rids) - len(ready)
        return ready

    def finish_step(self) -> list[Any]:
        """After the step's mask was used (engine thread): the requests whose grammar arrived during the step get
        their matcher for good; returns them (they sampled under it)."""
        if not self._adopted:
            return []
        adopted, self._adopted = self._adopted, {}
        out = []
        for rid, (req, state) in adopted.items():
            if self._pending.pop(rid, None) is not None:
                self._states[rid] = state
                out.append(req)
        return out

    def grammar_bitmask_async(self, scheduler_output, requests: dict) -> Optional[_MaskFuture]:
        """``grammar_bitmask`` filled in the mask thread: a handle whose ``result()`` (called by the runner just
        before sampling) returns it. The caller must not advance matchers or call ``finish_step`` until it is
        done. None when no constrained or compiling request samples this step."""
        so = scheduler_output.num_scheduled_tokens
        if not any(rid in self._states or rid in self._pending for rid in so):
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-mask")
        deadline = _SampleDeadline()
        return _MaskFuture(deadline, self._mask_pool.submit(self.grammar_bitmask, scheduler_output, requests,
                                                            deadline))

    def accept_tokens(self, request_id: str, token_ids: Sequence[int],
                      history: Optional[Callable[[], list[int]]] = None) -> bool:
        """Advances the request's matcher over its newly accepted ``token_ids``. False if the grammar rejected one
        (then the request is no longer constrained: a backend bug or a bitmask mismatch, logged once)."""
        st = self._states.get(request_id)
        if st is None or st.failed or not token_ids:
            return True
        tokens = list(token_ids)
        if st.reasoning == "maybe":
            if tokens[0] == self.reasoning_end.start_id:
                st.reasoning = "thinking"
                tokens = tokens[1:]
            else:
                st.reasoning = "done"
        if st.reasoning == "thinking":
            k = self.reasoning_end.split_after_end(tokens, history or (lambda: list(tokens)))
            if k is None:
                return True
            st.reasoning = "done"
            tokens = tokens[k:]
        if not tokens:
            return True
        if not st.grammar.accept_tokens(tokens):
            st.failed = True
            logger.warning("structured output: request %s sampled a token its grammar rejects; it is no longer "
                           "constrained", request_id)
            return False
        return True

    def is_terminated(self, request_id: str) -> bool:
        st = self._states.get(request_id)
        return st is not None and st.grammar.is_terminated()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=False, cancel_futures=True)


def _lower_thread_priority(nice: int) -> None:
    """Raises the calling thread's nice value by ``nice`` (Linux threads have their own; threads it starts inherit
    it). Best effort: elsewhere, or without permission, the thread keeps its priority."""
    import os

    if nice > 0 and hasattr(os, "setpriority"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        except OSError:
            pass


def _bit(k: int) -> int:
    """Bit ``k`` (0..31) of an int32 word, as a Python int that fits int32 (bit 31 is the sign bit)."""
    return (1 << k) - (1 << 32) if k == 31 else 1 << k
