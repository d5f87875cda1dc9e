"""GGUF quantized tensors, kept quantized: raw ggml blocks -> ``KQuantWeight`` / ``Int4Groups`` / ``Int8Rows``.

| ggml type | kept as | exact? |
|---|---|---|
| Q8_0, Q5_0, Q4_K, Q5_K, Q6_K | the file's values in our 16-row tiles (``kquant.KQuantWeight``, ``kernels/csrc/kquant_cpu.c``) | yes |
| Q4_0 (``d * (q - 8)``) | int4, group 32, zero 0 | yes (d rounded to the activation dtype) |
| Q4_1 (``d * q + m``) | int4, group 32, zero ``m + 8 d`` | yes (scale and zero rounded to the activation dtype) |
| Q2_K, Q3_K, IQ4_* | int4, group 32 (min-max of the dequantized values) | requantized |
| Q5_1, Q8_K, other | int8 per row (of the dequantized values) | requantized |

Without the C kernels (``PAGEDLLM_CPU_KERNELS=0``, no compiler) the kept-as-stored types fall back to the
requantizations they had before: Q4_K to int4, the others to per-row int8. Each requantization is logged once per
ggml type.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from pagedllm.layers.quantization.kernels import Int4Groups, Int8Rows, quantize_int4_minmax
from pagedllm.layers.quantization.kquant import KQuantWeight, kquant_supports
from pagedllm.layers.quantization.tile_cache import FileSpan

logger = logging.getLogger(__name__)

UNQUANTIZED_TYPES = frozenset({T.F32, T.F16, T.BF16, T.F64})
_TO_INT4 = frozenset({T.Q2_K, T.Q3_K, T.Q4_K, T.IQ4_NL, T.IQ4_XS})  # Q4_K: only without the kquant kernels
_logged: set[str] = set()


@dataclass
class GGUFWeight:
    """One quantized GGUF matrix: ``data [rows, row_bytes]`` uint8 holds ``rows`` rows of ``shape[1]`` values as
    ggml blocks. Rows are independent, so row permutations (llama.cpp's Q/K order) apply to ``data`` directly.
    ``file_backed``: ``data`` is a view of the loader's copy-on-write file mapping, never written (so its pages may be
    dropped from resident memory once the weight is converted: ``KQuantWeight.tiled``); ``span``: where in the file
    (``tile_cache.FileSpan``: the converted tiles may be cached on disk)."""

    ggml_type: T
    shape: tuple[int, int]
    data: torch.Tensor
    file_backed: bool = False
    span: Optional[FileSpan] = None

    def dequantize(self) -> torch.Tensor:
        """float32 ``shape`` (the loader's dequantization)."""
        from pagedllm.model_loader.gguf_loader import dequantize_blocks

        return dequantize_blocks(self.data.reshape(-1), self.ggml_type, self.shape)


def _log_once(key: str, msg: str) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg)


def _f16(blocks: torch.Tensor, col: int) -> torch.Tensor:
    return blocks[:, col : col + 2].contiguous().view(torch.float16).float()  # [n_blocks, 1]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:  # [n_blocks, 16] -> [n_blocks, 32]: element j low, j + 16 high
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def gguf_to_canonical(w: GGUFWeight) -> KQuantWeight | Int4Groups | Int8Rows:
    rows, cols = w.shape
    if kquant_supports(w.ggml_type, cols):
        return KQuantWeight(w.ggml_type, cols, w.data, file_backed=w.file_backed, span=w.span)
    _, type_size = GGML_QUANT_SIZES[w.ggml_type]
    if w.ggml_type in (T.Q4_0, T.Q4_1):
        blocks = w.data.reshape(-1, type_size)
        d = _f16(blocks, 0).view(rows, cols // 32)
        if w.ggml_type == T.Q4_0:
            q, zero = _nibbles(blocks[:, 2:]), torch.zeros_like(d)
        else:
            q, zero = _nibbles(blocks[:, 4:]), _f16(blocks, 2).view(rows, cols // 32) + 8 * d
        return Int4Groups(q.view(rows, cols), d, zero, 32)
    name = w.ggml_type.name
    if w.ggml_type in _TO_INT4:
        _log_once(name, f"GGUF {name}: no kernel for its layout; requantized to int4 (group 32, min-max) at load")
        return quantize_int4_minmax(w.dequantize(), 32)
    if w.ggml_type == T.Q8_0:
        _log_once(name, "GGUF Q8_0: requantized from per-32 scales to per-row int8 scales at load")
    else:
        _log_once(name, f"GGUF {name}: no kernel for its layout; requantized to per-row int8 at load")
    return Int8Rows.quantize(w.dequantize())
