"""Torch-tensor wrappers of pagedllm's CPU kernels (``pagedllm/kernels/csrc``), each with a torch fallback.

Kernels (C + OpenMP, AVX-512 where the CPU has it, scalar C otherwise):
- ``paged_decode`` (``kernels/csrc/paged_decode.c``): decode attention straight from the paged KV cache (its score pass on
  AMX tiles where the AMX library runs);
- ``prefill_attention``: prefill attention on AMX tiles (``kernels/csrc/amx_attention.c``, in the ``amx`` library);
- ``paged_prefill`` (``kernels/csrc/paged_prefill.c``): chunk-invariant prefill attention where the AMX kernel doesn't
  run (each query row's bits independent of its chunk and batch; VDPBF16PS for bf16 with AVX512-BF16, else float32
  FMAs);
- ``add_rms_norm``, ``silu_and_mul``, ``rope_and_cache``, ``argmax_rows`` (``kernels/csrc/cpu_ops.c``): fused element-wise
  passes that replace 2-8 torch ops each (per-op dispatch and OpenMP overhead dominate at decode batch sizes).

The library (``cpu`` in ``pagedllm.kernels.bindings``) is built and loaded by ``pagedllm.kernels`` for the active ISA
level; with none (level ``none``, ``PAGEDLLM_CPU_KERNELS=0``, no compiler) every wrapper returns None/False and the
caller takes its torch path.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from pagedllm import kernels

if TYPE_CHECKING:
    from pagedllm.attention.torch_attn import PrefillBatch


def get_lib() -> Optional[ctypes.CDLL]:
    """The kernels' library for the active level, or None: level ``none``, disabled, or no compiler."""
    return kernels.lib("cpu")


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, rows: Optional[torch.Tensor], out: torch.Tensor, scale: float,
                 window: Optional[int]) -> bool:
    """Decode attention for ``n`` requests straight from the paged cache, into ``out`` (same layout as ``q``).

    Shapes: ``q/out [num_tokens, H, D]`` (``out`` contiguous; ``q`` may have a row stride); ``k_cache/v_cache [num_blocks, BS, KVH, D]`` contiguous;
    ``block_tables [n, max_blocks]`` int64; ``seq_lens [n]`` int64; ``rows [n]`` int64 (rows of q/out) or None
    (rows 0..n-1). Returns False (doing nothing) when the kernel can't run here (then use the torch path).
    """
    lib = get_lib()
    if lib is None or q.device.type != "cpu":
        return False
    if q.dtype == torch.bfloat16:
        fn = lib.paged_decode_bf16
        _sync_decode_amx(lib)
    elif q.dtype == torch.float32:
        fn = lib.paged_decode_f32
    else:
        return False
    n = block_tables.shape[0]
    H, D = q.shape[1], q.shape[2]
    BS, KVH = k_cache.shape[1], k_cache.shape[2]
    if H // KVH > 64 or q.stride(2) != 1 or q.stride(1) != D or not (
            out.is_contiguous() and k_cache.is_contiguous()
                             and v_cache.is_contiguous() and block_tables.is_contiguous()):
        return False
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
       seq_lens.data_ptr(), rows.data_ptr() if rows is not None else None, out.data_ptr(), n, H, KVH, D, BS,
       float(scale), int(window or 0), q.stride(0))
    return True


_DECODE_AMX: dict[int, bool] = {}  # id(library) -> whether its AMX score pass is on


def _sync_decode_amx(lib: ctypes.CDLL) -> None:
    """Switches ``lib``'s decode AMX score pass on where the AMX library runs (it holds the process's tile state) and
    the active ``KernelConfig`` allows AMX attention; only a library built for level ``amx`` has that pass."""
    want = kernels.config().amx_attention and _amx_lib() is not None
    if _DECODE_AMX.get(id(lib)) != want:
        lib.paged_decode_use_amx(int(want))
        _DECODE_AMX[id(lib)] = want


def _amx_lib() -> Optional[ctypes.CDLL]:
    return kernels.lib("amx")  # None below level amx; loading it asks the OS for the tile state


def _fused_fn(x: torch.Tensor, base: str):
    """The C function ``base_bf16`` / ``base_f32`` for ``x`` (CPU, contiguous), or None (use torch)."""
    lib = get_lib()
    name = {torch.bfloat16: "_bf16", torch.float32: "_f32"}.get(x.dtype)
    if lib is None or name is None or not x.is_cpu or not x.is_contiguous():
        return None
    return getattr(lib, base + name)


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """Fused ``residual = x + residual; y = rms_norm(residual) * weight`` over rows of ``x [T, H]``.

    Returns ``(y, new_residual)`` (``new_residual`` is None when ``residual`` is None), or None when the C kernel
    can't run (other dtype or device, non-contiguous input, no compiler): the caller then uses torch.
    Numerics: see ``csrc/cpu_ops.c`` (same roundings as the torch ops it replaces).
    """
    fn = _fused_fn(x, "add_rms_norm")
    if fn is None or x.dim() != 2 or weight.dtype != x.dtype:
        return None
    T, H = x.shape
    out = torch.empty_like(x)
    if residual is None:
        fn(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), None, T, H, eps)
        return out, None
    if residual.dtype != x.dtype or not residual.is_contiguous() or residual.shape[0] != T:
        return None
    res_out = torch.empty_like(x)
    fn(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), res_out.data_ptr(), T, H, eps)
    return out, res_out


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float, groups: int = 1,
                   out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Gemma's RMSNorm ``rms_norm(x.float(), scale).to(bf16)`` over the ``groups`` heads of ``D = scale.numel()``
    values at the start of each row of bf16 ``x [T, >= groups * D]`` (rows may be strided, e.g. a fused qkv slice)
    -> ``out [T, groups * D]`` (given: any row stride, contiguous within a row; else a new contiguous tensor).
    ``scale`` is ``1 + weight`` in float32. Returns None when the C kernel can't run (other dtype or device, no
    compiler): the caller then uses torch. Numerics: ``csrc/cpu_ops.c`` (float32 norm, one rounding)."""
    lib = get_lib()
    if (lib is None or x.dtype != torch.bfloat16 or not x.is_cpu or x.dim() != 2 or x.stride(1) != 1
            or scale.dtype != torch.float32 or not scale.is_contiguous()):
        return None
    T, D = x.shape[0], scale.numel()
    if x.shape[1] < groups * D:
        return None
    if out is None:
        out = x.new_empty((T, groups * D))
    elif out.dtype != x.dtype or out.dim() != 2 or out.stride(1) != 1 or tuple(out.shape) != (T, groups * D):
        return None
    lib.gemma_rms_norm_bf16(x.data_ptr(), x.stride(0), scale.data_ptr(), out.data_ptr(), out.stride(0), T, groups, D,
                            eps)
    return out


def _act_and_mul(gate_up: torch.Tensor, fn) -> Optional[torch.Tensor]:
    """``act(gate) * up`` by the C function ``fn`` for ``gate_up [T, 2 * I]`` (gate first) -> ``[T, I]``; None when
    ``fn`` is None or ``gate_up`` isn't 2-D."""
    if fn is None or gate_up.dim() != 2:
        return None
    T, I2 = gate_up.shape
    out = gate_up.new_empty((T, I2 // 2))
    fn(gate_up.data_ptr(), out.data_ptr(), T, I2 // 2)
    return out


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> Optional[torch.Tensor]:
    """``F.gelu(gate, approximate="tanh") * up`` for bf16 ``gate_up [T, 2 * I]`` (gate first) -> ``[T, I]`` (Gemma's
    GeGLU; same two roundings); None when the C kernel can't run."""
    return _act_and_mul(gate_up, _fused_fn(gate_up, "gelu_tanh_mul") if gate_up.dtype == torch.bfloat16 else None)


def silu_and_mul(gate_up: torch.Tensor) -> Optional[torch.Tensor]:
    """``silu(gate) * up`` for ``gate_up [T, 2 * I]`` (gate first) -> ``[T, I]``; None when the C kernel can't run."""
    return _act_and_mul(gate_up, _fused_fn(gate_up, "silu_mul"))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul``, or torch's ``F.silu(gate) * up`` where the C kernel can't run: never None."""
    act = silu_and_mul(gate_up)
    if act is None:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
    return act


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [N, V]`` float32 or bfloat16 -> ``[N]`` int64, the first index of each row's maximum (NaN counts as the
    maximum), as ``torch.argmax(x, -1)`` but one vectorized pass (torch's CPU argmax reads ~0.4 GB/s here). Falls
    back to torch."""
    fn = _fused_fn(x, "argmax_rows")
    if fn is None or x.dim() != 2 or x.shape[1] == 0:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    fn(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    return out


def sample_rows(logits: torch.Tensor, inv_temperature: torch.Tensor, u: torch.Tensor,
                min_p: Optional[torch.Tensor] = None, top_k: Optional[torch.Tensor] = None,
                top_p: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Inverse-CDF draws, one per row, truncation included (``sample_rows_f32`` in kernels/csrc/cpu_ops.c): ``[R]``
    int64, the first kept token (in index order) where the running sum of kept weights passes ``u`` times their
    total.

    ``logits [R, V]`` float32 (unit stride along V), weighted ``exp((x - max) * inv_temperature[r])`` (a softmax at
    that temperature; -inf logits never drawn). Optional ``[R]`` truncations (vLLM's order, the sampler's semantics):
    ``min_p`` (drop ``p < min_p * max p``; 0 = off), ``top_k`` (keep ``p >=`` the k-th largest; 0 = off), ``top_p``
    (then the smallest prefix by descending ``p`` whose mass reaches ``top_p`` of what is left; 1 = off). ``u [R]``:
    uniforms in [0, 1) (float64). A row's draw depends only on its own row and ``u``, not on the other rows or the
    thread count. None where the C kernel can't run (the caller falls back to torch).

    Raises:
        MemoryError: the kernel could not allocate its scratch (about ``R * V / 50`` bytes, 64 KB a thread, and
            up to 32 bytes a candidate token of a truncated row)."""
    lib = get_lib()
    if (lib is None or logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0
            or logits.stride(1) != 1 or logits.device.type != "cpu"):
        return None
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.int64)
    u = u.to(torch.float64).contiguous()
    t = inv_temperature.to(torch.float32).contiguous()
    mp = None if min_p is None else min_p.to(torch.float32).contiguous()
    tk = None if top_k is None else top_k.to(torch.int64).contiguous()
    tp = None if top_p is None else top_p.to(torch.float32).contiguous()
    rc = lib.sample_rows_f32(logits.data_ptr(), R, V, logits.stride(0), t.data_ptr(),
                             None if mp is None else mp.data_ptr(), None if tk is None else tk.data_ptr(),
                             None if tp is None else tp.data_ptr(), u.data_ptr(), out.data_ptr())
    if rc != 0:
        raise MemoryError(f"sample_rows: no memory for the sampler's scratch ({R} rows x {V} tokens)")
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> bool:
    """``logits[rows[i], t] = -inf`` where bit ``t`` of ``bitmask[i]`` is 0, in place (xgrammar's int32 token
    bitmask ``[len(rows), ceil(V / 32)]``; logits ``[N, V]`` float32 contiguous, ``rows`` int64). One C pass (xgrammar's
    own CPU kernel took ~3 ms for 16 rows of a 49k vocabulary); False when the C kernel can't run (use torch)."""
    lib = get_lib()
    if (lib is None or logits.dtype != torch.float32 or not logits.is_contiguous() or logits.dim() != 2
            or bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or rows.dtype != torch.int64):
        return False
    if bitmask.shape[1] * 32 < logits.shape[1] or bitmask.shape[0] != rows.shape[0]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} doesn't cover logits {tuple(logits.shape)} / rows")
    lib.apply_token_bitmask_f32(logits.data_ptr(), logits.shape[1], rows.data_ptr(), rows.shape[0],
                                bitmask.data_ptr(), bitmask.shape[1], logits.shape[1])
    return True


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Rotates q and k of ``qkv [T, (H + 2 * KVH) * D]`` in place (NeoX rotate-half RoPE) and writes K and V into
    ``kv_cache [2, num_blocks, block_size, KVH, D]`` at ``slot_mapping [T]``: one C pass instead of ~8 torch ops.

    ``cos`` is the ``[T, 1, D]`` view ``RotaryEmbedding`` returns (its sine lies ``D`` elements after it in the
    same ``[T, 2, D]`` gather). Same roundings as ``apply_rotary`` + ``index_copy_``. Returns False (doing nothing)
    when the kernel can't run here; the caller then takes the torch path.
    """
    fn = _fused_fn(qkv, "rope_cache")
    if (fn is None or qkv.dim() != 2 or head_dim > 512 or head_dim % 2 or cos.dtype != qkv.dtype
            or cos.stride(2) != 1 or cos.shape[-1] != head_dim or kv_cache.dtype != qkv.dtype
            or not kv_cache.is_contiguous() or slot_mapping.dtype != torch.int64
            or not slot_mapping.is_contiguous()):
        return False
    T = qkv.shape[0]
    fn(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), cos.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
       slot_mapping.data_ptr(), T, num_heads, num_kv_heads, head_dim)
    return True


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: "PrefillBatch",
                      out: torch.Tensor, scale: float, window: Optional[int]) -> bool:
    """Causal attention of every prefill slice of a step, straight from the paged cache, on AMX tiles
    (``csrc/amx_attention.c``); this step's K/V must already be in the cache.

    Shapes: ``q [num_tokens, H, D]`` bf16 (rows may have a stride; ``q.stride(1) == D``), ``out`` the same,
    contiguous; ``k_cache/v_cache [num_blocks, BS, KVH, D]`` bf16 contiguous. ``batch`` (``PrefillBatch``) gives each
    slice's first row, new tokens and context length, and the block tables. Query ``i`` of a slice with ``c`` cached
    tokens sees keys ``j <= c + i`` (and ``c + i - j < window`` with a sliding window). Returns False (doing nothing)
    where the kernel can't run: not level ``amx``, ``amx_attention`` off, not bf16, ``D % 32 != 0`` or ``D > 128``,
    ``BS % 16 != 0``; the caller then uses torch's SDPA.
    """
    if not kernels.config().amx_attention or q.dtype != torch.bfloat16 or q.device.type != "cpu":
        return False
    H, D = q.shape[1], q.shape[2]
    BS, KVH = k_cache.shape[1], k_cache.shape[2]
    if (D % 32 or D > 128 or BS % 16 or H % KVH or q.stride(2) != 1 or q.stride(1) != D
            or k_cache.dtype != torch.bfloat16 or not (out.is_contiguous() and k_cache.is_contiguous()
                                                      and v_cache.is_contiguous())):
        return False
    lib = _amx_lib()
    if lib is None:
        return False
    ws = batch.workspace(KVH, D)
    lib.amx_prefill_attention_bf16(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                   batch.block_tables.data_ptr(), batch.block_tables.shape[1],
                                   batch.q_starts.data_ptr(), batch.q_lens.data_ptr(), batch.seq_lens.data_ptr(),
                                   batch.q_starts.shape[0], out.data_ptr(), H, KVH, D, BS, float(scale),
                                   int(window or 0), ws.data_ptr())
    return True


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: "PrefillBatch",
                  out: torch.Tensor, scale: float, window: Optional[int]) -> bool:
    """Causal attention of every prefill slice of a step, straight from the paged cache (``csrc/paged_prefill.c``);
    this step's K/V must already be in the cache. Each query row's result is a function of the row alone (its q, its
    position and the K/V it sees), never of how the prompt was cut into chunks or what else the step holds: with
    torch's SDPA a request's output would depend on its neighbours (they move its chunk boundaries).

    Shapes as ``prefill_attention``: ``q [num_tokens, H, D]`` (rows may have a stride; ``q.stride(1) == D``),
    ``out`` the same, contiguous; ``k_cache/v_cache [num_blocks, BS, KVH, D]`` contiguous, bf16 or float32 like ``q``.
    Returns False (doing nothing) where it can't run: no C library (level ``none``), ``batch_invariant`` off (then
    torch's SDPA, often faster), another dtype, ``D`` odd or > 256, more than 16 query heads per KV head.
    """
    if not kernels.config().batch_invariant or q.device.type != "cpu":
        return False
    lib = get_lib()
    if lib is None or q.dtype not in (torch.bfloat16, torch.float32) or k_cache.dtype != q.dtype:
        return False
    H, D = q.shape[1], q.shape[2]
    BS, KVH = k_cache.shape[1], k_cache.shape[2]
    if (q.stride(2) != 1 or q.stride(1) != D or not (out.is_contiguous() and k_cache.is_contiguous()
                                                     and v_cache.is_contiguous())):
        return False
    is_bf16 = int(q.dtype == torch.bfloat16)
    ws = batch._ws.get(("paged_prefill", KVH, D, is_bf16))
    if ws is None:
        nbytes = lib.paged_prefill_ws_bytes(batch.seq_lens.data_ptr(), batch.seq_lens.shape[0], KVH, D, is_bf16)
        ws = torch.empty(max(int(nbytes), 64), dtype=torch.uint8)
        batch._ws[("paged_prefill", KVH, D, is_bf16)] = ws
    fn = lib.paged_prefill_bf16 if is_bf16 else lib.paged_prefill_f32
    rc = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), batch.block_tables.data_ptr(),
            batch.block_tables.shape[1], batch.q_starts.data_ptr(), batch.q_lens.data_ptr(), batch.seq_lens.data_ptr(),
            batch.q_starts.shape[0], out.data_ptr(), H, KVH, D, BS, float(scale), int(window or 0), ws.data_ptr())
    return rc == 0
