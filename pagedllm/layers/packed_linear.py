"""Linear layers with their weights pre-packed once at load for the CPU's matrix units (bfloat16).

Three backends, chosen per layer when it is packed:

- **AMX** (``csrc/amx_linear.c``, on CPUs with AMX-TILE and AMX-BF16, when ``out_features`` and ``in_features`` are
  multiples of 32): our own tile kernel over a weight layout it streams sequentially. At decode batch sizes it reads
  the weights about twice as fast as oneDNN's packed matmul on this CPU (measured, 2 threads, every SmolLM2 weight of
  a step, rows 16: 12.4 vs 21.8 ms; the tied LM head: 1.6 vs 4.5 ms); at prefill sizes it is on par with oneDNN on a
  quiet host (~2 TFLOP/s at 2,048 rows) and ahead of it when one core is slowed, as its work units are taken
  dynamically.
- **dpbf16** (``kernels/csrc/dpbf16_linear.c``, without AMX: VDPBF16PS at level ``avx512_bf16``, e.g. AMD Zen 4;
  AVX2 + FMA at level ``avx2``; same shape rule): our own kernel with the AMX kernel's ABI and output modes over a
  sequentially streamed layout, batch invariant (a row's sums run in the same order whatever the number of rows).
  At ``avx2`` it is used while ``batch_invariant`` is on (the default); with it off oneDNN runs there, unless the
  CPU has no native oneDNN bf16 (AVX2-only CPUs such as Zen 2/3: there a shape ours don't take runs ``F.linear``).
- **oneDNN** otherwise: ``F.linear`` on a plain bf16 weight makes oneDNN reorder the weight into its blocked layout
  on every call, which at decode batch sizes costs as much as the matmul. Packing once
  (``torch.ops.mkldnn._reorder_linear_weight``, the op Inductor's weight freezing uses) and calling
  ``torch.ops.mkldnn._linear_pointwise`` halves that (a SmolLM2 layer's four matmuls at 32 rows, 820 -> 500 us).

The packed-kernel backends form a table (``LINEAR_BACKENDS``, best first); a layer takes the first whose library
runs at the active ISA level and which takes its shape, else oneDNN. A backend is a library of
``pagedllm.kernels.bindings`` with ``amx_pack`` / ``amx_linear_bf16``'s C ABI (same arguments, modes 0-3), so a new
one (e.g. a non-AMX AVX512-BF16 kernel) is one more entry.

Only exact ``nn.Linear`` modules with bf16 weights on CPU are packed (quantized or tensor-parallel layers have their
own kernels), except those marked ``keep_weight = True`` because the model reads their ``.weight`` itself. The
original weight is dropped (the packed copy replaces it), except tied LM heads, whose weight is also the embedding
table: those get an extra packed copy. ``KernelConfig.pack_weights`` off (``PAGEDLLM_PACK_WEIGHTS=0``) keeps plain
weights; ``amx_linear`` off (``PAGEDLLM_AMX_LINEAR=0``) skips the AMX backend (the dpbf16 kernel then runs).

Logits are float32 on every path (``lm_head_logits``): a bf16 logit of magnitude 8-16 is resolved only to 1/16, so
near-ties become exact ties and greedy answers change with the backend. The packed kernels return their float32
sums (mode 3); where the head runs on oneDNN or plain weights it keeps a float32 copy of its weight (4 bytes per
weight more: 113 MB for SmolLM2's tied head) and multiplies in float32.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import kernels

logger = logging.getLogger(__name__)

# Row-count hint oneDNN uses to choose the packed layout (the layout is valid for any row count).
PACK_BATCH_HINT = 32


@dataclass(frozen=True)
class LinearBackend:
    """A packed bf16 linear kernel: library ``library`` exports ``pack(W, N, K, P)`` and ``linear(x, M, K, P, N,
    bias, out, mode)`` with ``amx_linear_bf16``'s semantics (modes 0-3, fp32 sums, one rounding); ``takes(N, K)``
    says which shapes it runs; ``enabled(cfg)`` its switch."""

    name: str
    library: str
    pack: str
    linear: str
    takes: Callable[[int, int], bool]
    enabled: Callable[[kernels.KernelConfig], bool]


def _by32(n: int, k: int) -> bool:
    return n % 32 == 0 and k % 32 == 0


LINEAR_BACKENDS: tuple[LinearBackend, ...] = (
    LinearBackend("amx", "amx", "amx_pack", "amx_linear_bf16", _by32, lambda cfg: cfg.amx_linear),
    LinearBackend("dpbf16", "dpbf16", "dpbf16_pack", "dpbf16_linear_bf16", _by32,
                  lambda cfg: (cfg.level in ("amx", "avx512_bf16") or cfg.batch_invariant
                               or not onednn_bf16_supported())),
)


def linear_backend(out_features: int, in_features: int) -> Optional[tuple[LinearBackend, object]]:
    """The first packed-kernel backend (and its library) that runs a layer of this shape here, or None (oneDNN)."""
    cfg = kernels.config()
    for b in LINEAR_BACKENDS:
        if b.enabled(cfg) and b.takes(out_features, in_features):
            lib = kernels.lib(b.library)
            if lib is not None:
                return b, lib
    return None


@functools.lru_cache(maxsize=1)
def onednn_bf16_supported() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX512-BF16 / AMX; false on AVX2-only CPUs such as
    Zen 2/3, where only our kernels can take a packed bf16 layer)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True when bf16 weights on this CPU can be packed (packing on): for one of our kernel backends (every level
    with our libraries, AVX2 included) or for oneDNN where it runs bf16 natively (without it, a shape our backends don't take keeps its plain
    weight inside the ``PackedLinear``: backend ``torch``)."""
    if not kernels.config().pack_weights or device.type != "cpu" or dtype != torch.bfloat16:
        return False
    return onednn_bf16_supported() or any(b.enabled(kernels.config()) and kernels.lib(b.library) is not None
                                          for b in LINEAR_BACKENDS)



def amx_linear_supported() -> bool:
    """Whether the AMX bf16 kernel runs here: level ``amx``, the kernel built, the OS granted the tile state, and
    ``amx_linear`` is on."""
    cfg = kernels.config()
    return cfg.amx_linear and kernels.lib("amx") is not None


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W [out_features, in_features]`` held packed for the AMX kernel or oneDNN.

    forward(x [..., in_features] bf16) -> [..., out_features] bf16. Both backends sum in float32 and round once to
    bf16 (AMX: bias added in float32 before the rounding; oneDNN: the bf16 bias); ``backend`` says which one.

    ``silu_gated=True`` (a SwiGLU ``gate_up_proj``, ``W = [gate; up]``): on the AMX backend the two halves are packed
    side by side so that ``forward_silu_mul`` returns ``silu(gate) * up [..., out_features / 2]`` straight from the
    matmul (no ``[T, 2I]`` intermediate, no separate pass), equal bit for bit to ``forward`` then
    ``attention.cpu_kernels.silu_and_mul``.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], silu_gated: bool = False,
                 logits_head: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        found = linear_backend(self.out_features, self.in_features)
        self.backend = found[0].name if found else "onednn"
        kern = found[1] if found else None
        self.gated = kern is not None and silu_gated and self.out_features % 64 == 0
        with torch.no_grad():
            w = weight.detach().contiguous()
            b32 = None if bias is None else bias.detach().float().contiguous()
            # A head on oneDNN has no float32 output: it multiplies a float32 copy (see the module docstring).
            self._w32 = w.float() if logits_head and kern is None else None
            if kern is not None:
                if self.gated:  # each 32-row group: 16 gate rows, then the 16 matching up rows
                    w = _interleave_halves(w)
                    b32 = None if b32 is None else _interleave_halves(b32[:, None])[:, 0].contiguous()
                packed = torch.empty(w.numel(), dtype=torch.bfloat16)
                getattr(kern, found[0].pack)(w.data_ptr(), self.out_features, self.in_features, packed.data_ptr())
            elif onednn_bf16_supported():
                packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
            else:  # no kernel takes this shape and oneDNN has no bf16 here (AVX2-only CPUs): the plain weight
                packed, self.backend = w, "torch"
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # The packed kernels add a float32 bias (in packed row order) before their one rounding.
        self._bias_f32 = b32 if kern is not None else None
        self._amx = getattr(kern, found[0].linear) if kern is not None else None  # the backend's linear function
        # Raw pointers for the kernel call, with references that keep their tensors alive.
        self._w, self._w_ptr = packed, (packed.data_ptr() if kern is not None else None)
        self._b_ptr = None if self._bias_f32 is None else self._bias_f32.data_ptr()

    @staticmethod
    def uses_amx(out_features: int, in_features: int) -> bool:
        """Whether a layer of this shape gets the AMX backend here."""
        found = linear_backend(out_features, in_features)
        return found is not None and found[0].name == "amx"

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
            if self.backend == "torch":
                return F.linear(x, self.packed_weight, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return self._run(x, 1 if self.gated else 0, self.out_features)

    def forward_f32(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``x @ W.T + b`` as float32 ``[..., out_features]``: the kernel's fp32 sums without the bf16 rounding, or
        (a ``logits_head`` on oneDNN) a float32 matmul over the float32 copy. None otherwise (or a gated layer)."""
        if self._w32 is not None:
            return F.linear(x.float(), self._w32, None if self.bias is None else self.bias.float())
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
    """Replaces every exact ``nn.Linear`` of ``model`` by a ``PackedLinear`` (a shape no backend takes on a CPU
    without oneDNN bf16 keeps its plain weight: backend ``torch``); a tied LM head (``model.lm_head`` an
    ``nn.Embedding``) gets ``model.lm_head_packed``. Returns the number of layers packed. Call after loading."""
    # ``keep_weight``: a layer whose ``.weight`` the model reads directly (e.g. MLA's kv_b_proj) stays plain.
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and not getattr(m, "keep_weight", False)]
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        packed = PackedLinear(m.weight, m.bias, silu_gated=getattr(m, "silu_gated", False),
                              logits_head=name == "lm_head")
        if hasattr(m, "output_sizes"):
            packed.output_sizes = m.output_sizes
        setattr(parent, attr, packed)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Embedding):
        model.lm_head_packed = PackedLinear(head.weight, None, logits_head=True)
    return len(targets) + (1 if isinstance(head, nn.Embedding) else 0)


def lm_head_logits(model: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``hidden [N, hidden] -> logits [N, vocab]`` float32 on every path: the packed head's float32 sums, a quantized
    head's float32 logits, or a float32 matmul (``float32_logits``)."""
    packed = getattr(model, "lm_head_packed", None)
    head = model.lm_head
    if packed is None and isinstance(head, PackedLinear):
        packed = head
    if packed is not None:
        logits = packed.forward_f32(hidden_states)
        return packed(hidden_states).float() if logits is None else logits
    if not isinstance(head, (nn.Linear, nn.Embedding)) and hasattr(head, "logits"):  # QuantLinear / QuantEmbedding
        return head.logits(hidden_states).float()
    return float32_logits(model, hidden_states, head.weight)


def float32_logits(owner: nn.Module, hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden [N, K] @ weight[V, K].T`` in float32; a bf16 ``weight``'s float32 copy is made once and kept on
    ``owner`` (remade if the weight changes)."""
    if weight.dtype == torch.float32:
        return F.linear(hidden_states.float(), weight)
    key = (weight.data_ptr(), weight._version, tuple(weight.shape))
    cached = owner.__dict__.get("_lm_head_w32")
    if cached is None or cached[0] != key:
        cached = owner.__dict__["_lm_head_w32"] = (key, weight.detach().float())
    return F.linear(hidden_states.float(), cached[1])
