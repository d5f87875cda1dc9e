"""Model configs and weights from Hugging Face folders (safetensors) and GGUF files."""

from pagedllm.model_loader.hf_config import get_architecture, load_hf_config
from pagedllm.model_loader.loader import load_model

__all__ = ["get_architecture", "load_hf_config", "load_model"]
