"""EngineCore: ``step() = schedule -> execute_model -> update_from_output``."""

from __future__ import annotations

import logging
from collections import deque
from typing import Iterable, Optional

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.output import EngineCoreOutput
from pagedllm.core.scheduler import Scheduler, SchedulerStats
from pagedllm.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the model runner. Not thread-safe: one thread drives it."""

    def __init__(self, config: EngineConfig, model=None, structured_output_manager=None) -> None:
        """``structured_output_manager``: a ``StructuredOutputManager`` (grammar-constrained requests), or None."""
        from pagedllm.kv_cache_spec import plan_kv_cache_layout
        from pagedllm.model_loader.loader import load_model
        from pagedllm.worker.model_runner import ModelRunner, determine_num_blocks

        from pagedllm import kernels

        if config.kernel is not None:  # before the model loads: packing and quantized layouts depend on it
            kernels.set_config(config.kernel)
        self.config = config
        self.executor = None
        if config.parallel.is_parallel:
            # Tensor / pipeline parallel: the workers hold the model; they agree on the block count.
            from pagedllm.executor import make_executor

            if model is not None:
                raise ValueError("a preloaded model can't be used with tensor/pipeline parallelism.")
            self.executor = self.runner = make_executor(config)
            num_blocks, group_windows = self.executor.num_blocks, self.executor.group_windows
        else:
            if model is None:
                model = load_model(config.model)
            # KV cache groups: sliding-window layers get their own block tables (and free what left the window).
            layout = plan_kv_cache_layout(model.kv_cache_spec())
            # A drafter with a KV cache of its own shares the budget (determine_num_blocks).
            spec, draft, draft_layout = config.speculative, None, None
            if spec is not None and spec.method == "draft_model":
                from pagedllm.spec_decode.draft_model import load_draft_model

                draft = load_draft_model(spec, model)
                draft_layout = plan_kv_cache_layout(draft.kv_cache_spec())
            elif spec is not None and spec.method == "self_int4":
                draft_layout = layout
            num_blocks = determine_num_blocks(config, model.kv_cache_spec(), layout, draft_layout)
            self.runner = ModelRunner(config, model, num_blocks, layout=layout, draft_model=draft)
            group_windows = layout.group_windows
        self.num_blocks = num_blocks
        # Test hook (engine/fault_injection.py): a step that schedules one of these raises in the forward.
        self.forward_fault_req_ids: set[str] = set()
        self.kv_cache_manager = KVCacheManager(num_blocks, config.cache.block_size,
                                               config.cache.enable_prefix_caching, group_windows)
        sc = config.scheduler
        pc = config.parallel
        self.scheduler = Scheduler(self.kv_cache_manager, sc.max_num_seqs, sc.max_num_batched_tokens,
                                   sc.max_model_len, sc.enable_chunked_prefill,
                                   use_pp=pc.pipeline_parallel_size > 1,
                                   speculative_config=config.speculative,
                                   long_prefill_token_threshold=sc.long_prefill_token_threshold)
        # Pipeline parallel (vLLM's batch queue): up to max_in_flight_batches micro-batches in flight, so stage 0
        # runs batch k+1 while stage 1 runs batch k. The external launcher runs every rank's engine in lock step.
        self.batch_queue: Optional[deque] = None
        self.max_in_flight_batches = 1
        self.num_batches_in_flight_peak = 0  # the most batches ever in flight at once (a stat for tests/benchmarks)
        if (pc.pipeline_parallel_size > 1 and pc.max_in_flight_batches > 1
                and pc.distributed_executor_backend == "mp"):
            self.max_in_flight_batches = pc.max_in_flight_batches
            self.batch_queue = deque()
            self.step = self.step_with_batch_queue
        self.structured_output_manager = structured_output_manager

    def add_request(self, request: Request) -> None:
        so = self.structured_output_manager
        if request.sampling_params.structured_outputs is not None:
            if so is None:
                raise ValueError("structured_outputs needs a tokenizer (the engine runs with skip_tokenizer_init).")
            if request.request_id in self.scheduler.requests:
                raise ValueError(f"request_id {request.request_id!r} is already in use.")
            # Compiling: it prefills meanwhile. In process, the step that samples its first token waits for the
            # compile a little (structured_output/manager.py); a runner in other processes can't, so the request
            # holds that token back until the grammar is ready.
            if so.add_request(request) and self.executor is not None:
                request.awaiting_grammar = True
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        request_ids = list(request_ids)
        if self.structured_output_manager is not None:
            self.structured_output_manager.remove_requests(request_ids)
        self.scheduler.finish_requests(request_ids, status)

    # ------------------------------------------------------------------ structured outputs (small hooks)
    def _admit_grammar_requests(self) -> list[EngineCoreOutput]:
        """Lets requests whose grammar compiled sample (``awaiting_grammar`` off); those whose compile failed
        finish (abort)."""
        so = self.structured_output_manager
        ready, failed = so.take_ready()
        for req in ready:
            req.awaiting_grammar = False
        outs = []
        if failed:
            for req, msg in failed:
                logger.warning("request %s: %s", req.request_id, msg)
                outs.append(EngineCoreOutput(req.request_id, [], finish_reason="abort", stop_reason=msg))
            self.scheduler.finish_requests([req.request_id for req, _ in failed], RequestStatus.FINISHED_ABORTED)
        return outs

    def _idle_on_grammars(self) -> None:
        """A step with nothing scheduled while grammars compile: wait a little for one instead of spinning."""
        so = self.structured_output_manager
        if so is not None and so.has_pending():
            so.wait_pending(timeout=0.05)

    def _attach_grammar_bitmask(self, sched, overlap: bool = False) -> None:
        """Sets ``sched.grammar_bitmask``. ``overlap`` (in-process runner): a future filled in the manager's mask
        thread while the forward pass runs (the runner waits for it only before sampling; nothing advances the
        matchers meanwhile)."""
        so = self.structured_output_manager
        if so is not None and (so.has_constrained() or so.has_pending()) and not sched.is_empty:
            if overlap:
                sched.grammar_bitmask = so.grammar_bitmask_async(sched, self.scheduler.requests)
            else:
                sched.grammar_bitmask = so.grammar_bitmask(sched, self.scheduler.requests)

    def _finish_grammar_step(self, out) -> None:
        """Requests whose grammar arrived during the step sampled under it; those whose compile wasn't done in time
        didn't sample (``out.unsampled_req_ids``: the scheduler counts their last token as not computed) and hold
        it back until their grammar is ready."""
        for req in self.structured_output_manager.finish_step():
            req.awaiting_grammar = False
        if out.unsampled_req_ids:
            requests = self.scheduler.requests
            for rid in out.unsampled_req_ids:
                req = requests.get(rid)
                if req is not None:
                    req.awaiting_grammar = True

    def _advance_grammars(self, outputs: list[EngineCoreOutput]) -> None:
        """Feeds each step's accepted tokens to the matchers; forgets finished requests."""
        so = self.structured_output_manager
        if so is None or not so.has_constrained():
            return
        requests = self.scheduler.requests
        for o in outputs:
            if o.new_token_ids and not o.finished:
                req = requests.get(o.request_id)
                so.accept_tokens(o.request_id, o.new_token_ids,
                                 (lambda r=req: list(r.output_token_ids)) if req is not None else None)
            elif o.finished:
                so.remove_requests([o.request_id])

    def step(self) -> list[EngineCoreOutput]:
        extra = []
        if self.structured_output_manager is not None and self.structured_output_manager.has_pending():
            extra = self._admit_grammar_requests()
        sched = self.scheduler.schedule()
        if self.forward_fault_req_ids and not self.forward_fault_req_ids.isdisjoint(sched.num_scheduled_tokens):
            from pagedllm.engine.fault_injection import InjectedFault

            raise InjectedFault("injected fault in the model forward")
        self._attach_grammar_bitmask(sched, overlap=self.executor is None)
        gb = sched.grammar_bitmask
        try:
            out = self.runner.execute_model(sched)
        finally:
            if hasattr(gb, "result"):
                gb.result()  # the fill is done (a compile it waits for released) before any matcher advances
        if sched.is_empty:
            self._idle_on_grammars()
            return extra
        if gb is not None:
            self._finish_grammar_step(out)
        outputs = self.scheduler.update_from_output(sched, out)
        self._advance_grammars(outputs)
        return extra + outputs if extra else outputs

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """``step`` with several batches in flight: schedules and sends batches until ``max_in_flight_batches``
        are in flight or nothing is left to schedule, then waits for the oldest one's output and applies it.

        The running requests are split evenly over the micro-batches (at most ``ceil(unfinished / max in
        flight)`` each): one batch of all of them would leave every other stage idle.

        Raises:
            EngineDeadError: if a worker has died.
        """
        q = self.batch_queue
        scheduler = self.scheduler
        max_reqs = -(-(len(scheduler.running) + len(scheduler.waiting)) // self.max_in_flight_batches)
        extra = []  # failed grammar compiles
        if self.structured_output_manager is not None and self.structured_output_manager.has_pending():
            extra = self._admit_grammar_requests()
        while len(q) < self.max_in_flight_batches:
            sched = scheduler.schedule(max(1, max_reqs))
            if sched.is_empty:
                if not q:  # nothing in flight: the empty step tells the workers which requests finished
                    self.executor.execute_model(sched)
                    self._idle_on_grammars()
                    return extra
                # Those ids go out with the next batch instead (the runner drops a finished request's state).
                scheduler.finished_req_ids |= sched.finished_req_ids
                break
            scheduler.mark_in_flight(sched)
            self._attach_grammar_bitmask(sched)
            q.append((self.executor.execute_model(sched, non_block=True), sched))
            if len(q) > self.num_batches_in_flight_peak:
                self.num_batches_in_flight_peak = len(q)
        pending, sched = q.popleft()
        outputs = scheduler.update_from_output(sched, pending.result())
        self._advance_grammars(outputs)
        return extra + outputs if extra else outputs

    def has_unfinished_requests(self) -> bool:
        """True while a request is waiting or running, or a batch is still in flight."""
        so = self.structured_output_manager
        return (self.scheduler.has_unfinished_requests() or bool(self.batch_queue)
                or (so is not None and so.has_pending()))

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        """Stops the worker processes of a parallel engine (nothing to do in-process)."""
        if self.executor is not None:
            self.executor.shutdown()
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
