"""CPU tensors backed by transparent huge pages (2 MiB), for the KV caches.

Why: decode attention reads each request's KV blocks, wherever the block tables point. With 4 KiB pages that is a
TLB miss every few blocks, and in a VM each miss is a two-level (guest + host) page walk. Measured on this machine
(2 threads, interleaved): decode attention over 16 requests x 500 tokens x 30 layers with random block tables
12.5-12.9 -> 10.8-11.3 ms. In the engine, whose block tables are still mostly in allocation order, steps moved within
noise. So it is opt-in (``PAGEDLLM_HUGEPAGES=1``): with it on by default, a pipeline-parallel test once saw a
killed engine's surviving worker outlive SIGKILL by >10 s (not reproduced in 3 isolated runs of that test; cause
not traced).
Not used for the packed weights: in one huge-page arena a 16-request prefill wave's linears took 176-216
instead of 136 ms (interleaved; the cause not traced).

Linux hands out huge pages to anonymous memory only when it is ``madvise``'d (``/sys/kernel/mm/transparent_hugepage/
enabled`` is ``madvise`` on most distributions), and only for 2 MiB-aligned ranges, so the tensors are carved out of
one private anonymous mapping, aligned and advised before the first touch (``madvise(2)``, ``MADV_HUGEPAGE``). Where
that isn't available or wanted (not Linux, ``PAGEDLLM_HUGEPAGES`` not ``1``, or less than 2 MiB in all), plain
``torch.zeros`` is used.
"""

from __future__ import annotations

import math
import mmap
from typing import Sequence

import torch

HUGE_PAGE = 2 << 20  # bytes (x86-64 PMD size)
_ALIGN = 4096  # each tensor starts on a page (so a tensor never shares a cache line or a small page with another)


def _enabled() -> bool:
    from pagedllm import kernels

    return kernels.config().hugepages and hasattr(mmap, "MADV_HUGEPAGE")


def zeros_in_hugepages(shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed CPU tensors of the given shapes and ``dtype``, all in one huge-page-advised mapping (each one
    page-aligned); the mapping lives as long as any of them. Every page is touched now (as ``torch.zeros`` would),
    so no page fault lands inside a later step.

    Falls back to one ``torch.zeros`` per shape where huge pages can't be asked for.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(s) * elem for s in shapes]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    if not _enabled() or total < HUGE_PAGE:
        return [torch.zeros(tuple(s), dtype=dtype) for s in shapes]
    try:
        mm = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return [torch.zeros(tuple(s), dtype=dtype) for s in shapes]
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive
    start = (-raw.data_ptr()) % HUGE_PAGE
    try:
        # advise only the aligned part (madvise needs a page-aligned start; the kernel rounds to huge pages inside)
        mm.madvise(mmap.MADV_HUGEPAGE, start, total)
    except OSError:
        pass  # huge pages refused (e.g. THP disabled): still correct, with small pages
    arena = raw[start : start + total]
    arena.zero_()  # fresh anonymous memory is already zero; this only faults the pages in
    return [arena[o : o + n].view(dtype).view(tuple(s)) for o, n, s in zip(offsets, sizes, shapes)]
