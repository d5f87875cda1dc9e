"""Prefix caching in the core (block pool, KV cache manager, scheduler), no torch, no model.

Outputs come from ``kv_sim.KVSimRunner``, which reads and writes a simulated KV cache through the block tables, so a
wrong prefix hit changes the tokens (``true_output`` is what they must be).
"""

import hashlib
import random
from array import array

import pytest

from kv_sim import (EOS, KVSimRunner, check_invariants, exact_kv_utilization, make_request, pool_whole, run_to_end,
                    true_output)
from pagedllm.core.block_pool import NONE_HASH, BlockPool, hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import RequestStatus


def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=64, caching=True):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(kv, max_num_seqs, budget, max_model_len)


def step(sched, runner, acc=None):
    """One step; output tokens are added to ``acc`` (request id -> tokens)."""
    so = sched.schedule()
    outs = sched.update_from_output(so, runner(so))
    check_invariants(sched)
    if acc is not None:
        for eo in outs:
            acc.setdefault(eo.request_id, []).extend(eo.new_token_ids)
    return so, outs


def ids(blocks):
    return [b.block_id for b in blocks]


# ---------------------------------------------------------------------------------------------------- hash chain
def test_hash_chain_values():
    def sha(*parts):
        return hashlib.sha256(b"".join(parts)).digest()

    def q(toks):
        return array("q", toks).tobytes()

    assert NONE_HASH == sha(b"pagedllm-prefix-cache-v1")
    h0 = hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert h0 == sha(NONE_HASH, q([1, 2, 3, 4]))
    assert h1 == sha(h0, q([5, 6, 7, 8]))
    assert h0.hex()[:16] == sha(NONE_HASH, (1).to_bytes(8, "little"), (2).to_bytes(8, "little"),
                                (3).to_bytes(8, "little"), (4).to_bytes(8, "little")).hex()[:16]
    salted = hash_block_tokens(NONE_HASH, [1, 2, 3, 4], "tenant-a")
    assert salted == sha(NONE_HASH, q([1, 2, 3, 4]), (8).to_bytes(8, "little"), b"tenant-a")
    # The parent matters (same tokens, different prefix) and so does every token.
    assert hash_block_tokens(hash_block_tokens(NONE_HASH, [0, 2, 3, 4]), [5, 6, 7, 8]) != h1
    assert hash_block_tokens(NONE_HASH, [1, 2, 3, 5]) != h0

    kv = KVCacheManager(16, 4)
    r = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    kv.update_block_hashes(r)
    assert r.block_hashes == [h0, h1]  # only full blocks
    # A salt enters the first block's key only, and through the chain changes every later hash.
    rs = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8], 4, salt="tenant-a")
    kv.update_block_hashes(rs)
    assert rs.block_hashes == [salted, hash_block_tokens(salted, [5, 6, 7, 8])]
    # Output tokens extend the chain as blocks fill.
    r.append_output_token_ids([10, 11, 12])
    kv.update_block_hashes(r)
    assert r.block_hashes == [h0, h1, hash_block_tokens(h1, [9, 10, 11, 12])]


# ---------------------------------------------------------------------------------------------------- block pool
def test_ref_cnt_on_shared_prefix():
    kv = KVCacheManager(32, 4)
    a = make_request("a", list(range(10)), 4)  # blocks: [0..3] [4..7] [8, 9]
    b = make_request("b", list(range(10)), 4)
    c = make_request("c", list(range(4)) + [40, 41, 42, 43, 44], 4)  # shares block 0 only
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 10) is not None
    pa = kv.req_to_blocks["a"]
    assert [x.ref_cnt for x in pa] == [1, 1, 1]
    assert pa[0].block_hash == a.block_hashes[0] and pa[1].block_hash == a.block_hashes[1]
    assert pa[2].block_hash is None  # partial: never cached
    hit, n = kv.get_computed_blocks(b)
    assert hit == pa[:2] and n == 8
    kv.allocate_slots(b, 2, hit, n)
    hit_c, n_c = kv.get_computed_blocks(c)
    assert hit_c == pa[:1] and n_c == 4
    kv.allocate_slots(c, 5, hit_c, n_c)
    assert [x.ref_cnt for x in pa] == [3, 2, 1]
    pb, pc = kv.req_to_blocks["b"], kv.req_to_blocks["c"]
    assert pb[:2] == pa[:2] and pb[2] is not pa[2] and pc[0] is pa[0]
    assert len({x.block_id for x in pa + pb + pc}) == 6
    kv.free(a)
    assert [x.ref_cnt for x in pa] == [2, 1, 0]
    kv.free(b)
    kv.free(c)
    assert all(x.ref_cnt == 0 for x in pa + pb + pc)
    assert kv.block_pool.get_num_free_blocks() == 31


def test_free_list_exact_eviction_order():
    # 9 usable blocks of 4 tokens. Cached blocks are evicted least recently freed first and, within a request,
    # tail first; a freed block without a hash (a partial last block) goes to the head, since reusing it evicts
    # nothing.
    kv = KVCacheManager(10, 4)
    pool = kv.block_pool
    a = make_request("a", list(range(10)), 4)  # 2 full blocks + 2 tokens
    b = make_request("b", list(range(100, 109)), 4)  # 2 full blocks + 1 token
    kv.allocate_slots(a, 10)
    kv.allocate_slots(b, 9)
    assert kv.get_block_ids("a") == [1, 2, 3] and kv.get_block_ids("b") == [4, 5, 6]
    assert pool.free_block_queue.block_ids() == [7, 8, 9]
    kv.free(a)
    assert pool.free_block_queue.block_ids() == [3, 7, 8, 9, 2, 1]
    kv.free(b)
    assert pool.free_block_queue.block_ids() == [6, 3, 7, 8, 9, 2, 1, 5, 4]
    # A hit takes a's blocks out of the free list; freeing them again makes them the most recently used.
    a2 = make_request("a2", list(range(10)), 4)
    hit, n = kv.get_computed_blocks(a2)
    assert ids(hit) == [1, 2] and n == 8
    kv.allocate_slots(a2, 2, hit, n)
    assert kv.get_block_ids("a2") == [1, 2, 6]
    assert pool.free_block_queue.block_ids() == [3, 7, 8, 9, 5, 4]
    kv.free(a2)
    assert pool.free_block_queue.block_ids() == [6, 3, 7, 8, 9, 5, 4, 2, 1]
    # New blocks come from the head: hashless ones first, then b's (freed before a2's), tail block first.
    assert pool.num_evictions == 0
    c = make_request("c", list(range(200, 228)), 4)
    kv.allocate_slots(c, 28)
    assert kv.get_block_ids("c") == [6, 3, 7, 8, 9, 5, 4]
    assert pool.num_evictions == 2
    assert pool.get_cached_block(b.block_hashes[0]) is None and pool.get_cached_block(b.block_hashes[1]) is None
    assert pool.get_cached_block(a.block_hashes[1]).block_id == 2  # a's prefix survives
    assert pool.free_block_queue.block_ids() == [2, 1]


def test_cached_block_evicted_when_reallocated():
    kv = KVCacheManager(4, 4)  # 3 usable blocks
    pool = kv.block_pool
    a = make_request("a", list(range(8)), 4)
    kv.allocate_slots(a, 8)
    blk0, blk1 = kv.req_to_blocks["a"]
    kv.free(a)
    # Freed, the blocks keep their hashes and stay findable.
    assert blk0.block_hash == a.block_hashes[0] and pool.get_cached_block(a.block_hashes[0]) is blk0
    assert kv.get_computed_blocks(make_request("x", list(range(9)), 4))[1] == 8
    # Reallocation (free list order: [3, blk1, blk0]) drops the hash of each block it takes.
    other = make_request("o", list(range(50, 58)), 4)
    kv.allocate_slots(other, 8)
    assert kv.get_block_ids("o") == [3, blk1.block_id]
    assert blk1.block_hash == other.block_hashes[1]  # re-registered under its new content
    assert pool.get_cached_block(a.block_hashes[1]) is None
    assert kv.get_computed_blocks(make_request("y", list(range(9)), 4))[1] == 4  # only block 0 is left
    kv.free(other)
    more = make_request("m", list(range(60, 72)), 4)
    kv.allocate_slots(more, 12)
    assert blk0.block_hash is None or blk0.block_hash != a.block_hashes[0]
    assert pool.get_cached_block(a.block_hashes[0]) is None
    assert kv.get_computed_blocks(make_request("z", list(range(9)), 4)) == ([], 0)
    assert pool.num_evictions == 4  # a's two blocks, then other's two


# ---------------------------------------------------------------------------------------------------- scheduler
def run_ref(prompt, max_tokens, salt=None, max_model_len=64, ignore_eos=False):
    return true_output(prompt, salt, max_tokens, max_model_len, ignore_eos)


@pytest.mark.parametrize("prompt_len,expected_hit", [(12, 8), (10, 8), (13, 12), (1, 0), (4, 0), (5, 4)])
def test_full_prompt_hit_still_computes_last_token(prompt_len, expected_hit):
    # The last prompt token is always computed (its logits are needed). Hits are whole blocks, and a hit block is
    # never written, so a prompt that is a multiple of block_size recomputes its whole last block
    # (num_computed = num_tokens - block_size), others compute from the last block boundary
    # (13 tokens: 12 hit, 1 computed: the hit ends exactly on a block boundary).
    s = make_sched(block_size=4)
    run = KVSimRunner(s)
    prompt = [7 + (i * 5) % 11 for i in range(prompt_len)]
    s.add_request(make_request("a", prompt, 3))
    out_a = run_to_end(s, run)
    b = make_request("b", prompt, 3)
    s.add_request(b)
    acc = {}
    so, _ = step(s, run, acc)
    nr = so.scheduled_new_reqs[0]
    assert nr.num_computed_tokens == expected_hit and b.num_cached_tokens == expected_hit
    assert so.num_scheduled_tokens["b"] == prompt_len - expected_hit
    assert nr.block_ids[:expected_hit // 4] == [s.kv.block_pool.get_cached_block(h).block_id
                                                for h in b.block_hashes[:expected_hit // 4]]
    run_to_end(s, run, outputs=acc)
    assert out_a["a"] == acc["b"] == run_ref(prompt, 3)
    assert pool_whole(s)


def test_hit_ending_on_block_boundary():
    # 16 cached tokens + 1: the new request computes exactly one token, in a fresh block after the boundary.
    s = make_sched(block_size=4, budget=8)
    run = KVSimRunner(s)
    out = {}
    prompt = list(range(30, 47))  # 17 tokens
    s.add_request(make_request("a", prompt[:16] + [99], 2))
    run_to_end(s, run, outputs=out)
    s.add_request(make_request("b", prompt, 2))
    so, _ = step(s, run, out)
    nr = so.scheduled_new_reqs[0]
    assert nr.num_computed_tokens == 16 and so.num_scheduled_tokens["b"] == 1 and len(nr.block_ids) == 5
    assert s.kv.req_to_blocks["b"][4].block_hash is None
    run_to_end(s, run, outputs=out)
    assert out["b"] == run_ref(prompt, 2)


def test_prefix_hit_after_preemption():
    # 9 usable blocks of 4 tokens. a (16 prompt + 8 output tokens: 6 blocks) and b (16 + 16: 8 blocks) prefill 4
    # blocks each; decoding position 16, a takes the last free block and b is preempted: its 4 full blocks are freed
    # with their hashes, tail first. a's 6th block evicts b's last block; when a finishes, b resumes with a hit on
    # its first 3 blocks (12 tokens) and recomputes from there.
    outs = {}
    for caching in (True, False):
        s = make_sched(num_blocks=10, block_size=4, budget=64, caching=caching)
        run = KVSimRunner(s)
        a = make_request("a", list(range(1, 17)), 8)
        b = make_request("b", list(range(101, 117)), 16)
        s.add_request(a)
        s.add_request(b)
        resumed_hits = []
        for _ in range(200):
            if not s.has_unfinished_requests():
                break
            so = s.schedule()
            for cr in so.scheduled_cached_reqs:
                if cr.resumed_from_preemption:
                    resumed_hits.append((cr.req_id, cr.num_computed_tokens, len(cr.all_token_ids)))
            for eo in s.update_from_output(so, run(so)):
                outs.setdefault((caching, eo.request_id), []).extend(eo.new_token_ids)
            check_invariants(s)
        assert pool_whole(s)
        assert b.num_preemptions >= 1 and resumed_hits
        rid, hit, n = resumed_hits[0]
        assert rid == "b"
        if caching:
            # b's blocks were freed with their hashes; resuming, it hits them (all full blocks but the last token).
            assert hit == 12
            assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0  # counted at first admission only
        else:
            assert hit == 0
    for rid, prompt, n in (("a", list(range(1, 17)), 8), ("b", list(range(101, 117)), 16)):
        assert outs[(True, rid)] == outs[(False, rid)] == run_ref(prompt, n)


@pytest.mark.parametrize("chunked", [False, True])
def test_same_prefix_same_step(chunked):
    # Two requests with the same 16-token prompt arrive together. Without chunking a registers its full blocks at
    # allocation and b, later in the same step, hits 3 of them. With budget 10, a gets a 10-token chunk
    # (2 blocks full after the step), b gets nothing; next step a's last 6 tokens fill blocks 2-3 and b, admitted
    # in that same step with the 4 tokens left, hits 3 blocks (one filled in this very step) and computes 4.
    s = make_sched(block_size=4, budget=10 if chunked else 64)
    run = KVSimRunner(s)
    out = {}
    prompt = list(range(60, 76))
    s.add_request(make_request("a", prompt, 3, ignore_eos=True))
    s.add_request(make_request("b", prompt, 3, ignore_eos=True))
    so, _ = step(s, run, out)
    if chunked:
        assert so.num_scheduled_tokens == {"a": 10}
        so, _ = step(s, run, out)
        assert so.num_scheduled_tokens == {"a": 6, "b": 4}
    else:
        assert so.num_scheduled_tokens == {"a": 16, "b": 4}
    assert s.requests["b"].num_cached_tokens == 12
    pa, pb = s.kv.req_to_blocks["a"], s.kv.req_to_blocks["b"]
    assert pb[:3] == pa[:3] and pb[3] is not pa[3]
    assert [x.ref_cnt for x in pa] == [2, 2, 2, 1]
    run_to_end(s, run, outputs=out)
    assert out["a"] == out["b"] == run_ref(prompt, 3, ignore_eos=True)
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (32, 12)
    assert pool_whole(s)


def test_same_prefix_consecutive_steps_and_diverging_suffixes():
    s = make_sched(block_size=4)
    run = KVSimRunner(s)
    out = {}
    sys_prompt = list(range(300, 310))  # 2 full blocks + 2 tokens
    s.add_request(make_request("a", sys_prompt + [1, 2, 3], 5))
    step(s, run, out)
    s.add_request(make_request("b", sys_prompt + [4, 5, 6, 7, 8], 5))
    so, _ = step(s, run, out)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert s.kv.req_to_blocks["b"][:2] == s.kv.req_to_blocks["a"][:2]
    assert s.kv.req_to_blocks["b"][2] is not s.kv.req_to_blocks["a"][2]  # different third block
    run_to_end(s, run, outputs=out)
    assert out["a"] == run_ref(sys_prompt + [1, 2, 3], 5)
    assert out["b"] == run_ref(sys_prompt + [4, 5, 6, 7, 8], 5)


def test_parallel_sampling_children_share_prompt_blocks():
    # n=4 fans out into 4 child requests with one prompt, queued together: children 1-3 hit child 0's blocks.
    s = make_sched(block_size=4, budget=64)
    run = KVSimRunner(s)
    out = {}
    prompt = list(range(500, 514))  # 3 full blocks + 2 tokens
    for i in range(4):
        s.add_request(make_request(f"{i}_p", prompt, 4))
    so, _ = step(s, run, out)
    assert so.num_scheduled_tokens == {"0_p": 14, "1_p": 2, "2_p": 2, "3_p": 2}
    shared = s.kv.req_to_blocks["0_p"][:3]
    assert [b.ref_cnt for b in shared] == [4, 4, 4]
    assert all(s.kv.req_to_blocks[f"{i}_p"][:3] == shared for i in range(4))
    assert len({s.kv.req_to_blocks[f"{i}_p"][3].block_id for i in range(4)}) == 4  # private partial blocks
    run_to_end(s, run, outputs=out)
    assert all(out[f"{i}_p"] == run_ref(prompt, 4) for i in range(4))
    assert pool_whole(s)


def test_cache_salt_isolation():
    s = make_sched(block_size=4)
    run = KVSimRunner(s)
    out = {}
    prompt = list(range(700, 713))
    s.add_request(make_request("plain", prompt, 2))
    run_to_end(s, run, outputs=out)
    s.add_request(make_request("t1", prompt, 2, salt="tenant-1"))
    so, _ = step(s, run, out)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # salted: no hit on the unsalted prefix
    run_to_end(s, run, outputs=out)
    s.add_request(make_request("t1b", prompt, 2, salt="tenant-1"))
    s.add_request(make_request("t2", prompt, 2, salt="tenant-2"))
    s.add_request(make_request("plain2", prompt, 2))
    so, _ = step(s, run, out)
    hits = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
    assert hits == {"t1b": 12, "t2": 0, "plain2": 12}
    blocks = s.kv.req_to_blocks
    assert not set(ids(blocks["t1b"][:3])) & set(ids(blocks["plain2"][:3]))
    run_to_end(s, run, outputs=out)
    assert out["t1b"] == run_ref(prompt, 2, "tenant-1") and out["t2"] == run_ref(prompt, 2, "tenant-2")
    assert out["plain2"] == run_ref(prompt, 2)


def test_caching_off_path():
    s = make_sched(block_size=4, caching=False)
    run = KVSimRunner(s)
    out = {}
    prompt = list(range(20))
    s.add_request(make_request("a", prompt, 3))
    run_to_end(s, run, outputs=out)
    s.add_request(make_request("b", prompt, 3))
    s.add_request(make_request("c", prompt, 3))
    so, _ = step(s, run, out)
    assert so.num_scheduled_tokens == {"b": 20, "c": 20}
    assert not s.kv.block_pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in s.kv.block_pool.blocks)
    assert s.requests["b"].block_hashes == []  # no hashing cost
    run_to_end(s, run, outputs=out)
    assert out["b"] == out["c"] == run_ref(prompt, 3)
    assert s.make_stats().prefix_cache_hits == 0


def test_prompt_logprobs_request_gets_no_hit_but_others_can_hit_it():
    s = make_sched(block_size=4)
    run = KVSimRunner(s)
    out = {}
    prompt = list(range(40, 52))
    s.add_request(make_request("a", prompt, 2))
    run_to_end(s, run, outputs=out)
    s.add_request(make_request("plp", prompt, 2, prompt_logprobs=1))
    so, _ = step(s, run, out)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    run_to_end(s, run, outputs=out)


def test_reset_prefix_cache():
    s = make_sched(block_size=4)
    run = KVSimRunner(s)
    out = {}
    prompt = list(range(80, 93))
    s.add_request(make_request("a", prompt, 30))
    step(s, run, out)
    assert s.kv.block_pool.cached_block_hash_to_block
    assert s.kv.reset_prefix_cache()
    assert not s.kv.block_pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in s.kv.block_pool.blocks)
    s.add_request(make_request("b", prompt, 2))
    so, _ = step(s, run, out)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    run_to_end(s, run, outputs=out)
    assert out["a"] == run_ref(prompt, 30) and out["b"] == run_ref(prompt, 2)
    assert pool_whole(s)


def test_abort_frees_shared_blocks_once():
    s = make_sched(block_size=4)
    run = KVSimRunner(s)
    out = {}
    prompt = list(range(120, 133))
    s.add_request(make_request("a", prompt, 20, ignore_eos=True))
    s.add_request(make_request("b", prompt, 20, ignore_eos=True))
    step(s, run, out)
    shared = s.kv.req_to_blocks["a"][:3]
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    check_invariants(s)
    assert [b.ref_cnt for b in shared] == [1, 1, 1]
    run_to_end(s, run, outputs=out)
    assert out["b"] == run_ref(prompt, 20, ignore_eos=True)
    assert pool_whole(s)


# ---------------------------------------------------------------------------------------------------- utilization
def test_kv_utilization_steady_mixed_load():
    """block_size 16, mixed prompt (16-1024) and output (8-512) lengths, a pool that stays busy: the share of slots
    of held blocks that hold a computed token stays >= 95% (only each request's last block is partly empty)."""
    rng = random.Random(0)
    bs = 16
    s = Scheduler(KVCacheManager(2048, bs), max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=2048)
    run = KVSimRunner(s)
    counter = [0]

    def add():
        counter[0] += 1
        prompt = [rng.randrange(1, 30000) for _ in range(rng.randint(16, 1024))]
        s.add_request(make_request(f"r{counter[0]}", prompt, rng.randint(8, 512), ignore_eos=True))

    for _ in range(48):
        add()
    samples = []
    for i in range(500):
        so = s.schedule()
        s.update_from_output(so, run(so))
        while s.get_num_unfinished_requests() < 48:
            add()
        if i >= 50:
            u = s.kv_cache_utilization()
            assert abs(u - exact_kv_utilization(s)) < 1e-12
            samples.append(u)
    mean, low = sum(samples) / len(samples), min(samples)
    print(f"kv utilization over {len(samples)} steps: mean {mean:.4f}, min {low:.4f}")
    assert mean >= 0.95 and low >= 0.95


def test_kv_utilization_counts_shared_blocks_once():
    s = make_sched(block_size=16, budget=256)
    run = KVSimRunner(s)
    out = {}
    prompt = list(range(1000, 1040))
    s.add_request(make_request("a", prompt, 5))
    step(s, run, out)
    s.add_request(make_request("b", prompt[:32] + [1, 2, 3], 5))
    step(s, run, out)
    # a: 41 computed tokens in 3 blocks; b: 35 in 3 blocks, the first 2 shared: 4 blocks, 41 + 35 - 32 = 44 live.
    assert s.kv_cache_utilization() == exact_kv_utilization(s) == 44 / 64
