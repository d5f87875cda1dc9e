"""Builds (once, with the system C compiler) and loads the CPU paged-attention decode kernel.

The C source is ``csrc/paged_decode.c``; the shared library is cached under ``<cache_dir>/kernels/`` keyed by the
source hash, compiler flags and machine. Set ``PAGEDLLM_CPU_KERNELS=0`` to use the pure-torch path instead; if the
build fails (no compiler), the torch path is used and one warning is logged.
"""

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

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.c")
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-shared", "-fPIC"]
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False


def _build() -> Optional[ctypes.CDLL]:
    import torch  # noqa: F401  (torch's libgomp is loaded first, so the kernel shares its OpenMP runtime)

    from pagedllm.model_files import cache_dir

    src = open(_SRC, "rb").read()
    key = hashlib.sha256(src + " ".join(_FLAGS).encode() + platform.node().encode()
                         + platform.processor().encode()).hexdigest()[:16]
    out_dir = os.path.join(str(cache_dir()), "kernels")
    os.makedirs(out_dir, exist_ok=True)
    so = os.path.join(out_dir, f"paged_decode-{key}.so")
    if not os.path.exists(so):
        cc = os.environ.get("CC", "gcc")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        res = subprocess.run([cc, *_FLAGS, _SRC, "-o", tmp, "-lm"], capture_output=True, text=True)
        if res.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(res.stderr[-2000:])
        os.replace(tmp, so)
    lib = ctypes.CDLL(so)
    argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5 + [
        ctypes.c_float, ctypes.c_int, ctypes.c_int64]
    for name in ("paged_decode_bf16", "paged_decode_f32"):
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = None
    return lib


def get_lib() -> Optional[ctypes.CDLL]:
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") != "0":
                try:
                    _lib = _build()
                except Exception as e:  # no compiler, or a build error: fall back to torch
                    logger.warning("CPU paged-attention kernel unavailable (%s); using the torch path.", e)
                    _lib = None
            _tried = True
    return _lib


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, rows: Optional[torch.Tensor], out: torch.Tensor, scale: float,
                 window: Optional[int]) -> bool:
    """Decode attention for ``n`` requests straight from the paged cache, into ``out`` (same layout as ``q``).

    Shapes: ``q/out [num_tokens, H, D]`` (``out`` contiguous; ``q`` may have a row stride); ``k_cache/v_cache [num_blocks, BS, KVH, D]`` contiguous;
    ``block_tables [n, max_blocks]`` int64; ``seq_lens [n]`` int64; ``rows [n]`` int64 (rows of q/out) or None
    (rows 0..n-1). Returns False (doing nothing) when the kernel can't run here (then use the torch path).
    """
    lib = get_lib()
    if lib is None or q.device.type != "cpu":
        return False
    if q.dtype == torch.bfloat16:
        fn = lib.paged_decode_bf16
    elif q.dtype == torch.float32:
        fn = lib.paged_decode_f32
    else:
        return False
    n = block_tables.shape[0]
    H, D = q.shape[1], q.shape[2]
    BS, KVH = k_cache.shape[1], k_cache.shape[2]
    if H // KVH > 64 or q.stride(2) != 1 or q.stride(1) != D or not (
            out.is_contiguous() and k_cache.is_contiguous()
                             and v_cache.is_contiguous() and block_tables.is_contiguous()):
        return False
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
       seq_lens.data_ptr(), rows.data_ptr() if rows is not None else None, out.data_ptr(), n, H, KVH, D, BS,
       float(scale), int(window or 0), q.stride(0))
    return True
