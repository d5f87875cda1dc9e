"""pagedllm's bf16 linear kernel for CPUs without AMX (``csrc/dpbf16_linear.c``), built with the system compiler.

``dpbf16_pack`` / ``dpbf16_linear_bf16`` have the AMX kernel's ABI and output modes (``amx_linear.c``), so
``layers.packed_linear.PackedLinear`` and the fused layer loop take either. The file compiles at every x86-64 level:
VDPBF16PS microkernels where the compiler targets AVX512-BF16, AVX2 + FMA, or scalar C; ``level`` says which. Built
for this CPU (``-march=native``) by ``dpbf16_lib()``; ``DpBf16Library(march)`` builds it for another level (tests).
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional, Sequence

from pagedllm.utils.c_build import CLibrary

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_ATTN_C = os.path.join(os.path.dirname(os.path.dirname(__file__)), "attention", "csrc")

# Level numbers returned by dpbf16_supported() in C.
LEVELS = {2: "avx512_bf16", 1: "avx2", 0: "scalar"}


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.dpbf16_supported.argtypes, lib.dpbf16_supported.restype = [], i32
    lib.dpbf16_pack.argtypes, lib.dpbf16_pack.restype = [ptr, i64, i64, ptr], None
    lib.dpbf16_linear_bf16.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i32]
    lib.dpbf16_linear_bf16.restype = None


class DpBf16Library(CLibrary):
    """The kernel built with ``march`` (compiler target flags, e.g. ``["-march=x86-64-v3"]``). Math flags as the
    fused element-wise kernels (attention/csrc/cpu_ops.c), so the SiLU epilogue of mode 2 rounds alike."""

    def __init__(self, march: Sequence[str] = ("-march=native",), name: str = "pagedllm_dpbf16") -> None:
        super().__init__(name, [os.path.join(_CSRC, "dpbf16_linear.c")],
                         ["-O3", *march, "-ffast-math", "-fno-finite-math-only", "-fopenmp"], _declare,
                         headers=[os.path.join(_ATTN_C, "simd.h"), os.path.join(_ATTN_C, "bf16.h")])

    def level(self) -> Optional[str]:
        """``"avx512_bf16"``, ``"avx2"`` or ``"scalar"``: the path compiled in; None when the library didn't build."""
        lib = self.get()
        return None if lib is None else LEVELS[lib.dpbf16_supported()]


_LIB = DpBf16Library()


def dpbf16_lib() -> Optional[DpBf16Library]:
    """The kernel for this CPU, or None (no compiler, or ``PAGEDLLM_CPU_KERNELS=0``). Built once."""
    return _LIB if _LIB.get() is not None else None
