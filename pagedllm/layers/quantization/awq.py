"""AWQ checkpoints (AutoAWQ ``WQLinear_GEMM`` format, ``version: "gemm"``), 4-bit, unpacked to ``Int4Groups``.

Format (AutoAWQ ``awq/modules/linear/gemm.py`` ``from_linear``; vLLM ``awq.py`` reads the same), K inputs, N outputs:
- ``qweight [K, N / 8] int32`` packed along the *outputs*, in AutoAWQ's interleaved order: nibble ``i`` of column
  ``c`` holds output ``8 c + AWQ_ORDER[i]`` with ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``;
- ``qzeros [K / group_size, N / 8] int32``, packed the same way (zero points as is, no offset);
- ``scales [K / group_size, N] float16``;  ``w[n, k] = scales[k // g, n] * (q[k, n] - zero[k // g, n])``.
"""

from __future__ import annotations

import torch

from pagedllm.layers.quantization.gptq import unpack_int32_cols
from pagedllm.layers.quantization.kernels import Int4Groups

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# unpacked nibble i is output AWQ_ORDER[i]: output j sits at nibble AWQ_REVERSE_ORDER[j]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C] int32`` -> ``[R, 8 C]`` codes in output order."""
    r, c = packed.shape
    nib = unpack_int32_cols(packed).view(r, c, 8)
    return nib[:, :, list(AWQ_REVERSE_ORDER)].reshape(r, 8 * c)


def awq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Groups:
    q = unpack_awq(qweight).t()  # [N, K]
    zeros = unpack_awq(qzeros).float().t()  # [N, G]
    s = scales.float().t()
    return Int4Groups(q.to(torch.uint8).contiguous(), s, s * (8 - zeros), group_size)
