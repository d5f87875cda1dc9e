"""Executors run the model for ``EngineCore``: in-process (the plain ``ModelRunner``, tp = pp = 1), one worker
process per rank (``MultiprocExecutor``), or this process as one rank of a ``torchrun`` launch
(``ExternalLauncherExecutor``)."""

from __future__ import annotations


def make_executor(config):
    """The executor for ``config.parallel`` (only called when it is parallel)."""
    from pagedllm.worker.worker import check_parallel_supported

    check_parallel_supported(config)
    if config.parallel.distributed_executor_backend == "external_launcher":
        from pagedllm.executor.external_launcher import ExternalLauncherExecutor

        return ExternalLauncherExecutor(config)
    from pagedllm.executor.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config)
