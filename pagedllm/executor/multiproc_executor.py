"""``MultiprocExecutor``: one worker process per rank on this machine (torch.multiprocessing, spawned).

Control plane: the driver (the engine core's thread, which runs the scheduler once) pickles each
``SchedulerOutput`` once and writes it down a pipe to every worker; the output rank (TP rank 0 of the last pipeline
stage) writes the ``ModelRunnerOutput`` back. With pipeline parallelism the driver may send the next step before
the last one's output is back (``execute_model(..., non_block=True)`` -> ``PendingOutput``): every rank reads its pipe
in order, so all stages run the micro-batches in the order sent (their point-to-point sends and receives pair up),
and the output rank answers in that order. Data plane: everything between ranks (all-reduces, logits gathers,
pipeline hand-offs, the sampled tokens) goes through ``torch.distributed`` (gloo on CPU).

Failure: the driver waits on the output pipe *and* every worker's process sentinel, so a worker that dies makes
the step raise ``EngineDeadError`` naming the rank at once, instead of the survivors hanging in a collective; a
monitor thread reports a death that happens while the engine is idle. The survivors are then terminated.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import socket
import threading
import time
import traceback
import weakref
from collections import deque
from multiprocessing.connection import wait
from typing import Callable, Optional

from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 600.0
# How long a rank's step error waits for a peer's exit to show (a killed peer's sentinel can fire after the survivor
# has already reported the reset connection).
_PEER_DEATH_GRACE_S = 1.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(config: EngineConfig, rank: int, world_size: int, init_method: str, conn,
                 num_threads: int) -> None:
    """Worker process: build the rank, report ``("ready", WorkerInfo)``, then serve ``(method, args)`` calls."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    from pagedllm.worker.worker import Worker

    try:
        worker = Worker(config, rank, world_size, init_method, num_threads=num_threads)
        conn.send(("ready", worker.info()))
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    output_rank = worker.groups.output_rank
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the driver is gone
        if method == "shutdown":
            break
        try:
            result = getattr(worker, method)(*args)
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
            raise
        if method != "execute_model" or rank == output_rank:
            conn.send(("ok", result))
    worker.shutdown()


def _watch(executor_ref, sentinels) -> None:
    """Monitor thread: waits for any worker to exit and has the executor report it."""
    ready = wait(sentinels)
    executor = executor_ref()
    if executor is not None:
        executor._report_death(ready)


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(1)


class PendingOutput:
    """The ``ModelRunnerOutput`` of a step sent without waiting (vLLM returns a Future here; a future's thread
    would be one more runnable thread on a machine whose cores the ranks already use)."""

    __slots__ = ("_executor", "_output", "_done")

    def __init__(self, executor: "MultiprocExecutor") -> None:
        self._executor = executor
        self._output = None
        self._done = False

    def result(self):
        """Blocks until the output rank has answered this step (and every step sent before it).

        Raises:
            EngineDeadError: if a worker dies meanwhile.
        """
        if not self._done:
            self._executor._receive_until(self)
        return self._output


class MultiprocExecutor:
    """Looks like a ``ModelRunner`` to ``EngineCore`` (``execute_model``), plus the agreed KV block count."""

    def __init__(self, config: EngineConfig) -> None:
        import torch.multiprocessing as mp

        pc = config.parallel
        self.world_size = pc.tensor_parallel_size * pc.pipeline_parallel_size
        self.output_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        init_method = pc.distributed_init_method or f"tcp://127.0.0.1:{_free_port()}"
        # Cores split between the ranks, unless OMP_NUM_THREADS says otherwise.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        num_threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, cores // self.world_size))
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self._dead = None  # EngineDeadError once a worker has died
        self._stopping = False
        self._death_callbacks: list[Callable] = []
        self._pending: deque[PendingOutput] = deque()  # steps sent with non_block whose output isn't received
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker_main, args=(config, rank, self.world_size, init_method, child,
                                                      num_threads), name=f"pagedllm-worker-{rank}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _kill, self.procs)
        # Stop the workers before multiprocessing's exit handler terminates them (which would read as a death).
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown())
        try:
            self.workers = [self._recv(r, WORKER_START_TIMEOUT_S, starting=True) for r in range(self.world_size)]
        except BaseException:
            self._stopping = True  # the others may wait in a collective for the failed one: no graceful stop
            _kill(self.procs)
            raise
        self.num_blocks = self.workers[0].num_blocks
        windows = {w.group_windows for w in self.workers}
        if len(windows) != 1:
            self.shutdown()
            raise ValueError(f"pipeline stages disagree on KV cache groups {windows}: this model's layer types "
                             f"can't be split into these stages.")
        self.group_windows = self.workers[0].group_windows
        # The monitor holds only a weak reference: an executor dropped without shutdown() is still collected (and
        # its finalizer stops the workers).
        self._monitor = threading.Thread(target=_watch, args=(weakref.ref(self), [p.sentinel for p in self.procs]),
                                         name="pagedllm-worker-monitor", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ calls
    def execute_model(self, scheduler_output, non_block: bool = False):
        """Runs one step on every rank -> its ``ModelRunnerOutput``, or with ``non_block`` a ``PendingOutput`` at
        once (pipeline parallelism: the next micro-batch is sent before this one's output is back).

        Raises:
            EngineDeadError: if a worker has died (also from ``PendingOutput.result()``).
        """
        self._send_all(("execute_model", (scheduler_output,)))
        if not non_block:
            return self._recv(self.output_rank)
        pending = PendingOutput(self)
        self._pending.append(pending)
        return pending

    def _receive_until(self, pending: "PendingOutput") -> None:
        """The output rank answers steps in the order they were sent: receives outputs up to ``pending``'s."""
        while not pending._done:
            first = self._pending.popleft()
            first._output = self._recv(self.output_rank)
            first._done = True

    def collective_rpc(self, method: str, *args) -> list:
        """Calls ``Worker.method(*args)`` on every rank; their results in rank order (after pending steps)."""
        if self._pending:
            self._receive_until(self._pending[-1])
        self._send_all((method, args))
        return [self._recv(r) for r in range(self.world_size)]

    def on_death(self, callback: Callable) -> None:
        """``callback(EngineDeadError)`` runs (on a monitor thread) when a worker dies, also while idle."""
        self._death_callbacks.append(callback)
        if self._dead is not None:
            callback(self._dead)

    def _send_all(self, msg: tuple) -> None:
        if self._dead is not None:
            raise self._dead
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError:
                self._check_workers()
                raise self._died("a worker pipe closed")

    def _recv(self, rank: int, timeout: Optional[float] = None, starting: bool = False):
        conn = self.conns[rank]
        while True:
            if conn.poll():
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    self._check_workers()
                    raise self._died(f"rank {rank} closed its pipe")
                if kind in ("ready", "ok"):
                    return payload
                if starting:  # a bad setting found by the worker (e.g. KV cache too small) stays a ValueError
                    exc = ValueError if payload.startswith("ValueError:") else RuntimeError
                    raise exc(f"tensor/pipeline-parallel worker rank {rank} failed to start: {payload}")
                # A rank's error is often the echo of a peer's death (its collective's connection was reset by the
                # dead peer): a peer that exits within a second is named as the cause instead.
                fired = wait([p.sentinel for i, p in enumerate(self.procs) if i != rank], _PEER_DEATH_GRACE_S)
                if fired:
                    self._check_workers(fired)
                raise self._died(f"worker {payload}")
            ready = wait([conn] + [p.sentinel for p in self.procs], timeout)
            if not ready:
                raise self._died(f"rank {rank} did not answer within {timeout} s")
            if conn not in ready:
                self._check_workers(ready)

    def _check_workers(self, ready_sentinels=()) -> None:
        """Raises the EngineDeadError if a worker has exited (``ready_sentinels``: sentinels known to have fired;
        a sentinel fires a moment before ``is_alive`` turns false)."""
        for rank, p in enumerate(self.procs):
            if p.sentinel in ready_sentinels or not p.is_alive():
                p.join(1.0)
                last = ""
                try:  # its last words, if it said why ("failed" at start-up, "error" from a call)
                    if self.conns[rank].poll():
                        kind, payload = self.conns[rank].recv()
                        if kind in ("failed", "error"):
                            last = f": {payload}"
                except (EOFError, OSError, ValueError):
                    pass
                raise self._died(f"worker rank {rank} (pid {p.pid}) died with exit code {p.exitcode}{last}")

    def _died(self, what: str):
        from pagedllm.engine.exceptions import EngineDeadError

        if self._dead is None:
            self._dead = EngineDeadError(f"tensor/pipeline-parallel {what}; the engine is down.")
            if not self._stopping:
                logger.error("%s", self._dead)
            _kill(self.procs)
        return self._dead

    def _report_death(self, ready_sentinels) -> None:
        if self._stopping:
            return
        try:
            self._check_workers(ready_sentinels)
        except BaseException as err:  # noqa: BLE001 - the EngineDeadError from _died
            for cb in self._death_callbacks:
                try:
                    cb(err)
                except Exception:  # noqa: BLE001
                    logger.exception("worker death callback failed")

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        data = pickle.dumps(("shutdown", ()))
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        _kill(self.procs)
        for conn in self.conns:
            conn.close()
