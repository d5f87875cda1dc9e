"""Building a model from a ``ModelConfig``: pick the class, construct it in the model dtype, load the weights."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from pagedllm.model_loader.gguf_loader import iterate_gguf_weights
from pagedllm.model_loader.hf_config import is_gguf_file
from pagedllm.model_loader.safetensors_loader import iterate_safetensors_weights
from pagedllm.models.registry import get_model_class


def iterate_weights(path: str, dtype: torch.dtype, keep_quantized: bool = False,
                    skip: Optional[Callable[[str], bool]] = None) -> Iterator[tuple[str, Any]]:
    """``(hf_name, tensor)`` pairs from a GGUF file (dequantized to ``dtype``, or quantized ones as ``GGUFWeight``
    with ``keep_quantized``) or an HF folder (checkpoint dtype), without the ones ``skip(hf_name)`` is true for (not
    even read)."""
    if is_gguf_file(path):
        return iterate_gguf_weights(path, dtype, keep_quantized, skip)
    return iterate_safetensors_weights(path, skip)


def load_model(model_config: Any) -> nn.Module:
    """The model of ``model_config`` (a ``pagedllm.config.ModelConfig``), weights loaded, in eval mode, no grads.

    Raises:
        ValueError: for an unsupported architecture or weights that don't fit the model.
    """
    cls = get_model_class(model_config.architecture)
    qc = getattr(model_config, "quantization", None)
    kwargs = {"quant_config": qc} if qc is not None else {}
    model = cls(model_config.hf_config, model_config.dtype, max_model_len=model_config.max_model_len, **kwargs)
    keep_quantized = qc is not None and qc.method == "gguf"
    # A pipeline stage skips the other stages' tensors (LlamaForCausalLM.skips_weight).
    model.load_weights(iterate_weights(model_config.model, model_config.dtype, keep_quantized,
                                       getattr(model, "skips_weight", None)))
    model.eval()
    model.requires_grad_(False)
    return model
