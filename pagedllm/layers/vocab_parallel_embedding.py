"""Vocabulary-parallel embedding and LM head: each TP rank holds ``ceil(V / tp)`` rows of the table.

Rank ``r`` owns token ids ``[r * n, (r + 1) * n)``; the last rank's tail past ``V`` is zero padding. E.g. V=49152,
tp=2: n=24576, rank 1 owns ids 24576..49151. The embedding looks up the ids it owns, zeroes the rest and sums over
the ranks (exact: one rank contributes each row, the others add zeros). The LM head computes its rank's slice of
the logits; ``gather_logits`` concatenates them and drops the padding.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        tp = get_tp_size()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // tp)
        self.vocab_start = get_tp_rank() * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, embedding_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"embedding shape {tuple(loaded.shape)}, expected "
                             f"({self.num_embeddings}, {param.shape[1]})")
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded.narrow(0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        x = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary rows like the embedding (``compute_logits`` multiplies by it)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied through compute_logits, not called")


def gather_logits(local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, V / tp]`` per rank -> ``[N, V]`` on every rank (padding rows dropped)."""
    return tensor_model_parallel_all_gather(local_logits)[:, :vocab_size]
