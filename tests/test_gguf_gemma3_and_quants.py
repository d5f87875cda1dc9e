"""GGUF: every quant type the issue names dequantizes exactly like ``gguf.quants.dequantize`` (what transformers
uses), and a synthetic Gemma 3 GGUF (llama.cpp's names, norm weights stored + 1, no layer pattern in the metadata)
loads into the same config and weights as transformers' own GGUF loader gives, with the same logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM

from pagedllm.model_loader import get_architecture, load_hf_config, load_model
from pagedllm.model_loader.gguf_loader import GGUFTensorInfo, _to_torch, gguf_to_hf_name, iterate_gguf_weights
from test_loader import _model_config, _prefill_logits

Q = GGMLQuantizationType
SIMPLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
# byte offsets of the f16 scale fields in a K-quant block (random bytes there could be inf/nan)
K_QUANTS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _blocks(qtype, shape: tuple[int, int], seed: int) -> np.ndarray:
    """Raw bytes ``[rows, row_bytes]`` of a ``shape`` tensor: real quantization for the simple types (gguf can't
    quantize K-quants), random blocks with small finite scales for K-quants."""
    rng = np.random.default_rng(seed)
    if qtype in SIMPLE:
        return quantize((rng.standard_normal(shape) * 2).astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    n = shape[0] * shape[1] // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in K_QUANTS[qtype]:
        raw[:, off : off + 2] = rng.uniform(1e-4, 3e-3, size=(n, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(shape[0], -1)


@pytest.mark.parametrize("qtype", SIMPLE + list(K_QUANTS), ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_gguf(qtype, dtype):
    shape = (6, 512)  # K-quant super-blocks are 256 wide
    raw = _blocks(qtype, shape, seed=int(qtype))
    info = GGUFTensorInfo("t", shape, qtype, 0, raw.nbytes)
    got = _to_torch(raw.reshape(-1), info, dtype)
    ref = torch.from_numpy(dequantize(raw, qtype).astype(np.float32)).reshape(shape)
    assert got.shape == shape and got.dtype == dtype
    assert torch.equal(got, ref.to(dtype))
    assert ref.abs().max() > 0


# ---------------------------------------------------------------- a synthetic Gemma 3 GGUF

_GEMMA_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gemma_gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, *rest = hf_name.split(".")
    return f"blk.{layer}.{_GEMMA_GGUF_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


def test_gguf_names_for_gemma3():
    assert gguf_to_hf_name("blk.2.ffn_norm.weight", "gemma3") == "model.layers.2.pre_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.2.post_attention_norm.weight", "gemma3") == \
        "model.layers.2.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.2.post_ffw_norm.weight", "gemma3") == "model.layers.2.post_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"  # llama


def test_synthetic_gemma3_gguf_matches_transformers_gguf_loader(tmp_path):
    torch.manual_seed(0)
    vocab = 256
    cfg = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=128, sliding_window=8, rms_norm_eps=1e-6,
        query_pre_attn_scalar=256, initializer_range=0.05,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    )
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = str(tmp_path / "tiny-gemma3.gguf")
    w = GGUFWriter(path, "gemma3")
    w.add_string("general.name", "tiny gemma3")
    for key, value in (("context_length", 128), ("embedding_length", 256), ("block_count", 6),
                       ("feed_forward_length", 512), ("attention.head_count", 4), ("attention.head_count_kv", 1),
                       ("attention.key_length", 64), ("attention.value_length", 64),
                       ("attention.sliding_window", 8)):
        w.add_uint32(f"gemma3.{key}", value)
    w.add_float32("gemma3.rope.freq_base", 1000000.0)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32("tokenizer.ggml.bos_token_id", 2)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    expected = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        if "norm" in name:
            t = t.float() + torch.empty_like(t).uniform_(-0.5, 0.5)  # non-trivial zero-centred weights
            w.add_tensor(_gemma_gguf_name(name), (t + 1).numpy())  # llama.cpp stores 1 + w
            expected[name] = (t + 1) - 1
        else:
            q = quantize(t.float().numpy(), Q.Q8_0)
            w.add_tensor(_gemma_gguf_name(name), q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
            expected[name] = torch.from_numpy(dequantize(q, Q.Q8_0)).reshape(t.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours_cfg = load_hf_config(path)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny-gemma3.gguf", dtype=torch.float32).eval()
    assert get_architecture(ours_cfg) == "Gemma3ForCausalLM" and ours_cfg.model_type == ref.config.model_type
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "sliding_window", "layer_types", "query_pre_attn_scalar",
                  "tie_word_embeddings", "final_logit_softcapping", "hidden_activation", "bos_token_id",
                  "eos_token_id"):
        assert getattr(ours_cfg, field) == getattr(ref.config, field), field
    assert ours_cfg.rope_parameters == ref.config.rope_parameters
    assert abs(ours_cfg.rms_norm_eps - ref.config.rms_norm_eps) < 1e-12

    got = dict(iterate_gguf_weights(path, torch.float32))
    ref_state = ref.state_dict()
    assert set(got) == set(expected) == set(ref_state) - {"lm_head.weight"}
    for name, t in got.items():
        assert torch.equal(t, ref_state[name]), name  # same dequantization and the same "- 1" as transformers

    model = load_model(_model_config(path))
    tokens = torch.randint(0, vocab, (21,)).tolist()  # longer than the window (8)
    with torch.inference_mode():
        ref_logits = ref(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_prefill_logits(model, tokens, block_size=4), ref_logits, atol=1e-4, rtol=1e-4)
