"""Iteration-level scheduler: one token budget, no prefill/decode phases (vLLM v1's design).

Each step every running request asks for ``num_tokens - num_computed_tokens`` new tokens (1 when decoding, a
chunk of its prompt while prefilling); the scheduler hands out at most ``max_num_batched_tokens`` in total, running
requests first (in arrival order), then waiting ones (FCFS) while the budget, ``max_num_seqs`` and free blocks last.
When a running request can't get a block, the latest running request is preempted (recompute): its blocks are freed
and it goes back to the head of the waiting queue with ``num_computed_tokens = 0``.

``update_from_output`` is the only place request state advances. Integers only; no torch.

Pipeline parallelism keeps several batches in flight (``EngineCore.step_with_batch_queue``): a batch is scheduled
before the outputs of earlier ones are back. A request in a batch in flight (``in_flight_req_ids``) is not scheduled
again until ``update_from_output`` has seen that batch: a decode needs the token being sampled, and a prompt's next
chunk waits for the previous one (unlike vLLM, which advances ``num_computed_tokens`` at schedule time, here
``num_computed_tokens`` still only advances in ``update_from_output``). Requests in flight are never preempted; an
aborted one is freed at once (its batch still writes to the freed blocks, but every stage runs batches in order, so
a later batch that reuses them writes after it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.request import Request, RequestStatus


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # share of usable blocks referenced by requests
    kv_cache_utilization: float = 1.0  # share of slots in referenced blocks that hold a live token
    num_preemptions: int = 0  # since the last stats call
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        use_pp: bool = False,
    ) -> None:
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests finished since the last schedule(): the runner drops their state.
        self.finished_req_ids: set[str] = set()
        # Requests the runner has state for (scheduled at least once and not finished).
        self._known_to_runner: set[str] = set()
        self.num_preemptions = 0
        # Pipeline parallel: ranks other than the output rank never see sampled tokens; each step carries them
        # (``CachedRequestData.new_token_ids``).
        self.use_pp = use_pp
        # Requests in a scheduled batch whose output update_from_output hasn't seen (several batches in flight).
        self.in_flight_req_ids: set[str] = set()

    # ------------------------------------------------------------------ queue management
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests from outside (abort, or a stop string found by the output processor)."""
        out = []
        for rid in list(request_ids):
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free_request(req)
            out.append(req)
        return out

    def _free_request(self, req: Request) -> None:
        self.kv.free(req)
        del self.requests[req.request_id]
        if req.request_id in self._known_to_runner:
            self._known_to_runner.discard(req.request_id)
            self.finished_req_ids.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self, max_num_scheduled_reqs: Optional[int] = None) -> SchedulerOutput:
        """The next batch: at most ``max_num_scheduled_reqs`` requests (default ``max_num_seqs``; a pipeline splits
        the running requests over its micro-batches this way), none of them in ``in_flight_req_ids``."""
        budget = self.max_num_batched_tokens
        max_reqs = max_num_scheduled_reqs or self.max_num_seqs
        in_flight = self.in_flight_req_ids
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        scheduled_running: list[Request] = []

        # 1. Running requests, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0 or (in_flight and req.request_id in in_flight):
                i += 1
                continue
            while True:
                new_blocks = self.kv.allocate_slots(req, n)
                if new_blocks is not None:
                    break
                victim = self.running.pop() if not in_flight else self._pop_victim_not_in_flight()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
            if new_blocks is None:
                break
            scheduled_running.append(req)
            num_scheduled[req.request_id] = n
            cached_reqs.append(CachedRequestData(
                req.request_id, [b.block_id for b in new_blocks], req.num_computed_tokens,
                new_token_ids=self._new_token_ids(req, n) if self.use_pp else None))
            budget -= n
            i += 1
            if len(num_scheduled) >= max_reqs:
                break

        # 2. Waiting requests, FCFS (not in a step that had to preempt: memory is short).
        if not preempted:
            while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
                   and len(num_scheduled) < max_reqs):
                req = self.waiting[0]
                if in_flight and req.request_id in in_flight:
                    break  # an aborted request's id, reused before its last batch came back
                resumed = req.status == RequestStatus.PREEMPTED
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
                n = req.num_tokens - num_hit
                if n > budget and not self.enable_chunked_prefill:
                    break
                n = min(n, budget)
                new_blocks = self.kv.allocate_slots(req, n, hit_blocks, num_hit)
                if new_blocks is None:
                    break
                self.waiting.popleft()
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                    self.kv.record_prefix_query(req.num_prompt_tokens, num_hit)
                req.num_computed_tokens = num_hit
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                num_scheduled[req.request_id] = n
                block_ids = self.kv.get_block_ids(req.request_id)
                if req.request_id in self._known_to_runner:
                    cached_reqs.append(CachedRequestData(
                        req.request_id, block_ids, num_hit, resumed_from_preemption=True,
                        all_token_ids=list(req.all_token_ids)))
                else:
                    self._known_to_runner.add(req.request_id)
                    new_reqs.append(NewRequestData(
                        req.request_id, req.prompt_token_ids, req.sampling_params, block_ids, num_hit,
                        req.eos_token_ids))
                budget -= n
                assert not resumed or req.request_id in self._known_to_runner

        # Lay requests out in running order (old running first, then newly admitted).
        ordered = {r.request_id: num_scheduled[r.request_id] for r in self.running if r.request_id in num_scheduled}
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=ordered,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
            new_group_block_ids=self.kv.take_new_group_block_ids(),
        )
        self.finished_req_ids = set()
        return out

    def _pop_victim_not_in_flight(self) -> Request:
        """The latest running request that isn't in a batch in flight (the one being scheduled is a candidate, so
        one is always found)."""
        for j in range(len(self.running) - 1, -1, -1):
            if self.running[j].request_id not in self.in_flight_req_ids:
                return self.running.pop(j)
        raise AssertionError("every running request is in flight, including the one being scheduled")

    def _new_token_ids(self, req: Request, n: int) -> list[int]:
        """Output tokens among the ``n`` scheduled from ``num_computed_tokens`` on (a decode: its last sampled
        token; a prompt chunk: none)."""
        return req.all_token_ids[max(req.num_computed_tokens, req.num_prompt_tokens):req.num_computed_tokens + n]

    def mark_in_flight(self, sched: SchedulerOutput) -> None:
        """Records that ``sched`` went to the executor without waiting for its output."""
        self.in_flight_req_ids.update(sched.num_scheduled_tokens)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ update
    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advances every scheduled request by its scheduled tokens, appends sampled tokens and checks stops."""
        if self.in_flight_req_ids:
            self.in_flight_req_ids.difference_update(sched.num_scheduled_tokens)
        outputs: list[EngineCoreOutput] = []
        index = {rid: i for i, rid in enumerate(out.req_ids)}
        finished: list[Request] = []
        logprobs = out.logprobs or {}
        prompt_logprobs = out.prompt_logprobs or {}
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted meanwhile
            req.num_computed_tokens += n
            self.kv.release_out_of_window(req)  # sliding-window KV groups: blocks no later query can see
            sampled = out.sampled_token_ids[index[rid]] if rid in index else []
            new_ids: list[int] = []
            if sampled and req.num_computed_tokens >= req.num_tokens:
                for tok in sampled:
                    req.append_output_token_ids([tok])
                    new_ids.append(tok)
                    if self._check_stop(req, tok):
                        break
            plp = prompt_logprobs.get(rid)
            if new_ids or plp is not None or req.is_finished():
                outputs.append(EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=new_ids,
                    new_logprobs=logprobs.get(rid) if new_ids else None,
                    new_prompt_logprobs=plp,
                    finish_reason=req.get_finish_reason(),
                    stop_reason=req.stop_reason,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                ))
            if req.is_finished():
                finished.append(req)
        for req in finished:
            self.running.remove(req)
            self._free_request(req)
        return outputs

    def _check_stop(self, req: Request, tok: int) -> bool:
        sp = req.sampling_params
        if req.num_output_tokens > sp.min_tokens:  # min_tokens tokens come before any EOS/stop id
            if not sp.ignore_eos and tok in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if tok in sp.all_stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = tok
                return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # ------------------------------------------------------------------ stats
    def make_stats(self) -> SchedulerStats:
        pcs = self.kv.prefix_cache_stats.take()
        n_pre = self.num_preemptions
        self.num_preemptions = 0
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            kv_cache_utilization=self.kv_cache_utilization(),
            num_preemptions=n_pre,
            prefix_cache_queries=pcs.queries,
            prefix_cache_hits=pcs.hits,
        )

    def kv_cache_utilization(self) -> float:
        """Live tokens / token slots of the distinct blocks requests hold (1.0 when none is held). Call between steps.

        A slot is live when a request holding its block has computed that position. O(running requests), no walk over
        blocks: a block held by several requests is a full block for each of them (a hit takes whole cached blocks,
        and a block is cached only in the step that fills it), so each reference beyond the first adds exactly
        ``block_size`` live tokens, which are subtracted. Example with block_size 16: ``a`` has computed 40 tokens in
        3 blocks, ``b`` hit a's first 2 blocks and has computed 35 tokens in 3 blocks: 4 distinct blocks (64 slots),
        6 references, live = 40 + 35 - (6 - 4) * 16 = 43, utilization 43 / 64.
        """
        bs = self.block_size
        live, num_refs = self.kv.count_live_tokens(self.running)  # over all KV cache groups
        num_blocks = self.kv.num_allocated_blocks()
        if num_blocks == 0:
            return 1.0
        return (live - (num_refs - num_blocks) * bs) / (num_blocks * bs)
