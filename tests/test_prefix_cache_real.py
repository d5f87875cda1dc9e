"""Prefix caching on the real SmolLM2-135M-Instruct GGUF, float32: the same tokens with caching on and off.

One module-scoped engine (caching on) and variants on the same weights (``with_engine_args``); few tokens each.
"""

import pytest

from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = ("You are a careful assistant for a small bakery in Lyon. Answer in one short sentence, be polite, mention "
          "prices in euros, and never invent opening hours that were not given. Opening hours: 7am to 7pm, closed "
          "on Mondays. Bread costs 2 euros, croissants 1.5 euros.\n\n")
QUESTIONS = ["Question: Are you open on Monday?\nAnswer:", "Question: How much is a croissant?\nAnswer:",
             "Question: When do you close?\nAnswer:", "Question: Do you sell bread?\nAnswer:"]
OTHERS = ["The capital of France is", "def add(a, b):\n    return"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_on():
    return LLM(dtype="float32", kv_cache_memory_bytes=128 << 20, max_model_len=512, quantization="none")


@pytest.fixture(scope="module")
def llm_off(llm_on):
    return llm_on.with_engine_args(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def reference(llm_off):
    """Greedy GREEDY outputs of every test prompt, caching off, one batch: prompt -> token ids."""
    prompts = [SYSTEM + q for q in QUESTIONS] + OTHERS
    return {p: o.outputs[0].token_ids for p, o in zip(prompts, llm_off.generate(prompts, GREEDY, use_tqdm=False))}


def token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_shared_and_unshared_prefixes_identical_on_off(llm_on, llm_off, reference):
    prompts = [SYSTEM + q for q in QUESTIONS[:2]] + OTHERS + [SYSTEM + q for q in QUESTIONS[2:]]
    sys_len = len(llm_on.get_tokenizer().encode(SYSTEM))
    assert sys_len >= 48  # at least 3 blocks of 16
    llm_on.reset_prefix_cache()
    on = llm_on.generate(prompts, GREEDY, use_tqdm=False)
    off = llm_off.generate(prompts, GREEDY, use_tqdm=False)  # another order than the reference batch
    assert token_ids(on) == token_ids(off) == [[reference[p]] for p in prompts]
    # Same step: the first request with the system prompt computes it, the later ones hit its full blocks.
    cached = [o.num_cached_tokens for o in on]
    assert cached[0] == 0 and cached[2] == 0 and cached[3] == 0
    for i in (1, 4, 5):
        assert sys_len - 16 < cached[i] + 16 and cached[i] % 16 == 0 and cached[i] > 0
    assert all(o.num_cached_tokens == 0 for o in off)
    # Again: now the first one hits too, and a repeated unshared prompt hits its own earlier run.
    again = llm_on.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(again) == token_ids(off)
    assert again[0].num_cached_tokens > 0
    stats = llm_on.llm_engine.engine_core.make_stats()
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries


def test_n4_seeded_sampling_identical_on_off(llm_on, llm_off):
    sp = SamplingParams(n=4, temperature=0.8, top_p=0.95, seed=1234, max_tokens=8)
    prompts = [SYSTEM + QUESTIONS[0], OTHERS[0]]
    llm_on.reset_prefix_cache()
    on = llm_on.generate(prompts, sp, use_tqdm=False)
    off = llm_off.generate(prompts, sp, use_tqdm=False)
    assert token_ids(on) == token_ids(off)
    assert len({tuple(c.token_ids) for c in on[0].outputs}) > 1  # the 4 samples differ (seeds seed + i)
    assert on[0].num_cached_tokens > 0  # children 1-3 share child 0's prompt blocks
    assert off[0].num_cached_tokens == 0


def test_forced_preemption_identical_on_off(llm_on, reference):
    # 10 usable blocks of 16 tokens (the least max_model_len=128 allows). The 4 system-prompt requests (~80 prompt +
    # 8 output tokens: 6 blocks each) need 24 blocks without sharing, 12 with it: preemption either way, and with
    # caching a resumed request hits its own (and its siblings') blocks.
    prompts = [SYSTEM + q for q in QUESTIONS]
    for caching in (True, False):
        small = llm_on.with_engine_args(num_gpu_blocks_override=10, max_model_len=128, enable_prefix_caching=caching)
        outs = small.generate(prompts, GREEDY, use_tqdm=False)
        core = small.llm_engine.engine_core
        assert core.scheduler.num_preemptions > 0
        assert token_ids(outs) == [[reference[p]] for p in prompts]
        pool = core.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks - 1 and not core.kv_cache_manager.req_to_blocks


def test_cache_salt_isolates_and_keeps_output(llm_on):
    prompt = SYSTEM + QUESTIONS[1]
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm_on.reset_prefix_cache()
    plain = llm_on.generate([prompt], sp, use_tqdm=False)[0]
    outs = llm_on.generate([{"prompt": prompt, "cache_salt": "tenant-1"}, {"prompt": prompt, "cache_salt": "tenant-1"},
                            {"prompt": prompt, "cache_salt": "tenant-2"}, prompt], sp, use_tqdm=False)
    assert [o.num_cached_tokens > 0 for o in outs] == [False, True, False, True]
    assert all(o.outputs[0].token_ids == plain.outputs[0].token_ids for o in outs)
    with pytest.raises(ValueError, match="cache_salt"):
        llm_on.generate({"prompt": prompt, "cache_salt": ""}, sp, use_tqdm=False)
