"""ISA levels (pagedllm.kernels): detection, forcing a lower level, per-level builds, the binding table against the
prototypes header, batch invariance, and the kernel / greedy-vs-HF tests run again at every lower level this CPU
supports (each in its own process, started with that level's environment)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from pagedllm import kernels
from pagedllm.kernels import bindings, build
from pagedllm.kernels.config import LEVELS, check_level, detect_level, level_environ, supported_levels

V3 = frozenset("avx2 fma f16c bmi1 bmi2 movbe abm sse4_2 avx".split())
ZEN4 = V3 | frozenset("avx512f avx512bw avx512vl avx512dq avx512cd avx512_bf16 avx512_vnni avx512vbmi".split())
SPR = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx_vnni"}
ICE_LAKE = ZEN4 - {"avx512_bf16"}  # AVX-512 + VNNI without BF16
OLD_X86 = frozenset("sse4_2 avx".split())


def test_levels_detected_from_cpu_flags():
    assert detect_level(SPR) == "amx"
    assert detect_level(ZEN4) == "avx512_bf16"
    assert detect_level(ICE_LAKE) == "avx2"  # no native bf16: the x86-64-v3 builds
    assert detect_level(V3) == "avx2"
    assert detect_level(OLD_X86) == "none" and detect_level(frozenset()) == "none"
    assert supported_levels(SPR) == LEVELS
    assert supported_levels(ZEN4) == ("avx512_bf16", "avx2", "none")
    assert supported_levels(frozenset()) == ("none",)


def test_forcing_a_level_above_the_cpu_is_a_clear_error():
    assert check_level(None, ZEN4) == check_level("auto", ZEN4) == "avx512_bf16"
    assert check_level("avx2", ZEN4) == "avx2" and check_level("none", ZEN4) == "none"
    with pytest.raises(ValueError, match="above what this CPU supports.*avx512_bf16"):
        check_level("amx", ZEN4)
    with pytest.raises(ValueError, match="cpu_isa must be one of"):
        check_level("avx512", SPR)
    from pagedllm.config import EngineArgs

    with pytest.raises(ValueError, match="cpu_isa"):
        EngineArgs(cpu_isa="sse9").create_engine_config()


def test_engine_config_carries_the_forced_level(monkeypatch):
    from pagedllm.config import EngineArgs

    monkeypatch.setenv("PAGEDLLM_FUSED_STACK", "0")
    cfg = EngineArgs(cpu_isa="none", dtype="auto").create_engine_config()
    assert cfg.kernel.level == "none" and not cfg.kernel.native and not cfg.kernel.fused_stack
    assert cfg.model.dtype == torch.float32  # auto: no native bf16 at level none
    for level in set(supported_levels()) - {"none"}:  # auto: bf16 wherever our bf16 kernels run (avx2 and up)
        assert EngineArgs(cpu_isa=level, dtype="auto").create_engine_config().model.dtype == torch.bfloat16, level
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "none")
    assert EngineArgs().create_engine_config().kernel.level == "none"


def test_level_flags_never_target_above_the_level():
    assert build.level_flags("avx2", SPR)[0] == "-march=x86-64-v3"
    assert not any("avx512" in f or "amx" in f for f in build.level_flags("avx2", SPR))
    assert "-mavxvnni" in build.level_flags("avx2", SPR) and "-mavxvnni" not in build.level_flags("avx2", ZEN4)
    f = build.level_flags("avx512_bf16", ZEN4)
    assert f[0] == "-march=x86-64-v4" and {"-mavx512bf16", "-mavx512vnni", "-mavx512vbmi"} <= set(f)
    assert not any("amx" in x for x in build.level_flags("avx512_bf16", SPR))
    assert {"-mamx-tile", "-mamx-bf16"} <= set(build.level_flags("amx", SPR))
    assert "-mavx512vbmi" not in build.level_flags("avx512_bf16", ZEN4 - {"avx512vbmi"})  # Cooper Lake: no VBMI


def test_cache_key_covers_level_compiler_and_every_included_header(monkeypatch, tmp_path):
    lib = bindings.LIBRARIES["cpu"]
    names = {os.path.basename(p) for p in build.source_closure([os.path.join(build.CSRC, s) for s in lib.sources])}
    assert {"paged_decode.c", "cpu_ops.c", "bf16.h", "simd.h", "amx.h", "pagedllm_kernels.h"} <= names
    key = build.cache_key(lib, "avx2")
    assert key != build.cache_key(lib, "avx512_bf16")
    monkeypatch.setattr(build, "compiler_identity", lambda cc: "gcc (other) 99.1")
    assert build.cache_key(lib, "avx2") != key
    monkeypatch.undo()
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", str(csrc))
    assert build.cache_key(lib, "avx2") == key
    (csrc / "simd.h").write_text((csrc / "simd.h").read_text() + "\n/* edited */\n")
    assert build.cache_key(lib, "avx2") != key  # a header edit rebuilds


def _prototypes() -> dict[str, int]:
    """Function name -> parameter count, from csrc/pagedllm_kernels.h."""
    text = open(os.path.join(build.CSRC, "pagedllm_kernels.h")).read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = {}
    for decl in re.findall(r"^[a-z][\w\s\*]*?\b(\w+)\s*\(([^)]*)\)\s*;", text, flags=re.M):
        name, params = decl
        out[name] = 0 if params.strip() in ("", "void") else params.count(",") + 1
    return out


def test_binding_table_matches_the_prototypes_header():
    protos = _prototypes()
    table = {name: len(fn.argtypes) for lib in bindings.LIBRARIES.values() for name, fn in lib.functions.items()}
    assert table == protos


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv != "none"])
def test_every_library_builds_and_binds_at_each_supported_level(level):
    if level not in supported_levels():
        pytest.skip(f"this CPU runs below {level}")
    for name, spec in bindings.LIBRARIES.items():
        lib = kernels.load(name, level)
        if level not in spec.levels:
            assert lib is None
            continue
        assert lib is not None, name
        for fname, fn in spec.functions.items():
            assert fn.optional or getattr(lib, fname).argtypes == list(fn.argtypes), fname


def test_loading_every_library_keeps_subnormals_in_this_process():
    """No library may turn on FTZ/DAZ for the process (GCC links crtfastmath.o, which does, into anything linked with
    -ffast-math): subnormal float32 arithmetic in torch must still give subnormals after every library is loaded."""
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert tiny.item() != 0.0
    for level in supported_levels():
        for name in bindings.LIBRARIES:
            kernels.load(name, level)
    assert (tiny * 1.0).item() != 0.0 and (tiny + tiny).item() == pytest.approx(2e-40, rel=1e-3)


def _disassembly(name: str, level: str) -> str:
    lib = bindings.LIBRARIES[name]
    so = build.build(lib, level)
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", so], capture_output=True, text=True).stdout


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump")
def test_lower_level_builds_contain_no_instruction_above_their_level():
    """avx2 builds: no zmm register and no mask register (AVX-512); below amx: no tile instruction. The checks can
    fail: the higher builds do contain them."""
    levels = supported_levels()
    for name in ("cpu", "int4"):
        if "avx2" in levels:
            asm = _disassembly(name, "avx2")
            assert asm and "zmm" not in asm and not re.search(r"%k[1-7]\b", asm), name
        if "avx512_bf16" in levels:
            asm = _disassembly(name, "avx512_bf16")
            assert "zmm" in asm and "tdpbf16ps" not in asm and "ldtilecfg" not in asm, name
    if "amx" in levels:
        assert "tdpbf16ps" in _disassembly("cpu", "amx")


def test_level_none_loads_no_library_and_amx_only_at_amx():
    with kernels.use(dataclasses.replace(kernels.config(), level="none")):
        assert all(kernels.lib(name) is None for name in bindings.LIBRARIES)
    with kernels.use(dataclasses.replace(kernels.config(), cpu_kernels=False)):
        assert all(kernels.lib(name) is None for name in bindings.LIBRARIES)
    for level in supported_levels():
        if level != "amx":
            with kernels.use(dataclasses.replace(kernels.config(), level=level)):
                assert kernels.lib("amx") is None


# ----------------------------------------------------------------------------------------------- batch invariance
def _promised_invariant(quantization: str, level: str) -> bool:
    """Batch invariance holds by construction where every kernel of the path is ours: not at level ``none``, and
    for bf16 only where the linears get a packed kernel of ours (README "CPU kernels and ISA levels")."""
    from pagedllm.layers.packed_linear import linear_backend

    if level == "none":
        return False
    with kernels.use(dataclasses.replace(kernels.config(), level=level)):
        return quantization == "gguf" or linear_backend(576, 576) is not None


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("quantization", ["gguf", "none"])  # the bundled SmolLM2 4-bit, and dequantized to bf16
def test_greedy_alone_equals_among_concurrent_others(quantization, level):
    """One prompt's greedy tokens alone and batched with 8 others (one prefill step of all nine, then a batch-9
    decode) are identical, at every ISA level this CPU runs. Where the path is not promised invariant (torch or
    oneDNN linears) a difference is an expected failure."""
    if level not in supported_levels():
        pytest.skip(f"this CPU runs below {level}")
    from real_models import greedy_alone_and_among_others

    from pagedllm import LLM

    llm = LLM(dtype="bfloat16", quantization=quantization, cpu_isa=level, kv_cache_memory_bytes=64 << 20,
              max_model_len=512, enable_prefix_caching=False)
    assert kernels.config().level == level
    alone, mixed = greedy_alone_and_among_others(llm, 32)
    assert len(alone) == 32
    if mixed != alone and not _promised_invariant(quantization, level):
        pytest.xfail(f"level {level!r}: torch/oneDNN linears pick their algorithm by the number of rows")
    assert mixed == alone, next(i for i, (a, b) in enumerate(zip(alone, mixed)) if a != b)


# ------------------------------------------------------------------------------------------- the suite per level
# Representative tests run again in a process started at each lower level (our kernels at that level, and oneDNN /
# ATen capped at it): the C kernels against their references, the int4/int8 kernels, and greedy decoding of the
# model families against HF. (The fused loop and batch invariance take ``cpu_isa`` per engine and run every level
# in-process: tests/test_fused_stack.py, test_greedy_alone_equals_among_concurrent_others; the dpbf16 kernel is
# built for every level in tests/test_dpbf16_linear.py.)
LEVEL_SUITE = [
    "tests/test_attention_kernel.py::test_kernel_matches_reference",
    "tests/test_attention_kernel.py::test_torch_fallback_equals_kernel",
    "tests/test_attention_kernel.py::test_decode_kernel_block16_matches_reference",
    "tests/test_attention_kernel.py::test_decode_alone_equals_among_others_across_the_head_split",
    "tests/test_attention_kernel.py::test_decode_long_context_partitions",
    "tests/test_paged_prefill.py",
    "tests/test_cpu_ops.py::test_add_rms_norm_matches_torch",
    "tests/test_cpu_ops.py::test_silu_and_mul_matches_torch",
    "tests/test_cpu_ops.py::test_rope_and_cache_matches_torch_path",
    "tests/test_cpu_ops.py::test_argmax_rows_matches_torch_including_ties_and_nan",
    "tests/test_cpu_ops.py::test_apply_token_bitmask_matches_the_bit_definition",
    "tests/test_cpu_ops.py::test_packed_linear_equals_f_linear",
    "tests/test_cpu_ops.py::test_pack_linear_weights_replaces_linears_and_tied_head",
    "tests/test_quantization.py::test_gguf_linear_equals_dequantized",
    "tests/test_quantization.py::test_int4_gemv_matches_float64",
    "tests/test_quantization.py::test_int4_rows_take_their_kernel_by_kind_not_by_batch",  # prefill rows below AMX
    "tests/test_quantization.py::test_int8_embedding_logits_equal_dequantized",
    "tests/test_quantization.py::test_int4_pack_layouts_round_trip_and_aten_writes_its_own",
    "tests/test_quantization.py::test_int4_pack_of_aten_layout_computes_like_ours",
    "tests/test_quantization.py::test_smollm2_int4_chat_answers_paris",
    # GGUF K-quants: the tiled integer kernel (bound, batch invariance) and the prefill path per level (issue 20)
    "tests/test_kquant.py::test_matmul_within_activation_rounding_bound",
    "tests/test_kquant.py::test_batch_invariance",
    "tests/test_kquant.py::test_tiled_layout_holds_the_files_values",
    "tests/test_kquant.py::test_prefill_tiles_in_bf16_equal_dequantized_bf16_matmul",
    "tests/test_kquant.py::test_step_rows_give_each_row_its_kernel",
    *(f"tests/test_models.py::test_batched_decode_and_prefill_match_hf[{name}]"
      for name in ("llama-tied-bias", "mistral-sliding", "qwen3-qk-norm", "gemma3", "deepseek-v2")),
]


@pytest.mark.slow
@pytest.mark.parametrize("level", [
    "avx512_bf16",
    # avx2 failed here until aten's int4 pack (whose layout follows ATen's runtime capability) stopped feeding our
    # kernels: see INT4_LAYOUTS in layers/quantization/kernels.py.
    "avx2",
    "none",
])
def test_suite_at_lower_level(level, tmp_path):
    """``LEVEL_SUITE`` in a process started at ``level`` (``level_environ``: ours, oneDNN's and ATen's ISA caps), so
    one machine tests every level it can run."""
    if os.environ.get("PAGEDLLM_CPU_ISA"):
        pytest.skip("already inside a per-level run")
    if level not in supported_levels():
        pytest.skip(f"this CPU runs below {level}")
    if level == detect_level():
        pytest.skip(f"{level} is this CPU's level: the suite itself ran there")
    env = {**os.environ, **level_environ(level)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *LEVEL_SUITE],
                         cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, tail
    assert re.search(r"\d+ passed", tail), tail


# ------------------------------------------------------------------------------------------------ envs.py
def test_every_environment_variable_is_listed_once_and_read_only_in_envs():
    """Each PAGEDLLM_* name in the package is an entry of envs.ENV_VARS, and no module but envs.py reads one from
    os.environ / os.getenv."""
    from pagedllm import envs

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pagedllm")
    used, readers = set(), []
    for dirpath, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            text = open(path).read()
            used |= set(re.findall(r"\bPAGEDLLM_[A-Z0-9_]+", text))
            if f != "envs.py" and re.search(r"os\.(environ\.get|getenv|environ\[)\(?\s*[\"']PAGEDLLM_", text):
                readers.append(path)
    used -= {"PAGEDLLM_BF16_H", "PAGEDLLM_SIMD_H", "PAGEDLLM_AMX_H", "PAGEDLLM_KERNELS_H"}  # C include guards
    assert used <= set(envs.ENV_VARS), used - set(envs.ENV_VARS)
    assert not readers
    assert all(v.meaning for v in envs.ENV_VARS.values())


def test_kernel_switches_resolve_once_into_the_frozen_config(monkeypatch):
    from pagedllm.kernels import KernelConfig

    monkeypatch.setenv("PAGEDLLM_AMX_ATTENTION", "0")
    monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", "0")
    monkeypatch.setenv("PAGEDLLM_HUGEPAGES", "1")
    cfg = KernelConfig.from_env("none")
    assert (cfg.level, cfg.amx_attention, cfg.batch_invariant, cfg.hugepages, cfg.fused_stack) == (
        "none", False, False, True, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.level = "amx"
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "none")
    assert KernelConfig.from_env().level == "none"
    assert KernelConfig.from_env("avx2" if "avx2" in supported_levels() else "none").level != "amx"


def test_kquant_activation_widths_resolve_and_are_checked(monkeypatch):
    from pagedllm.kernels import KernelConfig

    cfg = KernelConfig.from_env("none")
    # decode rows: the width of their dtype (auto); prefill rows llama.cpp-wide
    assert (cfg.kquant_act_bits, cfg.kquant_prefill_act_bits) == (0, 8)
    assert [cfg.kquant_decode_bits(d) for d in (torch.bfloat16, torch.float32, torch.float16)] == [8, 16, 16]
    want = "kquant activations auto (8-bit on bf16, 15-bit on float32) (prefill 8-bit, LM head 15-bit)"
    assert want in cfg.describe()
    for v in ("auto", "", " AUTO "):
        monkeypatch.setenv("PAGEDLLM_KQUANT_ACT_BITS", v)
        assert KernelConfig.from_env("none").kquant_act_bits == 0
    monkeypatch.setenv("PAGEDLLM_KQUANT_ACT_BITS", "16")
    assert KernelConfig.from_env("none").kquant_decode_bits(torch.bfloat16) == 16  # a set width wins over the dtype
    monkeypatch.setenv("PAGEDLLM_KQUANT_ACT_BITS", "8")
    monkeypatch.setenv("PAGEDLLM_KQUANT_PREFILL_ACT_BITS", "16")
    cfg = KernelConfig.from_env("none")
    assert (cfg.kquant_act_bits, cfg.kquant_prefill_act_bits) == (8, 16)
    assert cfg.kquant_decode_bits(torch.float32) == 8
    assert "kquant activations 8-bit (prefill 15-bit, LM head 15-bit)" in cfg.describe()
    for bad in ("4", "eight", "0"):
        monkeypatch.setenv("PAGEDLLM_KQUANT_ACT_BITS", bad)
        with pytest.raises(ValueError, match="PAGEDLLM_KQUANT_ACT_BITS|kquant_act_bits"):
            KernelConfig.from_env("none")
    with pytest.raises(ValueError, match="kquant_prefill_act_bits"):
        KernelConfig(kquant_prefill_act_bits=12)
    # int4 prefill rows below AMX: auto is the dpbf16 GEMM at avx512_bf16, the 15-bit integer kernel below
    monkeypatch.delenv("PAGEDLLM_KQUANT_ACT_BITS")
    assert KernelConfig(level="avx512_bf16").int4_prefill_kernel == "bf16"
    assert KernelConfig(level="avx2").int4_prefill_kernel == "int16"
    assert KernelConfig(level="avx2", int4_prefill="bf16").int4_prefill_kernel == "bf16"
    assert KernelConfig(level="avx2", int4_prefill="float").int4_prefill_kernel == "float"
    assert KernelConfig(level="avx2", int4_prefill="int8").int4_prefill_kernel == "int8"
    monkeypatch.setenv("PAGEDLLM_INT4_PREFILL", "int8")
    assert KernelConfig.from_env("none").int4_prefill_kernel == "int8"
    assert "int4 prefill int8" in KernelConfig.from_env("none").describe()
    monkeypatch.setenv("PAGEDLLM_INT4_PREFILL", "int4")
    with pytest.raises(ValueError, match="int4_prefill"):
        KernelConfig.from_env("none")


def test_weight_prefetch_distances_resolve_by_vendor_and_are_checked(monkeypatch):
    """``PAGEDLLM_INT4_PREFETCH_BYTES`` / ``PAGEDLLM_KQUANT_PREFETCH_BYTES``: auto is 6 / 8 KB on AMD and 2 KB elsewhere
    (each kernel's measured best per CPU), a number is taken as given, anything else (or out of 32..65536) is refused;
    the resolved distances are in the start-up line."""
    from pagedllm.kernels import KernelConfig

    kc = importlib.import_module("pagedllm.kernels.config")  # the module (pagedllm.kernels.config is also a function)

    assert kc.default_prefetch_bytes("int4", "AuthenticAMD") == 6144
    assert kc.default_prefetch_bytes("kquant", "AuthenticAMD") == 8192
    assert kc.default_prefetch_bytes("int4", "GenuineIntel") == kc.default_prefetch_bytes("kquant", "") == 2048
    monkeypatch.setattr(kc, "cpu_vendor", lambda: "AuthenticAMD")
    cfg = KernelConfig.from_env("none")
    assert (cfg.int4_prefetch_bytes, cfg.kquant_prefetch_bytes) == (6144, 8192)
    assert "weight prefetch int4 6144 B / K-quant 8192 B" in cfg.describe()
    monkeypatch.setattr(kc, "cpu_vendor", lambda: "GenuineIntel")
    assert KernelConfig.from_env("none").int4_prefetch == 2048
    assert KernelConfig().kquant_prefetch == 2048  # 0: the CPU's default
    monkeypatch.setenv("PAGEDLLM_INT4_PREFETCH_BYTES", "4096")
    monkeypatch.setenv("PAGEDLLM_KQUANT_PREFETCH_BYTES", "1024")
    assert (KernelConfig.from_env("none").int4_prefetch, KernelConfig.from_env("none").kquant_prefetch) == (4096, 1024)
    for name in ("PAGEDLLM_INT4_PREFETCH_BYTES", "PAGEDLLM_KQUANT_PREFETCH_BYTES"):
        for bad in ("16", "100000", "far"):
            monkeypatch.setenv(name, bad)
            with pytest.raises(ValueError, match=name):
                KernelConfig.from_env("none")
        monkeypatch.setenv(name, "auto")
    with pytest.raises(ValueError, match="kquant_prefetch_bytes"):
        KernelConfig(kquant_prefetch_bytes=-1)


def test_weight_prefetch_hint_resolves_by_vendor_and_reaches_the_libraries(monkeypatch):
    """``PAGEDLLM_WEIGHT_PREFETCH_HINT``: auto is non-temporal on AMD (measured faster on a Zen 5) and not elsewhere,
    nta / cache are taken as given on any CPU, anything else is refused; the start-up line says when it is on, and
    the int4 and K-quant libraries are built with the choice (a -D flag, in the build's cache key)."""
    from pagedllm import kernels
    from pagedllm.kernels import KernelConfig

    kc = importlib.import_module("pagedllm.kernels.config")
    monkeypatch.setattr(kc, "cpu_vendor", lambda: "AuthenticAMD")
    cfg = KernelConfig.from_env("none")
    assert cfg.weight_prefetch_hint == "auto" and cfg.weight_prefetch_nta
    assert "K-quant 8192 B, non-temporal" in cfg.describe()
    monkeypatch.setenv("PAGEDLLM_WEIGHT_PREFETCH_HINT", "cache")
    assert not KernelConfig.from_env("none").weight_prefetch_nta
    monkeypatch.setattr(kc, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.setenv("PAGEDLLM_WEIGHT_PREFETCH_HINT", "auto")
    cfg = KernelConfig.from_env("none")
    assert not cfg.weight_prefetch_nta and "non-temporal" not in cfg.describe()
    monkeypatch.setenv("PAGEDLLM_WEIGHT_PREFETCH_HINT", "NTA")
    assert KernelConfig.from_env("none").weight_prefetch_nta
    monkeypatch.setenv("PAGEDLLM_WEIGHT_PREFETCH_HINT", "t1")
    with pytest.raises(ValueError, match="PAGEDLLM_WEIGHT_PREFETCH_HINT"):
        KernelConfig.from_env("none")
    with pytest.raises(ValueError, match="weight_prefetch_hint"):
        KernelConfig(weight_prefetch_hint="far")
    # a build-time choice: the int4 and K-quant libraries are built with WEIGHT_PREFETCH_NTA=1 for nta, the others not
    nta, cache = (dataclasses.replace(KernelConfig(), weight_prefetch_hint=h) for h in ("nta", "cache"))
    assert kernels._defines("kquant", nta) == kernels._defines("int4", nta) == ("-DWEIGHT_PREFETCH_NTA=1",)
    assert kernels._defines("kquant", cache) == kernels._defines("dpbf16", nta) == ()
    lib = bindings.LIBRARIES["kquant"]
    assert "-DWEIGHT_PREFETCH_NTA=1" in build.command(lib, "avx2", defines=kernels._defines("kquant", nta))
    assert build.cache_key(lib, "avx2", defines=("-DWEIGHT_PREFETCH_NTA=1",)) != build.cache_key(lib, "avx2")
