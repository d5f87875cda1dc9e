"""ISA levels and the frozen ``KernelConfig``: which of our kernels may run in this process, resolved once.

Levels, best first (``LEVELS``); a CPU gets the best one whose flags (``/proc/cpuinfo``) it reports:

| level | CPU flags required | e.g. |
|---|---|---|
| ``amx`` | ``avx512_bf16`` level + ``amx_tile``, ``amx_bf16`` | Sapphire Rapids and later |
| ``avx512_bf16`` | ``avx512f/bw/vl/dq/cd`` + ``avx512_bf16`` | Zen 4/5, Cooper Lake |
| ``avx2`` | x86-64-v3: ``avx2 fma f16c bmi1 bmi2 movbe abm`` | Haswell..Skylake client, Zen 2/3; Ice Lake and Skylake-SP |
| ``none`` | anything else (ARM, older x86) | pure torch, no C library |

Ice Lake (and Skylake-SP / Cascade Lake) has AVX-512 and VNNI but no AVX512-BF16: it runs at ``avx2``, where every
kernel has a path (our AVX-512 paths all assume native bf16 conversions, and the AVX-512 int4/int8 VNNI kernels
need AVX512-BF16 as well).

A lower level is forced with ``PAGEDLLM_CPU_ISA`` / ``--cpu-isa`` / ``LLM(cpu_isa=...)``, so one machine tests every
level it can run; asking for a level above the CPU's is a ``ValueError``. Below ``amx`` no AMX instruction of ours
runs; at ``avx2`` our libraries are compiled for x86-64-v3, so none of their instructions is AVX-512; at ``none`` no
C library is loaded. ``level_environ`` also caps oneDNN and ATen at the level, for processes that start with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

from pagedllm import envs

logger = logging.getLogger(__name__)

LEVELS = ("amx", "avx512_bf16", "avx2", "none")  # best first

_V3 = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
_AVX512_BF16 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16"}) | _V3
_REQUIRED = {
    "amx": _AVX512_BF16 | {"amx_tile", "amx_bf16"},
    "avx512_bf16": _AVX512_BF16,
    "avx2": _V3,
    "none": frozenset(),
}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset:
    """The CPU's feature flags from ``/proc/cpuinfo`` (e.g. ``{"avx512_bf16", "amx_tile", ...}``); empty if
    unreadable (not Linux): then the level is ``none``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """``/proc/cpuinfo``'s ``vendor_id`` (``AuthenticAMD``, ``GenuineIntel``, ...), or "" if unreadable. Read once:
    ``KernelConfig.int4_prefetch`` / ``kquant_prefetch`` ask for it on every library lookup of a config made without
    ``from_env`` (whose distances are 0, the CPU's default)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# How far ahead the decode kernels prefetch their weight streams, per CPU vendor (bytes): each kernel's measured best
# (int4_set_prefetch_bytes in kernels/csrc/int4_cpu.c, kq_set_prefetch_bytes in kquant_cpu.c). AMD EPYC Zen 5, 2
# threads, builds interleaved: SmolLM2's int4 layer matmuls 1.24-1.28 ms a step at 6 KB, 1.35-1.40 at 2 KB; the 1.5B
# Q4_K_M decode step 15.0-15.6 ms at 8 KB, 17.0-22.6 at 2 KB. Xeon (AMX): 2 KB for both (4 KB 10% slower there).
_PREFETCH_BYTES = {"int4": {"AuthenticAMD": 6144}, "kquant": {"AuthenticAMD": 8192}}
# Whether the int4 and K-quant decode kernels' weight prefetches are non-temporal, per CPU vendor
# (kernels/csrc/prefetch.h: decode steps 1.03-1.11x faster on a Zen 5, each weight line being read once a step; the
# kernels' cached level was tuned on a Xeon, where it stays off).
_PREFETCH_NTA = {"AuthenticAMD": True}
PREFETCH_HINTS = ("auto", "nta", "cache")


def default_prefetch_bytes(kernel: str, vendor: Optional[str] = None) -> int:
    """The prefetch distance of ``kernel`` ("int4" or "kquant") for a CPU of ``vendor`` (default: this one's)."""
    return _PREFETCH_BYTES[kernel].get(cpu_vendor() if vendor is None else vendor, 2048)


def detect_level(flags: Optional[frozenset] = None) -> str:
    """The best level of ``LEVELS`` whose required flags are all in ``flags`` (default: this CPU's)."""
    import platform

    flags = cpu_flags() if flags is None else flags
    if platform.machine().lower() not in ("x86_64", "amd64") and flags is cpu_flags():
        return "none"
    return next(level for level in LEVELS if _REQUIRED[level] <= flags)


def supported_levels(flags: Optional[frozenset] = None) -> tuple[str, ...]:
    """Every level this CPU can run, best first (``amx`` CPU: all four; Zen 4: avx512_bf16, avx2, none)."""
    return LEVELS[LEVELS.index(detect_level(flags)):]


def level_at_least(level: str, floor: str) -> bool:
    return LEVELS.index(level) <= LEVELS.index(floor)


def check_level(requested: Optional[str], flags: Optional[frozenset] = None) -> str:
    """``requested`` (None or "auto": the detected level) validated against the CPU.

    Raises:
        ValueError: an unknown level, or one above what this CPU supports (naming its flags' best level).
    """
    best = detect_level(flags)
    if requested is None or requested == "auto" or requested == "":
        return best
    if requested not in LEVELS:
        raise ValueError(f"cpu_isa must be one of auto, {', '.join(LEVELS)}; got {requested!r}.")
    if not level_at_least(best, requested):
        raise ValueError(f"cpu_isa={requested!r} is above what this CPU supports (its best level is {best!r}; "
                         f"supported: {', '.join(supported_levels(flags))}).")
    return requested


INT4_PREFILL_KERNELS = ("auto", "bf16", "float", "int16", "int8")


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels run. ``level`` is one of ``LEVELS``; the switches can only turn paths off (see ``envs``).

    ``batch_invariant``: every kernel computes a row the same way whatever else shares its call (kernels pick no
    algorithm by the number of rows), so a request's output doesn't depend on its neighbours. True by default.
    """

    level: str = "none"
    cpu_kernels: bool = True  # False: no C library at all (as level none)
    amx_attention: bool = True
    amx_linear: bool = True
    pack_weights: bool = True
    fused_stack: bool = True
    hugepages: bool = False
    weight_hugepages: bool = True  # GGUF K-quant weights in huge pages (pagedllm.utils.hugepages)
    kquant_tile_cache: bool = True  # GGUF K-quant tiles cached on disk, mapped at later loads (quantization.tile_cache)
    malloc_keep: bool = True  # glibc keeps a step's freed memory for the next (pagedllm.utils.malloc)
    batch_invariant: bool = True
    # activations of the GGUF integer matmuls' decode rows (and unmarked calls): 8, 16, or 0 (auto: the width the
    # activations' dtype carries, ``kquant_decode_bits``)
    kquant_act_bits: int = 0
    kquant_prefill_act_bits: int = 8  # the same for prefill rows (``step_rows``)
    int4_prefill: str = "auto"  # int4 prefill rows below AMX: auto, bf16, float, int16, int8 (``int4_prefill_kernel``)
    int4_prefetch_bytes: int = 0  # the int4 decode kernel's prefetch distance; 0: the CPU's default (from_env sets it)
    kquant_prefetch_bytes: int = 0  # the same for the K-quant matmuls
    weight_prefetch_hint: str = "auto"  # int4 / K-quant decode weight prefetches: nta, cache, auto (CPU's default)

    def __post_init__(self) -> None:
        if self.kquant_act_bits not in (0, 8, 16):
            raise ValueError(f"kquant_act_bits must be 0 (auto), 8 or 16; got {self.kquant_act_bits!r}.")
        if self.kquant_prefill_act_bits not in (8, 16):
            raise ValueError(f"kquant_prefill_act_bits must be 8 or 16; got {self.kquant_prefill_act_bits!r}.")
        for name in ("int4_prefetch_bytes", "kquant_prefetch_bytes"):
            if not 0 <= getattr(self, name) <= 65536:
                raise ValueError(f"{name} must be in 0..65536; got {getattr(self, name)!r}.")
        if self.weight_prefetch_hint not in PREFETCH_HINTS:
            raise ValueError(f"weight_prefetch_hint must be one of {', '.join(PREFETCH_HINTS)}; "
                             f"got {self.weight_prefetch_hint!r}.")
        if self.int4_prefill not in INT4_PREFILL_KERNELS:
            raise ValueError(f"int4_prefill must be one of {', '.join(INT4_PREFILL_KERNELS)}; "
                             f"got {self.int4_prefill!r}.")

    def kquant_decode_bits(self, dtype) -> int:
        """The activation width (8 or 16) of the GGUF integer matmuls' decode rows for activations of ``dtype`` (a
        ``torch.dtype``): ``kquant_act_bits`` where set, else (auto) 8 for bfloat16 activations and 16 (15-bit) for
        float32 / float16 ones. bf16 activations carry 8 significant bits, and int8 per 32 inputs (llama.cpp's
        activations for every quantized matmul, whose Q8_K takes one scale per 256 for K-quants) adds an error of
        the same order: teacher-forced over 1,785 positions (7 chunks of 512 tokens, the second halves scored), the
        mean KL from the same file run in float32 was, with bf16 activations, 5.6e-4 (15-bit) / 1.19e-3 (8-bit) on
        Qwen2.5-Coder-0.5B and 4.9e-4 / 9.7e-4 on the 1.5B Q4_K_M (EPYC Zen 3, s42, the head then 8-bit too; on a
        Zen 5 with the head at 15 bits, s43: 5.7e-4 / 1.06e-3 and 4.3e-4 / 1.10e-3), where llama.cpp's own run of
        each file measured against its F32 conversion (``llama-perplexity --kl-divergence``, the same text and
        chunks) gave 1.21e-3 and 2.43e-3; with float32 activations 15-bit rows give the float32 model's greedy output (KL 5e-8). 8-bit rows
        halve the integer work (one ``vpdpbusd`` per chunk instead of two; AVX2: one ``vpmaddubsw``): on an EPYC Zen 3
        (runs alternating) the 1.5B's decode step took 1.20-1.30x its memory floor with 15-bit rows and 1.10-1.17x
        with 8-bit ones while the host read 30-36 GB/s, and 1.11-1.23x either way at 27-30 GB/s, where the weight
        stream hides the integer work (README, quantized weights). The width follows the dtype, never the number of
        rows, so batch invariance holds. The LM head is not a decode row here: it keeps 15 bits at every dtype
        (``LOGITS_ACT_BITS``; 8-bit head activations flipped the bundled SmolLM2's answer to the README's
        first question)."""
        if self.kquant_act_bits:
            return self.kquant_act_bits
        return 8 if str(dtype).endswith("bfloat16") else 16

    @property
    def int4_prefill_kernel(self) -> str:
        """What runs int4 layers' prefill rows where no AMX tile path does: ``bf16`` (the weight expanded slab by slab
        to bf16 in the packed layout of our bf16 GEMM, dpbf16 below AMX, bf16 activations exact; as AMX does),
        ``float`` (``int4_gemm``: the weight expanded to float32 tiles), ``int16`` / ``int8`` (the integer-dot kernel
        with 15-bit / 8-bit activations; 8-bit adds llama.cpp's activation error, up to max|x| / 254 per group).
        ``auto``: ``bf16`` at ``avx512_bf16`` (and ``amx``), ``int16`` below. Measured on an AMD EPYC Zen 5 (2 threads,
        SmolLM2's four int4 layer shapes at 512 rows, expansion included): bf16 4.2 ms (858 GFLOP/s), int8 4.8, int16
        9.2, float 11.7; on a Xeon capped at ``avx512_bf16`` (VDPBF16PS one per 2 cycles there) bf16 and int16 were
        even. At ``avx2`` the ``vpmaddwd`` kernel was 1.24-1.35x ``int4_gemm`` at 512 rows (Zen 3)."""
        if self.int4_prefill != "auto":
            return self.int4_prefill
        return "bf16" if level_at_least(self.level, "avx512_bf16") else "int16"

    @property
    def int4_prefetch(self) -> int:
        """The int4 decode kernel's prefetch distance in bytes (``int4_prefetch_bytes``, or the CPU's default)."""
        return self.int4_prefetch_bytes or default_prefetch_bytes("int4")

    @property
    def kquant_prefetch(self) -> int:
        """The K-quant matmuls' prefetch distance in bytes (``kquant_prefetch_bytes``, or the CPU's default)."""
        return self.kquant_prefetch_bytes or default_prefetch_bytes("kquant")

    @property
    def weight_prefetch_nta(self) -> bool:
        """Whether the int4 and K-quant decode kernels prefetch their weights non-temporally (``weight_prefetch_hint``:
        nta; cache: into L1, as they were tuned; auto: the CPU vendor's measured default)."""
        if self.weight_prefetch_hint == "auto":
            return _PREFETCH_NTA.get(cpu_vendor(), False)
        return self.weight_prefetch_hint == "nta"

    @property
    def native(self) -> bool:
        """Whether C libraries may load (level above ``none`` and ``cpu_kernels`` on)."""
        return self.cpu_kernels and self.level != "none"

    @property
    def amx(self) -> bool:
        """Whether AMX code of ours may run (the OS must still grant the tile state: ``kernels.amx_lib``)."""
        return self.native and self.level == "amx"

    def with_level(self, level: str) -> "KernelConfig":
        return replace(self, level=check_level(level))

    def describe(self) -> str:
        off = [n for n in ("cpu_kernels", "amx_attention", "amx_linear", "pack_weights", "fused_stack",
                           "weight_hugepages", "kquant_tile_cache", "malloc_keep", "batch_invariant")
               if not getattr(self, n)]
        return (f"level={self.level} (CPU best: {detect_level()})" + (f", off: {', '.join(off)}" if off else "")
                + (", hugepages" if self.hugepages else "") + ", kquant activations "
                + (_width(self.kquant_act_bits) if self.kquant_act_bits else "auto (8-bit on bf16, 15-bit on float32)")
                + f" (prefill {_width(self.kquant_prefill_act_bits)}, LM head {_width(LOGITS_ACT_BITS)})"
                + f", int4 prefill {self.int4_prefill_kernel}"
                + f", weight prefetch int4 {self.int4_prefetch} B / K-quant {self.kquant_prefetch} B"
                + (", non-temporal" if self.weight_prefetch_nta else "")
                + (", int4 integer sums on AMX-INT8" if self.amx and self.amx_linear and "amx_int8" in cpu_flags()
                   else ""))

    @classmethod
    def from_env(cls, cpu_isa: Optional[str] = None) -> "KernelConfig":
        """Resolved from ``cpu_isa`` (else ``PAGEDLLM_CPU_ISA``, else the detected level) and the switches in
        ``envs``. Raises ``ValueError`` for a level the CPU can't run."""
        level = check_level(cpu_isa if cpu_isa not in (None, "", "auto") else envs.get("PAGEDLLM_CPU_ISA"))
        return cls(level=level, cpu_kernels=envs.flag("PAGEDLLM_CPU_KERNELS"),
                   amx_attention=envs.flag("PAGEDLLM_AMX_ATTENTION"), amx_linear=envs.flag("PAGEDLLM_AMX_LINEAR"),
                   pack_weights=envs.flag("PAGEDLLM_PACK_WEIGHTS"), fused_stack=envs.flag("PAGEDLLM_FUSED_STACK"),
                   hugepages=envs.flag("PAGEDLLM_HUGEPAGES"), weight_hugepages=envs.flag("PAGEDLLM_WEIGHT_HUGEPAGES"),
                   kquant_tile_cache=envs.flag("PAGEDLLM_KQUANT_TILE_CACHE"),
                   malloc_keep=envs.flag("PAGEDLLM_MALLOC_KEEP"), batch_invariant=envs.flag("PAGEDLLM_BATCH_INVARIANT"),
                   kquant_act_bits=_bits_env("PAGEDLLM_KQUANT_ACT_BITS"),
                   kquant_prefill_act_bits=_int_env("PAGEDLLM_KQUANT_PREFILL_ACT_BITS"),
                   int4_prefill=envs.get("PAGEDLLM_INT4_PREFILL"),
                   int4_prefetch_bytes=_prefetch_env("int4"), kquant_prefetch_bytes=_prefetch_env("kquant"),
                   weight_prefetch_hint=_choice_env("PAGEDLLM_WEIGHT_PREFETCH_HINT", PREFETCH_HINTS))


def _prefetch_env(kernel: str) -> int:
    name = f"PAGEDLLM_{kernel.upper()}_PREFETCH_BYTES"
    v = envs.get(name)
    if v in (None, "", "auto"):
        return default_prefetch_bytes(kernel)
    n = _int_env(name)
    if not 32 <= n <= 65536:
        raise ValueError(f"{name} must be auto or 32..65536; got {v!r}.")
    return n


def _choice_env(name: str, choices: tuple[str, ...]) -> str:
    v = (envs.get(name) or "auto").strip().lower()
    if v not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {v!r}.")
    return v


# The LM head's activations: 15 bits at every dtype. The logits are what a token is picked from, and a tiny model's
# near-tied ones flip with the head's rounding: SmolLM2-135M (its tied Q8_0 head) answered "What is the capital of
# France?" with "L'Étoile, la Marseillaise, ..." on 8-bit head activations in bf16 and "The capital of France is
# Paris." on 15-bit ones (s42, a fresh clone's `make serve`). One matmul a step: the 1.5B Q4_K_M's Q6_K head (191 of
# its 980 MB) 8.55 vs 7.83 ms at 15 / 8 bits, streamed alone at 20-30 GB/s (EPYC Zen 3, 2 threads); on an EPYC Zen 5
# 4.60 vs 4.53 ms, Gemma-3-270M's Q8_0 head 4.23 vs 4.32 ms (s43, alternating). Read by ``kquant.kquant_logits``.
LOGITS_ACT_BITS = 16


def _width(bits: int) -> str:
    """An activation width setting as the kernels use it: 16 means 15-bit (two s8 halves, 128 hi + lo), 8 is int8."""
    return "15-bit" if bits == 16 else f"{bits}-bit"


def _bits_env(name: str) -> int:
    """``auto`` (or empty) -> 0, else the integer."""
    v = envs.get(name)
    if v is None or v.strip().lower() in ("", "auto"):
        return 0
    if v.strip() not in ("8", "16"):
        raise ValueError(f"{name} must be auto, 8 or 16; got {v!r}.")
    return int(v)


def _int_env(name: str) -> int:
    v = envs.get(name)
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer; got {v!r}.") from None


# oneDNN (torch's bf16 matmuls) and ATen's vectorized kernels read these once, when first used: a process that sets
# them before torch runs an op (the CLI, test subprocesses) keeps torch at the level too.
_TORCH_ENV = {
    "avx512_bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI_2", "ATEN_CPU_CAPABILITY": "avx2"},
}


def level_environ(level: str) -> dict[str, str]:
    """Environment variables for a process that should run at ``level`` (ours and torch's), e.g. for
    ``subprocess.run(env={**os.environ, **level_environ("avx2")})``."""
    if level not in LEVELS:
        raise ValueError(f"unknown ISA level {level!r}")
    return {"PAGEDLLM_CPU_ISA": level, **_TORCH_ENV.get(level, {})}
