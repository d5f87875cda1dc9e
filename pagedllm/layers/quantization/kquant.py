"""GGUF Q8_0 / Q5_0 / Q4_K / Q5_K / Q6_K weights executed with the file's own values (``kernels/csrc/kquant_cpu.c``).

A ``KQuantWeight`` holds either the file's bytes (``data [N, row_bytes]`` uint8, ggml blocks, a view of the
memory-mapped GGUF) or, after ``tiled()`` (done once at load, in C: 3 s for Qwen2.5-0.5B's 485 MB on one loaded
core), our tiled form: 16 output
rows interleaved per tile so that one 32-bit SIMD lane holds 4 consecutive codes of one row (the layout of
``vpdpbusd`` / ``vpmaddubsw`` against a broadcast word of activations). Every code, scale and min is the file's own
(no requantization; ``dequantize`` gives gguf's values back); Q8_0 / Q5_0 / Q6_K tiles are the file's size, Q4_K /
Q5_K's 6-bit scales are unpacked to bytes (+2.8 % / +2.3 %). The file's view is dropped once tiled, so resident
weight memory is the tiled bytes (the mapped pages are dropped: ``file_backed``; the tiles are carved from
huge-page-advised memory while a model loads: ``pagedllm.utils.hugepages.weight_arena``, or mapped from the tiles a
first load wrote to disk: ``tile_cache``). A decode GEMV streams each tile once, sequentially (prefetching 2 KB
ahead), 16 rows per instruction, with the block scales applied per group to one float32 accumulator per row (the
epilogue); see ``kquant_cpu.c`` for the layout. (The kernel walked the file's rows
along K before: 2.5-3x the memory floor at decode; now 1.15-1.6x, see the issue-20 report.)

The activations are quantized per 32 inputs (``quantize_activations``) to 15 or 8 bits; the u8 x s8 products are
summed exactly in int32 and the block scales applied in float32. Prefill rows (``step_rows``) on the integer kernel take
8-bit activations by default (``KernelConfig.kquant_prefill_act_bits``: int8 per 32 inputs, as llama.cpp's Q8_0;
the kernel then skips the low half, 1.2x faster prefill on AVX2); decode rows the width their dtype carries
(``KernelConfig.kquant_decode_bits``: 8 bits for bf16 activations, the server's default, 15 bits for float32 ones);
the LM head's rows keep 15 bits at every dtype (``kquant_logits``, ``kernels.config.LOGITS_ACT_BITS``). The row kind
and the dtype, never the row count, pick the width, so batch invariance holds.

Error (15 bits): per element |x - x~| <= max|x| / 32256 over its block of 32 (about 2^-15, far below a bf16 rounding),
so ``|y - x @ W.T| <= sum_k |w_k| max_b|x| / 32256`` plus float32 arithmetic; ``tests/test_kquant.py`` checks it
against ``gguf.quants.dequantize`` and a float64 matmul. Every M runs the same per-row arithmetic (batch
invariance: a row's result does not depend on the other rows of the call, nor on the thread count), and every ISA
(AVX512-VNNI, AVX-VNNI, AVX2, scalar) gives the same bits.

Prefill rows (marked by the model runner, ``step_rows``) of bf16 layers go through ``kquant_prefill_bf16`` at level
``amx`` (``prefill_backend``): slabs of <= 2M weights dequantized to bf16 straight into the AMX kernel's packed layout,
multiplied, dropped (no full dequantized copy). Their weights are rounded once to bf16 (like a bf16 model's); the row
kind, never the row count, picks the path (batch invariance). Below ``amx`` prefill rows stay on the integer kernel
(8-bit activations): on the Xeon capped at ``avx512_bf16`` that was 2.3x the dpbf16 route (1.5B Q4_K_M TTFT at
128 / 1,024 tokens 0.80 / 7.6 s against 1.86 / 15.2 s), as ``vpdpbusd`` does 64 multiply-adds where ``vdpbf16ps``
does 32. On an AMD EPYC Zen 5 (2 threads), whose VDPBF16PS runs twice that Xeon's rate, the integer kernel still won:
0.37-0.39 / 2.80-2.83 s against 0.51 / 3.31 s (unlike int4 layers, whose prefill goes to dpbf16 there:
``KernelConfig.int4_prefill_kernel``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from pagedllm import kernels
from pagedllm.kernels.bindings import StackKqShard
from pagedllm.kernels.config import LOGITS_ACT_BITS
from pagedllm.layers.quantization import tile_cache
from pagedllm.layers.quantization.tile_cache import FileSpan
from pagedllm.utils.hugepages import weight_empty

KQUANT_TYPES = frozenset({T.Q8_0, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K})


def get_lib() -> Optional[ctypes.CDLL]:
    """The ``kquant`` library (``kernels/csrc/kquant_cpu.c``) for the active ISA level, or None: level ``none``,
    ``PAGEDLLM_CPU_KERNELS=0`` or no compiler (then GGUF files load with the requantizations of ``gguf.py``)."""
    return kernels.lib("kquant")  # with the active config's prefetch settings (kernels._settings)


@dataclass
class KQuantWeight:
    """``rows`` x ``n_in`` weights of ``ggml_type``: ``data`` is ``[rows, row_bytes]`` uint8 ggml blocks as stored in
    the file, or (``is_tiled``) the 1-D tiled form of ``kq_pack`` (``kquant_cpu.c``). ``file_backed``: ``data`` is a
    view of a read-only (or never written copy-on-write) file mapping, whose pages ``tiled()`` drops from resident
    memory once copied (they would otherwise stay resident while the mapping lives: two copies). ``span``: where
    in a GGUF file ``data`` lies (``tile_cache.FileSpan``), so ``tiled()`` can map cached tiles instead of packing."""

    ggml_type: T
    n_in: int
    data: torch.Tensor
    n_rows: int = -1
    is_tiled: bool = False
    file_backed: bool = False
    span: Optional[FileSpan] = None

    def __post_init__(self) -> None:
        if self.n_rows < 0:
            if self.is_tiled:
                raise ValueError("a tiled KQuantWeight needs n_rows")
            self.n_rows = self.data.shape[0]

    @property
    def rows(self) -> int:
        return self.n_rows

    def tiled(self, lib: Optional[ctypes.CDLL] = None) -> "KQuantWeight":
        """This weight in the kernel's tiled layout (a new buffer; ``self`` if already tiled).

        Raises:
            ValueError: for a type or ``n_in`` the kernel doesn't take.
        """
        if self.is_tiled:
            return self
        lib = lib or get_lib()
        nbytes = lib.kq_packed_bytes(int(self.ggml_type), self.rows, self.n_in)
        if nbytes < 0:
            raise ValueError(f"kquant: unsupported type {self.ggml_type.name} or n_in {self.n_in}")
        # the file's own bytes (not permuted or sliced) may have their tiles in the load's cache file
        span = self.span if self.span is not None and self.data.is_contiguous() and (
            self.data.data_ptr() == self.span.ptr) else None
        cached = tile_cache.lookup(span, self.ggml_type, self.rows, self.n_in, nbytes)
        if cached is not None:
            return KQuantWeight(self.ggml_type, self.n_in, cached, self.rows, True)
        src = self.data.contiguous()
        out = weight_empty(nbytes)  # huge pages while a model loads (pagedllm.utils.hugepages.weight_arena)
        lib.kq_pack(int(self.ggml_type), src.data_ptr(), self.rows, self.n_in, src.shape[1], out.data_ptr())
        if self.file_backed and src.data_ptr() == self.data.data_ptr():
            lib.kq_release_file_pages(src.data_ptr(), src.numel())
        tile_cache.store(span, self.ggml_type, self.rows, self.n_in, out)
        return KQuantWeight(self.ggml_type, self.n_in, out, self.rows, True)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, n_in]``, the values ``gguf.quants.dequantize`` gives."""
        if self.is_tiled:
            return dequantize_rows(self, torch.arange(self.rows), torch.float32)
        from pagedllm.model_loader.gguf_loader import dequantize_blocks

        return dequantize_blocks(self.data.reshape(-1), self.ggml_type, (self.rows, self.n_in))


def kquant_supports(ggml_type: T, n_in: int) -> bool:
    return ggml_type in KQUANT_TYPES and n_in % GGML_QUANT_SIZES[ggml_type][0] == 0 and get_lib() is not None


class QuantizedActivations:
    """``x [M, K]`` as the kernel takes it, in one buffer: ``hi, lo [M, K]`` int8 (xq = 128 hi + lo,
    |xq| <= 16256), per block of 32 the float32 scale ``xs [M, K/32]`` and ``xs * sum(xq)`` (``sum32 [M, K/32]``),
    and the exact int32 sums of xq per half block (``isum16 [M, K/16]``). The views are made on demand (a decode
    step quantizes ~100 activations: one allocation each keeps the per-call overhead at a few microseconds)."""

    def __init__(self, m: int, k: int, bits: int = 16) -> None:
        self.m, self.k, self.bits = m, k, bits
        self.buf = torch.empty(2 * m * k + 4 * m * (k // 32) * 2 + 4 * m * (k // 16), dtype=torch.uint8)
        base = self.buf.data_ptr()
        n32 = m * (k // 32)
        self.ptrs = (base, base + m * k, base + 2 * m * k, base + 2 * m * k + 4 * n32, base + 2 * m * k + 8 * n32)

    def _view(self, i: int, dtype: torch.dtype, cols: int) -> torch.Tensor:
        off = self.ptrs[i] - self.ptrs[0]
        size = self.m * cols * torch.empty((), dtype=dtype).element_size()
        return self.buf[off : off + size].view(dtype).view(self.m, cols)

    @property
    def hi(self) -> torch.Tensor:
        return self._view(0, torch.int8, self.k)

    @property
    def lo(self) -> torch.Tensor:
        return self._view(1, torch.int8, self.k)

    @property
    def xs(self) -> torch.Tensor:
        return self._view(2, torch.float32, self.k // 32)

    @property
    def sum32(self) -> torch.Tensor:
        return self._view(3, torch.float32, self.k // 32)

    @property
    def isum16(self) -> torch.Tensor:
        return self._view(4, torch.int32, self.k // 16)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[M, K]``: the activations the matmul actually multiplies (for error bounds in tests)."""
        q = self.hi.float() * 128 + self.lo.float()
        return (q.view(q.shape[0], -1, 32) * self.xs[..., None]).view(q.shape)


def quantize_activations(x: torch.Tensor, lib: Optional[ctypes.CDLL] = None, bits: Optional[int] = None
                         ) -> QuantizedActivations:
    """``x [M, K]`` (bf16 / float32; K % 32 == 0) -> ``QuantizedActivations`` (one pass, in C).

    ``bits`` (default the active ``KernelConfig.kquant_decode_bits`` for x's dtype: 8 for bf16, 16 for float32):
    16: xq = rint(x / xs), xs = max|x| / 16256 per
    block of 32; 8: xq = 128 rint(127 x / max|x|) (lo = 0; the matmul then skips lo: about half the integer work),
    per element error <= max|x| / 254, llama.cpp's per-32 int8 (finer than its per-256 Q8_K for K-quants)."""
    lib = lib or get_lib()
    bits = kernels.config().kquant_decode_bits(x.dtype) if bits is None else bits
    if bits not in (8, 16):
        raise ValueError(f"bits must be 8 or 16; got {bits!r}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    x = x.contiguous()
    m, k = x.shape
    a = QuantizedActivations(m, k, bits)
    lib.kq_quantize_act(x.data_ptr(), m, k, int(x.dtype == torch.bfloat16), *a.ptrs, bits)
    return a


def kquant_matmul(acts: QuantizedActivations, weights: Sequence[KQuantWeight], out_dtype: torch.dtype,
                  lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """``x @ cat(weights).T -> [M, sum N_i]`` in ``out_dtype`` (bf16 / float32): each weight (any supported type,
    same ``n_in``) writes its own columns of the one output (a fused qkv / gate_up layer needs no cat). Weights not
    yet tiled are tiled for this call (layers tile theirs once at load)."""
    lib = lib or get_lib()
    weights = [w.tiled(lib) for w in weights]
    m, k = acts.m, acts.k
    n_total = sum(w.rows for w in weights)
    out = torch.empty(m, n_total, dtype=out_dtype)
    shards = (StackKqShard * len(weights))(*[(int(w.ggml_type), w.rows, w.data.data_ptr()) for w in weights])
    rc = lib.kq_matmul_shards(shards, len(weights), k, *acts.ptrs, m, out.data_ptr(), n_total,
                              int(out_dtype == torch.bfloat16), int(acts.bits == 8))
    if rc == -2:
        raise MemoryError(f"kquant_matmul: no memory for the int16 activations ({m} x {k})")
    if rc != 0:
        raise ValueError(f"kquant_matmul: unsupported ggml types {[w.ggml_type.name for w in weights]} or too many "
                         f"shards ({len(weights)})")
    return out


# Prefill slabs: at most this many weights dequantized to bf16 at once (4 MB), so no full bf16 copy is ever held.
PREFILL_SLAB_WEIGHTS = 1 << 21


def packed_bf16_backend(lib: Optional[ctypes.CDLL] = None):
    """``(LinearBackend, its library, layout id)`` of the level's packed bf16 GEMM for ``kq_dequant_packed_bf16``
    (which writes that backend's layout: 0 AMX, 1 dpbf16), or None: no packed bf16 kernel at this level, or the
    kquant build is not AVX-512 (its dequantization to bf16 would be scalar)."""
    from pagedllm.layers.packed_linear import linear_backend

    lib = lib or get_lib()
    if lib is None or lib.kq_isa() != 3:
        return None
    found = linear_backend(32, 32)
    if found is None:
        return None
    backend, kern = found
    layout = {"amx": 0, "dpbf16": 1}.get(backend.name)
    return None if layout is None else (backend, kern, layout)


def prefill_backend(lib: Optional[ctypes.CDLL] = None):
    """``packed_bf16_backend`` where it is AMX, else None: then prefill rows take the integer kernel on 8-bit
    activations, which beat the dpbf16 route 2.3x (see the module's docstring; measured on a Xeon capped at
    ``avx512_bf16``, 2 threads). AMX: 1.5B Q4_K_M TTFT at 128 tokens 0.48 s against the integer kernel's 0.80."""
    found = packed_bf16_backend(lib)
    return found if found is not None and found[0].name == "amx" else None


def kquant_prefill_bf16(x: torch.Tensor, weights: Sequence[KQuantWeight], found, lib: Optional[ctypes.CDLL] = None
                        ) -> torch.Tensor:
    """``x [T, K]`` bf16 ``@ cat(weights).T -> [T, N]`` bf16 through the packed bf16 GEMM of ``found``
    (``prefill_backend``, or ``packed_bf16_backend`` for the dpbf16 layout): slab by slab, each weight's rows are
    dequantized (gguf's values, rounded once to bf16) into the kernel's layout and multiplied (float32 sums, one
    rounding). A row's result does not depend on the other rows (the backends are batch invariant). Every weight's
    rows must be a multiple of 32."""
    lib = lib or get_lib()
    backend, kern, layout = found
    linear = getattr(kern, backend.linear)
    x = x.contiguous()
    m, k = x.shape
    n_total = sum(w.rows for w in weights)
    out = torch.empty(m, n_total, dtype=torch.bfloat16)
    slab_rows = max(64, PREFILL_SLAB_WEIGHTS // k // 64 * 64)
    buf = torch.empty(min(slab_rows, max(w.rows for w in weights)) * k, dtype=torch.bfloat16)
    col = 0
    for w in weights:
        w = w.tiled(lib)
        for r0 in range(0, w.rows, slab_rows):
            r1 = min(w.rows, r0 + slab_rows)
            rc = lib.kq_dequant_packed_bf16(int(w.ggml_type), w.data.data_ptr(), w.rows, k, r0 // 16, r1 // 16, layout,
                                            buf.data_ptr())
            if rc != 0:
                raise ValueError(f"kquant_prefill_bf16: bad type {w.ggml_type.name} or rows {w.rows}")
            if r0 == 0 and r1 == n_total:
                linear(x.data_ptr(), m, k, buf.data_ptr(), r1 - r0, None, out.data_ptr(), 0)
            else:
                y = torch.empty(m, r1 - r0, dtype=torch.bfloat16)
                linear(x.data_ptr(), m, k, buf.data_ptr(), r1 - r0, None, y.data_ptr(), 0)
                out[:, col + r0 : col + r1] = y
        col += w.rows
    return out


def kquant_logits(x: torch.Tensor, weights: Sequence[KQuantWeight], lib: Optional[ctypes.CDLL] = None
                  ) -> torch.Tensor:
    """The LM head: ``x [T, K] @ cat(weights).T -> [T, N]`` float32 logits, on ``LOGITS_ACT_BITS`` activations for
    every row (whatever the dtype, the row kind or the row count)."""
    lib = lib or get_lib()
    return kquant_matmul(quantize_activations(x, lib, LOGITS_ACT_BITS), weights, torch.float32, lib)


def kquant_linear(x: torch.Tensor, weights: Sequence[KQuantWeight], out_dtype: Optional[torch.dtype] = None,
                  lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """``x [T, K] @ cat(weights).T -> [T, N]`` in ``out_dtype`` (default x's dtype; float16 comes via float32).

    Each row's kernel depends on the row's kind, never on how many rows share the call (batch invariance): rows the
    model runner marked as prefill rows (``step_rows``) of a bf16 layer go through ``kquant_prefill_bf16`` at level
    ``amx`` (tiles dequantized to bf16: the weights rounded once to bf16, like a bf16 model), elsewhere the integer
    kernel on ``KernelConfig.kquant_prefill_act_bits`` activations; decode rows and every other call run the integer
    kernel on the file's exact values (activations of ``KernelConfig.kquant_decode_bits`` for x's dtype)."""
    from pagedllm.layers.quantization.kernels import by_row_kind, current_step_rows

    out_dtype = out_dtype or x.dtype
    kernel_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.float32
    rows = current_step_rows() if x.dtype == out_dtype == torch.bfloat16 else None
    if rows is not None and rows.num_tokens == x.shape[0] and rows.prefill is not None and all(
            w.rows % 32 == 0 for w in weights) and x.shape[1] % 32 == 0:
        found = prefill_backend(lib)
        if found is not None:
            return by_row_kind(x.contiguous(), rows, lambda xp: kquant_prefill_bf16(xp, weights, found, lib),
                               lambda xd: kquant_matmul(quantize_activations(xd, lib), weights, torch.bfloat16, lib))
    cfg = kernels.config()
    if rows is not None and rows.num_tokens == x.shape[0] and rows.prefill is not None and \
            cfg.kquant_prefill_act_bits != cfg.kquant_decode_bits(x.dtype):
        pb = cfg.kquant_prefill_act_bits
        y = by_row_kind(x.contiguous(), rows,
                        lambda xp: kquant_matmul(quantize_activations(xp, lib, pb), weights, kernel_dtype, lib),
                        lambda xd: kquant_matmul(quantize_activations(xd, lib), weights, kernel_dtype, lib))
    else:
        y = kquant_matmul(quantize_activations(x, lib), weights, kernel_dtype, lib)
    return y if kernel_dtype == out_dtype else y.to(out_dtype)


def dequantize_rows(w: KQuantWeight, ids: torch.Tensor, dtype: torch.dtype,
                    lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """Rows ``ids [T]`` of ``w`` dequantized -> ``[T, n_in]`` in ``dtype`` (gguf's float32 values, rounded once to
    bf16 when ``dtype`` is bf16): an embedding lookup that never expands the table.

    Raises:
        IndexError: for an id outside ``[0, N)``.
    """
    lib = lib or get_lib()
    w = w.tiled(lib)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    kernel_dtype = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    out = torch.empty(ids.numel(), w.n_in, dtype=kernel_dtype)
    rc = lib.kq_dequant_rows(int(w.ggml_type), w.data.data_ptr(), w.rows, w.n_in, ids.data_ptr(), ids.numel(),
                             out.data_ptr(), int(kernel_dtype == torch.bfloat16))
    if rc == -2:  # the kernel checks every id before it reads a row
        raise IndexError(f"token id out of range [0, {w.rows})")
    if rc != 0:
        raise ValueError(f"kq_dequant_rows: unsupported type {w.ggml_type!r} or shape")
    return out if kernel_dtype == dtype else out.to(dtype)
