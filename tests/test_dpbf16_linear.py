"""The bf16 linear kernel for CPUs without AMX (pagedllm/kernels/csrc/dpbf16_linear.c), built at each ISA level this
CPU can run (AVX512-BF16, AVX2 + FMA, scalar C): every output mode against a float64 reference within the bound of
float32 accumulation plus one bf16 rounding, and batch invariance (a row's result doesn't depend on how many rows share
the call or on the thread count: torch.equal)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import kernels
from pagedllm.layers.packed_linear import _interleave_halves

# The library at each ISA level (pagedllm.kernels), and a scalar build below every level (x86-64 baseline target).
_SCALAR = (["-march=x86-64"], set())
_LIBS: dict = {}
_DP_LEVEL = {"avx512_bf16": 2, "avx2": 1, "scalar": 0}


def _lib(level: str):
    if level != "scalar" and level not in kernels.supported_levels():
        pytest.skip(f"this CPU can't run the {level} build")
    if level not in _LIBS:
        lib = kernels.load_target("dpbf16", "scalar", _SCALAR[0]) if level == "scalar" else kernels.load("dpbf16", level)
        assert lib is not None and lib.dpbf16_supported() == _DP_LEVEL[level]  # the path its flags allow
        _LIBS[level] = lib
    return _LIBS[level]


def _pack(lib, w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    w = w.contiguous()
    p = torch.empty(n * k, dtype=torch.bfloat16)
    lib.dpbf16_pack(w.data_ptr(), n, k, p.data_ptr())
    return p


def _call(lib, x, packed, n, bias, mode):
    m, k = x.shape
    n_out = n // 2 if mode == 2 else n
    out = torch.empty((m, n_out), dtype=torch.float32 if mode == 3 else torch.bfloat16)
    lib.dpbf16_linear_bf16(x.data_ptr(), m, k, packed.data_ptr(), n, None if bias is None else bias.data_ptr(),
                           out.data_ptr(), mode)
    return out


def _ref_and_bound(x, w, b):
    """float64 x @ w.T + b and the bound of a float32 sum over K (|error| <= (K + 2) u sum |x w| + |b| u, u = 2^-24,
    Higham, Accuracy and Stability of Numerical Algorithms, sec. 3.1; generous by a factor ~2)."""
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    if b is not None:
        ref, mag = ref + b.double(), mag + b.double().abs()
    return ref, (x.shape[1] + 4) * 2.0 ** -24 * mag


def _check_bf16(out, ref, acc_err):
    """out: bf16 rounding (to nearest) of a float32 sum within acc_err of ref."""
    bound = acc_err + 2.0 ** -8 * (ref.abs() + acc_err) + 1e-30
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


_LEVELS = ["avx512_bf16", "avx2", "scalar"]
# SmolLM2-135M: hidden 576, intermediate 1536, q/k/v 576 + 2 x 192; 160 and 96 end in a 32-column block.
_SHAPES = [(576, 576), (960, 576), (192, 576), (576, 1536), (160, 64), (96, 32)]


@pytest.mark.parametrize("level", _LEVELS)
@pytest.mark.parametrize("n,k", _SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_plain_modes_match_float64(level, n, k, with_bias):
    lib = _lib(level)
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen) if with_bias else None
    p = _pack(lib, w)
    for m in (1, 3, 17, 64, 300) if level != "scalar" or n * k <= 576 * 576 else (1, 17):
        x = torch.randn(m, k, generator=gen).bfloat16()
        ref, acc_err = _ref_and_bound(x, w, b)
        _check_bf16(_call(lib, x, p, n, b, 0), ref, acc_err)
        f32 = _call(lib, x, p, n, b, 3)
        assert f32.dtype == torch.float32
        assert ((f32.double() - ref).abs() <= acc_err + 1e-30).all()


@pytest.mark.parametrize("level", _LEVELS)
@pytest.mark.parametrize("inter,k", [(1536, 576), (64, 96)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gated_modes(level, inter, k, with_bias):
    """W = [gate; up] interleaved 16 rows at a time (as PackedLinear packs it): mode 1 returns [gate | up] like the
    plain matmul, mode 2 silu(gate) * up with the unfused path's roundings (gate, up, silu(gate), product to bf16)."""
    from pagedllm.attention import cpu_kernels

    lib = _lib(level)
    gen = torch.Generator().manual_seed(inter + k)
    w = torch.randn(2 * inter, k, generator=gen).bfloat16()
    b = torch.randn(2 * inter, generator=gen) if with_bias else None
    p = _pack(lib, _interleave_halves(w))
    bp = None if b is None else _interleave_halves(b[:, None])[:, 0].contiguous()
    for m in (1, 3, 17, 64, 300) if level != "scalar" else (1, 5):
        x = torch.randn(m, k, generator=gen).bfloat16()
        ref, acc_err = _ref_and_bound(x, w, b)
        gu = _call(lib, x, p, 2 * inter, bp, 1)
        _check_bf16(gu, ref, acc_err)
        act = _call(lib, x, p, 2 * inter, bp, 2)
        unfused = (F.silu(gu[:, :inter]) * gu[:, inter:]).to(torch.bfloat16)
        # the epilogue's exp is a polynomial (relative error < 2e-7): at most one bf16 ulp from torch's silu
        ulp = 2.0 ** (torch.floor(torch.log2(unfused.double().abs().clamp_min(1e-30))) - 7)
        assert ((act.double() - unfused.double()).abs() <= ulp).all()
        if level == "avx512_bf16" and kernels.config().level in ("amx", "avx512_bf16") and cpu_kernels.get_lib():
            assert torch.equal(act, cpu_kernels.silu_and_mul(gu))  # the same SIMD silu as the element-wise kernel


@pytest.mark.parametrize("level", _LEVELS)
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_batch_invariant(level, mode):
    """Each row of a 37-row call (and of a 300-row call, which splits its rows into work units) equals the same row
    computed alone, and inside calls of 2, 5, 6, 7 and 16 rows: torch.equal."""
    lib = _lib(level)
    gen = torch.Generator().manual_seed(mode)
    n, k = (3072, 576) if mode in (1, 2) else (960, 576)
    if level == "scalar":  # a smaller layer (N % 32 == 0, gated N % 64 == 0)
        n, k = (768 if mode in (1, 2) else 224), 160
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen)
    p = _pack(lib, _interleave_halves(w) if mode in (1, 2) else w)
    x = torch.randn(300 if level != "scalar" else 60, k, generator=gen).bfloat16()
    big = _call(lib, x, p, n, b, mode)
    x37 = x[:37].contiguous()
    full = _call(lib, x37, p, n, b, mode)
    assert torch.equal(full, big[:37])
    for i in range(37):
        assert torch.equal(_call(lib, x37[i:i + 1].contiguous(), p, n, b, mode), full[i:i + 1]), f"row {i}"
    for size in (2, 5, 6, 7, 16):
        for start in range(0, 37 - size + 1, size + 3):
            part = _call(lib, x37[start:start + size].contiguous(), p, n, b, mode)
            assert torch.equal(part, full[start:start + size]), (size, start)
    for i in range(0, x.shape[0], 23):
        assert torch.equal(_call(lib, x[i:i + 1].contiguous(), p, n, b, mode), big[i:i + 1]), f"row {i} of 300"


@pytest.mark.parametrize("level", _LEVELS)
@pytest.mark.parametrize("mode", [0, 3])
def test_row_panels(level, mode):
    """A call whose rows outgrow one row panel (PANEL_BYTES, 2 MB of x: here 700 rows x 4,096 = 5.7 MB, panels of
    192, 192, 192 and 124 rows; the scalar build's 400 rows: 192, 192, 16): within the float64 bound, and the rows on
    each side of every panel edge, alone, give the same bits."""
    lib = _lib(level)
    gen = torch.Generator().manual_seed(7)
    n, k, m = 160, 4096, 700 if level != "scalar" else 400
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen).bfloat16()
    p = _pack(lib, w)
    out = _call(lib, x, p, n, b, mode)
    ref, acc_err = _ref_and_bound(x, w, b)
    if mode == 3:
        assert ((out.double() - ref).abs() <= acc_err + 1e-30).all()
    else:
        _check_bf16(out, ref, acc_err)
    for i in (0, 95, 96, 191, 192, 383, 384, 575, 576, m - 1):
        if i < m:
            assert torch.equal(_call(lib, x[i:i + 1].contiguous(), p, n, b, mode), out[i:i + 1]), f"row {i}"


@pytest.mark.parametrize("level", ["avx512_bf16", "avx2"])
def test_thread_count_invariant(level):
    """The thread split only moves whole column blocks: the same bits with 1 thread as with all."""
    lib = _lib(level)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(960, 576, generator=gen).bfloat16()
    p = _pack(lib, w)
    x = torch.randn(130, 576, generator=gen).bfloat16()
    many = _call(lib, x, p, 960, None, 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _call(lib, x, p, 960, None, 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_packed_linear_dpbf16_backend():
    """PackedLinear with the AMX kernel switched off picks the dpbf16 backend on a CPU with AVX512-BF16 (or AVX2):
    forward / forward_f32 / forward_silu_mul as the kernel, equal to a float64 reference within the bound."""
    from pagedllm.layers import packed_linear
    from pagedllm.layers.packed_linear import PackedLinear

    import dataclasses

    cfg = dataclasses.replace(kernels.config(), amx_linear=False)
    with kernels.use(cfg):
        if packed_linear.linear_backend(384, 576) is None:
            pytest.skip("no dpbf16 kernel for this CPU")
        _packed_linear_case()


def _packed_linear_case():
    from pagedllm.layers.packed_linear import PackedLinear

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(384, 576, generator=gen).bfloat16()
    b = torch.randn(384, generator=gen).bfloat16()
    lin = PackedLinear(w, b, silu_gated=True)
    assert lin.backend == "dpbf16" and lin.gated
    x = torch.randn(2, 5, 576, generator=gen).bfloat16()
    ref, acc_err = _ref_and_bound(x.reshape(10, 576), w, b.float())
    y = lin(x)
    assert y.shape == (2, 5, 384)
    _check_bf16(y.reshape(10, 384), ref, acc_err)
    act = lin.forward_silu_mul(x)
    assert act.shape == (2, 5, 192)
    assert torch.equal(act, lin._run(x.reshape(10, 576).contiguous(), 2, 192).view(2, 5, 192))
    head = PackedLinear(w, None)
    logits = head.forward_f32(x)
    assert logits.dtype == torch.float32
    ref0, err0 = _ref_and_bound(x.reshape(10, 576), w, None)
    assert ((logits.reshape(10, 384).double() - ref0).abs() <= err0).all()


def _adversarial_bf16(gen, shape, lo: int, hi: int) -> torch.Tensor:
    """bf16 values of random sign and mantissa with exponents uniform in [lo, hi] (powers of two; below -126 the
    values are bf16 denormals), some exact zeros."""
    e = torch.randint(lo, hi + 1, shape, generator=gen).double()
    m = 1 + torch.rand(shape, generator=gen, dtype=torch.float64)
    s = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
    v = (s * m * torch.pow(2.0, e)).float()
    v[torch.rand(shape, generator=gen) < 0.02] = 0
    return v.bfloat16()


def _intel_model():
    """The CPU's model number if it is an Intel family-6 CPU (/proc/cpuinfo), else None."""
    info = dict(line.split(":", 1) for line in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines() if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    if info.get("vendor_id") == "GenuineIntel" and info.get("cpu family") == "6":
        return int(info.get("model", -1))
    return None


def test_fma_path_gives_vdpbf16ps_bits():
    """The AVX-512 build's FMA path (float32 FMAs, odd K first, under DAZ + FTZ) gives VDPBF16PS's bits; dpbf16_tune
    enables it only after checking that on this CPU, so a row's result is the same whichever path its call takes.
    Data the tune didn't see: activations from bf16 denormals to 2^30, weights 2^-20..2^4 (cancellations, products
    that underflow), every mode, row counts that split into every row-block remainder and into work units."""
    lib = _lib("avx512_bf16")
    rows = lib.dpbf16_tune()
    if rows == 0:
        # Sapphire/Emerald/Granite Rapids retire VDPBF16PS at half FMA's rate: there a zero means a broken FMA path
        assert _intel_model() not in (143, 173, 207), "the FMA path failed dpbf16_tune's bit check on this Xeon"
        pytest.skip("dpbf16_tune left the FMA path off on this CPU (other bits or not faster)")
    gen = torch.Generator().manual_seed(11)
    try:
        for mode in (0, 1, 2, 3):
            n, k = (1024, 320) if mode in (1, 2) else (992, 320)
            w = _adversarial_bf16(gen, (n, k), -20, 4)
            b = torch.randn(n, generator=gen)
            p = _pack(lib, _interleave_halves(w) if mode in (1, 2) else w)
            for m in (1, 5, 6, 13, 97, 200):
                x = _adversarial_bf16(gen, (m, k), -140, 30)
                lib.dpbf16_set_fma_rows(0)
                want = _call(lib, x, p, n, b, mode)
                lib.dpbf16_set_fma_rows(1)
                got = _call(lib, x, p, n, b, mode)
                assert torch.equal(got.view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32),
                                   want.view(torch.int16 if want.dtype == torch.bfloat16 else torch.int32)), (mode, m)
    finally:
        assert lib.dpbf16_tune() == rows
