"""Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 / DeepSeek V2-V3 against transformers' own implementations, through the
paged KV cache.

Tiny random-weight models are built from transformers configs, saved with ``save_pretrained`` (safetensors), loaded
with our loader, and run in float32 three ways: one prefill of the whole prompt; chunked prefill (chunks ending
mid-block and on block boundaries, block_size 4); and two requests batched in one step (one decoding while the other
prefills, then both decoding). Logits must match HF's within ``ATOL``/``RTOL``.

Physical blocks are handed out in a shuffled order so that every request's blocks are scattered in the cache.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from pagedllm.attention.torch_attn import build_attention_metadata
from pagedllm.config import ModelConfig
from pagedllm.kv_cache_spec import AttentionSpec
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.model_loader import get_architecture, load_hf_config, load_model
from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from pagedllm.models.registry import get_model_class, resolve_architecture
from pagedllm.worker.model_runner import allocate_kv_caches

# float32 on both sides; the only differences are summation orders (fused matmuls, SDPA vs eager softmax).
ATOL = 1e-4
RTOL = 1e-4
BLOCK_SIZE = 4
VOCAB = 256

# ---------------------------------------------------------------- paged runner used by the tests


class PagedRunner:
    """Feeds scheduled tokens of several requests through ``model`` the way the engine's runner does: one flat
    batch per step, slot_mapping and block_tables built from per-request block lists."""

    def __init__(self, model: torch.nn.Module, num_blocks: int = 64, block_size: int = BLOCK_SIZE, seed: int = 0):
        self.model = model
        self.block_size = block_size
        dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_caches(model.kv_cache_spec(), num_blocks, block_size, dtype)
        self.free_blocks = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free_blocks)
        self.block_ids: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    @torch.inference_mode()
    def step(self, scheduled: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """scheduled: ``(request id, its new token ids)`` in batch order -> logits ``[len(tokens), vocab]`` each."""
        bs = self.block_size
        input_ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for req_id, tokens in scheduled:
            start = self.num_computed.get(req_id, 0)
            end = start + len(tokens)
            blocks = self.block_ids.setdefault(req_id, [])
            while len(blocks) * bs < end:
                blocks.append(self.free_blocks.pop())
            input_ids += tokens
            positions += range(start, end)
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(blocks)
            self.num_computed[req_id] = end
        block_tables = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        meta = build_attention_metadata(
            query_lens,
            seq_lens,
            block_tables,
            torch.tensor(slots, dtype=torch.int64),
            bs,
            sliding_window=self.model.sliding_window,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), self.kv_caches, meta
        )
        return list(self.model.compute_logits(hidden).float().split(query_lens))


# ---------------------------------------------------------------- tiny models


def _llama(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        initializer_range=0.1,  # larger than the default 0.02 so attention and rotary errors show in the logits
        tie_word_embeddings=False,
    )
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _mistral(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # q_size 128 != hidden 64
        max_position_embeddings=64,
        sliding_window=5,  # smaller than the prompts
        rms_norm_eps=1e-5,
        initializer_range=0.1,
    )
    base.update(kw)
    return transformers.MistralConfig(**base)


def _qwen2(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=True,
    )
    base.update(kw)
    return transformers.Qwen2Config(**base)


def _qwen3(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return transformers.Qwen3Config(**base)


def _gemma3(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,  # != head_dim: the scale must come from it
        max_position_embeddings=64,
        sliding_window=5,  # smaller than the prompts
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                     "full_attention", "sliding_attention"],
        rms_norm_eps=1e-6,
        initializer_range=0.1,
    )  # rope: local base 10k, global 1M (Gemma 3's defaults)
    base.update(kw)
    return transformers.Gemma3TextConfig(**base)


# DeepSeek: MLA with r=16 latents + 8 rope dims, nope 8, v 12 (!= nope + rope), 8 experts of which 2 per token,
# one dense layer first. V3 needs num_key_value_heads = heads in HF's eager attention.
_DEEPSEEK_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
)
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                  "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}


def _deepseek_v2(**kw):
    return transformers.DeepseekV2Config(**{**_DEEPSEEK_COMMON, "q_lora_rank": None, "routed_scaling_factor": 1.5,
                                            **kw})


def _deepseek_v3(**kw):
    return transformers.DeepseekV3Config(**{**_DEEPSEEK_COMMON, "q_lora_rank": 24, "n_group": 4, "topk_group": 2,
                                            "routed_scaling_factor": 2.5, **kw})


CONFIGS = {
    "llama": lambda: _llama(),
    "llama-tied-bias": lambda: _llama(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "llama-rope-linear": lambda: _llama(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "llama-rope-dynamic": lambda: _llama(
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    ),
    "llama-rope-llama3": lambda: _llama(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
    "llama-rope-yarn": lambda: _llama(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
    "mistral-sliding": lambda: _mistral(),
    "qwen2-bias": lambda: _qwen2(),
    "qwen2-sliding-upper-layers": lambda: _qwen2(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=6, max_window_layers=1
    ),
    "qwen3-qk-norm": lambda: _qwen3(),
    "gemma3": lambda: _gemma3(),
    "gemma3-softcap-bias-linear-rope": lambda: _gemma3(
        final_logit_softcapping=5.0,
        attention_bias=True,
        tie_word_embeddings=False,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
        },
    ),
    "deepseek-v2": lambda: _deepseek_v2(),
    "deepseek-v2-grouped-yarn-qlora-bias": lambda: _deepseek_v2(
        q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2, attention_bias=True,
        rope_parameters=_DEEPSEEK_YARN, max_position_embeddings=64,
    ),
    "deepseek-v3": lambda: _deepseek_v3(norm_topk_prob=True),
    "deepseek-v3-yarn-rotate-half": lambda: _deepseek_v3(
        rope_interleave=False, rope_parameters=_DEEPSEEK_YARN, norm_topk_prob=False, n_shared_experts=2,
        tie_word_embeddings=True,
    ),
}

_loaded: dict[str, tuple] = {}


def _load_pair(name: str, tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(HF model, our model) for config ``name``; ours loaded from HF's save_pretrained folder."""
    if name not in _loaded:
        torch.manual_seed(zlib.crc32(name.encode()) % 1000)  # stable across runs (str hash is salted)
        cfg = CONFIGS[name]()
        hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
        with torch.no_grad():  # HF initialises every RMSNorm weight to 1, which would hide swapped norms
            for p_name, p in hf.named_parameters():
                if "norm" in p_name:
                    p.uniform_(0.5, 1.5)
            for b_name, b in hf.named_buffers():  # DeepSeek V3's router bias starts at 0
                if b_name.endswith("e_score_correction_bias"):
                    b.uniform_(-0.1, 0.1)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        hf_config = load_hf_config(str(folder))
        mc = ModelConfig(
            model=str(folder),
            tokenizer=str(folder),
            served_model_name=name,
            dtype=torch.float32,
            max_model_len=hf_config.max_position_embeddings,
            hf_config=hf_config,
            architecture=get_architecture(hf_config),
            vocab_size=hf_config.vocab_size,
        )
        _loaded[name] = (hf, load_model(mc))
    return _loaded[name]


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=g).tolist()


@torch.inference_mode()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------- tests against HF


@pytest.mark.parametrize("name", list(CONFIGS))
def test_single_prefill_matches_hf(name, tmp_path_factory):
    hf, ours = _load_pair(name, tmp_path_factory)
    prompt = _prompt(19, seed=1)
    (logits,) = PagedRunner(ours).step([("a", prompt)])
    _close(logits, _hf_logits(hf, prompt))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_prefill_matches_hf(name, tmp_path_factory):
    # chunks 5 + 7 + 7 with block_size 4: the first ends mid-block, the second on a block boundary (12)
    hf, ours = _load_pair(name, tmp_path_factory)
    prompt = _prompt(19, seed=2)
    runner = PagedRunner(ours, seed=3)
    got = [runner.step([("a", prompt[s:e])])[0] for s, e in ((0, 5), (5, 12), (12, 19))]
    _close(torch.cat(got), _hf_logits(hf, prompt))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_decode_and_prefill_match_hf(name, tmp_path_factory):
    hf, ours = _load_pair(name, tmp_path_factory)
    a = _prompt(17, seed=4)
    b = _prompt(16, seed=5)
    # (request, start, end) per step; the sequences are fixed, so "decoding" feeds the next token of each.
    schedule = [
        [("a", 0, 9)],  # prefill a
        [("a", 9, 10), ("b", 0, 6)],  # a decodes while b prefills (decode rows are not all rows)
        [("b", 6, 13), ("a", 10, 11)],  # b's chunk first in the batch this time
        [("a", 11, 12), ("b", 13, 14)],  # both decode: one batched decode call
        [("a", 12, 13), ("b", 14, 15)],
        [("a", 13, 17), ("b", 15, 16)],  # a chunk of 4 after decoding, b decodes
    ]
    seqs = {"a": a, "b": b}
    runner = PagedRunner(ours, seed=6)
    got = {"a": [], "b": []}
    for step in schedule:
        out = runner.step([(r, seqs[r][s:e]) for r, s, e in step])
        for (r, _, _), logits in zip(step, out):
            got[r].append(logits)
    _close(torch.cat(got["a"]), _hf_logits(hf, a))
    _close(torch.cat(got["b"]), _hf_logits(hf, b))


@torch.inference_mode()
def test_dynamic_ntk_decode_beyond_max_positions_matches_hf_generation(tmp_path_factory):
    """Past max_position_embeddings, HF's dynamic NTK rescales with the current length each step; cached decoding
    must reproduce HF's own token-by-token generation with its KV cache."""
    torch.manual_seed(0)
    cfg = _llama(
        max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    )
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    ours = LlamaForCausalLM(cfg, torch.float32)
    ours.load_weights(hf.state_dict().items())
    seq = _prompt(28, seed=7)
    out = hf(torch.tensor([seq[:12]]), use_cache=True)
    ref = [out.logits[0]]
    cache = out.past_key_values
    for tok in seq[12:]:
        out = hf(torch.tensor([[tok]]), cache=cache, use_cache=True)
        cache = out.past_key_values
        ref.append(out.logits[0])
    runner = PagedRunner(ours)
    got = [runner.step([("a", seq[:12])])[0]] + [runner.step([("a", [t])])[0] for t in seq[12:]]
    _close(torch.cat(got), torch.cat(ref))


ROPE_CASES = {k: CONFIGS[k] for k in CONFIGS if k.startswith("llama-rope") or k == "llama"}


@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_rotary_tables_match_hf(name):
    cfg = ROPE_CASES[name]()
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ours = RotaryEmbedding(head_dim, cfg.max_position_embeddings, rope_parameters(cfg))
    pos = torch.arange(cfg.max_position_embeddings)
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), pos[None])
    our_cos, our_sin = ours(pos)
    torch.testing.assert_close(our_cos[:, 0], cos[0], atol=1e-6, rtol=1e-6)
    half = head_dim // 2
    # ours stores sin signed for the roll formulation: cat(-s, s)
    torch.testing.assert_close(our_sin[:, 0, half:], sin[0, :, half:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(-our_sin[:, 0, :half], sin[0, :, :half], atol=1e-6, rtol=1e-6)


def test_rope_parameters_legacy_rope_scaling_and_errors():
    class Legacy:  # a pre-transformers-5 config: rope_theta + rope_scaling with "type"
        rope_theta = 500000.0
        rope_scaling = {"type": "linear", "factor": 4.0}
        max_position_embeddings = 32

    params = rope_parameters(Legacy())
    assert params["rope_type"] == "linear" and params["rope_theta"] == 500000.0 and params["factor"] == 4.0

    class Longrope(Legacy):
        rope_scaling = {"rope_type": "longrope", "factor": 4.0}

    with pytest.raises(ValueError, match="longrope"):
        rope_parameters(Longrope())


# ---------------------------------------------------------------- structure


def test_registry_names_and_errors():
    assert get_model_class("LlamaForCausalLM") is LlamaForCausalLM
    assert get_model_class("mistral") is MistralForCausalLM
    assert get_model_class("qwen2") is Qwen2ForCausalLM
    assert get_model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM
    assert resolve_architecture("llama") == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_get_architecture_from_model_type_and_unsupported():
    cfg = _qwen2()
    cfg.architectures = None
    assert get_architecture(cfg) == "Qwen2ForCausalLM"
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="not supported"):
        get_architecture(cfg)


def test_kv_cache_spec_sliding_window_and_fused_params(tmp_path_factory):
    _, mistral = _load_pair("mistral-sliding", tmp_path_factory)
    assert mistral.kv_cache_spec() == [AttentionSpec(2, 32, 5)] * 3
    assert mistral.sliding_window == 5
    assert all(layer.self_attn.attn.sliding_window == 5 for layer in mistral.model.layers)
    _, qwen = _load_pair("qwen2-sliding-upper-layers", tmp_path_factory)
    assert qwen.sliding_window == 6
    assert [layer.self_attn.attn.sliding_window for layer in qwen.model.layers] == [None, 6, 6]
    assert qwen.model.layers[0].self_attn.qkv_proj.bias is not None
    assert qwen.model.layers[0].self_attn.o_proj.bias is None
    assert qwen.lm_head.weight is qwen.model.embed_tokens.weight  # tied
    _, llama = _load_pair("llama", tmp_path_factory)
    assert llama.sliding_window is None
    assert llama.model.layers[0].self_attn.qkv_proj.weight.shape == ((4 + 2 + 2) * 16, 64)
    assert llama.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    assert not any(p.requires_grad for p in llama.parameters())
    assert not llama.training


def test_load_weights_rejects_unknown_missing_and_misshapen():
    cfg = _llama(num_hidden_layers=1)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = hf.state_dict()
    model = LlamaForCausalLM(cfg, torch.float32)
    with pytest.raises(ValueError, match="no parameter"):
        model.load_weights([*sd.items(), ("model.layers.0.self_attn.foo.weight", torch.zeros(1))])
    partial = {k: v for k, v in sd.items() if "k_proj" not in k}
    with pytest.raises(ValueError, match="missing.*qkv_proj"):
        model.load_weights(partial.items())
    bad = dict(sd)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="up_proj.*shape"):
        model.load_weights(bad.items())


def test_bfloat16_model_runs_close_to_float32(tmp_path_factory):
    hf, ours32 = _load_pair("qwen2-bias", tmp_path_factory)
    ours16 = Qwen2ForCausalLM(hf.config, torch.bfloat16)
    ours16.load_weights(hf.state_dict().items())
    prompt = _prompt(12, seed=8)
    (l16,) = PagedRunner(ours16).step([("a", prompt)])
    (l32,) = PagedRunner(ours32).step([("a", prompt)])
    assert l16.dtype == torch.float32
    assert (l16 - l32).abs().max() < 0.1 * l32.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_matches_hf(dtype):
    from pagedllm.layers.layernorm import RMSNorm

    torch.manual_seed(0)
    x = (torch.randn(7, 96) * 3).to(dtype)
    residual = torch.randn(7, 96).to(dtype)
    hf = transformers.models.llama.modeling_llama.LlamaRMSNorm(96, eps=1e-5).to(dtype)
    ours = RMSNorm(96, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96) * 0.5 + 1)
        ours.weight.copy_(hf.weight)
    # float32: equal up to summation order; 16-bit: HF rounds twice (before and after the weight), we round once
    tol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    torch.testing.assert_close(ours(x), hf(x), atol=tol * 8, rtol=tol)
    normed, new_residual = ours(x, residual)
    assert torch.equal(new_residual, x + residual)
    torch.testing.assert_close(normed, hf(x + residual), atol=tol * 8, rtol=tol)
