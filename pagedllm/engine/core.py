"""EngineCore: ``step() = schedule -> execute_model -> update_from_output``."""

from __future__ import annotations

import logging
from typing import Iterable, Optional

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.output import EngineCoreOutput
from pagedllm.core.scheduler import Scheduler, SchedulerStats
from pagedllm.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the model runner. Not thread-safe: one thread drives it."""

    def __init__(self, config: EngineConfig, model=None) -> None:
        from pagedllm.kv_cache_spec import plan_kv_cache_layout
        from pagedllm.model_loader.loader import load_model
        from pagedllm.worker.model_runner import ModelRunner, determine_num_blocks

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
            num_blocks = determine_num_blocks(config, model.kv_cache_spec(), layout)
            self.runner = ModelRunner(config, model, num_blocks, layout=layout)
            group_windows = layout.group_windows
        self.num_blocks = num_blocks
        self.kv_cache_manager = KVCacheManager(num_blocks, config.cache.block_size,
                                               config.cache.enable_prefix_caching, group_windows)
        sc = config.scheduler
        self.scheduler = Scheduler(self.kv_cache_manager, sc.max_num_seqs, sc.max_num_batched_tokens,
                                   sc.max_model_len, sc.enable_chunked_prefill)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        out = self.runner.execute_model(sched)
        if sched.is_empty:
            return []
        return self.scheduler.update_from_output(sched, out)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        """Stops the worker processes of a parallel engine (nothing to do in-process)."""
        if self.executor is not None:
            self.executor.shutdown()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
