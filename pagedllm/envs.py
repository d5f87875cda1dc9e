"""Every environment variable pagedllm reads, in one place: name, default and meaning.

Only this module reads them (``get`` / ``flag``, as vLLM's ``envs.py``). The kernel switches are read once, at
start-up, into the frozen ``pagedllm.kernels.KernelConfig`` carried in ``EngineConfig``, so no hot path reads the
environment and a test changes them by passing a ``KernelConfig``, not by setting a variable. This module imports
nothing heavy (no torch), so the CLI can use it before torch starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: Optional[str]
    meaning: str


ENV_VARS: dict[str, EnvVar] = {v.name: v for v in (
    # Kernels (resolved into pagedllm.kernels.KernelConfig at start-up; README "CPU kernels and ISA levels").
    EnvVar("PAGEDLLM_CPU_ISA", None,
           "Force a lower ISA level for our kernels: amx | avx512_bf16 | avx2 | none (default: the best level this "
           "CPU supports; a level above it is an error). Same as --cpu-isa / LLM(cpu_isa=...)."),
    EnvVar("PAGEDLLM_CPU_KERNELS", "1", "0: load no C library at all (as level none: pure torch paths)."),
    EnvVar("PAGEDLLM_AMX_ATTENTION", "1", "0: no AMX attention (prefill kernel and the decode kernel's AMX score pass)."),
    EnvVar("PAGEDLLM_AMX_LINEAR", "1", "0: bf16 linears don't use the AMX kernel (the next backend of the level), "
           "nor int4 linears' integer sums AMX-INT8 tiles (their VNNI loop instead: the same bits)."),
    EnvVar("PAGEDLLM_PACK_WEIGHTS", "1", "0: keep plain bf16 weights (F.linear) instead of packing them at load."),
    EnvVar("PAGEDLLM_FUSED_STACK", "1", "0: run the model's Python layer loop instead of the fused C loop."),
    EnvVar("PAGEDLLM_HUGEPAGES", "0", "1: KV caches in one huge-page-advised mapping (Linux)."),
    EnvVar("PAGEDLLM_WEIGHT_HUGEPAGES", "1", "0: GGUF K-quant weights in ordinary pages instead of huge-page-advised "
           "mappings (Linux)."),
    EnvVar("PAGEDLLM_KQUANT_TILE_CACHE", "1", "0: pack GGUF K-quant weights into our tiled layout at every load instead "
           "of keeping the tiles on disk after the first (<cache dir>/kquant-tiles, about the GGUF's size) and mapping "
           "them at later loads (Qwen2.5-Coder-1.5B Q4_K_M: 1.2-3 s less start-up)."),
    EnvVar("PAGEDLLM_MALLOC_KEEP", "1", "0: leave glibc's malloc thresholds as they are (by default, once the model "
           "is loaded, blocks up to 64 MiB come from the heap and up to 256 MiB of freed heap is kept, so a step's "
           "activations reuse memory instead of new zeroed pages)."),
    EnvVar("PAGEDLLM_BATCH_INVARIANT", "1",
           "0: let kernels choose their algorithm by the number of rows of a call (faster int4/int8 at some batch "
           "sizes, but a request's greedy output may then depend on the requests batched with it)."),
    EnvVar("PAGEDLLM_KQUANT_ACT_BITS", "auto",
           "Activations of the GGUF K-quant / Q8_0 / Q5_0 integer matmuls' decode rows: auto (8 with bf16 activations, "
           "16 with float32), 16 (15-bit, ~2^-15 of each block's max: greedy output as the float32 model's) or 8 (int8 "
           "per 32 inputs, as llama.cpp; half the integer work: decode steps ~1.1x faster on AVX2, about twice the KL "
           "from the float32 model that bf16 activations give, no more than llama.cpp's own; README, quantized weights)."),
    EnvVar("PAGEDLLM_KQUANT_PREFILL_ACT_BITS", "8",
           "The same for prefill rows (where the level has no bf16 tile path): 8 (1.2x faster prefill on AVX2) or 16."),
    EnvVar("PAGEDLLM_INT4_PREFETCH_BYTES", "auto",
           "How far ahead the int4 decode kernel prefetches its weights, in bytes (32 to 65536), or auto (6144 on "
           "AMD CPUs, 2048 on others: measured best on a Zen 5 and a Xeon)."),
    EnvVar("PAGEDLLM_KQUANT_PREFETCH_BYTES", "auto",
           "The same for the GGUF K-quant / Q8_0 / Q5_0 matmuls (auto: 8192 on AMD CPUs, 2048 on others)."),
    EnvVar("PAGEDLLM_WEIGHT_PREFETCH_HINT", "auto",
           "The int4 and K-quant decode kernels' weight prefetches: nta (non-temporal: weights read once a step don't "
           "evict what the step keeps using), cache (into L1, as the kernels were tuned), or auto (nta on AMD CPUs, "
           "measured faster on a Zen 5; cache on others)."),
    EnvVar("PAGEDLLM_INT4_PREFILL", "auto",
           "int4 layers' prefill rows below level amx: bf16 (weights expanded to bf16 for our packed bf16 GEMM), "
           "float (float32 tiles), int16 (integer dots, 15-bit activations), int8 (8-bit activations, llama.cpp's "
           "activation error), or auto (bf16 at avx512_bf16, int16 below)."),
    # Files and tools.
    EnvVar("PAGEDLLM_CACHE_DIR", None, "Folder for assembled model files and built kernels (default ~/.cache/pagedllm)."),
    EnvVar("PAGEDLLM_TOKENIZER_CACHE", "1",
           "0: don't keep converted GGUF tokenizers (nor xgrammar's tokenizer info) on disk."),
    EnvVar("PAGEDLLM_API_KEY", None, "Default of serve --api-key."),
    EnvVar("PAGEDLLM_PEERS_DIR", None, "Folder of the benchmark peers (default .peers/ in the checkout)."),
    EnvVar("CC", "gcc", "C compiler for the kernels."),
)}

def get(name: str) -> Optional[str]:
    """The value of ``name`` (one of ``ENV_VARS``, else ``KeyError``) from the environment, else its default."""
    return os.environ.get(name, ENV_VARS[name].default)


def flag(name: str) -> bool:
    """``get(name)`` as a boolean: anything but ``0``, ``false``, ``no``, ``off`` or empty is true."""
    v = get(name)
    return v is not None and v.strip().lower() not in ("0", "false", "no", "off", "")
