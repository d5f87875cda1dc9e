"""Gemma 3 (text): HF ``Gemma3ForCausalLM`` / ``gemma3_text``, GGUF architecture ``gemma3``.

What differs from Llama (HF ``modeling_gemma3``):

| | Gemma 3 |
|---|---|
| norms | ``GemmaRMSNorm``: zero-centred weight, ``x / rms(x) * (1 + w)`` in float32; four per layer (input, post-attention, pre- and post-feed-forward), the post norms applied to the branch before the residual add |
| q / k | RMSNorm over each head (before RoPE) |
| attention scale | ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``) |
| layers | ``layer_types``: sliding window (``sliding_window`` tokens) on 5 of every 6 layers, full attention on the rest |
| RoPE | per layer type: local (sliding) base 10k, global base 1M (``rope_parameters[layer_type]``) |
| MLP | GeGLU: ``gelu_tanh(gate) * up`` |
| embeddings | scaled by ``sqrt(hidden_size)`` (rounded to the model dtype, as HF does); lm_head tied |
| logits | optional ``final_logit_softcapping``: ``cap * tanh(logits / cap)`` |

GGUF stores the norm weights with the 1 already added (HF weight = GGUF weight - 1; the loader subtracts it).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.cpu_kernels import gelu_tanh_and_mul, rope_and_cache
from pagedllm.attention.torch_attn import Attention, AttentionMetadata
from pagedllm.layers.packed_linear import lm_head_logits
from pagedllm.models.fused_stack import GemmaFusedStack, built_stack
from pagedllm.kv_cache_spec import AttentionSpec
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.layers.quantization import finish_quantized_loading, load_quantized, quantize_model
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from pagedllm.models.utils import load_named_weights, skip_init_embedding, skip_init_linear, stacked_params_resolver

STACKED_PARAMS_MAPPING: tuple[tuple[str, str, int], ...] = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)

SLIDING = "sliding_attention"
FULL = "full_attention"


def gemma3_layer_types(cfg: Any) -> list[str]:
    """``layer_types`` of the config, or Gemma 3's default: every 6th layer global, the others sliding."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(cfg, "sliding_window_pattern", None) or 6
    return [SLIDING if (i + 1) % pattern else FULL for i in range(cfg.num_hidden_layers)]


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: Any, sliding_window: Optional[int], dtype: torch.dtype) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = skip_init_linear(hidden, self.q_size + 2 * self.kv_size, bias, dtype)
        self.qkv_proj.output_sizes = (self.q_size, self.kv_size, self.kv_size)
        self.o_proj = skip_init_linear(self.q_size, hidden, bias, dtype)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale, sliding_window=sliding_window)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        H = self.num_heads
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        # Where the C kernels run: the q and k heads normed in place in the qkv rows, then RoPE in place and K / V
        # into the paged cache in one pass (the same kernels, in the same order, as the fused layer loop).
        normed = self.q_norm.forward_heads(qkv, H, qkv[:, :self.q_size]) is not None
        if normed:
            self.k_norm.forward_heads(qkv[:, self.q_size:], self.num_kv_heads, qkv[:, self.q_size:qk_size])
            if rope_and_cache(qkv, cos, kv_cache, meta.slot_mapping, H, self.num_kv_heads, self.head_dim):
                q, k, v = qkv[:, :self.q_size], qkv[:, self.q_size:qk_size], qkv[:, qk_size:]
                return self.o_proj(self.attn(q, k, v, kv_cache, meta, kv_cached=True))
        qk = qkv[:, :qk_size].view(T, -1, self.head_dim)  # [T, H + KVH, D]
        if not normed:
            qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)
        qk = apply_rotary(qk, cos, sin)
        q = qk[:, :H].flatten(1)
        k = qk[:, H:].flatten(1)
        v = qkv[:, qk_size:]
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class Gemma3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh / gelu)")
        self.approximate = "none" if act == "gelu" else "tanh"
        self.gate_up_proj = skip_init_linear(hidden_size, 2 * intermediate_size, False, dtype)
        self.gate_up_proj.output_sizes = (intermediate_size, intermediate_size)
        self.down_proj = skip_init_linear(intermediate_size, hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = gelu_tanh_and_mul(gate_up) if self.approximate == "tanh" else None  # one C pass (csrc/cpu_ops.c)
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate=self.approximate) * up
        return self.down_proj(act)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_type = layer_type
        window = cfg.sliding_window if layer_type == SLIDING else None
        self.self_attn = Gemma3Attention(cfg, window, dtype)
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        self.mlp = Gemma3MLP(hidden, cfg.intermediate_size, act, dtype)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta))
        x = x + h
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + h


class Gemma3Model(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, max_positions: Optional[int]) -> None:
        super().__init__()
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise ValueError("attn_logit_softcapping is not supported")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (causal LMs only)")
        hidden = cfg.hidden_size
        self.layer_types = gemma3_layer_types(cfg)
        self.embed_tokens = skip_init_embedding(cfg.vocab_size, hidden, dtype)
        # HF multiplies by sqrt(hidden) rounded to the model dtype.
        self.register_buffer("embed_scale", torch.tensor(hidden**0.5, dtype=dtype), persistent=False)
        self.rotary = nn.ModuleDict({
            t: RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, rope_parameters(cfg, t),
                               max_positions=max_positions, dtype=dtype)
            for t in sorted(set(self.layer_types))
        })
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, t, dtype) for t in self.layer_types)
        self.norm = GemmaRMSNorm(hidden, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale  # [T, hidden]
        rope = {t: r(positions) for t, r in self.rotary.items()}  # (cos, sin) per layer type, shared by layers
        metas = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata] * len(self.layers)
        stack = self._fused_stack()
        fused = stack.forward_gemma(x, rope, kv_caches, metas) if stack is not None else None
        if fused is not None:  # every layer in one C call (models/fused_stack.py), decode steps
            return self.norm(fused)
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas):
            cos, sin = rope[layer.layer_type]
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def _fused_stack(self) -> Optional[GemmaFusedStack]:
        return built_stack(self, GemmaFusedStack)


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 text decoder over flattened tokens (see the module docstring).

    Args:
        hf_config: a ``transformers.Gemma3TextConfig`` (or one with the same fields).
        dtype: parameter and activation dtype (norms and rotary tables are computed in float32 first).
        max_model_len: positions to cache rotary tables for.
        quant_config: a ``layers.quantization.QuantConfig``: linears and the (tied) embedding are built quantized.
    """

    supports_quantization = True

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, max_model_len: Optional[int] = None,
                 quant_config: Any = None) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.dtype = dtype
        self.model = Gemma3Model(hf_config, dtype, max_model_len)
        self.vocab_size = hf_config.vocab_size
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = skip_init_linear(hf_config.hidden_size, hf_config.vocab_size, False, dtype)
        self.final_logit_softcapping: Optional[float] = getattr(hf_config, "final_logit_softcapping", None)
        self.quant_modules = quantize_model(self, quant_config) if quant_config is not None else {}
        windows = [layer.self_attn.attn.sliding_window for layer in self.model.layers]
        self.sliding_window: Optional[int] = next((w for w in windows if w is not None), None)

    def kv_cache_spec(self) -> list[AttentionSpec]:
        return [
            AttentionSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, layer.self_attn.attn.sliding_window)
            for layer in self.model.layers
        ]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata | list[AttentionMetadata],  # one, or one per layer (its KV cache group's)
    ) -> torch.Tensor:
        """-> hidden states [T, hidden] (after the final norm)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        logits = lm_head_logits(self, hidden_states)  # float32 (a quantized head's own logits when quantized)
        cap = self.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named checkpoint tensors into the parameters (see ``load_named_weights``)."""
        fused = stacked_params_resolver(STACKED_PARAMS_MAPPING)

        def resolve(name: str):
            if name.endswith("rotary_emb.inv_freq"):
                return None
            if self.tie_word_embeddings and name == "lm_head.weight":
                return None
            if name.startswith("model.language_model."):  # Gemma3ForConditionalGeneration's text tower
                name = "model." + name[len("model.language_model."):]
            return fused(name)

        if self.quant_modules:  # quantized modules take their tensors as they come; the rest are copied
            def unquantized(pairs):
                for name, tensor in pairs:
                    target = resolve(name)
                    if target is None or not load_quantized(self.quant_modules, target.param, target.shard, tensor):
                        yield name, tensor

            weights = unquantized(weights)
        load_named_weights(self, weights, resolve)
        finish_quantized_loading(self.quant_modules)
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):
                m.update_scale()
