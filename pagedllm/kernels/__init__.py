"""pagedllm's kernels wing: every C source (``csrc/``), their build (``build``), the binding table (``bindings``),
ISA levels and the ``KernelConfig`` (``config``). The only package that builds or loads native code.

The process runs one active ``KernelConfig`` (``config()``): resolved from the environment on first use, or set at
engine start-up from ``EngineConfig.kernel`` (``set_config``); ``use(cfg)`` switches it for a block (tests).
The configuration is per process (an engine's start-up sets it; one engine per process in production, and the
test suite restores it after each test). ``lib(name)`` is the named library for the active level (built and bound on first use), or None where it must not
or cannot run: level ``none`` / ``cpu_kernels`` off, a library not built for the level, no compiler (one warning),
or, for ``amx``, the OS refusing the tile state. Wrappers in attention/, layers/, models/ call it and fall back to
torch on None.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from typing import Iterator, Optional

from pagedllm.kernels.bindings import LIBRARIES
from pagedllm.kernels.config import (LEVELS, KernelConfig, check_level, cpu_flags, detect_level, level_at_least,
                                     level_environ, supported_levels)

__all__ = ["LEVELS", "KernelConfig", "check_level", "config", "cpu_flags", "detect_level", "level_at_least",
           "level_environ", "lib", "load", "set_config", "set_value", "supported_levels", "use"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded: dict[tuple, Optional[ctypes.CDLL]] = {}
_active: Optional[KernelConfig] = None
_active_libs: dict[str, Optional[ctypes.CDLL]] = {}
_logged: set = set()


def load(name: str, level: str, defines: tuple[str, ...] = ()) -> Optional[ctypes.CDLL]:
    """Library ``name`` (a key of ``bindings.LIBRARIES``) built for ``level`` (with the ``-D`` flags ``defines``: a
    configured variant, see ``lib``) and bound, or None: not built for that level, build failed (one warning), or
    (``amx``) no tile state. Cached per (name, level, defines)."""
    key = (name, level, defines)
    if key in _loaded:
        return _loaded[key]
    with _lock:
        if key not in _loaded:
            _loaded[key] = _load(name, level, defines)
    return _loaded[key]


def load_target(name: str, tag: str, march: list[str]) -> Optional[ctypes.CDLL]:
    """Library ``name`` built with other target flags (e.g. ``["-march=x86-64"]``: a scalar build), bound; for tests
    of the paths below every level. Cached per (name, tag)."""
    key = (name, "target:" + tag)
    if key not in _loaded:
        with _lock:
            _loaded[key] = _bind(name, tag, march)
    return _loaded[key]


def _load(name: str, level: str, defines: tuple[str, ...] = ()) -> Optional[ctypes.CDLL]:
    spec = LIBRARIES[name]
    if level not in spec.levels or not level_at_least(detect_level(), level):
        return None
    return _bind(name, level, None, defines)


def _bind(name: str, level: str, march: Optional[list], defines: tuple[str, ...] = ()) -> Optional[ctypes.CDLL]:
    spec = LIBRARIES[name]
    from pagedllm.kernels.build import build

    try:
        lib = ctypes.CDLL(build(spec, level, march, defines))
    except Exception as e:  # no compiler, or a build error: the torch paths are used
        logger.warning("CPU kernels %r (level %s) unavailable (%s); using the torch paths.", name, level, e)
        return None
    for fname, fn in spec.functions.items():
        if fn.optional and not hasattr(lib, fname):
            continue
        f = getattr(lib, fname)
        f.argtypes, f.restype = list(fn.argtypes), fn.restype
    if name == "amx" and not lib.amx_supported():  # Linux refused this process the AMX tile state
        logger.warning("AMX kernels unavailable: the OS did not grant the AMX tile state.")
        return None
    if name == "dpbf16" and march is None and lib.dpbf16_supported() == 2:
        rows = lib.dpbf16_tune()  # a speed choice only: both paths give the same bits (checked in the call)
        logger.info("dpbf16 linear (%s): %s", level, f"FMA path from {rows} rows (VDPBF16PS's bits, faster here)"
                    if rows else "VDPBF16PS at every size")
    return lib


def config() -> KernelConfig:
    """The active ``KernelConfig`` (resolved from the environment on first use)."""
    global _active
    if _active is None:
        set_config(KernelConfig.from_env())
    return _active


def set_config(cfg: KernelConfig) -> None:
    """Makes ``cfg`` the process's kernel configuration (engine start-up; logged once per distinct config)."""
    global _active
    if cfg != _active:
        _active = cfg
        _active_libs.clear()
        if cfg not in _logged:
            _logged.add(cfg)
            logger.info("CPU kernels: %s", cfg.describe())


@contextlib.contextmanager
def use(cfg: KernelConfig) -> Iterator[KernelConfig]:
    """Runs the block with ``cfg`` active, then restores the previous configuration."""
    prev = config()
    set_config(cfg)
    try:
        yield cfg
    finally:
        set_config(prev)


def lib(name: str) -> Optional[ctypes.CDLL]:
    """Library ``name`` for the active configuration, or None (see the module docstring). Hot path: a dict hit."""
    try:
        return _active_libs[name]
    except KeyError:
        pass
    cfg = config()
    found = None
    if cfg.native and (name != "amx" or cfg.amx):
        found = load(name, cfg.level, _defines(name, cfg))
        if found is not None:
            for setter, value in _settings(name, cfg):
                set_value(found, setter, value)
    _active_libs[name] = found
    return found


def _defines(name: str, cfg: KernelConfig) -> tuple[str, ...]:
    """The ``-D`` flags of library ``name``'s build for ``cfg``: choices compiled in, where a runtime switch in the
    hot loop cost more than the choice gained (the K-quant integer kernel's prefill, compute-bound, ran 1.3x slower
    with a branch on the prefetch hint beside each weight prefetch; kernels/csrc/prefetch.h)."""
    if name in ("int4", "kquant") and cfg.weight_prefetch_nta:
        return ("-DWEIGHT_PREFETCH_NTA=1",)
    return ()


def _settings(name: str, cfg: KernelConfig) -> tuple[tuple[str, int], ...]:
    """The library-wide settings ``lib`` gives library ``name`` from the active config, (setter, value) each: applied
    whenever a config becomes active (``set_config`` empties the lookup cache)."""
    return {"int4": (("int4_set_prefetch_bytes", cfg.int4_prefetch),),
            "kquant": (("kq_set_prefetch_bytes", cfg.kquant_prefetch),)}.get(name, ())


_given: dict[tuple[int, str], int] = {}  # (id(library), setter) -> the value it was given


def set_value(library: ctypes.CDLL, setter: str, value: int) -> None:
    """Calls ``library.<setter>(value)`` (a library-wide setting taken from the ``KernelConfig``, e.g. a prefetch
    distance) unless that library already has ``value``: ``lib`` calls it for each of ``_settings`` whenever a config
    becomes active, and configs that differ elsewhere share the same build."""
    key = (id(library), setter)
    if _given.get(key) != value:
        getattr(library, setter)(value)
        _given[key] = value
