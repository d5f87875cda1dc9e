"""Speculative decoding through the runner and the whole engine: n-gram proposer, verification, exactness.

Greedy output with speculation must be token-identical to greedy output without it (tiny random-weight models in
float32, with prefix caching, chunked prefill, preemption and n > 1 in the mix); seeded random sampling must be
identical too (the generator is advanced once per output token, see spec_decode/verify.py); and the verification
rule must reproduce the target distribution (chi-square bound over many samples)."""

import random

import numpy as np
import pytest
import torch

from pagedllm.entrypoints.llm import LLM
from pagedllm.layers.sampler import Sampler, SamplerRequestState, SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.verify import GeneratorRewind, accept, verify_rows

transformers = pytest.importorskip("transformers")

from tests.test_engine_tiny import VOCAB, _save_tiny  # noqa: E402

# step_token_budget: every request speculates even in a full batch (mixed with prefills and plain decodes)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
         "step_token_budget": 1024}


# ---------------------------------------------------------------------------------------------------- proposer
def _brute_force_propose(tokens, k, lo, hi):
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):  # latest match first, never the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposer_equals_brute_force():
    rng = random.Random(0)
    for case in range(3000):
        L = rng.randint(0, 40)
        alphabet = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(alphabet) for _ in range(L)]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 6)
        got = NgramProposer(k, lo, hi).propose(tokens)
        assert got == _brute_force_propose(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_ngram_proposer_worked_example_and_numpy_input():
    p = NgramProposer(3, 2, 3)
    assert p.propose([5, 6, 7, 8, 9, 6, 7]) == [8, 9, 6]
    assert p.propose(np.array([5, 6, 7, 8, 9, 6, 7])) == [8, 9, 6]
    assert p.propose([1, 2, 3, 4]) == []
    assert p.propose([1, 2, 1, 2], k=1) == [1]  # the continuation may run into the suffix


def test_accept_examples():
    assert accept([4, 5, 9, 2, 7], [[4, 5, 6], []]) == ([[4, 5, 9], [7]], [0, 4])
    assert accept([1, 2, 3], [[1, 2]]) == ([[1, 2, 3]], [0])  # all accepted + the bonus token
    assert accept([8, 2, 3], [[1, 2]]) == ([[8]], [0])  # the first draft rejected: a plain decode's token
    assert accept([3, 4], [[], []]) == ([[3], [4]], [0, 1])


def test_verify_rows_give_each_row_its_output_for_penalties():
    sp = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    st = SamplerRequestState(sp, [1, 2], [3], None, set())
    plain = SamplerRequestState(SamplingParams(temperature=0.0), [1, 2], [3], None, set())
    idx, rows = verify_rows([10, 14], [st, plain], [[7, 8], [9]])
    assert idx == [7, 8, 9, 12, 13]
    assert [r.output_token_ids for r in rows] == [[3], [3, 7], [3, 7, 8], [3], [3]]
    assert rows[3] is plain and rows[4] is plain


# ---------------------------------------------------------------------------------------------------- distribution
def test_verification_preserves_target_distribution_chi_square():
    """Two draft positions over a 6-token vocabulary, 60k trials in one batch: the first output token must follow
    p0, and when the first draft was accepted the second must follow p1 (the target's distribution at each
    position), with temperature, top_p and min_p in play. Chi-square at p = 1e-4 (df = 5: 25.7)."""
    V, N = 6, 60_000
    torch.manual_seed(0)
    l0 = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.0, 0.0])
    l1 = torch.tensor([-0.3, 0.9, 0.1, 0.4, 0.0, -2.0])
    l2 = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    d1, d2 = 0, 1  # drafts: the first is likely, the second less so
    sp = SamplingParams(temperature=0.9, top_p=0.97, min_p=0.02)
    st = SamplerRequestState(sp, [1], [2], None, set())
    rows, drafts = [], []
    for _ in range(N):
        rows.extend([st, st, st])
        drafts.append([d1, d2])
    logits = torch.stack([l0, l1, l2]).repeat(N, 1)
    md = SamplingMetadata.build(rows, V, torch.device("cpu"))
    sampled = Sampler()(logits, md).sampled_token_ids.tolist()
    outs, _ = accept(sampled, drafts)

    def target(l):  # the Sampler's own pipeline on one row: temperature, min_p, top_p
        p = (l / sp.temperature).softmax(-1)
        p[p < p.max() * sp.min_p] = 0
        order = p.argsort(descending=True)
        cum = p[order].cumsum(0)
        keep = order[: int((cum < sp.top_p * p.sum()).sum()) + 1]
        q = torch.zeros(V)
        q[keep] = p[keep]
        return (q / q.sum()).numpy()

    def chi2(counts, p):
        m = p > 0
        assert counts[~m].sum() == 0, "a token outside the target's support was output"
        e = p[m] * counts.sum()
        return float(((counts[m] - e) ** 2 / e).sum()), int(m.sum()) - 1

    first = np.bincount([o[0] for o in outs], minlength=V)
    x, df = chi2(first, target(l0))
    assert x < {5: 25.7, 4: 23.5, 3: 21.1}[df], (x, first)
    second = np.bincount([o[1] for o in outs if o[0] == d1], minlength=V)
    x, df = chi2(second, target(l1))
    assert x < {5: 25.7, 4: 23.5, 3: 21.1}[df], (x, second)
    # the number of tokens per trial: 1 (d1 rejected), 2 (d2 rejected) or 3
    p0, p1 = target(l0)[d1], target(l1)[d2]
    lens = np.bincount([len(o) for o in outs], minlength=4)[1:] / N
    want = np.array([1 - p0, p0 * (1 - p1), p0 * p1])
    assert np.abs(lens - want).max() < 0.01, (lens, want)


def test_generator_rewind_leaves_the_stream_of_a_plain_decode():
    """After a verify step sampled 4 rows of a seeded request (3 drafts) and kept 2 output tokens, its generator
    stands where a plain decode of those 2 tokens left it: the sampler's own draws (one row each) are replayed."""
    V = 50
    gen_a = torch.Generator().manual_seed(7)
    gen_b = torch.Generator().manual_seed(7)
    sp = SamplingParams(temperature=1.0, seed=7)
    st = SamplerRequestState(sp, [1], [2], gen_b, set())
    rw = GeneratorRewind([st], [[1, 2, 3]])
    logits = torch.randn(1, V)
    md = SamplingMetadata.build([st], V, torch.device("cpu"))
    for _ in range(4):  # the sampler draws once per row
        Sampler()(logits, md)
    rw.advance([[1, 2]])  # 2 output tokens
    plain = SamplerRequestState(sp, [1], [2], gen_a, set())
    md_a = SamplingMetadata.build([plain], V, torch.device("cpu"))
    for _ in range(2):
        Sampler()(logits, md_a)
    assert torch.equal(torch.rand(V, generator=gen_a), torch.rand(V, generator=gen_b))


# ---------------------------------------------------------------------------------------------------- whole engine
class OracleDrafter:
    """Proposes the request's true continuation (from a run without speculation), corrupted at random: long
    accepted runs, rejections at every position, and stops inside accepted tokens all happen."""

    def __init__(self, ref: dict, k: int, seed: int = 0) -> None:
        self.ref = ref  # prompt tuple -> output token ids
        self.k = k
        self.rng = random.Random(seed)

    def propose(self, states, sampled, limits=None):
        out = []
        for st, toks, lim in zip(states, sampled, limits or [self.k] * len(states)):
            if not toks or not lim:
                out.append([])
                continue
            done = len(st.token_ids) - len(st.prompt_token_ids)
            true = list(self.ref[tuple(st.prompt_token_ids)][done:done + self.k])
            r = self.rng.random()
            if r < 0.1:
                true = []
            elif r < 0.6 and true:
                m = self.rng.randrange(len(true))
                true[m] = (true[m] + 1 + self.rng.randrange(5)) % VOCAB
                true = true[:self.rng.randint(m + 1, len(true))]
            out.append(true[:lim])
        return out


def _prompts(n_rep=3):
    g = torch.Generator().manual_seed(5)
    lens = [3, 17, 9, 30, 5, 12]
    out = []
    for i, n in enumerate(lens):
        base = torch.randint(2, VOCAB - 2, (n,), generator=g).tolist()
        out.append(base * (n_rep if i % 2 == 0 else 1))  # repetitive prompts give n-gram matches
    out.append(list(out[1]))  # the same prompt twice: prefix cache hits
    return out


def _outputs(llm, prompts, sp):
    return [[c.token_ids for c in o.outputs] for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_llm(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    _save_tiny(request.param, path)
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=4, kv_cache_memory_bytes=4 << 20,
              max_model_len=160)
    return request.param, llm


def _variants(llm, spec):
    layout = llm.llm_engine.engine_core.runner.layout
    num_blocks = layout.blocks_for_one_request(64, 4, 16) + 2  # the longest request: 30 + 28 tokens
    return {
        "batched": llm.with_engine_args(speculative_config=spec),
        "chunked": llm.with_engine_args(speculative_config=spec, max_num_batched_tokens=7),
        "preempt": llm.with_engine_args(speculative_config=spec, num_gpu_blocks_override=num_blocks,
                                        max_model_len=64, max_num_batched_tokens=16),
    }


@pytest.mark.slow
def test_greedy_identical_with_ngram_and_oracle_drafts(tiny_llm):
    kind, llm = tiny_llm
    prompts = _prompts()
    sp = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True, n=2)
    ref = _outputs(llm, prompts, sp)
    assert all(len(o) == 2 and o[0] == o[1] for o in ref)
    ref_by_prompt = {tuple(p): o[0] for p, o in zip(prompts, ref)}
    for spec_name, spec in [("ngram", NGRAM), ("oracle", dict(NGRAM, num_speculative_tokens=6, adaptive=False))]:
        for name, eng in _variants(llm, spec).items():
            core = eng.llm_engine.engine_core
            if spec_name == "oracle":
                core.runner.drafter = OracleDrafter(ref_by_prompt, 6, seed=len(name))
            got = _outputs(eng, prompts, sp)
            assert got == ref, f"{kind}/{spec_name}/{name}: output differs from no speculation"
            st = core.scheduler.spec_stats
            assert st.num_draft_tokens > 0, f"{kind}/{spec_name}/{name}: nothing was speculated"
            pool = core.kv_cache_manager.block_pool
            assert pool.get_num_free_blocks() == pool.num_blocks - 1, f"{name}: blocks leaked"
            if spec_name == "oracle":
                assert st.num_accepted_tokens > st.num_draft_tokens // 3
                assert st.num_accepted_tokens < st.num_draft_tokens
                if name == "preempt":
                    assert core.scheduler.num_preemptions > 0


def test_greedy_identical_with_stops_inside_accepted_drafts(tiny_llm):
    """EOS and stop token ids are checked per accepted token: the output is cut exactly where a plain decode
    stops, even when the stop token comes in the middle of accepted drafts."""
    kind, llm = tiny_llm
    prompts = _prompts()
    free = _outputs(llm, prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    ref_by_prompt = {tuple(p): o[0] for p, o in zip(prompts, free)}
    stop_ids = sorted({o[0][7] for o in free})[:3]  # tokens that do occur mid-output
    sp = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=stop_ids, ignore_eos=True)
    ref = _outputs(llm, prompts, sp)
    eng = llm.with_engine_args(speculative_config=dict(NGRAM, num_speculative_tokens=8, adaptive=False))
    eng.llm_engine.engine_core.runner.drafter = OracleDrafter(ref_by_prompt, 8, seed=3)
    assert _outputs(eng, prompts, sp) == ref
    assert any(len(o[0]) < 30 for o in ref)


def test_seeded_random_sampling_identical_with_and_without_speculation(tiny_llm):
    """Seeded requests (temperature, top_p, penalties, min_tokens) give the same tokens with speculation: each
    output token is sampled from the same generator draw as in a plain decode."""
    kind, llm = tiny_llm
    prompts = _prompts()
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=24, ignore_eos=True,
                             repetition_penalty=1.2 if i % 3 == 0 else 1.0, min_tokens=5 if i % 3 == 1 else 0,
                             presence_penalty=0.3 if i % 3 == 2 else 0.0)
              for i in range(len(prompts))]
    ref = _outputs(llm, prompts, params)
    ref_by_prompt = {}
    for p, o in zip(prompts, ref):
        ref_by_prompt.setdefault(tuple(p), o[0])
    eng = llm.with_engine_args(speculative_config=dict(NGRAM, num_speculative_tokens=5, adaptive=False),
                               max_num_batched_tokens=16)
    eng.llm_engine.engine_core.runner.drafter = OracleDrafter(ref_by_prompt, 5, seed=1)
    got = _outputs(eng, prompts, params)
    # prompts 1 and 6 are the same prompt with different seeds: the oracle proposes prompt 1's output for both
    assert got == ref
    st = eng.llm_engine.engine_core.scheduler.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens


def test_logprobs_with_speculation(tiny_llm):
    kind, llm = tiny_llm
    prompts = _prompts()[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    ref = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    ref_by_prompt = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, ref)}
    eng = llm.with_engine_args(speculative_config=dict(NGRAM, adaptive=False))
    eng.llm_engine.engine_core.runner.drafter = OracleDrafter(ref_by_prompt, 4, seed=2)
    got = eng.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == 20
        for a, b in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert list(a) == list(b)  # same token ids (sampled + top 3)
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) < 1e-4
