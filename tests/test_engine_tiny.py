"""Greedy generation through the whole engine (paged cache, batching, chunked prefill, preemption) equals
HF transformers' greedy decoding, on tiny random-weight Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 /
DeepSeek V2 / DeepSeek V3 models (float32). HF checks the batched run in one forward pass per prompt (its argmax
at every position must be the engine's next token); the chunked and preempted runs must equal the batched one."""

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
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
    if kind == "gemma3":
        # 2 of 3 layers sliding (window 12 < most prompts), GQA, head_dim 32, tied embeddings
        c = {k: v for k, v in common.items() if k != "tie_word_embeddings"}
        c["num_hidden_layers"] = 3
        return transformers.Gemma3TextConfig(
            **c, head_dim=32, sliding_window=12, query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], pad_token_id=0)
    if kind in ("deepseek_v2", "deepseek_v3"):
        c = dict(common, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                 kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)
        if kind == "deepseek_v2":
            return transformers.DeepseekV2Config(**c, q_lora_rank=None, topk_method="group_limited_greedy",
                                                 n_group=4, topk_group=2, routed_scaling_factor=1.5)
        return transformers.DeepseekV3Config(**c, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                             routed_scaling_factor=2.5)
    raise ValueError(kind)


KINDS = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "deepseek_v2", "deepseek_v3"]


def _save_tiny(kind: str, path) -> torch.nn.Module:
    torch.manual_seed(KINDS.index(kind))
    cfg = _tiny_config(kind)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if kind == "gemma3" and "norm" in name:  # zero-centred norm weights start at 0
                p.uniform_(-0.5, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    if kind == "qwen2":
        with torch.no_grad():  # make the q/k/v biases non-trivial
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


@torch.no_grad()
def assert_hf_greedy(model, prompt: list[int], generated: list[int], what: str) -> None:
    """HF's greedy decoding of ``prompt`` yields ``generated`` iff HF's argmax at every position of
    ``prompt + generated[:-1]`` is the next generated token: one forward pass checks them all."""
    logits = model(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1 :]
    picks = logits.argmax(-1).tolist()
    if picks != generated:
        i = next(j for j, (a, b) in enumerate(zip(picks, generated)) if a != b)
        raise AssertionError(f"{what}: HF picks {picks[i]} at output token {i}, the engine {generated[i]}")


def _prompts():
    g = torch.Generator().manual_seed(123)
    lens = [3, 17, 30, 9, 45, 1, 24, 16]
    return [torch.randint(2, VOCAB - 2, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_equals_hf(kind, tmp_path):
    hf = _save_tiny(kind, tmp_path)
    prompts = _prompts()
    max_new = 20
    if kind.startswith("deepseek"):  # MoE steps are several times dearer (a Python loop over experts, both sides)
        prompts, max_new = prompts[:6], 12
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
              kv_cache_memory_bytes=4 << 20, max_model_len=256)
    # Preemption: 2 blocks more than one request of 72 tokens may hold at once (prefilled in chunks of <= 16), for
    # 8 requests of up to 65 tokens. Llama: 20 blocks of 4 tokens (one request: 18). Sliding-window layers hold
    # fewer blocks (KV cache groups), so their models get fewer.
    layout = llm.llm_engine.engine_core.runner.layout
    num_blocks = layout.blocks_for_one_request(72, 4, 16) + 2
    variants = {
        "batched": llm,
        # a 7-token budget forces chunked prefill with chunks ending mid-block and on block boundaries
        "chunked": llm.with_engine_args(max_num_batched_tokens=7),
        # at most 5 prompt tokens a request per step: long prompts in chunks beside the short ones' whole prompts
        "long_prefill": llm.with_engine_args(long_prefill_token_threshold=5),
        "preempt": llm.with_engine_args(num_gpu_blocks_override=num_blocks, max_model_len=72,
                                        max_num_batched_tokens=16),
    }
    ref = None
    for name, eng in variants.items():
        outs = eng.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        if ref is None:  # the batched run against HF; the others must be token-identical to it
            for i, (p, g) in enumerate(zip(prompts, got)):
                assert len(g) == max_new
                assert_hf_greedy(hf, p, g, f"{kind}/{name}: prompt {i} (len {len(p)})")
            ref = got
        for i, (g, r) in enumerate(zip(got, ref)):
            assert g == r, f"{kind}/{name}: prompt {i} (len {len(prompts[i])}) differs from HF"
        core = eng.llm_engine.engine_core
        pool = core.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks - 1, f"{name}: blocks leaked"
    assert variants["preempt"].llm_engine.engine_core.scheduler.num_preemptions > 0
    assert variants["long_prefill"].llm_engine.engine_core.scheduler.chunk_cap == 5
    runner = llm.llm_engine.engine_core.runner
    if kind.startswith("deepseek"):  # one MLA latent per token per layer in the paged cache, nothing else
        assert all(c.shape == (runner.num_blocks, 4, 16 + 8) for c in runner.kv_caches)
