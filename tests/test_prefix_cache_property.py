"""Property test: random workloads through Scheduler + KVCacheManager + a simulated-KV runner, tiny pools.

Random arrivals, prompts built from a few shared prefixes (so hits, same-step sharing and n>1-like groups happen),
salts, max_tokens, aborts, budgets and pool sizes down to one max-length request. After every step
``kv_sim.check_invariants`` holds (no block both free and referenced, ref_cnt == number of block tables holding it,
hash table consistent both ways, block counts, utilization formula == its definition); at the end the pool is whole,
and every request's tokens are the ones ``true_output`` predicts, with caching on and off alike (the simulated KV is
read through the block tables, so a wrong hit would change them).
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_sim import KVSimRunner, cdiv, make_request, pool_whole, run_to_end, true_output
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import RequestStatus


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 40))
    # From exactly one max-length request up to a few spare blocks: preemption is common.
    num_blocks = 1 + cdiv(max_model_len, block_size) + draw(st.integers(0, 6))
    budget = draw(st.integers(2, 48))
    max_num_seqs = draw(st.integers(1, 6))
    alphabet = st.integers(1, 6)  # tiny vocabulary: accidental shared prefixes too
    prefixes = draw(st.lists(st.lists(alphabet, min_size=0, max_size=max_model_len - 2), min_size=1, max_size=3))
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(alphabet, min_size=0 if prefix else 1, max_size=8))
        prompt = (prefix + suffix)[:max_model_len - 1]
        max_tokens = draw(st.integers(1, max(1, min(12, max_model_len - len(prompt)))))
        arrival = draw(st.integers(0, 12))
        copies = draw(st.sampled_from([1, 1, 1, 2, 4]))  # like n>1: the same prompt, queued together
        salt = draw(st.sampled_from([None, None, None, "tenant"]))
        abort_after = draw(st.one_of(st.none(), st.integers(0, 10)))
        for c in range(copies):
            reqs.append(dict(rid=f"{c}_{i}", prompt=prompt, max_tokens=max_tokens, arrival=arrival, salt=salt,
                             abort_at=None if abort_after is None else arrival + abort_after))
    return dict(block_size=block_size, max_model_len=max_model_len, num_blocks=num_blocks, budget=budget,
                max_num_seqs=max_num_seqs, reqs=reqs)


def run_workload(w, caching):
    kv = KVCacheManager(w["num_blocks"], w["block_size"], enable_caching=caching)
    sched = Scheduler(kv, w["max_num_seqs"], w["budget"], w["max_model_len"])
    runner = KVSimRunner(sched)
    aborted = set()
    last = max(max(r["arrival"], r["abort_at"] or 0) for r in w["reqs"])

    def on_step(i):
        for r in w["reqs"]:
            if r["arrival"] == i:
                sched.add_request(make_request(r["rid"], r["prompt"], r["max_tokens"], r["salt"],
                                               w["max_model_len"]))
        for r in w["reqs"]:
            if r["abort_at"] == i and sched.finish_requests([r["rid"]], RequestStatus.FINISHED_ABORTED):
                aborted.add(r["rid"])
        return i < last

    outs = run_to_end(sched, runner, max_steps=3000, on_step=on_step)
    assert pool_whole(sched)
    assert not sched.requests and not sched.running and not sched.waiting
    if not caching:
        assert not kv.block_pool.cached_block_hash_to_block
    return outs, aborted


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_random_workloads_caching_on_off(w):
    results = {}
    for caching in (True, False):
        outs, aborted = run_workload(w, caching)
        for r in w["reqs"]:
            want = true_output(r["prompt"], r["salt"], r["max_tokens"], w["max_model_len"])
            got = outs.get(r["rid"], [])
            if r["rid"] in aborted:
                assert got == want[:len(got)], r["rid"]  # aborted: a prefix of the true output
            else:
                assert got == want, r["rid"]
        results[caching] = (outs, aborted)
    # Non-aborted requests: identical with caching on and off (aborts land at different points: fewer tokens
    # to compute with caching on).
    (on, ab_on), (off, ab_off) = results[True], results[False]
    for r in w["reqs"]:
        rid = r["rid"]
        if rid not in ab_on and rid not in ab_off:
            assert on.get(rid) == off.get(rid)
