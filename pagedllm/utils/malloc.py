"""glibc malloc thresholds for the engine's steps (``mallopt(3)``), set once the model and KV caches are in memory.

Why: a step's activations are a few large tensors per layer (an int4 gate_up output of a 2,048-token prefill step is
12 MiB), each a new ``malloc`` of a size glibc serves from fresh ``mmap`` pages or from a heap top it has just given
back (``M_TRIM_THRESHOLD``): either way, pages the kernel must fault in and zero on first touch, every step. With
blocks up to ``MMAP_THRESHOLD`` served from the heap and up to ``TRIM_THRESHOLD`` of freed heap kept, a step reuses the
memory the previous one freed. Measured (SmolLM2 int4, 64 x 360-token prompts, prefill only, Xeon with AMX, 2
threads, interleaved): 10.4-11.0 -> 9.2-9.4 s for two passes. Set after load, so the loader's large temporaries are
still handed back to the OS as before; what is kept is bounded by a step's peak working set (and at most
``TRIM_THRESHOLD`` of free heap). ``KernelConfig.malloc_keep`` (``PAGEDLLM_MALLOC_KEEP=0`` leaves glibc's defaults).
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20  # bytes: smaller blocks come from the heap
TRIM_THRESHOLD = 256 << 20  # bytes of free memory at the heap's top kept before it is returned to the OS


def keep_step_memory() -> bool:
    """Sets the two thresholds in this process; False (nothing changed) where the C library has no ``mallopt``
    (not Linux, or not glibc) or refuses them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
