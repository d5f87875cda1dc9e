"""Linear layers with their weights pre-packed for oneDNN (CPU, bfloat16).

``F.linear`` on a plain bf16 weight makes oneDNN reorder the weight into its blocked (AMX/AVX-512) layout on every
call: the whole weight is read and rewritten each step, which at decode batch sizes costs as much as the matmul.
Packing once at load (``torch.ops.mkldnn._reorder_linear_weight``, the same op Inductor's weight freezing uses) and
calling ``torch.ops.mkldnn._linear_pointwise`` halves the matmul time per decode step on this CPU (measured: a
SmolLM2 layer's four matmuls at 32 rows, 820 -> 500 us on one core; see benchmarks/RESULTS.md).

Only exact ``nn.Linear`` modules with bf16 weights on CPU are packed (quantized or tensor-parallel layers have their
own kernels), except those marked ``keep_weight = True`` because the model reads their ``.weight`` itself. The
original weight is dropped (the packed copy replaces it), except tied LM heads, whose weight is also the embedding
table: those get an extra packed copy. Set ``PAGEDLLM_PACK_WEIGHTS=0`` to keep plain weights.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# Row-count hint oneDNN uses to choose the packed layout (the layout is valid for any row count).
PACK_BATCH_HINT = 32


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True when bf16 weights on this CPU can be packed for oneDNN (and packing isn't switched off)."""
    if os.environ.get("PAGEDLLM_PACK_WEIGHTS", "1") == "0":
        return False
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W [out_features, in_features]`` held in oneDNN's packed layout.

    forward(x [T, in_features] bf16) -> [T, out_features] bf16; same values as ``F.linear`` (same oneDNN kernel).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linear_weights(model: nn.Module) -> int:
    """Replaces every exact ``nn.Linear`` of ``model`` by a ``PackedLinear``; a tied LM head (``model.lm_head`` an
    ``nn.Embedding``) gets ``model.lm_head_packed``. Returns the number of layers packed. Call after loading."""
    # ``keep_weight``: a layer whose ``.weight`` the model reads directly (e.g. MLA's kv_b_proj) stays plain.
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and not getattr(m, "keep_weight", False)]
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        packed = PackedLinear(m.weight, m.bias)
        if hasattr(m, "output_sizes"):
            packed.output_sizes = m.output_sizes
        setattr(parent, attr, packed)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Embedding):
        model.lm_head_packed = PackedLinear(head.weight, None)
    return len(targets) + (1 if isinstance(head, nn.Embedding) else 0)


def lm_head_logits(model: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``hidden [N, hidden] -> logits [N, vocab]`` in the model dtype, through the packed head when there is one."""
    packed = getattr(model, "lm_head_packed", None)
    if packed is not None:
        return packed(hidden_states)
    head = model.lm_head
    if isinstance(head, PackedLinear):
        return head(hidden_states)
    return F.linear(hidden_states, head.weight)
