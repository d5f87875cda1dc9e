"""The two weight layouts quantized linears run on, and the matmuls over them.

Every scheme is converted at load into one of two canonical forms, then packed once:

- ``Int4Groups``: 4-bit codes ``q`` in [0, 15] with a float scale and a float *zero* per group of ``group_size``
  input features; ``w = (q - 8) * scale + zero``. This is the form of PyTorch's CPU int4 weight-only matmul
  (``aten._weight_int4pack_mm_for_cpu``, used by gpt-fast and torchao's Int4CPULayout): checked numerically, the op
  computes ``x @ ((q - 8) * s + z).T`` with ``scales_and_zeros [K / group, N, 2]`` in the activation dtype.
  GGUF Q4_0 (``d * (q - 8)``) has zero 0; Q4_1 (``d * q + m``) has zero ``m + 8 d``; GPTQ / AWQ
  (``s * (q - z_int)``) have zero ``s * (8 - z_int)``.
- ``Int8Rows``: int8 codes with one scale per output row (``aten._weight_int8pack_mm``).

Decode rows in bf16 run on our integer-dot kernel (``int4_gemv_bf16``, VNNI or AVX2); otherwise aten's int4 op, which
costs about the same per activation row at any batch (no weight reuse across rows): batches of a few rows and more
run on our C kernel, prefill expands the weight for one dense matmul (``int4_matmul``).

Measured (1 thread, bf16, SmolLM2 shapes, microseconds; see README "Quantization"):

| N x K | batch | bf16 F.linear | int4pack g32 | int8pack |
|---|---|---|---|---|
| 576 x 576 | 1 / 32 | 69 / 77 | 28 / 354 | 33 / 382 |
| 1536 x 576 | 1 / 32 | 138 / 186 | 65 / 939 | 72 / 1020 |
| 576 x 1536 | 1 / 32 | 173 / 213 | 68 / 910 | 62 / 889 |
| 49152 x 576 | 1 / 32 | 5811 / 9808 | 1921 / 35260 | 2277 / 37345 |
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np

import torch
import torch.nn.functional as F

# Int4 pack layouts: a ``[N_pad, K / 2]`` uint8 pack holds, for each block of ``block_n`` output rows and each input
# column k, ``block_n / 2`` bytes; "half": byte j holds rows j (low nibble) and j + block_n / 2 (high), "pairs":
# rows 2j and 2j + 1. aten's ``_convert_weight_to_int4pack_for_cpu`` writes the one of its *runtime* CPU capability
# (measured on torch 2.13: AVX512 -> (64, half), AVX2 -> (32, half), DEFAULT -> (32, pairs)), so a pack made by it
# on one level reads as garbage on another (``ATEN_CPU_CAPABILITY=avx2``, i.e. our level avx2, or a Zen 2 machine).
# Our C kernels read INT4_OURS, which we write ourselves; aten's op is used only on a pack of aten's own layout.
INT4_LAYOUTS = {"avx512": (64, "half"), "avx2": (32, "half"), "default": (32, "pairs")}
INT4_OURS = "avx512"
# Padding N to a multiple of 64 fits every layout's block (and the op needs N % 16 == 0 anyway).
INT4_BLOCK_N = 64
INT4_KERNEL_GROUP_SIZES = (256, 128, 64, 32)
# Which int4 path runs a matmul of M activation rows (measured, 1 thread, bf16, SmolLM2 shapes; README):
# M < INT4_GEMM_MIN_TOKENS: aten's op (fastest for decode of one or a few requests);
# up to DENSE_FALLBACK_MIN_TOKENS: our C kernel (csrc/int4_cpu.c), which expands each weight tile once for all rows
# (aten's op costs about the same per row at any M: 960x576 at M=32: aten 951 us, C 624 us, bf16 310 us);
# from DENSE_FALLBACK_MIN_TOKENS on (prefill): expand the whole weight (C, 2-3x faster than in torch) + one dense
# matmul (576x1536 at M=128: C gemm 3.4 ms, expand 2.1 ms + dense 1.0 ms).
INT4_GEMM_MIN_TOKENS = 6
# bf16 activations, up to this many rows: our integer-dot kernel (int4_gemv_bf16), at levels avx2 and up
# (invariance off; batch invariant: every decode row). SmolLM2 shapes, 2 threads, M = 1, microseconds: 960x576 23 vs aten 38, 3072x576 53 vs 114,
# 576x1536 41 vs 59; at M = 8 it still beats the C gemm on the wide shapes, at 16 it does not.
INT4_GEMV_MAX_TOKENS = 8
INT8_GEMM_MIN_TOKENS = 24
DENSE_FALLBACK_MIN_TOKENS = 128


@dataclass
class Int4Groups:
    """``w[n, k] = (q[n, k] - 8) * scale[n, k // group_size] + zero[n, k // group_size]`` (float32 scale/zero).

    ``perm`` (act-order GPTQ): input feature ``k`` of this layout is feature ``perm[k]`` of the checkpoint, so the
    layer computes ``x[:, perm] @ w.T``.
    """

    q: torch.Tensor  # [N, K] integer in [0, 15]
    scale: torch.Tensor  # [N, K / group_size] float32
    zero: torch.Tensor  # [N, K / group_size] float32
    group_size: int
    perm: Optional[torch.Tensor] = None  # [K] int64

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] in the checkpoint's input-feature order."""
        g = self.group_size
        w = (self.q.float() - 8).view(self.q.shape[0], -1, g) * self.scale[..., None] + self.zero[..., None]
        w = w.view(self.q.shape)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w

    @staticmethod
    def cat(parts: list["Int4Groups"]) -> "Int4Groups":
        """Stacks shards along N (same K, group size and permutation)."""
        return Int4Groups(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            parts[0].group_size,
            parts[0].perm,
        )


@dataclass
class Int8Rows:
    """``w[n, k] = q[n, k] * scale[n]``."""

    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    @staticmethod
    def quantize(w: torch.Tensor) -> "Int8Rows":
        """Symmetric per-row int8 of a float weight (absmax / 127)."""
        w = w.float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
        return Int8Rows(torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale)

    @staticmethod
    def cat(parts: list["Int8Rows"]) -> "Int8Rows":
        return Int8Rows(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))


def quantize_int4_minmax(w: torch.Tensor, group_size: int = 32) -> Int4Groups:
    """Asymmetric min-max int4 of a float weight ``[N, K]`` per group (the requantization for types without a
    kernel, e.g. Q4_K: exact for a group whose codes span 0..15)."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).view(n, k)
    return Int4Groups(q, scale, lo + 8 * scale, group_size)


def int4_kernel_supports(n_in: int, group_size: int) -> bool:
    return group_size % 32 == 0 and n_in % group_size == 0 and n_in % 32 == 0


def int4_pack_codes(q: torch.Tensor, layout: str = INT4_OURS) -> torch.Tensor:
    """Codes ``q [N_pad, K]`` (integers in [0, 15], N_pad a multiple of the layout's block) -> the uint8 pack
    ``[N_pad, K / 2]`` of ``layout`` (see ``INT4_LAYOUTS``)."""
    block_n, kind = INT4_LAYOUTS[layout]
    n_pad, k = q.shape
    qb = q.to(torch.uint8).view(n_pad // block_n, block_n, k)
    if kind == "half":
        lo, hi = qb[:, : block_n // 2], qb[:, block_n // 2:]
    else:
        lo, hi = qb[:, 0::2], qb[:, 1::2]
    return (lo | (hi << 4)).transpose(1, 2).contiguous().view(n_pad, k // 2)  # [B, K, block_n / 2] bytes


def int4_unpack_codes(packed: torch.Tensor, layout: str = INT4_OURS) -> torch.Tensor:
    """The inverse of ``int4_pack_codes``: uint8 codes ``[N_pad, K]``."""
    block_n, kind = INT4_LAYOUTS[layout]
    n_pad, k = packed.shape[0], packed.shape[1] * 2
    p = packed.view(n_pad // block_n, k, block_n // 2)
    lo, hi = p & 0x0F, p >> 4
    q = torch.cat([lo, hi], dim=2) if kind == "half" else torch.stack([lo, hi], dim=3).view(-1, k, block_n)
    return q.transpose(1, 2).reshape(n_pad, k)


_aten_layout: list = []


def aten_int4_layout() -> Optional[str]:
    """The layout aten's int4 pack writes in this process (its CPU capability is fixed at start), found once by
    packing a probe; None for a layout we don't know (then aten's op is never used)."""
    if not _aten_layout:
        g = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (INT4_BLOCK_N * 2, 64), generator=g, dtype=torch.int32)
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
        except Exception:  # noqa: BLE001 - no CPU int4 op in this build
            packed = None
        found = None
        if packed is not None and packed.dtype == torch.uint8 and tuple(packed.shape) == (q.shape[0], 32):
            found = next((name for name in INT4_LAYOUTS if torch.equal(int4_unpack_codes(packed, name).int(), q)),
                         None)
        _aten_layout.append(found)
    return _aten_layout[0]


class PackedInt4:
    """An ``Int4Groups`` packed for our C kernels (layout ``INT4_OURS``) or, where they don't run, for
    ``aten._weight_int4pack_mm_for_cpu`` in aten's own layout (tensors registered on a module)."""

    @staticmethod
    def pack(w: Int4Groups, dtype: torch.dtype, layout: Optional[str] = None) -> dict:
        """``layout``: default ours where our int4 kernels load at the active level, else aten's (ours if aten's is
        unknown: then the matmuls expand the weight). The returned ``layout`` entry is a str; the rest tensors."""
        from pagedllm.layers.quantization import cpu_kernels

        n, k = w.q.shape
        g = w.group_size
        kernel_g = next(kg for kg in INT4_KERNEL_GROUP_SIZES if g % kg == 0 and k % kg == 0)
        scale, zero = w.scale, w.zero
        if kernel_g != g:  # a group of 128 is four groups of 32 with the same scale and zero: exact
            scale, zero = scale.repeat_interleave(g // kernel_g, 1), zero.repeat_interleave(g // kernel_g, 1)
        n_pad = -n % INT4_BLOCK_N
        q = w.q.to(torch.int32)
        if n_pad:
            q = F.pad(q, (0, 0, 0, n_pad), value=8)
            scale, zero = F.pad(scale, (0, 0, 0, n_pad)), F.pad(zero, (0, 0, 0, n_pad))
        if layout is None:
            layout = INT4_OURS if cpu_kernels.get_lib() is not None else (aten_int4_layout() or INT4_OURS)
        packed = int4_pack_codes(q, layout)  # [N_pad, K / 2] uint8
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()  # [K / g, N_pad, 2]
        out = {"packed": packed, "scales_and_zeros": scales_and_zeros,
               "kernel_group": torch.tensor(kernel_g), "n_out": torch.tensor(n), "layout": layout}
        if w.perm is not None:
            out["perm"] = w.perm.to(torch.int64)
        return out

    @staticmethod
    def unpack_codes(packed: torch.Tensor, layout: str = INT4_OURS) -> torch.Tensor:
        """uint8 codes ``[N_pad, K]`` of a pack of ``layout``."""
        return int4_unpack_codes(packed, layout)

    @staticmethod
    def expand(packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_g: int, dtype: torch.dtype,
               layout: str = INT4_OURS) -> torch.Tensor:
        """The weight ``[N_pad, K]`` in ``dtype`` (same values the op uses, rounded once to ``dtype``)."""
        q = int4_unpack_codes(packed, layout)
        n_pad, k = q.shape
        sz = scales_and_zeros.transpose(0, 1)  # [N_pad, K / g, 2]
        w = q.view(n_pad, k // kernel_g, kernel_g).to(dtype).sub_(8)
        return w.mul_(sz[..., 0:1]).add_(sz[..., 1:2]).view(n_pad, k)


@dataclass
class StepRows:
    """Which rows of a step's activations ``[num_tokens, ...]`` are decode rows (a request's one new token) and which
    prefill rows: ``None`` for none of that kind, a tensor of row indices, or ``ALL``."""

    num_tokens: int
    decode: object
    prefill: object


ALL = "all"
_step = threading.local()


@contextmanager
def step_rows(query_lens: list[int], decode: Optional[list[bool]] = None,
              prefill_rows: Optional[list[int]] = None) -> Iterator[None]:
    """The model runner marks the step's rows around the model's forward (``query_lens``: new tokens per request,
    in row order), so int4 linears can give each row its kernel by its kind, not by how many rows share the call.
    ``decode``: which requests decode (default: those with one new token); a speculating request's 1 + k verify
    rows are decode rows, so they take the kernel its plain decode steps take (greedy output stays identical).
    ``prefill_rows`` (overrides ``decode``): per request, how many of its rows (the first) are prefill rows, the
    rest decode rows (``build_attention_metadata``'s argument of that name)."""
    n = sum(query_lens)
    if prefill_rows is None:
        dec = decode if decode is not None else [q == 1 for q in query_lens]
        prefill_rows = [0 if d else q for d, q in zip(dec, query_lens)]
    n_pre = sum(prefill_rows)
    if n_pre == 0:
        rows = StepRows(n, ALL, None)
    elif n_pre == n:
        rows = StepRows(n, None, ALL)
    else:
        is_dec = np.ones(n, dtype=bool)
        at = 0
        for p, q in zip(prefill_rows, query_lens):
            is_dec[at:at + p] = False
            at += q
        rows = StepRows(n, torch.from_numpy(np.flatnonzero(is_dec)), torch.from_numpy(np.flatnonzero(~is_dec)))
    prev = getattr(_step, "rows", None)
    _step.rows = rows
    try:
        yield
    finally:
        _step.rows = prev


def current_step_rows() -> Optional[StepRows]:
    """The rows of the step being run (``step_rows``), or None outside one."""
    return getattr(_step, "rows", None)


# by_row_kind runs a whole step through the prefill kernel (then redoes its decode rows) while the decode rows are at
# most this fraction of the step's rows; with more, the two kinds' rows are gathered and scattered apart.
RECOMPUTE_DECODE_MAX_FRACTION = 1 / 8


def by_row_kind(x: torch.Tensor, rows: StepRows, prefill: Callable[[torch.Tensor], torch.Tensor],
                decode: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``[T, N]``: the prefill rows of ``x [T, K]`` (contiguous; ``rows.prefill`` not None) through ``prefill``, its
    decode rows through ``decode``; both return ``[rows, N]`` in the same dtype, with per-row arithmetic that doesn't
    depend on the other rows (so the choice below never changes a bit of the result).

    A prefill step has one decode row per request whose prompt ends in it (its last prompt token). While the decode
    rows are few (``RECOMPUTE_DECODE_MAX_FRACTION``), the whole step goes through ``prefill`` and the decode rows are
    then recomputed and written over, instead of copying every prefill row's input out and output back: those two
    copies took ~30% of a 2,048-token int4 prefill step (SmolLM2 int4, 64 prompts x 360 tokens, Xeon with AMX, 2
    threads: 10.5 -> 7.1 s).
    """
    if rows.decode is None:
        return prefill(x)
    if rows.decode.numel() <= rows.num_tokens * RECOMPUTE_DECODE_MAX_FRACTION:
        out = prefill(x)
        out.index_copy_(0, rows.decode, decode(x.index_select(0, rows.decode)))
        return out
    y_dec = decode(x.index_select(0, rows.decode))
    y_pre = prefill(x.index_select(0, rows.prefill))
    out = torch.empty(x.shape[0], y_pre.shape[1], dtype=y_pre.dtype)
    out.index_copy_(0, rows.decode, y_dec)
    out.index_copy_(0, rows.prefill, y_pre)
    return out


# Prefill slabs: at most this many weights expanded to bf16 at once (4 MB), so no dense copy is ever held.
INT4_PREFILL_SLAB_WEIGHTS = 1 << 21


def int4_prefill_backend(k: int):
    """``(LinearBackend, its library, layout id)`` for the prefill rows of an int4 layer with ``k`` inputs
    (``int4_dequant_packed_bf16`` writes that backend's packed layout: 0 AMX, 1 dpbf16), or None: then prefill rows
    take ``KernelConfig.int4_prefill_kernel`` (``int4_matmul``). On AMX always: there it is 5-7x ``int4_gemm``'s
    float32 FMAs at 512 rows (SmolLM2's layers on a Xeon with AMX, 2 threads, expansion included: 960x576 2.1 -> 0.37
    ms, 3072x576 5.9 -> 1.2 ms; Qwen 1.5B's 17920x1536 104 -> 21 ms) and even at 32 rows (0.41 -> 0.22 ms). Below AMX
    the dpbf16 GEMM where ``int4_prefill_kernel`` is ``bf16`` (the default at ``avx512_bf16``): on an AMD EPYC Zen 5,
    SmolLM2's four layer shapes at 512 rows took 4.2 ms there against 9.2 on the 15-bit integer kernel (a Xeon capped
    at ``avx512_bf16``, whose VDPBF16PS runs at half that Zen 5's rate, had them even)."""
    from pagedllm import kernels
    from pagedllm.layers.packed_linear import linear_backend

    if k % 32:
        return None
    found = linear_backend(32, 32)
    if found is None:
        return None
    backend, kern = found
    if backend.name == "amx":
        return backend, kern, 0
    if backend.name == "dpbf16" and kernels.config().int4_prefill_kernel == "bf16":
        return backend, kern, 1
    return None


def int4_prefill_bf16(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_g: int,
                      n_out: int, found) -> torch.Tensor:
    """``x [T, K]`` bf16 (contiguous) ``@ w.T -> [T, n_out]`` bf16 through the packed bf16 GEMM of ``found``
    (``int4_prefill_backend``): slab by slab of 64-row blocks, the weight expanded (``int4_expand``'s values, rounded
    once to bf16) into the kernel's layout and multiplied (float32 sums, one rounding). A row's result does not
    depend on the other rows (the backends are batch invariant). ``scales_and_zeros`` in bf16 or float32."""
    return _int4_prefill_slabs(x, packed, scales_and_zeros, kernel_g, n_out, found, gated=False)


def int4_prefill_silu_mul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_g: int,
                          inter: int, found) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T) -> [T, inter]`` bf16 for an int4 SwiGLU gate_up pack (rows ``[gate; up]``, ``2
    inter`` of them, ``inter % 64 == 0``), through the packed GEMM of ``found`` (``int4_prefill_backend``: AMX or
    dpbf16) with its gated epilogue (mode 2): slab by slab of gate rows, each expanded with its up rows into the gated
    packing (``int4_dequant_packed_bf16`` layout 2 for AMX, 3 for dpbf16). The mode rounds gate, up, silu(gate) and
    the product to bf16 as ``int4_prefill_bf16`` then ``silu_and_mul`` do, so the bits are theirs, without writing
    and reading back the ``[T, 2 inter]`` product (SmolLM2 int4 prefill: ``silu_and_mul`` alone was ~6% of a
    step)."""
    return _int4_prefill_slabs(x, packed, scales_and_zeros, kernel_g, inter, found, gated=True)


def _int4_prefill_slabs(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_g: int,
                        n_cols: int, found, gated: bool) -> torch.Tensor:
    """``[T, n_cols]``: the two functions above. Plain: the pack's rows (``packed.shape[0]``, a multiple of 64, the last
    block maybe padded past ``n_cols``) slab by slab, mode 0. Gated: ``n_cols`` gate rows, each slab with its up rows
    (layout 2 for AMX, 3 for dpbf16), mode 2. Raises ``ValueError`` for a shape the expansion refuses."""
    from pagedllm.layers.quantization import cpu_kernels

    backend, kern, layout = found
    lib = cpu_kernels.get_lib()
    linear = getattr(kern, backend.linear)
    m, k = x.shape
    n_pad = packed.shape[0]
    is_bf16 = int(scales_and_zeros.dtype == torch.bfloat16)
    per_row = 2 if gated else 1  # weight rows expanded per row of the slab
    layout, mode, n_src = (2 + layout, 2, n_cols) if gated else (layout, 0, n_pad)  # gated: 2 AMX's, 3 dpbf16's
    slab_rows = max(64, INT4_PREFILL_SLAB_WEIGHTS // (per_row * k) // 64 * 64)
    buf = torch.empty(per_row * min(slab_rows, n_src) * k, dtype=torch.bfloat16)
    out = torch.empty(m, n_cols, dtype=torch.bfloat16)
    for r0 in range(0, n_cols, slab_rows):
        r1 = min(n_src, r0 + slab_rows)
        rc = lib.int4_dequant_packed_bf16(packed.data_ptr(), scales_and_zeros.data_ptr(), is_bf16, k, kernel_g, n_pad,
                                          r0 // 64, r1 // 64, layout, buf.data_ptr())
        if rc != 0:
            raise ValueError(f"int4 prefill: bad shape (N_pad {n_pad}, K {k}, group {kernel_g}, gated {gated})")
        if r0 == 0 and r1 == n_cols:
            linear(x.data_ptr(), m, k, buf.data_ptr(), per_row * r1, None, out.data_ptr(), mode)
        else:
            y = torch.empty(m, r1 - r0, dtype=torch.bfloat16)
            linear(x.data_ptr(), m, k, buf.data_ptr(), per_row * (r1 - r0), None, y.data_ptr(), mode)
            c1 = min(r1, n_cols)
            out[:, r0:c1] = y[:, : c1 - r0]
    return out


def int4_silu_mul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_g: int, n_out: int,
                  layout: str = INT4_OURS) -> Optional[torch.Tensor]:
    """``silu(gate) * up [T, n_out / 2]`` of an int4 SwiGLU gate_up layer (``x [T, K]`` bf16) in a step with prefill
    rows on a packed bf16 GEMM (``int4_prefill_backend``): those through ``int4_prefill_silu_mul``, the decode rows as
    ``int4_matmul`` then ``silu_and_mul`` (``by_row_kind``), the bits of ``int4_matmul`` then ``silu_and_mul`` for
    every row. None where that path doesn't apply (no prefill rows, no such GEMM, invariance off, a padded or odd
    shape): the caller then runs those two."""
    from pagedllm import kernels
    from pagedllm.attention.cpu_kernels import silu_mul
    from pagedllm.layers.quantization import cpu_kernels

    rows = getattr(_step, "rows", None)
    t, k = x.shape if x.dim() == 2 else (0, 0)
    inter = n_out // 2
    if (rows is None or rows.prefill is None or rows.num_tokens != t or x.dtype != torch.bfloat16
            or layout != INT4_OURS or packed.shape[0] != n_out or n_out % 128 or not kernels.config().batch_invariant
            or cpu_kernels.get_lib() is None or not cpu_kernels.int4_gemv_supported()):
        return None
    found = int4_prefill_backend(k)
    if found is None:
        return None
    x = x.contiguous()

    def decode(xd: torch.Tensor) -> torch.Tensor:
        return silu_mul(cpu_kernels.int4_gemv_bf16(xd, packed, scales_and_zeros, kernel_g, n_out))

    return by_row_kind(x, rows, lambda xp: int4_prefill_silu_mul(xp, packed, scales_and_zeros, kernel_g, inter, found),
                       decode)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_g: int,
                n_out: int, out_dtype: Optional[torch.dtype] = None, layout: str = INT4_OURS) -> torch.Tensor:
    """``x [T, K] @ w.T -> [T, n_out]`` in ``out_dtype`` (default x's dtype; float32 for logits).

    Batch invariant (``KernelConfig.batch_invariant``, the default): each row's kernel depends on the row, never on
    how many rows share the call, and both kernels' per-row arithmetic is independent of T. bf16 where the level has
    the integer-dot kernel: decode rows (and rows of unknown kind, e.g. logits) on it, prefill rows
    (``step_rows``) on the packed bf16 GEMM over tiles expanded to bf16 (``int4_prefill_bf16``) where that runs AMX,
    or dpbf16 with ``KernelConfig.int4_prefill_kernel`` ``bf16`` (the default at ``avx512_bf16``), else on that
    kind (by default the integer-dot kernel on 15-bit activations, as decode rows); without the integer-dot kernel
    our C tile kernel (``int4_gemm``, float32 weights) for every row; level ``none``: aten's op (not guaranteed
    invariant). With invariance off the path is picked by T (``INT4_GEMM_MIN_TOKENS``). ``layout``: the pack's
    (``PackedInt4.pack``); our kernels read only ``INT4_OURS``, aten's op only aten's own; a pack neither can read is
    expanded for a dense matmul.
    """
    from pagedllm import kernels
    from pagedllm.layers.quantization import cpu_kernels

    t = x.shape[0]
    out_dtype = out_dtype or x.dtype
    if layout != INT4_OURS or cpu_kernels.get_lib() is None:
        if out_dtype == torch.float32 and x.dtype != torch.float32:
            x, scales_and_zeros = x.float(), scales_and_zeros.float()
        if layout == aten_int4_layout() and t < DENSE_FALLBACK_MIN_TOKENS:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, kernel_g, scales_and_zeros)
        else:
            y = F.linear(x, PackedInt4.expand(packed, scales_and_zeros, kernel_g, x.dtype, layout))
        return y[:, :n_out].contiguous() if y.shape[1] != n_out else y
    invariant = kernels.config().batch_invariant
    if x.dtype == torch.bfloat16 and cpu_kernels.int4_gemv_supported() and (invariant or t <= INT4_GEMV_MAX_TOKENS):
        rows = getattr(_step, "rows", None) if invariant and out_dtype == x.dtype else None
        gemv = cpu_kernels.int4_gemv_bf16
        if rows is None or rows.num_tokens != t or rows.prefill is None:
            return gemv(x.contiguous(), packed, scales_and_zeros, kernel_g, n_out, out_dtype)
        x = x.contiguous()
        found = int4_prefill_backend(x.shape[1])
        if found is not None:
            def prefill(xp: torch.Tensor) -> torch.Tensor:
                return int4_prefill_bf16(xp, packed, scales_and_zeros, kernel_g, n_out, found)
        elif (kind := kernels.config().int4_prefill_kernel) == "float":
            def prefill(xp: torch.Tensor) -> torch.Tensor:
                return cpu_kernels.int4_gemm(xp, packed, scales_and_zeros, kernel_g, n_out)
        elif kind == "int16":  # the decode rows' own kernel: one call for every row
            return gemv(x, packed, scales_and_zeros, kernel_g, n_out, out_dtype)
        else:  # the integer-dot kernel on 8-bit activations (KernelConfig.int4_prefill_kernel "int8")
            def prefill(xp: torch.Tensor) -> torch.Tensor:
                return gemv(xp, packed, scales_and_zeros, kernel_g, n_out, out_dtype, 8)
        return by_row_kind(x, rows, prefill,
                           lambda xd: gemv(xd, packed, scales_and_zeros, kernel_g, n_out, out_dtype))
    if out_dtype == torch.float32 and x.dtype != torch.float32:  # float32 sums out: the float32 kernels
        x, scales_and_zeros = x.float(), scales_and_zeros.float()
    lib = cpu_kernels.get_lib() if x.dtype in (torch.bfloat16, torch.float32) else None
    if lib is not None and kernels.config().batch_invariant:
        return cpu_kernels.int4_gemm(x.contiguous(), packed, scales_and_zeros, kernel_g, n_out)
    aten_reads_ours = aten_int4_layout() == INT4_OURS  # aten's op (a few rows, invariance off) needs our layout
    if t >= DENSE_FALLBACK_MIN_TOKENS or (lib is None and not aten_reads_ours):
        if lib is not None:
            w = cpu_kernels.int4_expand(packed, scales_and_zeros, kernel_g, x.dtype)
        else:
            w = PackedInt4.expand(packed, scales_and_zeros, kernel_g, x.dtype)
        y = F.linear(x, w)
    elif lib is not None and (t >= INT4_GEMM_MIN_TOKENS or not aten_reads_ours):
        return cpu_kernels.int4_gemm(x.contiguous(), packed, scales_and_zeros, kernel_g, n_out)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, kernel_g, scales_and_zeros)
    if y.shape[1] != n_out:
        y = y[:, :n_out].contiguous()
    return y


INT8_LOGITS_MAX_TOKENS = 32  # int8_logits re-converts each weight tile per 4 rows: from 64 rows the tiled gemm wins


def int8_logits(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, unit_scale: torch.Tensor) -> torch.Tensor:
    """Logits of a per-row int8 LM head: ``x [T, K] @ (q * scale[:, None]).T -> [T, N]`` float32, ``scale [N]``
    float32 applied to float32 sums. Batch invariant (the default): our C kernel for every T where it runs;
    otherwise it only takes up to ``INT8_LOGITS_MAX_TOKENS`` rows. Without it (level ``none``): aten's int8 op on
    float32 activations (float32 sums, ~12x slower than in bf16, but no bf16 rounding of the logits).
    ``unit_scale``: ones in x's dtype (kept for the callers' buffers)."""
    from pagedllm import kernels
    from pagedllm.layers.quantization import cpu_kernels

    if (x.shape[1] % 16 == 0 and x.dtype in (torch.bfloat16, torch.float32) and cpu_kernels.get_lib() is not None
            and (kernels.config().batch_invariant or x.shape[0] <= INT8_LOGITS_MAX_TOKENS)):
        return cpu_kernels.int8_logits(x.contiguous(), q, scale)
    return torch.ops.aten._weight_int8pack_mm(x.float(), q, scale.float())


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [T, K] @ (q * scale[:, None]).T -> [T, N]`` (``scale`` in x's dtype). Batch invariant (the default): the
    C tiled kernel for every T where it runs (K % 32 == 0); otherwise aten's op below ``INT8_GEMM_MIN_TOKENS`` rows
    (49152x576 at M=32: aten 44 ms, C 34 ms; M=128: 358 / 118 ms)."""
    from pagedllm import kernels
    from pagedllm.layers.quantization import cpu_kernels

    if (x.shape[1] % 32 == 0 and x.dtype in (torch.bfloat16, torch.float32) and cpu_kernels.get_lib() is not None
            and (kernels.config().batch_invariant or x.shape[0] >= INT8_GEMM_MIN_TOKENS)):
        return cpu_kernels.int8_gemm(x.contiguous(), q, scale)
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)
