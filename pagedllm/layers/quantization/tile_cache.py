"""The GGUF K-quant tiles (``KQuantWeight.tiled``) kept on disk after a model's first load and mapped at later loads.

Why: packing is cheap, the memory it writes is not. On an AMD EPYC Zen 5 VM (2 threads) loading Qwen2.5-Coder-1.5B
Q4_K_M spent 2.8-3.3 s in ``kq_pack`` for its 1.1 GB of tiles: the packing itself runs at ~5-10 GB/s, the rest is the
first touch of the fresh (huge-page) memory it fills, 0.4-1.3 GB/s in that VM. A file in the page cache mapped
``MAP_PRIVATE`` needs no fresh memory: with ``MADV_HUGEPAGE`` and ``MADV_POPULATE_READ`` 512 MB of it were mapped in
0.4 ms, with 2 MiB page-table entries (``FilePmdMapped``) where the filesystem keeps large folios (ext4 / xfs on
recent kernels), and read as fast as anonymous huge pages (a 512 MB streaming read, interleaved: 73 vs 70 GB/s);
from a cold page cache in 0.19 s. llama.cpp maps its GGUF the same way.

One file per model load, holding every tile the load packed, in load order, 64-byte aligned from offset 0 (so,
like the load's huge-page arena, one mapping with 2 MiB entries everywhere but its last partial page: a file per
tensor left the 1-2 MB ones and every file's tail on 4 KiB pages, and the 1.5B's decode step ~2 % slower), then an
index (per tensor: ggml type, rows, n_in, its offset in the GGUF, its tile bytes, its offset in this file) and a
footer (magic, entries, index offset). Path: ``<cache_dir>/kquant-tiles/<gguf name>-<hash of its real path>/
<ident>-<layout>-<first>.tiles``: ``ident`` hashes the GGUF's size, mtime and inode (a rewritten GGUF gets new names;
files of other idents or layouts are deleted at the next write), ``layout`` the source of the packing code
(``kernels/csrc/kquant_cpu.c``: any edit there repacks), ``first`` the GGUF offset of the load's first tensor (a
pipeline stage loads other tensors than its neighbours, from its own file).

A load (``session``, around ``finish_quantized_loading``) maps its file at its first K-quant tensor and takes each
tensor it finds in the index (after checking type, rows and n_in); it packs the others as before, and if any was
missing writes the file anew at the end (the hits copied over). Files are written whole or not at all
(``utils.atomic.atomic_path``); nothing checksums the tile bytes (a checksum of 1.1 GB would cost what the cache
saves), as with the built kernels' cache. Only tensors of at least ``MIN_BYTES`` of tiles are cached (a smaller one
packs in well under a millisecond). Off with ``PAGEDLLM_KQUANT_TILE_CACHE=0`` (``KernelConfig.kquant_tile_cache``).
Where the page cache gave no 2 MiB entries (checked in ``/proc/self/smaps_rollup``), the hits are copied into the
load's huge-page arena instead (the packing saved, not the first touch): 4 KiB pages stream slower
(``pagedllm.utils.hugepages``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import shutil
import struct
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

logger = logging.getLogger(__name__)

MIN_BYTES = 1 << 20  # smallest tiled tensor worth caching (see the module docstring)
_MAGIC = b"PGLTILE2"
_ENTRY = struct.Struct("<qqqqqq")  # ggml type, rows, n_in, offset in the GGUF, tile bytes, offset in this file
_FOOTER = struct.Struct("<8sqq")  # magic, entries, index offset
_ALIGN = 64
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; Python 3.11's mmap lacks the name
_FREE_MARGIN = 1 << 30  # a write leaves at least this much of the disk free


@dataclass(frozen=True)
class FileSpan:
    """Where a quantized tensor's bytes lie: ``folder`` (its GGUF's cache folder), ``ident`` (the GGUF's size, mtime
    and inode, hashed), ``offset`` (bytes from the start of the file) and ``ptr``, the address of the loader's view of
    them in this process (a weight whose data is anything else, e.g. rows permuted, is not cached)."""

    folder: str
    ident: str
    offset: int = 0
    ptr: int = 0


def gguf_span(path: str) -> FileSpan:
    """The ``FileSpan`` of the GGUF at ``path`` (offset 0; the loader sets each tensor's ``offset`` and ``ptr``)."""
    from pagedllm.model_files import cache_dir

    real = os.path.realpath(path)
    st = os.stat(real)
    folder_hash = hashlib.sha256(real.encode()).hexdigest()[:16]
    ident = hashlib.sha256(f"{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}".encode()).hexdigest()[:12]
    return FileSpan(os.path.join(str(cache_dir()), "kquant-tiles", f"{os.path.basename(real)}-{folder_hash}"), ident)


_layout: Optional[str] = None


def _layout_hash() -> str:
    global _layout
    if _layout is None:
        src = os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "csrc", "kquant_cpu.c")
        with open(src, "rb") as f:
            _layout = hashlib.sha256(f.read()).hexdigest()[:12]
    return _layout


def _version(span: FileSpan) -> str:
    """The name prefix of the cache files of this GGUF version and packing code."""
    return f"{span.ident}-{_layout_hash()}-"


def cache_path(first: FileSpan) -> str:
    """The cache file of a load whose first cached tensor is at ``first``."""
    return os.path.join(first.folder, f"{_version(first)}{first.offset}.tiles")


def _rollup_pmd_kb() -> Optional[int]:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("FilePmdMapped:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _read_index(fd: int) -> Optional[dict]:
    """{(type, rows, n_in, gguf offset): (tile bytes, file offset)} of an open cache file; None if malformed."""
    size = os.fstat(fd).st_size
    if size < _FOOTER.size:
        return None
    magic, n, at = _FOOTER.unpack(os.pread(fd, _FOOTER.size, size - _FOOTER.size))
    if magic != _MAGIC or n < 0 or at < 0 or at + n * _ENTRY.size + _FOOTER.size != size:
        return None
    raw = os.pread(fd, n * _ENTRY.size, at)
    index = {}
    for i in range(n):
        ty, rows, n_in, off, nbytes, pos = _ENTRY.unpack_from(raw, i * _ENTRY.size)
        if nbytes < 0 or pos < 0 or pos + nbytes > at:
            return None
        index[(ty, rows, n_in, off)] = (nbytes, pos)
    return index


def _map(path: str, hugepages: bool) -> Optional[tuple[torch.Tensor, dict]]:
    """The whole cache file at ``path`` mapped copy-on-write (as the GGUF's own mapping; nothing writes to it),
    advised for huge pages and populated, with its index; None for a missing or malformed file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        index = _read_index(fd)
        if not index:
            return None
        mm = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError, struct.error):
        return None
    finally:
        os.close(fd)
    try:
        if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE)
        mm.madvise(_MADV_POPULATE_READ)
    except (OSError, AttributeError):
        pass  # an older kernel (or not Linux): the pages fault in at first use
    return torch.frombuffer(mm, dtype=torch.uint8), index  # the tensor keeps `mm` alive


@dataclass
class _Load:
    """One model load's cache state (``session``)."""

    hugepages: bool
    first: Optional[FileSpan] = None
    mapped: Optional[torch.Tensor] = None
    index: dict = field(default_factory=dict)
    copy_hits: bool = False  # the mapping got no 2 MiB entries: hits are copied into the arena
    tiles: list = field(default_factory=list)  # (key, tensor) of every tensor of the load, in order
    missing: int = 0

    def open(self, span: FileSpan) -> None:
        self.first = span
        path = cache_path(span)
        for attempt in range(2):
            before = _rollup_pmd_kb() if self.hugepages else None
            got = _map(path, self.hugepages)
            if got is None:
                return
            self.mapped, self.index = got
            if not self.hugepages or self.mapped.numel() < (8 << 20):
                return
            after = _rollup_pmd_kb()
            share = 0.0 if before is None or after is None else (after - before) * 1024 / self.mapped.numel()
            if share >= 0.9 or attempt == 1:
                break
            # The page cache holds the file in small folios (e.g. just copied, or written by another tool): once
            # dropped (only pages no process maps), the huge-page-advised read-in makes 2 MiB ones.
            self.mapped = got = None  # unmapped: only pages no process maps can be dropped
            _drop_page_cache(path)
        self.copy_hits = share < 0.5
        if self.copy_hits:
            logger.info("K-quant tile cache: the page cache gave no 2 MiB pages here (%.0f%% of %s); hits are "
                        "copied into huge-page memory", 100 * share, path)


_state = threading.local()  # .load: the current thread's _Load (a load runs on one thread; two may run at once)


def _current() -> Optional[_Load]:
    return getattr(_state, "load", None)


def _drop_page_cache(path: str) -> None:
    """Asks the kernel to drop ``path``'s clean, unmapped pages from the page cache (``POSIX_FADV_DONTNEED``)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def session(enabled: bool, hugepages: bool) -> Iterator[None]:
    """Within it (one model's weight processing), ``lookup`` / ``store`` use the load's cache file; at the end the
    file is written if any cached tensor was missing from it. ``enabled`` False: no caching."""
    prev = _current()
    _state.load = load = _Load(hugepages) if enabled else None
    try:
        yield
        if load is not None and load.first is not None and load.tiles:
            if load.mapped is not None and len(load.tiles) > load.missing:
                logger.info("K-quant tile cache: %d tensors %s from %s", len(load.tiles) - load.missing,
                            "copied" if load.copy_hits else "mapped", cache_path(load.first))
            if load.missing or load.mapped is None:
                _write(load)
    finally:
        _state.load = prev


def lookup(span: Optional[FileSpan], ggml_type: int, rows: int, n_in: int, nbytes: int) -> Optional[torch.Tensor]:
    """The cached tiles (uint8 ``[nbytes]``) of this tensor in the current ``session``'s file, or None (no session, a
    tensor below ``MIN_BYTES``, not in the file: ``store`` then keeps the packed tiles for the file)."""
    load = _current()
    if load is None or span is None or nbytes < MIN_BYTES:
        return None
    if load.first is None:
        load.open(span)
    key = (int(ggml_type), rows, n_in, span.offset)
    hit = load.index.get(key)
    if hit is None or hit[0] != nbytes or span.ident != load.first.ident or span.folder != load.first.folder:
        return None
    tiles = load.mapped[hit[1] : hit[1] + nbytes]
    if load.copy_hits:
        from pagedllm.utils.hugepages import weight_empty

        tiles = weight_empty(nbytes).copy_(tiles)
    load.tiles.append((key, tiles))
    return tiles


def store(span: Optional[FileSpan], ggml_type: int, rows: int, n_in: int, tiles: torch.Tensor) -> None:
    """Keeps freshly packed ``tiles`` for the current ``session``'s file (nothing outside a session or below
    ``MIN_BYTES``)."""
    load = _current()
    if load is None or span is None or tiles.numel() < MIN_BYTES or load.first is None:
        return
    if span.ident != load.first.ident or span.folder != load.first.folder:
        return  # a second GGUF in one load: only the first one's tensors are cached
    load.tiles.append(((int(ggml_type), rows, n_in, span.offset), tiles))
    load.missing += 1


def _write(load: _Load) -> None:
    """The load's file, whole (atomic rename), and the folder's files of other GGUF versions or layouts deleted.
    Skipped (logged) where the disk would keep less than 1 GiB free, or on any OS error (a read-only cache folder, a
    full disk): the cache is an optimisation only."""
    from pagedllm.utils.atomic import atomic_path

    path = cache_path(load.first)
    total = sum(-(-t.numel() // _ALIGN) * _ALIGN for _, t in load.tiles)
    try:
        os.makedirs(load.first.folder, exist_ok=True)
        if shutil.disk_usage(load.first.folder).free < total + _FREE_MARGIN:
            logger.info("K-quant tile cache: not written (%.1f GB would leave under 1 GiB free in %s)", total / 1e9,
                        load.first.folder)
            return
        entries, pos = [], 0
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            for (ty, rows, n_in, off), t in load.tiles:
                f.write(memoryview(t.numpy()))
                pad = -t.numel() % _ALIGN
                f.write(b"\0" * pad)
                entries.append(_ENTRY.pack(ty, rows, n_in, off, t.numel(), pos))
                pos += t.numel() + pad
            f.write(b"".join(entries))
            f.write(_FOOTER.pack(_MAGIC, len(entries), pos))
            f.flush()
            os.fdatasync(f.fileno())  # on disk before the rename (a crash leaves the old file or the whole new one)
        # The written pages sit in the page cache in the write path's folios, not all 2 MiB ones (a 1.1 GB file:
        # 77 % mapped with 2 MiB entries, and decode steps ~1 % slower): dropped, the next load's huge-page-advised
        # read-in makes 2 MiB folios of all of it.
        _drop_page_cache(path)
        keep = _version(load.first)
        for name in os.listdir(load.first.folder):
            if name.endswith(".tiles") and not name.startswith(keep):
                os.unlink(os.path.join(load.first.folder, name))
        logger.info("K-quant tile cache: %d tensors (%.2f GB) written to %s", len(entries), pos / 1e9, path)
    except OSError as e:
        logger.info("K-quant tile cache: not written (%s)", e)
