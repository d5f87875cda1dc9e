"""CPU tensors in fresh anonymous mappings: the KV caches (zero pages faulted in on first write; advised for transparent
huge pages, 2 MiB, when opted in) and the GGUF K-quant weights (huge pages by default).

Why: decode attention reads each request's KV blocks, wherever the block tables point. With 4 KiB pages that is a
TLB miss every few blocks, and in a VM each miss is a two-level (guest + host) page walk. Measured on this machine
(2 threads, interleaved): decode attention over 16 requests x 500 tokens x 30 layers with random block tables
12.5-12.9 -> 10.8-11.3 ms. In the engine, whose block tables are still mostly in allocation order, steps moved within
noise. So it is opt-in (``PAGEDLLM_HUGEPAGES=1``): with it on by default, a pipeline-parallel test once saw a
killed engine's surviving worker outlive SIGKILL by >10 s (not reproduced in 3 isolated runs of that test; cause
not traced).
Not used for the packed bf16 weights: in one huge-page arena a 16-request prefill wave's linears took 176-216
instead of 136 ms (interleaved; the cause not traced).

The GGUF K-quant weights (``KQuantWeight.tiled``) are, by default (``KernelConfig.weight_hugepages``,
``PAGEDLLM_WEIGHT_HUGEPAGES``): a decode step streams every weight byte once, and with 4 KiB pages each page of a
stream starts with a TLB miss (a two-level walk in a VM) while the hardware prefetcher stops at every page edge.
Measured on the Xeon (AMX, 2 threads): Gemma-3-270M's tied Q8_0 LM head (178 MB) 6.7 -> 5.3 ms, its 18 layers'
126 matmuls (68 MB) 4.1 -> 3.55 ms; a plain read of 512 MB 25.7 -> 31.9 GB/s. They are carved by ``WeightArena``
(one per model load: ``weight_arena()``) out of big advised mappings, so the huge pages are not split per tensor.

Linux hands out huge pages to anonymous memory only when it is ``madvise``'d (``/sys/kernel/mm/transparent_hugepage/
enabled`` is ``madvise`` on most distributions), and only for 2 MiB-aligned ranges, so the tensors are carved out of
one private anonymous mapping, aligned and advised before the first touch (``madvise(2)``, ``MADV_HUGEPAGE``). Where
that isn't available or wanted (not Linux, ``PAGEDLLM_HUGEPAGES`` not ``1``, or less than 2 MiB in all), the KV
caches get a plain anonymous mapping (small pages, still untouched until written).
"""

from __future__ import annotations

import contextlib
import math
import mmap
from typing import Iterator, Optional, Sequence

import torch

HUGE_PAGE = 2 << 20  # bytes (x86-64 PMD size)
_ALIGN = 4096  # each tensor starts on a page (so a tensor never shares a cache line or a small page with another)


def _enabled() -> bool:
    from pagedllm import kernels

    return kernels.config().hugepages and hasattr(mmap, "MADV_HUGEPAGE")


def zeroed_mapping(shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed CPU tensors of the given shapes and ``dtype``, all in one fresh private anonymous mapping (each one
    page-aligned), advised for huge pages when ``KernelConfig.hugepages`` is on; the mapping lives as long as any of
    them.

    Nothing is touched here: the OS hands out a zeroed page at each page's first touch (``mmap(2)``: anonymous
    memory is zero-initialised), so the tensors read as zeros and only the pages written so far are resident. For
    the KV caches that means start-up doesn't fault in (and zero) the whole budget: Gemma-3-270M's default 2 GiB
    took ~1 s on 2 cores and made every server 2 GiB resident before its first request. The cost moves to the
    first write of each page (a fault and a 4 KiB or 2 MiB zeroing, once per page for the process's life).

    Falls back to one ``torch.zeros`` per shape where no anonymous mapping can be made.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(s) * elem for s in shapes]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    arena = None
    if total > 0:
        arena = advised_mapping(total) if _enabled() and total >= HUGE_PAGE else anonymous_mapping(total)
    if arena is None:
        return [torch.zeros(tuple(s), dtype=dtype) for s in shapes]
    return [arena[o : o + n].view(dtype).view(tuple(s)) for o, n, s in zip(offsets, sizes, shapes)]


def _private_anonymous(nbytes: int) -> Optional[mmap.mmap]:
    """A fresh private anonymous mapping of ``nbytes`` (zero pages, faulted in on first touch), as ``malloc``'s memory
    is (Python's ``mmap(-1, n)`` alone maps shared memory on Unix: shmem pages, shared with any child forked later);
    None where none can be made."""
    try:
        if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
            return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return mmap.mmap(-1, nbytes)  # Windows: anonymous memory of this process
    except (OSError, ValueError):
        return None


def anonymous_mapping(nbytes: int) -> Optional[torch.Tensor]:
    """``nbytes`` uint8 of a fresh private anonymous mapping (``_private_anonymous``), page-aligned; None where none
    can be made. Views keep the mapping alive."""
    mm = _private_anonymous(nbytes)
    return None if mm is None else torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive


def advised_mapping(nbytes: int) -> Optional[torch.Tensor]:
    """``nbytes`` uint8 of a fresh private anonymous mapping, starting on a huge page and advised for huge pages
    (``MADV_HUGEPAGE``); None where no such mapping can be made. Untouched; views keep the mapping alive."""
    mm = _private_anonymous(nbytes + HUGE_PAGE) if hasattr(mmap, "MADV_HUGEPAGE") else None
    if mm is None:
        return None
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive
    start = (-raw.data_ptr()) % HUGE_PAGE
    try:
        # advise only the aligned part (madvise needs a page-aligned start; the kernel rounds to huge pages inside)
        mm.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:
        pass  # huge pages refused (e.g. THP disabled): still correct, with small pages
    return raw[start : start + nbytes]


class WeightArena:
    """A bump allocator of byte tensors in huge-page-advised mappings (``chunk_bytes`` of address space each; a
    larger request gets a mapping of its own), for weights made once at load and kept for the model's life.

    Each tensor starts on a 64-byte line. Only touched pages become resident, so a chunk's unused tail costs
    address space only (at most one partly used 2 MiB page of memory). A chunk is unmapped once the arena and every
    tensor carved from it are gone. Falls back to ``torch.empty`` where no advised mapping can be made."""

    def __init__(self, chunk_bytes: int = 256 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: Optional[torch.Tensor] = None
        self._off = 0

    def empty(self, nbytes: int) -> torch.Tensor:
        """A new uint8 tensor of ``nbytes`` (contents undefined)."""
        need = -(-nbytes // 64) * 64
        if self._chunk is None or self._off + need > self._chunk.numel():
            size = max(self.chunk_bytes, -(-need // HUGE_PAGE) * HUGE_PAGE)
            chunk = advised_mapping(size)
            if chunk is None:
                return torch.empty(nbytes, dtype=torch.uint8)
            if size > self.chunk_bytes:  # a mapping of its own; the current chunk goes on taking small tensors
                return chunk[:nbytes]
            self._chunk, self._off = chunk, 0
        out = self._chunk[self._off : self._off + nbytes]
        self._off += need
        return out


_arena: Optional[WeightArena] = None


@contextlib.contextmanager
def weight_arena() -> Iterator[Optional[WeightArena]]:
    """Within it (a model's weight processing at load), ``weight_empty`` carves from one ``WeightArena`` when the
    active ``KernelConfig.weight_hugepages`` is on (else yields None and ``weight_empty`` is ``torch.empty``)."""
    global _arena
    from pagedllm import kernels

    prev = _arena
    _arena = WeightArena() if kernels.config().weight_hugepages and hasattr(mmap, "MADV_HUGEPAGE") else None
    try:
        yield _arena
    finally:
        _arena = prev


def weight_empty(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` for a weight: from the active ``weight_arena()``'s huge pages, else
    ``torch.empty``."""
    return _arena.empty(nbytes) if _arena is not None else torch.empty(nbytes, dtype=torch.uint8)
