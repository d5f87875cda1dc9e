"""``draft_model``: a second, smaller model (the target's vocabulary) drafts; also the engine of ``self_int4``.

The draft loads like the target (``model_loader.load_model``: an HF folder or a GGUF file, whose quant types run
as stored) from ``SpeculativeConfig.draft_model_config``, once per target model (kept on it, so engines built on
the same loaded target with ``LLM.with_engine_args`` share it).

KV cache: the draft has its own paged cache (its own layers, heads and bytes per block), indexed by the target's
block tables (the same block ids), so prefix caching, preemption and freeing need no bookkeeping of their own: every
token the target computes, the draft computes too in the same step (``mirror``: the target's input rows through the
draft), so a block the target holds for a request holds the draft's K/V of the same tokens (a prefix-cache hit is
also one for the draft). After sampling, ``propose`` runs ``k`` greedy decode steps of the draft for every request
that sampled. Their K/V go to the request's own blocks where it has them and past its last block into scratch
blocks (``scratch_blocks_per_row`` per batch row, after the target's ``num_blocks``); the next step's mirror
rewrites those positions in the target's blocks. ``determine_num_blocks`` counts the draft's bytes per block and
its scratch blocks inside the KV budget (``draft_kv_bytes``).

Exactness never rests on the draft: a draft token is kept only when the target samples it itself
(``spec_decode/verify.py``), so a stale or wrong draft K/V only costs acceptance.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from pagedllm.attention.cpu_kernels import argmax_rows
from pagedllm.attention.torch_attn import build_attention_metadata
from pagedllm.layers.quantization.kernels import step_rows

_KEY = "_draft_models"
SCRATCH = 2  # scratch blocks per batch row beyond those the k draft positions need


def max_drafting_reqs(config) -> int:
    """From this many requests in a step on the scheduler verifies no drafts (``Scheduler.spec_cap``): the most
    requests a drafter drafts for. ``config``: a ``SpeculativeConfig``."""
    limit = config.disable_by_batch_size or (1 << 62)
    return min(limit, max(r for r in range(1, 65) if (config.step_token_budget - r) // r > 0))


def scratch_blocks_per_row(config, block_size: int) -> int:
    """Scratch blocks one drafting row may write past its last block: ``SCRATCH + cdiv(k, block_size)``."""
    return SCRATCH + (config.num_speculative_tokens + block_size - 1) // block_size


def draft_kv_bytes(config, block_size: int, draft_layout, dtype_size: int) -> tuple[int, int]:
    """``(bytes per block, bytes of the scratch blocks)`` of a model-drafter's KV cache: ``draft_layout`` (a
    ``KVCacheLayout``) blocks of ``block_size`` tokens in elements of ``dtype_size`` bytes, and
    ``max_drafting_reqs * scratch_blocks_per_row`` scratch blocks. Example: Qwen2.5-0.5B (24 layers, 2 KV heads,
    head_dim 64) in bf16, block 16: 16 * 24 * 2 * 2 * 64 * 2 = 196,608 bytes a block; k 4, budget 8: 4 * 3 scratch
    blocks."""
    per_block = draft_layout.bytes_per_block(block_size, dtype_size)
    return per_block, per_block * max_drafting_reqs(config) * scratch_blocks_per_row(config, block_size)


def load_draft_model(config, target: nn.Module) -> nn.Module:
    """The draft of ``config`` (a ``SpeculativeConfig`` with ``draft_model_config``) for ``target``, loaded once and
    kept on ``target``.

    Raises:
        ValueError: for weights that don't fit the draft's architecture (from the loader).
    """
    from pagedllm.model_loader.loader import load_model

    mc = config.draft_model_config
    key = (mc.model, str(mc.dtype), repr(mc.quantization), mc.max_model_len)
    drafts = target.__dict__.setdefault(_KEY, {})
    if key not in drafts:
        drafts[key] = load_model(mc)
    return drafts[key]


class DraftModelDrafter:
    """The runner's drafter for a model that drafts with its own KV cache (see the module docstring).

    ``runner``: the ``ModelRunner`` (block size, ``num_blocks``, its KV layout); ``draft``: the draft model (plain
    module: ``forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, H]``, ``compute_logits(hidden)
    -> [T, V]``, ``kv_cache_spec()``); ``layout``: the draft's ``KVCacheLayout`` (one group); ``dtype``: its KV dtype.

    Raises:
        ValueError: the target or the draft has more than one KV cache group (hybrid sliding-window layers), or
            their sliding windows differ (the draft attends with the target's attention metadata).
    """

    mirrors = True
    method = "draft_model"

    def __init__(self, config, runner, draft: nn.Module, layout, dtype: torch.dtype) -> None:
        from pagedllm.worker.model_runner import allocate_kv_caches

        if runner.num_groups != 1 or layout.num_groups != 1:
            raise ValueError(f"speculative_config.method {self.method!r} needs one KV cache group in the target and "
                             f"the draft (no hybrid sliding-window attention).")
        window = getattr(draft, "sliding_window", None)
        if window != runner.sliding_window:
            raise ValueError(f"speculative_config.model: the draft's sliding window ({window}) differs from the "
                             f"target's ({runner.sliding_window}).")
        self.k = config.num_speculative_tokens
        self.max_num_reqs = max_drafting_reqs(config)
        self.draft = draft
        self.block_size = runner.block_size
        self.num_blocks = runner.num_blocks
        self.scratch = scratch_blocks_per_row(config, self.block_size)
        self.sliding_window = runner.sliding_window
        caches = allocate_kv_caches(layout.slot_specs, self.num_blocks + self.max_num_reqs * self.scratch,
                                    self.block_size, dtype, runner.device)
        self.kv_caches = [caches[s] for s in layout.layer_slot]

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        """The target's step through the draft (inside the runner's ``step_rows``): the draft's K/V of the same
        tokens (``input_ids [T]`` at ``positions [T]``) at the same slots (``meta``, the target's attention
        metadata). Its hidden states are not needed."""
        self.draft(input_ids, positions, self.kv_caches, meta)

    def propose(self, states: Sequence, sampled: Sequence[Sequence[int]]) -> list[list[int]]:
        """``k`` greedy draft tokens for every request that sampled this step (none for structured outputs).
        ``states[i]``: a runner request state (``token_ids``: prompt + output, this step's tokens included;
        ``block_ids``); ``sampled[i]``: its tokens of this step."""
        out: list[list[int]] = [[] for _ in states]
        if len(states) > self.max_num_reqs:
            return out
        idx = [i for i, (st, toks) in enumerate(zip(states, sampled))
               if toks and getattr(st.sampling_params, "structured_outputs", None) is None]
        if not idx:
            return out
        n, bs = len(idx), self.block_size
        pos = np.asarray([len(states[i].token_ids) - 1 for i in idx], dtype=np.int64)  # the last token's
        width = max(len(states[i].block_ids) for i in idx) + self.scratch
        bt_np = np.zeros((n, width), dtype=np.int64)
        for j, i in enumerate(idx):
            ids = states[i].block_ids
            bt_np[j, :len(ids)] = ids
            bt_np[j, len(ids):len(ids) + self.scratch] = self.num_blocks + j * self.scratch + np.arange(self.scratch)
        block_tables = torch.from_numpy(bt_np)
        rows = np.arange(n)
        tokens = torch.tensor([states[i].token_ids[-1] for i in idx], dtype=torch.int64)
        drafts = []
        ones = [1] * n
        with step_rows(ones):
            for _ in range(self.k):
                slots = torch.from_numpy(bt_np[rows, pos // bs] * bs + pos % bs)
                meta = build_attention_metadata(ones, (pos + 1).tolist(), block_tables, slots, bs,
                                                self.sliding_window)
                hidden = self.draft(tokens, torch.from_numpy(pos.copy()), self.kv_caches, meta)
                tokens = argmax_rows(self.draft.compute_logits(hidden))
                drafts.append(tokens)
                pos = pos + 1
        mat = torch.stack(drafts, dim=1).tolist()  # [n, k]
        for j, i in enumerate(idx):
            out[i] = mat[j]
        return out


def make_draft_model_drafter(config, runner, draft: Optional[nn.Module] = None) -> DraftModelDrafter:
    """The ``draft_model`` drafter of ``runner``: ``draft`` (default ``load_draft_model(config, runner.model)``),
    its linears packed like the target's, its KV in the target's dtype."""
    from pagedllm.kv_cache_spec import plan_kv_cache_layout
    from pagedllm.layers.packed_linear import pack_linear_weights, packing_supported

    draft = draft if draft is not None else load_draft_model(config, runner.model)
    dtype = config.draft_model_config.dtype
    if packing_supported(dtype, runner.device) and not draft.__dict__.get("_packed"):
        pack_linear_weights(draft)  # oneDNN layout once, as the target's
        draft.__dict__["_packed"] = True
    return DraftModelDrafter(config, runner, draft, plan_kv_cache_layout(draft.kv_cache_spec()), dtype)
