"""One rank of a tensor / pipeline-parallel engine: joins the process groups, loads its shard of the model, sizes
and allocates its part of the KV cache and runs the unchanged ``ModelRunner`` step on it.

The runner sees a ``ParallelModel`` (this stage's layers, point-to-point hand-off of hidden states between stages,
logits gathered over the TP group) and a sampler: without pipeline stages a ``BroadcastSampler`` (the output rank
samples; every rank gets its tokens, so each rank's copy of the request state advances identically); with them a
``LastStageSampler`` (only the output rank samples; the scheduler sends the other ranks the tokens with the next
step, so no stage waits for the last one and several micro-batches can be in flight).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.distributed import parallel_state as ps

logger = logging.getLogger(__name__)

# Architectures whose layers are tensor/pipeline-parallel (pagedllm.models.llama).
PARALLEL_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def check_parallel_supported(config: EngineConfig) -> None:
    """Raises ValueError for a model or setting tensor/pipeline parallelism doesn't cover."""
    pc = config.parallel
    arch = config.model.architecture
    if arch not in PARALLEL_ARCHITECTURES:
        raise ValueError(f"tensor/pipeline parallelism supports {sorted(PARALLEL_ARCHITECTURES)}, not {arch}.")
    from pagedllm.layers.linear import divide, tp_head_split

    cfg = config.model.hf_config
    tp = pc.tensor_parallel_size
    heads = cfg.num_attention_heads
    for rank in range(tp):
        tp_head_split(heads, getattr(cfg, "num_key_value_heads", None) or heads, tp, rank)
    divide(cfg.intermediate_size, tp, "intermediate_size")
    ps.pp_layer_range(cfg.num_hidden_layers, 0, pc.pipeline_parallel_size)


class ParallelModel(nn.Module):
    """This rank's stage of the model with the ``forward`` / ``compute_logits`` the runner calls."""

    def __init__(self, model: nn.Module, groups: ps.ParallelGroups) -> None:
        super().__init__()
        self.model = model
        self.groups = groups
        self.vocab_size = model.vocab_size
        self.sliding_window = getattr(model, "sliding_window", None)

    def kv_cache_spec(self):
        return self.model.kv_cache_spec()

    def forward(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        g = self.groups
        if g.pp_size == 1:
            return self.model(input_ids, positions, kv_caches, attn_metadata)
        m = self.model.model
        if g.is_first_stage:
            x, residual = m.embed_tokens(input_ids), None
        else:  # hidden states and residual stream of the previous stage: [T, hidden] each
            shape = (input_ids.shape[0], self.model.hf_config.hidden_size)
            x, residual = ps.pp_recv([shape, shape], self.model.dtype, input_ids.device)
        cos, sin = m.rotary_emb(positions)
        layers = m.layers[m.start_layer:m.end_layer]
        metas = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata] * len(layers)
        for layer, kv_cache, meta in zip(layers, kv_caches, metas):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        if not g.is_last_stage:
            ps.pp_send([x, residual])
            return x  # not used: only the last stage's hidden states become logits
        x, _ = m.norm(x, residual)
        return x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 on the last stage (gathered over TP); zeros elsewhere (unused)."""
        g = self.groups
        if not g.is_last_stage:
            return torch.zeros(hidden_states.shape[0], self.vocab_size, device=hidden_states.device)
        if g.tp_size == 1:
            return self.model.compute_logits(hidden_states)
        from pagedllm.layers.vocab_parallel_embedding import gather_logits

        from pagedllm.layers.packed_linear import float32_logits

        local = float32_logits(self.model, hidden_states, self.model.lm_head.weight)
        return gather_logits(local, self.vocab_size)


class LastStageSampler:
    """Pipeline parallel: the output rank samples; every other rank gets None. No collective, so earlier stages can
    run the next micro-batch while the last one samples; the tokens reach them with the next ``SchedulerOutput``
    (``CachedRequestData.new_token_ids``)."""

    def __init__(self, sampler, groups: ps.ParallelGroups) -> None:
        self.sampler = sampler
        self.is_output_rank = groups.rank == groups.output_rank

    def __call__(self, logits, metadata):
        return self.sampler(logits, metadata) if self.is_output_rank else None


class BroadcastSampler:
    """The output rank samples; the result (tokens and logprobs) is broadcast to every rank."""

    def __init__(self, sampler, groups: ps.ParallelGroups) -> None:
        self.sampler = sampler
        self.groups = groups

    def __call__(self, logits, metadata):
        src = self.groups.output_rank
        so = self.sampler(logits, metadata) if self.groups.rank == src else None
        return ps.broadcast_object(so, src)


@dataclass(frozen=True)
class WorkerInfo:
    rank: int
    pid: int
    num_blocks: int
    group_windows: tuple
    weight_bytes: int
    kv_cache_bytes: int


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters and oneDNN-packed weights (tied parameters counted once; rotary tables and
    other buffers not)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_mkldnn]
    for t in tensors:
        key = id(t) if t.is_mkldnn else t.data_ptr()  # packed weights are opaque: no data pointer
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


class Worker:
    def __init__(self, config: EngineConfig, rank: int, world_size: int, init_method: str,
                 num_threads: Optional[int] = None) -> None:
        from pagedllm.kv_cache_spec import plan_kv_cache_layout
        from pagedllm.model_loader.loader import load_model
        from pagedllm.worker.model_runner import ModelRunner, determine_num_blocks

        if num_threads:
            torch.set_num_threads(num_threads)
        if config.kernel is not None:
            from pagedllm import kernels

            kernels.set_config(config.kernel)
        pc = config.parallel
        self.groups = ps.init_distributed(rank, world_size, pc.tensor_parallel_size, pc.pipeline_parallel_size,
                                          init_method, ps.default_backend("cpu"))
        self.rank = rank
        torch.manual_seed(config.model.seed)
        model = load_model(config.model)  # builds only this rank's shard (see pagedllm.models.llama)
        self.model = model
        layout = plan_kv_cache_layout(model.kv_cache_spec())
        num_blocks = determine_num_blocks(config, model.kv_cache_spec(), layout)
        # One block count for all ranks (the smallest): the driver's scheduler hands out the same block ids.
        t = torch.tensor([num_blocks], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        self.num_blocks = int(t.item())
        self.runner = ModelRunner(config, ParallelModel(model, self.groups), self.num_blocks, layout=layout)
        sampler_cls = LastStageSampler if self.groups.pp_size > 1 else BroadcastSampler
        self.runner.sampler = sampler_cls(self.runner.sampler, self.groups)
        self.layout = layout

    def info(self) -> WorkerInfo:
        kv = sum(t.numel() * t.element_size() for t in {id(c): c for c in self.runner.kv_caches}.values())
        return WorkerInfo(self.rank, os.getpid(), self.num_blocks, tuple(self.layout.group_windows),
                          resident_weight_bytes(self.model), kv)

    def execute_model(self, scheduler_output):
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        ps.destroy_distributed()
