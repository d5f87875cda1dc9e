"""pagedllm: a paged-KV-cache LLM inference and serving engine with vLLM's public names."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs", "__version__"]


def __getattr__(name):  # lazy: `import pagedllm` stays cheap (no torch) until these are used
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagedllm.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedllm import outputs

        return getattr(outputs, name)
    if name == "EngineArgs":
        from pagedllm.config import EngineArgs

        return EngineArgs
    raise AttributeError(name)
