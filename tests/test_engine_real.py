"""The engine on the real SmolLM2-135M-Instruct GGUF.

- float32 greedy output equals HF transformers' greedy output on the same GGUF file (64 tokens);
- a prompt alone == inside a batch of 16 == with chunked prefill == under preemption (float32: token-identical);
- seeded sampling is the same alone and in a mixed batch;
- bf16: the standard relaxation (equal up to the first divergence, and there each side's token is in the other's
  top-5) — how often it was needed is printed.
"""

import os

import pytest
import torch

from pagedllm.entrypoints.llm import LLM
from pagedllm.model_files import default_model_path
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Here is a list of the planets of the solar system, in order:",
    "Q: What is 17 times 3?\nA:",
    "The three primary colors are",
    "In machine learning, overfitting means",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "The quick brown fox",
    "Write a haiku about autumn leaves.",
    "import numpy as np\n\n# compute the mean of an array\n",
    "Paris, London and Berlin are",
    "My favourite recipe for pancakes needs",
    "The French Revolution began in",
    "Water boils at",
]


@pytest.fixture(scope="module")
def llm32():
    return LLM(dtype="float32", kv_cache_memory_bytes=512 << 20, max_model_len=1024, quantization="none")


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                             dtype=torch.float32)
    return m.eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model(torch.tensor([prompt]), use_cache=True)
    past = out.past_key_values
    toks = []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(max_new_tokens):
        toks.append(nxt)
        out = model(torch.tensor([[nxt]]), cache=past, use_cache=True)
        past = out.past_key_values
        nxt = int(out.logits[0, -1].argmax())
    return toks


GREEDY64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def test_greedy_equals_hf_on_real_gguf(llm32, hf_model):
    tok = llm32.get_tokenizer()
    prompts = PROMPTS[:4]
    outs = llm32.generate(prompts, GREEDY64, use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids = tok.encode(p)
        assert o.prompt_token_ids == ids
        ref = hf_greedy(hf_model, ids, 64)
        assert o.outputs[0].token_ids == ref, f"prompt {p!r}"
        assert o.outputs[0].text == tok.decode(ref, skip_special_tokens=True)


def test_chat_template_as_model_expects(llm32):
    tok = llm32.get_tokenizer()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm32.chat(msgs, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    expected = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(out.prompt_token_ids).endswith(expected)
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> ends the turn


def test_alone_batch_chunked_preempted_identical(llm32):
    target = PROMPTS[2]
    alone = llm32.generate([target], GREEDY64, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm32.generate(PROMPTS, GREEDY64, use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    chunked = llm32.with_engine_args(max_num_batched_tokens=24)
    outs = chunked.generate(PROMPTS, GREEDY64, use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone
    for a, b in zip(outs, batch):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    # 40 usable blocks of 16 tokens for 16 requests of ~80 tokens (6 blocks each): preemption.
    small = llm32.with_engine_args(num_gpu_blocks_override=40, max_model_len=512,
                                   enable_prefix_caching=False)
    outs = small.generate(PROMPTS, GREEDY64, use_tqdm=False)
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    for a, b in zip(outs, batch):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    pool = small.llm_engine.engine_core.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_seeded_sampling_alone_equals_in_batch(llm32):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=32)
    alone = llm32.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=40), SamplingParams(temperature=0.0, max_tokens=20),
              SamplingParams(temperature=0.7, top_k=20, seed=7, max_tokens=32)]
    params = [others[0], sp, others[1], others[2], others[0]]
    prompts = [PROMPTS[3], PROMPTS[0], PROMPTS[5], PROMPTS[6], PROMPTS[7]]
    outs = llm32.generate(prompts, params, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    # and a different seed gives a different sample (the seed is actually used)
    sp2 = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=32)
    assert llm32.generate([PROMPTS[0]], sp2, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_bf16_batch_invariance_relaxed():
    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=256 << 20, max_model_len=1024, quantization="none")
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0] for p in PROMPTS[:6]]
    batch = [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)[:6]]
    relaxed = 0
    for a, b in zip(alone, batch):
        if a.token_ids == b.token_ids:
            continue
        relaxed += 1
        i = next(k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        assert a.token_ids[i] in b.logprobs[i] and b.token_ids[i] in a.logprobs[i], (
            f"bf16 divergence at token {i} is not a near-tie")
    print(f"bf16 relaxation needed for {relaxed}/6 prompts")
