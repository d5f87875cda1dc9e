"""Iteration-level scheduler: one token budget, no prefill/decode phases (vLLM v1's design).

Each step every running request asks for ``num_tokens - num_computed_tokens`` new tokens (1 when decoding, a
chunk of its prompt while prefilling); the scheduler hands out at most ``max_num_batched_tokens`` in total, running
requests first (in arrival order), then waiting ones (FCFS) while the budget, ``max_num_seqs`` and free blocks last.
When a running request can't get a block, the latest running request is preempted (recompute): its blocks are freed
and it goes back to the head of the waiting queue with ``num_computed_tokens = 0``. With ``long_prefill_token_threshold``
(vLLM's engine arg) no request computes more than that many prompt tokens in a step.

``update_from_output`` is the only place request state advances. Integers only; no torch.

Speculative decoding (vLLM v1's contract): a decoding request may carry ``spec_token_ids`` (draft tokens the runner
proposed after the last step). It is then scheduled for ``1 + k`` tokens, its last sampled token and ``k`` drafts
(``SchedulerOutput.scheduled_spec_decode_tokens``), within the token budget and with KV slots for all of them. The
runner verifies the drafts in the same forward pass and returns the accepted drafts plus one token sampled after
them; ``update_from_output`` advances ``num_computed_tokens`` by that count only, so the KV slots of rejected
drafts hold garbage that a later step overwrites. Example: 10 tokens (9 computed), drafts ``[a, b, c]``: 4 tokens
scheduled (positions 9..12); ``a`` accepted, ``b`` rejected, ``x`` sampled in its place: outputs ``[a, x]``,
``num_computed_tokens`` 9 + 4 - 2 = 11, positions 11, 12 stale. Prefix caching hashes only ``all_token_ids``
(verified tokens), so a block is cached only once every token in it is verified and its KV written. Drafts never
cause a preemption: when the blocks for them aren't free the request keeps the drafts that fit its blocks.

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
from dataclasses import dataclass, field
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
from pagedllm.spec_decode import adaptive


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # share of usable blocks referenced by requests
    kv_cache_utilization: float = 1.0  # share of slots in referenced blocks that hold a live token
    num_preemptions: int = 0  # since the last stats call
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    spec_decoding_stats: Optional["SpecDecodingStats"] = None  # since the last stats call; None without speculation


@dataclass
class SpecDecodingStats:
    """Verified draft tokens (vLLM's ``spec_decode_*`` metrics). ``num_drafts``: request-steps that verified at
    least one draft token; acceptance rate = accepted / draft tokens; mean acceptance length (tokens per such
    step) = 1 + accepted / drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft:
            per_pos.extend([0] * (num_draft - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def take(self) -> "SpecDecodingStats":
        out = SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                self.num_accepted_tokens_per_pos)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = []
        return out


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        use_pp: bool = False,
        speculative_config=None,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        """``speculative_config``: a ``pagedllm.config.SpeculativeConfig`` (None: no speculative decoding).
        ``long_prefill_token_threshold`` (vLLM's engine arg; 0: off; EngineArgs checks it is >= 0 and comes with
        chunked prefill): the most prompt tokens one request computes in a step, so a long prompt takes several steps
        and the requests behind it get budget in each of them."""
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.chunk_cap = long_prefill_token_threshold or (1 << 62)
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
        # Speculative decoding: the most draft tokens per request and step (0: off).
        sc = speculative_config
        self.num_spec_tokens = sc.num_speculative_tokens if sc is not None else 0
        self.spec_disable_by_batch_size = (sc.disable_by_batch_size if sc is not None else None) or (1 << 62)
        self.spec_adaptive = bool(sc is not None and sc.adaptive)
        self.spec_cost_aware = bool(self.spec_adaptive and sc.cost_aware)
        self.spec_step_token_budget = sc.step_token_budget if sc is not None else 0
        self.spec_stats = SpecDecodingStats() if sc is not None else None
        # A draft token's cost in plain decode steps, as the runner last measured it (None: not yet; the fixed
        # rule applies), and the speculating single-stream steps until the next plain one it times.
        self.spec_token_cost: Optional[float] = None
        self._steps_to_plain = 2
        if self.num_spec_tokens and use_pp:
            raise ValueError("speculative decoding can't be combined with pipeline parallelism yet.")

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
        scheduled_spec: dict[str, list[int]] = {}
        draft_limits: dict[str, int] = {}
        # Requests waiting are load too: speculation steps aside until they are in (a drafter's catch-up would
        # hold up their prefills), and no draft is proposed for such a step.
        spec_cap = self.spec_cap(len(self.running) + len(self.waiting))

        # 1. Running requests, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens - req.awaiting_grammar, budget, self.chunk_cap)
            if n <= 0 or (in_flight and req.request_id in in_flight):
                i += 1
                continue
            k_want = self.num_spec_tokens
            if self.num_spec_tokens and not spec_cap:
                draft_limits[req.request_id] = 0  # stepped aside: the drafter drafts nothing for it either
            elif spec_cap and self.spec_adaptive and req.num_output_tokens:
                cost = self.spec_token_cost
                k_want = adaptive.share(self.num_spec_tokens, req.spec_acceptance, cost)
                if k_want == 0:
                    req.spec_acceptance = adaptive.relax(req.spec_acceptance)
                elif self.spec_cost_aware and len(self.running) == 1 and self._plain_step_due():
                    k_want = 0  # a plain step, for the runner to time (adaptive.StepCosts)
                # drafts proposed after this step: its share from its acceptance, one more in case that rises
                # (a drafter with a model pays a forward per draft position; absent: num_speculative_tokens)
                k_next = adaptive.share(self.num_spec_tokens, req.spec_acceptance, cost)
                k_next = min(self.num_spec_tokens, k_next + 1) if k_next else 0
                if k_next < self.num_spec_tokens:
                    draft_limits[req.request_id] = k_next
            k = self._num_spec_tokens(req, n, min(budget, n + spec_cap), k_want) \
                if spec_cap and req.spec_token_ids else 0
            while True:
                new_blocks = self.kv.allocate_slots(req, n + k)
                if new_blocks is not None:
                    break
                if k:  # draft tokens never cost a preemption: keep those that fit the blocks held
                    held = len(self.kv.req_to_blocks.get(req.request_id, ())) * self.block_size
                    k = max(min(k - 1, held - req.num_computed_tokens - n), 0)
                    continue
                victim = self.running.pop() if not in_flight else self._pop_victim_not_in_flight()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
            if new_blocks is None:
                break
            scheduled_running.append(req)
            if k:
                scheduled_spec[req.request_id] = req.spec_token_ids[:k]
            num_scheduled[req.request_id] = n + k
            cached_reqs.append(CachedRequestData(
                req.request_id, [b.block_id for b in new_blocks], req.num_computed_tokens,
                new_token_ids=self._new_token_ids(req, n) if self.use_pp else None))
            budget -= n + k
            i += 1
            if len(num_scheduled) >= max_reqs:
                break

        # 2. Waiting requests, FCFS (not in a step that had to preempt: memory is short). One whose grammar is still
        # compiling and that has nothing to prefill before its sampled token steps aside (it keeps its place).
        held_back: list[Request] = []
        if not preempted:
            while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
                   and len(num_scheduled) < max_reqs):
                req = self.waiting[0]
                if in_flight and req.request_id in in_flight:
                    break  # an aborted request's id, reused before its last batch came back
                resumed = req.status == RequestStatus.PREEMPTED
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
                n = req.num_tokens - num_hit
                if req.awaiting_grammar:
                    n -= 1  # a prompt chunk short of the sampled token (itself a chunk: chunked prefill only)
                    if n <= 0 or not self.enable_chunked_prefill:
                        held_back.append(self.waiting.popleft())
                        continue
                if n > budget and not self.enable_chunked_prefill:
                    break
                n = min(n, budget, self.chunk_cap)
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
        self.waiting.extendleft(reversed(held_back))

        # Lay requests out in running order (old running first, then newly admitted).
        ordered = {r.request_id: num_scheduled[r.request_id] for r in self.running if r.request_id in num_scheduled}
        if self.num_spec_tokens and not spec_cap:  # stepped aside: no drafts for the step's new requests either
            draft_limits.update((r.req_id, 0) for r in new_reqs)
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=ordered,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
            new_group_block_ids=self.kv.take_new_group_block_ids(),
            scheduled_spec_decode_tokens=scheduled_spec,
            spec_draft_limits=draft_limits,
        )
        self.finished_req_ids = set()
        return out

    def spec_cap(self, num_running: int) -> int:
        """The most draft tokens a request may verify in a step that starts with ``num_running`` running
        requests (``SpeculativeConfig.step_token_budget``, ``disable_by_batch_size``; 0 without speculation)."""
        if not self.num_spec_tokens or num_running > self.spec_disable_by_batch_size or num_running == 0:
            return 0
        return min(self.num_spec_tokens, max(0, (self.spec_step_token_budget - num_running) // num_running))

    def _plain_step_due(self) -> bool:
        """Whether this speculating single-stream step verifies no drafts: every ``CALIBRATE_EVERY`` steps (every 8
        until the runner has a cost), so the runner times a plain step beside the verify steps."""
        self._steps_to_plain -= 1
        if self._steps_to_plain > 0:
            return False
        self._steps_to_plain = adaptive.CALIBRATE_EVERY if self.spec_token_cost is not None else 8
        return True

    def _num_spec_tokens(self, req: Request, n: int, budget: int, k_want: int) -> int:
        """Draft tokens to verify with a decode of ``req`` (0 while it prefills): its proposal, cut to its adaptive
        share ``k_want``, to the budget left after its ``n`` tokens, and so that the token sampled after them still
        fits ``max_tokens`` and ``max_model_len`` (more could never be output)."""
        if req.num_computed_tokens + n != req.num_tokens or req.num_output_tokens == 0:
            return 0
        k = min(len(req.spec_token_ids), k_want, budget - n,
                req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1)
        return max(k, 0)

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
        req.spec_token_ids = []
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
        spec_decode_tokens = sched.scheduled_spec_decode_tokens
        spec_token_ids = out.spec_token_ids
        if out.spec_token_cost is not None and self.spec_cost_aware:
            self.spec_token_cost = out.spec_token_cost
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted meanwhile
            sampled = out.sampled_token_ids[index[rid]] if rid in index else []
            req.num_computed_tokens += n
            if out.unsampled_req_ids and rid in out.unsampled_req_ids:
                req.num_computed_tokens -= 1  # computed again in the step that samples it
            if spec_decode_tokens:
                drafts = spec_decode_tokens.get(rid)
                if drafts:  # rejected drafts aren't computed: their slots are overwritten later
                    num_accepted = len(sampled) - 1
                    req.num_computed_tokens -= len(drafts) - num_accepted
                    self._observe_spec(req, len(drafts), num_accepted)
            self.kv.release_out_of_window(req)  # sliding-window KV groups: blocks no later query can see
            new_ids: list[int] = []
            if sampled and req.num_computed_tokens >= req.num_tokens:
                for tok in sampled:
                    req.append_output_token_ids([tok])
                    new_ids.append(tok)
                    if self._check_stop(req, tok):
                        break
            if spec_token_ids is not None and not req.is_finished():
                req.spec_token_ids = spec_token_ids[index[rid]] if rid in index else []
            plp = prompt_logprobs.get(rid)
            if new_ids or plp is not None or req.is_finished():
                lp = logprobs.get(rid) if new_ids else None
                if lp is not None and len(lp.ranks) > len(new_ids):  # a stop among the accepted tokens
                    lp = lp.head(len(new_ids))
                outputs.append(EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=new_ids,
                    new_logprobs=lp,
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

    def _observe_spec(self, req: Request, num_draft: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_draft:
            raise AssertionError(f"{req.request_id}: {num_accepted} accepted of {num_draft} draft tokens")
        self.spec_stats.observe(num_draft, num_accepted)
        if self.spec_adaptive:
            req.spec_acceptance = adaptive.update(req.spec_acceptance, num_draft, num_accepted)

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
            spec_decoding_stats=self.spec_stats.take() if self.spec_stats is not None else None,
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
