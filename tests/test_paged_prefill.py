"""``paged_prefill`` (pagedllm/kernels/csrc/paged_prefill.c): chunk-invariant prefill attention straight from the paged
cache, where the AMX kernel doesn't run.

It equals a float64 reference (softmax attention over each query row's own keys), and each query row's bits are the
same whatever chunks the prompt was cut into and whatever other slices share the call: the property SDPA lacks,
which made a request's greedy output depend on its neighbours (the token budget they share moves its chunk
boundaries) and on speculation (verify rows take budget). Run at every ISA level by the per-level suite."""

import math

import pytest
import torch

from conftest import require_native
from pagedllm import kernels
from pagedllm.attention import cpu_kernels
from pagedllm.attention.torch_attn import Attention, build_attention_metadata


def _cache(dtype, NB, BS, KVH, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NB, BS, KVH, D, generator=g).to(dtype)
    v = torch.randn(NB, BS, KVH, D, generator=g).to(dtype)
    return k, v


def _block_tables(n, max_blocks, NB, seed=1):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NB - 1, generator=g)[: n * max_blocks] + 1  # shuffled blocks, 0 is the null block
    return perm.view(n, max_blocks).contiguous()


def _call(q, k_cache, v_cache, bt, q_starts, q_lens, seq_lens, scale, window):
    """(out [T, H, D], ran) through the kernel wrapper, as ``Attention`` calls it."""
    from pagedllm.attention.torch_attn import PrefillBatch

    batch = PrefillBatch(q_starts=torch.tensor(q_starts, dtype=torch.int64),
                         q_lens=torch.tensor(q_lens, dtype=torch.int64),
                         seq_lens=torch.tensor(seq_lens, dtype=torch.int64), block_tables=bt)
    out = torch.full((q.shape[0], q.shape[1], q.shape[2]), float("nan"), dtype=q.dtype)
    ran = cpu_kernels.paged_prefill(q, k_cache, v_cache, batch, out, scale, window)
    return out, ran


def _reference(q, k_cache, v_cache, bt, q_starts, q_lens, seq_lens, scale, window):
    """float64 [T, H, D]: row i of a slice (position seq_len - q_len + i) over keys [lo, position]."""
    T, H, D = q.shape
    BS, KVH = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for s, (q0, ql, L) in enumerate(zip(q_starts, q_lens, seq_lens)):
        pos = torch.arange(L)
        slots = bt[s][pos // BS] * BS + pos % BS
        k = k_cache.reshape(-1, KVH, D)[slots].double()
        v = v_cache.reshape(-1, KVH, D)[slots].double()
        for i in range(ql):
            p = L - ql + i
            lo = max(0, p + 1 - window) if window else 0
            for h in range(H):
                sc = k[lo : p + 1, h // G] @ q[q0 + i, h].double() * scale
                out[q0 + i, h] = torch.softmax(sc, 0) @ v[lo : p + 1, h // G]
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 11])
@pytest.mark.parametrize("H, KVH, D", [(6, 2, 64), (4, 1, 16), (3, 3, 128), (8, 2, 40), (2, 1, 256)])
def test_matches_float64_reference(dtype, tol, window, H, KVH, D):
    """Three slices in one call (one with nothing cached, two after cached tokens, one ending mid-tile) on shuffled
    blocks: every row within the bound of bf16 inputs (P rounded to bf16 on VDPBF16PS) or float32 sums."""
    require_native(cpu_kernels.get_lib())
    BS, NB = 16 if D != 16 else 4, 96
    k_cache, v_cache = _cache(dtype, NB, BS, KVH, D)
    seq_lens, q_lens = [37, 70, 9], [37, 21, 4]
    max_blocks = max((L + BS - 1) // BS for L in seq_lens)
    bt = _block_tables(3, max_blocks, NB)
    T = sum(q_lens) + 2
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=torch.Generator().manual_seed(2)).to(dtype)
    q = qkv[:, : H * D].view(T, H, D)  # a row-strided view, as the model passes it
    q_starts = [1, 1 + 37, 1 + 37 + 21]
    scale = 1 / math.sqrt(D)
    out, ran = _call(q, k_cache, v_cache, bt, q_starts, q_lens, seq_lens, scale, window)
    assert ran
    ref = _reference(q, k_cache, v_cache, bt, q_starts, q_lens, seq_lens, scale, window)
    rows = [r for q0, ql in zip(q_starts, q_lens) for r in range(q0, q0 + ql)]
    torch.testing.assert_close(out[rows].double(), ref[rows], atol=tol, rtol=tol)
    assert torch.isnan(out[0]).all() and torch.isnan(out[-1]).all()  # rows of no slice untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("H, KVH, D", [(9, 3, 64), (4, 2, 16)])
def test_rows_bitwise_equal_in_any_chunking_and_batch(dtype, window, H, KVH, D):
    """A 150-token prompt computed whole, in chunks of 1-41 tokens (each chunk a call after its cached prefix), and
    with other slices before and after it in the same call: every row's output bits are the same."""
    require_native(cpu_kernels.get_lib())
    BS, NB, L = (16 if D != 16 else 4), 160, 150
    k_cache, v_cache = _cache(dtype, NB, BS, KVH, D, seed=3)
    mb = (L + BS - 1) // BS
    bt = _block_tables(3, mb, NB, seed=4)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(L + 40, H, D, generator=g).to(dtype)
    scale = 1 / math.sqrt(D)
    whole, ran = _call(q[:L], k_cache, v_cache, bt[:1], [0], [L], [L], scale, window)
    assert ran
    for cuts in ([1, 2, 3, 5, 8, 13, 21, 34, 63], [41] * 3 + [27], [16, 16, 17, 15, 86], [149, 1]):
        start = 0
        for n in cuts:
            got, _ = _call(q[start : start + n], k_cache, v_cache, bt[:1], [0], [n], [start + n], scale, window)
            assert torch.equal(got, whole[start : start + n]), (cuts, start, n)
            start += n
        assert start == L
    # the same chunk among other slices (before and after it in the call, other lengths and tables)
    other = q[L : L + 40]
    qq = torch.cat([other[:17], q[60:97], other[17:]])  # slice 0: 17 rows, slice 1: rows 60..96, slice 2: 23 rows
    got, _ = _call(qq, k_cache, v_cache, torch.stack([bt[1], bt[0], bt[2]]), [0, 17, 54], [17, 37, 23],
                   [100, 97, 23], scale, window)
    assert torch.equal(got[17:54], whole[60:97])


def test_attention_layer_takes_it_below_amx_and_matches_sdpa():
    """``Attention`` sends prefill slices the AMX kernel can't take (here head_dim 16, block_size 4) to
    ``paged_prefill``; its output is torch's SDPA's within bf16 rounding."""
    require_native(cpu_kernels.get_lib())
    torch.manual_seed(0)
    H, KVH, D, BS = 4, 2, 16, 4
    att = Attention(H, D, KVH, D ** -0.5)
    kv = torch.zeros(2, 40, BS, KVH, D, dtype=torch.bfloat16)
    q_lens, seq_lens = [9, 14], [9, 30]
    bt = torch.zeros(2, 8, dtype=torch.int64)
    bt[0, :3] = torch.tensor([5, 1, 9])
    bt[1, :8] = torch.tensor([2, 3, 4, 6, 7, 8, 10, 11])
    kv[:, bt[1, :4]] = torch.randn(2, 4, BS, KVH, D).to(torch.bfloat16)  # cached tokens 0..15 of slice 1
    slots = torch.cat([bt[0][torch.arange(9) // BS] * BS + torch.arange(9) % BS,
                       bt[1][torch.arange(16, 30) // BS] * BS + torch.arange(16, 30) % BS])
    T = 23
    q, k, v = (torch.randn(T, n * D).to(torch.bfloat16) for n in (H, KVH, KVH))
    meta = build_attention_metadata(q_lens, seq_lens, bt, slots, BS)
    calls = []
    orig = cpu_kernels.paged_prefill

    def spy(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    import pagedllm.attention.torch_attn as TA

    TA.paged_prefill = spy
    try:
        ours = att(q, k, v, kv.clone(), meta)
    finally:
        TA.paged_prefill = orig
    assert calls
    from pagedllm import kernels
    import dataclasses

    with kernels.use(dataclasses.replace(kernels.config(), batch_invariant=False)):  # SDPA
        sdpa = att(q, k, v, kv.clone(), meta)
    torch.testing.assert_close(ours.float(), sdpa.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("level", ["auto", "avx2"])
def test_greedy_output_the_same_in_any_chunking(tmp_path, level):
    """A tiny bf16 Llama (head_dim 16: below the AMX kernel's shapes) gives the same greedy tokens for its prompts
    whole and in chunks of 5, 11 and 22 tokens (so some prompts end on a one-token chunk, as a structured-output
    request's held-back last token does), batched with each other: prefill attention is chunk-invariant and a row's
    kind follows its position (the last prompt token is a decode row however it was scheduled)."""
    require_native(cpu_kernels.get_lib())
    from pagedllm.kernels.config import supported_levels
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams
    from tests.test_engine_tiny import VOCAB, _save_tiny

    if level != "auto" and level not in supported_levels():
        pytest.skip(f"this CPU runs below {level}")
    _save_tiny("llama", tmp_path)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, VOCAB - 2, (n,), generator=g).tolist() for n in (12, 23, 6, 34, 45)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    base = dict(dtype="bfloat16", quantization="none", skip_tokenizer_init=True, block_size=4,
                kv_cache_memory_bytes=4 << 20, max_model_len=128, cpu_isa=level)

    def run(**kw):
        llm = LLM(str(tmp_path), **base, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]

    def top2(lp):
        return {t: v.logprob for t, v in lp.items()}

    ref, ref_lp = run()
    for chunk in (5, 11, 22):
        got, got_lp = run(max_num_batched_tokens=chunk)
        # the first difference with both sides' top-2 logprobs (a near-tie or not), so a failure says where it began
        where = next(((i, j, top2(ref_lp[i][j]), top2(got_lp[i][j])) for i in range(len(ref))
                      for j in range(len(ref[i])) if ref[i][j] != got[i][j]
                      or ref_lp[i][j].keys() != got_lp[i][j].keys()), None)
        assert got == ref, (chunk, kernels.config().describe(), where)
        # not only the tokens: the logprobs too, bit for bit (a row's arithmetic doesn't depend on its batch)
        assert [[top2(x) for x in r] for r in got_lp] == [[top2(x) for x in r] for r in ref_lp], chunk
