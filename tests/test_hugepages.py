"""``zeros_in_hugepages``: zeroed, separate, writable tensors in one mapping advised for transparent huge pages."""

import dataclasses
import gc
import mmap

import pytest
import torch

from pagedllm import kernels
from pagedllm.utils.hugepages import HUGE_PAGE, zeros_in_hugepages


def _hugepages(on: bool):
    return kernels.use(dataclasses.replace(kernels.config(), hugepages=on))


def _vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping of this process holding ``addr`` (from /proc/self/smaps)."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= addr < hi
            elif found and head == "VmFlags:":
                return line.split()[1:]
    return []


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_zeros_in_hugepages_are_separate_zeroed_and_advised():
    shapes = [(3, 1000, 7), (5,), (2, HUGE_PAGE // 2)]
    with _hugepages(True):
        ts = zeros_in_hugepages(shapes, torch.bfloat16)
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
        (plain,) = zeros_in_hugepages([(HUGE_PAGE,)], torch.float32)
    assert "hg" not in _vm_flags(plain.data_ptr()) and bool((plain == 0).all())


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

