"""GGUF Q8_0 / Q5_0 / Q4_K / Q5_K / Q6_K weights executed as stored (``kernels/csrc/kquant_cpu.c``).

A ``KQuantWeight`` is the file's own bytes (``data [N, row_bytes]`` uint8, ggml blocks, usually a view of the
memory-mapped GGUF): no requantization and no repack, so resident weight memory is the file's tensor bytes and
loading copies nothing. (A repack was not needed for exactness or SIMD: ggml's layouts already put 32 consecutive
codes of a group in one 32-byte load, the kernel decodes them in registers with a few instructions per 32 weights,
and Q4_K's 6-bit scales cost ~1 instruction per group to unpack.) The activations are quantized per 32 inputs to 15
bits (``quantize_activations``); the u8 x s8 products are summed exactly in int32 and the block scales applied in
float32.

Error: per element |x - x~| <= max|x| / 32256 over its block of 32 (about 2^-15, far below a bf16 rounding),
so ``|y - x @ W.T| <= sum_k |w_k| max_b|x| / 32256`` plus float32 accumulation; ``tests/test_kquant.py`` checks it
against ``gguf.quants.dequantize`` and a float64 matmul. Every M runs the same per-row arithmetic (batch
invariance: a row's result does not depend on the other rows of the call), and every ISA (AVX512-VNNI, AVX-VNNI,
AVX2, scalar) the same bits.

Speed (one row per weight row pass, up to 4 activation rows sharing each decoded group): see benchmarks in the
issue-20 report; prefill is the same integer path (no bf16 GEMM on dequantized tiles), which keeps batch invariance
but is slower than a dense AMX / AVX512-BF16 GEMM for long prompts.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from pagedllm import kernels

KQUANT_TYPES = frozenset({T.Q8_0, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K})


def get_lib() -> Optional[ctypes.CDLL]:
    """The ``kquant`` library (``kernels/csrc/kquant_cpu.c``) for the active ISA level, or None: level ``none``,
    ``PAGEDLLM_CPU_KERNELS=0`` or no compiler (then GGUF files load with the requantizations of ``gguf.py``)."""
    return kernels.lib("kquant")


@dataclass
class KQuantWeight:
    """``data [N, row_bytes]`` uint8: N rows of ``n_in`` inputs as ggml blocks of ``ggml_type`` (bytes as stored)."""

    ggml_type: T
    n_in: int
    data: torch.Tensor

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, n_in]``, the values ``gguf.quants.dequantize`` gives."""
        from pagedllm.model_loader.gguf_loader import dequantize_blocks

        return dequantize_blocks(self.data.reshape(-1), self.ggml_type, (self.rows, self.n_in))


def kquant_supports(ggml_type: T, n_in: int) -> bool:
    return ggml_type in KQUANT_TYPES and n_in % GGML_QUANT_SIZES[ggml_type][0] == 0 and get_lib() is not None


@dataclass
class QuantizedActivations:
    """``x [M, K]`` as the kernel takes it: ``hi, lo [M, K]`` int8 (xq = 128 hi + lo, |xq| <= 16256), per block of
    32 the float32 scale ``xs [M, K/32]`` and ``xs * sum(xq)`` (``sum32 [M, K/32]``, ``sum16 [M, K/16]`` per half)."""

    hi: torch.Tensor
    lo: torch.Tensor
    xs: torch.Tensor
    sum32: torch.Tensor
    sum16: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 ``[M, K]``: the activations the matmul actually multiplies (for error bounds in tests)."""
        q = self.hi.float() * 128 + self.lo.float()
        return (q.view(q.shape[0], -1, 32) * self.xs[..., None]).view(q.shape)


def quantize_activations(x: torch.Tensor, lib: Optional[ctypes.CDLL] = None) -> QuantizedActivations:
    """``x [M, K]`` (bf16 / float32; K % 32 == 0) -> ``QuantizedActivations`` (one pass, in C)."""
    lib = lib or get_lib()
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    x = x.contiguous()
    m, k = x.shape
    hi = torch.empty(m, k, dtype=torch.int8)
    lo = torch.empty(m, k, dtype=torch.int8)
    xs = torch.empty(m, k // 32)
    s32 = torch.empty(m, k // 32)
    s16 = torch.empty(m, k // 16)
    lib.kq_quantize_act(x.data_ptr(), m, k, int(x.dtype == torch.bfloat16), hi.data_ptr(), lo.data_ptr(),
                        xs.data_ptr(), s32.data_ptr(), s16.data_ptr())
    return QuantizedActivations(hi, lo, xs, s32, s16)


def kquant_matmul(acts: QuantizedActivations, weights: Sequence[KQuantWeight], out_dtype: torch.dtype,
                  lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """``x @ cat(weights).T -> [M, sum N_i]`` in ``out_dtype`` (bf16 / float32): each weight (any supported type,
    same ``n_in``) writes its own columns of the one output (a fused qkv / gate_up layer needs no cat)."""
    lib = lib or get_lib()
    m, k = acts.hi.shape
    n_total = sum(w.rows for w in weights)
    out = torch.empty(m, n_total, dtype=out_dtype)
    esize = out.element_size()
    col = 0
    for w in weights:
        rc = lib.kq_matmul(int(w.ggml_type), w.data.data_ptr(), w.rows, k, w.data.shape[1], acts.hi.data_ptr(),
                           acts.lo.data_ptr(), acts.xs.data_ptr(), acts.sum32.data_ptr(), acts.sum16.data_ptr(), m,
                           out.data_ptr() + col * esize, n_total, int(out_dtype == torch.bfloat16))
        if rc != 0:
            raise ValueError(f"kquant_matmul: unsupported ggml type {w.ggml_type.name}")
        col += w.rows
    return out


def kquant_linear(x: torch.Tensor, weights: Sequence[KQuantWeight], out_dtype: Optional[torch.dtype] = None,
                  lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """``x [T, K] @ cat(weights).T -> [T, N]`` in ``out_dtype`` (default x's dtype; float16 comes via float32)."""
    out_dtype = out_dtype or x.dtype
    kernel_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.float32
    y = kquant_matmul(quantize_activations(x, lib), weights, kernel_dtype, lib)
    return y if kernel_dtype == out_dtype else y.to(out_dtype)


def dequantize_rows(w: KQuantWeight, ids: torch.Tensor, dtype: torch.dtype,
                    lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """Rows ``ids [T]`` of ``w`` dequantized -> ``[T, n_in]`` in ``dtype`` (gguf's float32 values, rounded once to
    bf16 when ``dtype`` is bf16): an embedding lookup that never expands the table.

    Raises:
        IndexError: for an id outside ``[0, N)``.
    """
    lib = lib or get_lib()
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= w.rows):
        raise IndexError(f"token id out of range [0, {w.rows})")
    kernel_dtype = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    out = torch.empty(ids.numel(), w.n_in, dtype=kernel_dtype)
    lib.kq_dequant_rows(int(w.ggml_type), w.data.data_ptr(), w.data.shape[1], w.n_in, ids.data_ptr(), ids.numel(),
                        out.data_ptr(), int(kernel_dtype == torch.bfloat16))
    return out if kernel_dtype == dtype else out.to(dtype)
