"""The one build step: compiles a ``bindings.Library`` for one ISA level with the system C compiler, cached.

The library is cached as ``<cache_dir>/kernels/<name>-<level>-<key>.so``; ``key`` hashes everything the object code
depends on: the CPU's flags (``/proc/cpuinfo``: the level's optional flags, ``-mtune=native``), the compiler
command line, the compiler's identity (``$CC --version``), and every source and every header it includes
(followed recursively). So an edit, another compiler or another CPU builds anew, and a library is never loaded on a
CPU it wasn't built for. Each level is its own file, so one process can hold several levels (tests).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from functools import lru_cache
from typing import Optional

from pagedllm import envs
from pagedllm.kernels.bindings import Library
from pagedllm.kernels.config import cpu_flags
from pagedllm.utils.atomic import atomic_path

CSRC = os.path.join(os.path.dirname(__file__), "csrc")

# Per level: the target (-march) and the extensions added where the CPU has them (cpuinfo flag -> gcc flag).
_LEVEL_MARCH = {
    "amx": ["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16"],
    "avx2": ["-march=x86-64-v3"],
}
_LEVEL_OPTIONAL = {
    "amx": {"avx512_vnni": "-mavx512vnni", "avx512vbmi": "-mavx512vbmi", "amx_int8": "-mamx-int8"},
    "avx512_bf16": {"avx512_vnni": "-mavx512vnni", "avx512vbmi": "-mavx512vbmi"},
    "avx2": {"avx_vnni": "-mavxvnni"},
}


def level_flags(level: str, flags: frozenset | None = None) -> list[str]:
    """The compiler flags that select ``level``'s instructions on a CPU with ``flags`` (default: this one).

    e.g. Zen 4 at avx512_bf16: ``-march=x86-64-v4 -mavx512bf16 -mavx512vnni -mavx512vbmi -mtune=native``; at avx2:
    ``-march=x86-64-v3 -mtune=native`` (no AVX-512 instruction can be emitted)."""
    flags = cpu_flags() if flags is None else flags
    opt = [f for cpu, f in _LEVEL_OPTIONAL[level].items() if cpu in flags]
    return [*_LEVEL_MARCH[level], *opt, "-mtune=native"]


@lru_cache(maxsize=None)
def compiler_identity(cc: str) -> str:
    """``$CC --version``'s first line and target (e.g. ``gcc (Debian 12.2.0-14) 12.2.0 x86_64-linux-gnu``)."""
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()
        target = subprocess.run([cc, "-dumpmachine"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"no C compiler {cc!r} ({e})") from e
    return f"{ver[0] if ver else cc} {target}"


_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.M)


def source_closure(sources: list[str]) -> list[str]:
    """``sources`` and every header they include with ``#include "..."`` (recursively), as sorted paths."""
    seen: set[str] = set()
    todo = list(sources)
    while todo:
        path = os.path.normpath(todo.pop())
        if path in seen:
            continue
        seen.add(path)
        with open(path, "rb") as f:
            for inc in _INCLUDE.findall(f.read()):
                todo.append(os.path.join(os.path.dirname(path), inc.decode()))
    return sorted(seen)


def command(lib: Library, level: str, march: Optional[list[str]] = None, defines: tuple[str, ...] = ()) -> list[str]:
    """The compiler command for ``lib`` at ``level`` (``march``: other target flags instead, for tests; ``defines``:
    ``-D`` flags of a configured variant, see ``kernels.lib``)."""
    cc = envs.get("CC") or "gcc"
    srcs = [os.path.join(CSRC, s) for s in lib.sources]
    return [cc, *lib.flags, *(level_flags(level) if march is None else march), *defines, "-shared", "-fPIC", *srcs,
            "-lm"]


def cache_key(lib: Library, level: str, march: Optional[list[str]] = None, defines: tuple[str, ...] = ()) -> str:
    cmd = command(lib, level, march, defines)
    h = hashlib.sha256()
    h.update("\0".join(os.path.basename(a) if a.endswith(".c") else a for a in cmd).encode())  # not the install path
    h.update(compiler_identity(cmd[0]).encode())
    h.update(" ".join(sorted(cpu_flags())).encode())
    for path in source_closure([os.path.join(CSRC, s) for s in lib.sources]):
        h.update(os.path.basename(path).encode() + b"\0" + open(path, "rb").read())
    return h.hexdigest()[:16]


def build(lib: Library, level: str, march: Optional[list[str]] = None, defines: tuple[str, ...] = ()) -> str:
    """Path of ``lib`` compiled for ``level`` (built now unless cached; ``march``: other target flags, ``level`` then
    only names the file; ``defines``: -D flags). Raises ``RuntimeError`` with the compiler's message on a failed
    build."""
    import torch  # noqa: F401  (torch's libgomp is loaded first, so OpenMP kernels share its runtime)

    from pagedllm.model_files import cache_dir

    out_dir = os.path.join(str(cache_dir()), "kernels")
    os.makedirs(out_dir, exist_ok=True)
    so = os.path.join(out_dir, f"{lib.name}-{level}-{cache_key(lib, level, march, defines)}.so")
    if not os.path.exists(so):
        with atomic_path(so, suffix=".so", shared=False) as tmp:  # concurrent builders never load a half-written file
            res = subprocess.run([*command(lib, level, march, defines), "-o", tmp], capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(res.stderr[-2000:])
    return so
