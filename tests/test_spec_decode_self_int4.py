"""``self_int4`` speculative decoding (pagedllm/spec_decode/self_int4.py): the bf16 model drafts with an int4 copy of
its own weights. The packed bf16 weights read back exactly (the draft can be made from an already packed model);
on the real SmolLM2 in bf16 greedy output is identical with and without it, with prefix caching (a prompt asked
twice), chunked prefill and n = 2 in the mix, and the int4 draft is accepted most of the time."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm import kernels
from pagedllm.config import SpeculativeConfig
from pagedllm.entrypoints.llm import LLM
from pagedllm.kernels.config import supported_levels
from pagedllm.layers.packed_linear import PackedLinear, linear_backend
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.self_int4 import _dense_weight

SPEC = {"method": "self_int4", "num_speculative_tokens": 3, "step_token_budget": 32}


@pytest.mark.parametrize("level", ["amx", "avx512_bf16", "avx2"])
@pytest.mark.parametrize("gated", [False, True])
def test_packed_weight_reads_back_exactly(level, gated):
    if level not in supported_levels():
        pytest.skip(f"this CPU runs below {level}")
    torch.manual_seed(0)
    with kernels.use(dataclasses.replace(kernels.config(), level=level)):
        for n, k in [(192, 576), (3072, 576), (576, 1536)]:
            if linear_backend(n, k) is None:
                pytest.skip(f"no packed bf16 kernel at {level}")
            w = torch.randn(n, k).bfloat16()
            packed = PackedLinear(w, None, silu_gated=gated)
            assert packed._amx is not None and packed.gated == gated
            assert torch.equal(_dense_weight(packed), w)


def test_config_accepts_self_int4():
    cfg = SpeculativeConfig.from_dict(SPEC)
    assert cfg.method == "self_int4" and cfg.num_speculative_tokens == 3


@pytest.fixture(scope="module")
def smollm_bf16():
    return LLM(None, dtype="bfloat16", quantization="none", max_model_len=1024, kv_cache_memory_bytes=64 << 20)


def _chat(tok, text: str) -> dict:
    t = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return {"prompt_token_ids": tok.encode(t, add_special_tokens=False)}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_bf16_greedy_identical_with_self_int4(smollm_bf16):
    llm = smollm_bf16
    tok = llm.get_tokenizer()
    prompts = [_chat(tok, q) for q in ("Explain in a few sentences why the sky is blue.",
                                       "Write a haiku about autumn leaves.",
                                       "List three uses of a paper clip.")]
    prompts.append(dict(prompts[0]))  # a prefix-cache hit on the whole prompt
    params = [SamplingParams(temperature=0.0, max_tokens=40, n=2 if i == 1 else 1) for i in range(len(prompts))]
    # Not preemption here: in bf16 a recomputed request's rows change kind with what the prefix cache holds then
    # (a full hit computes the last prompt token as a decode row), which changes greedy output without speculation
    # too (measured); the float32 ngram test covers speculation with preemption.
    variants = {"chunked": {"max_num_batched_tokens": 32}}
    for name, extra in variants.items():
        # the reference under the same scheduler settings: in bf16 a prompt prefilled in other chunks, or a full
        # prefix-cache hit (its last token then computed as a decode row), may already change greedy output
        base = llm.with_engine_args(**extra)
        ref = [[c.token_ids for c in o.outputs] for o in base.generate(prompts, params, use_tqdm=False)]
        eng = llm.with_engine_args(speculative_config=SPEC, **extra)  # the draft from the packed weights
        got = [[c.token_ids for c in o.outputs] for o in eng.generate(prompts, params, use_tqdm=False)]
        assert got == ref, f"{name}: output differs from no speculation"
        core = eng.llm_engine.engine_core
        st = core.scheduler.spec_stats
        assert st.num_draft_tokens > 30 and st.num_accepted_tokens > 0.5 * st.num_draft_tokens, (name, st)
        pool = core.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks - 1
        draft = core.runner.drafter.draft
        kinds = {m.kind for n, m in draft.named_modules() if n.endswith(("qkv_proj", "o_proj", "down_proj"))}
        assert kinds == {"int4"} and draft.model.embed_tokens.kind == "int8"
