"""``draft_model``: a second, smaller model (the target's vocabulary) drafts; also the engine of ``self_int4``.

The draft loads like the target (``model_loader.load_model``: an HF folder or a GGUF file, whose quant types run
as stored) from ``SpeculativeConfig.draft_model_config``, once per target model (kept on it, so engines built on
the same loaded target with ``LLM.with_engine_args`` share it).

KV cache: the draft has its own paged cache (its own layers, heads and bytes per block), indexed by the target's
block tables (the same block ids). The draft computes a request's tokens only when it drafts for it, lazily: each
request records how far the draft's K/V of its tokens is computed (``CachedRequestState.draft_computed``), and
``valid_blocks`` holds the blocks whose draft K/V is complete, so a prefix-cache hit on such blocks is one for the
draft too (``admit``; a block allocated afresh leaves the set, ``forget``). So a step that drafts for nobody (a batch
above ``max_drafting_reqs``, where speculation steps aside, or requests whose acceptance turned it off) runs no draft
forward at all, and under load speculation costs nothing. After sampling, ``propose`` runs the draft once over each
drafting request's tokens it lacks (the catch-up: its accepted drafts and its new token, whose logits give the first
draft token; after a pause, everything since it last drafted), then ``k - 1`` greedy decode steps. Their K/V go to
the request's own blocks where it has them and past its last block into scratch blocks (``scratch_blocks_per_row``
per drafting row, after the target's ``num_blocks``); the next step's catch-up rewrites those positions in the
target's blocks, and skips the accepted drafts whose K/V is in those blocks already (``CachedRequestState.draft_kv``).
``determine_num_blocks`` counts the draft's bytes per block and its scratch blocks inside the KV budget
(``draft_kv_bytes``).

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

    mirrors = True  # computes the target's tokens too (lazily): propose takes the step's starts and query lengths
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
        self.valid_blocks: set[int] = set()  # blocks whose draft K/V holds all their tokens

    def admit(self, st, num_cached_tokens: int) -> None:
        """A request (re)enters with its first ``num_cached_tokens`` tokens in blocks it found (prefix-cache hits);
        its other blocks are new. Its draft K/V counts as computed over the leading found blocks the draft had
        computed (``valid_blocks``)."""
        bs = self.block_size
        hits = min(num_cached_tokens // bs, len(st.block_ids))
        self.forget(st.block_ids[hits:])
        n = 0
        while n < hits and st.block_ids[n] in self.valid_blocks:
            n += 1
        st.draft_computed = n * bs
        st.draft_kv = None

    def forget(self, block_ids: Sequence[int]) -> None:
        """Blocks allocated afresh: whatever draft K/V they held is not theirs any more."""
        for b in block_ids:
            self.valid_blocks.discard(b)

    def _first_to_compute(self, st, toks: Sequence[int], start: int, end: int) -> int:
        """The first of a drafting request's positions ``[.., end)`` the draft computes this step: from
        ``st.draft_computed`` where it lags the step's ``start`` (a pause), else from ``start``, or after it where
        the last step drafted for it: the draft's K/V of that step's new token and of its draft tokens is in the
        request's blocks already (``st.draft_kv``); of them, that new token's and those of the drafts this step
        accepted (``toks`` but its last token) hold the right tokens, so rows start after them: a fully accepted
        draft of ``k`` costs 2 rows instead of ``k + 2``, a rejected one 1. The same blocks must still hold them
        (not after a preemption), and one row is always computed."""
        if st.draft_computed < start:
            return st.draft_computed
        rec = st.draft_kv
        if rec is None or not toks or rec[0] != start:
            return start
        first, kv_end, blocks = rec
        b0 = first // self.block_size
        if tuple(st.block_ids[b0:b0 + len(blocks)]) != blocks:
            return start
        return max(start, min(kv_end, start + len(toks), end - 1))

    def propose(self, states: Sequence, sampled: Sequence[Sequence[int]], starts: Sequence[int],
                query_lens: Sequence[int], limits: Optional[Sequence[int]] = None) -> list[list[int]]:
        """Catches the draft's KV up with this step's tokens and drafts ``k`` greedy tokens (``limits[i]`` for
        request ``i`` where given: the scheduler's adaptive share; 0 drafts none) for every request that sampled
        (none for structured outputs, none at all above ``max_num_reqs`` requests). A request's draft steps stop at
        its limit: drafting costs a draft forward per position, so a low-acceptance request no longer pays ``k``.

        ``states[i]``: a runner request state (``token_ids``: prompt + output, this step's tokens included;
        ``block_ids``); ``sampled[i]``: its tokens of this step; ``starts[i]``, ``query_lens[i]``: its first
        position and row count in this step. The first draft forward computes, per request, the tokens now known
        from ``starts[i]`` on: a request that sampled its accepted drafts and the new token (whose logits give the
        first draft token), one still prefilling its chunk; so the draft's KV holds every token the target's does
        (in the same forward as the first draft step). Then ``k - 1`` decode
        steps of the drafting rows only.
        """
        out: list[list[int]] = [[] for _ in states]
        n_all, bs = len(states), self.block_size
        drafting = n_all <= self.max_num_reqs
        limits = limits or [self.k] * n_all
        idx = [i for i, (st, toks, lim) in enumerate(zip(states, sampled, limits))
               if drafting and toks and lim > 0 and getattr(st.sampling_params, "structured_outputs", None) is None]
        d_states = [states[i] for i in idx]
        # Rows of each drafting request: from what its draft K/V lacks up to its new token (whose logits draft).
        ends = [len(st.token_ids) for st in d_states]
        firsts = [self._first_to_compute(st, sampled[i], starts[i], e) for st, i, e in zip(d_states, idx, ends)]
        for st in states:
            st.draft_kv = None
        if not idx:  # nobody drafts: no draft forward (the requests' draft K/V waits for their next draft)
            return out
        qd = [e - s for e, s in zip(ends, firsts)]
        n = len(idx)
        width = max(len(st.block_ids) for st in d_states) + self.scratch
        bt_np = np.zeros((n, width), dtype=np.int64)
        for j, st in enumerate(d_states):  # past its last block a drafting row writes into its scratch blocks
            n_ids = len(st.block_ids)
            bt_np[j, :n_ids] = st.block_ids
            bt_np[j, n_ids:n_ids + self.scratch] = self.num_blocks + j * self.scratch + np.arange(self.scratch)
        block_tables = torch.from_numpy(bt_np)
        q_arr = np.asarray(qd, dtype=np.int64)
        req_np = np.repeat(np.arange(n, dtype=np.int64), q_arr)
        pos_np = np.repeat(np.asarray(firsts, dtype=np.int64), q_arr) + (
            np.arange(int(q_arr.sum()), dtype=np.int64) - np.repeat(np.cumsum(q_arr) - q_arr, q_arr))
        ids = [t for st, s, e in zip(d_states, firsts, ends) for t in st.token_ids[s:e]]
        slots = torch.from_numpy(bt_np[req_np, pos_np // bs] * bs + pos_np % bs)
        small = [q <= self.k + 2 for q in qd]  # a decode or a speculating request's few rows: decode kernels
        meta = build_attention_metadata(qd, ends, block_tables, slots, bs, self.sliding_window, small)
        with step_rows(qd, small):
            hidden = self.draft(torch.tensor(ids, dtype=torch.int64), torch.from_numpy(pos_np), self.kv_caches,
                                meta)
        for st, e in zip(d_states, ends):  # computed up to (not counting) the new token, which draft_kv covers
            done = e - 1
            for b in range(st.draft_computed // bs, min(done // bs, len(st.block_ids))):
                self.valid_blocks.add(st.block_ids[b])
            st.draft_computed = max(st.draft_computed, done)
        last = torch.from_numpy(np.cumsum(q_arr) - 1)
        tokens = argmax_rows(self.draft.compute_logits(hidden.index_select(0, last)))
        lim = np.minimum(np.asarray([limits[i] for i in idx], dtype=np.int64), self.k)
        mats = []  # (rows of idx, [rows, steps] tokens) per run of steps with the same drafting rows
        alive = np.arange(n)  # positions in idx still drafting
        drafts = [tokens]
        bt_all = bt_np
        pos_all = np.asarray(ends, dtype=np.int64)  # the first draft token's position
        for step in range(1, int(lim.max())):
            keep = lim[alive] > step
            if not keep.all():  # rows at their limit leave: later steps run the others only
                mats.append((alive, torch.stack(drafts, dim=1)))
                alive = alive[keep]
                drafts = []
                tokens = tokens.index_select(0, torch.from_numpy(np.flatnonzero(keep)))
            m = len(alive)
            bt_d = bt_all[alive]
            pos = pos_all[alive] + (step - 1)
            ones = [1] * m
            slots = torch.from_numpy(bt_d[np.arange(m), pos // bs] * bs + pos % bs)
            meta = build_attention_metadata(ones, (pos + 1).tolist(), torch.from_numpy(bt_d), slots, bs,
                                            self.sliding_window)
            with step_rows(ones):
                hidden = self.draft(tokens, torch.from_numpy(pos), self.kv_caches, meta)
            tokens = argmax_rows(self.draft.compute_logits(hidden))
            drafts.append(tokens)
        if drafts:
            mats.append((alive, torch.stack(drafts, dim=1)))
        for j, i in enumerate(idx):  # the K/V this step left in the request's own blocks: its new token's, its drafts'
            st, first = states[i], ends[j] - 1
            end = min(ends[j] + int(lim[j]) - 1, len(st.block_ids) * bs)
            if end > first:
                st.draft_kv = (first, end, tuple(st.block_ids[first // bs:(end + bs - 1) // bs]))
        for rows_, mat in mats:  # a row's tokens: its pieces of every run it was in, in order
            for j, toks in zip(rows_.tolist(), mat.tolist()):
                out[idx[j]].extend(toks)
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
