"""Quantized weights executed quantized: ``--quantization {auto,none,gguf,gptq,awq,int8}``.

- ``gguf``: a GGUF file's quantized tensors stay quantized (see ``gguf.py`` for which type runs on which kernel).
- ``gptq`` / ``awq``: 4-bit safetensors checkpoints (``quantization_config`` in config.json).
- ``int8``: weight-only per-row int8 of a float checkpoint (or of a GGUF file's dequantized tensors).
- ``none``: dense in ``--dtype`` (a GGUF file is dequantized at load, as before).
``auto`` (the default) detects the scheme from the checkpoint. Quantized: the Llama family's linears and its
token embedding / lm_head (GGUF, int8); other model classes load dense.

The model seam: ``quantize_model`` swaps the model's ``nn.Linear`` / ``nn.Embedding`` modules (empty, made with
``skip_init``) for ``QuantLinear`` / ``QuantEmbedding`` before loading; the model's ``load_weights`` hands them
their tensors with ``load_quantized`` and calls ``finish_quantized_loading`` at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from pagedllm.layers.quantization.linear import QuantEmbedding, QuantLinear

QUANTIZATION_METHODS = ("auto", "none", "gguf", "gptq", "awq", "int8")
QUANTIZED_TENSOR_NAMES = ("weight", "qweight", "qzeros", "scales", "g_idx")

__all__ = [
    "QUANTIZATION_METHODS",
    "QuantConfig",
    "QuantEmbedding",
    "QuantLinear",
    "finish_quantized_loading",
    "load_quantized",
    "quantize_model",
    "resolve_quant_config",
]


@dataclass(frozen=True)
class QuantConfig:
    method: str  # gguf | gptq | awq | int8
    group_size: int = 0  # gptq / awq: inputs per scale group (-1 or 0: one group per row)
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"  # gptq: zero points stored minus one; gptq_v2: as is


def _checkpoint_quant_config(model: str, hf_config: Any) -> Optional[QuantConfig]:
    """The scheme the checkpoint is stored in (None: unquantized).

    Raises:
        ValueError: naming ``quantization_config.<field>`` for an unsupported scheme or setting.
    """
    from pagedllm.model_loader.hf_config import is_gguf_file

    if is_gguf_file(model):
        from pagedllm.layers.quantization.gguf import UNQUANTIZED_TYPES
        from pagedllm.model_loader.gguf_loader import read_gguf_header

        types = {t.ggml_type for t in read_gguf_header(model).tensors.values()}
        return QuantConfig("gguf") if types - UNQUANTIZED_TYPES else None
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (gptq, awq)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config.bits must be 4 for {method}, got {bits!r}")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version {version!r} is not supported (AWQ gemm only)")
        if not qc.get("zero_point", True):
            raise ValueError("quantization_config.zero_point=False is not supported for AWQ")
        return QuantConfig("awq", group_size=group_size, sym=False)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    return QuantConfig("gptq", group_size=group_size, desc_act=bool(qc.get("desc_act", False)),
                       sym=bool(qc.get("sym", True)), checkpoint_format=fmt)


def resolve_quant_config(requested: Optional[str], model: str, hf_config: Any, model_cls: Any,
                         tensor_parallel_size: int = 1) -> Optional[QuantConfig]:
    """The quantization to run with, from ``--quantization`` (None = auto) and the checkpoint.

    ``tensor_parallel_size`` is the number of ranks (tensor x pipeline): quantized layers run in one process only,
    so with several ranks ``auto`` runs a GGUF dequantized.

    Raises:
        ValueError: naming ``quantization`` for an unknown value, a mismatch with the checkpoint, a model class
            that can't run quantized, or tensor/pipeline parallelism.
    """
    req = "auto" if requested is None else str(requested).lower()
    if req not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {requested!r}.")
    stored = _checkpoint_quant_config(model, hf_config)
    supported = bool(getattr(model_cls, "supports_quantization", False))
    if req == "auto":
        if stored is None or (stored.method == "gguf" and (not supported or tensor_parallel_size > 1)):
            return None  # a GGUF file can always be dequantized instead
        qc = stored
    elif req == "none":
        if stored is not None and stored.method != "gguf":
            raise ValueError(f"quantization='none': the checkpoint is {stored.method}-quantized and can only run "
                             f"quantized")
        return None
    elif req == "int8":
        if stored is not None and stored.method != "gguf":
            raise ValueError(f"quantization='int8' does not match the checkpoint ({stored.method})")
        qc = QuantConfig("int8")
    else:
        found = stored.method if stored else "unquantized"
        if stored is None or stored.method != req:
            raise ValueError(f"quantization={req!r} does not match the checkpoint ({found})")
        qc = stored
    if not supported:
        raise ValueError(f"quantization={qc.method!r} is not supported for {getattr(model_cls, '__name__', model_cls)}")
    if tensor_parallel_size > 1:
        raise ValueError("quantization together with tensor_parallel_size or pipeline_parallel_size > 1 is not "
                         "supported (use quantization='none' to run the model dequantized)")
    return qc


# Modules quantized in a Llama-family model (by attribute name); lm_head only when not tied.
QUANTIZED_LINEAR_NAMES = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"})


def quantize_model(model: nn.Module, quant_config: QuantConfig) -> dict[str, nn.Module]:
    """Replaces the linears named in ``QUANTIZED_LINEAR_NAMES`` (and, for gguf / int8, ``embed_tokens``, which a
    tied ``lm_head`` shares) by their quantized placeholders. GPTQ / AWQ checkpoints keep embeddings and lm_head
    dense (they store them unquantized). Returns ``{module name: quantized module}``."""
    quant_embedding = quant_config.method in ("gguf", "int8")
    replaced: dict[int, nn.Module] = {}
    parents = [m for _, m in model.named_modules(remove_duplicate=False)]
    for parent in parents:
        for name, child in parent.named_children():
            if id(child) in replaced:
                continue
            if isinstance(child, nn.Linear) and name in QUANTIZED_LINEAR_NAMES:
                if name == "lm_head" and quant_config.method in ("gptq", "awq"):
                    continue
                sizes = getattr(child, "output_sizes", None)
                replaced[id(child)] = QuantLinear(child.in_features, child.out_features, child.bias is not None,
                                                  child.weight.dtype, quant_config, sizes)
                replaced[id(child)].silu_gated = getattr(child, "silu_gated", False)  # rows [gate; up] (SwiGLU)
            elif isinstance(child, nn.Embedding) and name == "embed_tokens" and quant_embedding:
                replaced[id(child)] = QuantEmbedding(child.num_embeddings, child.embedding_dim, child.weight.dtype,
                                                     quant_config)
    for parent in parents:  # a tied lm_head is the embedding module under a second name
        for name, child in list(parent.named_children()):
            if id(child) in replaced:
                setattr(parent, name, replaced[id(child)])
    return {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}


def load_quantized(modules: dict[str, nn.Module], name: str, shard_id: Optional[int], tensor: Any) -> bool:
    """Hands ``tensor`` (checkpoint name mapped onto the model, e.g. ``…qkv_proj.qweight``) to its quantized module;
    False if ``name`` is not a quantized module's weight (then it is an ordinary parameter, e.g. a bias)."""
    module_name, _, leaf = name.rpartition(".")
    mod = modules.get(module_name)
    if mod is None or leaf not in QUANTIZED_TENSOR_NAMES:
        return False
    mod.load_shard(shard_id or 0, leaf, tensor)
    return True


def finish_quantized_loading(modules: dict[str, nn.Module]) -> None:
    """Each quantized module's ``process_weights_after_loading`` once; the K-quant tiles they make share one
    ``weight_arena`` (huge pages, see ``pagedllm.utils.hugepages``), or come from the load's cache file
    (``tile_cache``)."""
    from pagedllm import kernels
    from pagedllm.layers.quantization import tile_cache
    from pagedllm.utils.hugepages import weight_arena

    cfg = kernels.config()
    seen: set[int] = set()
    with weight_arena(), tile_cache.session(cfg.kquant_tile_cache, cfg.weight_hugepages):
        for mod in modules.values():
            if id(mod) not in seen:
                seen.add(id(mod))
                mod.process_weights_after_loading()
