"""Builds a C shared library once with the system compiler and loads it with ctypes (pagedllm's CPU kernels).

The library is cached under ``<cache_dir>/kernels/<name>-<key>.so``, ``key`` hashing the sources (and headers),
the compiler flags and the machine, so an edit or another CPU rebuilds it. ``PAGEDLLM_CPU_KERNELS=0`` disables
every such library; a failed build logs one warning and the callers use their torch paths.
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
from typing import Callable, Optional, Sequence

logger = logging.getLogger(__name__)


class CLibrary:
    """``get()`` -> the loaded ``ctypes.CDLL`` (built on first use, thread-safe), or None if disabled or unbuildable.

    Args:
        name: file stem of the cached library and the name in the warning.
        sources: C files compiled together; ``headers``: files they include (only hashed).
        flags: compiler flags (``-shared -fPIC`` are added).
        declare: sets ``argtypes``/``restype`` on the loaded library.
    """

    def __init__(self, name: str, sources: Sequence[str], flags: Sequence[str],
                 declare: Callable[[ctypes.CDLL], None], headers: Sequence[str] = ()) -> None:
        self.name, self.sources, self.headers = name, list(sources), list(headers)
        self.flags = [*flags, "-shared", "-fPIC"]
        self.declare = declare
        self._lock = threading.Lock()
        self._lib: Optional[ctypes.CDLL] = None
        self._tried = False

    def _build(self) -> ctypes.CDLL:
        import torch  # noqa: F401  (torch's libgomp is loaded first, so OpenMP kernels share its runtime)

        from pagedllm.model_files import cache_dir

        src = b"".join(open(f, "rb").read() for f in self.sources + self.headers)
        key = hashlib.sha256(src + " ".join(self.flags).encode() + platform.node().encode()
                             + platform.processor().encode()).hexdigest()[:16]
        out_dir = os.path.join(str(cache_dir()), "kernels")
        os.makedirs(out_dir, exist_ok=True)
        so = os.path.join(out_dir, f"{self.name}-{key}.so")
        if not os.path.exists(so):
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
            os.close(fd)
            res = subprocess.run([os.environ.get("CC", "gcc"), *self.flags, *self.sources, "-o", tmp, "-lm"],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                os.unlink(tmp)
                raise RuntimeError(res.stderr[-2000:])
            os.replace(tmp, so)  # atomic: concurrent builders never load a half-written file
        lib = ctypes.CDLL(so)
        self.declare(lib)
        return lib

    def get(self) -> Optional[ctypes.CDLL]:
        if self._tried:
            return self._lib
        with self._lock:
            if not self._tried:
                if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") != "0":
                    try:
                        self._lib = self._build()
                    except Exception as e:  # no compiler, or a build error: the torch paths are used
                        logger.warning("CPU kernels %r unavailable (%s); using the torch paths.", self.name, e)
                        self._lib = None
                self._tried = True
        return self._lib
