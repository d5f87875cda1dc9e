"""Verify rows attend exactly as plain decode rows do: bit for bit, at every ISA level this CPU runs.

A speculating request's ``1 + k`` verify rows (its last sampled token, then its drafts) are scheduled as one request
with ``q_len = 1 + k``. ``build_attention_metadata(..., verify=...)`` makes each of them a decode entry of its own,
so the decode kernel computes row ``j`` exactly as the plain decode step at that position computes it; the
multi-query prefill path (AMX prefill kernel, torch SDPA) sums in another order, and a verify row's logits would then
differ from the decode step's in the last bits (in bf16 enough to flip near-tied greedy tokens).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm import kernels
from pagedllm.attention.torch_attn import Attention, build_attention_metadata
from pagedllm.kernels.config import LEVELS, supported_levels

H, KVH, D, BS, NB = 9, 3, 64, 16, 40  # SmolLM2's attention shape


def _slots(bt: torch.Tensor, query_lens, seq_lens) -> torch.Tensor:
    out = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        out.extend(int(bt[r, p // BS]) * BS + p % BS for p in range(s - q, s))
    return torch.tensor(out, dtype=torch.int64)


def _step(attn, q, k, v, kv, query_lens, seq_lens, bt, verify=None):
    meta = build_attention_metadata(query_lens, seq_lens, bt, _slots(bt, query_lens, seq_lens), BS,
                                    attn.sliding_window, verify)
    return attn(q, k, v, kv, meta)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 20])
def test_verify_rows_equal_decode_rows_bitwise(level, dtype, window):
    if level not in supported_levels():
        pytest.skip(f"this CPU runs below {level}")
    torch.manual_seed(0)
    attn = Attention(H, D, KVH, D ** -0.5, sliding_window=window)
    # One step: request 0 verifies 1 + 5 rows after 37 cached tokens (a 16-token tile boundary inside them),
    # request 1 decodes at context 20, request 2 prefills 12 tokens after 8 cached, request 3 verifies 1 + 2 rows
    # from position 0 of its third block.
    query_lens, seq_lens = [6, 1, 12, 3], [43, 20, 20, 35]
    verify = [True, False, False, True]
    perm = torch.randperm(NB - 1) + 1
    bt = perm[:4 * 3].view(4, 3).contiguous()
    T = sum(query_lens)
    q = torch.randn(T, H * D).to(dtype)
    k = torch.randn(T, KVH * D).to(dtype)
    v = torch.randn(T, KVH * D).to(dtype)
    kv = torch.randn(2, NB, BS, KVH, D).to(dtype)
    cfg = dataclasses.replace(kernels.config(), level=level)
    differ = []  # rows not bitwise as their reference (tolerated at level none only: see below)

    def same(a, b, r, j):
        if not torch.equal(a, b):
            assert level == "none", (level, r, j)
            differ.append((r, j))

    with kernels.use(cfg):
        out = _step(attn, q, k, v, kv, query_lens, seq_lens, bt, verify)
        plain = _step(attn, q, k, v, kv.clone(), query_lens, seq_lens, bt)  # verify rows as a prefill chunk
        starts = [0, 6, 7, 19]
        for r in (0, 3):
            for j in range(query_lens[r]):
                row = starts[r] + j
                pos = seq_lens[r] - query_lens[r] + j  # the position this row computes
                # the plain decode step at that position, alone and beside request 1's decode
                alone = _step(attn, q[row:row + 1], k[row:row + 1], v[row:row + 1], kv, [1], [pos + 1], bt[r:r + 1])
                same(out[row], alone[0], r, j)
                rows = [row, starts[1]]
                both = _step(attn, q[rows], k[rows], v[rows], kv, [1, 1], [pos + 1, seq_lens[1]], bt[[r, 1]])
                same(out[row], both[0], r, j)
        # the other requests' rows are what they are without verify rows in the step
        others = torch.cat([torch.arange(6, 7), torch.arange(7, 19)])
        same(out[others], plain[others], "others", None)
        # and the verify rows are still attention: close to the multi-query path's (which may differ in low bits)
        torch.testing.assert_close(out.float(), plain.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    if differ:  # level none: torch SDPA, not promised batch invariant (README "Batch invariance")
        # measured on an AVX2-only EPYC (ATen capability AVX2), float32, 2 threads: a lone decode query's sums differ
        # from the same query's among others (equal with 1 thread); AVX-512 CPUs give equal bits
        pytest.xfail(f"level none: rows {differ} differ in low bits from their plain steps'")


def test_verify_metadata_decode_entries():
    """The worked example of ``build_attention_metadata``'s ``verify``: one decode entry per verify row, each with
    the context up to its own position, the request's block table repeated, rows in batch order."""
    bt = torch.tensor([[3, 4], [5, 6], [7, 0]])
    query_lens, seq_lens = [3, 4, 1], [10, 20, 5]
    slots = _slots(bt, query_lens, seq_lens)
    meta = build_attention_metadata(query_lens, seq_lens, bt, slots, BS, None, [True, False, False])
    dec = meta.decode
    assert dec.token_rows.tolist() == [0, 1, 2, 7] and not dec.all_rows
    assert dec.seq_lens.tolist() == [8, 9, 10, 5]
    assert dec.block_tables.tolist() == [[3], [3], [3], [7]]  # cut to the longest decode context's blocks
    assert [(p.q_start, p.q_end) for p in meta.prefills] == [(3, 7)]
    meta = build_attention_metadata([3, 1], [10, 5], bt[[0, 2]], _slots(bt[[0, 2]], [3, 1], [10, 5]), BS, None,
                                    [True, False])
    assert meta.decode.all_rows and meta.decode.token_rows.tolist() == [0, 1, 2, 3] and not meta.prefills
    assert meta.decode.seq_lens.tolist() == [8, 9, 10, 5] and meta.prefill_batch is None
