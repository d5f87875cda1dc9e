"""Process groups for tensor (TP) and pipeline (PP) parallelism, and the collectives the model layers call.

Ranks are laid out as in vLLM: ``rank = pp_rank * tp_size + tp_rank``. With tp=2, pp=2:

| rank | pp_rank | tp_rank | TP group | PP group |
|---|---|---|---|---|
| 0 | 0 | 0 | {0, 1} | {0, 2} |
| 1 | 0 | 1 | {0, 1} | {1, 3} |
| 2 | 1 | 0 | {2, 3} | {0, 2} |
| 3 | 1 | 1 | {2, 3} | {1, 3} |

Nothing here is initialized in a single-process engine: the getters then answer rank 0 of size 1, and the model
builds exactly the unsharded modules it always did (no collective is ever called on that path).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

# Workers wait for the next step without a timeout of their own: the driver watches them (a dead peer is reported
# by the driver, which then ends the others), and an idle engine must not time out inside a collective.
_NO_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class ParallelGroups:
    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    tp_group: Optional[dist.ProcessGroup]
    pp_group: Optional[dist.ProcessGroup]
    tp_ranks: tuple[int, ...]  # global ranks of this rank's TP group
    pp_ranks: tuple[int, ...]  # global ranks of this rank's PP group (stage order)
    cpu_group: Optional[dist.ProcessGroup] = None  # gloo world group for pickled objects (None: the world is gloo)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def output_rank(self) -> int:
        """The global rank that samples and reports results: TP rank 0 of the last stage."""
        return (self.pp_size - 1) * self.tp_size


_GROUPS: Optional[ParallelGroups] = None


def default_backend(device: str = "cpu") -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_distributed(rank: int, world_size: int, tp_size: int, pp_size: int, init_method: str,
                     backend: str = "gloo") -> ParallelGroups:
    """Joins the world (``init_method``: ``tcp://host:port`` or ``env://``) and builds the TP and PP groups.

    Raises:
        ValueError: if ``world_size != tp_size * pp_size``.
    """
    global _GROUPS
    if world_size != tp_size * pp_size:
        raise ValueError(f"world size {world_size} != tensor_parallel_size {tp_size} * "
                         f"pipeline_parallel_size {pp_size}.")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=_NO_TIMEOUT)
    tp_group = pp_group = None
    my_tp: tuple[int, ...] = (rank,)
    my_pp: tuple[int, ...] = (rank,)
    # new_group must be called by every rank for every group, in the same order.
    for p in range(pp_size):
        ranks = list(range(p * tp_size, (p + 1) * tp_size))
        g = dist.new_group(ranks, timeout=_NO_TIMEOUT) if tp_size > 1 else None
        if rank in ranks:
            tp_group, my_tp = g, tuple(ranks)
    for t in range(tp_size):
        ranks = list(range(t, world_size, tp_size))
        g = dist.new_group(ranks, timeout=_NO_TIMEOUT) if pp_size > 1 else None
        if rank in ranks:
            pp_group, my_pp = g, tuple(ranks)
    # Pickled objects (sampler results) travel on CPU tensors: with NCCL they need a gloo group of their own.
    cpu_group = dist.new_group(backend="gloo", timeout=_NO_TIMEOUT) if backend != "gloo" else None
    _GROUPS = ParallelGroups(rank, world_size, tp_size, pp_size, tp_group, pp_group, my_tp, my_pp, cpu_group)
    return _GROUPS


def destroy_distributed() -> None:
    global _GROUPS
    _GROUPS = None
    if dist.is_initialized():
        dist.destroy_process_group()


def get_groups() -> Optional[ParallelGroups]:
    return _GROUPS


def get_tp_size() -> int:
    return _GROUPS.tp_size if _GROUPS else 1


def get_tp_rank() -> int:
    return _GROUPS.tp_rank if _GROUPS else 0


def get_pp_size() -> int:
    return _GROUPS.pp_size if _GROUPS else 1


def get_pp_rank() -> int:
    return _GROUPS.pp_rank if _GROUPS else 0


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums ``x`` over the TP group, in place (returns ``x``)."""
    if _GROUPS is None or _GROUPS.tp_size == 1:
        return x
    dist.all_reduce(x, group=_GROUPS.tp_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` on each TP rank -> ``[..., tp * n]`` (rank order along the last dim)."""
    if _GROUPS is None or _GROUPS.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_GROUPS.tp_size)]
    dist.all_gather(parts, x, group=_GROUPS.tp_group)
    return torch.cat(parts, dim=-1)


def pp_send(tensors: list[torch.Tensor]) -> None:
    """Sends ``tensors`` to the same TP rank of the next stage (blocking point-to-point)."""
    g = _GROUPS
    dst = g.pp_ranks[g.pp_rank + 1]
    for t in tensors:
        dist.send(t.contiguous(), dst=dst, group=g.pp_group)


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype,
            device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Receives tensors of ``shapes`` from the same TP rank of the previous stage."""
    g = _GROUPS
    src = g.pp_ranks[g.pp_rank - 1]
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src, group=g.pp_group)
        out.append(t)
    return out


def broadcast_object(obj, src: int):
    """``obj`` from global rank ``src`` to every rank (pickled, over the world group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_GROUPS.cpu_group if _GROUPS else None)
    return box[0]


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of stage ``pp_rank``: an even split, earlier stages one fewer when uneven
    (30 layers, pp 4: 7, 7, 8, 8)."""
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size ({pp_size}) is larger than the number of layers ({num_layers}).")
    return pp_rank * num_layers // pp_size, (pp_rank + 1) * num_layers // pp_size
