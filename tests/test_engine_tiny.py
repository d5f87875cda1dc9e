"""Greedy generation through the whole engine (paged cache, batching, chunked prefill, preemption) equals
HF transformers' own greedy decoding, on tiny random-weight Llama / Mistral / Qwen2 models (float32)."""

import pytest
import torch

from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 384


def _tiny_config(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, tie_word_embeddings=False, eos_token_id=VOCAB - 1, bos_token_id=1)
    if kind == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=12, rope_theta=10000.0)
    if kind == "qwen2":
        c = dict(common)
        c["tie_word_embeddings"] = True
        return transformers.Qwen2Config(**c, rope_theta=1000000.0, use_sliding_window=False)
    raise ValueError(kind)


def _save_tiny(kind: str, path) -> torch.nn.Module:
    torch.manual_seed({"llama": 0, "mistral": 1, "qwen2": 2}[kind])
    cfg = _tiny_config(kind)
    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM}[kind]
    model = cls(cfg).to(torch.float32).eval()
    if kind == "qwen2":
        with torch.no_grad():  # make the q/k/v biases non-trivial
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's own incremental decoding with its KV cache: argmax at each step."""
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    past = out.past_key_values
    toks = []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(max_new_tokens):
        toks.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = int(out.logits[0, -1].argmax())
    return toks


def _prompts():
    g = torch.Generator().manual_seed(123)
    lens = [3, 17, 30, 9, 45, 1, 24, 16]
    return [torch.randint(2, VOCAB - 2, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_engine_greedy_equals_hf(kind, tmp_path):
    hf = _save_tiny(kind, tmp_path)
    prompts = _prompts()
    max_new = 20
    ref = [hf_greedy(hf, p, max_new) for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
              kv_cache_memory_bytes=4 << 20, max_model_len=256)
    variants = {
        "batched": llm,
        # a 7-token budget forces chunked prefill with chunks ending mid-block and on block boundaries
        "chunked": llm.with_engine_args(max_num_batched_tokens=7),
        # 20 usable blocks of 4 tokens for 8 requests of up to 65 tokens (17 blocks): preemption by recompute
        "preempt": llm.with_engine_args(num_gpu_blocks_override=20, max_model_len=72),
    }
    for name, eng in variants.items():
        outs = eng.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        for i, (g, r) in enumerate(zip(got, ref)):
            assert g == r, f"{kind}/{name}: prompt {i} (len {len(prompts[i])}) differs from HF"
        core = eng.llm_engine.engine_core
        pool = core.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks - 1, f"{name}: blocks leaked"
    assert variants["preempt"].llm_engine.engine_core.scheduler.num_preemptions > 0
