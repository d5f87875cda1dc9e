"""pagedllm's Intel AMX kernels (AMX-TILE + AMX-BF16), built into one C library with the system compiler.

- ``amx_pack`` / ``amx_linear_bf16`` (``layers/csrc/amx_linear.c``): bf16 linear layers, used by
  ``layers.packed_linear.PackedLinear``; switch off with ``PAGEDLLM_AMX_LINEAR=0``.
- ``amx_prefill_attention_bf16`` (``attention/csrc/amx_attention.c``): prefill attention straight from the paged KV
  cache, used by ``attention.cpu_kernels.prefill_attention``; switch off with ``PAGEDLLM_AMX_ATTENTION=0``.

The library is only built on CPUs that report both features, and only used once Linux has granted this process the
tile state (``amx_supported`` in C). ``PAGEDLLM_CPU_KERNELS=0`` disables it with the other C kernels.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

from pagedllm.config import cpu_flags
from pagedllm.utils.c_build import CLibrary

_PKG = os.path.dirname(os.path.dirname(__file__))
_LAYERS_C = os.path.join(_PKG, "layers", "csrc")
_ATTN_C = os.path.join(_PKG, "attention", "csrc")


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.amx_supported.argtypes, lib.amx_supported.restype = [], i32
    lib.amx_pack.argtypes, lib.amx_pack.restype = [ptr, i64, i64, ptr], None
    lib.amx_linear_bf16.argtypes, lib.amx_linear_bf16.restype = [ptr, i64, i64, ptr, i64, ptr, ptr, i32], None
    fn = lib.amx_prefill_attention_bf16
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, ptr, i32, i32, i32, i32, ctypes.c_float, i32, ptr]
    fn.restype = None


# The same math flags as the fused element-wise kernels (attention/csrc/cpu_ops.c), so the SiLU epilogue rounds alike.
_LIB = CLibrary("pagedllm_amx", [os.path.join(_LAYERS_C, "amx_linear.c"), os.path.join(_ATTN_C, "amx_attention.c")],
                ["-O3", "-march=native", "-mamx-tile", "-mamx-bf16", "-ffast-math", "-fno-finite-math-only",
                 "-fopenmp"], _declare,
                headers=[os.path.join(_ATTN_C, "simd.h"), os.path.join(_ATTN_C, "bf16.h"),
                         os.path.join(_LAYERS_C, "amx.h")])
_OK: Optional[bool] = None


def amx_lib() -> Optional[ctypes.CDLL]:
    """The AMX kernels' library, or None where they can't run: no AMX-TILE/AMX-BF16 on this CPU, no compiler, or the
    OS refused the tile state. Built and checked once."""
    global _OK
    if _OK is None:
        ok = {"amx_tile", "amx_bf16"} <= cpu_flags()  # don't even build the kernels on other CPUs
        lib = _LIB.get() if ok else None
        _OK = bool(lib is not None and lib.amx_supported())
    return _LIB.get() if _OK else None
