"""Which module runs which architecture.

Keys are Hugging Face ``architectures`` names; GGUF ``general.architecture`` values and HF ``model_type`` values
resolve to them. Model modules are imported on first use.
"""

from __future__ import annotations

import importlib

# HF architecture name -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pagedllm.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("pagedllm.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("pagedllm.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("pagedllm.models.llama", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("pagedllm.models.gemma3", "Gemma3ForCausalLM"),
    "DeepseekV2ForCausalLM": ("pagedllm.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("pagedllm.models.deepseek", "DeepseekV3ForCausalLM"),
}

# GGUF general.architecture / HF model_type -> HF architecture name
_ALIASES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(name: str) -> str:
    """Maps an HF architecture name, GGUF architecture or model_type to a supported HF architecture name.

    Raises:
        ValueError: listing the supported ones, if ``name`` is unknown.
    """
    if name in _MODELS:
        return name
    if name in _ALIASES:
        return _ALIASES[name]
    raise ValueError(
        f"Model architecture {name!r} is not supported. Supported: {', '.join(supported_architectures())} "
        f"(GGUF / model_type: {', '.join(sorted(_ALIASES))})."
    )


def get_model_class(architecture: str) -> type:
    """The ``nn.Module`` class for ``architecture`` (see ``resolve_architecture``).

    Raises:
        ValueError: listing the supported architectures, if ``architecture`` is unknown.
    """
    module_name, class_name = _MODELS[resolve_architecture(architecture)]
    return getattr(importlib.import_module(module_name), class_name)
