"""The fused C element-wise ops (csrc/cpu_ops.c) and the oneDNN-packed linear layer equal the torch ops they
replace: bit-exact in bfloat16 (same roundings), within float32 rounding in float32."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention import cpu_kernels
from conftest import require_native
from pagedllm.layers.packed_linear import (PackedLinear, amx_linear_supported, lm_head_logits, pack_linear_weights,
                                          packing_supported)


@pytest.fixture(autouse=True)
def _lib():
    require_native(cpu_kernels.get_lib())


@pytest.mark.parametrize("rows", [1, 7, 300, 600])  # 600 x 576: over the threshold where rows run in parallel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_matches_torch(rows, dtype):
    torch.manual_seed(rows)
    H = 576
    x, res = torch.randn(rows, H).to(dtype), torch.randn(rows, H).to(dtype)
    w = (torch.rand(H) + 0.5).to(dtype)
    y, new_res = cpu_kernels.add_rms_norm(x, res, w, 1e-5)
    ref_res = x + res
    ref = F.rms_norm(ref_res, (H,), w, 1e-5)
    assert torch.equal(new_res, ref_res)
    y0, none = cpu_kernels.add_rms_norm(x, None, w, 1e-5)
    assert none is None
    if dtype == torch.bfloat16:  # one rounding at the end, as F.rms_norm: at most one ulp apart
        torch.testing.assert_close(y, ref, atol=0, rtol=2 ** -7)
        torch.testing.assert_close(y0, F.rms_norm(x, (H,), w, 1e-5), atol=0, rtol=2 ** -7)
        assert (y != ref).float().mean() < 0.01
    else:
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y0, F.rms_norm(x, (H,), w, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 500])  # 500 x 640: over the threshold where rows run in parallel
def test_gemma_rms_norm_matches_torch_on_rows_and_strided_heads(rows):
    """Gemma's RMSNorm (float32 norm and scale, one rounding) as ``F.rms_norm(x.float(), 1 + w).to(bf16)``: over
    hidden-state rows, and over the q / k heads of a fused qkv row written into slices of one buffer."""
    from pagedllm.layers.layernorm import GemmaRMSNorm

    torch.manual_seed(rows)
    H, D, NH, NKV = 640, 256, 4, 1
    norm = GemmaRMSNorm(H, 1e-6, torch.bfloat16)
    norm.weight.data = torch.randn(H).to(torch.bfloat16) * 0.5
    norm.update_scale()
    x = (torch.randn(rows, H) * 3).to(torch.bfloat16)
    ref = F.rms_norm(x.float(), (H,), 1.0 + norm.weight.float(), 1e-6).to(torch.bfloat16)
    y = cpu_kernels.gemma_rms_norm(x, norm.scale, 1e-6)
    torch.testing.assert_close(y, ref, atol=0, rtol=2 ** -7)  # at most one ulp apart (the float32 sum's order)
    assert (y != ref).float().mean() < 0.01
    assert torch.equal(norm(x), y)  # the module takes the kernel
    qn = GemmaRMSNorm(D, 1e-6, torch.bfloat16)
    qn.weight.data = torch.randn(D).to(torch.bfloat16)
    qn.update_scale()
    qkv = torch.randn(rows, (NH + 2 * NKV) * D).to(torch.bfloat16)
    out = torch.full((rows, (NH + NKV) * D), float("nan"), dtype=torch.bfloat16)
    assert qn.forward_heads(qkv, NH, out[:, :NH * D]) is not None
    ref_q = F.rms_norm(qkv[:, :NH * D].reshape(rows, NH, D).float(), (D,), qn.scale, 1e-6).to(torch.bfloat16)
    torch.testing.assert_close(out[:, :NH * D].reshape(rows, NH, D), ref_q, atol=0, rtol=2 ** -7)
    assert out[:, NH * D:].isnan().all()  # nothing written past its slice
    assert cpu_kernels.gemma_rms_norm(x.float(), norm.scale, 1e-6) is None  # bf16 only: float32 stays on torch
    assert qn.forward_heads(qkv[:, :D], NH, out[:, :NH * D]) is None  # fewer values than heads * D


def test_bf16_norms_same_bits_at_every_level_and_batch_invariant():
    """The bf16 norms sum squares in 16 fixed lanes (cpu_ops.c): the AVX-512 and AVX2 builds (and the scalar tail,
    H not a multiple of 16) give the same bits, and a row's result doesn't depend on the rows beside it (1 row vs
    600, where the rows run in parallel)."""
    import dataclasses

    from pagedllm import kernels
    from pagedllm.kernels.config import supported_levels

    torch.manual_seed(0)
    outs = {}
    for level in [lv for lv in supported_levels() if lv != "none"]:
        with kernels.use(dataclasses.replace(kernels.config(), level=level)):
            got = []
            for H in (576, 640, 100):  # 100: six lanes of tail
                g = torch.Generator().manual_seed(H)
                x = (torch.randn(600, H, generator=g) * 3).bfloat16()
                res = torch.randn(600, H, generator=g).bfloat16()
                w = (torch.rand(H, generator=g) + 0.5).bfloat16()
                y, r = cpu_kernels.add_rms_norm(x, res, w, 1e-5)
                y1, r1 = cpu_kernels.add_rms_norm(x[7:8].contiguous(), res[7:8].contiguous(), w, 1e-5)
                assert torch.equal(y1, y[7:8]) and torch.equal(r1, r[7:8])
                scale = torch.rand(H, generator=g) + 0.5
                gy = cpu_kernels.gemma_rms_norm(x, scale, 1e-6)
                assert torch.equal(cpu_kernels.gemma_rms_norm(x[7:8], scale, 1e-6), gy[7:8])
                got += [y, r, gy]
            outs[level] = got
    first = next(iter(outs.values()))
    for level, got in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, first)), level


@pytest.mark.parametrize("rows", [1, 5, 200])
def test_gelu_tanh_and_mul_matches_torch(rows):
    """Gemma's GeGLU in one pass: ``F.gelu(gate, approximate="tanh") * up`` with the same two bf16 roundings. Its
    tanh is 1 - 2 / (1 + exp(2u)), not torch's: at most one ulp apart (rarely) where the gelu is not tiny; for gates
    below about -3, 1 + tanh(u) cancels to a few float32 ulps in either, so there the two differ by those ulps
    (absolute differences ~1e-6 of a value ~1e-6). Huge and tiny gates and a tail past 16 lanes included."""
    torch.manual_seed(rows)
    I = 2048 + 13
    gu = (torch.randn(rows, 2 * I) * 4).to(torch.bfloat16)
    gu[0, :6] = torch.tensor([-200.0, -12.0, 0.0, -0.0, 12.0, 300.0])
    gate, up = gu.chunk(2, dim=-1)
    ref = F.gelu(gate, approximate="tanh") * up
    got = cpu_kernels.gelu_tanh_and_mul(gu)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=2 ** -7)
    big = F.gelu(gate, approximate="tanh").float().abs() > 1e-2
    torch.testing.assert_close(got[big], ref[big], atol=0, rtol=2 ** -7)
    assert (got[big] != ref[big]).float().mean() < 0.01
    assert torch.equal(got[0, :6], ref[0, :6])  # -200 .. 300: 0 (-0), 0, 0, -0, 12 u, 300 u
    assert cpu_kernels.gelu_tanh_and_mul(gu.float()) is None


@pytest.mark.parametrize("rows", [1, 5, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_matches_torch(rows, dtype):
    torch.manual_seed(rows)
    gu = (torch.randn(rows, 2 * 1537) * 3).to(dtype)  # odd width: no vector-length assumption
    gu[0, :10] = torch.tensor([100.0, -100.0, 1e4, -1e4, 0.0, 88.0, -88.0, 89.0, -89.0, 50.0])  # exp's clamps
    out = cpu_kernels.silu_and_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out, ref, atol=0, rtol=2 ** -7)
        assert (out != ref).float().mean() < 0.01
    else:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_fused_ops_decline_what_they_cannot_do():
    x = torch.randn(4, 8, dtype=torch.float16)
    assert cpu_kernels.add_rms_norm(x, None, torch.ones(8, dtype=torch.float16), 1e-6) is None
    assert cpu_kernels.silu_and_mul(torch.randn(4, 16)[:, ::2]) is None  # non-contiguous


@pytest.mark.skipif(not packing_supported(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 here")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(bias):
    torch.manual_seed(0)
    for out_f, in_f in [(960, 576), (49, 33), (3072, 576)]:
        lin = nn.Linear(in_f, out_f, bias=bias, dtype=torch.bfloat16)
        packed = PackedLinear(lin.weight, lin.bias)
        for rows in (1, 3, 32, 100):
            x = torch.randn(rows, in_f).bfloat16()
            torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(not amx_linear_supported(), reason="no AMX-BF16 here")
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_matches_float64(bias):
    """The AMX kernel against a float64 matmul: every row-tile tail (1-100 rows), both weight tiles of a group, and
    prefill sizes split into several (row chunk, weight chunk) work units with partial last units (300, 600 rows).
    Bound: the one bf16 rounding of the output (2^-8 relative) plus float32 summation (2^-20 of sum |x w|)."""
    torch.manual_seed(1)
    for out_f, in_f in [(960, 576), (64, 1536)]:
        w = (torch.randn(out_f, in_f) * 0.05).bfloat16()
        b = torch.randn(out_f).bfloat16() if bias else None
        packed = PackedLinear(w, b)
        assert packed.backend == "amx"
        for rows in (1, 5, 16, 17, 32, 33, 100, 300, 600):
            x = torch.randn(rows, in_f).bfloat16()
            x[0, :] *= 1000.0  # a row of a very different scale
            ref = x.double() @ w.double().T + (b.double() if bias else 0.0)
            bound = ref.abs() * 2.0 ** -8 + (x.double().abs() @ w.double().abs().T) * 2.0 ** -20
            err = (packed(x).double() - ref).abs()
            assert (err <= bound).all(), (out_f, in_f, rows, (err - bound).max().item())
            # float32 output (the LM head's logits): no bf16 rounding, so only the summation term is left
            out32 = packed.forward_f32(x)
            assert out32.dtype == torch.float32
            bound32 = ref.abs() * 2.0 ** -23 + (x.double().abs() @ w.double().abs().T) * 2.0 ** -20
            err32 = (out32.double() - ref).abs()
            assert (err32 <= bound32).all(), (out_f, in_f, rows, (err32 - bound32).max().item())
    assert PackedLinear(torch.randn(48, 64).bfloat16(), None).backend == "onednn"  # 48 % 32 != 0


@pytest.mark.skipif(not amx_linear_supported(), reason="no AMX-BF16 here")
@pytest.mark.parametrize("bias", [False, True])
def test_amx_gated_gate_up_equals_unfused(bias):
    """A SwiGLU gate_up packed gated: ``forward`` equals the plain packing's output and ``forward_silu_mul`` equals
    ``silu_and_mul`` of it, bit for bit (rows past one 256-row chunk included)."""
    torch.manual_seed(2)
    i_size, k = 96, 64
    w = (torch.randn(2 * i_size, k) * 0.2).bfloat16()
    b = torch.randn(2 * i_size).bfloat16() if bias else None
    plain, gated = PackedLinear(w, b), PackedLinear(w, b, silu_gated=True)
    assert gated.gated and not plain.gated
    for rows in (1, 17, 33, 300):
        x = torch.randn(rows, k).bfloat16()
        gate_up = plain(x)
        assert torch.equal(gated(x), gate_up)
        act = gated.forward_silu_mul(x)
        assert act.shape == (rows, i_size)
        assert torch.equal(act, cpu_kernels.silu_and_mul(gate_up))
    assert plain.forward_silu_mul(torch.randn(2, k).bfloat16()) is None


@pytest.mark.skipif(not packing_supported(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 here")
def test_pack_linear_weights_replaces_linears_and_tied_head():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16, dtype=torch.bfloat16)
            self.proj = nn.Linear(16, 16, dtype=torch.bfloat16)
            self.lm_head = self.embed

    m = Tiny()
    h = torch.randn(3, 16).bfloat16()
    ref_proj, ref_logits = F.linear(h, m.proj.weight, m.proj.bias), F.linear(h, m.embed.weight)
    assert pack_linear_weights(m) == 2
    assert isinstance(m.proj, PackedLinear) and isinstance(m.lm_head, nn.Embedding)
    torch.testing.assert_close(m.proj(h), ref_proj, atol=1e-2, rtol=1e-2)
    logits = lm_head_logits(m, h)  # float32 on every path (a 16-wide head: oneDNN, with a float32 weight copy)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, h.float() @ m.embed.weight.float().t(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits.float(), atol=1e-1, rtol=1e-2)


@pytest.mark.parametrize("level", ["avx512_bf16", "avx2"])  # the AVX-512 and the AVX2 body
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 200, 49152, 65536,
                                  151936, 262144])
def test_argmax_rows_matches_torch_including_ties_and_nan(cols, dtype, level):
    import dataclasses

    from pagedllm import kernels
    from pagedllm.kernels.config import supported_levels

    if level not in supported_levels():
        pytest.skip(f"this CPU runs below {level}")
    with kernels.use(dataclasses.replace(kernels.config(), level=level)):
        _check_argmax_rows(cols, dtype)


def _check_argmax_rows(cols, dtype):
    torch.manual_seed(cols)
    x = torch.randn(9, cols).to(dtype)
    x[1] = 0.0  # all tied: first index
    if cols > 3:
        x[2, cols - 1] = x[2, 1] = 100.0  # a tie between an early and the last column
        x[3, cols // 2] = float("nan")  # NaN counts as the maximum
        x[4, 0] = float("inf")
        # ties between the kernel's running maxima: a later lane of an earlier chunk vs an early lane of a later one,
        # and a column of the last whole 16-wide chunks vs one of the 64-wide loop
        x[5, min(47, cols - 1)] = x[5, cols - 1 - (cols - 1) % 16] = 50.0
        x[6, cols - 1] = x[6, cols - 2] = 60.0
        x[8, min(23, cols - 1)] = x[8, cols - 1 - (cols - 1) % 8] = 70.0  # the same for the AVX2 body's 8-wide tail
        x[0, cols // 2 - 1] = x[0, cols // 2] = 80.0  # a tie across the cut of a split row
        x[7, 3 * cols // 4] = float("nan")
        x[7, 5] = float("nan")  # the first NaN wins
    got = cpu_kernels.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.float().argmax(dim=-1))
    # one row alone: from 65,536 columns the threads split it (ties and NaNs on both sides of the cut at cols / 2)
    for r in range(x.shape[0]):
        assert cpu_kernels.argmax_rows(x[r : r + 1]).tolist() == x[r : r + 1].float().argmax(dim=-1).tolist(), r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H, KVH, D", [(9, 3, 64), (4, 4, 32), (2, 1, 6)])
def test_rope_and_cache_matches_torch_path(dtype, H, KVH, D):
    from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary

    torch.manual_seed(H * D)
    T, NB, BS = 7, 6, 4
    rope = RotaryEmbedding(D, 256, {"rope_type": "default", "rope_theta": 10000.0}, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 17, 100, 3, 255])
    cos, sin = rope(positions)
    qkv = torch.randn(T, (H + 2 * KVH) * D).to(dtype)
    slots = torch.randperm(NB * BS)[:T]
    cache = torch.zeros(2, NB, BS, KVH, D, dtype=dtype)
    # reference: the torch path of LlamaAttention
    qk = apply_rotary(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), cos, sin)
    ref_cache = torch.zeros_like(cache)
    ref_cache[0].view(-1, KVH, D).index_copy_(0, slots, qk[:, H:])
    ref_cache[1].view(-1, KVH, D).index_copy_(0, slots, qkv[:, (H + KVH) * D:].view(T, KVH, D))
    v_before = qkv[:, (H + KVH) * D:].clone()
    assert cpu_kernels.rope_and_cache(qkv, cos, cache, slots, H, KVH, D)
    tol = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), qk, **tol)
    torch.testing.assert_close(cache, ref_cache, **tol)
    assert torch.equal(qkv[:, (H + KVH) * D:], v_before)  # V is not rotated


@pytest.mark.skipif(not packing_supported(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 here")
@pytest.mark.parametrize("name", ["llama-tied-bias", "qwen2-bias", "gemma3", "deepseek-v2", "deepseek-v3"])
def test_bf16_engine_with_packed_weights_equals_plain_weights(name, tmp_path_factory, monkeypatch):
    """The engine in bf16 packs every plain linear (not MLA's kv_b_proj, whose weight the model reads) and gives the
    same greedy tokens as with plain weights, on the AMX kernel (where the CPU has it) and on oneDNN's, and with
    prefill attention on the AMX kernel or on torch's SDPA (models with head_dim 32 take the AMX one)."""
    from test_models import _load_pair

    from pagedllm import LLM, SamplingParams

    hf, _ = _load_pair(name, tmp_path_factory)  # the tiny random HF model (norm weights randomised)
    folder = str(tmp_path_factory.mktemp(f"bf16-{name}"))
    hf.save_pretrained(folder)
    prompt = {"prompt_token_ids": list(range(3, 15))}
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kw = dict(dtype="bfloat16", skip_tokenizer_init=True, max_model_len=64, kv_cache_memory_bytes=4 << 20,
              quantization="none")
    runs = {}
    for pack, amx, amx_attn in (("1", "1", "1"), ("1", "0", "1"), ("0", "1", "1"), ("1", "1", "0")):
        monkeypatch.setenv("PAGEDLLM_PACK_WEIGHTS", pack)
        monkeypatch.setenv("PAGEDLLM_AMX_LINEAR", amx)
        monkeypatch.setenv("PAGEDLLM_AMX_ATTENTION", amx_attn)
        llm = LLM(folder, **kw)
        model = llm.llm_engine.engine_core.runner.model
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert bool(packed) == (pack == "1")
        backends = {m.backend for m in packed}
        if pack == "1" and amx == "0":
            assert "amx" not in backends and backends <= {"dpbf16", "onednn", "torch"}  # AMX off: the next one
        if pack == "1" and amx == "1" and amx_linear_supported():
            assert "amx" in backends
        runs[pack + amx + amx_attn] = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert len(runs["111"]) == 8 and runs["111"] == runs["101"] == runs["011"] == runs["110"]


@pytest.mark.parametrize("command,env,expected", [
    ("serve", {}, "30000"),                                  # the server: a bounded OpenMP spin
    ("generate", {}, None),                                  # offline: libgomp's default
    ("serve", {"GOMP_SPINCOUNT": "123"}, "123"),              # the user's value wins
    ("serve", {"OMP_WAIT_POLICY": "ACTIVE"}, None),           # an explicit wait policy: no spin count set for it
])
def test_serve_sets_bounded_openmp_spin_before_torch_loads(command, env, expected):
    """The CLI sets GOMP_SPINCOUNT for ``serve`` before torch (and its libgomp) loads, unless the user chose."""
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = ("import sys, os; from pagedllm.entrypoints import cli; cli.set_openmp_spin(sys.argv[1]); "
            "print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code, command], env={**base, **env}, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["False", str(expected)]


@pytest.mark.parametrize("vocab,n_rows", [(49152, 16), (1000, 3), (151936, 2), (33, 1)])
def test_apply_token_bitmask_matches_the_bit_definition(vocab, n_rows):
    """Our bitmask pass equals the definition (bit t of word t // 32 of row i; 0 masks to -inf) and xgrammar's own
    CPU kernel, for sparse (JSON-like), dense and all-ones words, rows picked out of a larger batch, a vocabulary not
    a multiple of 32, and a bitmask wider than the logits (the model's padded width)."""
    import xgrammar as xgr

    torch.manual_seed(vocab)
    words = (vocab + 31) // 32 + 1  # wider than needed
    n_logits = n_rows + 3
    bm = torch.randint(-2**31, 2**31 - 1, (n_rows, words), dtype=torch.int32)
    bm[:, ::3] = 0  # all masked
    bm[:, 1::5] = -1  # all allowed
    rows = torch.randperm(n_logits)[:n_rows].to(torch.int64)
    logits = torch.randn(n_logits, vocab)
    got = logits.clone()
    assert cpu_kernels.apply_token_bitmask(got, bm, rows)
    bits = ((bm.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1).view(n_rows, -1)[:, :vocab].bool()
    ref = logits.clone()
    for i, r in enumerate(rows.tolist()):
        ref[r] = torch.where(bits[i], logits[r], torch.tensor(float("-inf")))
    assert torch.equal(got, ref)
    theirs = logits.clone()
    full = torch.full((n_logits, words), -1, dtype=torch.int32)
    full[rows] = bm
    xgr.apply_token_bitmask_inplace(theirs, full, vocab_size=vocab, indices=rows.tolist())
    assert torch.equal(got, theirs)


def _reference_draw(w64: torch.Tensor, u: float) -> tuple[int, float]:
    """The inverse-CDF draw in float64 from weights ``w64 [V]``: (index, how far u S lies from the nearest boundary of
    the cumulative sums, relative to S)."""
    cum = w64.cumsum(0)
    S = float(cum[-1])
    target = u * S
    i = int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64), right=True))
    return min(i, len(w64) - 1), float((cum - target).abs().min()) / S


def _reference_kept(logits: torch.Tensor, inv_t: float, min_p: float, top_k: int, top_p: float) -> torch.Tensor:
    """float64 weights ``[V]`` of one row after the sampler's truncations (0 = dropped): exp((l - max) inv_t), then
    min_p (w < min_p max w), top_k (w < the k-th largest), top_p (the smallest descending prefix whose mass reaches
    top_p of what is left; with top_k, of its k largest)."""
    d = (logits.double() - logits.double().max()) * inv_t
    w = torch.where(d >= -87, torch.exp(d), torch.zeros_like(d))
    w[w < min_p] = 0.0
    s = w.sort(descending=True).values
    mass = float(w.sum())
    if top_k > 0:
        k = min(top_k, len(w))
        w[w < s[k - 1]] = 0.0
        mass = float(s[:k].sum())
    if top_p < 1.0:
        cum = s.cumsum(0)
        kept = 1 + int((cum[:-1] < top_p * mass).sum())
        w[w < s[kept - 1]] = 0.0
    return w


# (inv_t, min_p, top_k, top_p) per row: temperature alone, and each truncation alone and together
SAMPLE_ROWS = [(1.0, 0.0, 0, 1.0), (1 / 0.7, 0.0, 0, 0.9), (1 / 1.3, 0.05, 0, 1.0), (1.0, 0.0, 40, 1.0),
               (2.0, 0.0, 64, 0.95), (1 / 1.5, 0.02, 20, 0.8), (1.0, 0.0, 3, 1.0), (0.5, 0.0, 0, 0.999)]


@pytest.mark.parametrize("level", ["avx512_bf16", "avx2"])
@pytest.mark.parametrize("V", [1, 5, 100, 8192, 8193, 50000, 262144])
def test_sample_rows_is_the_float64_truncated_inverse_cdf(V, level):
    """``sample_rows`` (kernels/csrc/cpu_ops.c) against float64 on the same uniforms, for rows of temperature alone
    and with min_p / top_k / top_p alone and together, over 1 to 32 of its 8,192-token chunks: the draw is the
    float64 one wherever u S lies farther than 1e-5 S from a boundary of the kept tokens' running sums, and always a
    kept token (-inf logits and truncated tokens never drawn, even at u = 0 and u -> 1). The logits: a peaked head
    (a real model's) on a wide tail, so a nucleus holds tens of tokens, or (x 0.1) thousands."""
    import dataclasses

    from pagedllm import kernels
    from pagedllm.kernels.config import supported_levels

    if level not in supported_levels():
        pytest.skip(f"this CPU runs below {level}")
    g = torch.Generator().manual_seed(V)
    R = len(SAMPLE_ROWS)
    logits = torch.randn(R, V, generator=g) * 2
    head = min(V, 30)
    logits[:, :head] += torch.linspace(12, 4, head)
    logits = logits[:, torch.randperm(V, generator=g)]  # the head anywhere in the row
    logits[1::2] *= 0.1  # every other row flat: wide nuclei
    banned = torch.rand(R, V, generator=g) < 0.2
    banned[:, 0] = V > 1  # the first token banned (u = 0 must not land on it)
    logits[banned] = float("-inf")
    inv_t, min_p, top_k, top_p = (torch.tensor(c) for c in zip(*SAMPLE_ROWS))
    kept = [_reference_kept(logits[r], *SAMPLE_ROWS[r]) for r in range(R)]
    us = [0.0, 1 - 2 ** -53, 0.5, *torch.rand(12, generator=g, dtype=torch.float64).tolist()]
    with kernels.use(dataclasses.replace(kernels.config(), level=level)):
        for u in us:
            got = cpu_kernels.sample_rows(logits, inv_t, torch.full((R,), u, dtype=torch.float64), min_p, top_k,
                                          top_p)
            assert got is not None
            for r in range(R):
                assert kept[r][int(got[r])] > 0, (u, r, int(got[r]))
                ref, margin = _reference_draw(kept[r], u)
                if margin > 1e-5:
                    assert int(got[r]) == ref, (u, r, int(got[r]), ref, margin)


def test_sample_rows_same_draw_alone_among_others_and_at_any_thread_count():
    """A row's draw depends on its own logits and uniform only: alone, among the others (its row anywhere), at 1, 2
    and 3 threads, with and without truncation."""
    g = torch.Generator().manual_seed(0)
    V, R = 50000, len(SAMPLE_ROWS)
    logits = torch.randn(R, V, generator=g) * 4
    inv_t, min_p, top_k, top_p = (torch.tensor(c) for c in zip(*SAMPLE_ROWS))
    u = torch.rand(R, generator=g, dtype=torch.float64)
    before = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            together = cpu_kernels.sample_rows(logits, inv_t, u, min_p, top_k, top_p)
            alone = torch.cat([cpu_kernels.sample_rows(logits[r:r + 1], inv_t[r:r + 1], u[r:r + 1], min_p[r:r + 1],
                                                       top_k[r:r + 1], top_p[r:r + 1]) for r in range(R)])
            perm = torch.randperm(R, generator=g)
            shuffled = cpu_kernels.sample_rows(logits[perm], inv_t[perm], u[perm], min_p[perm], top_k[perm],
                                               top_p[perm])
            assert torch.equal(together, alone) and torch.equal(shuffled, together[perm]), threads
            runs.append(together)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, runs[0]) for r in runs)
    assert len(set(runs[0].tolist())) > 4  # it really draws different tokens


_SAMPLE_OOM_SCRIPT = r"""
import resource, sys, torch
from pagedllm.attention import cpu_kernels
R, V, BIG = 4, 262144, 20000
g = torch.Generator().manual_seed(0)
x = torch.randn(R, V, generator=g)
inv_t, u = torch.ones(R), torch.rand(R, generator=g, dtype=torch.float64)
top_k = torch.full((R,), 50, dtype=torch.int64)
first = cpu_kernels.sample_rows(x, inv_t, u, top_k=top_k)  # the library loaded, OpenMP's threads started
# BIG rows that are all row 0 (row stride 0): 1 MB of logits, ~100 MB of scratch (the per-chunk sums and counts)
xb, inv_b = x[:1].expand(BIG, V), torch.ones(BIG)
u_b, top_kb = torch.rand(BIG, generator=g, dtype=torch.float64), torch.full((BIG,), 50, dtype=torch.int64)
size = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (size + (4 << 20), hard))  # 4 MB more address space, no more
try:
    cpu_kernels.sample_rows(xb, inv_b, u_b, top_k=top_kb)
    print("NO ERROR")
except MemoryError as e:
    print("MemoryError:", e)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
print("AGAIN", torch.equal(cpu_kernels.sample_rows(x, inv_t, u, top_k=top_k), first))
"""


def test_sample_rows_out_of_memory_raises_and_the_process_goes_on():
    """Where ``sample_rows_f32`` can't allocate its scratch (20,000 rows of 262,144 tokens need ~100 MB of it, and
    the address space is capped 4 MB above what the process maps) the call raises ``MemoryError`` naming the sampler
    instead of writing through a NULL pointer, and the next call, with memory back, draws what a call before it
    drew."""
    import subprocess
    import sys

    require_native(cpu_kernels.get_lib())
    r = subprocess.run([sys.executable, "-c", _SAMPLE_OOM_SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "MemoryError: sample_rows: no memory for the sampler's scratch (20000 rows x 262144 tokens)" in r.stdout
    assert "AGAIN True" in r.stdout


def test_inverse_cdf_torch_fallback_is_the_float64_inverse_cdf():
    """The sampler's torch path (no C kernel): the same draws as float64, never a zero probability."""
    from pagedllm.layers.sampler import _inverse_cdf

    g = torch.Generator().manual_seed(1)
    probs = torch.rand(3, 3000, generator=g) * (torch.rand(3, 3000, generator=g) < 0.1)
    probs[:, 0] = probs[:, -1] = 0.0
    probs[:, 1500] += 0.2
    for u in [0.0, 1 - 2 ** -53, *torch.rand(30, generator=g, dtype=torch.float64).tolist()]:
        got = _inverse_cdf(probs, torch.full((3,), u, dtype=torch.float64))
        for r in range(3):
            assert probs[r, int(got[r])] > 0, (u, r)
            ref, margin = _reference_draw(probs[r].double(), u)
            if margin > 1e-9:
                assert int(got[r]) == ref, (u, r)
