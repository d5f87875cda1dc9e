"""Model implementations (plain ``nn.Module``s over flattened tokens) and the architecture registry."""

from pagedllm.models.registry import get_model_class, resolve_architecture, supported_architectures

__all__ = ["get_model_class", "resolve_architecture", "supported_architectures"]
