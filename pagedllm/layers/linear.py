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

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator}).")
    return numerator // denominator


@dataclass(frozen=True)
class HeadSplit:
    q_head_start: int
    num_heads: int
    kv_head_start: int
    num_kv_heads: int


def tp_head_split(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadSplit:
    """This rank's query and KV heads. Heads move in GQA groups (a KV head with its ``num_heads / num_kv_heads``
    query heads), so each rank's attention is ordinary GQA over its own heads.

    - ``num_kv_heads >= tp``: KV heads split as evenly as possible; when they don't divide, the later ranks take one
      more. SmolLM2-135M (9 heads, 3 KV heads) at tp 2: rank 0 = KV head 0 + q heads 0-2, rank 1 = KV heads 1-2 +
      q heads 3-8.
    - ``num_kv_heads < tp``: each KV head is replicated on ``tp / num_kv_heads`` ranks, which split its query heads
      (4 heads, 1 KV head, tp 2: both ranks hold KV head 0; rank 0 q heads 0-1, rank 1 q heads 2-3).

    Raises:
        ValueError: when the heads can't be split that way, with the numbers.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads "
                         f"({num_kv_heads}).")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv0, kv1 = tp_rank * num_kv_heads // tp_size, (tp_rank + 1) * num_kv_heads // tp_size
        return HeadSplit(kv0 * group, (kv1 - kv0) * group, kv0, kv1 - kv0)
    replicas = tp_size // num_kv_heads
    if tp_size % num_kv_heads or group % replicas:
        raise ValueError(f"tensor_parallel_size {tp_size} can't split {num_heads} attention heads with "
                         f"{num_kv_heads} KV heads: with fewer KV heads than ranks, tensor_parallel_size must be a "
                         f"multiple of num_key_value_heads and divide each KV head's {group} query heads.")
    kv = tp_rank // replicas
    per = group // replicas
    return HeadSplit(kv * group + (tp_rank % replicas) * per, per, kv, 1)


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
        split = tp_head_split(num_heads, num_kv_heads, get_tp_size(), get_tp_rank())
        q, kv = split.num_heads * head_dim, split.num_kv_heads * head_dim
        super().__init__(hidden_size, q + 2 * kv, bias, dtype)
        self.num_heads, self.num_kv_heads = split.num_heads, split.num_kv_heads
        self.q_head_start = split.q_head_start
        self.output_sizes = (q, kv, kv)
        kv_start = split.kv_head_start * head_dim
        self._shard_src = [(split.q_head_start * head_dim, q), (kv_start, kv), (kv_start, kv)]


class RowParallelLinear(nn.Linear):
    """Input columns split over the TP ranks; the partial outputs are summed (all-reduce), then the bias added.

    ``input_split``: this rank's (first column, columns) when the split is uneven (o_proj after uneven heads)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 input_split: Optional[tuple[int, int]] = None):
        if input_split is None:
            local_in = divide(in_features, get_tp_size(), "input size of a row-parallel layer")
            input_split = (get_tp_rank() * local_in, local_in)
        col_start, local_in = input_split
        super().__init__(local_in, out_features, bias=bias, device="meta", dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features, local_in, dtype=dtype), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
        for p in self.parameters(recurse=False):
            p.weight_loader = self.weight_loader
        self._col_start = col_start

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
