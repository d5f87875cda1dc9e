"""pagedllm: a paged-KV-cache LLM inference and serving engine with vLLM's public names."""

import os as _os

# OpenMP threads (torch's libgomp, shared by our C kernels) wait at the end of every parallel region. libgomp's
# default spins 300,000 `pause`s (~6 ms here, 20 ns each) before sleeping, so a thread that loses its core to any other
# runnable thread holds every region up until the scheduler's next tick: measured on 2 cores with one other busy
# process, a 32x576x3072 bf16 linear took 7.8 ms instead of 0.34 ms and a decode step 0.79 s instead of ~40 ms. A
# short spin (3,000: ~60 us, longer than most gaps between ops in a step, so threads stay hot while a step runs) keeps
# the fast path and gives the core back under contention. libgomp reads it once, when torch is first imported;
# set GOMP_SPINCOUNT (or OMP_WAIT_POLICY) yourself to override.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "3000")

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
