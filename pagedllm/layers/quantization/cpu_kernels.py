"""``csrc/int4_cpu.c`` (built once by ``pagedllm.utils.c_build``): the batched int4 / int8 matmuls and the int4
weight expansion. ``PAGEDLLM_CPU_KERNELS=0`` or a failed build: the torch paths are used (one warning)."""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

from pagedllm.utils.c_build import CLibrary

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "int4_cpu.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp"]


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.int4_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.int4_expand.argtypes = [ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.int8_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.int8_logits.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.int4_gemm.restype = lib.int4_expand.restype = lib.int8_gemm.restype = None
    lib.int8_logits.restype = None
    lib.int4_gemv_bf16_supported.argtypes = []
    lib.int4_gemv_bf16_supported.restype = ctypes.c_int
    if lib.int4_gemv_bf16_supported():  # both VNNI kernels exist only on CPUs with AVX512-VNNI, -VBMI and -BF16
        lib.int4_gemv_bf16.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr]
        lib.int8_logits_vnni.argtypes = lib.int8_logits.argtypes
        lib.int4_gemv_bf16.restype = lib.int8_logits_vnni.restype = None


_LIB = CLibrary("int4_cpu", [_SRC], _FLAGS, _declare)


def get_lib() -> Optional[ctypes.CDLL]:
    """The int4/int8 kernels' library (built on first use), or None: disabled, or no compiler."""
    return _LIB.get()


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
              n_out: int) -> torch.Tensor:
    """``x [M, K]`` (bf16 / float32, contiguous) @ w.T -> ``[M, n_out]``."""
    lib = get_lib()
    m, k = x.shape
    out = torch.empty(m, n_out, dtype=x.dtype)
    lib.int4_gemm(x.data_ptr(), m, k, packed.data_ptr(), scales_and_zeros.data_ptr(), group_size,
                  packed.shape[0], n_out, out.data_ptr(), int(x.dtype == torch.bfloat16))
    return out


_GEMV_SUPPORTED: Optional[bool] = None


def int4_gemv_supported() -> bool:
    """Whether ``int4_gemv_bf16`` was built (the CPU has AVX512-VNNI, -VBMI and -BF16); cached."""
    global _GEMV_SUPPORTED
    lib = get_lib()
    if lib is None:
        return False
    if _GEMV_SUPPORTED is None:
        _GEMV_SUPPORTED = bool(lib.int4_gemv_bf16_supported())
    return _GEMV_SUPPORTED


def int4_gemv_bf16(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                   n_out: int) -> torch.Tensor:
    """``x [M, K]`` (bf16, contiguous) @ w.T -> bf16 ``[M, n_out]`` on integer dot products (csrc/int4_cpu.c): x is
    quantized per weight group to 15 bits (error ~2^-15 of the group's largest |x|), sums are exact in int32, the
    scales apply in float32, one rounding to bf16. ``scales_and_zeros`` bf16, group ``G % 4 == 0``. Requires
    ``int4_gemv_supported()``."""
    m, k = x.shape
    out = torch.empty(m, n_out, dtype=torch.bfloat16)
    get_lib().int4_gemv_bf16(x.data_ptr(), m, k, packed.data_ptr(), scales_and_zeros.data_ptr(), group_size,
                             packed.shape[0], n_out, out.data_ptr())
    return out


def int8_logits(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (bf16 / float32, contiguous; K % 16 == 0) @ (q * scale[:, None]).T -> float32 ``[M, N]``, with
    ``scale [N]`` float32 applied last. With AVX512-VNNI and K % 64 == 0: integer dot products over x quantized to
    22 bits per row (``int8_logits_vnni``; error ~2^-22 of the row's largest |x|, sums exact), else float32 sums."""
    lib = get_lib()
    fn = lib.int8_logits_vnni if x.shape[1] % 64 == 0 and int4_gemv_supported() else lib.int8_logits
    return _int8_call(fn, x, q, scale, torch.float32)


def int4_expand(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The weight ``[N_pad, K]`` in ``dtype`` (bf16 / float32)."""
    lib = get_lib()
    n_pad, k = packed.shape[0], packed.shape[1] * 2
    w = torch.empty(n_pad, k, dtype=dtype)
    lib.int4_expand(packed.data_ptr(), scales_and_zeros.data_ptr(), k, group_size, n_pad, w.data_ptr(),
                    int(dtype == torch.bfloat16))
    return w


def int8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (bf16 / float32, contiguous) @ (q * scale[:, None]).T -> ``[M, N]``."""
    return _int8_call(get_lib().int8_gemm, x, q, scale, x.dtype)


def _int8_call(fn, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Calls one of the per-row int8 kernels (same C signature: x, M, K, q, scale, N, out, is_bf16)."""
    m, k = x.shape
    out = torch.empty(m, q.shape[0], dtype=out_dtype)
    fn(x.data_ptr(), m, k, q.data_ptr(), scale.data_ptr(), q.shape[0], out.data_ptr(), int(x.dtype == torch.bfloat16))
    return out
