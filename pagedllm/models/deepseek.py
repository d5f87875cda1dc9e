"""DeepSeek V2 / V3: multi-head latent attention (MLA) over a paged latent cache, and mixture-of-experts MLPs.

Follows HF ``modeling_deepseek_v2`` / ``modeling_deepseek_v3`` (which are the reference in the tests).

Attention (per layer; H heads, r = kv_lora_rank, p = qk_rope_head_dim, dn = qk_nope_head_dim, dv = v_head_dim)::

    q      = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))          [T, H, dn + p] -> q_nope | q_pe
    c, k_pe = kv_a_proj_with_mqa(x)                                        [T, r] | [T, p]
    latent = [kv_a_layernorm(c) | rope(k_pe)]                              [T, r + p]   <- the only thing cached
    attention of [q_nope | rope(q_pe)] against keys [W_UK c | k_pe] and values W_UV c (kv_b_proj = [W_UK; W_UV])

``pagedllm.attention.mla`` computes it absorbed (decode) or expanded (prefill). RoPE is DeepSeek's interleaved
pairs ``(x0, x1), (x2, x3) …`` (V2 always, V3 with ``rope_interleave``); we emit the rotated pairs de-interleaved
(``[even | odd]``), for q and k alike, which leaves every q·k product as HF computes it. The softmax scale is
``(dn + p) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under yarn scaling; the yarn
``attention_factor`` multiplies cos/sin as in HF.

MoE (layers ``>= first_k_dense_replace``; dense MLP before): a float32 router picks ``num_experts_per_tok`` of
``n_routed_experts`` experts per token, plus ``n_shared_experts`` always-on experts fused into one MLP.

| | V2 (``topk_method``) | V3 (``noaux_tc``) |
|---|---|---|
| scores | softmax(logits) | sigmoid(logits); choice by ``scores + e_score_correction_bias`` |
| groups (``n_group``, ``topk_group``) | ``group_limited_greedy``: keep the ``topk_group`` groups with the highest max score | always: keep the groups with the highest sum of their top-2 scores |
| weights | scores of the chosen experts | same, divided by their sum if ``norm_topk_prob`` |
| then | × ``routed_scaling_factor`` | × ``routed_scaling_factor`` |

(HF's V2 router ignores ``norm_topk_prob``, and so do we; released V2 configs have it False.)
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.packed_linear import lm_head_logits
from pagedllm.attention.mla import MLAAttention
from pagedllm.attention.torch_attn import AttentionMetadata
from pagedllm.kv_cache_spec import MLASpec
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from pagedllm.models.utils import WeightTarget, load_named_weights, skip_init_embedding, skip_init_linear

# HF's DeepseekV2/V3RMSNorm default, used for the latent norms (q_a_layernorm, kv_a_layernorm).
LATENT_NORM_EPS = 1e-6


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(cfg: Any, rope: dict) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        m = _yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * m * m
    return scale


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs ``(x[2i], x[2i+1])``, output de-interleaved ``[even' | odd']``.

    x [T, N, p]; cos/sin [T, 1, p] from ``RotaryEmbedding`` (``cos = [c | c]``, ``sin = [-s | s]``)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., half:]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class DeepseekMLAttention(nn.Module):
    def __init__(self, cfg: Any, rope: dict, interleaved: bool, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = H = cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.interleaved = interleaved
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = skip_init_linear(hidden, H * qk_head_dim, False, dtype)
        else:
            self.q_a_proj = skip_init_linear(hidden, self.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = skip_init_linear(self.q_lora_rank, H * qk_head_dim, False, dtype)
        self.kv_a_proj_with_mqa = skip_init_linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = skip_init_linear(self.kv_lora_rank, H * (self.qk_nope_head_dim + self.v_head_dim), False,
                                          dtype)
        self.kv_b_proj.keep_weight = True  # MLA reads its weight (absorbed W_UK / W_UV): never packed
        self.o_proj = skip_init_linear(H * self.v_head_dim, hidden, bias, dtype)
        self.attn = MLAAttention(H, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                                 self.v_head_dim, mla_softmax_scale(cfg, rope))

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, p]
        sin: torch.Tensor,
        latent_cache: torch.Tensor,  # [num_blocks, block_size, r + p]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        H, r = self.num_heads, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, H, -1)
        q_nope, q_pe = q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim :]
        kv_a = self.kv_a_proj_with_mqa(x)  # [T, r + p]
        c_kv = self.kv_a_layernorm(kv_a[:, :r])
        pe = torch.cat([q_pe, kv_a[:, None, r:]], dim=1)  # [T, H + 1, p]: q heads and the shared key
        pe = rotate_interleaved(pe, cos, sin) if self.interleaved else apply_rotary(pe, cos, sin)
        latent = torch.cat([c_kv, pe[:, H]], dim=-1)  # [T, r + p]
        out = self.attn(q_nope, pe[:, :H], latent, latent_cache, self.kv_b_proj.weight, meta)
        return self.o_proj(out)


class DeepseekMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        self.gate_up_proj = skip_init_linear(hidden_size, 2 * intermediate_size, False, dtype)
        self.gate_up_proj.output_sizes = (intermediate_size, intermediate_size)
        self.down_proj = skip_init_linear(intermediate_size, hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class FusedExperts(nn.Module):
    """``num_experts`` SiLU-GLU experts stacked: ``gate_up_proj [E, 2I, hidden]``, ``down_proj [E, hidden, I]``
    (HF's in-memory layout; per-expert checkpoint tensors are stacked into them on load)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype))
        self.output_sizes = {"gate_up_proj": (intermediate_size, intermediate_size)}

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], topk_ids / topk_weights [T, k] -> sum_j weight_j * expert_{id_j}(x) [T, hidden]."""
        T, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // k
        xs = x.index_select(0, token_of)
        ys = torch.empty_like(xs)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            h = F.linear(xs[start : start + c], self.gate_up_proj[e])
            gate, up = h.chunk(2, dim=-1)
            ys[start : start + c] = F.linear(F.silu(gate) * up, self.down_proj[e])
            start += c
        ys = ys * topk_weights.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, ys)


class MoEGate(nn.Module):
    """The router, in float32 (as HF keeps ``gate.weight``): -> (topk_ids [T, k] int64, topk_weights [T, k] f32)."""

    def __init__(self, cfg: Any, version: int) -> None:
        super().__init__()
        self.num_experts = E = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.routed_scaling_factor = float(cfg.routed_scaling_factor)
        self.n_group = cfg.n_group or 1
        self.topk_group = cfg.topk_group or self.n_group
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, dtype=torch.float32))
        if version == 3:
            self.method = "noaux_tc"
            self.norm_topk_prob = bool(cfg.norm_topk_prob)
            self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32))
        else:
            self.method = cfg.topk_method or "greedy"
            if self.method not in ("greedy", "group_limited_greedy"):
                raise ValueError(f"DeepSeek V2 topk_method {self.method!r} is not supported")
            self.norm_topk_prob = False
            self.e_score_correction_bias = None
        if self.method != "greedy" and E % self.n_group:
            raise ValueError(f"n_routed_experts={E} is not divisible by n_group={self.n_group}")

    def _keep_top_groups(self, choice: torch.Tensor, group_scores: torch.Tensor, fill: float) -> torch.Tensor:
        T = choice.shape[0]
        top_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
        keep = keep.unsqueeze(-1).expand(T, self.n_group, self.num_experts // self.n_group).reshape(T, -1)
        return choice.masked_fill(~keep, fill)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)  # [T, E]
        T = logits.shape[0]
        if self.method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(T, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
            choice = self._keep_top_groups(choice, group_scores, float("-inf"))
        else:
            scores = choice = logits.softmax(dim=-1)
            if self.method == "group_limited_greedy":
                group_scores = choice.view(T, self.n_group, -1).max(dim=-1).values
                choice = self._keep_top_groups(choice, group_scores, 0.0)
        topk_ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_ids, weights * self.routed_scaling_factor


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: Any, version: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = MoEGate(cfg, version)
        self.experts = FusedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype)
        n_shared = cfg.n_shared_experts or 0
        self.shared_experts = (
            DeepseekMLP(cfg.hidden_size, cfg.moe_intermediate_size * n_shared, cfg.hidden_act, dtype)
            if n_shared else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, version: int, rope: dict, interleaved: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = DeepseekMLAttention(cfg, rope, interleaved, dtype)
        if cfg.n_routed_experts and layer_idx >= (cfg.first_k_dense_replace or 0):
            self.mlp = DeepseekMoE(cfg, version, dtype)
        else:
            self.mlp = DeepseekMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x, residual, cos, sin, latent_cache, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, latent_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DeepseekForCausalLM(nn.Module):
    """DeepSeek V2 (``version=2``) / V3 (``version=3``) decoder over flattened tokens.

    Args:
        hf_config: ``transformers.DeepseekV2Config`` / ``DeepseekV3Config`` (or one with the same fields).
        dtype: parameter and activation dtype (the router stays float32).
        max_model_len: positions to cache rotary tables for.
    """

    version = 2

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, max_model_len: Optional[int] = None) -> None:
        super().__init__()
        cfg = hf_config
        self.hf_config = cfg
        self.dtype = dtype
        rope = rope_parameters(cfg)
        interleaved = True if self.version == 2 else bool(getattr(cfg, "rope_interleave", True))
        self.model = nn.Module()
        self.model.embed_tokens = skip_init_embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.model.rotary_emb = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position_embeddings, rope,
                                                max_positions=max_model_len, dtype=dtype)
        self.model.layers = nn.ModuleList(
            DeepseekDecoderLayer(cfg, i, self.version, rope, interleaved, dtype) for i in range(cfg.num_hidden_layers)
        )
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.vocab_size = cfg.vocab_size
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = skip_init_linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        self.sliding_window: Optional[int] = None

    def kv_cache_spec(self) -> list[MLASpec]:
        """One latent of ``kv_lora_rank + qk_rope_head_dim`` per token per layer (not K and V per head)."""
        return [MLASpec(self.hf_config.kv_lora_rank, self.hf_config.qk_rope_head_dim)] * len(self.model.layers)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, r + p]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """-> hidden states [T, hidden] (after the final norm)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions)
        residual = None
        metas = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata] * len(self.model.layers)
        for layer, cache, meta in zip(self.model.layers, kv_caches, metas):
            x, residual = layer(x, residual, cos, sin, cache, meta)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (``lm_head_logits``)."""
        return lm_head_logits(self, hidden_states)

    def set_absorb(self, absorb: Optional[bool]) -> None:
        """Forces absorbed (True) or expanded (False) MLA everywhere; None: absorbed for decode only."""
        for layer in self.model.layers:
            layer.self_attn.attn.absorb = absorb

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors (per-expert ``experts.{e}.{gate,up,down}_proj.weight`` or stacked
        ``experts.gate_up_proj`` / ``experts.down_proj``) into the parameters."""
        expert_re = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
        mlp_re = re.compile(r"^(.*\.(?:mlp|shared_experts))\.(gate_proj|up_proj)\.(weight|bias)$")
        num_layers = len(self.model.layers)

        def resolve(name: str) -> Optional[WeightTarget]:
            if name.endswith("rotary_emb.inv_freq"):
                return None
            if self.tie_word_embeddings and name == "lm_head.weight":
                return None
            m = re.match(r"^model\.layers\.(\d+)\.", name)
            if m and int(m.group(1)) >= num_layers:
                return None  # V3's multi-token-prediction layers (num_mtp_layers) are not used for decoding
            m = expert_re.match(name)
            if m:
                prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
                if kind == "down_proj":
                    return WeightTarget(f"{prefix}.down_proj", expert=e)
                return WeightTarget(f"{prefix}.gate_up_proj", shard=0 if kind == "gate_proj" else 1, expert=e)
            m = mlp_re.match(name)
            if m:
                return WeightTarget(f"{m.group(1)}.gate_up_proj.{m.group(3)}",
                                    shard=0 if m.group(2) == "gate_proj" else 1)
            return WeightTarget(name)

        load_named_weights(self, weights, resolve)


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    version = 2


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    version = 3
