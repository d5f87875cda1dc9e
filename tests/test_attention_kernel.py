"""The C paged-decode kernel equals a brute-force reference (float64 softmax attention over the gathered context),
and the torch fallback path of ``Attention`` equals the kernel path."""

import math

import pytest
import torch

from pagedllm.attention import cpu_kernels
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
@pytest.mark.parametrize("D", [32, 64, 128, 40])  # 64/128: specialised vector paths; 40: scalar fallback
@pytest.mark.parametrize("n", [5, 1])  # 5 requests: one task per request; 1: one task per KV head
def test_kernel_matches_reference(dtype, tol, window, D, n):
    if cpu_kernels.get_lib() is None:
        pytest.fail("the CPU kernel failed to build (is gcc installed?)")
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
