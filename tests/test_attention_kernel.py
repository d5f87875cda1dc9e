"""The C paged-decode kernel equals a brute-force reference (float64 softmax attention over the gathered context),
and the torch fallback path of ``Attention`` equals the kernel path."""

import dataclasses
import math

import pytest
import torch

from pagedllm import kernels
from pagedllm.attention import cpu_kernels
from conftest import require_native
from pagedllm.attention.torch_attn import Attention, build_attention_metadata


def reference(q, k_cache, v_cache, block_tables, seq_lens, rows, scale, window):
    """q [T, H, D]; returns [n, H, D] in float64 for rows[i] (decode queries at position seq_len-1)."""
    n = block_tables.shape[0]
    H, D = q.shape[1], q.shape[2]
    BS, KVH = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    out = torch.zeros(n, H, D, dtype=torch.float64)
    for r in range(n):
        L = int(seq_lens[r])
        pos = torch.arange(L)
        slots = block_tables[r][pos // BS] * BS + pos % BS
        k = k_cache.reshape(-1, KVH, D)[slots].double()  # [L, KVH, D]
        v = v_cache.reshape(-1, KVH, D)[slots].double()
        lo = max(0, L - window) if window else 0
        for h in range(H):
            qh = q[rows[r], h].double() * scale
            s = (k[lo:, h // G] @ qh)
            p = torch.softmax(s, 0)
            out[r, h] = p @ v[lo:, h // G]
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("D", [32, 64, 128, 256, 40])  # 64/128/256: specialised vector paths; 40: scalar fallback
@pytest.mark.parametrize("n", [5, 1])  # 5 requests: one task per request; 1: one task per KV head
def test_kernel_matches_reference(dtype, tol, window, D, n):
    require_native(cpu_kernels.get_lib())
    torch.manual_seed(0)
    H, KVH, BS, NB = 6, 2, 4, 64
    k_cache = torch.randn(NB, BS, KVH, D).to(dtype)
    v_cache = torch.randn(NB, BS, KVH, D).to(dtype)
    seq_lens = torch.tensor([1, 5, 13, 16, 41][-n:], dtype=torch.int64)  # 41: three 16-token tiles, the last partial
    max_blocks = 11
    perm = torch.randperm(NB - 1)[: n * max_blocks] + 1
    block_tables = perm.view(n, max_blocks).contiguous()
    T = 9
    qkv = torch.randn(T, (H + 2 * KVH) * D).to(dtype)
    q = qkv[:, : H * D].view(T, H, D)  # a row-strided view, as the model passes it
    rows = torch.tensor([0, 2, 3, 6, 8][-n:], dtype=torch.int64)
    out = torch.zeros(T, H, D, dtype=dtype)
    scale = 1 / math.sqrt(D)
    assert cpu_kernels.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, rows, out, scale, window)
    ref = reference(q, k_cache, v_cache, block_tables, seq_lens, rows, scale, window)
    torch.testing.assert_close(out[rows].double(), ref, atol=tol, rtol=tol)
    untouched = torch.ones(T, dtype=torch.bool)
    untouched[rows] = False
    assert (out[untouched] == 0).all()


def test_torch_fallback_equals_kernel(monkeypatch):
    torch.manual_seed(1)
    H, KVH, D, BS, NB = 4, 2, 16, 4, 32
    attn = Attention(H, D, KVH, D ** -0.5)
    kv = torch.randn(2, NB, BS, KVH, D)
    # two decode requests (contexts 9 and 4) and one prefill chunk of 3 tokens after 5 cached tokens
    query_lens, seq_lens = [1, 3, 1], [9, 8, 4]
    bt = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 0, 0]])
    slots = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        for p in range(s - q, s):
            slots.append(int(bt[r, p // BS]) * BS + p % BS)
    slot_mapping = torch.tensor(slots)
    T = sum(query_lens)
    q, k, v = torch.randn(T, H * D), torch.randn(T, KVH * D), torch.randn(T, KVH * D)
    meta = build_attention_metadata(query_lens, seq_lens, bt, slot_mapping, BS)
    out_kernel = attn(q, k, v, kv.clone(), meta)
    monkeypatch.setattr("pagedllm.attention.torch_attn.paged_decode", lambda *a, **kw: False)
    meta = build_attention_metadata(query_lens, seq_lens, bt, slot_mapping, BS)
    out_torch = attn(q, k, v, kv.clone(), meta)
    torch.testing.assert_close(out_kernel, out_torch, atol=1e-5, rtol=1e-5)


def _amx_attention_ready() -> bool:
    from pagedllm import kernels

    return kernels.lib("amx") is not None


def prefill_reference(q, k_cache, v_cache, bt_row, cached, q_len, scale, window):
    """float64 softmax attention of ``q [q_len, H, D]`` (positions cached..cached+q_len-1) over the request's
    gathered context, causal (and windowed: key j visible from position i iff 0 <= i - j < window)."""
    H, D = q.shape[1], q.shape[2]
    BS, KVH = k_cache.shape[1], k_cache.shape[2]
    L = cached + q_len
    pos = torch.arange(L)
    slots = bt_row[pos // BS] * BS + pos % BS
    k = k_cache.reshape(-1, KVH, D)[slots].double().repeat_interleave(H // KVH, 1).transpose(0, 1)  # [H, L, D]
    v = v_cache.reshape(-1, KVH, D)[slots].double().repeat_interleave(H // KVH, 1).transpose(0, 1)
    qpos, kpos = torch.arange(cached, L)[:, None], pos[None, :]
    visible = kpos <= qpos
    if window:
        visible &= qpos - kpos < window
    s = (q.double().transpose(0, 1) @ k.transpose(1, 2)) * scale
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    return (p @ v).transpose(0, 1), v.abs().amax()  # [q_len, H, D], largest |V| of the context


@pytest.mark.skipif(not _amx_attention_ready(), reason="no AMX-BF16 here")
@pytest.mark.parametrize("H, KVH, D", [(9, 3, 64), (8, 2, 128), (4, 4, 96), (2, 1, 32)])
@pytest.mark.parametrize("window", [None, 40])
def test_amx_prefill_attention_matches_float64(H, KVH, D, window):
    """All prefill slices of a step in one AMX call: fresh prompts, chunks after cached tokens (not multiples of 16
    or 32), a 1-token slice, and a 300-token slice (many 16-query tiles, full key tiles and causal/window edges).
    Unused cache memory holds NaN (block 0 and the slots past each context in its last block): none may leak in.
    Bound: P and the output are each rounded to bf16 once (2^-9 relative), so |err| <= 2^-8 (max|V| + |ref|)."""
    from pagedllm.attention.torch_attn import PrefillBatch

    torch.manual_seed(0)
    BS, NB = 16, 256
    specs = [(0, 37), (20, 50), (100, 3), (5, 300), (64, 64), (7, 1)]  # (cached tokens, new tokens)
    k_cache = torch.randn(NB, BS, KVH, D).bfloat16()
    v_cache = torch.randn(NB, BS, KVH, D).bfloat16()
    k_cache[0] = v_cache[0] = float("nan")
    nblocks = [(c + n + BS - 1) // BS for c, n in specs]
    perm = torch.randperm(NB - 1)[: sum(nblocks)] + 1
    bt = torch.zeros(len(specs), max(nblocks), dtype=torch.int64)  # padding: block 0 (NaN)
    used = 0
    for i, (c, n) in enumerate(specs):
        bt[i, : nblocks[i]] = perm[used : used + nblocks[i]]
        used += nblocks[i]
        last, fill = int(bt[i, nblocks[i] - 1]), (c + n) % BS
        if fill:
            k_cache[last, fill:] = v_cache[last, fill:] = float("nan")
    q_lens = [n for _, n in specs]
    starts = [sum(q_lens[:i]) + 2 * i for i in range(len(specs))]  # 2 decode rows between slices: not touched
    T = starts[-1] + q_lens[-1]
    qkv = torch.randn(T, (H + 2 * KVH) * D).bfloat16()
    q = qkv[:, : H * D].view(T, H, D)  # a row-strided view, as the model passes it
    out = torch.zeros(T, H, D, dtype=torch.bfloat16)
    batch = PrefillBatch(q_starts=torch.tensor(starts), q_lens=torch.tensor(q_lens),
                         seq_lens=torch.tensor([c + n for c, n in specs]), block_tables=bt)
    scale = D ** -0.5
    assert cpu_kernels.prefill_attention(q, k_cache, v_cache, batch, out, scale, window)
    for i, (c, n) in enumerate(specs):
        ref, vmax = prefill_reference(q[starts[i] : starts[i] + n], k_cache, v_cache, bt[i], c, n, scale, window)
        got = out[starts[i] : starts[i] + n].double()
        assert torch.isfinite(got).all()
        bound = 2.0 ** -8 * (vmax + ref.abs())
        assert ((got - ref).abs() <= bound).all(), (specs[i], (got - ref).abs().max().item())
    touched = torch.zeros(T, dtype=torch.bool)
    for s, n in zip(starts, q_lens):
        touched[s : s + n] = True
    assert (out[~touched] == 0).all()


def test_amx_prefill_attention_declines_unsupported_shapes(monkeypatch):
    """Shapes the kernel doesn't cover (float32, head_dim 16 or 256, block_size 8) and ``amx_attention`` off
    return False without touching ``out``, so ``Attention`` takes torch's SDPA path."""
    from pagedllm.attention.torch_attn import PrefillBatch

    batch = PrefillBatch(q_starts=torch.tensor([0]), q_lens=torch.tensor([4]), seq_lens=torch.tensor([4]),
                         block_tables=torch.tensor([[1]]))
    for dtype, D, BS in ((torch.float32, 64, 16), (torch.bfloat16, 16, 16), (torch.bfloat16, 256, 16),
                         (torch.bfloat16, 64, 8)):
        q = torch.randn(4, 2, D).to(dtype)
        cache = torch.randn(2, 2, BS, 1, D).to(dtype)
        out = torch.zeros_like(q)
        assert not cpu_kernels.prefill_attention(q, cache[0], cache[1], batch, out, 1.0, None)
        assert (out == 0).all()
    q = torch.randn(4, 2, 64).bfloat16()
    cache = torch.randn(2, 2, 16, 1, 64).bfloat16()
    with kernels.use(dataclasses.replace(kernels.config(), amx_attention=False)):
        assert not cpu_kernels.prefill_attention(q, cache[0], cache[1], batch, torch.zeros_like(q), 1.0, None)


@pytest.mark.parametrize("amx", ["1", "0"])
@pytest.mark.parametrize("H, KVH, D", [(9, 3, 64), (12, 2, 64), (6, 2, 128), (14, 2, 64), (12, 2, 128), (32, 8, 64)])
@pytest.mark.parametrize("window", [None, 21])
def test_decode_kernel_block16_matches_reference(amx, H, KVH, D, window, monkeypatch):
    """block_size 16 (whole 16-token tiles inside a block): the score pass runs on AMX tiles where they are
    available (``amx_attention`` on) and on vdpbf16ps otherwise; both against float64. Cache rows past each
    context in its last block hold NaN, which the tile loads read and must mask out."""
    require_native(cpu_kernels.get_lib())
    cfg = dataclasses.replace(kernels.config(), amx_attention=amx == "1")
    with kernels.use(cfg):
        _decode_block16_case(H, KVH, D, window)


def _decode_block16_case(H, KVH, D, window):
    torch.manual_seed(0)
    BS, NB = 16, 160
    k_cache = torch.randn(NB, BS, KVH, D).bfloat16()
    v_cache = torch.randn(NB, BS, KVH, D).bfloat16()
    seq_lens = torch.tensor([1, 16, 17, 100, 333, 48, 5], dtype=torch.int64)
    n, max_blocks = len(seq_lens), 21
    block_tables = (torch.randperm(NB - 1)[: n * max_blocks] + 1).view(n, max_blocks).contiguous()
    for r, L in enumerate(seq_lens.tolist()):
        if L % BS:
            last = int(block_tables[r, L // BS])
            k_cache[last, L % BS :] = float("nan")
            v_cache[last, L % BS :] = float("nan")
    qkv = torch.randn(n, (H + 2 * KVH) * D).bfloat16()
    q = qkv[:, : H * D].view(n, H, D)
    out = torch.zeros(n, H, D, dtype=torch.bfloat16)
    scale = 1 / math.sqrt(D)
    assert cpu_kernels.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, None, out, scale, window)
    ref = reference(q, k_cache, v_cache, block_tables, seq_lens, torch.arange(n), scale, window)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H, KVH, D", [(4, 1, 256), (4, 1, 64), (6, 2, 128), (3, 1, 128), (14, 2, 64), (32, 8, 64),
                                     (12, 2, 128)])
def test_decode_alone_equals_among_others_across_the_head_split(dtype, H, KVH, D):
    """With fewer (request, KV head) tasks than threads the kernel cuts each KV head's query heads among the threads
    (one request of Gemma 3 270M: 4 query heads on 1 KV head); with many requests it doesn't. A request's output is
    the same bits either way, at 1, 2 and 3 threads, and within bound of float64. Alone, a request's task holds one
    KV head; among others, all of them, so on AMX several heads share one score tile (32 on 8: three tiles, their
    Q^T tiles reloaded per tile): each head's columns must sum only its own products."""
    require_native(cpu_kernels.get_lib())
    torch.manual_seed(1)
    BS, NB, n = 16, 100, 6
    k_cache, v_cache = torch.randn(NB, BS, KVH, D).to(dtype), torch.randn(NB, BS, KVH, D).to(dtype)
    seq_lens = torch.tensor([200, 17, 5, 64, 99, 1], dtype=torch.int64)
    block_tables = (torch.randperm(NB - 1)[: n * 13] + 1).view(n, 13).contiguous()
    q = torch.randn(n, H, D).to(dtype)
    _alone_equals_together_at_1_to_3_threads(q, k_cache, v_cache, block_tables, seq_lens, None)


def _alone_equals_together_at_1_to_3_threads(q, k_cache, v_cache, block_tables, seq_lens, window):
    """Each request's output the same bits alone (rows r..r of the same tensors) as among all of them, at 1, 2 and 3
    threads, the three runs equal, and within bound of float64."""
    n, H, D = q.shape
    scale = 1 / math.sqrt(D)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            together = torch.zeros(n, H, D, dtype=q.dtype)
            assert cpu_kernels.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, None, together, scale, window)
            for r in range(n):
                alone = torch.zeros(1, H, D, dtype=q.dtype)
                assert cpu_kernels.paged_decode(q[r : r + 1], k_cache, v_cache, block_tables[r : r + 1],
                                                seq_lens[r : r + 1], None, alone, scale, window)
                assert torch.equal(alone[0], together[r]), (threads, r)
            outs.append(together)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs)
    ref = reference(q, k_cache, v_cache, block_tables, seq_lens, torch.arange(n), scale, window)
    tol = 1e-5 if q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0].double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H, KVH, D", [(9, 3, 64), (4, 1, 256), (12, 2, 128)])
@pytest.mark.parametrize("window", [None, 300])
def test_decode_long_context_partitions(dtype, H, KVH, D, window):
    """Contexts of several partitions (``DECODE_PART`` in paged_decode.c, 256 tokens: 1,000 tokens is 4, the last
    partial; 256 one, 257 two; a window of 300 starts a context mid-block) against float64, and each request's output
    the same bits alone (its partitions then spread over the threads, combined after them) as among 2 x threads others
    (one task per request, its partitions in order), at 1, 2 and 3 threads."""
    require_native(cpu_kernels.get_lib())
    torch.manual_seed(2)
    BS, NB, max_blocks = 16, 700, 64
    k_cache, v_cache = torch.randn(NB, BS, KVH, D).to(dtype), torch.randn(NB, BS, KVH, D).to(dtype)
    seq_lens = torch.tensor([1000, 256, 513, 257, 700, 3, 1023, 400], dtype=torch.int64)
    n = len(seq_lens)
    block_tables = (torch.randperm(NB - 1)[: n * max_blocks] + 1).view(n, max_blocks).contiguous()
    q = (torch.randn(n, H, D) * 3).to(dtype)  # sharper softmax: partitions with very different maxima
    _alone_equals_together_at_1_to_3_threads(q, k_cache, v_cache, block_tables, seq_lens, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, KVH, D", [(4, 1, 256), (14, 2, 64), (6, 2, 72), (5, 5, 40), (12, 2, 128)])
def test_decode_same_bits_at_any_block_size(dtype, H, KVH, D):
    """The same contexts laid out in caches of 4-, 8- and 24-token blocks (block tables shuffled) give the same bits:
    V is summed a run of tokens at a time (one block's, at most 16: ``PV_RUN`` in paged_decode.c), and where the runs
    are cut must not change any sum's order. Shapes: query heads per KV head 4 (cut among the threads alone), 7, 3,
    1, 6; head_dim with a tail past the last whole register block (72, 40). Block sizes that are not multiples of 16,
    so the AVX-512 BF16 score pass (16-token tiles within a block) stays out. Within bound of float64."""
    require_native(cpu_kernels.get_lib())
    torch.manual_seed(3)
    seq_lens = torch.tensor([300, 1, 37, 160], dtype=torch.int64)
    n, longest = len(seq_lens), int(seq_lens.max())
    k = torch.randn(n, longest, KVH, D).to(dtype)  # request r's token t
    v = torch.randn(n, longest, KVH, D).to(dtype)
    q = (torch.randn(n, H, D) * 2).to(dtype)
    scale = 1 / math.sqrt(D)
    outs = []
    for BS in (4, 8, 24):
        width = -(-longest // BS)
        NB = n * width + 1
        block_tables = (torch.randperm(NB - 1)[: n * width] + 1).view(n, width).contiguous()
        k_cache = torch.full((NB, BS, KVH, D), float("nan"), dtype=dtype)
        v_cache = torch.full((NB, BS, KVH, D), float("nan"), dtype=dtype)
        pos = torch.arange(longest)
        for r in range(n):
            k_cache[block_tables[r, pos // BS], pos % BS] = k[r]
            v_cache[block_tables[r, pos // BS], pos % BS] = v[r]
        for window in (None, 100):
            out = torch.zeros(n, H, D, dtype=dtype)
            assert cpu_kernels.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, None, out, scale, window)
            outs.append(out)
            if BS == 8:
                ref = reference(q, k_cache, v_cache, block_tables, seq_lens, torch.arange(n), scale, window)
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for i, out in enumerate(outs):
        assert torch.equal(out, outs[i % 2]), i  # each block size equals the first, window for window
