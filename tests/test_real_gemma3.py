"""Gemma-3-270M (base; GGUF: Q5_0 / Q4_K / Q6_K / Q8_0, norms stored +1; head_dim 256, one KV head, sliding window
512 on 5 of every 6 layers, 262k vocabulary) through our loader and engine, against HF transformers' Gemma3 in
float32.

The HF model is built from our config and our dequantized weights (see real_models.py). One prompt is longer than
the 512-token window, so the sliding-window layers drop its beginning (in prefill chunks and in decode) while the
global layers keep it. Logits tolerance: ``ATOL``/``RTOL`` (float32 both sides; summation order only).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from pagedllm.entrypoints.llm import LLM
from pagedllm.entrypoints.openai.protocol import ChatMessage
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import OpenAIServingError
from pagedllm.model_files import gemma3_270m_path
from pagedllm.sampling_params import SamplingParams
from real_models import (
    assert_dequantizes_like_gguf,
    assert_hf_greedy_agrees,
    hf_reference,
    prefill_logits,
)

pytestmark = pytest.mark.slow

ATOL = 1e-3
RTOL = 1e-4
MAX_NEW = 16
BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press into a system that could produce books quickly. "
)


@pytest.fixture(scope="module")
def gemma():
    t0 = time.perf_counter()
    # dense (the file dequantized): HF's reference is built from these weights; the kept-as-stored default
    # (quantization auto) is checked against this same dequantized model in test_kquant.py
    llm = LLM(gemma3_270m_path(), dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=1024,
              block_size=BLOCK_SIZE, quantization="none")
    load_s = time.perf_counter() - t0
    model = llm.llm_engine.engine_core.runner.model
    hf = hf_reference(model)
    tok = llm.get_tokenizer()
    long_ids = tok.encode(LONG_TEXT * 40)[:560] + tok.encode(" In summary,", add_special_tokens=False)
    ids = [tok.encode("The capital of France is"),
           tok.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'), long_ids]
    # One engine run: the long prompt is prefilled in chunks of <= 128 tokens (crossing the window) while the
    # short ones decode, and the KV cache has one block more than the long request may hold at once (KV cache
    # groups: 3 layers per block, the global group keeps every block, the 5 window groups what their window and a
    # chunk need), so the short requests beside it force a preemption.
    max_len = (-(-(len(long_ids) + MAX_NEW) // BLOCK_SIZE) + 1) * BLOCK_SIZE
    layout = llm.llm_engine.engine_core.runner.layout
    eng = llm.with_engine_args(max_num_batched_tokens=128, max_model_len=max_len,
                               num_gpu_blocks_override=layout.blocks_for_one_request(max_len, BLOCK_SIZE, 128) + 1)
    t0 = time.perf_counter()
    outs = eng.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    gen = [o.outputs[0].token_ids for o in outs]
    with torch.inference_mode():  # HF's logits at the positions that pick the generated tokens (one pass each)
        hf_logits = [hf(torch.tensor([p + g[:-1]]), logits_to_keep=MAX_NEW).logits[0] for p, g in zip(ids, gen)]
    print(f"Gemma-3-270M: our load {load_s:.1f} s, chunked + preempted generate {gen_s:.1f} s")
    return SimpleNamespace(llm=llm, eng=eng, model=model, hf=hf, ids=ids, gen=gen, hf_logits=hf_logits)


def test_config_is_gemma3_270m(gemma):
    cfg = gemma.model.hf_config
    assert type(gemma.model).__name__ == "Gemma3ForCausalLM" and cfg.model_type == "gemma3_text"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (640, 18, 4, 1)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (256, 2048, 262144)
    assert cfg.sliding_window == 512 and cfg.query_pre_attn_scalar == 256 and cfg.rms_norm_eps == 1e-6
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1000000.0
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert full == [5, 11, 17]
    assert [layer.self_attn.attn.sliding_window for layer in gemma.model.model.layers] == [
        None if i in full else 512 for i in range(18)]
    assert cfg.tie_word_embeddings and gemma.model.lm_head is gemma.model.model.embed_tokens
    assert cfg.final_logit_softcapping is None and cfg.hidden_activation == "gelu_pytorch_tanh"
    layout = gemma.llm.llm_engine.engine_core.runner.layout  # KV cache groups: 3 global layers, 5 x 3 windowed
    assert layout.group_windows == (None,) + (512,) * 5 and layout.layers_per_group == 3


def test_every_quant_type_dequantizes_like_gguf():
    assert assert_dequantizes_like_gguf(gemma3_270m_path()) == ["F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]


def test_norm_weights_are_stored_plus_one(gemma):
    import numpy as np

    from pagedllm.model_loader.gguf_loader import _to_torch, read_gguf_header

    info = read_gguf_header(gemma3_270m_path()).tensors["output_norm.weight"]  # F32: 1 + w in the file
    raw = np.memmap(gemma3_270m_path(), dtype=np.uint8, mode="r")[info.offset : info.offset + info.nbytes]
    stored = _to_torch(np.array(raw), info, torch.float32)
    assert torch.equal(gemma.model.model.norm.weight, stored - 1)
    assert torch.equal(gemma.hf.model.norm.weight, stored - 1)


def test_logits_match_hf_across_the_window(gemma):
    tokens = gemma.ids[2] + gemma.gen[2][:-1]
    got = prefill_logits(gemma.model, tokens, chunk=200, keep_last=MAX_NEW)  # chunk borders at 200 and 400
    torch.testing.assert_close(got, gemma.hf_logits[2], atol=ATOL, rtol=RTOL)
    assert len(gemma.ids[2]) > 512


def test_engine_greedy_equals_hf_chunked_and_preempted(gemma):
    for i, (p, g) in enumerate(zip(gemma.ids, gemma.gen)):
        assert_hf_greedy_agrees(gemma.hf_logits[i], p[-1:], g, f"prompt {i}")  # logits kept: the last MAX_NEW
    assert gemma.eng.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert "return" in gemma.llm.get_tokenizer().decode(gemma.gen[1])  # sensible text: weights really loaded


def test_base_model_has_no_chat_template_so_chat_is_a_clear_400(gemma):
    with pytest.raises(ValueError, match="no chat template"):
        gemma.llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    engine = SimpleNamespace(tokenizer=gemma.llm.get_tokenizer(), config=gemma.llm.llm_engine.config,
                             input_processor=gemma.llm.llm_engine.input_processor)
    serving = OpenAIServingChat(engine, ["gemma"])
    with pytest.raises(OpenAIServingError, match="no chat template") as e:
        serving.render([ChatMessage(role="user", content="hi")])
    assert e.value.status == 400
    # completions work
    out = gemma.llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4),
                             use_tqdm=False)[0]
    assert out.outputs[0].token_ids == gemma.gen[0][:4]
