"""Loading configs and weights: GGUF (synthetic files written with gguf.GGUFWriter, and the real SmolLM2) and
sharded safetensors folders, checked against transformers.

Tolerances: weights must be *equal* (same dequantization arithmetic); logits within ``ATOL``/``RTOL`` (float32 on both
sides) for tiny models, ``REAL_ATOL`` for SmolLM2 (30 layers, logits up to ~36).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM

from pagedllm.attention.torch_attn import build_attention_metadata
from pagedllm.config import ModelConfig
from pagedllm.model_loader import get_architecture, load_hf_config, load_model
from pagedllm.model_loader.gguf_loader import (
    gguf_to_hf_name,
    iterate_gguf_weights,
    read_gguf_header,
    unpermute_qk,
)
from pagedllm.model_loader.safetensors_loader import iterate_safetensors_weights, weight_files
from pagedllm.model_files import default_model_path
from pagedllm.worker.model_runner import allocate_kv_caches

ATOL = 1e-4
RTOL = 1e-4
REAL_ATOL = 5e-4  # measured max |diff| 4.6e-5 on logits up to 36
REAL_RTOL = 1e-4
VOCAB = 256


def _model_config(path: str, dtype=torch.float32) -> ModelConfig:
    cfg = load_hf_config(path)
    return ModelConfig(
        model=path,
        tokenizer=path,
        served_model_name="test",
        dtype=dtype,
        max_model_len=cfg.max_position_embeddings,
        hf_config=cfg,
        architecture=get_architecture(cfg),
        vocab_size=cfg.vocab_size,
        is_gguf=path.endswith(".gguf"),
    )


@torch.inference_mode()
def _prefill_logits(model, tokens: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits of every prompt position from one prefill through a fresh paged cache (blocks 1..n)."""
    n = len(tokens)
    num_blocks = (n + block_size - 1) // block_size
    dtype = next(model.parameters()).dtype
    kv = allocate_kv_caches(model.kv_cache_spec(), num_blocks + 1, block_size, dtype)
    block_table = torch.arange(1, num_blocks + 1, dtype=torch.int32)[None]
    slots = torch.arange(block_size, block_size + n, dtype=torch.int64)
    meta = build_attention_metadata([n], [n], block_table, slots, block_size, sliding_window=model.sliding_window)
    hidden = model(torch.tensor(tokens), torch.arange(n), kv, meta)
    return model.compute_logits(hidden).float()


def _randomize_norms(hf) -> None:
    """HF initialises every RMSNorm weight to 1, which would hide swapped or missing norms."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def _split_fused(model) -> dict[str, torch.Tensor]:
    """Our state dict under HF names: fused qkv / gate_up rows split back into q/k/v and gate/up."""
    out = {}
    for name, p in model.named_parameters():
        sizes = model._shard_sizes.get(name)
        if sizes is None:
            out[name] = p.data
            continue
        shards = p.data.split(list(sizes))
        shard_names = ("q_proj", "k_proj", "v_proj") if "qkv_proj" in name else ("gate_proj", "up_proj")
        fused = "qkv_proj" if "qkv_proj" in name else "gate_up_proj"
        for shard_name, t in zip(shard_names, shards):
            out[name.replace(fused, shard_name)] = t
    return out


# ---------------------------------------------------------------- GGUF names and the Q/K permutation


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp's convert script: reshape(n_head, 2, rows / n_head / 2, *rest).swapaxes(1, 2)
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def test_unpermute_qk_inverts_llama_cpp_permutation():
    w = torch.randn(4 * 8, 5)
    assert torch.equal(unpermute_qk(_llama_cpp_permute(w, 4), 4), w)
    b = torch.randn(2 * 8)
    assert torch.equal(unpermute_qk(_llama_cpp_permute(b, 2), 2), b)
    assert not torch.equal(_llama_cpp_permute(w, 4), w)


def test_gguf_to_hf_names():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_v.bias") == "model.layers.0.self_attn.v_proj.bias"
    assert gguf_to_hf_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert gguf_to_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.3.attn_norm.weight") == "model.layers.3.input_layernorm.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    assert gguf_to_hf_name("blk.3.attn_q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert gguf_to_hf_name("blk.3.ssm_conv1d.weight") is None


# ---------------------------------------------------------------- synthetic GGUF files

# Quant type per HF weight kind, as llama.cpp mixes them.
_QTYPES = {
    "embed_tokens": GGMLQuantizationType.Q8_0,
    "q_proj": GGMLQuantizationType.Q4_1,
    "k_proj": GGMLQuantizationType.Q4_0,
    "v_proj": GGMLQuantizationType.Q5_0,
    "o_proj": GGMLQuantizationType.Q5_1,
    "gate_proj": GGMLQuantizationType.Q8_0,
    "up_proj": GGMLQuantizationType.F16,
    "down_proj": GGMLQuantizationType.BF16,
    "lm_head": GGMLQuantizationType.Q6_K,  # gguf can't quantize K-quants: random blocks, see _random_q6_k
}
_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    _, _, layer, *rest = hf_name.split(".")  # model.layers.N.self_attn.q_proj.weight
    module, suffix = ".".join(rest[:-1]), rest[-1]
    if module in _HF_TO_GGUF:
        return f"blk.{layer}.{_HF_TO_GGUF[module]}.{suffix}"
    return f"blk.{layer}.{_HF_TO_GGUF['.'.join(rest)]}"


def _random_q6_k(shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Random Q6_K blocks (210 bytes: ql[128], qh[64], int8 scales[16], f16 d) with a small finite d."""
    rng = np.random.default_rng(seed)
    n_blocks = shape[0] * shape[1] // 256
    blocks = rng.integers(0, 256, size=(n_blocks, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.full((n_blocks, 1), 2e-4, dtype=np.float16).view(np.uint8)
    return blocks.reshape(shape[0], shape[1] // 256 * 210)


def _write_gguf(path: str, arch: str, cfg, state: dict[str, torch.Tensor], extra_kv: dict | None = None) -> dict:
    """Writes ``state`` (HF names) as a GGUF like llama.cpp would; returns the dequantized tensors a correct loader
    must produce, under HF names."""
    w = GGUFWriter(path, arch)
    w.add_string("general.name", f"tiny {arch}")
    w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    w.add_uint32(f"{arch}.attention.key_length", head_dim)
    w.add_uint32(f"{arch}.attention.value_length", head_dim)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)])
    for k, v in (extra_kv or {}).items():
        (w.add_string if isinstance(v, str) else w.add_float32)(k, v)
    expected = {}
    for hf_name, t in state.items():
        kind = next((k for k in _QTYPES if f"{k}." in hf_name), None)
        qtype = _QTYPES[kind] if kind and hf_name.endswith("weight") else GGMLQuantizationType.F32
        data = t.float().numpy()
        if arch == "llama" and ("q_proj" in hf_name or "k_proj" in hf_name):
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            data = _llama_cpp_permute(t.float(), heads).numpy()
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(_gguf_name(hf_name), data)
            expected[hf_name] = t.float()
        else:
            q = _random_q6_k(data.shape) if qtype == GGMLQuantizationType.Q6_K else quantize(data, qtype)
            w.add_tensor(_gguf_name(hf_name), q, raw_shape=q.shape, raw_dtype=qtype)
            deq = torch.from_numpy(dequantize(q, qtype).reshape(t.shape).copy())
            if arch == "llama" and ("q_proj" in hf_name or "k_proj" in hf_name):
                deq = unpermute_qk(deq, cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads)
            expected[hf_name] = deq
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _tiny_llama_cfg(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.05,
        tie_word_embeddings=False,
    )  # hidden 256: K-quants need rows of 256
    base.update(kw)
    return transformers.LlamaConfig(**base)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_synthetic_gguf_weights_config_and_logits(arch, tmp_path):
    torch.manual_seed(0)
    if arch == "llama":
        cfg = _tiny_llama_cfg()
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=128, max_position_embeddings=128, rms_norm_eps=1e-6,
            initializer_range=0.05, tie_word_embeddings=False,
        )
    else:
        cfg = transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.05,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    _randomize_norms(hf)
    state = {k: v for k, v in hf.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    path = str(tmp_path / f"tiny-{arch}.gguf")
    expected = _write_gguf(path, arch, cfg, state)

    ours_cfg = load_hf_config(path)
    assert type(ours_cfg) is type(cfg)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(ours_cfg, field) == getattr(cfg, field), field
    assert ours_cfg.head_dim == (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    assert ours_cfg.rms_norm_eps == cfg.rms_norm_eps  # float32 in the file, shortest decimal back
    assert ours_cfg.rope_parameters["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert get_architecture(ours_cfg) == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                          "qwen3": "Qwen3ForCausalLM"}[arch]

    got = dict(iterate_gguf_weights(path, torch.float32))
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), name

    model = load_model(_model_config(path))
    hf.load_state_dict({**expected, **({"lm_head.weight": expected["model.embed_tokens.weight"]}
                                       if cfg.tie_word_embeddings else {})})
    tokens = torch.randint(0, VOCAB, (21,)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_prefill_logits(model, tokens, block_size=4), ref, atol=ATOL, rtol=RTOL)


def test_gguf_rope_scaling_and_sliding_window_metadata(tmp_path):
    cfg = _tiny_llama_cfg(num_hidden_layers=1)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = str(tmp_path / "scaled.gguf")
    _write_gguf(path, "llama", cfg, hf.state_dict(), extra_kv={
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0,
        "llama.attention.sliding_window": 0.0,
    })
    ours = load_hf_config(path)
    assert ours.rope_parameters["rope_type"] == "linear" and ours.rope_parameters["factor"] == 2.0
    assert ours.head_dim == 64 and not ours.attention_bias


def test_gguf_header_reader_matches_gguf_reader(tmp_path):
    from gguf import GGUFReader

    cfg = _tiny_llama_cfg(num_hidden_layers=1)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = str(tmp_path / "h.gguf")
    _write_gguf(path, "llama", cfg, hf.state_dict())
    ours = read_gguf_header(path)
    reader = GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # the reader adds GGUF.version ...
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        assert ours.metadata[key] == field.contents(), key
    assert ours.metadata["llama.block_count"] == 1
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert info.ggml_type == t.tensor_type
        assert info.offset == t.data_offset
        assert info.nbytes == t.n_bytes


def test_gguf_rejects_bad_files(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_header(str(bad))
    with pytest.raises(FileNotFoundError):
        load_hf_config(str(tmp_path / "missing"))


# ---------------------------------------------------------------- safetensors folders


def test_sharded_safetensors_folder_with_stray_file(tmp_path):
    torch.manual_seed(1)
    cfg = _tiny_llama_cfg(hidden_size=64, intermediate_size=128)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    files = weight_files(str(tmp_path))
    assert len(files) > 1
    # a file the index doesn't list (Mistral repos ship consolidated.safetensors next to the HF shards)
    from safetensors.torch import save_file

    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, str(tmp_path / "consolidated.safetensors"))
    assert weight_files(str(tmp_path)) == files
    names = {n for n, _ in iterate_safetensors_weights(str(tmp_path))}
    assert names == set(hf.state_dict())
    model = load_model(_model_config(str(tmp_path)))
    tokens = list(range(3, 40, 3))
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_prefill_logits(model, tokens), ref, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------- the real SmolLM2-135M-Instruct Q4_1 GGUF


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_path()
    t0 = time.perf_counter()
    ours = load_model(_model_config(path))
    load_s = time.perf_counter() - t0
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    return path, ours, hf, load_s


@pytest.mark.slow
def test_smollm2_weights_equal_transformers(smollm2):
    path, ours, hf, load_s = smollm2
    print(f"SmolLM2 load_model (float32): {load_s:.2f} s")
    mine = _split_fused(ours)
    ref = hf.state_dict()
    assert set(mine) == set(ref) - {"lm_head.weight"}  # tied: lm_head is the embedding
    for name, t in ref.items():
        ours_t = mine["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert ours_t.dtype == t.dtype == torch.float32
        assert torch.equal(ours_t, t), name


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2):
    path = smollm2[0]
    ours = load_hf_config(path)
    ref = transformers.AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                  "bos_token_id", "eos_token_id", "pad_token_id", "model_type"):
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.rope_parameters == ref.rope_parameters == {"rope_theta": 100000.0, "rope_type": "default"}
    assert ours.rms_norm_eps == 1e-5 and abs(ref.rms_norm_eps - 1e-5) < 1e-12  # HF keeps the float32 value
    assert get_architecture(ours) == "LlamaForCausalLM"


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    _, ours, hf, _ = smollm2
    tokens = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]  # arbitrary ids
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    got = _prefill_logits(ours, tokens)
    torch.testing.assert_close(got, ref, atol=REAL_ATOL, rtol=REAL_RTOL)
    assert torch.equal(got[-1].argmax(), ref[-1].argmax())


@torch.inference_mode()
def _greedy(model, prompt: list[int], max_new_tokens: int, block_size: int = 4) -> list[int]:
    """Prefill, then decode one token per step through the paged cache (blocks 1..n in order)."""
    total = len(prompt) + max_new_tokens
    num_blocks = (total + block_size - 1) // block_size
    kv = allocate_kv_caches(model.kv_cache_spec(), num_blocks + 1, block_size, torch.float32)
    block_table = torch.arange(1, num_blocks + 1, dtype=torch.int32)[None]
    out: list[int] = []
    tokens, start = list(prompt), 0
    while len(out) < max_new_tokens:
        end = start + len(tokens)
        slots = torch.arange(start, end, dtype=torch.int64) + block_size
        meta = build_attention_metadata([len(tokens)], [end], block_table, slots, block_size)
        hidden = model(torch.tensor(tokens), torch.arange(start, end), kv, meta)
        out.append(int(model.compute_logits(hidden[-1:]).argmax()))
        tokens, start = [out[-1]], end
    return out


@pytest.mark.slow
def test_smollm2_greedy_decode_matches_transformers(smollm2):
    _, ours, hf, _ = smollm2
    prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert _greedy(ours, prompt, 6) == ref


@pytest.mark.slow
def test_loading_a_model_does_not_import_torch_dynamo():
    """Building the model skeleton must not pull in torch._dynamo (and through it triton): ~0.9 s of start-up, and
    triton's nanobind printed "leaked" warnings at every server exit. ``torch.nn.utils.skip_init(nn.Embedding)`` did
    (its meta-device ``normal_`` goes through ``torch._refs``); checked in a fresh interpreter for the bundled model
    and for Gemma 3 and DeepSeek skeletons, which build their embeddings the same way."""
    import subprocess
    import sys

    code = (
        "import sys, torch, transformers\n"
        "from pagedllm.entrypoints.llm import LLM\n"
        "from pagedllm.sampling_params import SamplingParams\n"
        "from pagedllm.models.utils import skip_init_embedding\n"
        "e = skip_init_embedding(1000, 64, torch.bfloat16)\n"
        "assert e.weight.shape == (1000, 64) and e.weight.dtype == torch.bfloat16\n"
        "llm = LLM(None, dtype='bfloat16', max_model_len=256)\n"
        "out = llm.generate(['Hello'], SamplingParams(max_tokens=2, temperature=0))\n"
        "assert len(out[0].outputs[0].token_ids) == 2\n"
        "from pagedllm.models.gemma3 import Gemma3ForCausalLM\n"
        "from pagedllm.models.deepseek import DeepseekV2ForCausalLM\n"
        "g = transformers.Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128,"
        " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32)\n"
        "Gemma3ForCausalLM(g, torch.bfloat16)\n"
        "d = transformers.DeepseekV2Config(vocab_size=512, hidden_size=64, intermediate_size=128,"
        " moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,"
        " n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,"
        " qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1)\n"
        "DeepseekV2ForCausalLM(d, torch.bfloat16)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'triton')))[:5])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
