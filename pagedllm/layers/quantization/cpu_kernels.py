"""Torch-tensor wrappers of the int4 / int8 kernels (``kernels/csrc/int4_cpu.c``, the ``int4`` library of
``pagedllm.kernels``): batched int4 / int8 matmuls, the int4 weight expansion and the integer-dot decode kernels
(VNNI, or AVX2 with the same bits). Where the library can't load (level ``none``, ``PAGEDLLM_CPU_KERNELS=0``, no
compiler) ``get_lib()`` is None and the callers use the torch paths."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from pagedllm import kernels


def get_lib() -> Optional[ctypes.CDLL]:
    """The int4/int8 kernels' library for the active level, or None: level ``none``, disabled, or no compiler."""
    lib = kernels.lib("int4")
    if lib is not None:
        _sync_amx(lib)  # the prefetch settings come with the lookup (kernels._settings)
    return lib


_AMX: dict[int, tuple[bool, int]] = {}  # id(library) -> (AMX-INT8 path wanted, the fewest rows it takes; 0: off)


def _sync_amx(lib: ctypes.CDLL) -> int:
    """Switches ``lib``'s AMX-INT8 integer sums (``int4_gemv_bf16`` calls of a few rows or more: the same bits as its
    VNNI loop) on where the AMX library runs (it holds the process's tile state) and the active ``KernelConfig`` lets
    linears use AMX (``amx_linear``); only a library built for level ``amx`` on a CPU with AMX-INT8 has that path.
    Returns the fewest rows a call needs to take it (0: off)."""
    want = kernels.config().amx_linear and kernels.lib("amx") is not None
    state = _AMX.get(id(lib))
    if state is None or state[0] != want:
        state = _AMX[id(lib)] = (want, lib.int4_gemv_use_amx(int(want)))
    return state[1]


def int4_gemv_amx_min_rows() -> int:
    """The fewest rows of an ``int4_gemv_bf16`` call that run on AMX-INT8 tiles here (0: none do)."""
    lib = get_lib()
    return _sync_amx(lib) if lib is not None else 0


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
              n_out: int) -> torch.Tensor:
    """``x [M, K]`` (bf16 / float32, contiguous) @ w.T -> ``[M, n_out]``."""
    lib = get_lib()
    m, k = x.shape
    out = torch.empty(m, n_out, dtype=x.dtype)
    lib.int4_gemm(x.data_ptr(), m, k, packed.data_ptr(), scales_and_zeros.data_ptr(), group_size,
                  packed.shape[0], n_out, out.data_ptr(), int(x.dtype == torch.bfloat16))
    return out


def int4_gemv_supported() -> bool:
    """Whether ``int4_gemv_bf16`` exists in the active level's build (AVX512-VNNI + VBMI + BF16, or AVX2 + FMA:
    levels ``avx2`` and up; both builds give the same bits)."""
    lib = get_lib()
    return lib is not None and hasattr(lib, "int4_gemv_bf16")


def int4_gemv_bf16(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                   n_out: int, out_dtype: torch.dtype = torch.bfloat16, act_bits: int = 16) -> torch.Tensor:
    """``x [M, K]`` (bf16, contiguous) @ w.T -> ``[M, n_out]`` in ``out_dtype`` (bf16, or float32 for logits) on
    integer dot products (kernels/csrc/int4_cpu.c): x is quantized per weight group to 15 bits (error ~2^-15 of the
    group's largest |x|), sums are exact in int32, the scales apply in float32, then one rounding to bf16 (none for
    float32). Each row's arithmetic is independent of M. ``scales_and_zeros`` bf16, group ``G % 4 == 0``. Requires
    ``int4_gemv_supported()``. ``act_bits=8`` (bf16 out only; prefill rows): x quantized per group to int8
    (``rint(127 x / max|x|)``, error <= max|x| / 254 per element), the VNNI build doing half the integer work.
    Raises ``ValueError`` for other ``act_bits``, or 8 with float32 out."""
    m, k = x.shape
    out = torch.empty(m, n_out, dtype=out_dtype)
    lib = get_lib()
    if act_bits not in (8, 16) or (act_bits == 8 and out_dtype != torch.bfloat16):
        raise ValueError(f"int4_gemv_bf16: act_bits {act_bits!r} with {out_dtype} (8 only with bf16 out, or 16)")
    fn = lib.int4_gemv_bf16_f32 if out_dtype == torch.float32 else (
        lib.int4_gemv_bf16_a8 if act_bits == 8 else lib.int4_gemv_bf16)
    fn(x.data_ptr(), m, k, packed.data_ptr(), scales_and_zeros.data_ptr(), group_size, packed.shape[0], n_out,
       out.data_ptr())
    return out


def int8_logits(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (bf16 / float32, contiguous; K % 16 == 0) @ (q * scale[:, None]).T -> float32 ``[M, N]``, with
    ``scale [N]`` float32 applied last. With the integer-dot kernels (``int4_gemv_supported``) and K % 64 == 0: integer dot products over x quantized to
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
