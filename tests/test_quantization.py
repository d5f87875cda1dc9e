"""Quantized linears (``--quantization``): each scheme against ``x @ dequant(W).T``, tiny models quantized vs
dequantized, and the real SmolLM2 GGUF (memory, greedy output).

GPTQ and AWQ fixtures: no such checkpoint can be downloaded here, so ``gptq_pack`` / ``awq_pack`` below build them
from a tiny random weight with a plain round-to-nearest quantizer, written from the formats' documented packing:
- GPTQ: AutoGPTQ ``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py`` ``QuantLinear.pack`` (the layout vLLM's
  ``gptq.py`` and GPTQModel read): ``qweight [K/8, N]`` int32 with input ``8r + j`` in bits ``4j`` of row ``r``;
  ``qzeros [G, N/8]`` int32 with output ``8c + j`` in bits ``4j`` of column ``c``, storing ``zero - 1``;
  ``scales [G, N]`` fp16; ``g_idx [K]`` int32 (act-order: groups follow a permutation of the inputs).
- AWQ: AutoAWQ ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear``: ``qweight [K, N/8]`` int32 packed along
  the outputs with ``order_map = [0, 2, 4, 6, 1, 3, 5, 7]`` (nibble ``i`` holds output ``8c + order_map[i]``),
  ``qzeros [K/g, N/8]`` packed the same way (no offset), ``scales [K/g, N]`` fp16.
The reference weight is computed from the integer codes before packing, so packing and unpacking are both checked.

Tolerances (``x`` standard normal): float32 activations ``atol = rtol = 1e-4`` (summation order only; the int4 op
accumulates in float32); bfloat16 activations: relative error of the output's norm below 1% (scale/zero and the
output are rounded to bf16).
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from pagedllm import kernels
from pagedllm.config import EngineArgs
from pagedllm.layers.quantization import QuantConfig, QuantLinear, resolve_quant_config
from pagedllm.layers.quantization.awq import AWQ_ORDER
from pagedllm.layers.quantization.gguf import GGUFWeight
from pagedllm.layers.quantization.kernels import (DENSE_FALLBACK_MIN_TOKENS, INT4_GEMM_MIN_TOKENS, INT8_GEMM_MIN_TOKENS,
                                                  Int8Rows)
from pagedllm.model_loader import load_model
from test_loader import VOCAB, _greedy, _model_config, _randomize_norms, _tiny_llama_cfg, _write_gguf

F32_TOL = dict(atol=1e-4, rtol=1e-4)
BF16_REL = 0.01


def _check(layer: QuantLinear, ref_w: torch.Tensor, k: int) -> None:
    """Forward on each path vs ``x @ ref_w.T`` (float32): batch invariant (one kernel for every row count), and with
    that off the per-size paths (aten ops, C batched kernels, expand + dense); the float32 logits too."""
    torch.manual_seed(1)
    for invariant in (True, False):
        with kernels.use(dataclasses.replace(kernels.config(), batch_invariant=invariant)):
            for t in (1, INT4_GEMM_MIN_TOKENS - 1, INT4_GEMM_MIN_TOKENS + 7, INT8_GEMM_MIN_TOKENS + 5,
                      DENSE_FALLBACK_MIN_TOKENS + 3):
                x = torch.randn(t, k, dtype=layer.dtype)
                got = layer(x).float()
                ref = x.float() @ ref_w.t()
                if layer.dtype == torch.float32:
                    torch.testing.assert_close(got, ref, **F32_TOL)
                else:
                    assert (got - ref).norm() / ref.norm() < BF16_REL
                logits = layer.logits(x)
                assert logits.dtype == torch.float32
                assert (logits - ref).norm() / ref.norm() < (1e-5 if layer.dtype == torch.float32 else BF16_REL)


# ---------------------------------------------------------------- GGUF


# K-quants gguf can't quantize: random blocks with small finite f16 super-scales at these byte offsets.
_K_QUANT_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def _gguf_weight(qtype, n: int, k: int, seed: int = 0) -> GGUFWeight:
    rng = np.random.default_rng(seed)
    if qtype in _K_QUANT_SCALE_OFFSETS:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(n * k // block_size, type_size), dtype=np.uint8)
        for off in _K_QUANT_SCALE_OFFSETS[qtype]:
            blocks[:, off : off + 2] = np.full((len(blocks), 1), 2e-3, dtype=np.float16).view(np.uint8)
        return GGUFWeight(qtype, (n, k), torch.from_numpy(blocks.reshape(n, -1)))
    blocks = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    return GGUFWeight(qtype, (n, k), torch.from_numpy(blocks.copy()))


def _no_kquant_kernels(monkeypatch) -> None:
    """As without a C compiler (or ``PAGEDLLM_CPU_KERNELS=0``): GGUF types fall back to the requantizations."""
    from pagedllm.layers.quantization import kquant

    monkeypatch.setattr(kquant, "get_lib", lambda: None)


def _check_kquant(layer: QuantLinear, ref_w: torch.Tensor, k: int) -> None:
    """Forward at several batch sizes vs ``x @ ref_w.T`` within the kquant bound (tests/test_kquant.py derives it:
    activations of the decode rows' width for the dtype per block of 32 (15 bits: max|x| / 16256 steps, 8 bits:
    max|x| / 127), then float32 sums; plus one rounding of a bf16 output)."""
    from pagedllm import kernels

    step = 16256 if kernels.config().kquant_decode_bits(layer.dtype) == 16 else 127
    torch.manual_seed(1)
    for t in (1, 3, 9, 37):
        x = torch.randn(t, k, dtype=layer.dtype)
        got = layer(x).double()
        xd, wd = x.double(), ref_w.double()
        ref = xd @ wd.t()
        xs = xd.abs().view(t, -1, 32).amax(-1).repeat_interleave(32, 1) / step
        bound = 0.504 * xs @ wd.abs().t() + 2.0**-18 * (xd.abs() @ wd.abs().t())
        if layer.dtype == torch.bfloat16:
            bound += ref.abs() * 2.0**-8
        assert ((got - ref).abs() <= bound).all(), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [True, False], ids=["kquant", "no_kquant_kernels"])
@pytest.mark.parametrize("qtype,n,k,kind,fallback", [
    (Q.Q4_0, 64, 96, "int4", "int4"), (Q.Q4_1, 37, 160, "int4", "int4"), (Q.Q4_1, 192, 576, "int4", "int4"),
    (Q.Q8_0, 100, 96, "kquant", "int8"), (Q.Q5_0, 48, 64, "kquant", "int8"), (Q.Q4_K, 40, 256, "kquant", "int4"),
    (Q.Q6_K, 16, 256, "kquant", "int8"),
])
def test_gguf_linear_equals_dequantized(qtype, n, k, kind, fallback, kernels, dtype, monkeypatch):
    from pagedllm.layers.quantization import kquant

    if not kernels or kquant.get_lib() is None:  # switched off, or no C library at this ISA level (none)
        _no_kquant_kernels(monkeypatch)
        kind = fallback
    w = _gguf_weight(qtype, n, k)
    layer = QuantLinear(k, n, False, dtype, QuantConfig("gguf"))
    layer.load_shard(0, "weight", w)
    layer.process_weights_after_loading()
    assert layer.kind == kind
    gguf_ref = torch.from_numpy(dequantize(w.data.numpy(), qtype)).reshape(n, k).float()
    if kind == "kquant":  # kept as stored: exactly the file's values
        assert torch.equal(layer.dequantized_weight(), gguf_ref)
        _check_kquant(layer, gguf_ref, k)
    elif qtype in (Q.Q4_0, Q.Q4_1):  # exact layouts: the layer holds the GGUF values (scale/zero in the act dtype)
        if dtype == torch.float32:
            torch.testing.assert_close(layer.dequantized_weight(), gguf_ref, atol=1e-6, rtol=1e-6)
        _check(layer, gguf_ref, k)
    else:  # requantized at load: the layer computes with its own weight, which stays near GGUF's
        if kind == "int8" and dtype == torch.float32:  # within half a per-row int8 step
            step = gguf_ref.abs().amax(1, keepdim=True) / 127
            assert ((layer.dequantized_weight() - gguf_ref).abs() <= step * 0.501).all()
        assert (layer.dequantized_weight() - gguf_ref).norm() / gguf_ref.norm() < (0.02 if kind == "int8" else 0.1)
        _check(layer, layer.dequantized_weight(), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_torch_paths_without_c_kernel(monkeypatch, dtype):
    from pagedllm.layers.quantization import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "get_lib", lambda: None)  # as after a failed build: aten op and torch only
    w = _gguf_weight(Q.Q4_1, 72, 128)
    layer = QuantLinear(128, 72, False, dtype, QuantConfig("gguf"))
    layer.load_shard(0, "weight", w)
    layer.process_weights_after_loading()
    _check(layer, w.dequantize(), 128)


def test_int4_gemv_prefetch_distance_changes_no_bit(monkeypatch):
    """The decode kernel's prefetch distance and kind (``KernelConfig.int4_prefetch_bytes``, ``weight_prefetch_hint``)
    are only hints: 32 B, 2 KB and 64 KB ahead, into L1 or non-temporal (a build of its own), give the same bits, and
    the library in use follows the active config."""
    from pagedllm.layers.quantization import cpu_kernels
    from pagedllm.layers.quantization import kernels as K

    if not cpu_kernels.int4_gemv_supported():
        pytest.skip("no int4 decode kernel at this level")
    torch.manual_seed(3)
    pk = K.PackedInt4.pack(K.quantize_int4_minmax(torch.randn(200, 1536), 32), torch.bfloat16)
    kg = int(pk["kernel_group"])
    x = torch.randn(3, 1536).bfloat16()
    outs, libs, calls = [], {}, []
    real = kernels.set_value
    monkeypatch.setattr(kernels, "set_value", lambda lib, setter, v: calls.append((setter, v)) or real(lib, setter, v))
    for hint in ("cache", "nta"):
        for dist in (32, 2048, 65536):
            cfg = dataclasses.replace(kernels.config(), int4_prefetch_bytes=dist, weight_prefetch_hint=hint)
            with kernels.use(cfg):
                outs.append(cpu_kernels.int4_gemv_bf16(x, pk["packed"], pk["scales_and_zeros"], kg, 200))
                libs[hint] = cpu_kernels.get_lib()
    assert [v for s, v in calls if s == "int4_set_prefetch_bytes"][:3] == [32, 2048, 65536]
    assert libs["cache"] is not libs["nta"]  # the non-temporal build
    assert len(outs) == 6 and all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("n,k,group", [(37, 160, 32), (130, 256, 64), (64, 512, 128), (200, 512, 256)])
def test_int4_gemv_matches_float64(n, k, group, monkeypatch):
    """The integer-dot decode kernel (bf16 rows <= INT4_GEMV_MAX_TOKENS) vs float64 over the same int4 weight: within
    the bf16 rounding of the output plus the 15-bit activation rounding (2^-15 of a group's largest |x|), also for
    rows whose values span six orders of magnitude; and int4_matmul sends those rows to it."""
    from pagedllm.layers.quantization import cpu_kernels
    from pagedllm.layers.quantization import kernels as K

    if not cpu_kernels.int4_gemv_supported():
        pytest.skip("CPU without AVX512-VNNI/VBMI/BF16: int4_matmul uses aten's op")
    torch.manual_seed(n)
    pk = K.PackedInt4.pack(K.quantize_int4_minmax(torch.randn(n, k), group), torch.bfloat16)
    kg = int(pk["kernel_group"])
    w = K.PackedInt4.expand(pk["packed"], pk["scales_and_zeros"], kg, torch.float32)[:n].double()
    calls = []
    real = cpu_kernels.int4_gemv_bf16
    monkeypatch.setattr(cpu_kernels, "int4_gemv_bf16", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in (1, 2, 3, 5, K.INT4_GEMV_MAX_TOKENS):
        x = torch.randn(m, k)
        x[0] *= torch.logspace(-3, 3, k)[torch.randperm(k)]  # a row with a wide range inside each group
        x = x.bfloat16()
        got = K.int4_matmul(x, pk["packed"], pk["scales_and_zeros"], kg, n).double()
        ref = x.double() @ w.t()
        amax = x.double().abs().view(m, k // group, group).amax(-1).repeat_interleave(group, 1)  # [m, k]
        slack = 2.0**-15 * amax @ w.abs().t()
        assert got.shape == (m, n)
        assert ((got - ref).abs() <= ref.abs() * 2.0**-8 + slack + 1e-30).all(), m
    assert calls == [1, 2, 3, 5, K.INT4_GEMV_MAX_TOKENS]
    x = torch.randn(K.INT4_GEMV_MAX_TOKENS + 1, k).bfloat16()  # more rows: still this kernel (batch invariant) ...
    K.int4_matmul(x, pk["packed"], pk["scales_and_zeros"], kg, n)
    assert len(calls) == 6
    with kernels.use(dataclasses.replace(kernels.config(), batch_invariant=False)):  # ... else the C gemm
        K.int4_matmul(x, pk["packed"], pk["scales_and_zeros"], kg, n)
    assert len(calls) == 6


@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_int4_gemv_rows_equal_each_row_alone(group):
    """The integer-dot kernel (15-bit and 8-bit activations) and the C tile kernel give each row the bits it gets
    alone, at every row count (AVX2: one row per pass, or 2+ rows sharing each group's widened codes, 16 rows at a
    time; VNNI: rows in pairs), in both output dtypes,
    on rows from 2^-40 to 2^40 (the quantization is per row and group; a row mixed up with another, a group's
    scale applied to the wrong row or a stale buffer would change bits)."""
    from pagedllm.layers.quantization import cpu_kernels
    from pagedllm.layers.quantization import kernels as K

    if not cpu_kernels.int4_gemv_supported():
        pytest.skip("no integer-dot kernel at this level")
    torch.manual_seed(group)
    n, k = 200, 1024
    pk = K.PackedInt4.pack(K.quantize_int4_minmax(torch.randn(n, k), group), torch.bfloat16)
    args = (pk["packed"], pk["scales_and_zeros"], int(pk["kernel_group"]), n)
    m = 37  # two full chunks of 16 and a tail
    x = torch.randn(m, k) * torch.pow(2.0, torch.randint(-40, 40, (m, 1)).float())
    x[5] *= torch.logspace(-6, 6, k)
    x[9] = 0
    x = x.bfloat16()
    for dtype in (torch.bfloat16, torch.float32):
        together = cpu_kernels.int4_gemv_bf16(x, *args, dtype)
        for rows in (range(m), [range(0, 2), range(3, 20), range(20, 37)]):
            for r in rows:
                r = [r] if isinstance(r, int) else list(r)
                alone = cpu_kernels.int4_gemv_bf16(x[r].contiguous(), *args, dtype)
                assert torch.equal(together[r], alone), (dtype, r)
    assert (together[9] == 0).all() and together.isfinite().all()
    together = cpu_kernels.int4_gemv_bf16(x, *args, torch.bfloat16, 8)  # prefill rows below AMX: 8-bit activations
    for r in range(m):
        assert torch.equal(together[r], cpu_kernels.int4_gemv_bf16(x[r:r + 1].contiguous(), *args, torch.bfloat16,
                                                                    8)[0]), r
    assert (together[9] == 0).all() and together.isfinite().all()
    together = cpu_kernels.int4_gemm(x, *args)  # the C tile kernel (batch invariance off, no integer-dot kernel)
    for r in range(m):
        assert torch.equal(together[r], cpu_kernels.int4_gemm(x[r:r + 1].contiguous(), *args)[0]), r


def test_int4_rows_take_their_kernel_by_kind_not_by_batch():
    """Batch invariant: in a step marked by ``step_rows``, decode rows run on the integer-dot kernel (15-bit
    activations) and prefill rows on AMX tiles or, below AMX, ``KernelConfig.int4_prefill_kernel``, so each
    row's bits are those it gets alone (a 1-token decode step, or its prompt alone)."""
    from pagedllm.layers.packed_linear import linear_backend
    from pagedllm.layers.quantization import cpu_kernels
    from pagedllm.layers.quantization import kernels as K

    if not cpu_kernels.int4_gemv_supported():
        pytest.skip("no integer-dot kernel at this level: int4_gemm takes every row")
    torch.manual_seed(0)
    pk = K.PackedInt4.pack(K.quantize_int4_minmax(torch.randn(200, 256), 32), torch.bfloat16)
    mm = lambda x: K.int4_matmul(x, pk["packed"], pk["scales_and_zeros"], 32, 200)  # noqa: E731
    # 2 decode rows of 42 (the step through the prefill kernel, the decode rows recomputed: by_row_kind), then 3 of
    # 11 (the kinds' rows gathered apart)
    for lens in ([1, 30, 1, 10], [1, 5, 1, 3, 1]):
        x = torch.randn(sum(lens), 256).bfloat16()
        with K.step_rows(lens):
            y = mm(x)
        s0 = 0
        for q in lens:
            with K.step_rows([q]):
                alone = mm(x[s0:s0 + q].contiguous())
            assert torch.equal(y[s0:s0 + q], alone), (lens, s0, q)
            s0 += q
        with K.step_rows([1] * len(x)):
            assert torch.equal(mm(x)[0], y[0])  # a decode row among others
        if kernels.config().level != "amx":  # below AMX: a prefill row is int4_prefill_kernel's
            for kind in ("bf16", "float", "int16", "int8"):
                with kernels.use(dataclasses.replace(kernels.config(), int4_prefill=kind)):
                    found = K.int4_prefill_backend(256)
                    assert (found is not None) == (kind == "bf16" and linear_backend(32, 32) is not None), kind
                    with K.step_rows(lens):
                        y = mm(x)
                args = (x[1:1 + lens[1]].contiguous(), pk["packed"], pk["scales_and_zeros"], 32, 200)
                if kind == "bf16" and found is None:
                    continue  # no packed bf16 GEMM at this level: the integer kernel took it (checked above)
                want = (K.int4_prefill_bf16(*args, found) if kind == "bf16" else cpu_kernels.int4_gemm(*args)
                        if kind == "float" else cpu_kernels.int4_gemv_bf16(*args, torch.bfloat16,
                                                                            8 if kind == "int8" else 16))
                assert torch.equal(y[1:1 + lens[1]], want), (lens, kind)
                assert torch.equal(y[0], cpu_kernels.int4_gemv_bf16(x[0:1], pk["packed"], pk["scales_and_zeros"],
                                                                    32, 200)[0]), (lens, kind)


def test_int4_gemv_amx_int8_gives_the_vnni_bits():
    """``int4_gemv_bf16`` on AMX-INT8 tiles (calls of ``int4_gemv_amx_min_rows()`` rows or more, level ``amx``) gives
    its VNNI loop's bits: the same exact int32 sums and float32 epilogue, for groups of 32, 64 and 128 (one or two
    tile products a group), row counts around the 16-row tiles, and the bf16, float32 (logits) and 8-bit-activation
    forms."""
    from pagedllm.kernels.config import cpu_flags
    from pagedllm.layers.quantization import cpu_kernels
    from pagedllm.layers.quantization import kernels as K

    if kernels.config().level != "amx" or "amx_int8" not in cpu_flags() or not kernels.config().amx_linear:
        pytest.skip("AMX-INT8 runs only at level amx on a CPU with it")
    lo = cpu_kernels.int4_gemv_amx_min_rows()
    assert lo > 1
    off = dataclasses.replace(kernels.config(), amx_linear=False)
    with kernels.use(off):
        assert cpu_kernels.int4_gemv_amx_min_rows() == 0
    torch.manual_seed(0)
    for g, (n, k) in [(32, (200, 256)), (64, (130, 512)), (128, (576, 1536))]:
        pk = K.PackedInt4.pack(K.quantize_int4_minmax(torch.randn(n, k), g), torch.bfloat16)
        for m in (lo - 1, lo, 16, 17, 40):
            x = torch.randn(m, k).bfloat16()
            x[0, :g] = 0  # a zero group
            for dtype, bits in ((torch.bfloat16, 16), (torch.float32, 16), (torch.bfloat16, 8)):
                args = (x, pk["packed"], pk["scales_and_zeros"], g, n, dtype, bits)
                y = cpu_kernels.int4_gemv_bf16(*args)
                with kernels.use(off):
                    want = cpu_kernels.int4_gemv_bf16(*args)
                assert torch.equal(y, want), (g, m, dtype, bits)


@pytest.mark.parametrize("slab_weights", [1 << 21, 64 * 256])
def test_int4_silu_mul_equals_matmul_then_silu_and_mul(slab_weights, monkeypatch):
    """An int4 SwiGLU gate_up in a step with prefill rows on a packed bf16 GEMM (``int4_silu_mul``: prefill rows
    through the AMX or dpbf16 GEMM's gated epilogue over the gated expansion, ``int4_dequant_packed_bf16`` layout 2 or
    3; decode rows the integer kernel then ``silu_and_mul``) gives the bits of ``int4_matmul`` then ``silu_and_mul``,
    in one slab or in slabs of 64 gate rows; None outside a step with prefill rows. Below AMX with the ``bf16``
    prefill kind (the default at avx512_bf16; forced here, so the avx2 build's dpbf16 runs it too)."""
    cfg = kernels.config()
    with kernels.use(cfg if cfg.level == "amx" else dataclasses.replace(cfg, int4_prefill="bf16")):
        _int4_silu_mul_case(slab_weights, monkeypatch)


def _int4_silu_mul_case(slab_weights, monkeypatch):
    from pagedllm.attention.cpu_kernels import silu_and_mul
    from pagedllm.layers.quantization import kernels as K

    if K.int4_prefill_backend(256) is None:
        pytest.skip("no packed bf16 GEMM at this level")
    monkeypatch.setattr(K, "INT4_PREFILL_SLAB_WEIGHTS", slab_weights)
    torch.manual_seed(0)
    inter, k = 192, 256
    pk = K.PackedInt4.pack(K.quantize_int4_minmax(torch.randn(2 * inter, k), 32), torch.bfloat16)
    args = (pk["packed"], pk["scales_and_zeros"], 32, 2 * inter)
    for lens in ([1, 30, 1, 10], [1, 5, 1, 3, 1], [12]):
        x = torch.randn(sum(lens), k).bfloat16()
        with K.step_rows(lens):
            fused = K.int4_silu_mul(x, *args)
            want = silu_and_mul(K.int4_matmul(x, *args))
        assert fused is not None and torch.equal(fused, want), lens
    with K.step_rows([1, 1]):
        assert K.int4_silu_mul(x[:2], *args) is None  # decode rows only: the caller's two calls
    assert K.int4_silu_mul(x, *args) is None  # outside a step


@pytest.mark.parametrize("lens", [[1, 40, 1], [1, 3, 1, 1, 2], [7], [2, 1, 1]])
def test_by_row_kind_gives_each_row_its_kind_s_function(lens):
    """``by_row_kind``: prefill rows get ``prefill``'s result and decode rows ``decode``'s, whether it recomputes a few
    decode rows over a whole-step prefill call or gathers the two kinds apart; a function sees only rows of its
    kind, except ``prefill``, which may see the whole step."""
    from pagedllm.layers.quantization import kernels as K

    x = torch.randn(sum(lens), 8)
    seen = {"prefill": [], "decode": []}

    def fn(kind, add):
        def f(rows):
            seen[kind].append(rows.shape[0])
            return rows * 2 + add
        return f

    with K.step_rows(lens):
        y = K.by_row_kind(x, K.current_step_rows(), fn("prefill", 0.0), fn("decode", 100.0))
    is_dec = torch.zeros(sum(lens), dtype=torch.bool)
    at = 0
    for q in lens:
        is_dec[at] = q == 1
        at += q
    want = x * 2 + 100.0 * is_dec[:, None]
    assert torch.equal(y, want)
    n_dec = int(is_dec.sum())
    assert seen["decode"] == ([n_dec] if n_dec else [])
    recompute = n_dec <= len(x) * K.RECOMPUTE_DECODE_MAX_FRACTION
    assert seen["prefill"] == [len(x) if recompute else len(x) - n_dec]


@pytest.mark.parametrize("layout", [0, 1])
def test_int4_prefill_bf16_is_the_expanded_weight_through_the_packed_gemm(layout):
    """Prefill rows on AMX (``int4_prefill_bf16``): the pack expanded slab by slab straight into the packed layout of
    a bf16 GEMM (0 AMX, 1 dpbf16) gives ``x @ int4_expand(...).T`` within the bound of float32 sums and one bf16
    rounding, for an N that takes two slabs and a padded last block (2100 outputs of 2112, K 1024); each row's bits
    are those it gets alone; and ``int4_matmul`` sends a step's prefill rows there (where AMX runs)."""
    from pagedllm.layers.packed_linear import LINEAR_BACKENDS
    from pagedllm.layers.quantization import cpu_kernels
    from pagedllm.layers.quantization import kernels as K

    backend = LINEAR_BACKENDS[layout]
    kern = kernels.lib(backend.library)
    if cpu_kernels.get_lib() is None or kern is None or not backend.enabled(kernels.config()):
        pytest.skip(f"no {backend.name} packed GEMM at this level")
    torch.manual_seed(layout)
    n, k = 2100, 1024
    assert n * k > K.INT4_PREFILL_SLAB_WEIGHTS
    pk = K.PackedInt4.pack(K.quantize_int4_minmax(torch.randn(n, k), 32), torch.bfloat16)
    packed, sz, g = pk["packed"], pk["scales_and_zeros"], int(pk["kernel_group"])
    found = (backend, kern, layout)
    x = torch.randn(45, k).bfloat16()
    y = K.int4_prefill_bf16(x, packed, sz, g, n, found)
    assert y.shape == (45, n) and y.dtype == torch.bfloat16
    w = cpu_kernels.int4_expand(packed, sz, g, torch.bfloat16)[:n].double()
    ref = x.double() @ w.T
    bound = (x.double().abs() @ w.abs().T) * 2.0 ** -20 + ref.abs() * 2.0 ** -8
    assert ((y.double() - ref).abs() <= bound).all()
    for r in (0, 17, 44):
        assert torch.equal(y[r], K.int4_prefill_bf16(x[r:r + 1].contiguous(), packed, sz, g, n, found)[0]), r
    with pytest.raises(ValueError, match="bad shape"):
        K.int4_prefill_bf16(x[:, :1000].contiguous(), packed[:, :500].contiguous(), sz[:31].contiguous(), g, n,
                            found)
    if K.int4_prefill_backend(k) == found:
        with K.step_rows([45]):
            assert torch.equal(K.int4_matmul(x, packed, sz, g, n), y)


def test_int4_avx2_library_gives_the_vnni_kernels_bits():
    """The library built for level avx2 (x86-64-v3: no AVX-512) has the integer-dot kernels too (vpmaddwd over the
    codes widened to 16 bits, the activations' 15-bit / 22-bit integers whole or in two int16 parts): int4 GEMV
    (bf16 and float32 out; 8-bit activations for prefill rows) and int8 logits within the float64 bounds of the
    activation rounding, on a row spanning six orders of magnitude; its C tile gemm and scalar int8 logits too. Where
    the CPU also runs avx512_bf16, every one of them equals the AVX-512 build's bits (same integers, same float
    operations in the same order)."""
    if "avx2" not in kernels.supported_levels():
        pytest.skip("CPU below x86-64-v3")
    from pagedllm.layers.quantization import kernels as K

    lib2 = kernels.load("int4", "avx2")
    assert lib2 is not None and lib2.int4_gemv_bf16_supported() == 1
    torch.manual_seed(0)
    n, k, g, m = 100, 256, 32, 5
    pk = K.PackedInt4.pack(K.quantize_int4_minmax(torch.randn(n, k), g), torch.bfloat16)
    packed, sz = pk["packed"], pk["scales_and_zeros"]
    w = K.PackedInt4.expand(packed, sz, g, torch.float32)[:n].double()
    x = torch.randn(m, k)
    x[1] *= torch.logspace(-3, 3, k)[torch.randperm(k)]
    x = x.bfloat16()
    q8 = Int8Rows.quantize(torch.randn(70, k))

    def run(lib):
        outs = {}
        for name, dtype in (("int4_gemv_bf16", torch.bfloat16), ("int4_gemv_bf16_f32", torch.float32),
                            ("int4_gemv_bf16_a8", torch.bfloat16)):
            o = torch.empty(m, n, dtype=dtype)
            getattr(lib, name)(x.data_ptr(), m, k, packed.data_ptr(), sz.data_ptr(), g, packed.shape[0], n,
                               o.data_ptr())
            outs[name] = o
        o = torch.empty(m, n, dtype=torch.bfloat16)
        lib.int4_gemm(x.data_ptr(), m, k, packed.data_ptr(), sz.data_ptr(), g, packed.shape[0], n, o.data_ptr(), 1)
        outs["int4_gemm"] = o
        for name in ("int8_logits", "int8_logits_vnni"):
            o = torch.empty(m, 70)
            getattr(lib, name)(x.data_ptr(), m, k, q8.q.data_ptr(), q8.scale.data_ptr(), 70, o.data_ptr(), 1)
            outs[name] = o
        return outs

    got = run(lib2)
    ref = x.double() @ w.t()
    amax = x.double().abs().view(m, k // g, g).amax(-1).repeat_interleave(g, 1)
    slack = 2.0**-15 * amax @ w.abs().t() + 1e-30
    assert ((got["int4_gemv_bf16_f32"].double() - ref).abs() <= 2.0**-20 * ref.abs() + slack).all()
    assert ((got["int4_gemv_bf16"].double() - ref).abs() <= 2.0**-8 * ref.abs() + slack).all()
    assert ((got["int4_gemv_bf16_a8"].double() - ref).abs() <= 2.0**-8 * ref.abs() + 2**15 / 254 * slack).all()
    torch.testing.assert_close(got["int4_gemm"].double(), ref, atol=2e-2, rtol=1e-2)
    ref8 = (x.double() @ q8.q.double().t()) * q8.scale.double()
    row_amax = x.double().abs().amax(1, keepdim=True)
    slack8 = 2.0**-21 * row_amax * (q8.q.double().abs() * q8.scale.double()[:, None]).sum(1)
    assert ((got["int8_logits_vnni"].double() - ref8).abs() <= 2.0**-20 * ref8.abs() + slack8).all()
    torch.testing.assert_close(got["int8_logits"].double(), ref8, atol=1e-4, rtol=1e-5)
    if "avx512_bf16" in kernels.supported_levels():
        lib5 = kernels.load("int4", "avx512_bf16")
        assert lib5.int4_gemv_bf16_supported() == 1
        for name, want in run(lib5).items():
            if name in ("int4_gemm", "int8_logits"):  # float32 FMAs in another grouping: close, not equal
                torch.testing.assert_close(got[name].float(), want.float(), atol=1e-4, rtol=1e-2)
            else:
                assert torch.equal(got[name], want), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [96, 128])  # 128: the integer-dot decode kernel where the CPU has AVX512-VNNI
def test_int8_embedding_logits_equal_dequantized(dtype, k, monkeypatch):
    """The tied int8 LM head (a Q8_0 table without the kquant kernels): float32 logits on the decode kernels
    (<= INT8_LOGITS_MAX_TOKENS rows) and on the batched path, vs x @ dequant(W).T in float64; the lookup returns
    the dequantized rows."""
    from pagedllm.layers.quantization import QuantEmbedding
    from pagedllm.layers.quantization.kernels import INT8_LOGITS_MAX_TOKENS

    _no_kquant_kernels(monkeypatch)

    n = 1000
    emb = QuantEmbedding(n, k, dtype, QuantConfig("gguf"))
    emb.load_shard(0, "weight", _gguf_weight(Q.Q8_0, n, k))
    emb.process_weights_after_loading()
    assert emb.kind == "int8"
    ref_w = emb.qweight.double() * emb.scale.double()[:, None]
    torch.manual_seed(2)
    for t in (1, 3, INT8_LOGITS_MAX_TOKENS, INT8_LOGITS_MAX_TOKENS + 9):
        x = torch.randn(t, k, dtype=dtype)
        got = emb.logits(x)
        assert got.dtype == torch.float32 and got.shape == (t, n)
        ref = x.double() @ ref_w.t()
        tol = 1e-5 if dtype == torch.float32 or t <= INT8_LOGITS_MAX_TOKENS else 1e-2  # fallback rounds to bf16
        assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < tol, t
    ids = torch.tensor([0, 7, n - 1])
    torch.testing.assert_close(emb(ids).double(), ref_w[ids].to(dtype).double())


def test_gguf_fused_shards_stack_in_order():
    sizes = (64, 32, 32)
    ws = [_gguf_weight(Q.Q4_1, s, 128, seed=i) for i, s in enumerate(sizes)]
    layer = QuantLinear(128, sum(sizes), True, torch.float32, QuantConfig("gguf"), sizes)
    for i in (2, 0, 1):  # any arrival order
        layer.load_shard(i, "weight", ws[i])
    layer.bias.data.normal_()
    layer.process_weights_after_loading()
    ref = torch.cat([w.dequantize() for w in ws])
    x = torch.randn(3, 128)
    torch.testing.assert_close(layer(x), x @ ref.t() + layer.bias, **F32_TOL)


def test_gguf_mixed_shards_fall_back_to_int8():
    layer = QuantLinear(256, 96, False, torch.float32, QuantConfig("gguf"), (64, 32))
    layer.load_shard(0, "weight", _gguf_weight(Q.Q4_0, 64, 256))
    layer.load_shard(1, "weight", _gguf_weight(Q.Q6_K, 32, 256))
    layer.process_weights_after_loading()
    assert layer.kind == "int8"
    _check(layer, layer.dequantized_weight(), 256)


def test_int8_weight_only_from_dense():
    w = torch.randn(45, 96)
    layer = QuantLinear(96, 45, False, torch.float32, QuantConfig("int8"))
    layer.load_shard(0, "weight", w)
    layer.process_weights_after_loading()
    assert layer.kind == "int8"
    assert (layer.dequantized_weight() - w).abs().max() <= w.abs().max() / 127
    _check(layer, layer.dequantized_weight(), 96)


# ---------------------------------------------------------------- GPTQ / AWQ reference quantizer and packers


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy((x.numpy().astype(np.int64) & 0xFFFFFFFF).astype(np.uint32).view(np.int32))


def _pack_rows(q: torch.Tensor) -> torch.Tensor:  # [8R, C] codes -> [R, C]: row 8r + j at bits 4j
    q = q.long().view(-1, 8, q.shape[1])
    return _to_int32(sum(q[:, j] << (4 * j) for j in range(8)))


def _pack_cols(q: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:  # [R, 8C] -> [R, C]: nibble i = col order[i]
    q = q.long().view(q.shape[0], -1, 8)
    return _to_int32(sum(q[:, :, order[i]] << (4 * i) for i in range(8)))


def rtn_quantize(w: torch.Tensor, group_size: int, sym: bool, g_idx: torch.Tensor):
    """Round-to-nearest 4-bit per (group, output). Returns ``q [K, N]``, ``zeros [G, N]``, ``scales [G, N]`` fp16 and
    the reference weight ``[N, K]`` = ``scales[g_idx[k], n] * (q[k, n] - zeros[g_idx[k], n])``."""
    n, k = w.shape
    n_groups = k // group_size
    q = torch.empty(k, n, dtype=torch.int64)
    zeros = torch.empty(n_groups, n, dtype=torch.int64)
    scales = torch.empty(n_groups, n, dtype=torch.float16)
    for g in range(n_groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols]  # [N, group]
        if sym:
            s = (wg.abs().amax(1) / 7.5).clamp_min(1e-8)
            z = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).clamp_min(1e-8)
            z = torch.round(-lo / s).long().clamp(0, 15)
        s16 = s.half()
        q[cols] = torch.round(wg / s16.float()[:, None] + z[:, None]).clamp(0, 15).long().t()
        zeros[g], scales[g] = z, s16
    ref = (scales.float()[g_idx] * (q - zeros[g_idx]).float()).t()  # [N, K]
    return q, zeros, scales, ref


def gptq_pack(w: torch.Tensor, group_size: int, sym: bool, act_order: bool, seed: int = 0):
    """GPTQ tensors ``{qweight, qzeros, scales, g_idx}`` for ``w [N, K]`` and the reference weight."""
    n, k = w.shape
    g_idx = torch.arange(k, dtype=torch.int32) // group_size
    if act_order:  # groups formed in a permuted input order, as desc_act does
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int32).index_copy_(0, perm, g_idx)
    q, zeros, scales, ref = rtn_quantize(w, group_size, sym, g_idx.long())
    t = {"qweight": _pack_rows(q), "qzeros": _pack_cols(zeros - 1), "scales": scales, "g_idx": g_idx}
    return t, ref


def awq_pack(w: torch.Tensor, group_size: int):
    n, k = w.shape
    q, zeros, scales, ref = rtn_quantize(w, group_size, False, torch.arange(k) // group_size)
    return {"qweight": _pack_cols(q, AWQ_ORDER), "qzeros": _pack_cols(zeros, AWQ_ORDER), "scales": scales}, ref


GPTQ_CASES = [(32, True, False), (64, False, False), (128, True, True), (32, False, True), (128, False, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size,sym,act_order", GPTQ_CASES)
def test_gptq_linear_equals_dequantized(group_size, sym, act_order, dtype):
    n, k = 72, 2 * group_size + (128 if group_size == 32 else 0)
    torch.manual_seed(0)
    tensors, ref = gptq_pack(torch.randn(n, k), group_size, sym, act_order)
    layer = QuantLinear(k, n, False, dtype, QuantConfig("gptq", group_size=group_size, desc_act=act_order, sym=sym))
    for name, t in tensors.items():
        layer.load_shard(0, name, t)
    layer.process_weights_after_loading()
    assert layer.kind == "int4" and (layer.perm is not None) == act_order
    if dtype == torch.float32:
        torch.testing.assert_close(layer.dequantized_weight(), ref, atol=1e-6, rtol=1e-6)
    _check(layer, ref, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size,n", [(32, 40), (64, 24), (128, 136)])
def test_awq_linear_equals_dequantized(group_size, n, dtype):
    k = 256
    torch.manual_seed(0)
    tensors, ref = awq_pack(torch.randn(n, k), group_size)
    layer = QuantLinear(k, n, False, dtype, QuantConfig("awq", group_size=group_size, sym=False))
    for name, t in tensors.items():
        layer.load_shard(0, name, t)
    layer.process_weights_after_loading()
    assert layer.kind == "int4"
    if dtype == torch.float32:
        torch.testing.assert_close(layer.dequantized_weight(), ref, atol=1e-6, rtol=1e-6)
    _check(layer, ref, k)


# ---------------------------------------------------------------- tiny models: quantized == dequantized


def _tiny_hf(tie: bool = False):
    torch.manual_seed(0)
    cfg = _tiny_llama_cfg(tie_word_embeddings=tie, max_position_embeddings=256)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    _randomize_norms(hf)
    with torch.no_grad():  # larger weights: sharper logits, so greedy picks are not near-ties
        for name, p in hf.named_parameters():
            if "proj" in name or "embed" in name or "lm_head" in name:
                p.normal_(0, 0.08)
    return cfg, hf


def _load(path: str, quantization):
    mc = _model_config(path)
    cls = __import__("pagedllm.models.registry", fromlist=["x"]).get_model_class(mc.architecture)
    qc = resolve_quant_config(quantization, path, mc.hf_config, cls)
    from dataclasses import replace
    return load_model(replace(mc, quantization=qc))


def _assert_same_greedy(a, b, prompts, n_new: int = 8) -> None:
    for p in prompts:
        assert _greedy(a, p, n_new) == _greedy(b, p, n_new), p


# prefills on each int4 path: aten op, C batched kernel, expand + dense
PROMPTS = [[5, 6, 7], [1, 17, 93, 4, 200, 31, 8, 9, 60], list(range(10, 150))]


def test_tiny_llama_gguf_quantized_greedy_equals_dequantized(tmp_path, monkeypatch):
    import test_loader

    monkeypatch.setattr(test_loader, "_QTYPES", {
        "q_proj": Q.Q4_1, "k_proj": Q.Q4_0, "v_proj": Q.Q4_1, "o_proj": Q.Q4_0,
        "gate_proj": Q.Q4_1, "up_proj": Q.Q4_1, "down_proj": Q.Q4_0, "lm_head": Q.Q4_1,
    })
    cfg, hf = _tiny_hf()
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(path, "llama", cfg, hf.state_dict())
    quant, dense = _load(path, None), _load(path, "none")
    kinds = {m.kind for m in quant.quant_modules.values()}
    assert kinds == {"int4", "dense"}, kinds  # the F32 embedding stays dense
    assert not dense.quant_modules
    _assert_same_greedy(quant, dense, PROMPTS)


def _write_quantized_folder(folder, cfg, hf, method: str, group_size: int, sym: bool, act_order: bool) -> dict:
    """An HF folder with every linear of ``hf`` GPTQ/AWQ-packed; returns the dequantized state dict."""
    state, ref_state = {}, {}
    for name, t in hf.state_dict().items():
        if name.endswith("proj.weight"):
            base = name[: -len(".weight")]
            if method == "gptq":
                # one act-order per input size: q/k/v (and gate/up) see the same inputs, so real GPTQ
                # checkpoints give them the same g_idx
                tensors, ref = gptq_pack(t, group_size, sym, act_order, seed=t.shape[1])
            else:
                tensors, ref = awq_pack(t, group_size)
            state.update({f"{base}.{k}": v.contiguous() for k, v in tensors.items()})
            ref_state[name] = ref
        else:
            state[name] = t.contiguous()
            ref_state[name] = t
    folder.mkdir(exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    cfg_dict = cfg.to_dict()
    qcfg = {"quant_method": method, "bits": 4, "group_size": group_size}
    qcfg.update({"desc_act": act_order, "sym": sym} if method == "gptq" else {"version": "gemm", "zero_point": True})
    cfg_dict["quantization_config"] = qcfg
    (folder / "config.json").write_text(json.dumps(cfg_dict))
    return ref_state


@pytest.mark.parametrize("method,group_size,sym,act_order", [("gptq", 64, False, True), ("gptq", 128, True, False),
                                                             ("awq", 32, False, False)])
def test_tiny_llama_gptq_awq_greedy_equals_dequantized(tmp_path, method, group_size, sym, act_order):
    cfg, hf = _tiny_hf()
    ref_state = _write_quantized_folder(tmp_path / "q", cfg, hf, method, group_size, sym, act_order)
    hf.load_state_dict(ref_state)
    hf.save_pretrained(tmp_path / "dense")
    quant = _load(str(tmp_path / "q"), None)
    assert {m.kind for m in quant.quant_modules.values()} == {"int4"}
    _assert_same_greedy(quant, _load(str(tmp_path / "dense"), None), PROMPTS)


def test_quantization_errors(tmp_path):
    cfg, hf = _tiny_hf()
    _write_quantized_folder(tmp_path / "q", cfg, hf, "gptq", 64, True, False)
    hf.save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(model=str(tmp_path / "dense"), quantization="fp4").create_engine_config()
    with pytest.raises(ValueError, match=r"quantization='awq' does not match the checkpoint \(gptq\)"):
        EngineArgs(model=str(tmp_path / "q"), quantization="awq").create_engine_config()
    with pytest.raises(ValueError, match=r"quantization='gguf' does not match the checkpoint \(unquantized\)"):
        EngineArgs(model=str(tmp_path / "dense"), quantization="gguf").create_engine_config()
    with pytest.raises(ValueError, match="quantization='none'"):
        EngineArgs(model=str(tmp_path / "q"), quantization="none").create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        resolve_quant_config("int8", str(tmp_path / "dense"), cfg, type(_load(str(tmp_path / "dense"), None)), 2)
    data = json.loads((tmp_path / "q" / "config.json").read_text())
    data["quantization_config"]["bits"] = 8
    (tmp_path / "q" / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="quantization_config.bits"):
        EngineArgs(model=str(tmp_path / "q")).create_engine_config()
    assert EngineArgs(model=str(tmp_path / "dense")).create_engine_config().model.quantization is None
    assert EngineArgs(model=str(tmp_path / "dense"), quantization="int8").create_engine_config().model.quantization \
        == QuantConfig("int8")


@torch.no_grad()
def _dense_twin(quant, dense):
    """``dense`` with every quantized module's weight replaced by what that module computes with."""
    for name, mod in quant.quant_modules.items():
        dense.get_submodule(name).weight.copy_(mod.dequantized_weight())
    return dense


def test_tiny_llama_gguf_requantized_types_greedy_equals_their_dequantized_weights(tmp_path, monkeypatch):
    import test_loader

    monkeypatch.setattr(test_loader, "_QTYPES", {
        "embed_tokens": Q.Q8_0, "q_proj": Q.Q4_1, "k_proj": Q.Q4_1, "v_proj": Q.Q5_0, "o_proj": Q.Q5_1,
        "gate_proj": Q.Q8_0, "up_proj": Q.Q8_0, "down_proj": Q.Q4_0,
    })
    cfg, hf = _tiny_hf(tie=True)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(path, "llama", cfg, {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"})
    quant = _load(path, None)
    kinds = {n.rsplit(".", 1)[-1]: m.kind for n, m in quant.quant_modules.items()}
    # Q8_0 kept as stored; q/k Q4_1 next to v Q5_0: the fused layer goes int8; Q5_1 has no kernel
    assert kinds == {"embed_tokens": "kquant", "qkv_proj": "int8", "o_proj": "int8", "gate_up_proj": "kquant",
                     "down_proj": "int4"}, kinds
    _assert_same_greedy(quant, _dense_twin(quant, _load(path, "none")), PROMPTS)


def test_int8_weight_only_tiny_llama_greedy_equals_its_dequantized_weights(tmp_path):
    cfg, hf = _tiny_hf(tie=True)
    hf.save_pretrained(tmp_path / "dense")
    quant = _load(str(tmp_path / "dense"), "int8")
    _assert_same_greedy(quant, _dense_twin(quant, _load(str(tmp_path / "dense"), None)), PROMPTS)


def test_int8_weight_only_tiny_llama_close_to_dense(tmp_path):
    cfg, hf = _tiny_hf(tie=True)
    hf.save_pretrained(tmp_path / "dense")
    quant, dense = _load(str(tmp_path / "dense"), "int8"), _load(str(tmp_path / "dense"), None)
    assert quant.lm_head is quant.model.embed_tokens and quant.lm_head.kind == "int8"
    from test_loader import _prefill_logits

    a, b = _prefill_logits(quant, PROMPTS[0]), _prefill_logits(dense, PROMPTS[0])
    assert (a - b).norm() / b.norm() < 0.05  # per-row int8 of N(0, 0.08) weights: ~3%


# ---------------------------------------------------------------- the real SmolLM2 GGUF (Q4_1 layers, Q8_0 embedding)


def _weight_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = id(t) if t.is_mkldnn else t.data_ptr()  # oneDNN-packed bf16 weights are opaque (no data pointer)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@pytest.mark.slow
def test_smollm2_quantized_memory_and_greedy():
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    t0 = time.perf_counter()
    kw = dict(dtype="bfloat16", kv_cache_memory_bytes=64 << 20, max_model_len=512)
    quant, dense = LLM(**kw), LLM(quantization="none", **kw)
    qm, dm = (x.llm_engine.engine_core.runner.model for x in (quant, dense))
    assert qm.quant_modules and not dm.quant_modules  # the bundled GGUF runs quantized by default
    q_bytes, d_bytes = _weight_bytes(qm), _weight_bytes(dm)
    print(f"SmolLM2 weight bytes: quantized {q_bytes / 1e6:.1f} MB, bf16 {d_bytes / 1e6:.1f} MB "
          f"({q_bytes / d_bytes:.1%})")
    assert q_bytes <= 0.40 * d_bytes
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    prompts = ["The capital of France is", "def fibonacci(n):\n", "The three primary colors are"]
    exact = 0
    for a, b in zip(quant.generate(prompts, sp, use_tqdm=False), dense.generate(prompts, sp, use_tqdm=False)):
        a, b = a.outputs[0], b.outputs[0]
        if a.token_ids == b.token_ids:
            exact += 1
            continue
        i = next(k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        assert a.token_ids[i] in b.logprobs[i] and b.token_ids[i] in a.logprobs[i], f"divergence at {i}"
    print(f"greedy identical for {exact}/3 prompts; {time.perf_counter() - t0:.1f} s")


_TEACHER_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press. Within fifty years, presses were at work in more than two "
    "hundred European cities, and the price of books fell sharply. Scholars could compare identical copies of a "
    "text for the first time, which changed how knowledge was checked and shared.\n\n"
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n"
    "Question: What is the capital of France? Answer: The capital of France is Paris, which lies on the Seine.")


def _teacher_forced_logprobs(llm, text: str) -> "np.ndarray":
    """The model's log-probability of each token of ``text`` given the ones before it (``prompt_logprobs``)."""
    from pagedllm.sampling_params import SamplingParams

    o = llm.generate([text], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return np.array([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])


@pytest.mark.slow
def test_smollm2_quantized_bf16_adds_no_error_beyond_bf16():
    """Regression: with bf16-rounded per-row scales of the int8 embedding / tied LM head, the quantized model in bf16
    answered "What is the capital of France?" with "L'Etoile, la Marseillaise, ..." where float32 said Paris.

    Comparing bf16 answers can't test that: float32's first-token margin there is 0.08 nats ("The" over "L"), about
    two rms of bf16's own logprob noise, so the *dense* bf16 model flips too on some kernels (measured on a Xeon
    without AMX, level avx512_bf16: "The" -2.007 vs "L" -1.959; float32: -1.883 vs -1.965). What the quantized path
    must not do is add error of its own: teacher-forced over a text, its bf16 logprobs are as close to its float32
    ones as the dense model's bf16 logprobs are to the dense float32 ones; and in float32 both answer Paris.

    That comparison only catches gross errors (bf16 rounding noise from the layers dominates it: rounding the
    logits to bf16, or the table's scales to bf16, moves its rms by less than 0.01), so the head itself is checked
    directly: on bf16 hidden states, the bf16 model's head gives float32 logits within float32 rounding of a float64
    product with the file's table (a bf16 rounding anywhere would be a 2^-9 relative error)."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.kernels.config import LOGITS_ACT_BITS
    from pagedllm.layers.quantization.kquant import quantize_activations
    from pagedllm.sampling_params import SamplingParams

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    sp = SamplingParams(temperature=0, max_tokens=12)
    rms, heads = {}, {}
    for quantization in ("gguf", "none"):
        lps = {}
        for dtype in ("bfloat16", "float32"):
            llm = LLM(quantization=quantization, dtype=dtype, kv_cache_memory_bytes=64 << 20, max_model_len=512)
            if quantization == "gguf":
                heads[dtype] = llm.llm_engine.engine_core.runner.model.lm_head
                assert heads[dtype].kind == "kquant"  # the Q8_0 table as stored
            if dtype == "float32":
                assert "Paris" in llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0].text, (quantization, dtype)
            lps[dtype] = _teacher_forced_logprobs(llm, _TEACHER_TEXT)
            del llm
        d = lps["bfloat16"] - lps["float32"]
        rms[quantization] = float(np.sqrt(np.mean(d * d)))
    print(f"bf16 vs float32 logprob rms over {len(d)} tokens: quantized {rms['gguf']:.4f}, dense {rms['none']:.4f}")
    assert 0 < rms["gguf"] <= 1.25 * rms["none"] + 0.005, rms

    vocab, dim = heads["float32"].num_embeddings, heads["float32"].embedding_dim
    table = heads["float32"](torch.arange(vocab)).double()  # [vocab, dim]: the file's Q8_0 values (exact in float32)
    h = torch.randn(16, dim, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = heads["bfloat16"].logits(h)
    # the kernel's one approximation is its 15-bit activations (test_kquant's bound; the head keeps 15 bits in bf16
    # too, kernels.config.LOGITS_ACT_BITS); against those, float32 rounding
    xq = quantize_activations(h, bits=LOGITS_ACT_BITS).dequantize().double()
    assert got.dtype == torch.float32
    assert ((got.double() - xq @ table.T).abs() <= (dim / 16 + 16) * 2.0**-24 * (xq.abs() @ table.abs().T)).all()


@pytest.mark.parametrize("layout", ["avx512", "avx2", "default"])
def test_int4_pack_layouts_round_trip_and_aten_writes_its_own(layout):
    """Each int4 pack layout unpacks to the codes packed; aten's pack (whose layout follows its runtime CPU
    capability: ATEN_CPU_CAPABILITY=avx2 at our level avx2) is byte for byte ours of the layout we detect for it."""
    from pagedllm.layers.quantization import kernels as K

    torch.manual_seed(1)
    q = torch.randint(0, 16, (128, 96), dtype=torch.int32)
    packed = K.int4_pack_codes(q, layout)
    assert packed.shape == (128, 48) and packed.dtype == torch.uint8
    assert torch.equal(K.int4_unpack_codes(packed, layout).int(), q)
    others = [name for name in K.INT4_LAYOUTS if name != layout]
    assert all(not torch.equal(K.int4_unpack_codes(packed, o).int(), q) for o in others)
    aten = K.aten_int4_layout()
    if aten == layout:
        assert torch.equal(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8), packed)


def test_int4_pack_of_aten_layout_computes_like_ours(monkeypatch):
    """A layer packed in aten's layout (what runs where our int4 kernels don't load) and one packed in ours give the
    same weight and, through int4_matmul, the same products within bf16 rounding."""
    from pagedllm.layers.quantization import kernels as K

    aten = K.aten_int4_layout()
    if aten is None:
        pytest.skip("aten's int4 pack layout is unknown here: its op is never used")
    torch.manual_seed(2)
    w = K.quantize_int4_minmax(torch.randn(100, 256), 32)
    x = torch.randn(3, 256).bfloat16()
    weights = []
    for layout in sorted({aten, K.INT4_OURS}):
        pk = K.PackedInt4.pack(w, torch.bfloat16, layout=layout)
        assert pk["layout"] == layout
        wl = K.PackedInt4.expand(pk["packed"], pk["scales_and_zeros"], 32, torch.float32, layout)[:100]
        weights.append(wl)
        got = K.int4_matmul(x, pk["packed"], pk["scales_and_zeros"], 32, 100, torch.float32, layout).double()
        torch.testing.assert_close(got, x.double() @ wl.double().t(), atol=1e-2, rtol=1e-3)  # 15-bit x: ours
    assert all(torch.equal(a, weights[0]) for a in weights)


@pytest.mark.slow
def test_smollm2_int4_chat_answers_paris():
    """The bundled 4-bit SmolLM2 at the process's ISA level (tests/test_isa_levels.py runs this at every level the
    CPU supports, with ATen's capability capped too) knows the capital of France: a wrong int4 layout or kernel at a
    level shows here as gibberish. The prompt asks for one word: the bare question's first-token margin is 0.02-0.2
    nats ("The" vs "L'Étoile ..."), inside bf16 noise (level none answered "L'Étoile" on an AVX2-only EPYC); this
    one's is 1.5 nats, then " Paris" leads by 2.5."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(quantization="gguf", dtype="bfloat16", kv_cache_memory_bytes=32 << 20, max_model_len=256)
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                   SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    assert "Paris" in out, out
