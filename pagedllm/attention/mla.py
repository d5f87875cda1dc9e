"""Multi-head latent attention (DeepSeek V2/V3) over a paged cache of compressed latents, in plain torch.

Per token the cache keeps one row ``[c_kv (kv_lora_rank = r) | k_pe (qk_rope_head_dim = p)]``: the normalised KV
latent and the rotary key shared by all heads, already rotated. Layout: ``latent_cache [num_blocks, block_size,
r + p]``; token ``t`` of a request sits at the same slot as in the K/V backend (``block_table[t // block_size] *
block_size + t % block_size``).

Per head ``h``, ``kv_b_proj`` expands the latent: ``k_nope_h = W_UK[h] @ c_kv`` (``[dn, r]``) and
``v_h = W_UV[h] @ c_kv`` (``[dv, r]``). Two equivalent ways to attend (``q_h = [q_nope_h | q_pe_h]``):

- *expanded* (non-absorbed): compute ``k_nope``/``v`` for every context token, then ordinary attention with
  ``k_h = [k_nope_h | k_pe]``. Costs ``S * H * (dn + dv) * r`` to expand; best for long query chunks (prefill).
- *absorbed*: ``q_nope_h . (W_UK[h] c_kv) = (W_UK[h]^T q_nope_h) . c_kv``, so fold ``W_UK`` into the query
  (``q_lat_h = W_UK[h]^T q_nope_h``, ``[r]``) and attend with ONE shared key ``[c_kv | k_pe]`` and value ``c_kv``
  (multi-query attention of width ``r + p``); then ``o_h = W_UV[h] @ o_lat_h``. Nothing per context token is
  expanded: best for decode, where the query is one token and the context long.

By default decode rows use the absorbed form and prefill chunks the expanded form; ``MLAAttention.absorb`` forces
one of them everywhere (tests compare both against HF).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.attention.torch_attn import AttentionMetadata


class MLAAttention(torch.nn.Module):
    """forward(q_nope [T, H, dn], q_pe [T, H, p], latent [T, r + p], latent_cache, w_kv_b [H*(dn+dv), r], meta)
    -> [T, H * dv]. The step's latents are written into the cache at ``meta.slot_mapping`` first."""

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        self.absorb: Optional[bool] = None  # None: absorbed for decode rows, expanded for prefill chunks

    # ------------------------------------------------------------------ the two forms
    def _absorbed(self, q_nope, q_pe, latents, w_kv_b, mask) -> torch.Tensor:
        """q_nope [B, Tq, H, dn], q_pe [B, Tq, H, p], latents [B, S, r + p], mask [B, 1, Tq, S] bool or None
        (causal, Tq == S) -> [B, Tq, H, dv]."""
        H, r, dn = self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim
        B, Tq = q_nope.shape[:2]
        w = w_kv_b.view(H, dn + self.v_head_dim, r)
        w_uk, w_uv = w[:, :dn], w[:, dn:]  # [H, dn, r], [H, dv, r]
        q_lat = torch.matmul(q_nope.reshape(B * Tq, H, dn).transpose(0, 1), w_uk)  # [H, B*Tq, r]
        q = torch.cat([q_lat.transpose(0, 1).reshape(B, Tq, H, r), q_pe], dim=-1).transpose(1, 2)  # [B, H, Tq, r+p]
        k = latents.unsqueeze(1)  # [B, 1, S, r + p]: one key head shared by all query heads
        v = latents[..., :r].unsqueeze(1)  # [B, 1, S, r]
        if mask is None:
            o_lat = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            o_lat = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        # o_lat [B, H, Tq, r] -> o_h = W_UV[h] @ o_lat_h
        o = torch.matmul(o_lat.transpose(0, 1).reshape(H, B * Tq, r), w_uv.transpose(1, 2))  # [H, B*Tq, dv]
        return o.transpose(0, 1).reshape(B, Tq, H, self.v_head_dim)

    def _expanded(self, q_nope, q_pe, latents, w_kv_b, mask) -> torch.Tensor:
        """q_nope [Tq, H, dn], q_pe [Tq, H, p], latents [S, r + p], mask [Tq, S] bool or None (causal)
        -> [Tq, H, dv]."""
        H, r, dn, p = self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim
        S = latents.shape[0]
        kv = F.linear(latents[:, :r], w_kv_b).view(S, H, dn + self.v_head_dim)
        k = torch.cat([kv[..., :dn], latents[:, None, r:].expand(S, H, p)], dim=-1).transpose(0, 1)  # [H, S, dn+p]
        v = kv[..., dn:].transpose(0, 1)  # [H, S, dv]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, Tq, dn + p]
        q, k, v = q[None], k[None], v[None]  # 4-D: torch's CPU flash kernel (3-D runs the unfused math path)
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o[0].transpose(0, 1)  # [Tq, H, dv]

    # ------------------------------------------------------------------ paged forward
    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, dn]
        q_pe: torch.Tensor,  # [T, H, p] (rotated)
        latent: torch.Tensor,  # [T, r + p]: normalised c_kv | rotated k_pe
        latent_cache: torch.Tensor,  # [num_blocks, block_size, r + p]
        w_kv_b: torch.Tensor,  # kv_b_proj.weight [H * (dn + dv), r]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = q_nope.shape[0]
        H, dv = self.num_heads, self.v_head_dim
        width = latent.shape[-1]
        latent_cache.view(-1, width).index_copy_(0, meta.slot_mapping, latent)
        out = q_nope.new_empty(T, H, dv)
        dec = meta.decode
        if dec is not None:
            n = dec.token_rows.shape[0]
            rows = None if dec.all_rows else dec.token_rows
            qn = q_nope if rows is None else q_nope.index_select(0, rows)
            qp = q_pe if rows is None else q_pe.index_select(0, rows)
            ctx = latent_cache.index_select(0, dec.block_tables.reshape(-1)).view(n, -1, width)  # [n, ctx, r+p]
            mask = dec.mask(False)  # [n, 1, 1, ctx]
            if self.absorb is False:
                od = torch.stack([
                    self._expanded(qn[i : i + 1], qp[i : i + 1], ctx[i], w_kv_b, mask[i, 0]) for i in range(n)
                ])[:, 0]
            else:
                od = self._absorbed(qn[:, None], qp[:, None], ctx, w_kv_b, mask)[:, 0]  # [n, H, dv]
            if rows is None:
                out.copy_(od)
            else:
                out.index_copy_(0, rows, od)
        for p in meta.prefills:
            s, e = p.q_start, p.q_end
            if p.block_ids is None:
                lat = latent[s:e]
            else:
                lat = latent_cache.index_select(0, p.block_ids).view(-1, width)[: p.seq_len]
            if self.absorb:
                mask = None if p.mask is None else p.mask[None, None]
                out[s:e] = self._absorbed(q_nope[None, s:e], q_pe[None, s:e], lat[None], w_kv_b, mask)[0]
            else:
                out[s:e] = self._expanded(q_nope[s:e], q_pe[s:e], lat, w_kv_b, p.mask)
        return out.view(T, H * dv)
