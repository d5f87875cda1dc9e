"""Paged attention in plain torch (the CPU backend).

Layout of one layer's KV cache: ``kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V).
Token ``t`` of a request lives at slot ``block_table[t // block_size] * block_size + t % block_size``; e.g. with
``block_size=16`` and ``block_table=[7, 3]``, token 20 is in block 3, offset 4: slot 52.

Per step, the runner flattens all scheduled tokens of all requests into ``num_tokens`` rows (request order), and
builds one ``AttentionMetadata`` shared by every layer. Requests with a single query token (decode) are attended in
one batched call (``cpu_kernels.paged_decode``); requests with several query tokens (prefill chunks) all in one call
of the AMX kernel (``cpu_kernels.prefill_attention``) where it runs, else of ours (``cpu_kernels.paged_prefill``,
chunk-invariant), else (level ``none``, ``batch_invariant`` off) one torch SDPA call each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.cpu_kernels import paged_decode, paged_prefill, prefill_attention


@dataclass
class PrefillSlice:
    """One request with ``q_len > 1`` query tokens: rows ``[q_start, q_end)`` of the flattened batch."""

    req_index: int
    q_start: int
    q_end: int
    seq_len: int  # tokens of context after this step (cached + new)
    block_ids: Optional[torch.Tensor]  # [ceil(seq_len / block_size)] int64, None when nothing was cached before
    mask: Optional[torch.Tensor]  # [q_len, seq_len] bool (True = attend), None = plain causal
    mask_windowed: Optional[torch.Tensor] = None  # same, for sliding-window layers
    _bias: dict = field(default_factory=dict, repr=False)

    def attn_bias(self, windowed: bool, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The mask as an additive bias in ``dtype`` (0 = attend, -inf = not), built once per step and shared by
        every layer: torch's CPU flash-attention kernel runs ~9% faster with it than with the bool mask, same output
        (measured interleaved, bf16, 9 heads over 3 KV heads, 30-140 queries over 250-430 keys)."""
        mask = self.mask_windowed if windowed else self.mask
        if mask is None:
            return None
        bias = self._bias.get((windowed, dtype))
        if bias is None:
            bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
            self._bias[(windowed, dtype)] = bias
        return bias


@dataclass
class PrefillBatch:
    """The prefill slices of a step as arrays, for the one-call AMX prefill kernel (``cpu_kernels.prefill_attention``).

    Shapes: ``q_starts/q_lens/seq_lens [n]`` int64 (first row in the flattened batch, new tokens, context after the
    step), ``block_tables [n, max_blocks]`` int64 contiguous.
    """

    q_starts: torch.Tensor
    q_lens: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    _ws: dict = field(default_factory=dict, repr=False)

    def workspace(self, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """The kernel's V^T scratch (``sum(KVH * D * ceil32(seq_len))`` bf16), allocated once per step and shared by
        every layer."""
        ws = self._ws.get((num_kv_heads, head_dim))
        if ws is None:
            padded = int(((self.seq_lens + 31) // 32 * 32).sum())
            ws = torch.empty(num_kv_heads * head_dim * padded, dtype=torch.bfloat16)
            self._ws[(num_kv_heads, head_dim)] = ws
        return ws


@dataclass
class DecodeBatch:
    """All requests with exactly one query token, attended together.

    The padded-context masks are only needed by the pure-torch path, so they are built on first use.
    """

    token_rows: torch.Tensor  # [num_decode] int64: their rows in the flattened batch
    block_tables: torch.Tensor  # [num_decode, max_blocks] int64
    seq_lens: torch.Tensor  # [num_decode] int64
    block_size: int
    sliding_window: Optional[int] = None
    all_rows: bool = False  # True when every token of the batch is a decode token (rows are 0..n-1)
    _masks: dict = field(default_factory=dict, repr=False)

    def mask(self, windowed: bool) -> torch.Tensor:
        """[num_decode, 1, 1, max_blocks * block_size] bool, True = attend."""
        m = self._masks.get(windowed)
        if m is None:
            sl = self.seq_lens
            ctx = torch.arange(self.block_tables.shape[1] * self.block_size, dtype=torch.int64)
            m = ctx[None, :] < sl[:, None]
            if windowed:
                m = m & (ctx[None, :] > (sl[:, None] - 1 - self.sliding_window))
            m = m[:, None, None, :]
            self._masks[windowed] = m
        return m


@dataclass
class AttentionMetadata:
    """Per-step inputs of attention, shared by all layers.

    Shapes: ``slot_mapping [num_tokens]``, ``query_start_loc [num_reqs + 1]``, ``seq_lens [num_reqs]``,
    ``block_tables [num_reqs, max_blocks]`` (int32, host side; padded with 0, the null block).
    """

    num_tokens: int
    num_reqs: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    decode: Optional[DecodeBatch] = None
    prefills: list[PrefillSlice] = field(default_factory=list)
    prefill_batch: Optional[PrefillBatch] = None


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    sliding_window: Optional[int] = None,
    verify: Optional[Sequence[bool]] = None,
    prefill_rows: Optional[Sequence[int]] = None,
) -> AttentionMetadata:
    """Builds the metadata (and the masks every layer reuses) for one step.

    Args:
        query_lens: tokens computed this step, per request.
        seq_lens: context length after this step (``num_computed_tokens + query_len``), per request.
        block_tables: ``[num_reqs, max_blocks]`` int (physical block ids; padding 0).
        slot_mapping: ``[num_tokens]`` int64.
        sliding_window: if set, masks for windowed layers are built too (key ``j`` visible from query ``i`` iff
            ``0 <= i - j < sliding_window``, as HF Mistral/Gemma define it).
        verify: per request, whether its query rows are verify rows (a speculating request's last sampled token
            and its drafts). Each verify row is attended as a decode query of its own: row ``j`` of a request with
            ``q`` rows and context ``s`` is a decode entry with ``s - q + 1 + j`` keys, so its attention runs the
            decode kernel exactly as the plain decode step at that position would (bit for bit: greedy output is
            the same with and without speculation), never the multi-query prefill path with its other reduction
            order. Example: ``query_lens [3]``, ``seq_lens [10]``, verify -> decode entries with 8, 9, 10 keys.
        prefill_rows: per request, how many of its rows (the first ones) are prefill rows; the rest are decode
            entries as with ``verify``. The runner makes a row's kind follow its position (prompt tokens but the last
            prefill, the last and generated ones decode), never how the step cut the request: a recomputed output
            token is computed as its decode step computed it, a prompt's rows the same in any chunking. Overrides
            ``verify``; default: no rows for a request with one new token or ``verify``, else all of them.
            Example: ``query_lens [5]``, ``seq_lens [5]``, ``prefill_rows [3]`` -> a prefill slice of rows 0-2
            (context 3), decode entries for rows 3 and 4 with 4 and 5 keys.
    """
    num_reqs = len(query_lens)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    num_tokens = qsl[-1]
    block_tables = block_tables.to(torch.int64)
    if prefill_rows is None:
        prefill_rows = [0 if q == 1 or (verify and verify[i]) else q for i, q in enumerate(query_lens)]
    n_pre = [min(max(int(p), 0), q) for p, q in zip(prefill_rows, query_lens)]
    decode_idx = [i for i, (p, q) in enumerate(zip(n_pre, query_lens)) if p < q]
    decode = None
    if decode_idx:
        n_dec = len(decode_idx)
        all_rows = n_dec == num_reqs and not any(n_pre)
        max_blocks = (max(seq_lens[i] for i in decode_idx) + block_size - 1) // block_size
        if n_dec == sum(query_lens[i] - n_pre[i] for i in decode_idx) and not any(n_pre[i] for i in decode_idx):
            if all_rows:
                rows = torch.arange(num_reqs, dtype=torch.int64)
                bt = block_tables
                sl = torch.tensor(seq_lens, dtype=torch.int64)
            else:
                rows = torch.tensor([qsl[i] for i in decode_idx], dtype=torch.int64)
                bt = block_tables[decode_idx]
                sl = torch.tensor([seq_lens[i] for i in decode_idx], dtype=torch.int64)
        else:  # verify rows, recomputed output tokens: one decode entry per row (see ``verify``, ``prefill_rows``)
            counts = np.asarray([query_lens[i] - n_pre[i] for i in decode_idx], dtype=np.int64)
            first = np.asarray([qsl[i] + n_pre[i] for i in decode_idx], dtype=np.int64)
            ends = np.asarray([seq_lens[i] for i in decode_idx], dtype=np.int64)
            offs = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
            rows_np = np.repeat(first, counts) + offs
            sl_np = np.repeat(ends - counts + 1, counts) + offs
            all_rows = all_rows and rows_np.shape[0] == num_tokens  # rows 0..num_tokens-1 in order
            rows = torch.from_numpy(rows_np)
            sl = torch.from_numpy(sl_np)
            bt = block_tables[torch.from_numpy(np.repeat(np.asarray(decode_idx, dtype=np.int64), counts))]
        bt = bt[:, :max_blocks].contiguous()
        decode = DecodeBatch(token_rows=rows, block_tables=bt, seq_lens=sl, block_size=block_size,
                             sliding_window=sliding_window, all_rows=all_rows)
    prefills = []
    for i, q in enumerate(n_pre):
        if q == 0:
            continue
        s = seq_lens[i] - (query_lens[i] - q)  # context after its last prefill row
        cached = s - q
        block_ids = None
        mask = None
        mask_w = None
        if cached > 0 or sliding_window is not None:
            qpos = torch.arange(cached, s, dtype=torch.int64)[:, None]
            kpos = torch.arange(s, dtype=torch.int64)[None, :]
            causal = kpos <= qpos
            mask = causal if cached > 0 else None
            if sliding_window is not None:
                mask_w = causal & (kpos > qpos - sliding_window)
        if cached > 0:
            block_ids = block_tables[i, : (s + block_size - 1) // block_size]
        prefills.append(PrefillSlice(i, qsl[i], qsl[i] + q, s, block_ids, mask, mask_w))
    prefill_batch = None
    if prefills:
        idx = [p.req_index for p in prefills]
        prefill_batch = PrefillBatch(
            q_starts=torch.tensor([p.q_start for p in prefills], dtype=torch.int64),
            q_lens=torch.tensor([p.q_end - p.q_start for p in prefills], dtype=torch.int64),
            seq_lens=torch.tensor([p.seq_len for p in prefills], dtype=torch.int64),
            block_tables=block_tables[idx].contiguous())
    return AttentionMetadata(
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        block_size=block_size,
        decode=decode,
        prefills=prefills,
        prefill_batch=prefill_batch,
    )


class Attention(torch.nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache.

    forward(q [T, H*D], k [T, KVH*D], v [T, KVH*D], kv_cache [2, NB, BS, KVH, D], meta) -> [T, H*D].
    K/V of this step are first written into the cache at ``meta.slot_mapping``, so a request can attend to blocks
    another request of the same step wrote (prefix sharing inside one step).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.gqa = num_heads != num_kv_heads

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_cached: bool = False,
    ) -> torch.Tensor:
        """``kv_cached``: this step's K/V are already in ``kv_cache`` at ``meta.slot_mapping`` (a fused kernel wrote
        them), so they are not written again."""
        T = q.shape[0]
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = q.view(T, H, D)
        k = k.view(T, KVH, D)
        v = v.view(T, KVH, D)
        k_cache = kv_cache[0]
        v_cache = kv_cache[1]
        flat_k = k_cache.view(-1, KVH, D)
        flat_v = v_cache.view(-1, KVH, D)
        if not kv_cached:
            flat_k.index_copy_(0, meta.slot_mapping, k)
            flat_v.index_copy_(0, meta.slot_mapping, v)
        windowed = self.sliding_window is not None
        out = torch.empty_like(q)
        dec = meta.decode
        if dec is not None and paged_decode(q, k_cache, v_cache, dec.block_tables, dec.seq_lens,
                                            None if dec.all_rows else dec.token_rows, out, self.scale,
                                            self.sliding_window):
            dec = None  # done by the C kernel, straight from the paged cache
        if dec is not None:
            n = dec.token_rows.shape[0]
            qd = q if dec.all_rows else q.index_select(0, dec.token_rows)
            # index_select over whole blocks copies contiguous block_size*KVH*D runs (much faster than
            # advanced indexing); the result is the padded context [n, ctx, KVH, D].
            flat_bt = dec.block_tables.reshape(-1)
            kd = k_cache.index_select(0, flat_bt).view(n, -1, KVH, D).transpose(1, 2)  # [n, KVH, ctx, D]
            vd = v_cache.index_select(0, flat_bt).view(n, -1, KVH, D).transpose(1, 2)
            mask = dec.mask(windowed)
            od = F.scaled_dot_product_attention(
                qd.view(n, H, 1, D), kd, vd, attn_mask=mask, scale=self.scale, enable_gqa=self.gqa
            )  # [n, H, 1, D]
            out.index_copy_(0, dec.token_rows, od.view(n, H, D))
        prefills = meta.prefills
        if prefills and (prefill_attention(q, k_cache, v_cache, meta.prefill_batch, out, self.scale,
                                           self.sliding_window)
                         or paged_prefill(q, k_cache, v_cache, meta.prefill_batch, out, self.scale,
                                          self.sliding_window)):
            prefills = ()  # all of them in one call of the AMX kernel (or ours), straight from the paged cache
        for p in prefills:
            qp = q[p.q_start : p.q_end].transpose(0, 1)  # [H, q_len, D]
            if p.block_ids is None:
                kp = k[p.q_start : p.q_end].transpose(0, 1)
                vp = v[p.q_start : p.q_end].transpose(0, 1)
            else:
                kp = k_cache.index_select(0, p.block_ids).view(-1, KVH, D)[: p.seq_len].transpose(0, 1)
                vp = v_cache.index_select(0, p.block_ids).view(-1, KVH, D)[: p.seq_len].transpose(0, 1)
            mask = p.attn_bias(windowed, qp.dtype)
            # 4-D inputs: torch's CPU flash-attention kernel only takes [B, H, L, D] (3-D falls back to the
            # unfused math path, ~7x slower on a 500-token prefill).
            qp, kp, vp = qp[None], kp[None], vp[None]
            if mask is None:
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale, enable_gqa=self.gqa)
            else:
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=self.scale, enable_gqa=self.gqa)
            out[p.q_start : p.q_end] = op[0].transpose(0, 1)
        return out.view(T, H * D)
