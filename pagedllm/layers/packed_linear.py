"""Linear layers with their weights pre-packed once at load for the CPU's matrix units (bfloat16).

Three backends, chosen per layer when it is packed:

- **AMX** (``csrc/amx_linear.c``, on CPUs with AMX-TILE and AMX-BF16, when ``out_features`` and ``in_features`` are
  multiples of 32): our own tile kernel over a weight layout it streams sequentially. At decode batch sizes it reads
  the weights about twice as fast as oneDNN's packed matmul on this CPU (measured, 2 threads, every SmolLM2 weight of
  a step, rows 16: 12.4 vs 21.8 ms; the tied LM head: 1.6 vs 4.5 ms); at prefill sizes it is on par with oneDNN on a
  quiet host (~2 TFLOP/s at 2,048 rows) and ahead of it when one core is slowed, as its work units are taken
  dynamically.
- **dpbf16** (``csrc/dpbf16_linear.c``, on CPUs without AMX that have AVX512-BF16, e.g. AMD Zen 4, same shape rule):
  our own VDPBF16PS kernel with the AMX kernel's ABI and output modes over a sequentially streamed layout, batch
  invariant (a row's sums run in the same order whatever the number of rows). Figures: benchmarks/RESULTS.md.
- **oneDNN** otherwise: ``F.linear`` on a plain bf16 weight makes oneDNN reorder the weight into its blocked layout
  on every call, which at decode batch sizes costs as much as the matmul. Packing once
  (``torch.ops.mkldnn._reorder_linear_weight``, the op Inductor's weight freezing uses) and calling
  ``torch.ops.mkldnn._linear_pointwise`` halves that (a SmolLM2 layer's four matmuls at 32 rows, 820 -> 500 us).

Only exact ``nn.Linear`` modules with bf16 weights on CPU are packed (quantized or tensor-parallel layers have their
own kernels), except those marked ``keep_weight = True`` because the model reads their ``.weight`` itself. The
original weight is dropped (the packed copy replaces it), except tied LM heads, whose weight is also the embedding
table: those get an extra packed copy. Set ``PAGEDLLM_PACK_WEIGHTS=0`` to keep plain weights, and
``PAGEDLLM_AMX_LINEAR=0`` to pack for the dpbf16 kernel (or oneDNN where it can't run) instead of the AMX kernel.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.dpbf16 import dpbf16_lib
from pagedllm.utils.amx import amx_lib

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


def amx_linear_supported() -> bool:
    """Whether the AMX bf16 kernel can run here: the CPU has AMX-TILE/AMX-BF16, the kernel built, the OS granted the
    tile state, and ``PAGEDLLM_AMX_LINEAR`` isn't ``0``. Cached after the first call."""
    return os.environ.get("PAGEDLLM_AMX_LINEAR", "1") != "0" and amx_lib() is not None


def dpbf16_backend_supported() -> Optional[str]:
    """The level of the dpbf16 kernel layers get here when AMX isn't used (``"avx512_bf16"``), or None: no
    AVX512-BF16 on this CPU (its AVX2 build runs everywhere but isn't chosen, see benchmarks/RESULTS.md), no compiler.
    """
    lib = dpbf16_lib()
    level = None if lib is None else lib.level()
    return level if level == "avx512_bf16" else None


def backend_lib(backend: str):
    """The ctypes library of a kernel backend (``"amx"``, ``"dpbf16"``), whose ``<prefix>_linear_bf16`` PackedLinear
    calls; None for ``"onednn"``."""
    if backend == "amx":
        return amx_lib()
    return dpbf16_lib().get() if backend == "dpbf16" else None


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W [out_features, in_features]`` held packed for the AMX or dpbf16 kernel or oneDNN.

    forward(x [..., in_features] bf16) -> [..., out_features] bf16. All backends sum in float32 and round once to
    bf16 (our kernels: bias added in float32 before the rounding; oneDNN: the bf16 bias); ``backend`` says which one.

    ``silu_gated=True`` (a SwiGLU ``gate_up_proj``, ``W = [gate; up]``): on our kernels the two halves are packed
    side by side so that ``forward_silu_mul`` returns ``silu(gate) * up [..., out_features / 2]`` straight from the
    matmul (no ``[T, 2I]`` intermediate, no separate pass), equal bit for bit to ``forward`` then
    ``attention.cpu_kernels.silu_and_mul``.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], silu_gated: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.backend = self.choose_backend(self.out_features, self.in_features)
        ours = self.backend != "onednn"
        self.gated = ours and silu_gated and self.out_features % 64 == 0
        with torch.no_grad():
            w = weight.detach().contiguous()
            b32 = None if bias is None else bias.detach().float().contiguous()
            if ours:
                if self.gated:  # each 32-row group: 16 gate rows, then the 16 matching up rows
                    w = _interleave_halves(w)
                    b32 = None if b32 is None else _interleave_halves(b32[:, None])[:, 0].contiguous()
                packed = torch.empty(w.numel(), dtype=torch.bfloat16)
                pack = getattr(backend_lib(self.backend), f"{self.backend}_pack")
                pack(w.data_ptr(), self.out_features, self.in_features, packed.data_ptr())
            else:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # Our kernels add a float32 bias (in packed row order) before their one rounding.
        self._bias_f32 = b32 if ours else None
        self._amx = getattr(backend_lib(self.backend), f"{self.backend}_linear_bf16") if ours else None
        # Raw pointers for the kernel call, with references that keep their tensors alive.
        self._w, self._w_ptr = packed, (packed.data_ptr() if ours else None)
        self._b_ptr = None if self._bias_f32 is None else self._bias_f32.data_ptr()

    @staticmethod
    def uses_amx(out_features: int, in_features: int) -> bool:
        """Whether a layer of this shape gets the AMX backend here."""
        return out_features % 32 == 0 and in_features % 32 == 0 and amx_linear_supported()

    @staticmethod
    def choose_backend(out_features: int, in_features: int) -> str:
        """``"amx"``, else ``"dpbf16"`` (AVX512-BF16, same shape rule), else ``"onednn"``."""
        if PackedLinear.uses_amx(out_features, in_features):
            return "amx"
        if out_features % 32 == 0 and in_features % 32 == 0 and dpbf16_backend_supported():
            return "dpbf16"
        return "onednn"

    def _run(self, x: torch.Tensor, mode: int, n_out: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous():  # the model's rows come as they are
            lead = x.shape[:-1]
            x = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
            return self._run(x, mode, n_out, dtype).view(*lead, n_out)
        m = x.shape[0]
        out = torch.empty((m, n_out), dtype=dtype)
        if m:  # a decode step calls this ~120 times: no per-call work beyond the kernel
            self._amx(x.data_ptr(), m, self.in_features, self._w_ptr, self.out_features, self._b_ptr, out.data_ptr(),
                      mode)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._amx is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return self._run(x, 1 if self.gated else 0, self.out_features)

    def forward_f32(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``x @ W.T + b`` as float32 ``[..., out_features]``: our kernel's fp32 sums without the bf16 rounding
        (for logits: a bf16 logit of magnitude 8-16 is only resolved to 1/16, so near-ties turn into exact ties).
        None on the oneDNN backend or a gated layer."""
        if self._amx is None or self.gated:
            return None
        return self._run(x, 3, self.out_features, torch.float32)

    def forward_silu_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``silu(gate) * up`` ``[..., out_features / 2]`` in one kernel, or None when this layer wasn't packed gated."""
        if not self.gated:
            return None
        return self._run(x, 2, self.out_features // 2)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"backend={self.backend}")


def _interleave_halves(w: torch.Tensor) -> torch.Tensor:
    """``[2I, K]`` rows ``[a; b]`` -> 16 rows of ``a``, 16 of ``b``, the next 16 of ``a``, ... (``I % 16 == 0``)."""
    two_i, k = w.shape
    return w.view(2, two_i // 32, 16, k).transpose(0, 1).reshape(two_i, k).contiguous()


def pack_linear_weights(model: nn.Module) -> int:
    """Replaces every exact ``nn.Linear`` of ``model`` by a ``PackedLinear``; a tied LM head (``model.lm_head`` an
    ``nn.Embedding``) gets ``model.lm_head_packed``. Returns the number of layers packed. Call after loading."""
    # ``keep_weight``: a layer whose ``.weight`` the model reads directly (e.g. MLA's kv_b_proj) stays plain.
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and not getattr(m, "keep_weight", False)]
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        packed = PackedLinear(m.weight, m.bias, silu_gated=getattr(m, "silu_gated", False))
        if hasattr(m, "output_sizes"):
            packed.output_sizes = m.output_sizes
        setattr(parent, attr, packed)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Embedding):
        model.lm_head_packed = PackedLinear(head.weight, None)
    return len(targets) + (1 if isinstance(head, nn.Embedding) else 0)


def lm_head_logits(model: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``hidden [N, hidden] -> logits [N, vocab]`` through the packed head when there is one: float32 when that head
    runs on our kernels (AMX or dpbf16: their fp32 sums, unrounded), else in the model dtype."""
    packed = getattr(model, "lm_head_packed", None)
    if packed is None and isinstance(model.lm_head, PackedLinear):
        packed = model.lm_head
    if packed is not None:
        logits = packed.forward_f32(hidden_states)
        return packed(hidden_states) if logits is None else logits
    return F.linear(hidden_states, model.lm_head.weight)
