"""GPTQ checkpoints (AutoGPTQ / GPTQModel ``QuantLinear`` format), 4-bit, unpacked to ``Int4Groups``.

Format (AutoGPTQ ``nn_modules/qlinear`` ``pack``; vLLM ``gptq.py`` reads the same), for a layer with K inputs, N
outputs, ``G = K / group_size`` groups:
- ``qweight [K / 8, N] int32``: nibble ``j`` (bits ``4j..4j+3``) of ``qweight[r, n]`` is the code of input ``8r + j``;
- ``qzeros [G, N / 8] int32``: nibble ``j`` of ``qzeros[g, c]`` is the zero point of output ``8c + j``, stored minus
  one (``checkpoint_format`` "gptq"; "gptq_v2" stores it as is). Symmetric quantization stores 7 (zero 8);
- ``scales [G, N] float16``;  ``g_idx [K] int32``: the group of each input (``k // group_size`` unless
  ``desc_act``, "act-order", quantized the inputs in another order);
- ``w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])``.
Act-order is run by permuting the inputs so each group is contiguous again: ``perm = argsort(g_idx)``.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.layers.quantization.kernels import Int4Groups

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j at bits 4j


def unpack_int32_rows(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C] int32`` -> ``[8 R, C]``: nibble j of row r becomes row ``8 r + j``."""
    r, c = packed.shape
    return ((packed[:, None, :] >> _SHIFTS[None, :, None]) & 0x0F).reshape(8 * r, c)


def unpack_int32_cols(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C] int32`` -> ``[R, 8 C]``: nibble j of column c becomes column ``8 c + j``."""
    r, c = packed.shape
    return ((packed[:, :, None] >> _SHIFTS[None, None, :]) & 0x0F).reshape(r, 8 * c)


def gptq_to_int4(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor],
    group_size: int,
    zero_offset: int = 1,
) -> Int4Groups:
    """One GPTQ layer as ``Int4Groups`` ``[N, K]`` (``zero_offset`` 1 for checkpoint_format "gptq", 0 for v2).

    Raises:
        ValueError: if act-order groups are not all of ``group_size`` inputs.
    """
    q = unpack_int32_rows(qweight).t()  # [N, K]
    n, k = q.shape
    zeros = (unpack_int32_cols(qzeros)[:, :n] + zero_offset).float().t()  # [N, G]
    s = scales.float().t()  # [N, G]
    if group_size <= 0:
        group_size = k
    perm = None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group_size):
        perm = torch.argsort(g_idx.long(), stable=True)
        counts = torch.bincount(g_idx.long(), minlength=k // group_size)
        if not bool((counts == group_size).all()):
            raise ValueError(f"GPTQ g_idx: groups must have group_size={group_size} inputs each")
        q = q[:, perm]
    return Int4Groups(q.to(torch.uint8).contiguous(), s, s * (8 - zeros), group_size, perm)
