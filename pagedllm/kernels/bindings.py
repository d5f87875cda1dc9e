"""The typed binding table: every C library of ours, its sources, the levels it is built for, and each exported
function's ``argtypes`` / ``restype`` (the prototypes are in ``csrc/pagedllm_kernels.h``; a test checks the two agree).

One loader (``pagedllm.kernels.load``) builds and binds from this table; no other module declares ctypes types.
A new backend is one more ``Library`` entry (e.g. a non-AMX bf16 linear with ``amx_linear_bf16``'s ABI).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

P, I32, I64, U64, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_float


@dataclass(frozen=True)
class Fn:
    argtypes: tuple
    restype: object = None
    optional: bool = False  # exists only in some levels' builds (missing: not bound, ``hasattr`` is False)


@dataclass(frozen=True)
class Library:
    name: str
    sources: tuple[str, ...]  # in csrc/
    levels: tuple[str, ...]  # built for these ISA levels only
    functions: dict[str, Fn] = field(default_factory=dict)
    flags: tuple[str, ...] = ("-O3", "-fopenmp")  # beyond the level's -m flags


_DECODE = Fn((P,) * 4 + (I64,) + (P,) * 3 + (I32,) * 5 + (F32, I32, I64))
_PREFILL = Fn((P, I64, P, P, P, I64, P, P, P, I32, P, I32, I32, I32, I32, F32, I32, P), I32)
_RMS = Fn((P,) * 5 + (I64, I64, F32))
_ROPE = Fn((P, I64, P, I64, P, P, P, I64, I32, I32, I32))
_ROWS = Fn((P, P, I64, I64))
_LINEAR = Fn((P, I64, I64, P, I64, P, P, I32))  # amx_linear_bf16's ABI: x, M, K, packed, N, bias, out, mode
_INT4_GEMV = Fn((P, I64, I64, P, P, I64, I64, I64, P), optional=True)
_INT8 = Fn((P, I64, I64, P, P, I64, P, I32))
# Same math flags as the fused element-wise kernels, so the AMX linear's SiLU epilogue rounds as silu_mul does.
# -ffast-math's parts, spelled out, minus -ffinite-math-only (NaN/inf stay meaningful): the flag itself (or
# -funsafe-math-optimizations) on the link line makes GCC link crtfastmath.o, whose constructor sets FTZ/DAZ in MXCSR
# for the whole process as the library loads, so torch, numpy and hypothesis would then flush subnormals to zero.
_FAST_MATH = ("-O3", "-fno-math-errno", "-fno-signed-zeros", "-fno-trapping-math", "-fassociative-math",
              "-freciprocal-math", "-fno-rounding-math", "-fno-signaling-nans", "-fcx-limited-range",
              "-fexcess-precision=fast", "-fopenmp")

LIBRARIES: dict[str, Library] = {lib.name: lib for lib in (
    Library("cpu", ("paged_decode.c", "paged_prefill.c", "cpu_ops.c"), ("amx", "avx512_bf16", "avx2"), {
        "paged_decode_bf16": _DECODE, "paged_decode_f32": _DECODE, "paged_decode_use_amx": Fn((I32,)),
        "paged_prefill_ws_bytes": Fn((P, I32, I32, I32, I32), I64),
        "paged_prefill_bf16": _PREFILL, "paged_prefill_f32": _PREFILL,
        "add_rms_norm_bf16": _RMS, "add_rms_norm_f32": _RMS,
        "gemma_rms_norm_bf16": Fn((P, I64, P, P, I64, I64, I64, I64, F32)), "gelu_tanh_mul_bf16": _ROWS,
        "rope_cache_bf16": _ROPE, "rope_cache_f32": _ROPE,
        "argmax_rows_f32": _ROWS, "argmax_rows_bf16": _ROWS, "silu_mul_bf16": _ROWS, "silu_mul_f32": _ROWS,
        "apply_token_bitmask_f32": Fn((P, I64, P, I64, P, I64, I64)),
        "sample_rows_f32": Fn((P, I64, I64, I64, P, P, P, P, P, P), I32),
        "stream_read": Fn((P, I64, I64), U64),
    }, _FAST_MATH),
    Library("amx", ("amx_linear.c", "amx_attention.c"), ("amx",), {
        "amx_supported": Fn((), I32),
        "amx_pack": Fn((P, I64, I64, P)),
        "amx_linear_bf16": _LINEAR,
        "amx_prefill_attention_bf16": Fn((P, I64, P, P, P, I64, P, P, P, I32, P, I32, I32, I32, I32, F32, I32, P)),
    }, _FAST_MATH),
    Library("dpbf16", ("dpbf16_linear.c",), ("amx", "avx512_bf16", "avx2"), {
        "dpbf16_supported": Fn((), I32),
        "dpbf16_pack": Fn((P, I64, I64, P)),
        "dpbf16_linear_bf16": _LINEAR,
        "dpbf16_set_fma_rows": Fn((I32,)),
        "dpbf16_tune": Fn((), I32),
    }, _FAST_MATH),
    Library("int4", ("int4_cpu.c",), ("amx", "avx512_bf16", "avx2"), {
        "int4_gemm": Fn((P, I64, I64, P, P, I64, I64, I64, P, I32)),
        "int4_expand": Fn((P, P, I64, I64, I64, P, I32)),
        "int4_dequant_packed_bf16": Fn((P, P, I32, I64, I64, I64, I64, I64, I32, P), I32),
        "int8_gemm": _INT8, "int8_logits": _INT8,
        "int4_gemv_bf16_supported": Fn((), I32), "int4_gemv_use_amx": Fn((I32,), I32),
        "int4_set_prefetch_bytes": Fn((I64,)),
        "int4_gemv_bf16": _INT4_GEMV, "int4_gemv_bf16_a8": _INT4_GEMV, "int4_gemv_bf16_f32": _INT4_GEMV,
        "int8_logits_vnni": Fn(_INT8.argtypes, optional=True),
    }),
    # -ffp-contract=off: the scalar path's float operations stay as written (it mirrors the vector lanes)
    Library("kquant", ("kquant_cpu.c",), ("amx", "avx512_bf16", "avx2"), {
        "kq_isa": Fn((), I32),
        "kq_set_prefetch_bytes": Fn((I64,)),
        "kq_packed_bytes": Fn((I32, I64, I64), I64),
        "kq_pack": Fn((I32, P, I64, I64, I64, P), I32),
        "kq_release_file_pages": Fn((P, I64), I32),
        "kq_quantize_act": Fn((P, I64, I64, I32, P, P, P, P, P, I32)),
        "kq_matmul": Fn((I32, P, I64, I64, P, P, P, P, P, I64, P, I64, I32, I32), I32),
        "kq_matmul_shards": Fn((P, I64, I64, P, P, P, P, P, I64, P, I64, I32, I32), I32),
        "kq_dequant_rows": Fn((I32, P, I64, I64, P, I64, P, I32), I32),
        "kq_dequant_packed_bf16": Fn((I32, P, I64, I64, I64, I64, I32, P), I32),
    }, ("-O3", "-fopenmp", "-ffp-contract=off")),
    Library("stack", ("llama_stack.c",), ("amx", "avx512_bf16", "avx2"), {
        "stack_forward": Fn((P, P)),  # (const struct stack_model *, const struct stack_step *)
        "gemma_stack_forward": Fn((P, P)),
        "stack_scratch_elems": Fn((P, I64), I64),
    }, ("-O2",)),
)}


# llama_stack.c's structs (stack_linear_t, stack_layer_t, stack_model_t, stack_step_t), field for field.
class StackLinear(ctypes.Structure):
    _fields_ = [("kind", I64), ("w", P), ("sz", P), ("bias", P), ("group", I64), ("n_pad", I64)]


class StackLayer(ctypes.Structure):
    _fields_ = [(n, StackLinear) for n in ("qkv", "o", "gate_up", "down")] + [
        (n, P) for n in ("ln_in", "ln_post", "k_cache", "v_cache")] + [("window", I64)] + [
        (n, P) for n in ("g_in", "g_post_attn", "g_pre_ff", "g_post_ff", "g_q", "g_k")] + [
        ("group", I64), ("rope_sel", I64)]


class StackModel(ctypes.Structure):
    _fields_ = [(n, I64) for n in ("num_layers", "hidden", "H", "KVH", "D", "inter", "BS")] + [
        ("eps", F32), ("scale", F32)] + [(n, P) for n in ("linear", "rms", "rope", "decode", "prefill", "int4",
                                                       "silu_mul", "kq_quant", "kq_matmul")] + [
        ("kq_act_bits", I64), ("layers", P), ("gnorm", P), ("gelu_mul", P)]


class StackKqShard(ctypes.Structure):  # kq_shard_t (pagedllm_kernels.h)
    _fields_ = [("type", I64), ("rows", I64), ("w", P)]


class StackStep(ctypes.Structure):
    _fields_ = [("T", I64), ("x", P), ("x_out", P), ("res_out", P), ("cs", P), ("cs_stride", I64),
                ("slots", P), ("n_dec", I64), ("dec_max_blocks", I64), ("dec_bt", P), ("dec_seq_lens", P),
                ("dec_rows", P), ("n_pre", I64), ("pre_max_blocks", I64), ("pre_bt", P), ("pre_q_starts", P),
                ("pre_q_lens", P), ("pre_seq_lens", P), ("pre_ws", P), ("scratch", P), ("kq_scratch", P),
                ("cs2", P), ("cs2_stride", I64), ("groups", P)]


class StackGroup(ctypes.Structure):
    _fields_ = [("slots", P), ("n_dec", I64), ("dec_max_blocks", I64), ("dec_bt", P), ("dec_seq_lens", P),
                ("dec_rows", P)]
