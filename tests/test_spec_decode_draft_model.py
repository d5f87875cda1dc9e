"""``draft_model`` speculative decoding (pagedllm/spec_decode/draft_model.py) on tiny random-weight Llamas in float32.

Greedy output with a draft model is token-identical to greedy output without one, with prefix caching (a prompt
twice), chunked prefill, preemption and n = 2 in the mix. Two drafts: a smaller random model (its own KV layout:
fewer layers, heads and bytes per block; it is rarely right) and a copy of the target (always right where its KV
cache is right: its acceptance checks that the draft's paged KV, mirrored through the target's block tables,
holds the right tokens through chunking, prefix hits and recomputation). Also: the config is validated at the
boundary, and the draft's KV bytes come out of the KV budget (as ``self_int4``'s do)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import SpeculativeConfig
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.draft_model import max_drafting_reqs

transformers = pytest.importorskip("transformers")

from tests.test_engine_tiny import VOCAB, _save_tiny  # noqa: E402
from tests.test_spec_decode import _outputs, _prompts, _variants  # noqa: E402


def _save_small_draft(path, vocab_size: int = VOCAB, max_position_embeddings: int = 512) -> None:
    """A Llama smaller than the target (1 layer, hidden 32, 1 KV head of 16) with the target's vocabulary."""
    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=max_position_embeddings, initializer_range=0.2,
                                   tie_word_embeddings=False, eos_token_id=vocab_size - 1, bos_token_id=1,
                                   rope_theta=10000.0)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(target LLM, smaller draft's folder, the target's copy's folder)."""
    target = tmp_path_factory.mktemp("target")
    _save_tiny("llama", target)
    small = tmp_path_factory.mktemp("small_draft")
    _save_small_draft(small)
    same = tmp_path_factory.mktemp("same_draft")
    _save_tiny("llama", same)  # the same seed: the target's weights
    llm = LLM(str(target), dtype="float32", skip_tokenizer_init=True, block_size=4, kv_cache_memory_bytes=4 << 20,
              max_model_len=160)
    return llm, str(small), str(same)


def _spec(path: str, k: int = 4) -> dict:
    # step_token_budget: every request speculates even in a full batch (mixed with prefills and plain decodes)
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, "step_token_budget": 1024}


def test_greedy_identical_with_draft_model(tiny_pair):
    llm, small, same = tiny_pair
    prompts = _prompts()
    sp = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True, n=2)
    ref = _outputs(llm, prompts, sp)
    # the small draft in a batch (its own KV layout); the copy through every variant (its acceptance checks the
    # mirrored KV cache: with the mirror switched off it falls to ~2%, measured)
    runs = [("small", "batched"), ("same", "batched"), ("same", "chunked"), ("same", "preempt")]
    for draft_name, path in [("small", small), ("same", same)]:
        for name, eng in _variants(llm, _spec(path)).items():
            if (draft_name, name) not in runs:
                continue
            core = eng.llm_engine.engine_core
            got = _outputs(eng, prompts, sp)
            assert got == ref, f"{draft_name}/{name}: output differs from no speculation"
            st = core.scheduler.spec_stats
            assert st.num_draft_tokens > 100, f"{draft_name}/{name}: nothing was speculated"
            if draft_name == "same":  # the target drafting for itself: right wherever its KV cache is
                assert st.num_accepted_tokens > 0.9 * st.num_draft_tokens, (name, st)
            else:
                assert st.num_accepted_tokens < 0.5 * st.num_draft_tokens, (name, st)
            if name == "preempt":
                assert core.scheduler.num_preemptions > 0
            pool = core.kv_cache_manager.block_pool
            assert pool.get_num_free_blocks() == pool.num_blocks - 1, f"{draft_name}/{name}: blocks leaked"
            drafter = core.runner.drafter
            assert len(drafter.kv_caches) == (1 if draft_name == "small" else 2)


def test_draft_model_config_validation(tiny_pair, tmp_path):
    llm, small, _ = tiny_pair
    cfg = SpeculativeConfig.from_dict({"model": small, "num_speculative_tokens": 3})  # vLLM: the method inferred
    assert cfg.method == "draft_model" and cfg.model == small
    with pytest.raises(ValueError, match=r"speculative_config\.model .* not found"):
        SpeculativeConfig.from_dict({"method": "draft_model", "model": str(tmp_path / "nope"),
                                     "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=r"speculative_config\.model .* required"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=r"speculative_config\.model is only for"):
        SpeculativeConfig.from_dict({"method": "ngram", "model": small, "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=r"speculative_config\.draft_tensor_parallel_size"):
        SpeculativeConfig.from_dict({"model": small, "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2})
    wide = tmp_path / "wide"
    _save_small_draft(wide, vocab_size=VOCAB + 128)
    with pytest.raises(ValueError, match=rf"speculative_config\.model .* {VOCAB + 128} tokens, the target {VOCAB}"):
        llm.with_engine_args(speculative_config=_spec(str(wide)))
    short = tmp_path / "short"
    _save_small_draft(short, max_position_embeddings=128)
    with pytest.raises(ValueError, match=r"speculative_config\.model .* max_position_embeddings=128, below "
                                         r"max_model_len=160"):
        llm.with_engine_args(speculative_config=_spec(str(short)))
    llm.with_engine_args(speculative_config=_spec(str(short)), max_model_len=128)  # fits


def test_draft_kv_counted_in_the_kv_budget(tiny_pair):
    """4 MiB of KV: the target's block (4 tokens x 2 layers x K,V x 2 heads x 16 x 4 bytes = 2,048 B) plus the
    small draft's (4 x 1 x 2 x 1 x 16 x 4 = 512 B), after the draft's scratch blocks (4 drafting rows at the default
    step budget of 8, 2 + cdiv(k = 5, 4) = 4 blocks each)."""
    llm, small, _ = tiny_pair
    budget = 4 << 20
    assert llm.llm_engine.engine_core.num_blocks == budget // 2048
    spec = {"model": small, "num_speculative_tokens": 5}
    assert max_drafting_reqs(SpeculativeConfig.from_dict(spec)) == 4
    eng = llm.with_engine_args(speculative_config=spec)
    core = eng.llm_engine.engine_core
    assert core.num_blocks == (budget - 16 * 512) // (2048 + 512)
    drafter = core.runner.drafter
    assert [tuple(c.shape) for c in drafter.kv_caches] == [(2, core.num_blocks + 16, 4, 1, 16)]
    assert sum(c.numel() * c.element_size() for c in drafter.kv_caches) + \
        sum(c.numel() * c.element_size() for c in core.runner.kv_caches) <= budget


def test_self_int4_kv_counted_in_the_kv_budget(tmp_path):
    """self_int4's draft KV (the target's layout in bf16) shares the budget: half the blocks, less its scratch."""
    _save_tiny("llama", tmp_path)
    budget = 1 << 20
    base = LLM(str(tmp_path), dtype="bfloat16", quantization="none", skip_tokenizer_init=True, block_size=4,
               kv_cache_memory_bytes=budget, max_model_len=64)
    per_block = 4 * 2 * 2 * 2 * 16 * 2  # tokens x layers x K,V x heads x head_dim x bytes
    assert base.llm_engine.engine_core.num_blocks == budget // per_block
    eng = base.with_engine_args(speculative_config={"method": "self_int4", "num_speculative_tokens": 3})
    assert eng.llm_engine.engine_core.num_blocks == (budget - 4 * 3 * per_block) // (2 * per_block)


@pytest.mark.parametrize("extra", [
    {},
    # bf16 + chunked prefill: speculation moves chunk boundaries (verify rows take budget); identical since prefill
    # attention is chunk-invariant at every level (paged_prefill where the AMX kernel doesn't take head_dim 16) and
    # a one-token prompt chunk is a prefill row (build_attention_metadata's prefill_rows)
    {"max_num_batched_tokens": 7},
    {"max_num_batched_tokens": 5},
], ids=["batched", "chunked7", "chunked5"])
def test_self_int4_greedy_identical_on_the_shared_drafter(tmp_path, extra):
    """self_int4 runs on DraftModelDrafter (catch-up and first draft step in one forward): greedy output identical
    on a tiny bf16 Llama. Its int4 copy's acceptance here is what the former separate mirror forward gave too (49 of
    148, measured on both): a random-weight model's near-flat logits flip often."""
    _save_tiny("llama", tmp_path)
    llm = LLM(str(tmp_path), dtype="bfloat16", quantization="none", skip_tokenizer_init=True, block_size=4,
              kv_cache_memory_bytes=4 << 20, max_model_len=160, **extra)
    prompts = _prompts()
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = _outputs(llm, prompts, sp)
    eng = llm.with_engine_args(speculative_config={"method": "self_int4", "num_speculative_tokens": 3,
                                                   "step_token_budget": 1024})
    assert _outputs(eng, prompts, sp) == ref
    st = eng.llm_engine.engine_core.scheduler.spec_stats
    assert st.num_accepted_tokens > 0.25 * st.num_draft_tokens > 0, st


def test_draft_steps_stop_at_each_requests_adaptive_share(tiny_pair):
    """With adaptive speculation the scheduler sends each request's share of drafts (``spec_draft_limits``): the
    small draft, rarely right, soon gets fewer than ``k``, and the drafter runs a request's draft steps only up to
    its share. Each limited proposal is the prefix of the full one (the same forward passes, cut), and the output
    stays the one without speculation."""
    llm, small, _ = tiny_pair
    prompts = _prompts()
    sp = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    ref = _outputs(llm, prompts, sp)
    eng = llm.with_engine_args(speculative_config=_spec(small, k=5))
    drafter = eng.llm_engine.engine_core.runner.drafter
    orig = drafter.propose
    seen = []

    def checked(states, sampled, starts, query_lens, limits=None):
        got = orig(states, sampled, starts, query_lens, limits)
        if limits is not None:
            full = orig(states, sampled, starts, query_lens, None)  # the same KV writes again: idempotent
            for g, f, lim in zip(got, full, limits):
                assert g == f[:lim], (g, f, lim)
            seen.extend((lim, len(g)) for g, toks, lim in zip(got, sampled, limits) if toks)
        return got

    drafter.propose = checked
    assert _outputs(eng, prompts, sp) == ref
    assert any(lim < 5 for lim, _ in seen), "no request ever got a smaller share"
    assert any(0 < n < 5 for _, n in seen), "no proposal was cut short"
    assert all(n <= lim for lim, n in seen)


def test_catch_up_skips_the_accepted_drafts_kv(tiny_pair):
    """The draft steps leave their K/V in the request's blocks, so the next catch-up forward starts after the
    drafts the target accepted (``DraftModelDrafter._first_to_compute``): with the target's copy drafting (every
    draft accepted) the draft computes far fewer rows than when every catch-up starts at the step's first token,
    with the same output and the same acceptance (the K/V it keeps is the right one)."""
    llm, _, same = tiny_pair
    prompts = _prompts()[:2]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = _outputs(llm, prompts, sp)
    runs = {}
    for skip in (True, False):
        eng = llm.with_engine_args(speculative_config=_spec(same), block_size=16)
        drafter = eng.llm_engine.engine_core.runner.drafter
        rows = []
        forward = drafter.draft.forward

        def counted(ids, *args, **kwargs):
            rows.append(ids.shape[0])
            return forward(ids, *args, **kwargs)

        drafter.draft.forward = counted
        if not skip:
            drafter._first_to_compute = lambda st, toks, start, end: start
        try:
            assert _outputs(eng, prompts, sp) == ref, skip
        finally:
            del drafter.draft.forward
            drafter.__dict__.pop("_first_to_compute", None)
        st = eng.llm_engine.engine_core.scheduler.spec_stats
        assert st.num_accepted_tokens > 0.9 * st.num_draft_tokens, (skip, st)
        runs[skip] = (sum(rows), st.num_draft_tokens)
    (with_skip, drafted), (without, drafted_too) = runs[True], runs[False]
    assert drafted == drafted_too > 40
    # per verify step of 4 accepted drafts: 2 catch-up rows instead of 6 (plus the prompts' rows, the same)
    assert with_skip < without - drafted // 2, runs


def test_draft_steps_aside_under_load_and_catches_up_lazily(tiny_pair):
    """Above ``max_drafting_reqs`` requests (default budget: 4) the draft runs no forward at all, so speculation
    costs nothing under load; when the batch shrinks, each request's catch-up computes the draft K/V it lacks
    (``draft_computed``) and the target's copy is accepted > 90% (its lazily filled KV is right), output identical.
    A prompt asked again finds the draft K/V of its full cached blocks (``valid_blocks``): its catch-up starts
    there."""
    llm, _, same = tiny_pair
    prompts = _prompts()
    sps = [SamplingParams(temperature=0.0, max_tokens=4 + 9 * i, ignore_eos=True) for i in range(len(prompts))]
    ref = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sps,
                                                        use_tqdm=False)]
    eng = llm.with_engine_args(speculative_config={"method": "draft_model", "model": same,
                                                   "num_speculative_tokens": 4}, block_size=4)
    drafter = eng.llm_engine.engine_core.runner.drafter
    assert drafter.max_num_reqs == 4
    calls, rows = [], []
    propose, forward = drafter.propose, drafter.draft.forward

    def counted_propose(states, *a, **kw):
        n = len(rows)
        out = propose(states, *a, **kw)
        calls.append((len(states), len(rows) - n))
        return out

    def counted_forward(ids, *a, **kw):
        rows.append(ids.shape[0])
        return forward(ids, *a, **kw)

    drafter.propose, drafter.draft.forward = counted_propose, counted_forward
    try:
        got = [o.outputs[0].token_ids for o in eng.generate([{"prompt_token_ids": p} for p in prompts], sps,
                                                            use_tqdm=False)]
        assert got == ref
        assert all(f == 0 for n, f in calls if n > 4), calls  # stepped aside: no draft forward
        assert any(f > 0 for n, f in calls if n <= 4), calls
        st = eng.llm_engine.engine_core.scheduler.spec_stats
        assert st.num_draft_tokens > 30 and st.num_accepted_tokens > 0.9 * st.num_draft_tokens, st
        # the longest prompt again, alone: its full blocks are prefix hits whose draft K/V is there
        p = max(prompts, key=len)
        assert len(p) >= 12
        rows.clear()
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        again = eng.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
        assert again == llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
        assert rows[0] < len(p) - 4, rows  # the first catch-up skipped the cached blocks
    finally:
        del drafter.propose, drafter.draft.forward
