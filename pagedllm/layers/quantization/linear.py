"""``QuantLinear`` / ``QuantEmbedding``: modules that collect checkpoint shards while loading, then pack them once.

A fused layer (``qkv_proj``, ``gate_up_proj``) receives its shards separately (``load_shard(shard_id, name, t)``);
``process_weights_after_loading`` converts each to a canonical form (``kquant.KQuantWeight``, ``kernels.Int4Groups``
or ``Int8Rows``), stacks them along the outputs and packs the result. GGUF shards kept as stored may each have their
own type (a Q4_K_M file stores ``attn_v`` as Q6_K next to Q4_K q/k): each writes its columns of the one output.
Other mixes of forms fall back to per-row int8 for the whole layer; a dense shard makes it dense.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantization.kernels import (
    Int4Groups,
    Int8Rows,
    PackedInt4,
    int4_kernel_supports,
    int4_matmul,
    int4_silu_mul,
    int8_logits,
    int8_matmul,
)
from pagedllm.layers.quantization.kquant import KQuantWeight, dequantize_rows, kquant_linear, kquant_logits

logger = logging.getLogger(__name__)


class QuantLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` kept as GGUF blocks as stored, int4 groups, int8 rows, or dense
    (``self.kind``: kquant, int4, int8, dense)."""

    silu_gated = False  # rows [gate; up] of a SwiGLU gate_up (set by quantize_model from the layer it replaces)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, quant_config: Any,
                 output_sizes: Optional[tuple[int, ...]] = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.quant_config = quant_config
        self.output_sizes = tuple(output_sizes) if output_sizes else (out_features,)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.kind = "loading"
        self._shards: dict[int, dict[str, Any]] = {}

    def load_shard(self, shard_id: int, name: str, tensor: Any) -> None:
        self._shards.setdefault(shard_id, {})[name] = tensor

    def _canonical(self, shard_id: int) -> KQuantWeight | Int4Groups | Int8Rows | torch.Tensor:
        from pagedllm.layers.quantization.gguf import GGUFWeight, gguf_to_canonical

        parts = self._shards.get(shard_id)
        if not parts:
            raise ValueError(f"checkpoint is missing shard {shard_id} of a quantized layer ({self.extra_repr()})")
        qc = self.quant_config
        if "qweight" in parts:
            if qc.method == "gptq":
                from pagedllm.layers.quantization.gptq import gptq_to_int4

                return gptq_to_int4(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"),
                                    qc.group_size, 0 if qc.checkpoint_format == "gptq_v2" else 1)
            if qc.method == "awq":
                from pagedllm.layers.quantization.awq import awq_to_int4

                return awq_to_int4(parts["qweight"], parts["qzeros"], parts["scales"], qc.group_size)
            raise ValueError(f"quantization={qc.method!r}: the checkpoint has packed qweight tensors")
        w = parts["weight"]
        if isinstance(w, GGUFWeight):
            return gguf_to_canonical(w)
        if qc.method == "int8":
            return Int8Rows.quantize(w)
        return w

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        parts = [self._canonical(i) for i in range(len(self.output_sizes))]
        self._shards = {}
        for part, size in zip(parts, self.output_sizes):
            rows = part.shape[0] if isinstance(part, torch.Tensor) else part.rows if isinstance(
                part, KQuantWeight) else part.q.shape[0]
            if rows != size:
                raise ValueError(f"quantized weight has {rows} output rows, expected {size} ({self.extra_repr()})")
        if all(isinstance(p, KQuantWeight) for p in parts):
            self.kind = "kquant"
            self._kq = [p.tiled() for p in parts]  # our tiled copy; the file's views are dropped with `parts`
            parts = None
            for i, p in enumerate(self._kq):
                self.register_buffer(f"kq_data{i}", p.data, persistent=False)
            return
        int4 = all(isinstance(p, Int4Groups) for p in parts)
        if int4 and len(parts) > 1:
            perms = [p.perm for p in parts]
            same_perm = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                            for a, b in zip(perms, perms[1:]))
            int4 = same_perm and len({p.group_size for p in parts}) == 1
        if int4 and int4_kernel_supports(self.in_features, parts[0].group_size):
            self.kind = "int4"
            packed = PackedInt4.pack(Int4Groups.cat(parts), self.dtype)
            self._kernel_group, self._n_out = int(packed.pop("kernel_group")), int(packed.pop("n_out"))
            self._int4_layout = packed.pop("layout")
            if "perm" not in packed:
                self.perm = None
            for name, t in packed.items():
                self.register_buffer(name, t, persistent=False)
        elif all(isinstance(p, torch.Tensor) for p in parts):
            self.kind = "dense"
            self.register_buffer("weight", torch.cat([p.to(self.dtype) for p in parts]), persistent=False)
        else:
            as_int8 = [p if isinstance(p, Int8Rows) else Int8Rows.quantize(
                p.dequantize() if not isinstance(p, torch.Tensor) else p) for p in parts]
            if not all(isinstance(p, Int8Rows) for p in parts):
                logger.info("layer %s: shards of mixed forms; requantized to per-row int8", self.extra_repr())
            self.kind = "int8"
            w = Int8Rows.cat(as_int8)
            self.register_buffer("qweight", w.q.contiguous(), persistent=False)
            self.register_buffer("scale", w.scale.to(self.dtype), persistent=False)

    def dequantized_weight(self) -> torch.Tensor:
        """float32 ``[N, K]`` as the layer computes with it (checkpoint input order)."""
        if self.kind == "kquant":
            return torch.cat([p.dequantize() for p in self._kq])
        if self.kind == "int4":
            q = PackedInt4.unpack_codes(self.packed, self._int4_layout)[: self._n_out]
            sz = self.scales_and_zeros.float()[:, : self._n_out]  # [K / g, N, 2]
            w = Int4Groups(q, sz[..., 0].t(), sz[..., 1].t(), self._kernel_group, self.perm)
            return w.dequantize()
        if self.kind == "int8":
            return self.qweight.float() * self.scale.float()[:, None]
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.kind == "kquant":
            y = kquant_linear(x, self._kq)
        elif self.kind == "int4":
            if self.perm is not None:
                x = x.index_select(-1, self.perm)
            y = int4_matmul(x, self.packed, self.scales_and_zeros, self._kernel_group, self._n_out,
                            layout=self._int4_layout)
        elif self.kind == "int8":
            y = int8_matmul(x, self.qweight, self.scale)
        else:
            y = F.linear(x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y

    def forward_silu_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``silu(gate) * up`` ``[T, N / 2]`` of a SwiGLU gate_up layer (``silu_gated``: rows ``[gate; up]``) in one
        pass where it has one: int4 prefill rows on a packed bf16 GEMM (AMX, or dpbf16 at ``avx512_bf16``) through its
        gated epilogue (``int4_silu_mul``). None otherwise (the caller runs ``forward``, then ``silu_and_mul``); the
        same bits either way."""
        if (self.kind != "int4" or not self.silu_gated or self.perm is not None
                or self.bias is not None):
            return None
        return int4_silu_mul(x, self.packed, self.scales_and_zeros, self._kernel_group, self._n_out,
                             self._int4_layout)

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # as an (untied) lm_head: [T, K] -> [T, N] float32
        if self.kind == "kquant":
            y = kquant_logits(x, self._kq)
        elif self.kind == "int4":
            if self.perm is not None:
                x = x.index_select(-1, self.perm)
            y = int4_matmul(x, self.packed, self.scales_and_zeros, self._kernel_group, self._n_out, torch.float32,
                            self._int4_layout)
        elif self.kind == "int8":  # the LM head kernel (as a tied int8 head's): int8_matmul's GEMM is ~4x slower at
            # one row (151936x1536, EPYC Zen 3: 52 vs 14 ms), and a row's logits don't depend on the others in either
            y = int8_logits(x, self.qweight, self.scale.float(), None)
        else:
            y = F.linear(x.float(), self.weight.float())
        return y if self.bias is None else y + self.bias.float()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kind={self.kind}"


class QuantEmbedding(nn.Module):
    """Token embedding (and tied lm_head): GGUF blocks kept as stored (the lookup dequantizes only the looked-up
    rows, the logits run on the kquant kernel in float32), else per-row int8 (a row's scale serves both the lookup
    and the logits matmul). A dense checkpoint tensor stays dense."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, quant_config: Any) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.quant_config = quant_config
        self.output_sizes = None
        self.kind = "loading"
        self._weight: Any = None

    def load_shard(self, shard_id: int, name: str, tensor: Any) -> None:
        self._weight = tensor

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        from pagedllm.layers.quantization.gguf import GGUFWeight, gguf_to_canonical

        w, self._weight = self._weight, None
        if w is None:
            raise ValueError("checkpoint is missing the token embedding")
        if isinstance(w, GGUFWeight):
            w = gguf_to_canonical(w)
            if isinstance(w, KQuantWeight):
                self.kind = "kquant"
                self._kq = w = w.tiled()
                self.register_buffer("kq_data", w.data, persistent=False)
                return
            if isinstance(w, Int4Groups):
                logger.info("embedding: int4 GGUF type requantized to per-row int8")
                w = Int8Rows.quantize(w.dequantize())
        elif self.quant_config.method == "int8":
            w = Int8Rows.quantize(w)
        if isinstance(w, Int8Rows):
            self.kind = "int8"
            self.register_buffer("qweight", w.q.contiguous(), persistent=False)
            # The lookup uses float32 row scales: with bf16-rounded ones (each token's embedding off by up to 2^-9,
            # the same for every occurrence) the bundled SmolLM2 in bf16 answered greedy chat with gibberish.
            self.register_buffer("scale", w.scale.float(), persistent=False)
            # Logits: the int8 matmul with unit scales in the activation dtype (aten's int8 op is 12x slower in
            # float32), then the float32 row scales (bf16-rounded scales derailed greedy answers the same way).
            self.register_buffer("unit_scale", torch.ones_like(w.scale, dtype=self.dtype), persistent=False)
        else:
            self.kind = "dense"
            self.register_buffer("weight", w.to(self.dtype).contiguous(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        if self.kind == "dense":
            return F.embedding(input_ids, self.weight)
        if self.kind == "kquant":
            return dequantize_rows(self._kq, input_ids, self.dtype).view(*input_ids.shape, self.embedding_dim)
        return (self.qweight[input_ids].float() * self.scale[input_ids, None]).to(self.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # [N, dim] -> [N, vocab] float32
        if self.kind == "dense":
            from pagedllm.layers.packed_linear import float32_logits

            return float32_logits(self, x, self.weight)
        if self.kind == "kquant":
            return kquant_logits(x, [self._kq])
        return int8_logits(x, self.qweight, self.scale, self.unit_scale)

    def dequantized_weight(self) -> torch.Tensor:
        if self.kind == "dense":
            return self.weight.float()
        if self.kind == "kquant":
            return self._kq.dequantize()
        return self.qweight.float() * self.scale.float()[:, None]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={self.kind}"
