"""A fake model runner that simulates the KV cache, for prefix-caching tests of the core (no torch).

``KVSimRunner`` keeps its own per-request state from ``SchedulerOutput`` alone, as the real runner does (block table,
token ids, ``num_computed_tokens``), and owns a fake KV cache with one value per token slot. Computing position ``p``
reads the value of position ``p - 1`` *from the cache through the block table* (as attention reads the context) and
writes ``kv(p) = H(kv(p - 1), token[p])``; the sampled token is a function of the last value. So a prefix hit on the
wrong block, a block reused while still referenced, a hit on a block whose KV was never written, or a tenant reading
another tenant's blocks (the ``cache_salt`` seeds the chain here, standing in for "KV that must not be shared")
changes the sampled tokens, which ``true_output`` predicts without any cache. The runner also asserts that each slot
is written at most once per allocation of its block (a block shared by a prefix hit is never written again; the one
exception to "never written while shared" is a hit, in the same step, on a block its writer fills in that step) and
never while its block is free.

Speculative decoding (``proposer`` given): after each sample the runner proposes draft tokens; the KV of draft
positions is computed from the draft tokens (a wrong draft writes a wrong value there), the sample after each
position is checked against the next draft (accept while equal, then the first disagreeing sample), and slots
written for drafts may be written again (``draft_slots``: the slots whose value came from a draft not (yet)
verified). ``check_invariants`` then also asserts that no block in the prefix cache holds such a slot.
"""

from __future__ import annotations

from typing import Optional

from pagedllm.core.output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request

EOS = 999
_MASK = (1 << 61) - 1


def kv_value(prev: int, token: int) -> int:
    return hash((prev, token, 0x5EED)) & _MASK


def root_value(salt: Optional[str]) -> int:
    return 0 if salt is None else (sum(ord(c) * 131 ** i for i, c in enumerate(salt)) & _MASK) + 1


def sample_from(value: int) -> int:
    return EOS if value % 23 == 0 else 200 + value % 50


def true_output(prompt: list[int], salt: Optional[str], max_tokens: int, max_model_len: int,
                ignore_eos: bool = False) -> list[int]:
    """The tokens the runner must produce for a request that runs to its end (EOS, max_tokens, max_model_len)."""
    v = root_value(salt)
    toks = list(prompt)
    for t in toks:
        v = kv_value(v, t)
    out: list[int] = []
    while True:
        t = sample_from(v)
        out.append(t)
        toks.append(t)
        if (t == EOS and not ignore_eos) or len(out) >= max_tokens or len(toks) >= max_model_len:
            return out
        v = kv_value(v, t)


class _State:
    __slots__ = ("token_ids", "block_ids", "num_computed_tokens", "salt")

    def __init__(self, token_ids, block_ids, num_computed_tokens, salt):
        self.token_ids = list(token_ids)
        self.block_ids = list(block_ids)
        self.num_computed_tokens = num_computed_tokens
        self.salt = salt


class KVSimRunner:
    def __init__(self, sched: Scheduler, proposer=None) -> None:
        """``proposer(req_id, true_continuation) -> drafts``: the next tokens the request's output will truly have
        (as many as the scheduler may verify) -> the draft tokens to propose."""
        self.proposer = proposer
        self.draft_slots: set[int] = set()
        self.sched = sched
        self.bs = sched.block_size
        pool = sched.kv.block_pool
        self.pool = pool
        self.kv: list[Optional[int]] = [None] * (pool.num_blocks * self.bs)
        self.states: dict[str, _State] = {}
        self.num_written = 0
        # Wrap the pool's allocator: a (re)allocated block's slots read as never written.
        orig = pool.get_new_blocks

        def get_new_blocks(num_blocks):
            out = orig(num_blocks)
            for b in out:
                base = b.block_id * self.bs
                self.kv[base:base + self.bs] = [None] * self.bs
                self.draft_slots.difference_update(range(base, base + self.bs))
            return out

        pool.get_new_blocks = get_new_blocks

    def _slot(self, st: _State, pos: int) -> int:
        return st.block_ids[pos // self.bs] * self.bs + pos % self.bs

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.states
            salt = self.sched.requests[nr.req_id].cache_salt
            self.states[nr.req_id] = _State(nr.prompt_token_ids, nr.block_ids, nr.num_computed_tokens, salt)
        for cr in so.scheduled_cached_reqs:
            st = self.states[cr.req_id]
            st.num_computed_tokens = cr.num_computed_tokens
            if cr.resumed_from_preemption:
                st.block_ids = list(cr.new_block_ids)
                st.token_ids = list(cr.all_token_ids)
            else:
                st.block_ids.extend(cr.new_block_ids)
        ids, toks, props = [], [], []
        # Requests in layout order; a request that hits blocks filled in this same step comes after their writer.
        for rid, n in so.num_scheduled_tokens.items():
            st = self.states[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            num_verified = len(st.token_ids)
            tokens = st.token_ids + drafts
            start = st.num_computed_tokens
            assert start + n <= len(tokens)
            assert not drafts or start + n == len(tokens), "drafts are the last scheduled tokens"
            assert len(st.block_ids) * self.bs >= start + n, "block table too short for the scheduled tokens"
            if start == 0:
                v = root_value(st.salt)
            else:
                v = self.kv[self._slot(st, start - 1)]
                assert v is not None, f"{rid} reads position {start - 1}, whose KV was never written"
                assert self._slot(st, start - 1) not in self.draft_slots, f"{rid} reads a rejected draft's KV"
            values = []
            for pos in range(start, start + n):
                v = kv_value(v, tokens[pos])
                values.append(v)
                slot = self._slot(st, pos)
                b = self.pool.blocks[slot // self.bs]
                assert b.ref_cnt >= 1 and not b.is_null, f"{rid} writes free {b} at position {pos}"
                assert self.kv[slot] is None or slot in self.draft_slots, f"{rid} overwrites position {pos} in {b}"
                self.kv[slot] = v
                if pos >= num_verified:
                    self.draft_slots.add(slot)
                else:
                    self.draft_slots.discard(slot)
                self.num_written += 1
            ids.append(rid)
            if start + n < num_verified:
                st.num_computed_tokens = start + n
                toks.append([])
                props.append([])
                continue
            # values[j0 + j]: the value after the last verified token (j = 0) and after draft j (j >= 1).
            j0 = num_verified - 1 - start
            out = []
            for j in range(len(drafts) + 1):
                t = sample_from(values[j0 + j])
                out.append(t)
                if j == len(drafts) or drafts[j] != t:
                    break
                self.draft_slots.discard(self._slot(st, num_verified + j))  # accepted: verified KV
            st.token_ids.extend(out)
            st.num_computed_tokens = len(st.token_ids) - 1
            toks.append(out)
            props.append(self._propose(rid, st, values[j0 + len(out) - 1]) if self.proposer else [])
        return ModelRunnerOutput(ids, toks, spec_token_ids=props if self.proposer else None)

    def _propose(self, rid: str, st: _State, v_last: int) -> list[int]:
        """The proposer's drafts, given the request's true continuation after its last (uncomputed) token."""
        k = self.sched.num_spec_tokens
        v = kv_value(v_last, st.token_ids[-1])
        true = []
        for _ in range(k):
            t = sample_from(v)
            true.append(t)
            v = kv_value(v, t)
        return list(self.proposer(rid, true))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def exact_kv_utilization(sched: Scheduler) -> float:
    """The definition, by walking every block: live slots (max over holders) / slots of distinct held blocks."""
    bs = sched.block_size
    live: dict[int, int] = {}
    for req in sched.running:
        for j, b in enumerate(sched.kv.req_to_blocks.get(req.request_id, ())):
            filled = min(bs, max(req.num_computed_tokens - j * bs, 0))
            live[b.block_id] = max(live.get(b.block_id, 0), filled)
    if not live:
        return 1.0
    return sum(live.values()) / (len(live) * bs)


def check_invariants(sched: Scheduler, runner: Optional[KVSimRunner] = None) -> None:
    """Everything that must hold between steps (with ``runner``: no cached block holds an unverified draft's KV)."""
    kv = sched.kv
    pool = kv.block_pool
    bs = sched.block_size
    free_ids = pool.free_block_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    free_set = set(free_ids)
    assert 0 not in free_set and pool.blocks[0].is_null
    refs: dict[int, int] = {}
    for blocks in kv.req_to_blocks.values():
        for b in blocks:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for b in pool.blocks[1:]:
        assert b.ref_cnt == refs.get(b.block_id, 0), f"{b}: ref_cnt != number of block tables holding it"
        assert (b.block_id in free_set) == (b.ref_cnt == 0), f"{b}: free and referenced, or neither"
    # The hash table and the blocks' hashes agree both ways.
    table = pool.cached_block_hash_to_block
    for h, b in table.items():
        assert b.block_hash == h and not b.is_null
    for b in pool.blocks:
        if b.block_hash is not None:
            assert table.get(b.block_hash) is b, f"{b} carries a hash the table doesn't map to it"
    if not kv.enable_caching:
        assert not table
    # Only running requests hold blocks, exactly as many as their computed tokens need.
    running = {r.request_id: r for r in sched.running}
    assert set(kv.req_to_blocks) <= set(running)
    lookahead = sched.num_spec_tokens  # blocks allocated for drafts that were rejected stay with the request
    for rid, r in running.items():
        blocks = kv.req_to_blocks.get(rid, [])
        assert cdiv(r.num_computed_tokens, bs) <= len(blocks) <= cdiv(r.num_computed_tokens + lookahead, bs), \
            f"{r} holds {len(blocks)} blocks"
        # A block a request shares with another is full for it, and registered in the cache.
        for j, b in enumerate(blocks):
            if b.ref_cnt > 1:
                assert r.num_computed_tokens >= (j + 1) * bs
    for r in sched.waiting:
        assert r.request_id not in kv.req_to_blocks
    assert abs(sched.kv_cache_utilization() - exact_kv_utilization(sched)) < 1e-12
    if runner is not None and runner.draft_slots:
        for b in pool.blocks[1:]:
            if b.block_hash is not None:
                base = b.block_id * bs
                assert not runner.draft_slots.intersection(range(base, base + bs)), \
                    f"{b} is in the prefix cache with a rejected draft's KV"


def pool_whole(sched: Scheduler) -> bool:
    pool = sched.kv.block_pool
    return (pool.get_num_free_blocks() == pool.num_blocks - 1 and not sched.kv.req_to_blocks
            and all(b.ref_cnt == 0 for b in pool.blocks[1:]) and not sched.kv._quiet)


def run_to_end(sched: Scheduler, runner, max_steps: int = 5000, on_step=None,
               outputs: Optional[dict[str, list[int]]] = None) -> dict[str, list[int]]:
    """Steps until nothing is left, checking invariants after every step; returns each request's output tokens
    (added to ``outputs`` if given).

    ``on_step(i)`` runs before step ``i`` (add or abort requests there) and returns True while more are to come.
    """
    outputs = {} if outputs is None else outputs
    for i in range(max_steps):
        more = on_step(i) if on_step is not None else False  # True while arrivals are still to come
        if not sched.has_unfinished_requests():
            if more:
                continue
            break
        so = sched.schedule()
        for eo in sched.update_from_output(so, runner(so)):
            outputs.setdefault(eo.request_id, []).extend(eo.new_token_ids)
        check_invariants(sched, runner if isinstance(runner, KVSimRunner) else None)
    else:
        raise AssertionError(f"not finished after {max_steps} steps (deadlock?)")
    return outputs


def make_request(rid: str, prompt: list[int], max_tokens: int, salt: Optional[str] = None,
                 max_model_len: Optional[int] = None, **kw) -> Request:
    from pagedllm.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return Request(rid, prompt, sp, eos_token_ids={EOS}, cache_salt=salt, max_model_len=max_model_len)
