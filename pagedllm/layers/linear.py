"""Tensor-parallel linear layers (vLLM's shapes). Used only when the TP size is > 1; a single-process engine
builds plain ``nn.Linear``s.

- ``ColumnParallelLinear``: ``y = x W^T``, W split by output rows; each rank computes its slice of ``y``.
  ``MergedColumnParallelLinear`` (gate/up) and ``QKVParallelLinear`` (q/k/v by heads) hold several such slices
  side by side, so the fused matmul stays one matmul per rank.
- ``RowParallelLinear``: W split by input columns; each rank gets the matching slice of ``x`` (the output of a
  column-parallel layer, unchanged) and the partial products are summed with an all-reduce.

Each sharded parameter has a ``weight_loader(param, loaded_weight, shard_id)`` that narrows the full checkpoint
tensor to this rank's part while loading, so a rank holds only its shard.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator}).")
    return numerator // denominator


def tp_kv_heads(num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """-> (KV heads per rank, ranks sharing each KV head). With fewer KV heads than ranks each KV head is
    replicated on ``tp_size // num_kv_heads`` ranks (e.g. 1 KV head, tp 2: both ranks hold head 0).

    Raises:
        ValueError: if neither divides the other.
    """
    if num_kv_heads >= tp_size:
        return divide(num_kv_heads, tp_size, "num_key_value_heads"), 1
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp_size}) must be divisible by num_key_value_heads "
                         f"({num_kv_heads}) when it is larger.")
    return 1, tp_size // num_kv_heads


class ColumnParallelLinear(nn.Linear):
    """Output rows split over the TP ranks; ``output_sizes`` are this rank's row counts of each fused shard."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        # Parameters are made on "meta" and replaced by uninitialized ones: load_weights fills them.
        super().__init__(in_features, out_features, bias=bias, device="meta", dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
        for p in self.parameters(recurse=False):
            p.weight_loader = self.weight_loader
        self.output_sizes: tuple[int, ...] = (out_features,)
        # per fused shard: (first row in the checkpoint tensor, rows) for this rank
        self._shard_src: list[tuple[int, int]] = [(get_tp_rank() * out_features, out_features)]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int]) -> None:
        i = shard_id or 0
        src_start, rows = self._shard_src[i]
        dst_start = sum(self.output_sizes[:i])
        dest = param.data.narrow(0, dst_start, rows)
        _copy_checked(dest, loaded.narrow(0, src_start, rows), param)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers fused (gate/up): full sizes ``output_sizes`` are each split over the ranks."""

    def __init__(self, in_features: int, output_sizes: tuple[int, ...], bias: bool, dtype: torch.dtype):
        tp, rank = get_tp_size(), get_tp_rank()
        local = tuple(divide(s, tp, "intermediate_size") for s in output_sizes)
        super().__init__(in_features, sum(local), bias, dtype)
        self.output_sizes = local
        self._shard_src = [(rank * n, n) for n in local]


class QKVParallelLinear(ColumnParallelLinear):
    """q/k/v fused and split by heads: each rank holds ``num_heads / tp`` query heads and its KV heads (replicated
    when there are fewer KV heads than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype):
        tp, rank = get_tp_size(), get_tp_rank()
        heads = divide(num_heads, tp, "num_attention_heads")
        kv_heads, kv_replicas = tp_kv_heads(num_kv_heads, tp)
        q, kv = heads * head_dim, kv_heads * head_dim
        super().__init__(hidden_size, q + 2 * kv, bias, dtype)
        self.num_heads, self.num_kv_heads = heads, kv_heads
        self.output_sizes = (q, kv, kv)
        kv_start = (rank // kv_replicas) * kv
        self._shard_src = [(rank * q, q), (kv_start, kv), (kv_start, kv)]


class RowParallelLinear(nn.Linear):
    """Input columns split over the TP ranks; the partial outputs are summed (all-reduce), then the bias added."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        tp = get_tp_size()
        local_in = divide(in_features, tp, "input size of a row-parallel layer")
        super().__init__(local_in, out_features, bias=bias, device="meta", dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features, local_in, dtype=dtype), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
        for p in self.parameters(recurse=False):
            p.weight_loader = self.weight_loader
        self._col_start = get_tp_rank() * local_in

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int]) -> None:
        if param.dim() == 2:
            loaded = loaded.narrow(1, self._col_start, param.shape[1])
        _copy_checked(param.data, loaded, param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tensor_model_parallel_all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def _copy_checked(dest: torch.Tensor, src: torch.Tensor, param: nn.Parameter) -> None:
    if dest.shape != src.shape:
        raise ValueError(f"weight shard shape {tuple(src.shape)} doesn't fit {tuple(dest.shape)} "
                         f"(parameter {tuple(param.shape)})")
    dest.copy_(src)
