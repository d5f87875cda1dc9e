"""Speculative decoding in the core (scheduler + KV cache manager + block pool), with fake runners: no torch.

The contract (vLLM v1's): a decoding request with ``spec_token_ids`` is scheduled for ``1 + k`` tokens within the
budget, with KV slots for all; ``update_from_output`` advances ``num_computed_tokens`` by the accepted count only;
stop conditions are checked per accepted token; only verified tokens enter the prefix cache."""

import random
from types import SimpleNamespace

import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.output import LogprobsLists, ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode import adaptive
from tests.kv_sim import EOS, KVSimRunner, check_invariants, make_request, pool_whole, run_to_end, true_output


def spec_config(k=4, adaptive=False, disable_by_batch_size=None, step_token_budget=256, cost_aware=False):
    return SpeculativeConfig(num_speculative_tokens=k, adaptive=adaptive, disable_by_batch_size=disable_by_batch_size,
                             step_token_budget=step_token_budget, cost_aware=cost_aware)


def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256, caching=True, **spec):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(kv, max_num_seqs, budget, max_model_len, speculative_config=spec_config(**spec))


def req(rid, n_prompt, max_tokens=16, base=0, **kw):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return Request(rid, [base + i for i in range(n_prompt)], sp, eos_token_ids={EOS})


def prefill(s, r, first=50, spec=()):
    """Runs ``r``'s prompt in one step: it samples ``first`` and the runner proposes ``spec``."""
    s.add_request(r)
    so = s.schedule()
    assert so.num_scheduled_tokens[r.request_id] == r.num_tokens
    s.update_from_output(so, ModelRunnerOutput([r.request_id], [[first]], spec_token_ids=[list(spec)]))
    return so


# ---------------------------------------------------------------------------------------------------- the contract
def test_drafts_scheduled_verified_and_rejected_slots_not_computed():
    s = make_sched(block_size=4)
    r = req("a", 6)
    prefill(s, r, first=50, spec=[51, 52, 53])
    assert r.num_computed_tokens == 6 and r.num_tokens == 7 and r.spec_token_ids == [51, 52, 53]
    so = s.schedule()
    # the last sampled token + 3 drafts = positions 6..9, blocks for 10 tokens
    assert so.num_scheduled_tokens == {"a": 4} and so.total_num_scheduled_tokens == 4
    assert so.scheduled_spec_decode_tokens == {"a": [51, 52, 53]}
    assert len(s.kv.req_to_blocks["a"]) == 3
    # 51 accepted, 52 rejected: the runner samples 60 in its place
    outs = s.update_from_output(so, ModelRunnerOutput(["a"], [[51, 60]], spec_token_ids=[[61, 62]]))
    assert outs[0].new_token_ids == [51, 60]
    assert r.output_token_ids == [50, 51, 60]
    assert r.num_computed_tokens == 8  # 6 + 4 scheduled - 2 rejected: positions 8, 9 hold stale KV
    assert r.num_tokens == 9 and r.spec_token_ids == [61, 62]
    st = s.make_stats().spec_decoding_stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, 3, 1)
    assert st.num_accepted_tokens_per_pos == [1, 0, 0]
    assert s.make_stats().spec_decoding_stats.num_drafts == 0  # deltas
    # next step: the token sampled last + the 2 new drafts; no new block (slots 8..10 are in block 2)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 3} and so.scheduled_cached_reqs[0].new_block_ids == []
    assert so.scheduled_cached_reqs[0].num_computed_tokens == 8


def test_all_accepted_gives_bonus_token_and_budget_counts_drafts():
    s = make_sched(budget=10)
    a = req("a", 4)
    prefill(s, a, spec=[1, 2, 3, 4])
    s.add_request(req("b", 20, base=100))
    so = s.schedule()
    # a: 1 + 4 drafts; b's prompt gets the 5 tokens left of the 10-token budget
    assert so.num_scheduled_tokens == {"a": 5, "b": 5}
    s.update_from_output(so, ModelRunnerOutput(["a", "b"], [[1, 2, 3, 4, 9], []], spec_token_ids=[[], []]))
    assert a.output_token_ids == [50, 1, 2, 3, 4, 9] and a.num_computed_tokens == 9 and a.num_tokens == 10
    assert s.requests["b"].num_computed_tokens == 5


def test_drafts_cut_to_budget_max_tokens_and_max_model_len():
    s = make_sched(budget=3)
    r = req("a", 3)
    prefill(s, r, spec=[1, 2, 3, 4])
    assert s.schedule().scheduled_spec_decode_tokens == {"a": [1, 2]}  # 1 + 2 = the budget

    s = make_sched(budget=32)
    r = req("a", 4, max_tokens=3)  # 1 output so far: 2 more, so at most 1 draft (+ the token after it)
    prefill(s, r, spec=[1, 2, 3, 4])
    assert s.schedule().scheduled_spec_decode_tokens == {"a": [1]}

    s = make_sched(budget=32, max_model_len=8)
    r = req("a", 4, max_tokens=None)  # 5 tokens; drafts at positions 5, 6; the token sampled after them is the 8th
    prefill(s, r, spec=[1, 2, 3, 4])
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2]} and so.num_scheduled_tokens == {"a": 3}


def test_no_drafts_while_prefilling_or_with_spec_off():
    s = make_sched(budget=4)
    r = req("a", 10)
    s.add_request(r)
    r.spec_token_ids = [1, 2]  # even if set, a prompt chunk never carries drafts
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {} and so.num_scheduled_tokens == {"a": 4}

    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, 8, 32, 256)  # no speculative config
    r = req("a", 4)
    prefill(s, r, spec=[1, 2])
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {} and so.num_scheduled_tokens == {"a": 1}
    assert s.make_stats().spec_decoding_stats is None


def test_stop_inside_accepted_tokens_cuts_output_and_logprobs():
    s = make_sched()
    r = req("a", 4)
    prefill(s, r, spec=[1, EOS, 3])
    so = s.schedule()
    lp = LogprobsLists([[1], [EOS], [3], [7]], [[-0.1], [-0.2], [-0.3], [-0.4]], [1, 1, 1, 1])
    outs = s.update_from_output(so, ModelRunnerOutput(["a"], [[1, EOS, 3, 7]], logprobs={"a": lp},
                                                      spec_token_ids=[[8]]))
    assert outs[0].new_token_ids == [1, EOS] and outs[0].finish_reason == "stop"
    assert outs[0].new_logprobs.token_ids == [[1], [EOS]] and outs[0].new_logprobs.ranks == [1, 1]
    assert pool_whole(s)

    s = make_sched()
    r = req("b", 4, max_tokens=3, stop_token_ids=[77])
    prefill(s, r, spec=[5, 6, 7])
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"b": [5]}
    outs = s.update_from_output(so, ModelRunnerOutput(["b"], [[5, 77]], spec_token_ids=[[]]))
    assert outs[0].new_token_ids == [5, 77] and outs[0].stop_reason == 77


def test_drafts_never_cause_preemption():
    # 4 usable blocks of 4 tokens: a (5 prompt tokens) and b (7) hold 2 blocks each -> the pool is empty. a's
    # next token goes to position 5 (block 1 has room up to position 7): of its drafts, 2 fit (positions 6, 7);
    # a third would need a block, which would mean preempting b. b's next token fits its block too.
    s = make_sched(num_blocks=5, block_size=4, caching=False)
    a, b = req("a", 5), req("b", 7, base=100)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput(["a", "b"], [[50], [60]], spec_token_ids=[[1, 2, 3, 4], []]))
    assert s.kv.block_pool.get_num_free_blocks() == 0
    so = s.schedule()
    assert so.preempted_req_ids == set() and so.num_scheduled_tokens == {"a": 3, "b": 1}
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2]}


def test_disable_by_batch_size():
    s = make_sched(disable_by_batch_size=1)
    a, b = req("a", 4), req("b", 4, base=10)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput(["a", "b"], [[1], [2]], spec_token_ids=[[3, 4], [5, 6]]))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {}  # 2 running > 1
    s.update_from_output(so, ModelRunnerOutput(["a", "b"], [[3], [EOS]], spec_token_ids=[[4], []]))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [4]}  # b finished: 1 running


def test_step_token_budget_shares_drafts_and_steps_aside_under_load():
    s = make_sched(k=8, step_token_budget=8, max_num_seqs=16, budget=256)
    assert [s.spec_cap(r) for r in range(0, 7)] == [0, 7, 3, 1, 1, 0, 0]
    reqs = [req(f"r{i}", 4, base=10 * i) for i in range(6)]
    for r in reqs[:2]:
        s.add_request(r)
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput(["r0", "r1"], [[1], [2]], spec_token_ids=[[5] * 8, [6] * 8]))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"r0": [5] * 3, "r1": [6] * 3}  # (8 - 2) // 2 each
    s.update_from_output(so, ModelRunnerOutput(["r0", "r1"], [[7], [8]], spec_token_ids=[[5] * 8, [6] * 8]))
    for r in reqs[2:]:
        s.add_request(r)
    so = s.schedule()  # 2 running and 4 waiting when the step starts: load, speculation steps aside at once
    assert so.scheduled_spec_decode_tokens == {}
    assert so.spec_draft_limits == {r.request_id: 0 for r in reqs}  # and nobody's drafter drafts
    ids = list(so.num_scheduled_tokens)
    s.update_from_output(so, ModelRunnerOutput(ids, [[9]] * 6, spec_token_ids=[[5] * 8] * 6))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {}  # 6 running: speculation steps aside
    assert s.spec_cap(6) == 0
    s = make_sched(k=2, step_token_budget=8)
    assert s.spec_cap(1) == 2  # never more than num_speculative_tokens


def test_waiting_requests_are_load_speculation_steps_aside_until_they_are_in():
    """A queue means load: while requests wait (here: max_num_seqs holds them back), no drafts are verified and the
    drafter is told to draft none (a draft model's catch-up would hold up their prefills); once they are in and the
    batch is small again, speculation comes back."""
    from pagedllm.request import RequestStatus

    s = make_sched(k=4, step_token_budget=8, max_num_seqs=1)
    a = req("a", 4)
    prefill(s, a, spec=[5, 5])
    assert s.spec_cap(1) == 4
    queued = [req(f"w{i}", 4, base=10 * i) for i in range(1, 5)]
    for r in queued:  # wait: max_num_seqs 1; 1 running + 4 waiting is above the cap's 4
        s.add_request(r)
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["a"] and so.scheduled_spec_decode_tokens == {}
    assert so.spec_draft_limits == {"a": 0}
    s.update_from_output(so, ModelRunnerOutput(["a"], [[6]], spec_token_ids=[[]]))
    s.finish_requests([r.request_id for r in queued[1:]], RequestStatus.FINISHED_ABORTED)  # 1 running + 1 waiting
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["a"] and so.spec_draft_limits.get("a") != 0
    s.update_from_output(so, ModelRunnerOutput(["a"], [[7]], spec_token_ids=[[2, 3]]))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [2, 3]}


def test_adaptive_draft_length_follows_acceptance_and_probes_again():
    s = make_sched(k=8, adaptive=True)
    r = req("a", 4, max_tokens=1000)
    prefill(s, r, spec=list(range(8)))
    ks = []
    for step in range(40):
        so = s.schedule()
        k = len(so.scheduled_spec_decode_tokens.get("a", []))
        ks.append(k)
        sampled = [10_000 + step]  # every draft rejected
        s.update_from_output(so, ModelRunnerOutput(["a"], [sampled], spec_token_ids=[list(range(8))]))
    assert ks[0] == 8 and ks[1] < 8
    assert ks[:6] == sorted(ks[:6], reverse=True)  # shrinking while every draft is rejected
    off = [i for i, k in enumerate(ks) if k == 0]
    assert off, "speculation never turned itself off"
    probes = [i for i in range(off[0], 40) if ks[i] > 0]
    assert probes and all(ks[i] == 1 for i in probes)  # a probe is a single draft token
    assert 2 <= probes[0] - off[0] <= 10 and len(probes) <= (40 - off[0]) // 3  # a probe every 3-4 steps at most

    # a drafter that honours the scheduler's limits (spec_draft_limits) proposes nothing while speculation is
    # off for the request: the estimate must still relax, and the share come back as probes
    s = make_sched(k=8, adaptive=True)
    r = req("b", 4, max_tokens=1000)
    prefill(s, r, spec=list(range(8)))
    ks, limits = [], []
    for step in range(40):
        so = s.schedule()
        ks.append(len(so.scheduled_spec_decode_tokens.get("b", [])))
        lim = so.spec_draft_limits.get("b", 8)
        limits.append(lim)
        s.update_from_output(so, ModelRunnerOutput(["b"], [[10_000 + step]], spec_token_ids=[list(range(lim))]))
    assert limits[0] <= 8 and min(limits) == 0, limits
    assert all(k <= lim for k, lim in zip(ks[1:], limits[:-1])), (ks, limits)  # never more than proposed
    off = ks.index(0)
    assert any(k == 1 for k in ks[off:]), ks  # probes still happen

    # all accepted: back to the full length
    acc = 0.1
    for _ in range(20):
        acc = adaptive.update(acc, 4, 4)
    assert adaptive.num_draft_tokens(8, acc) == 8
    assert adaptive.num_draft_tokens(8, 0.5) == 2 and adaptive.num_draft_tokens(8, 0.1) == 0


def _rate(k: int, a: float, cost: float) -> float:
    """Expected tokens per unit of time with ``k`` drafts, brute force: the chance that exactly ``j`` drafts are
    accepted, times the ``j + 1`` tokens that gives, over the step's cost."""
    tokens = sum((j + 1) * a ** j * (1 - a) for j in range(k)) + (k + 1) * a ** k
    return tokens / (1 + cost * k)


@pytest.mark.parametrize("a", [0.0, 0.2, 0.45, 0.6, 0.71, 0.9, 0.98, 1.0])
@pytest.mark.parametrize("cost", [0.0, 0.05, 0.2, 0.5, 0.7, 1.0, 3.0])
def test_cost_aware_share_maximizes_tokens_per_second(a, cost):
    """With a measured cost the share is the k of the most tokens per unit of time (brute force over k, the
    expectation written out), and none where no k beats a plain step."""
    k = adaptive.num_draft_tokens(8, a, cost)
    rates = [_rate(j, a, cost) for j in range(9)]
    assert rates[k] >= max(rates) * (1 - 1e-9), (k, rates)
    assert (k == 0) == (max(rates[1:]) <= 1.0 + 1e-9)
    assert k == 0 or a > cost  # one draft pays exactly when it is accepted more often than it costs


def test_step_costs_from_timings():
    """StepCosts: a draft token's cost in plain steps from the timed steps (the marginal seconds per verify row
    and the draft's seconds per token, over a plain step's seconds); unknown before a plain step is timed."""
    c = adaptive.StepCosts()
    c.observe_step(5, 0.0566)
    c.observe_draft(4, 0.0432)
    assert c.draft_token_cost() is None  # no plain step yet
    c.observe_step(1, 0.0337)
    assert c.draft_token_cost() == pytest.approx(((0.0566 - 0.0337) / 4 + 0.0108) / 0.0337)
    c.observe_step(3, 0.0337 + 2 * 0.010)  # rows seen at several counts: their marginal seconds pooled
    per_row = ((0.0566 - 0.0337) + 2 * 0.010) / (4 + 2)
    assert c.draft_token_cost() == pytest.approx((per_row + 0.0108) / 0.0337)
    for _ in range(200):  # a slower machine: the averages follow
        c.observe_step(1, 0.05)
        c.observe_step(5, 0.09)
        c.observe_step(3, 0.07)
        c.observe_draft(2, 0.04)
    assert c.draft_token_cost() == pytest.approx((0.01 + 0.02) / 0.05, rel=1e-6)


def test_cost_aware_scheduler_times_plain_steps_and_steps_aside():
    """Cost-aware: a speculating single stream verifies no drafts in one step of ``CALIBRATE_EVERY`` (every 8
    until a cost is known), so the runner can time a plain step; where drafts cost more than they are accepted
    (cost 0.9 at acceptance ~0.7) it drafts only probes, and where they are cheap (0.1) the full length."""
    def run(cost, accept_every, steps=200):
        s = make_sched(k=4, adaptive=True, cost_aware=True, budget=64, num_blocks=400, max_model_len=2048)
        r = req("a", 4, max_tokens=10_000)
        prefill(s, r, spec=[1, 2, 3, 4])
        ks = []
        for step in range(steps):
            so = s.schedule()
            drafts = so.scheduled_spec_decode_tokens.get("a", [])
            ks.append(len(drafts))
            n_acc = len(drafts) if step % accept_every else 0  # accept all, or none
            sampled = list(drafts[:n_acc]) + [20_000 + step]
            s.update_from_output(so, ModelRunnerOutput(["a"], [sampled], spec_token_ids=[[1, 2, 3, 4]],
                                                       spec_token_cost=cost if step >= 10 else None))
        return ks

    cheap = run(0.1, accept_every=4)  # 3 of 4 steps accept all: acceptance ~0.8
    plain = [i for i, k in enumerate(cheap) if k == 0]
    assert plain[0] == 1 and all(b - a == 8 for a, b in zip(plain, plain[1:]) if b < 10)  # every 8 at first
    later = [i for i in plain if i > 20]
    assert later and all(b - a >= adaptive.CALIBRATE_EVERY for a, b in zip(later, later[1:]))
    assert sum(k == 4 for k in cheap[20:]) > 0.7 * len(cheap[20:])
    dear = run(0.9, accept_every=4)
    assert max(dear[40:]) <= 1 and 0 < sum(dear[40:]) < 0.1 * len(dear[40:]), dear[40:]  # probes only
    assert max(run(None, accept_every=4)[20:]) == 4  # no cost measured: the fixed rule


def test_speculative_config_validation():
    c = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 4, 4)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    for bad, key in [({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                     ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                     ({"num_speculative_tokens": 2, "bogus": 1}, "bogus"),
                     ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
                      "prompt_lookup_min"),
                     ({"method": "ngram"}, "num_speculative_tokens"),
                     ("{not json", "JSON"), ([1], "object")]:
        with pytest.raises(ValueError, match=key):
            SpeculativeConfig.from_dict(bad)


# ---------------------------------------------------------------------------------------------------- KV simulator
def _noisy_oracle(seed):
    """Drafts: the true continuation's first m tokens (m random), then wrong ones; sometimes nothing."""
    rng = random.Random(seed)

    def propose(rid, true):
        if rng.random() < 0.15:
            return []
        m = rng.randint(0, len(true))
        wrong = [(t + 1 + rng.randint(0, 3)) % 1000 for t in true[m:]]
        wrong = [w if w != t else w + 1 for w, t in zip(wrong, true[m:])]
        return true[:m] + wrong[:rng.randint(0, len(wrong))]

    return propose


@pytest.mark.parametrize("seed", range(6))
def test_kv_sim_outputs_exact_with_drafts_prefix_caching_chunking_preemption(seed):
    """Random workloads: shared prefixes (n > 1-like copies of one prompt), a budget that chunks prompts, a pool
    small enough to preempt. Every output equals the no-cache, no-speculation truth; the sim asserts that no step
    reads a rejected draft's KV, that only draft slots are ever rewritten, and (check_invariants) that no cached
    block holds an unverified draft's KV."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=rng.choice([14, 20, 40]), block_size=4, enable_caching=True)
    s = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=rng.choice([8, 13, 32]), max_model_len=64,
                  speculative_config=spec_config(k=rng.choice([2, 4, 7]), adaptive=seed % 2 == 1))
    runner = KVSimRunner(s, proposer=_noisy_oracle(seed))
    prefixes = [[rng.randint(1, 300) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    want = {}
    arrivals = []
    for i in range(10):
        prompt = rng.choice(prefixes) + [rng.randint(1, 300) for _ in range(rng.randint(0, 6))]
        if i % 4 == 3:
            prompt = list(arrivals[-1][1])  # the same prompt again (parallel sampling shares its blocks)
        mt = rng.randint(1, 30)
        arrivals.append((f"r{i}", prompt, mt))
        want[f"r{i}"] = true_output(prompt, None, mt, 64)

    def on_step(i):
        for rid, prompt, mt in arrivals[2 * i:2 * i + 2]:
            s.add_request(make_request(rid, prompt, mt, max_model_len=64))
        return 2 * i + 2 < len(arrivals)

    got = run_to_end(s, runner, on_step=on_step)
    assert got == want
    assert pool_whole(s)
    st = s.spec_stats
    assert st.num_draft_tokens > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens


def test_kv_sim_rejected_drafts_never_enter_prefix_cache():
    """A request whose drafts are always wrong (8 per step, 2 blocks' worth): their KV fills blocks past its
    verified tokens. Those blocks must never be cached: a later request whose prompt is the first request's tokens
    followed by those very drafts would otherwise hit them (and since the KV was computed from exactly those
    tokens, its output would even look right), but their KV was never verified."""
    s = make_sched(block_size=4, k=8, caching=True)
    runner = KVSimRunner(s, proposer=lambda rid, true: [(t + 7) % 1000 or 1 for t in true])
    prompt = list(range(1, 9))
    a = make_request("a", prompt, 20, max_model_len=256)
    s.add_request(a)
    last_drafts = []
    while s.has_unfinished_requests():
        so = s.schedule()
        last_drafts = so.scheduled_spec_decode_tokens.get("a") or last_drafts
        s.update_from_output(so, runner(so))
        check_invariants(s, runner)  # no cached block holds a draft slot
    assert a.output_token_ids == true_output(prompt, None, 20, 256)
    assert runner.draft_slots  # rejected drafts' KV is still in the freed blocks
    assert s.spec_stats.num_accepted_tokens == 0 and s.spec_stats.num_draft_tokens >= 8 * 3
    verified = a.all_token_ids
    b = make_request("b", verified + last_drafts, 1, max_model_len=256)
    _, num_hit = s.kv.get_computed_blocks(b)
    # exactly the full blocks of computed, verified tokens hit (the last token is never computed), none after
    assert num_hit == 4 * ((len(verified) - 1) // 4) and num_hit >= 8
