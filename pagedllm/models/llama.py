"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one plain module over flattened tokens.

The families differ only by config flags:

| flag | Llama | Mistral | Qwen2 | Qwen3 |
|---|---|---|---|---|
| q/k/v bias | ``attention_bias`` (also on o_proj) | no | yes | ``attention_bias`` (also on o_proj) |
| q/k RMSNorm per head, before RoPE | no | no | no | yes |
| sliding window | no | ``sliding_window`` (all layers) | ``use_sliding_window`` + ``layer_types`` | as Qwen2 |
| tied embeddings, rope scaling, head_dim | config | config | config | config |

One step computes ``T`` tokens from any number of requests: ``input_ids [T]``, ``positions [T]``; the
``AttentionMetadata`` says which rows belong to which request and where their K/V live in the paged cache.
q/k/v and gate/up are fused into one matmul each; checkpoint names are mapped onto them by
``STACKED_PARAMS_MAPPING``.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from pagedllm.layers.packed_linear import lm_head_logits
from pagedllm.attention.cpu_kernels import rope_and_cache, silu_mul
from pagedllm.attention.torch_attn import Attention, AttentionMetadata
from pagedllm.distributed.parallel_state import get_pp_rank, get_pp_size, get_tp_size, pp_layer_range
from pagedllm.kv_cache_spec import AttentionSpec
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.quantization import finish_quantized_loading, load_quantized, quantize_model
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from pagedllm.models.fused_stack import FusedStack, built_stack
from pagedllm.models.utils import skip_init_embedding, skip_init_linear

# (fused parameter, checkpoint shard name, shard index): "…self_attn.k_proj.weight" fills rows
# [q_size, q_size + kv_size) of "…self_attn.qkv_proj.weight"; biases the same way.
STACKED_PARAMS_MAPPING: tuple[tuple[str, str, int], ...] = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)

# Checkpoint entries that are not parameters here (old HF checkpoints saved the rotary buffer).
IGNORED_WEIGHT_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        sliding_window: Optional[int],
        dtype: torch.dtype,
        qk_norm_eps: Optional[float] = None,
    ) -> None:
        super().__init__()
        tensor_parallel = get_tp_size() > 1
        if tensor_parallel:  # this rank's heads only (pagedllm.layers.linear)
            from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear

            qkv = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias, dtype)
            o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, o_bias, dtype,
                                       input_split=(qkv.q_head_start * head_dim, qkv.num_heads * head_dim))
            num_heads, num_kv_heads = qkv.num_heads, qkv.num_kv_heads
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        if tensor_parallel:
            self.qkv_proj, self.o_proj = qkv, o_proj
        else:
            self.qkv_proj = skip_init_linear(hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, dtype)
            self.qkv_proj.output_sizes = (self.q_size, self.kv_size, self.kv_size)
            self.o_proj = skip_init_linear(self.q_size, hidden_size, o_bias, dtype)
        self.attn = Attention(num_heads, head_dim, num_kv_heads, head_dim**-0.5, sliding_window=sliding_window)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:  # Qwen3: RMSNorm over head_dim of each q / k head
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # [T, q_size + 2 * kv_size]
        qk_size = self.q_size + self.kv_size
        if self.q_norm is None and rope_and_cache(qkv, cos, kv_cache, meta.slot_mapping, self.num_heads,
                                                  self.num_kv_heads, self.head_dim):
            # RoPE applied in place and K/V already in the paged cache (one C pass)
            q, k, v = qkv[:, : self.q_size], qkv[:, self.q_size : qk_size], qkv[:, qk_size:]
            return self.o_proj.forward(self.attn.forward(q, k, v, kv_cache, meta, kv_cached=True))
        qk = qkv[:, :qk_size].view(T, -1, self.head_dim)  # [T, H + KVH, D]
        if self.q_norm is not None:
            H = self.num_heads
            qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)
        qk = apply_rotary(qk, cos, sin)  # q and k at once
        q = qk[:, : self.num_heads].flatten(1)  # [T, q_size] (a view)
        k = qk[:, self.num_heads :].flatten(1)  # [T, kv_size]
        v = qkv[:, qk_size:]
        return self.o_proj.forward(self.attn.forward(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        if get_tp_size() > 1:
            from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear

            self.gate_up_proj = MergedColumnParallelLinear(hidden_size, (intermediate_size, intermediate_size), bias,
                                                           dtype)
            self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, dtype)
            return
        self.gate_up_proj = skip_init_linear(hidden_size, 2 * intermediate_size, bias, dtype)
        self.gate_up_proj.output_sizes = (intermediate_size, intermediate_size)
        self.gate_up_proj.silu_gated = True  # weight packing may fuse silu(gate) * up into the matmul
        self.down_proj = skip_init_linear(intermediate_size, hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = getattr(self.gate_up_proj, "forward_silu_mul", None)  # a packed layer (layers/packed_linear.py)
        act = fused(x) if fused is not None else None
        if act is not None:
            return self.down_proj.forward(act)
        act = silu_mul(self.gate_up_proj.forward(x))  # one C pass on CPU (csrc/cpu_ops.c)
        return self.down_proj.forward(act)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, attn: LlamaAttention, mlp: LlamaMLP, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: Optional[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Pre-norm block; `residual` carries the stream so each norm also does the preceding add.
        # Submodules are called through .forward: nn.Module.__call__ costs ~2 us a call, ~300 calls per step
        # (no hooks are used on these modules).
        if residual is None:
            residual = x
            x = self.input_layernorm.forward(x)
        else:
            x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, max_positions: Optional[int]) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // num_heads
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        model_type = getattr(cfg, "model_type", "llama")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = attention_bias or model_type == "qwen2"
        o_bias = attention_bias  # Llama's attention_bias covers o_proj; Qwen2 has q/k/v bias only
        mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        qk_norm_eps = cfg.rms_norm_eps if model_type == "qwen3" else None
        window = getattr(cfg, "sliding_window", None)
        if window is not None and getattr(cfg, "use_sliding_window", True) is False:
            window = None
        layer_types = getattr(cfg, "layer_types", None)
        windowed = [
            window is not None and (layer_types is None or layer_types[i] == "sliding_attention")
            for i in range(cfg.num_hidden_layers)
        ]
        self.sliding_window: Optional[int] = int(window) if any(windowed) else None
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # Pipeline parallelism: this stage's layers [start_layer, end_layer); the others are empty placeholders
        # (checkpoint tensors for them are skipped). The embedding lives on the first stage (and the last, when the
        # LM head is tied to it), the final norm on the last.
        pp_rank, pp_size = get_pp_rank(), get_pp_size()
        self.start_layer, self.end_layer = pp_layer_range(cfg.num_hidden_layers, pp_rank, pp_size)
        is_first, is_last = pp_rank == 0, pp_rank == pp_size - 1
        tied = bool(getattr(cfg, "tie_word_embeddings", False))

        if get_tp_size() > 1 and (is_first or (is_last and tied)):
            from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding

            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, hidden, dtype)
        elif is_first or (is_last and tied):
            self.embed_tokens = skip_init_embedding(cfg.vocab_size, hidden, dtype)
        else:
            self.embed_tokens = PPMissingLayer()
        self.rotary_emb = RotaryEmbedding(
            head_dim, cfg.max_position_embeddings, rope_parameters(cfg), max_positions=max_positions, dtype=dtype
        )
        self.layers = nn.ModuleList(
            PPMissingLayer() if not self.start_layer <= i < self.end_layer else LlamaDecoderLayer(
                LlamaAttention(
                    hidden,
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    qkv_bias,
                    o_bias,
                    self.sliding_window if windowed[i] else None,
                    dtype,
                    qk_norm_eps,
                ),
                LlamaMLP(hidden, cfg.intermediate_size, mlp_bias, dtype),
                hidden,
                cfg.rms_norm_eps,
                dtype,
            )
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, dtype) if is_last else PPMissingLayer()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions)  # shared by all layers
        stack = self._fused_stack()
        fused = stack.forward(x, cos, kv_caches, attn_metadata) if stack is not None else None
        if fused is not None:  # every layer in one C call (models/fused_stack.py)
            x, residual = fused
        else:
            residual = None
            metas = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata] * len(self.layers)
            for layer, kv_cache, meta in zip(self.layers, kv_caches, metas):
                x, residual = layer.forward(x, residual, cos, sin, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def _fused_stack(self) -> Optional[FusedStack]:
        return built_stack(self, FusedStack)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 decoder.

    Args:
        hf_config: a ``transformers`` config (Llama/Mistral/Qwen2/Qwen3Config or one with the same fields).
        dtype: parameter and activation dtype (norms and rotary tables are computed in float32 first, as in HF).
        max_model_len: positions to cache rotary tables for, at least ``max_position_embeddings``
            (times ``factor`` for linear/dynamic rope scaling).
        quant_config: a ``layers.quantization.QuantConfig``: linears (and embeddings) are built quantized.
    """

    supports_quantization = True

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, max_model_len: Optional[int] = None,
                 quant_config: Any = None) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.dtype = dtype
        self.model = LlamaModel(hf_config, dtype, max_model_len)
        self.vocab_size = hf_config.vocab_size
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens  # the same Parameter; compute_logits reads .weight
        elif get_pp_rank() != get_pp_size() - 1:
            self.lm_head = PPMissingLayer()
        elif get_tp_size() > 1:  # this rank's vocabulary rows; the runner gathers the logits
            from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead

            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
        else:
            self.lm_head = skip_init_linear(hf_config.hidden_size, hf_config.vocab_size, False, dtype)
        # Checkpoint names of modules another pipeline stage holds (skipped by load_weights).
        self._other_stage_prefixes: tuple[str, ...] = tuple(
            f"{name}." for name, mod in self.named_modules() if isinstance(mod, PPMissingLayer))
        self.sliding_window: Optional[int] = self.model.sliding_window
        self.quant_modules = quantize_model(self, quant_config) if quant_config is not None else {}
        # fused parameter name -> row counts of its shards, for load_weights
        self._shard_sizes: dict[str, tuple[int, ...]] = {}
        for mod_name, mod in self.named_modules():
            sizes = getattr(mod, "output_sizes", None)
            if sizes is not None:
                for p_name, _ in mod.named_parameters(recurse=False):
                    self._shard_sizes[f"{mod_name}.{p_name}"] = tuple(sizes)

    def skips_weight(self, name: str) -> bool:
        """True for a checkpoint tensor another pipeline stage holds (the loader doesn't read it)."""
        return bool(self._other_stage_prefixes) and name.startswith(self._other_stage_prefixes)

    def kv_cache_spec(self) -> list[AttentionSpec]:
        """Each layer's KV cache (K and V of ``num_kv_heads`` heads, its sliding window), in layer order."""
        return [
            AttentionSpec(layer.self_attn.num_kv_heads, self.model.head_dim, layer.self_attn.attn.sliding_window)
            for layer in self.model.layers[self.model.start_layer:self.model.end_layer]
        ]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata | list[AttentionMetadata],  # one, or one per layer (its KV cache group's)
    ) -> torch.Tensor:
        """-> hidden states [T, hidden] (after the final norm)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 on every path (``lm_head_logits``)."""
        return lm_head_logits(self, hidden_states)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (HF names, any float dtype) into the parameters.

        Raises:
            ValueError: for an unknown name, a shape mismatch, or parameters the checkpoint didn't fill.
        """
        params = dict(self.named_parameters())
        expected: set[tuple[str, int]] = set()
        for name in params:
            n_shards = len(self._shard_sizes.get(name, (None,)))
            expected.update((name, i) for i in range(n_shards))
        loaded: set[tuple[str, int]] = set()
        for name, tensor in weights:
            if name.endswith(IGNORED_WEIGHT_SUFFIXES):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints still store a copy
            if self._other_stage_prefixes and name.startswith(self._other_stage_prefixes):
                continue  # another pipeline stage's
            target, shard = name, None
            for fused, shard_name, shard_id in STACKED_PARAMS_MAPPING:
                if f".{shard_name}." in name:
                    target, shard = name.replace(f".{shard_name}.", f".{fused}."), shard_id
                    break
            if self.quant_modules and load_quantized(self.quant_modules, target, shard, tensor):
                continue
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint weight {name!r} has no parameter in {type(self).__name__}")
            loader = getattr(param, "weight_loader", None)
            if loader is not None:  # tensor-parallel: the parameter narrows the tensor to this rank's shard
                loader(param, tensor, shard)
                loaded.add((target, shard or 0))
                continue
            dest = param.data
            if shard is not None:
                sizes = self._shard_sizes[target]
                dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r}: checkpoint shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add((target, shard or 0))
        finish_quantized_loading(self.quant_modules)
        missing = sorted({name for name, _ in expected - loaded})
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:10])}"
                             + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))


class PPMissingLayer(nn.Identity):
    """Placeholder for a module held by another pipeline stage (no parameters)."""


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window (from ``config.sliding_window``)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases (and an optional per-layer sliding window)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with RMSNorm on each q/k head before RoPE (and an optional per-layer sliding window)."""
