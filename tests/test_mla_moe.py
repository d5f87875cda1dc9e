"""DeepSeek specifics: the MLA latent cache (size and both attention forms) and the MoE router, against
transformers (float32; tolerances as in test_models).

The whole-model logits of every DeepSeek variant (V2 greedy / grouped + yarn + q-LoRA + bias, V3 interleaved /
rotate-half + yarn) are checked in test_models (one prefill, chunked prefill, batched decode + prefill); greedy
generation through the engine in test_engine_tiny.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from pagedllm.kv_cache_spec import AttentionSpec, MLASpec
from pagedllm.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, MoEGate
from pagedllm.worker.model_runner import allocate_kv_caches, kv_cache_bytes_per_block
from test_models import ATOL, CONFIGS, RTOL, PagedRunner, _deepseek_v2, _deepseek_v3, _hf_logits, _load_pair, _prompt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_cache_holds_one_latent_per_token_per_layer(dtype):
    cfg = CONFIGS["deepseek-v3"]()
    model = DeepseekV3ForCausalLM(cfg, dtype)
    specs = model.kv_cache_spec()
    elem = torch.empty((), dtype=dtype).element_size()
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert specs == [MLASpec(cfg.kv_lora_rank, cfg.qk_rope_head_dim)] * cfg.num_hidden_layers
    for spec in specs:
        # the requirement: (kv_lora_rank + qk_rope_head_dim) * dtype_size bytes per token per layer
        assert spec.bytes_per_token(elem) == latent * elem
    # what the runner allocates and budgets is exactly that (vs full K/V of every head: 2 * H * (dn + p) per token)
    num_blocks, block_size = 5, 4
    caches = allocate_kv_caches(specs, num_blocks, block_size, dtype)
    for c in caches:
        assert c.shape == (num_blocks, block_size, latent) and c.dtype == dtype
        assert c.numel() * c.element_size() == num_blocks * block_size * latent * elem
    assert kv_cache_bytes_per_block(specs, block_size, dtype) == cfg.num_hidden_layers * block_size * latent * elem
    full_kv = AttentionSpec(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    assert full_kv.bytes_per_token(elem) > 4 * specs[0].bytes_per_token(elem)


@pytest.mark.parametrize("name", ["deepseek-v2-grouped-yarn-qlora-bias", "deepseek-v3"])
@pytest.mark.parametrize("absorb", [True, False])
def test_absorbed_and_expanded_mla_match_hf_everywhere(name, absorb, tmp_path_factory):
    """Forcing one form for prefill chunks and decode rows alike: both equal HF (they differ only in summation
    order); the default (absorbed decode, expanded prefill) is covered by test_models."""
    hf, ours = _load_pair(name, tmp_path_factory)
    ours.set_absorb(absorb)
    try:
        a, b = _prompt(15, seed=11), _prompt(9, seed=12)
        runner = PagedRunner(ours, seed=13)
        steps = [[("a", 0, 6)], [("a", 6, 7), ("b", 0, 5)], [("b", 5, 6), ("a", 7, 8)], [("a", 8, 15), ("b", 6, 9)]]
        seqs = {"a": a, "b": b}
        got = {"a": [], "b": []}
        for step in steps:
            for (r, _, _), logits in zip(step, runner.step([(r, seqs[r][s:e]) for r, s, e in step])):
                got[r].append(logits)
        for r in ("a", "b"):
            torch.testing.assert_close(torch.cat(got[r]), _hf_logits(hf, seqs[r]), atol=ATOL, rtol=RTOL)
    finally:
        ours.set_absorb(None)


def _hf_router(cfg):
    if isinstance(cfg, transformers.DeepseekV3Config):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        return DeepseekV3TopkRouter(cfg)
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    return DeepseekV2TopkRouter(cfg)


ROUTERS = {
    "v2-greedy": lambda: _deepseek_v2(),
    "v2-group-limited": lambda: _deepseek_v2(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                             num_experts_per_tok=3),
    "v3-grouped-normed": lambda: _deepseek_v3(norm_topk_prob=True),
    "v3-one-group-unnormed": lambda: _deepseek_v3(n_group=1, topk_group=1, norm_topk_prob=False),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_router_picks_the_same_experts_and_weights_as_hf(name):
    torch.manual_seed(0)
    cfg = ROUTERS[name]()
    hf = _hf_router(cfg)
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
        if hasattr(hf, "e_score_correction_bias"):
            hf.e_score_correction_bias.uniform_(-0.3, 0.3)  # large enough to change choices, not weights
    version = 3 if isinstance(cfg, transformers.DeepseekV3Config) else 2
    ours = MoEGate(cfg, version)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        if version == 3:
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(64, cfg.hidden_size)
    _, ref_w, ref_ids = hf(x)
    ids, w = ours(x)
    # the order of the k chosen experts is irrelevant (their outputs are summed)
    ref_ids, ref_order = ref_ids.sort(dim=-1)
    ids, order = ids.sort(dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6, rtol=1e-6)
    if version == 3 and cfg.n_group > 1:
        # grouping really restricted the choice for some tokens (the test would be vacuous otherwise)
        free = torch.topk(torch.sigmoid(x @ hf.weight.T) + hf.e_score_correction_bias, cfg.num_experts_per_tok)[1]
        assert not torch.equal(free.sort(dim=-1)[0], ids)


def test_stacked_and_per_expert_checkpoint_names_load_the_same(tmp_path_factory):
    hf, from_folder = _load_pair("deepseek-v3", tmp_path_factory)  # save_pretrained: experts.{e}.gate_proj.weight
    stacked = DeepseekV3ForCausalLM(hf.config, torch.float32)
    state = hf.state_dict()  # in memory: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    stacked.load_weights(state.items())
    a = dict(from_folder.named_parameters())
    for name, p in stacked.named_parameters():
        assert torch.equal(p, a[name]), name
    with pytest.raises(ValueError, match="missing.*experts.down_proj"):
        DeepseekV2ForCausalLM(_deepseek_v2(), torch.float32).load_weights(
            (k, v) for k, v in _load_pair("deepseek-v2", tmp_path_factory)[0].state_dict().items()
            if "experts.down_proj" not in k
        )


def test_moe_layers_follow_first_k_dense_replace(tmp_path_factory):
    _, ours = _load_pair("deepseek-v2", tmp_path_factory)
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers]
    assert kinds == ["DeepseekMLP", "DeepseekMoE", "DeepseekMoE"]
    moe = ours.model.layers[1].mlp
    assert moe.experts.gate_up_proj.shape == (8, 2 * 32, 64) and moe.shared_experts is not None
    assert moe.gate.weight.dtype == torch.float32


def test_hf_reference_really_uses_the_moe(tmp_path_factory):
    """Sanity of the reference: zeroing the routed experts changes HF's logits (they are not a no-op)."""
    hf, _ = _load_pair("deepseek-v2", tmp_path_factory)
    prompt = _prompt(6, seed=21)
    ref = _hf_logits(hf, prompt)
    m = AutoModelForCausalLM.from_config(hf.config, attn_implementation="eager", dtype=torch.float32).eval()
    m.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for layer in m.model.layers[1:]:
            layer.mlp.experts.down_proj.zero_()
    assert (_hf_logits(m, prompt) - ref).abs().max() > 1e-3
