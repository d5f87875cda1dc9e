"""The K-quant tile cache (``pagedllm/layers/quantization/tile_cache.py``): a GGUF's tiles written at its first load
and mapped at the next, byte for byte what packing gives; a bad, stale or unwritable cache never fails a load."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagedllm import kernels
from pagedllm.layers.quantization import tile_cache
from pagedllm.layers.quantization.kquant import get_lib

pytestmark = pytest.mark.skipif(get_lib() is None, reason="no K-quant kernels at this ISA level (none)")

# every K-quant kernel type; q / k are permuted by llama.cpp (their rows move at load: never cached)
QTYPES = {"embed_tokens": Q.Q8_0, "q_proj": Q.Q8_0, "k_proj": Q.Q5_0, "v_proj": Q.Q8_0, "o_proj": Q.Q6_K,
          "gate_proj": Q.Q8_0, "up_proj": Q.Q5_0, "down_proj": Q.Q6_K, "lm_head": Q.Q6_K}
PROMPTS = [[5, 6, 7], list(range(10, 60))]


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    import test_loader
    from test_quantization import _tiny_hf

    monkeypatch.setattr(test_loader, "_QTYPES", QTYPES)
    monkeypatch.setattr(tile_cache, "MIN_BYTES", 0)  # the tiny model's tensors are far below the real threshold
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    cfg, hf = _tiny_hf()
    path = str(tmp_path / "tiny.gguf")
    test_loader._write_gguf(path, "llama", cfg, hf.state_dict())
    return path


def _load(path: str, cache: bool = True):
    from test_quantization import _load as load

    with kernels.use(dataclasses.replace(kernels.config(), kquant_tile_cache=cache)):
        return load(path, None)


def _tiles(model) -> dict:
    """{(module, part): tiled tensor} of every K-quant module."""
    out = {}
    for name, m in model.quant_modules.items():
        assert m.kind == "kquant", (name, m.kind)
        for i, w in enumerate(m._kq if isinstance(m._kq, list) else [m._kq]):
            out[(name, i)] = w.data
    return out


def _mapped_file(t: torch.Tensor) -> str:
    """The file mapped where ``t``'s data lies ('' for anonymous memory)."""
    a = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= a < hi:
                return parts[5] if len(parts) > 5 else ""
    raise AssertionError("address not mapped")


def _files(path: str) -> list[str]:
    folder = tile_cache.gguf_span(path).folder
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_second_load_maps_the_first_loads_tiles(tiny_gguf):
    from test_quantization import _assert_same_greedy

    packed = _load(tiny_gguf, cache=False)
    assert _files(tiny_gguf) == []  # off: nothing written
    first = _load(tiny_gguf)
    (name,) = _files(tiny_gguf)
    file = os.path.join(tile_cache.gguf_span(tiny_gguf).folder, name)
    second = _load(tiny_gguf)
    want, got1, got2 = _tiles(packed), _tiles(first), _tiles(second)
    assert want.keys() == got1.keys() == got2.keys()
    mapped = set()
    for key in want:
        assert torch.equal(got1[key], want[key]) and torch.equal(got2[key], want[key]), key
        assert _mapped_file(got1[key]) != file  # the first load packed into its own memory
        if _mapped_file(got2[key]) == file:
            mapped.add(key)
    # every tensor but q and k (part 0 / 1 of qkv_proj: rows permuted at load) came from the file
    assert mapped == {k for k in want if not (k[0].endswith("qkv_proj") and k[1] < 2)}, sorted(mapped)
    _assert_same_greedy(second, packed, PROMPTS)


def test_bad_stale_or_unwritable_caches_never_fail_a_load(tiny_gguf, tmp_path, monkeypatch):
    want = _tiles(_load(tiny_gguf, cache=False))
    _load(tiny_gguf)
    (name,) = _files(tiny_gguf)
    file = os.path.join(tile_cache.gguf_span(tiny_gguf).folder, name)
    size = os.path.getsize(file)
    for damage in ("truncated", "footer", "index"):
        with open(file, "r+b") as f:
            if damage == "truncated":
                f.truncate(size - 10)
            elif damage == "footer":  # the magic
                f.seek(size - 24)
                f.write(b"NOTTILES")
            else:  # an entry pointing past the tiles
                f.seek(size - 24 - 48 + 40)
                f.write((1 << 40).to_bytes(8, "little"))
        got = _tiles(_load(tiny_gguf))  # packed again, and the file written whole again
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert _files(tiny_gguf) == [name] and os.path.getsize(file) == size
        with open(file, "rb") as f:
            assert tile_cache._read_index(f.fileno())
    # the GGUF rewritten (a new mtime): a new file, the old one deleted at the write
    st = os.stat(tiny_gguf)
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    got = _tiles(_load(tiny_gguf))
    assert all(torch.equal(got[k], want[k]) for k in want)
    (new,) = _files(tiny_gguf)
    assert new != name
    # a cache folder that can't be made (a file in its way): loads as without the cache, writes nothing
    blocked = tmp_path / "blocked"
    blocked.write_text("not a folder")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(blocked))
    got = _tiles(_load(tiny_gguf))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert blocked.read_text() == "not a folder"


def test_small_tensors_are_not_cached(tiny_gguf, monkeypatch):
    monkeypatch.setattr(tile_cache, "MIN_BYTES", 1 << 20)  # the default: every tiny tensor is below it
    _load(tiny_gguf)
    assert _files(tiny_gguf) == []
