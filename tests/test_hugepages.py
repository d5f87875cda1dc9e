"""``zeroed_mapping``: zeroed, separate, writable tensors in one untouched mapping (advised for transparent huge pages
when asked); the weight arena's huge-page chunks."""

import dataclasses
import gc
import mmap
import subprocess
import sys

import pytest
import torch

from pagedllm import kernels
from pagedllm.utils.hugepages import HUGE_PAGE, WeightArena, weight_arena, weight_empty, zeroed_mapping


def _hugepages(on: bool):
    return kernels.use(dataclasses.replace(kernels.config(), hugepages=on))


def _mapping(addr: int) -> str:
    """The /proc/self/smaps entry (header line to VmFlags) of the mapping of this process holding ``addr``."""
    found = []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = [line] if lo <= addr < hi else []
            elif found:
                found.append(line)
                if head == "VmFlags:":
                    return "".join(found)
    return ""


def _vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping of this process holding ``addr`` (from /proc/self/smaps)."""
    entry = _mapping(addr)
    return entry.splitlines()[-1].split()[1:] if entry else []


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_zeroed_mapping_tensors_are_separate_zeroed_and_advised():
    shapes = [(3, 1000, 7), (5,), (2, HUGE_PAGE // 2)]
    with _hugepages(True):
        ts = zeroed_mapping(shapes, torch.bfloat16)
    assert [tuple(t.shape) for t in ts] == shapes and all(t.dtype == torch.bfloat16 for t in ts)
    assert all(bool((t == 0).all()) for t in ts)
    assert all(t.data_ptr() % 4096 == 0 for t in ts)
    assert ts[0].data_ptr() % HUGE_PAGE == 0  # the arena starts on a huge page
    for i, t in enumerate(ts):  # writes land in each tensor only
        t.fill_(i + 1)
    assert [int(t.float().sum()) for t in ts] == [(i + 1) * t.numel() for i, t in enumerate(ts)]
    assert "hg" in _vm_flags(ts[2].data_ptr())  # madvise(MADV_HUGEPAGE) was applied to the mapping
    keep = ts[1]
    del ts
    gc.collect()
    assert bool((keep == 2).all())  # the mapping lives as long as any of its tensors
    with _hugepages(False):
        (plain,) = zeroed_mapping([(HUGE_PAGE,)], torch.float32)
    # without huge pages: a plain private mapping of exactly the tensor's bytes
    assert plain.untyped_storage().nbytes() == 4 * HUGE_PAGE and bool((plain == 0).all())


def test_engine_kv_caches_share_one_advised_mapping():
    """With ``hugepages`` on (PAGEDLLM_HUGEPAGES=1) the KV caches of all layers come from one huge-page-advised
    mapping."""
    from pagedllm.worker.model_runner import allocate_kv_caches

    with _hugepages(True):
        caches = allocate_kv_caches([(2, 64)] * 3, 256, 16, torch.bfloat16)
    assert len({c.untyped_storage().data_ptr() for c in caches}) == 1  # one mapping
    assert all(c.shape == (2, 256, 16, 2, 64) and bool((c == 0).all()) for c in caches)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" in _vm_flags(caches[-1].data_ptr())



@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_weight_arena_carves_separate_aligned_tensors_from_advised_chunks():
    arena = WeightArena(chunk_bytes=4 * HUGE_PAGE)
    sizes = [100, 1, 4096, 3 * HUGE_PAGE, 5 * HUGE_PAGE, 77]  # the 5-huge-page one is larger than a chunk
    ts = [arena.empty(n) for n in sizes]
    assert [t.numel() for t in ts] == sizes and all(t.dtype == torch.uint8 for t in ts)
    assert all(t.data_ptr() % 64 == 0 for t in ts)
    assert ts[0].data_ptr() % HUGE_PAGE == 0  # a chunk starts on a huge page
    assert ts[4].data_ptr() % HUGE_PAGE == 0  # so does a mapping of its own
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in ts)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    assert all("hg" in _vm_flags(t.data_ptr()) for t in ts)
    for i, t in enumerate(ts):
        t.fill_(i + 1)
    assert [int(t.sum()) for t in ts] == [(i + 1) * n for i, n in enumerate(sizes)]
    keep = ts[1]
    del ts, arena
    gc.collect()
    assert int(keep) == 2  # a chunk lives as long as any tensor carved from it


def test_weight_empty_uses_the_arena_only_inside_weight_arena_and_when_on():
    on = dataclasses.replace(kernels.config(), weight_hugepages=True)
    with kernels.use(on), weight_arena() as arena:
        t = weight_empty(1000)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: carved from an advised chunk
        assert arena is not None and "hg" in _vm_flags(t.data_ptr())
        assert t.untyped_storage().nbytes() > 1000  # a view of the arena's chunk
    else:
        assert arena is None
    with kernels.use(dataclasses.replace(on, weight_hugepages=False)), weight_arena() as arena:
        assert arena is None
        plain = weight_empty(3 * HUGE_PAGE)
    outside = weight_empty(3 * HUGE_PAGE)  # no arena active: torch.empty
    # torch.empty's own storage, not a view of an advised mapping. (Not "no hg flag on its mapping": once the engine
    # has set glibc's thresholds (utils/malloc.py), such a block comes from the heap, and the full suite has seen
    # the heap's mapping flagged hg on a Zen 4 VM, from outside this module.)
    for x in (plain, outside):
        assert x.numel() == 3 * HUGE_PAGE and x.untyped_storage().nbytes() == 3 * HUGE_PAGE, _mapping(x.data_ptr())


_HEAP_PROBE = r"""
import sys, torch
from pagedllm.utils.malloc import keep_step_memory

def on_heap(t):
    a = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= a < hi:
                return line.rstrip().endswith("[heap]")
    return False

n = 40 << 20
before = on_heap(torch.empty(n, dtype=torch.uint8))
ok = keep_step_memory()
after = on_heap(torch.empty(n, dtype=torch.uint8))
print(int(before), int(ok), int(after))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt (Linux)")
def test_keep_step_memory_serves_a_step_s_large_blocks_from_the_heap():
    """``keep_step_memory`` (``pagedllm.utils.malloc``): a 40 MiB block, a fresh ``mmap`` under glibc's defaults (its
    pages faulted in and zeroed again on every step), comes from the heap once the thresholds are set. In a fresh
    interpreter, as the engine sets them once per process."""
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, ok, after = (int(x) for x in out.stdout.split()[-3:])
    if not ok:
        pytest.skip("this C library has no mallopt (not glibc)")
    assert (before, after) == (0, 1)


def test_engine_sets_the_malloc_thresholds_unless_switched_off(monkeypatch, tmp_path):
    """The model runner calls ``keep_step_memory`` once it is built, unless ``KernelConfig.malloc_keep`` is off
    (``PAGEDLLM_MALLOC_KEEP=0``)."""
    transformers = pytest.importorskip("transformers")
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.kernels.config import KernelConfig
    from pagedllm.worker import model_runner

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    calls = []
    monkeypatch.setattr(model_runner, "keep_step_memory", lambda: calls.append(1) or True)
    for env, want in (("1", [1]), ("0", [])):
        monkeypatch.setenv("PAGEDLLM_MALLOC_KEEP", env)
        assert KernelConfig.from_env().malloc_keep == (env == "1")
        calls.clear()
        LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_model_len=64, block_size=4,
            kv_cache_memory_bytes=1 << 20)
        assert calls == want, env


def _rss_kb(addr: int) -> int:
    """Resident kB of the mapping of this process holding ``addr`` (its smaps ``Rss:`` line)."""
    for line in _mapping(addr).splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError("no Rss line")


@pytest.mark.parametrize("huge", [False, True])
def test_kv_caches_become_resident_only_as_they_are_written(huge):
    """The KV caches are one untouched anonymous mapping: nothing of it is resident after allocation (start-up
    doesn't fault in the budget), a written block costs its pages only, and the caches read as zeros."""
    from pagedllm.worker.model_runner import allocate_kv_caches

    with _hugepages(huge):
        caches = allocate_kv_caches([(4, 128)] * 4, 2048, 16, torch.bfloat16)  # 4 x 64 MiB
    nbytes = sum(c.numel() * c.element_size() for c in caches)
    assert nbytes == 256 << 20 and len({c.untyped_storage().data_ptr() for c in caches}) == 1
    assert _rss_kb(caches[0].data_ptr()) == 0
    caches[1][:, 7].fill_(1.0)  # one block of one layer: K and V, 2 x 16 KiB
    assert 0 < _rss_kb(caches[0].data_ptr()) * 1024 <= 2 * HUGE_PAGE + 64 * 1024
    assert bool((caches[1][:, 7] == 1).all()) and float(caches[1].float().abs().sum()) == 2 * 16 * 4 * 128
    assert all(bool((c == 0).all()) for i, c in enumerate(caches) if i != 1)


def test_kv_cache_larger_than_available_memory_is_refused(monkeypatch):
    from pagedllm.worker import model_runner

    monkeypatch.setattr(model_runner, "_mem_available_bytes", lambda: 100 << 20)
    with pytest.raises(ValueError, match="kv-cache-memory-bytes"):
        model_runner.allocate_kv_caches([(4, 128)] * 4, 2048, 16, torch.bfloat16)  # 256 MiB
    assert len(model_runner.allocate_kv_caches([(4, 128)] * 4, 512, 16, torch.bfloat16)) == 4  # 64 MiB fits


def test_kv_caches_are_private_memory():
    """The KV caches' mapping is private anonymous memory (as malloc's), not shared memory (Python's plain
    ``mmap(-1, n)`` maps shmem, which a forked child would share): smaps shows it without the shared flag and
    without the ``/dev/zero`` backing of a shared anonymous mapping."""
    from pagedllm.worker.model_runner import allocate_kv_caches

    with _hugepages(False):
        (cache,) = allocate_kv_caches([(1, 64)], 64, 16, torch.float32)
    cache[0, 0].fill_(1.0)
    entry = _mapping(cache.data_ptr())
    assert entry and "sh" not in _vm_flags(cache.data_ptr()) and "/dev/zero" not in entry.splitlines()[0]
    assert float(cache.sum()) == 16 * 64
