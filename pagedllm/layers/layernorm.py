"""RMSNorm, computed in float32 like Hugging Face Llama's (one fused ``F.rms_norm`` call).

HF normalises in float32, casts to the model dtype, then multiplies by the weight. ``F.rms_norm`` with the weight
upcasts internally and rounds once at the end: identical in float32, within one ulp (and closer to exact) in
bfloat16/float16, for 1 op instead of 6.

``forward(x, residual)`` fuses the residual add that precedes every norm in a pre-norm decoder:
``x = x + residual; residual = x; return norm(x), residual`` (one call instead of two module boundaries).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.cpu_kernels import add_rms_norm, gemma_rms_norm


class RMSNorm(nn.Module):
    """forward(x [T, hidden], residual [T, hidden] | None) -> normed, or (normed, new_residual) with a residual."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        fused = add_rms_norm(x, residual, self.weight, self.eps)  # one C pass on CPU (csrc/cpu_ops.c)
        if fused is not None:
            return fused[0] if residual is None else fused
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored zero-centred, ``y = x / rms(x) * (1 + weight)``, computed in float32 and
    cast back (as HF's ``Gemma3RMSNorm``). ``1 + weight`` is kept in float32 by ``update_scale`` after loading.

    forward(x [..., hidden]) -> [..., hidden].
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.register_buffer("scale", torch.ones(hidden_size, dtype=torch.float32), persistent=False)

    @torch.no_grad()
    def update_scale(self) -> None:
        self.scale = 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.bfloat16:  # one C pass (csrc/cpu_ops.c) instead of three torch ops
            y = gemma_rms_norm(x, self.scale, self.eps)
            if y is not None:
                return y
        return F.rms_norm(x.float(), (self.hidden_size,), self.scale, self.eps).to(x.dtype)

    def forward_heads(self, x: torch.Tensor, groups: int, out: torch.Tensor) -> Optional[torch.Tensor]:
        """The norm over each of the first ``groups`` heads (``hidden_size`` values each) of the rows of ``x [T, >=
        groups * hidden_size]``, written into ``out [T, groups * hidden_size]`` (both may be strided views, e.g. of
        a fused qkv); None where the C kernel doesn't run (the caller then uses ``forward``)."""
        return gemma_rms_norm(x, self.scale, self.eps, groups, out)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
