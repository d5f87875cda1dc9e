"""KV cache groups in the core (no torch): sliding-window groups free the blocks that fell out of their window,
share the pool with full-attention groups, and take part in prefix caching.

``WindowSimRunner`` is a fake runner that checks attention's real requirement at every computed position ``p``:
in each group, every position its layers can see (``[p - window + 1, p)``, everything for full attention) is
reachable through the runner's own block table (built from ``SchedulerOutput`` alone, like the real runner's) and
holds the KV of *this* request's prefix (a function of the token prefix, so a correct prefix hit passes and a block
reused by another request fails). The sampled token is a function of the whole prefix.
"""

from __future__ import annotations

import pytest

from kv_sim import make_request
from pagedllm.core.kv_cache_manager import GroupHits, KVCacheManager, cdiv
from pagedllm.core.output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.kv_cache_spec import AttentionSpec, plan_kv_cache_layout


def prefix_kv(tokens: list[int], p: int) -> int:
    return hash(tuple(tokens[: p + 1]))


def next_token(tokens: list[int]) -> int:
    return 100 + hash(tuple(tokens)) % 50


class WindowSimRunner:
    def __init__(self, sched: Scheduler) -> None:
        self.kv = sched.kv
        self.bs = sched.block_size
        self.windows = self.kv.group_windows
        self.cache = [dict() for _ in self.windows]  # per group: slot -> value
        self.tables: dict[str, list[list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.tables[nr.req_id] = [list(nr.block_ids)] + [list(t) for t in so.new_group_block_ids.get(nr.req_id, [])]
            self.tokens[nr.req_id] = list(nr.prompt_token_ids)
            self.computed[nr.req_id] = nr.num_computed_tokens
        for cr in so.scheduled_cached_reqs:
            extra = so.new_group_block_ids.get(cr.req_id, [[] for _ in self.windows[1:]])
            if cr.resumed_from_preemption:
                self.tables[cr.req_id] = [list(cr.new_block_ids)] + [list(t) for t in extra]
                self.tokens[cr.req_id] = list(cr.all_token_ids)
            else:
                self.tables[cr.req_id][0].extend(cr.new_block_ids)
                for table, ids in zip(self.tables[cr.req_id][1:], extra):
                    table.extend(ids)
            self.computed[cr.req_id] = cr.num_computed_tokens
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            toks = self.tokens[rid]
            start = self.computed[rid]
            # write this step's KV first (attention reads it in the same step), then check every read
            for g in range(len(self.windows)):
                for p in range(start, start + n):
                    self.cache[g][self._slot(rid, g, p)] = prefix_kv(toks, p)
            for g, w in enumerate(self.windows):
                for p in range(start, start + n):
                    for q in range(0 if w is None else max(0, p - w + 1), p):
                        assert self.cache[g].get(self._slot(rid, g, q)) == prefix_kv(toks, q), (rid, g, p, q)
            self.computed[rid] = start + n
            req_ids.append(rid)
            if start + n >= len(toks):
                tok = next_token(toks)
                toks.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _slot(self, rid: str, g: int, p: int) -> int:
        block = self.tables[rid][g][p // self.bs]
        assert block != 0, f"group {g} position {p} of {rid} is in the null block"
        return block * self.bs + p % self.bs


def true_output(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def make_sched(windows, num_blocks=64, block_size=4, budget=64, max_model_len=256, caching=True):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, group_windows=windows)
    return Scheduler(kv, 8, budget, max_model_len)


def run(sched, runner, max_steps=2000, on_step=None) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return out
        so = sched.schedule()
        for eo in sched.update_from_output(so, runner(so)):
            out.setdefault(eo.request_id, []).extend(eo.new_token_ids)
        if on_step is not None:
            on_step(so)
    raise AssertionError("did not finish")


def pool_whole(sched) -> bool:
    kv = sched.kv
    return (kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks - 1
            and not any(kv.group_req_to_blocks[g] for g in range(kv.num_groups)))


# ---------------------------------------------------------------------------------------------------- layout
def test_layout_groups_gemma3_270m():
    specs = [AttentionSpec(1, 256, None if (i + 1) % 6 == 0 else 512) for i in range(18)]
    layout = plan_kv_cache_layout(specs)
    assert layout.group_windows == (None, 512, 512, 512, 512, 512)
    assert [i for i, g in enumerate(layout.layer_group) if g == 0] == [5, 11, 17]
    assert [i for i, g in enumerate(layout.layer_group) if g == 4] == [10, 12, 13]
    assert layout.layer_slot[13] == 2 and layout.layers_per_group == 3
    # one pool block: 16 tokens of 3 layers (K and V, 1 head of 256, bf16)
    assert layout.bytes_per_block(16, 2) == 16 * 3 * 2 * 256 * 2
    # a 2,000-token request: 125 blocks in the global group, 33 in each window group
    assert layout.blocks_for_one_request(2000, 16, 1) == 125 + 5 * 33


def test_layout_single_group_cases():
    mistral = plan_kv_cache_layout([AttentionSpec(2, 32, 8)] * 3)
    assert mistral.group_windows == (8,) and mistral.layer_slot == (0, 1, 2)
    llama = plan_kv_cache_layout([(2, 32)] * 4)  # the older (kv_heads, head_dim) form
    assert llama.group_windows == (None,) and llama.layer_slot == (0, 1, 2, 3)
    # different shapes can't share tensors: one group, no freeing
    mixed = plan_kv_cache_layout([AttentionSpec(2, 32, None), AttentionSpec(2, 64, 8)])
    assert mixed.group_windows == (None,) and mixed.layer_slot == (0, 1)
    qwen = plan_kv_cache_layout([AttentionSpec(2, 32, None)] + [AttentionSpec(2, 32, 6)] * 2)
    assert qwen.group_windows == (None, 6, 6) and qwen.layer_group == (0, 1, 2)


# ---------------------------------------------------------------------------------------------------- manager
def test_window_group_releases_blocks_behind_the_window():
    kv = KVCacheManager(64, 4, group_windows=[None, 8])
    r = make_request("a", list(range(10)), 30)
    assert kv.allocate_slots(r, 10) is not None
    r.num_computed_tokens = 10
    assert len(kv.req_to_blocks["a"]) == 3 and len(kv.group_req_to_blocks[1]["a"]) == 3
    first_ids = kv.get_group_block_ids("a", 1)
    free0 = kv.block_pool.get_num_free_blocks()
    # next query at position 10 sees keys 3..9: block 0 (tokens 0-3) is still needed for key 3
    kv.allocate_slots(r, 1)
    assert kv.block_pool.get_num_free_blocks() == free0
    r.num_computed_tokens = 12
    r.append_output_token_ids([1, 2])
    # at 12: keys 5..11, block 0 goes back to the pool (and stays cached), block 3 is new in both groups
    new = kv.allocate_slots(r, 1)
    assert len(new) == 1 and kv.block_pool.get_num_free_blocks() == free0 - 2 + 1
    g1 = kv.group_req_to_blocks[1]["a"]
    assert g1[0].is_null and not any(b.is_null for b in g1[1:]) and len(g1) == 4
    # the runner learns ids as they are allocated; a released block stays in its table, unread (out of window)
    assert kv.take_new_group_block_ids() == {"a": [first_ids + [g1[3].block_id]]}
    assert kv.take_new_group_block_ids() == {}
    assert kv.get_group_block_ids("a", 1) == [0] + first_ids[1:] + [g1[3].block_id]
    null = kv.block_pool.null_block
    ref = null.ref_cnt
    kv.free(r)
    assert null.ref_cnt == ref and kv.block_pool.get_num_free_blocks() == 63


def test_blocks_held_stay_within_the_window_bound():
    bs, w = 4, 10
    sched = make_sched([None, w], num_blocks=200, block_size=bs, budget=8)
    runner = WindowSimRunner(sched)
    prompt = list(range(1, 40))
    sched.add_request(make_request("a", prompt, 60))
    held = []

    def on_step(so):
        if "a" in sched.kv.group_req_to_blocks[1]:
            g1 = sched.kv.group_req_to_blocks[1]["a"]
            held.append((len([b for b in g1 if not b.is_null]), so.num_scheduled_tokens.get("a")))

    out = run(sched, runner, on_step=on_step)
    assert out["a"] == true_output(prompt, 60)
    # decode: at most cdiv(w, bs) + 1 blocks; chunks of 8: cdiv(w - 1 + 8, bs) + 1
    assert max(h for h, n in held if n == 1) <= cdiv(w, bs) + 1
    assert max(h for h, n in held) <= cdiv(w - 1 + 8, bs) + 1
    assert pool_whole(sched)


@pytest.mark.parametrize("windows,num_blocks", [([None, 6, 6], 30), ([6], 12), ([None, 5, 9], 30)])
def test_many_requests_chunked_preempted_with_prefix_hits_read_the_right_kv(windows, num_blocks):
    # prompts sharing long prefixes, a tight pool (preemption), small chunks (budget 10, block_size 4)
    sched = make_sched(windows, num_blocks=num_blocks, block_size=4, budget=10, max_model_len=80)
    runner = WindowSimRunner(sched)
    prompts = {}
    for i in range(9):
        base = [7, 7, 7, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13][: 10 + i] + [50 + i % 3] * (i % 4)
        prompts[f"r{i}"] = base + list(range(20, 20 + i))
    reqs = [make_request(rid, p, 12 + len(p) % 5) for rid, p in prompts.items()]
    for r in reqs:
        sched.add_request(r)
    out = run(sched, runner)
    for rid, p in prompts.items():
        assert out[rid] == true_output(p, 12 + len(p) % 5), rid
    assert sched.num_preemptions > 0
    assert sum(r.num_cached_tokens for r in reqs) > 0  # prefix hits happened
    assert pool_whole(sched)


def test_prefix_hit_in_window_groups_skips_blocks_before_the_window():
    bs = 4
    sched = make_sched([None, 6], num_blocks=64, block_size=bs, budget=64)
    runner = WindowSimRunner(sched)
    prompt = list(range(1, 31))  # 30 tokens: 7 full blocks
    sched.add_request(make_request("a", prompt, 3))
    run(sched, runner)
    kv = sched.kv
    b = make_request("b", prompt + [99], 3)
    hits, n = kv.get_computed_blocks(b)
    assert isinstance(hits, GroupHits) and n == 28  # 7 full blocks (the last token is always computed)
    g0, g1 = hits.groups
    assert len(g0) == len(g1) == 7 and not any(x.is_null for x in g0)
    # window 6 before position 28: keys 23..27 = blocks 5 and 6; blocks 0-4 are the null block
    assert [x.is_null for x in g1] == [True] * 5 + [False] * 2
    # a window block of group 1 evicted: the hit shrinks to what group 1 still has (block 5 missing -> m = 5,
    # whose window, keys 15..19, is blocks 3 and 4: still cached)
    kv.update_block_hashes(b)
    key = b.block_hashes[5] + kv._hash_suffix[1]
    kv.block_pool.cached_block_hash_to_block.pop(key).block_hash = None
    hits, n = kv.get_computed_blocks(b)
    assert n == 20 and [x.is_null for x in hits.groups[1]] == [True] * 3 + [False] * 2
    sched.add_request(b)
    out = run(sched, runner)
    assert out["b"] == true_output(prompt + [99], 3)
    assert b.num_cached_tokens == 20
    assert pool_whole(sched)


def test_utilization_counts_every_group_and_skips_released_blocks():
    sched = make_sched([None, 8], num_blocks=64, block_size=4, budget=64)
    runner = WindowSimRunner(sched)
    sched.add_request(make_request("a", list(range(1, 30)), 20))
    for _ in range(8):
        so = sched.schedule()
        sched.update_from_output(so, runner(so))
    u = sched.kv_cache_utilization()
    kv = sched.kv
    r = sched.requests["a"]
    held0 = len(kv.req_to_blocks["a"])
    held1 = len([b for b in kv.group_req_to_blocks[1]["a"] if not b.is_null])
    live1 = r.num_computed_tokens - kv.group_num_skipped[1]["a"] * 4
    assert kv.num_allocated_blocks() == held0 + held1
    assert u == pytest.approx((r.num_computed_tokens + live1) / ((held0 + held1) * 4))
    assert 0 < u <= 1


@pytest.mark.parametrize("windows,num_blocks,caching", [([None, 6, 6], 30, True), ([6], 12, True), ([None, 5, 9], 30, False),
                                                        ([None], 16, True)])
def test_quiet_fast_path_changes_nothing(windows, num_blocks, caching):
    # allocate_slots / release_out_of_window return early for a request inside its blocks (KVCacheManager._quiet):
    # the same workload with the early return disabled must give the same schedule, block tables (every group),
    # free-list order, prefix-cache contents and outputs, step by step; the fast path must have been taken.
    def trace(fast: bool):
        sched = make_sched(windows, num_blocks=num_blocks, block_size=4, budget=10, max_model_len=80, caching=caching)
        kv = sched.kv
        calls = [0, 0]  # allocate_slots calls, of which went the whole way (recorded their limits) or failed
        limits, allocate = kv._quiet_limits, kv.allocate_slots

        def counting_limits(rid):
            calls[1] += 1
            return limits(rid) if fast else (0, 0, 0)  # (0, 0, 0): never quiet

        def counting_allocate(*a, **k):
            calls[0] += 1
            got = allocate(*a, **k)
            calls[1] += got is None
            return got

        kv._quiet_limits, kv.allocate_slots = counting_limits, counting_allocate
        runner = WindowSimRunner(sched)
        for i in range(7):
            p = [7, 7, 7, 7, 1, 2, 3, 4, 5, 6, 7, 8][: 6 + i] + list(range(20, 20 + 2 * i))
            sched.add_request(make_request(f"r{i}", p, 10 + 3 * i))
        steps = []

        def on_step(so):
            tables = [{rid: [b.block_id for b in blocks] for rid, blocks in kv.group_req_to_blocks[g].items()}
                      for g in range(kv.num_groups)]
            free = kv.block_pool.free_block_queue.block_ids()
            cached = sorted((h, b.block_id) for h, b in kv.block_pool.cached_block_hash_to_block.items())
            steps.append((dict(so.num_scheduled_tokens), [c.new_block_ids for c in so.scheduled_cached_reqs],
                          {k: [list(t) for t in v] for k, v in so.new_group_block_ids.items()}, tables, free, cached))

        out = run(sched, runner, on_step=on_step)
        assert pool_whole(sched)
        assert not kv._quiet  # every finished or preempted request's record went with its blocks
        return out, steps, sched.num_preemptions, calls[0] - calls[1]  # the early returns

    fast, slow = trace(True), trace(False)
    assert fast[3] > 0 and slow[3] == 0
    assert fast[0] == slow[0]
    assert fast[2] == slow[2]
    assert len(fast[1]) == len(slow[1])
    for i, (a, b) in enumerate(zip(fast[1], slow[1])):
        assert a == b, f"step {i}"


def test_block_tables_array_pads_each_table_with_the_null_block():
    import numpy as np

    from pagedllm.worker.model_runner import block_tables_array

    rng = np.random.default_rng(0)
    for groups, n in ((1, 1), (1, 5), (6, 1), (6, 16), (3, 4)):
        tables = [list(rng.integers(1, 1000, rng.integers(1, 9))) for _ in range(groups * n)]
        got = block_tables_array(tables, groups, n)
        width = max(len(t) for t in tables)
        want = np.zeros((groups, n, width), dtype=np.int64)
        for k, t in enumerate(tables):
            want[k // n, k % n, : len(t)] = t
        assert got.dtype == np.int64 and got.shape == want.shape and (got == want).all()
