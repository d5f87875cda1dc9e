"""Turns ``EngineCoreOutput`` deltas into ``RequestOutput``s: detokenizes, finds stop strings, builds logprobs,
and folds the child requests of ``n > 1`` back into one parent output.

Each request is processed under its own guard: an exception while processing one request's output ends that
request alone (``finish_reason="error"``, listed in ``errors``; its children in ``failed_child_ids`` for the
core to abort) and the others in the step are processed as usual."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from pagedllm.core.output import EngineCoreOutput, LogprobsLists
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.exceptions import RequestFailedError
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ChildState:
    """One completion (a child request of the parent, or the request itself when n == 1)."""

    request_id: str
    index: int
    sampling_params: SamplingParams
    detokenizer: Optional[IncrementalDetokenizer]
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    num_sent_tokens: int = 0  # tokens already returned in DELTA mode
    num_sent_logprobs: int = 0
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    num_cached_tokens: int = 0
    final_sent: bool = False
    new_token_times: list[float] = field(default_factory=list)  # arrival time of each token batch (for ITL)
    fault: Optional[str] = None  # test hook (engine/fault_injection.py)


@dataclass
class ParentState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    arrival_time: float
    children: list[ChildState]
    prompt_logprobs: Optional[list] = None
    num_cached_tokens: int = 0
    finished_time: Optional[float] = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, ChildState]] = {}
        self._decode_cache: dict[int, str] = {}
        self.errors: list[tuple[str, RequestFailedError]] = []  # (parent id, error) of requests that failed alone
        self.failed_child_ids: list[str] = []  # their children, for the core to abort

    def add_request(self, parent: ParentState) -> None:
        self.parents[parent.request_id] = parent
        for c in parent.children:
            self.child_to_parent[c.request_id] = (parent, c)

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def child_ids(self, parent_id: str) -> list[str]:
        p = self.parents.get(parent_id)
        return [c.request_id for c in p.children] if p else []

    def abort_parent(self, parent_id: str) -> Optional[RequestOutput]:
        """Marks all children of ``parent_id`` aborted; returns its final output (or None if unknown)."""
        p = self.parents.get(parent_id)
        if p is None:
            return None
        for c in p.children:
            if c.finish_reason is None:
                c.finish_reason = "abort"
        return self._finish_parent(p, force_output=True)

    def _decode_token(self, tid: int) -> Optional[str]:
        s = self._decode_cache.get(tid)
        if s is None and self.tokenizer is None:
            return None
        if s is None:
            s = self.tokenizer.decode([tid])
            if len(self._decode_cache) < 200_000:
                self._decode_cache[tid] = s
        return s

    def _logprob_dicts(self, lp: LogprobsLists) -> list[dict[int, Logprob]]:
        out = []
        for ids, lps, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            d: dict[int, Logprob] = {}
            for j, (t, v) in enumerate(zip(ids, lps)):
                if t in d:
                    continue
                d[t] = Logprob(v, rank if j == 0 else j, self._decode_token(t))
            out.append(d)
        return out

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (request outputs to deliver, child request ids the core must stop because of a stop string)."""
        now = time.time()
        touched: dict[str, ParentState] = {}
        to_abort: list[str] = []
        failed: dict[str, ParentState] = {}
        for eo in outputs:
            pc = self.child_to_parent.get(eo.request_id)
            if pc is None:
                continue
            parent, c = pc
            if c.finish_reason is not None:
                continue
            try:
                self._process_one(eo, parent, c, now, to_abort)
            except Exception as e:  # noqa: BLE001 - this request's fault: it fails alone
                self._fail_parent(parent, e)
                failed[parent.request_id] = parent
                touched.pop(parent.request_id, None)
                continue
            touched[parent.request_id] = parent
        results = []
        for parent in touched.values():
            try:
                ro = self._make_output(parent)
            except Exception as e:  # noqa: BLE001
                self._fail_parent(parent, e)
                failed[parent.request_id] = parent
                continue
            if ro is not None:
                results.append(ro)
        for parent in failed.values():
            results.append(self._finish_parent(parent, force_output=True))
        return results, to_abort

    def _fail_parent(self, parent: ParentState, exc: Exception) -> None:
        """Ends every unfinished child of ``parent`` with ``finish_reason="error"`` and records the error."""
        err = RequestFailedError(f"request {parent.request_id} failed in the engine: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        self.errors.append((parent.request_id, err))
        for c in parent.children:
            c.detokenizer = None  # it may be what raised; the final output carries no more text
            if c.finish_reason is None:
                c.finish_reason = "error"
                self.failed_child_ids.append(c.request_id)

    def _process_one(self, eo: EngineCoreOutput, parent: ParentState, c: ChildState, now: float,
                     to_abort: list[str]) -> None:
        if c.fault == "request":
            from pagedllm.engine.fault_injection import InjectedFault

            raise InjectedFault("injected fault in per-request output processing")
        if eo.new_prompt_logprobs is not None and c.index == 0:
            # With n > 1 every child computes the prompt's logprobs; the parent reports one set (one entry per
            # prompt token), from child 0.
            if parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None]
            parent.prompt_logprobs.extend(self._logprob_dicts(eo.new_prompt_logprobs))
        c.num_cached_tokens = eo.num_cached_tokens
        parent.num_cached_tokens = eo.num_cached_tokens
        if eo.new_token_ids:
            if c.first_token_time is None:
                c.first_token_time = now
            c.last_token_time = now
            c.new_token_times.append(now)
            c.token_ids.extend(eo.new_token_ids)
            if eo.new_logprobs is not None:
                dicts = self._logprob_dicts(eo.new_logprobs)
                if c.logprobs is None:
                    c.logprobs = []
                    c.cumulative_logprob = 0.0
                for tok, d in zip(eo.new_token_ids, dicts):
                    c.logprobs.append(d)
                    c.cumulative_logprob += d[tok].logprob
        finish_reason = eo.finish_reason
        if c.detokenizer is not None:
            stop_str = c.detokenizer.update(eo.new_token_ids, finish_reason is not None,
                                            stop_terminated=finish_reason == "stop")
            if stop_str is not None and finish_reason is None:
                finish_reason = "stop"
                c.stop_reason = stop_str
                to_abort.append(c.request_id)
        if finish_reason is not None:
            c.finish_reason = finish_reason
            if c.stop_reason is None:
                c.stop_reason = eo.stop_reason

    def _completion(self, c: ChildState, delta: bool, finished_only: bool) -> CompletionOutput:
        fin = c.finish_reason is not None
        if c.detokenizer is not None:
            text = c.detokenizer.get_next_output_text(fin, delta)
        else:
            text = ""
        if delta:
            token_ids = c.token_ids[c.num_sent_tokens:]
            logprobs = c.logprobs[c.num_sent_logprobs:] if c.logprobs is not None else None
            c.num_sent_tokens = len(c.token_ids)
            c.num_sent_logprobs = len(c.logprobs) if c.logprobs is not None else 0
        else:
            token_ids = list(c.token_ids)
            logprobs = list(c.logprobs) if c.logprobs is not None else None
        return CompletionOutput(
            index=c.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=c.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def _make_output(self, parent: ParentState) -> Optional[RequestOutput]:
        kind = parent.output_kind
        finished = parent.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        return self._finish_parent(parent) if finished else self._build(parent, False)

    def _finish_parent(self, parent: ParentState, force_output: bool = False) -> Optional[RequestOutput]:
        parent.finished_time = time.time()
        ro = self._build(parent, True)
        self.parents.pop(parent.request_id, None)
        for c in parent.children:
            self.child_to_parent.pop(c.request_id, None)
        return ro

    def _build(self, parent: ParentState, finished: bool) -> RequestOutput:
        delta = parent.output_kind == RequestOutputKind.DELTA
        comps = []
        for c in parent.children:
            if delta:
                fin = c.finish_reason is not None
                if c.num_sent_tokens == len(c.token_ids) and (not fin or c.final_sent):
                    continue
                c.final_sent = fin
            comps.append(self._completion(c, delta, False))
        first = [c.first_token_time for c in parent.children if c.first_token_time is not None]
        last = [c.last_token_time for c in parent.children if c.last_token_time is not None]
        metrics = RequestMetrics(
            arrival_time=parent.arrival_time,
            first_token_time=min(first) if first else None,
            last_token_time=max(last) if last else None,
            finished_time=parent.finished_time if finished else None,
        )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs,
            outputs=comps,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=metrics,
        )
