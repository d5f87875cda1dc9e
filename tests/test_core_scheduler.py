"""Scheduler + KV cache manager + block pool, driven by a fake runner (no torch, no model)."""

import subprocess
import sys

import pytest

from pagedllm.core.block_pool import NONE_HASH, BlockPool, hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

EOS = 999


def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256, caching=True):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(kv, max_num_seqs, budget, max_model_len)


def req(rid, n_prompt, max_tokens=4, base=0, **kw):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return Request(rid, [base + i for i in range(n_prompt)], sp, eos_token_ids={EOS})


class FakeRunner:
    """Samples token ``100 + len(all tokens)`` (or a scripted token) for each request that completes its prompt."""

    def __init__(self, sched: Scheduler, script=None):
        self.sched = sched
        self.script = script or {}
        self.known: set[str] = set()

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.known.discard(rid)
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.known
            self.known.add(nr.req_id)
        for cr in so.scheduled_cached_reqs:
            assert cr.req_id in self.known, "runner told about a request it never saw"
        ids, toks = [], []
        for rid, n in so.num_scheduled_tokens.items():
            r = self.sched.requests[rid]
            ids.append(rid)
            if r.num_computed_tokens + n >= r.num_tokens:
                seq = self.script.get(rid)
                t = seq[r.num_output_tokens] if seq else 100 + r.num_tokens
                toks.append([t])
            else:
                toks.append([])
        return ModelRunnerOutput(ids, toks)


def step(sched, runner):
    so = sched.schedule()
    outs = sched.update_from_output(so, runner(so))
    check_pool_invariants(sched)
    return so, outs


def check_pool_invariants(sched: Scheduler):
    kv = sched.kv
    pool = kv.block_pool
    free_ids = set(pool.free_block_queue.block_ids())
    refs = {}
    for blocks in kv.req_to_blocks.values():
        for b in blocks:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for b in pool.blocks[1:]:
        assert b.ref_cnt == refs.get(b.block_id, 0), f"{b} ref_cnt != number of block tables holding it"
        assert (b.block_id in free_ids) == (b.ref_cnt == 0), f"{b} free/referenced mismatch"
    assert 0 not in free_ids


def pool_whole(sched):
    pool = sched.kv.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks - 1 and not sched.kv.req_to_blocks


def run_all(sched, runner, max_steps=1000):
    outs_all = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, outs = step(sched, runner)
        outs_all.extend(outs)
    assert not sched.has_unfinished_requests()
    return outs_all


def test_core_does_not_import_torch():
    code = ("import sys; import pagedllm.core.scheduler, pagedllm.core.kv_cache_manager, pagedllm.core.block_pool;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_chunked_prefill_chunk_sizes_under_budget():
    s = make_sched(budget=8, block_size=4)
    r = FakeRunner(s)
    s.add_request(req("a", 20, max_tokens=2))
    chunks = []
    for _ in range(3):
        so, _ = step(s, r)
        chunks.append(so.num_scheduled_tokens["a"])
    assert chunks == [8, 8, 4]
    assert s.requests["a"].num_output_tokens == 1  # sampled only after the last chunk
    so, outs = step(s, r)
    assert so.num_scheduled_tokens == {"a": 1}
    assert outs[0].finish_reason == "length"
    assert pool_whole(s)


def test_long_prefill_token_threshold_caps_each_prompt_chunk():
    """vLLM's long_prefill_token_threshold: no request computes more than that many tokens in a step, so the prompts
    queued behind a long one get budget in the same step; the budget still caps the step."""
    kv = KVCacheManager(64, 4, enable_caching=True)
    s = Scheduler(kv, 8, 16, 256, long_prefill_token_threshold=6)
    r = FakeRunner(s)
    s.add_request(req("a", 20, max_tokens=2))
    s.add_request(req("b", 4, max_tokens=2, base=300))
    s.add_request(req("c", 9, max_tokens=2, base=600))
    steps = []
    while s.has_unfinished_requests():
        so, _ = step(s, r)
        steps.append(dict(so.num_scheduled_tokens))
    assert steps[0] == {"a": 6, "b": 4, "c": 6}
    assert steps[1] == {"a": 6, "b": 1, "c": 3}
    assert steps[2] == {"a": 6, "c": 1}  # b finished (2 tokens)
    assert steps[3] == {"a": 2}  # c finished
    assert steps[4] == {"a": 1} and len(steps) == 5
    assert all(sum(st.values()) <= 16 for st in steps)
    assert pool_whole(s)


def test_budget_shared_running_first_then_fcfs():
    s = make_sched(budget=10, block_size=4)
    r = FakeRunner(s)
    s.add_request(req("a", 6, max_tokens=5))
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {"a": 6}
    s.add_request(req("b", 12, max_tokens=5, base=300))
    s.add_request(req("c", 3, max_tokens=5, base=600))
    so, _ = step(s, r)
    # a decodes (1), b gets the remaining 9 (chunked); c must wait (FCFS, budget gone).
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 9)]
    so, _ = step(s, r)
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 3), ("c", 3)]
    run_all(s, r)
    assert pool_whole(s)


def test_max_num_seqs_caps_running():
    s = make_sched(max_num_seqs=2, budget=100)
    r = FakeRunner(s)
    for i in range(4):
        s.add_request(req(f"r{i}", 5, max_tokens=3))
    so, _ = step(s, r)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert [q.request_id for q in s.waiting] == ["r2", "r3"]
    run_all(s, r)
    assert pool_whole(s)


def test_stop_on_eos_stop_token_and_length():
    s = make_sched()
    script = {"eos": [5, EOS, 7], "stopid": [5, 42, 7], "len": [5, 6, 7, 8]}
    r = FakeRunner(s, script)
    s.add_request(req("eos", 4, max_tokens=3))
    s.add_request(req("stopid", 4, max_tokens=3, stop_token_ids=[42]))
    s.add_request(req("len", 4, max_tokens=3))
    s.add_request(Request("ign", [1, 2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_ids={EOS}))
    r.script["ign"] = [EOS, EOS, EOS]
    outs = run_all(s, r)
    fin = {o.request_id: o for o in outs if o.finished}
    assert fin["eos"].finish_reason == "stop" and fin["eos"].stop_reason is None
    assert fin["stopid"].finish_reason == "stop" and fin["stopid"].stop_reason == 42
    assert fin["len"].finish_reason == "length"
    assert fin["ign"].finish_reason == "length"
    toks = {}
    for o in outs:
        toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert toks == {"eos": [5, EOS], "stopid": [5, 42], "len": [5, 6, 7], "ign": [EOS] * 3}
    assert pool_whole(s)


def test_min_tokens_defers_eos():
    s = make_sched()
    r = FakeRunner(s, {"a": [EOS, EOS, 3, EOS]})
    s.add_request(req("a", 4, max_tokens=10, min_tokens=2))
    outs = run_all(s, r)
    toks = [t for o in outs for t in o.new_token_ids]
    assert toks == [EOS, EOS, 3, EOS]


def test_preemption_and_resume_recompute():
    # 7 usable blocks of 4 tokens; two requests of 8 prompt tokens + 12 output tokens need 5 blocks each.
    s = make_sched(num_blocks=8, block_size=4, budget=64, caching=False)
    r = FakeRunner(s)
    s.add_request(req("a", 8, max_tokens=12))
    s.add_request(req("b", 8, max_tokens=12, base=50))
    preempted = []
    resumed_seen = False
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        preempted.extend(so.preempted_req_ids)
        resumed_seen |= any(c.resumed_from_preemption for c in so.scheduled_cached_reqs)
        for c in so.scheduled_cached_reqs:
            if c.resumed_from_preemption:
                rq = s.requests[c.req_id]
                assert rq.num_computed_tokens == 0 and len(c.all_token_ids) == rq.num_tokens
                assert so.num_scheduled_tokens[c.req_id] == rq.num_tokens  # recompute prompt + outputs
        s.update_from_output(so, r(so))
        check_pool_invariants(s)
    assert preempted == ["b"] or preempted[0] == "b"  # the latest request is the victim
    assert resumed_seen
    assert not s.has_unfinished_requests() and pool_whole(s)


def test_preempted_output_not_repeated():
    s = make_sched(num_blocks=8, block_size=4, budget=64, caching=False)
    r = FakeRunner(s)
    s.add_request(req("a", 8, max_tokens=12))
    s.add_request(req("b", 8, max_tokens=12, base=50))
    outs = run_all(s, r)
    for rid in ("a", "b"):
        toks = [t for o in outs if o.request_id == rid for t in o.new_token_ids]
        assert len(toks) == 12
        # FakeRunner's token = 100 + position: strictly increasing by one without repeats or gaps.
        assert toks == list(range(100 + 8, 100 + 20))


def test_abort_frees_blocks_and_tells_runner():
    s = make_sched()
    r = FakeRunner(s)
    s.add_request(req("a", 10, max_tokens=50))
    s.add_request(req("b", 10, max_tokens=50))
    step(s, r)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    check_pool_invariants(s)
    so, _ = step(s, r)
    assert "a" in so.finished_req_ids and "a" not in so.num_scheduled_tokens
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert pool_whole(s)


def test_abort_waiting_request_never_seen_by_runner():
    s = make_sched(max_num_seqs=1)
    r = FakeRunner(s)
    s.add_request(req("a", 4))
    s.add_request(req("b", 4))
    step(s, r)
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    so, _ = step(s, r)
    assert "b" not in so.finished_req_ids


def test_chunk_ending_on_block_boundary():
    s = make_sched(block_size=4, budget=8)
    r = FakeRunner(s)
    s.add_request(req("a", 16, max_tokens=3))
    so, _ = step(s, r)
    assert so.num_scheduled_tokens["a"] == 8
    assert len(s.kv.req_to_blocks["a"]) == 2  # exactly 2 full blocks, no spare
    so, _ = step(s, r)
    assert len(s.kv.req_to_blocks["a"]) == 4
    so, _ = step(s, r)  # first decode token (position 16) needs a 5th block
    assert so.num_scheduled_tokens["a"] == 1 and len(s.kv.req_to_blocks["a"]) == 5
    assert so.scheduled_cached_reqs[0].new_block_ids == [s.kv.req_to_blocks["a"][-1].block_id]
    run_all(s, r)
    assert pool_whole(s)


def test_free_list_exact_order_after_alloc_and_free():
    pool = BlockPool(10, enable_caching=False)
    assert pool.free_block_queue.block_ids() == list(range(1, 10))
    a = pool.get_new_blocks(3)  # 1, 2, 3
    b = pool.get_new_blocks(2)  # 4, 5
    assert [x.block_id for x in a] == [1, 2, 3] and [x.block_id for x in b] == [4, 5]
    pool.free_blocks(reversed(a))  # a request frees tail first; hashless blocks go to the head (evict nothing)
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 6, 7, 8, 9]
    pool.free_blocks(reversed(b))
    assert pool.free_block_queue.block_ids() == [4, 5, 1, 2, 3, 6, 7, 8, 9]
    c = pool.get_new_blocks(5)
    assert [x.block_id for x in c] == [4, 5, 1, 2, 3]
    assert all(x.ref_cnt == 1 for x in c)


def test_null_block_never_allocated():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert 0 not in [b.block_id for b in got]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_startup_sizing_error_message():
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from pagedllm.worker.model_runner import determine_num_blocks
    import torch

    cfg = SimpleNamespace(
        cache=SimpleNamespace(block_size=16, num_blocks=0, kv_cache_memory_bytes=10 * 16 * 2 * 2 * 64 * 2),
        model=SimpleNamespace(max_model_len=1000, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="max_model_len=1000"):
        determine_num_blocks(cfg, [(2, 64)])


def test_hash_chain_values():
    h1 = hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    h2 = hash_block_tokens(h1, [5, 6, 7, 8])
    assert h1 != hash_block_tokens(NONE_HASH, [1, 2, 3, 5])
    assert h2 != hash_block_tokens(hash_block_tokens(NONE_HASH, [0, 2, 3, 4]), [5, 6, 7, 8])  # parent matters
    assert hash_block_tokens(NONE_HASH, [1, 2, 3, 4], "tenant-a") != h1
    import hashlib
    from array import array

    assert h1 == hashlib.sha256(NONE_HASH + array("q", [1, 2, 3, 4]).tobytes()).digest()
    kv = KVCacheManager(16, 4)
    r = Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams())
    kv.update_block_hashes(r)
    assert r.block_hashes == [h1, h2]


# ---------------------------------------------------------------------------------------------------- batches in flight
def run_pipelined(sched, runner, depth=2, max_steps=2000, on_step=None):
    """Drives ``sched`` the way ``EngineCore.step_with_batch_queue`` does: up to ``depth`` batches in flight, each
    holding at most ceil(unfinished / depth) requests; the fake runner "executes" a batch when it is sent (stages
    run batches in order). Checks at every step that no request is in two batches in flight and that no request in
    flight is preempted. -> (all EngineCoreOutputs, most batches in flight at once)."""
    queue, outs, peak = [], [], 0
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not queue:
            break
        max_reqs = -(-(len(sched.running) + len(sched.waiting)) // depth)
        while len(queue) < depth:
            so = sched.schedule(max(1, max_reqs))
            if so.is_empty:
                sched.finished_req_ids |= so.finished_req_ids
                break
            assert not so.preempted_req_ids & sched.in_flight_req_ids, "a request in flight was preempted"
            assert not set(so.num_scheduled_tokens) & sched.in_flight_req_ids, "scheduled twice while in flight"
            assert len(so.num_scheduled_tokens) <= max(1, max_reqs)
            sched.mark_in_flight(so)
            queue.append((so, runner(so)))
            peak = max(peak, len(queue))
            check_pool_invariants(sched)
        if not queue:
            continue
        so, out = queue.pop(0)
        outs.extend(sched.update_from_output(so, out))
        check_pool_invariants(sched)
        if on_step is not None:
            on_step(sched, queue)
    assert not sched.has_unfinished_requests() and not sched.in_flight_req_ids
    return outs, peak


def _tokens(outs):
    got = {}
    for o in outs:
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return got


def _mixed_requests(s):
    for i in range(6):  # prompts of 3..43 tokens (chunked by the 32-token budget), 2..12 output tokens
        s.add_request(req(f"r{i}", 3 + 8 * i, max_tokens=2 + 2 * i, base=10 * i))


def test_in_flight_batches_split_requests_and_wait_for_tokens():
    s = make_sched(budget=32, max_num_seqs=8)
    s.use_pp = True
    for i in range(4):
        s.add_request(req(f"r{i}", 3, max_tokens=3, base=10 * i))
    r = FakeRunner(s)
    a = s.schedule(2)
    s.mark_in_flight(a)
    b = s.schedule(2)
    s.mark_in_flight(b)
    assert list(a.num_scheduled_tokens) == ["r0", "r1"] and list(b.num_scheduled_tokens) == ["r2", "r3"]
    assert s.schedule(2).is_empty  # every request is in flight: nothing to compute until an output is back
    s.update_from_output(a, r(a))
    c = s.schedule(2)
    assert c.num_scheduled_tokens == {"r0": 1, "r1": 1}
    # ranks other than the output rank learn the sampled tokens from the next step
    assert {cr.req_id: cr.new_token_ids for cr in c.scheduled_cached_reqs} == {"r0": [103], "r1": [103]}


def test_in_flight_chunks_of_one_prompt_are_sequential():
    s = make_sched(budget=16)
    s.use_pp = True
    s.add_request(req("long", 40, max_tokens=2))
    r = FakeRunner(s)
    a = s.schedule()
    s.mark_in_flight(a)
    assert a.num_scheduled_tokens == {"long": 16}
    assert s.schedule().is_empty  # its second chunk waits for the first
    s.update_from_output(a, r(a))
    b = s.schedule()
    assert b.num_scheduled_tokens == {"long": 16}
    assert b.scheduled_cached_reqs[0].num_computed_tokens == 16 and b.scheduled_cached_reqs[0].new_token_ids == []


def test_pipelined_outputs_equal_one_batch_at_a_time():
    want = {}
    s = make_sched(budget=32)
    _mixed_requests(s)
    want = _tokens(run_all(s, FakeRunner(s)))
    s = make_sched(budget=32)
    s.use_pp = True
    _mixed_requests(s)
    got, peak = run_pipelined(s, FakeRunner(s))
    assert _tokens(got) == want and peak == 2 and pool_whole(s)


def test_pipelined_preemption_spares_requests_in_flight():
    # 11 usable blocks of 4 tokens for 4 requests of 8 + 12 tokens (5 blocks each): preemptions, some while the
    # latest running request is in flight.
    s = make_sched(num_blocks=12, block_size=4, budget=64, caching=False)
    s.use_pp = True
    for i in range(4):
        s.add_request(req(f"r{i}", 8, max_tokens=12, base=50 * i))
    outs, peak = run_pipelined(s, FakeRunner(s))
    assert s.num_preemptions > 0 and peak == 2
    for i in range(4):  # FakeRunner's token = 100 + position: nothing repeated or lost across preemptions
        assert _tokens(outs)[f"r{i}"] == list(range(108, 120))
    assert pool_whole(s)


def test_abort_while_in_flight():
    s = make_sched()
    s.use_pp = True
    r = FakeRunner(s)
    s.add_request(req("a", 5, max_tokens=8))
    s.add_request(req("b", 5, max_tokens=8))
    a = s.schedule(1)
    s.mark_in_flight(a)
    out_a = r(a)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # its blocks are free at once
    check_pool_invariants(s)
    s.add_request(req("a", 5, max_tokens=8, base=30))  # the id reused before a's batch is back: waits for it
    b = s.schedule(2)
    assert "a" not in b.num_scheduled_tokens and "a" in b.finished_req_ids
    s.mark_in_flight(b)
    assert s.update_from_output(a, out_a) == []  # the aborted request's output is dropped
    assert s.requests["a"].num_computed_tokens == 0 and s.requests["a"].status == RequestStatus.WAITING
    s.update_from_output(b, r(b))
    c = s.schedule(2)
    assert "a" in c.num_scheduled_tokens and c.scheduled_new_reqs[0].prompt_token_ids[0] == 30


def test_preemption_victim_is_the_latest_request_not_in_flight():
    # 4 usable blocks of 4 tokens; three 4-token prompts fill one block each. Batches: (r0, r1), then (r2). While r2 is
    # in flight r0 takes the last block and r1 finds none: the victim is r1 (the latest running request not in
    # flight), not r2.
    s = make_sched(num_blocks=5, block_size=4, budget=64, caching=False)
    s.use_pp = True
    for i in range(3):
        s.add_request(req(f"r{i}", 4, max_tokens=4, base=50 * i))
    first = []

    def on_step(sched, queue):
        if sched.num_preemptions and not first:
            first.append([so.num_scheduled_tokens for so, _ in queue])

    outs, peak = run_pipelined(s, FakeRunner(s), on_step=on_step)
    # after r2's batch came back: in flight is the batch that preempted r1 (scheduled while r2 was in flight)
    assert first and first[0] == [{"r0": 1}]
    assert s.requests == {} and peak == 2
    assert _tokens(outs) == {f"r{i}": [104, 105, 106, 107] for i in range(3)}


def test_awaiting_grammar_prefills_all_but_the_sampled_token_and_never_blocks_the_queue():
    """A request whose grammar still compiles (``awaiting_grammar``) prefills its prompt up to, not including, its
    last token (the one whose logits are sampled under the mask); one with nothing left to prefill steps aside
    without holding up the requests behind it, and keeps its place; once the grammar is ready it samples."""
    sched = make_sched(budget=8)
    runner = FakeRunner(sched)
    a = req("a", 10)
    a.awaiting_grammar = True
    one = req("one", 1)
    one.awaiting_grammar = True  # a 1-token prompt: nothing to prefill before the sampled token
    b = req("b", 3)
    for r in (a, one, b):
        sched.add_request(r)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 8}  # a chunk of a; budget spent
    sched.update_from_output(so, runner(so))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 3}  # a stops one short of its prompt; "one" steps aside
    sched.update_from_output(so, runner(so))
    assert a.num_computed_tokens == 9 and a.num_output_tokens == 0 and b.num_output_tokens == 1
    assert list(sched.waiting) == [one]
    so = sched.schedule()
    assert "a" not in so.num_scheduled_tokens and "one" not in so.num_scheduled_tokens
    sched.update_from_output(so, runner(so))
    a.awaiting_grammar = one.awaiting_grammar = False
    so = sched.schedule()
    assert so.num_scheduled_tokens["a"] == 1 and so.num_scheduled_tokens["one"] == 1
    sched.update_from_output(so, runner(so))
    assert a.num_output_tokens == 1 and one.num_output_tokens == 1
    check_pool_invariants(sched)


def test_awaiting_grammar_without_chunked_prefill_waits_whole():
    kv = KVCacheManager(64, 4, enable_caching=True)
    sched = Scheduler(kv, 8, 32, 256, enable_chunked_prefill=False)
    a = req("a", 10)
    a.awaiting_grammar = True
    sched.add_request(a)
    sched.add_request(req("b", 5))
    assert sched.schedule().num_scheduled_tokens == {"b": 5}
