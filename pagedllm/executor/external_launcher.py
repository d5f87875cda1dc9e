"""``ExternalLauncherExecutor``: this process is one rank, started by an outside launcher (vLLM's
``external_launcher``), e.g. on each of two machines::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr HOST0 --master-port 29500 my_script.py

where ``my_script.py`` builds ``LLM(model, tensor_parallel_size=2, distributed_executor_backend="external_launcher")``.
Rank and world size come from torchrun's ``RANK`` / ``WORLD_SIZE`` (``init_method`` ``env://``), or, without torchrun,
from ``--node-rank`` / ``--nnodes`` (one rank per node) and ``--distributed-init-method tcp://HOST0:PORT``.

Every rank runs the whole engine, scheduler included, on the same prompts: the scheduler is deterministic, so all
ranks schedule the same steps and no ``SchedulerOutput`` needs to travel; all ranks return the same outputs.
"""

from __future__ import annotations

import os

from pagedllm.config import EngineConfig


def external_rank(config: EngineConfig) -> tuple[int, int, str]:
    """-> (rank, world_size, init_method) for this process.

    Raises:
        ValueError: if neither torchrun's environment nor ``node_rank`` / ``nnodes`` / an init method give them,
            or the world size isn't ``tensor_parallel_size * pipeline_parallel_size``.
    """
    pc = config.parallel
    world = pc.tensor_parallel_size * pc.pipeline_parallel_size
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_method = pc.distributed_init_method or "env://"
    else:
        if not pc.distributed_init_method:
            raise ValueError("distributed_executor_backend='external_launcher' needs torchrun (RANK, WORLD_SIZE) or "
                             "--distributed-init-method with --nnodes / --node-rank.")
        rank, size, init_method = pc.node_rank, pc.nnodes, pc.distributed_init_method
    if size != world:
        raise ValueError(f"the launcher started {size} ranks; tensor_parallel_size * pipeline_parallel_size = {world}.")
    return rank, size, init_method


class ExternalLauncherExecutor:
    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.worker.worker import Worker

        rank, world, init_method = external_rank(config)
        self.world_size = world
        self.worker = Worker(config, rank, world, init_method)
        self.num_blocks = self.worker.num_blocks
        self.group_windows = tuple(self.worker.layout.group_windows)
        # Every rank needs each step's result (its own scheduler advances on it): the output rank's runner output
        # is broadcast. Tokens already reach every rank (BroadcastSampler); this adds logprobs computed there.
        self.output_rank = self.worker.groups.output_rank

    def execute_model(self, scheduler_output):
        from pagedllm.distributed.parallel_state import broadcast_object

        out = self.worker.execute_model(scheduler_output)
        return broadcast_object(out, self.output_rank)

    def collective_rpc(self, method: str, *args) -> list:
        return [getattr(self.worker, method)(*args)]

    def on_death(self, callback) -> None:
        pass  # a dead peer surfaces as an error from the next collective

    def shutdown(self, timeout: float = 10.0) -> None:
        self.worker.shutdown()
