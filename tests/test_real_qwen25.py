"""Qwen2.5-Coder-0.5B-Instruct (GGUF: mostly Q5_0, with Q8_0 / Q4_K / Q6_K; q/k/v biases; untied lm_head; 152k
vocabulary) through our loader and engine, against HF transformers' Qwen2 in float32.

The HF model is built from our config and our dequantized weights (see real_models.py for why and for what
covers the GGUF path instead). Greedy equality is checked against one HF forward pass per prompt over our output
(HF's greedy pick at every position must be our token). Logits tolerance: ``ATOL``/``RTOL`` below (float32 both
sides, differences from summation order only).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from pagedllm.entrypoints.llm import LLM
from pagedllm.model_files import qwen25_05b_path
from pagedllm.sampling_params import SamplingParams
from real_models import (
    assert_dequantizes_like_gguf,
    assert_hf_greedy_agrees,
    hf_logits_of_continuation,
    hf_reference,
    prefill_logits,
)

pytestmark = pytest.mark.slow

ATOL = 1e-3
RTOL = 1e-4
MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):\n",
    "# Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.\n"
    "import re\n\n",
]


@pytest.fixture(scope="module")
def qwen():
    t0 = time.perf_counter()
    llm = LLM(qwen25_05b_path(), dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=512,
              quantization="none")
    load_s = time.perf_counter() - t0
    model = llm.llm_engine.engine_core.runner.model
    hf = hf_reference(model)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    # One engine run that chunks the long prompt (16-token budget) and must preempt (5 usable blocks of 16 for 3
    # requests of 2-4 blocks each); its output is checked against HF below.
    eng = llm.with_engine_args(max_num_batched_tokens=16, num_gpu_blocks_override=5, max_model_len=64)
    t0 = time.perf_counter()
    outs = eng.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    gen = [o.outputs[0].token_ids for o in outs]
    hf_logits = [hf_logits_of_continuation(hf, p, g) for p, g in zip(ids, gen)]
    print(f"Qwen2.5-0.5B: our load {load_s:.1f} s, chunked + preempted generate {gen_s:.1f} s")
    return SimpleNamespace(llm=llm, eng=eng, model=model, hf=hf, ids=ids, gen=gen, hf_logits=hf_logits)


def test_config_is_qwen25_coder_05b(qwen):
    cfg = qwen.model.hf_config
    assert type(qwen.model).__name__ == "Qwen2ForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (896, 24, 14, 2)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.head_dim) == (4864, 151936, 64)
    assert cfg.rope_parameters["rope_theta"] == 1000000.0 and cfg.rms_norm_eps == 1e-6
    assert not cfg.tie_word_embeddings  # this GGUF ships output.weight
    assert qwen.model.lm_head.weight.data_ptr() != qwen.model.model.embed_tokens.weight.data_ptr()
    assert qwen.model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert qwen.model.sliding_window is None


def test_every_quant_type_dequantizes_like_gguf():
    assert assert_dequantizes_like_gguf(qwen25_05b_path()) == ["F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]


def test_logits_match_hf(qwen):
    tokens = qwen.ids[2] + qwen.gen[2][:-1]
    got = prefill_logits(qwen.model, tokens, chunk=13)  # chunks end mid-block and cross blocks
    torch.testing.assert_close(got, qwen.hf_logits[2], atol=ATOL, rtol=RTOL)


def test_engine_greedy_equals_hf_chunked_and_preempted(qwen):
    for i, (p, g) in enumerate(zip(qwen.ids, qwen.gen)):
        assert_hf_greedy_agrees(qwen.hf_logits[i], p, g, f"prompt {i}")
    assert max(len(p) for p in qwen.ids) > 16  # chunked
    assert qwen.eng.llm_engine.engine_core.scheduler.num_preemptions > 0
    pool = qwen.eng.llm_engine.engine_core.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert "Paris" in qwen.llm.get_tokenizer().decode(qwen.gen[0])


def test_chat_uses_the_models_template(qwen):
    tok = qwen.llm.get_tokenizer()
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    out = qwen.llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    prompt = tok.decode(out.prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert "Paris" in out.outputs[0].text
