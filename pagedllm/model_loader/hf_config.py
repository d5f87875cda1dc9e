"""The model's ``transformers`` config, from an HF folder (config.json) or from GGUF metadata.

GGUF metadata is mapped here directly (the same keys transformers' GGUF support reads, from our fast header
parser) rather than through ``AutoConfig.from_pretrained(dir, gguf_file=...)``, which parses the whole vocabulary
with ``gguf.GGUFReader`` (~4.5 s for SmolLM2). Differences from transformers' mapping, on purpose:

- float metadata is stored as float32; we take the shortest decimal that round-trips it (``rms_norm_eps`` 1e-05
  as in the original config.json, not 9.999999747378752e-06);
- ``{arch}.rope.scaling.*`` (linear / yarn) and ``{arch}.attention.sliding_window`` are honoured (transformers
  drops them for llama/qwen2);
- ``vocab_size`` is the embedding's row count.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pagedllm.model_loader.gguf_loader import GGUFHeader, read_gguf_header
from pagedllm.models.registry import resolve_architecture


def _f32(x: float) -> float:
    """The shortest decimal that round-trips a float32 (GGUF stores 1e-5 as 9.99999974738e-06)."""
    return float(str(np.float32(x)))


def is_gguf_file(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def gguf_to_hf_config(header: GGUFHeader) -> Any:
    """A ``transformers`` config (Llama/Mistral/Qwen2/Qwen3Config) from GGUF metadata.

    Raises:
        ValueError: for an unsupported architecture or unsupported rope scaling.
    """
    from transformers import AutoConfig

    md = header.metadata
    arch = header.architecture
    name = str(md.get("general.name", ""))
    model_type = arch
    if arch == "llama" and "mistral" in name.lower():
        model_type = "mistral"  # llama.cpp converts Mistral as "llama"; transformers renames it the same way
    architecture = resolve_architecture(model_type)  # raises for unsupported ones
    key = header.arch_key

    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise ValueError(f"per-layer KV head counts {kv_heads} are not supported")
        kv_heads = kv_heads[0]
    hidden = int(key("embedding_length"))
    embd = header.tensors.get("token_embd.weight")
    if embd is not None:
        vocab_size = embd.shape[0]
    else:
        vocab_size = key("vocab_size") or len(md["tokenizer.ggml.tokens"])
    kw: dict[str, Any] = dict(
        architectures=[architecture],
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        max_position_embeddings=int(key("context_length", 2048)),
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in header.tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=md.get("tokenizer.ggml.padding_token_id"),
    )
    if name:
        kw["_name_or_path"] = name
    if md.get("tokenizer.ggml.unknown_token_id") is not None:
        kw["unk_token_id"] = md["tokenizer.ggml.unknown_token_id"]

    head_dim = key("attention.key_length")
    if head_dim is None and model_type in ("llama", "mistral"):
        head_dim = key("rope.dimension_count")
    kw["head_dim"] = int(head_dim) if head_dim is not None else hidden // heads  # Qwen3Config defaults to 128

    if "rope_freqs.weight" in header.tensors:
        raise ValueError("GGUF rope_freqs.weight (llama3-style rope scaling stored as a tensor) is not supported")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(key("rope.freq_base", 10000.0))}
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported")
        rope["rope_type"] = scaling
        rope["factor"] = _f32(key("rope.scaling.factor"))
        orig = key("rope.scaling.original_context_length")
        if orig is not None:
            rope["original_max_position_embeddings"] = int(orig)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if key(f"rope.scaling.{gguf_key}") is not None:
                rope[hf_key] = _f32(key(f"rope.scaling.{gguf_key}"))
    kw["rope_parameters"] = rope

    window = key("attention.sliding_window")
    if model_type == "llama":
        kw["attention_bias"] = "blk.0.attn_q.bias" in header.tensors
        kw["mlp_bias"] = "blk.0.ffn_up.bias" in header.tensors
    elif model_type == "mistral":
        kw["sliding_window"] = int(window) if window else None  # llama.cpp attends fully unless stated
    elif model_type in ("qwen2", "qwen3"):
        if model_type == "qwen3":
            kw["attention_bias"] = "blk.0.attn_q.bias" in header.tensors
        kw["use_sliding_window"] = bool(window)
        kw["sliding_window"] = int(window) if window else None
    elif model_type == "gemma3":
        # The text model. Not in the metadata (transformers uses the same defaults): the layer pattern (every 6th
        # layer global), the local rope base (10k), query_pre_attn_scalar (256). freq_base and any rope scaling
        # are the global layers'.
        model_type = "gemma3_text"
        kw["sliding_window"] = int(window) if window else None
        kw["rope_parameters"] = {"full_attention": rope, "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 10000.0}}
    return AutoConfig.for_model(model_type, **kw)


def load_hf_config(path: str) -> Any:
    """``transformers.PretrainedConfig`` for a GGUF file or a Hugging Face model folder (config.json).

    Raises:
        FileNotFoundError: if ``path`` is neither.
        ValueError: for an unsupported GGUF architecture or rope scaling.
    """
    path = os.path.expanduser(path)
    if is_gguf_file(path):
        return gguf_to_hf_config(read_gguf_header(path))
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path, local_files_only=True)
    raise FileNotFoundError(f"{path!r} is neither a GGUF file nor a folder with config.json")


def get_architecture(hf_config: Any) -> str:
    """The supported HF architecture name (e.g. "LlamaForCausalLM") from ``architectures`` or ``model_type``.

    Raises:
        ValueError: listing the supported architectures, if none matches.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        try:
            return resolve_architecture(arch)
        except ValueError:
            pass
    return resolve_architecture(archs[0] if archs else getattr(hf_config, "model_type", "<unknown>"))
