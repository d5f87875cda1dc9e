"""Builds (once, with the system C compiler) and loads ``csrc/int4_cpu.c``: the batched int4 / int8 matmuls and
the int4 weight expansion. Cached under ``<cache_dir>/kernels/`` keyed by source, flags and machine, as the attention
kernel. ``PAGEDLLM_CPU_KERNELS=0`` or a failed build: the torch paths are used (one warning)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "int4_cpu.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False


def _build() -> ctypes.CDLL:
    from pagedllm.model_files import cache_dir

    src = open(_SRC, "rb").read()
    key = hashlib.sha256(src + " ".join(_FLAGS).encode() + platform.node().encode()
                         + platform.processor().encode()).hexdigest()[:16]
    out_dir = os.path.join(str(cache_dir()), "kernels")
    os.makedirs(out_dir, exist_ok=True)
    so = os.path.join(out_dir, f"int4_cpu-{key}.so")
    if not os.path.exists(so):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        res = subprocess.run([os.environ.get("CC", "gcc"), *_FLAGS, _SRC, "-o", tmp], capture_output=True, text=True)
        if res.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(res.stderr[-2000:])
        os.replace(tmp, so)
    lib = ctypes.CDLL(so)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.int4_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.int4_expand.argtypes = [ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.int8_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.int4_gemm.restype = lib.int4_expand.restype = lib.int8_gemm.restype = None
    return lib


def get_lib() -> Optional[ctypes.CDLL]:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") != "0":
                    try:
                        _lib = _build()
                    except Exception as e:
                        logger.warning("CPU int4 kernels unavailable (%s); using the torch paths.", e)
                _tried = True
    return _lib


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
              n_out: int) -> torch.Tensor:
    """``x [M, K]`` (bf16 / float32, contiguous) @ w.T -> ``[M, n_out]``."""
    lib = get_lib()
    m, k = x.shape
    out = torch.empty(m, n_out, dtype=x.dtype)
    lib.int4_gemm(x.data_ptr(), m, k, packed.data_ptr(), scales_and_zeros.data_ptr(), group_size,
                  packed.shape[0], n_out, out.data_ptr(), int(x.dtype == torch.bfloat16))
    return out


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
    lib = get_lib()
    m, k = x.shape
    out = torch.empty(m, q.shape[0], dtype=x.dtype)
    lib.int8_gemm(x.data_ptr(), m, k, q.data_ptr(), scale.data_ptr(), q.shape[0], out.data_ptr(),
                  int(x.dtype == torch.bfloat16))
    return out
