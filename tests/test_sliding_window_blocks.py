"""Sliding-window KV blocks through the whole engine, on a tiny random-weight Gemma 3 (float32) with the real
model's attention pattern: window 512 on 5 of every 6 layers.

A 2,000-token request holds at most ``cdiv(512, block_size) + 1`` blocks in each sliding-window group while it
decodes (the global layers keep all of theirs), the KV usage the engine reports drops accordingly, and its greedy
output still equals HF's; a second request with the same long prefix gets a prefix-cache hit whose window blocks
come back from the free list, and is right too.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 16
WINDOW = 512
PROMPT_LEN = 2000
MAX_NEW = 6
VOCAB = 320


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, sliding_window=WINDOW,
        query_pre_attn_scalar=32, initializer_range=0.2, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1,
        bos_token_id=2,
    )  # layer_types default: layer 5 global, 0-4 sliding
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    folder = tmp_path_factory.mktemp("gemma-window")
    hf.save_pretrained(folder)
    llm = LLM(str(folder), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK_SIZE,
              max_model_len=PROMPT_LEN + 64, max_num_batched_tokens=512, kv_cache_memory_bytes=8 << 20)
    return hf, llm


@torch.inference_mode()
def _assert_hf_greedy(hf, prompt, generated):
    logits = hf(torch.tensor([prompt + generated[:-1]]), logits_to_keep=len(generated)).logits[0]
    assert logits.argmax(-1).tolist() == generated


def test_long_request_holds_a_window_of_blocks_per_sliding_group(tiny_gemma):
    hf, llm = tiny_gemma
    engine = llm.llm_engine
    core = engine.engine_core
    kv = core.kv_cache_manager
    layout = core.runner.layout
    assert layout.group_windows == (None, WINDOW, WINDOW, WINDOW, WINDOW, WINDOW)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=g).tolist()
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    bound = -(-WINDOW // BLOCK_SIZE) + 1  # 33
    held, usage, out = [], [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o.outputs[0].token_ids
        req = core.scheduler.requests.get("long")
        if req is None:
            break
        per_group = [len([b for b in kv.group_req_to_blocks[i]["long"] if not b.is_null])
                     for i in range(kv.num_groups)]
        held.append((req.num_computed_tokens, per_group))
        usage.append(kv.usage)
    decoding = [(c, h) for c, h in held if c >= PROMPT_LEN]
    assert decoding, held
    for computed, per_group in decoding:
        assert per_group[0] == -(-computed // BLOCK_SIZE)  # global layers keep every block
        assert all(n <= bound for n in per_group[1:]), (computed, per_group)
    # between prefill chunks (512 tokens) the window groups hold the window plus one chunk at most
    assert all(n <= -(-(WINDOW - 1 + 512) // BLOCK_SIZE) + 1 for _, h in held for n in h[1:])
    # the KV usage the engine reports counts exactly the blocks held: at most 126 + 5 * 33 of the pool's
    # blocks (each 1 layer deep here) instead of 6 * 126
    num_usable = core.num_blocks - 1
    assert round(usage[-1] * num_usable) == sum(held[-1][1]) <= -(-(PROMPT_LEN + MAX_NEW) // BLOCK_SIZE) + 5 * bound
    assert kv.block_pool.get_num_free_blocks() == num_usable  # all back after the request
    _assert_hf_greedy(hf, prompt, out)


def test_prefix_hit_reuses_window_blocks_from_the_free_list(tiny_gemma):
    hf, llm = tiny_gemma
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, VOCAB, (1200,), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prefix + [5, 6, 7]}], sp, use_tqdm=False)[0]
    second = llm.generate([{"prompt_token_ids": prefix + [8, 9]}], sp, use_tqdm=False)[0]
    # a hit of the 75 full blocks of the shared prefix: the global group's from block 0, each window group's
    # only for the 33 blocks before position 1200 (the rest are the null block in its table)
    assert second.num_cached_tokens == 1200
    _assert_hf_greedy(hf, prefix + [5, 6, 7], first.outputs[0].token_ids)
    _assert_hf_greedy(hf, prefix + [8, 9], second.outputs[0].token_ids)
