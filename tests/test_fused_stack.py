"""The fused C layer loop (pagedllm/models/fused_stack.py) against the model's Python layer loop: the same kernels in
the same order, so greedy tokens and their logprobs must be equal exactly, on decode-only and mixed steps; with the
linears on the AMX kernel, and on the dpbf16 kernel with every AMX kernel off (as on a CPU without AMX)."""

import pytest
import torch

from pagedllm import kernels
from pagedllm.layers.quantization import cpu_kernels
from pagedllm.models.fused_stack import FusedStack


def _backend_at(level: str):
    """The packed bf16 linear backend layers get at ``level`` (None: oneDNN, or the level isn't this CPU's)."""
    import dataclasses

    from pagedllm.layers.packed_linear import linear_backend

    if level not in kernels.supported_levels():
        return None
    with kernels.use(dataclasses.replace(kernels.config(), level=level)):
        found = linear_backend(64, 64)
    return found[0].name if found else None


# The bf16 fused loop runs on a packed bf16 linear kernel: AMX at level amx, dpbf16 at avx512_bf16 (as on Zen 4)
# and at avx2 (its AVX2 build; batch invariant by default). Each level the CPU runs is tested (cpu_isa per engine).
_BACKENDS = [pytest.param(b, lv, id=f"{b}-{lv}", marks=pytest.mark.skipif(
    _backend_at(lv) != b, reason=f"no {b} kernel at level {lv} on this CPU"))
    for b, lv in (("amx", "amx"), ("dpbf16", "avx512_bf16"), ("dpbf16", "avx2"))]


def _tokens_and_logprobs(out) -> tuple:
    c = out.outputs[0]
    return c.token_ids, [{k: v.logprob for k, v in d.items()} for d in c.logprobs]


def _tiny_case(name: str, level: str, prompt_lens, max_tokens: int, tmp_path_factory):
    """(folder of tiny HF config ``name`` saved, random prompts of ``prompt_lens`` tokens, greedy SamplingParams with
    logprobs, bf16 engine kwargs at ``level`` with a 16-token budget that chunks the prompts)."""
    from test_models import _load_pair

    from pagedllm import SamplingParams

    hf, _ = _load_pair(name, tmp_path_factory)
    folder = str(tmp_path_factory.mktemp(f"fused-{name}"))
    hf.save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 200, (n,), generator=gen).tolist()} for n in prompt_lens]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=3)
    kw = dict(dtype="bfloat16", skip_tokenizer_init=True, max_model_len=64, kv_cache_memory_bytes=4 << 20,
              quantization="none", max_num_batched_tokens=16, enable_prefix_caching=False, cpu_isa=level)
    return folder, prompts, sp, kw


@pytest.mark.parametrize("backend,level", _BACKENDS)
@pytest.mark.parametrize("name", ["llama-tied-bias", "mistral-sliding", "qwen2-bias"])
def test_fused_stack_equals_python_layer_loop(name, backend, level, tmp_path_factory, monkeypatch):
    """llama-tied-bias: biases everywhere, head_dim 16 (prefill steps take the Python loop, decode steps the fused
    one); mistral-sliding: head_dim 32 and a 5-token window (prefill and mixed steps fused too on AMX; without AMX
    only decode-only steps); qwen2-bias: q/k/v bias. A 16-token budget chunks the prompts, so steps mix prefill
    chunks with decodes."""
    from pagedllm import LLM
    from pagedllm.layers import packed_linear

    folder, prompts, sp, kw = _tiny_case(name, level, (5, 23, 40), 8, tmp_path_factory)
    calls = {"fused": 0, "prefill": 0}
    orig = FusedStack.forward

    def counting(self, x, cos, kv_caches, meta):
        out = orig(self, x, cos, kv_caches, meta)
        if out is not None:
            calls["fused"] += 1
            calls["prefill"] += bool(meta.prefills)
        return out

    monkeypatch.setattr(FusedStack, "forward", counting)
    # level avx512_bf16: no AMX kernel at all (linears, prefill and decode attention), as on AMD Zen 4
    results = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_FUSED_STACK", fused)
        llm = LLM(folder, **kw)
        model = llm.llm_engine.engine_core.runner.model
        assert {m.backend for m in model.modules() if isinstance(m, packed_linear.PackedLinear)} == {backend}
        outs = llm.generate(prompts, sp, use_tqdm=False)
        results[fused] = [_tokens_and_logprobs(o) for o in outs]
        if fused == "1":
            assert calls["fused"] > 0
            if name == "mistral-sliding" and backend == "amx":  # head_dim 32: the AMX prefill kernel, fused too
                assert calls["prefill"] > 0
            if backend == "dpbf16":  # prefill attention in the fused loop is AMX only
                assert calls["prefill"] == 0
            fused_calls = dict(calls)
    assert calls == fused_calls  # PAGEDLLM_FUSED_STACK=0: no fused call
    assert all(len(r[0]) == 8 for r in results["1"])
    assert results["1"] == results["0"]


@pytest.mark.slow
@pytest.mark.skipif(not cpu_kernels.int4_gemv_supported(), reason="no int4 GEMV here (level none)")
def test_fused_stack_int4_smollm2_equals_python_layer_loop(monkeypatch):
    """The bundled SmolLM2 GGUF kept 4-bit (int4 linears on the int4 GEMV, int8 embedding / LM head outside the loop).
    Batch invariant (the default): decode-only steps fuse (the GEMV is the decode rows' kernel), steps with prefill
    rows take the Python loop (prefill rows on the C tile kernel); with PAGEDLLM_BATCH_INVARIANT=0, steps of up to 8
    tokens fuse and larger ones take the Python loop (its per-size int4 paths). Greedy tokens and logprobs equal
    fused vs not, in both modes."""
    from pagedllm import LLM, SamplingParams

    calls = []
    orig = FusedStack.forward
    monkeypatch.setattr(FusedStack, "forward", lambda self, *a: calls.append(orig(self, *a)) or calls[-1])
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    for invariant in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", invariant)
        results = {}
        for fused in ("1", "0"):
            monkeypatch.setenv("PAGEDLLM_FUSED_STACK", fused)
            calls.clear()
            llm = LLM(dtype="bfloat16", quantization="gguf", kv_cache_memory_bytes=32 << 20, max_model_len=256)
            kinds = {m.kind for m in llm.llm_engine.engine_core.runner.model.quant_modules.values()}
            assert "int4" in kinds
            # both prompts in one prefill step (13 tokens), then one alone (6 tokens)
            outs = llm.generate(prompts, sp, use_tqdm=False) + llm.generate(prompts[:1], sp, use_tqdm=False)
            results[fused] = [_tokens_and_logprobs(o) for o in outs]
            if fused == "1":  # decode steps fused; the 13-token prefill step (and, batch invariant, every
                assert any(c is not None for c in calls) and any(c is None for c in calls)  # prefill) not
            else:
                assert not calls
        assert results["1"] == results["0"], invariant


@pytest.mark.slow
@pytest.mark.skipif(kernels.lib("kquant") is None, reason="no kquant kernels here (level none)")
def test_fused_stack_kquant_qwen_equals_python_layer_loop(monkeypatch):
    """Qwen2.5-Coder-0.5B GGUF as stored (Q5_0 / Q8_0 / Q6_K / Q4_K linears, fused qkv shards of different types, a
    bf16 qkv bias): decode-only steps fuse (kquant_matmul on the decode rows' activation width, then the bias added
    as torch adds it), steps with prefill rows take the Python loop. Greedy tokens and logprobs equal fused vs not,
    for two prompts decoding side by side (batch 2) and one alone."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.model_files import qwen25_05b_path

    calls = []
    orig = FusedStack.forward
    monkeypatch.setattr(FusedStack, "forward", lambda self, *a: calls.append(orig(self, *a)) or calls[-1])
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    results = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_FUSED_STACK", fused)
        calls.clear()
        llm = LLM(model=qwen25_05b_path(), quantization="gguf", kv_cache_memory_bytes=32 << 20, max_model_len=256)
        model = llm.llm_engine.engine_core.runner.model
        assert {m.kind for m in model.quant_modules.values()} == {"kquant"}
        outs = llm.generate(prompts, sp, use_tqdm=False) + llm.generate(prompts[:1], sp, use_tqdm=False)
        results[fused] = [_tokens_and_logprobs(o) for o in outs]
        if fused == "1":
            assert any(c is not None for c in calls) and any(c is None for c in calls)
        else:
            assert not calls
        del llm
    assert results["1"] == results["0"]


@pytest.mark.skipif(not cpu_kernels.int4_gemv_supported(), reason="no int4 GEMV here (level none)")
def test_fused_stack_int4_with_bias_equals_python_layer_loop(tmp_path_factory, monkeypatch):
    """int4 linears with a bf16 bias (a Qwen2 model's ``self_int4`` draft: q/k/v bias, every decoder linear
    requantized to int4): the draft's decode steps take the fused loop (the bias added after the int4 GEMV as torch
    adds it), and its proposals, the target's tokens and logprobs equal those of the Python layer loop."""
    from test_models import _load_pair

    from pagedllm import LLM, SamplingParams

    hf, _ = _load_pair("qwen2-bias", tmp_path_factory)
    folder = str(tmp_path_factory.mktemp("fused-int4-bias"))
    hf.save_pretrained(folder)
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 200, (n,), generator=gen).tolist()} for n in (7, 19)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    kw = dict(dtype="bfloat16", skip_tokenizer_init=True, max_model_len=64, kv_cache_memory_bytes=8 << 20,
              quantization="none", speculative_config={"method": "self_int4", "num_speculative_tokens": 3})
    fused_hidden = []
    orig = FusedStack.forward

    def counting(self, x, *a):
        out = orig(self, x, *a)
        if out is not None and self.any_int4:
            fused_hidden.append(x.shape[0])
        return out

    monkeypatch.setattr(FusedStack, "forward", counting)
    results = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_FUSED_STACK", fused)
        llm = LLM(folder, **kw)
        drafter = llm.llm_engine.engine_core.runner.drafter
        assert any(m.bias is not None and m.kind == "int4" for m in drafter.draft.modules()
                   if type(m).__name__ == "QuantLinear")
        proposals = []
        propose = drafter.propose
        drafter.propose = lambda *a: proposals.append(propose(*a)) or proposals[-1]
        outs = llm.generate(prompts, sp, use_tqdm=False)
        results[fused] = ([_tokens_and_logprobs(o) for o in outs], proposals)
        assert (len(fused_hidden) > 0) == (fused == "1")
        fused_hidden.clear()
    assert results["1"] == results["0"]
    assert sum(len(p) for step in results["1"][1] for p in step) > 10


def _count_gemma_fused(monkeypatch) -> dict:
    from pagedllm.models.fused_stack import GemmaFusedStack

    calls = {"fused": 0, "declined": 0}
    orig = GemmaFusedStack.forward_gemma

    def counting(self, *a):
        out = orig(self, *a)
        calls["fused" if out is not None else "declined"] += 1
        return out

    monkeypatch.setattr(GemmaFusedStack, "forward_gemma", counting)
    return calls


@pytest.mark.parametrize("backend,level", _BACKENDS)
@pytest.mark.parametrize("name", ["gemma3", "gemma3-softcap-bias-linear-rope"])
def test_gemma_fused_stack_equals_python_layer_loop(name, backend, level, tmp_path_factory, monkeypatch):
    """Gemma 3 in the fused loop (gemma_stack_forward): its six norms, GeGLU, two rotary tables, a 5-token window on
    the sliding layers (their own KV cache groups and block tables: prompts and outputs pass the window), a q/k/v
    bias and an untied head in the second config. Decode steps fuse, prefill steps take the Python loop; greedy
    tokens and logprobs equal PAGEDLLM_FUSED_STACK=0's, three prompts side by side."""
    from pagedllm import LLM
    from pagedllm.layers import packed_linear

    folder, prompts, sp, kw = _tiny_case(name, level, (3, 9, 17), 12, tmp_path_factory)
    calls = _count_gemma_fused(monkeypatch)
    results, counts = {}, {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_FUSED_STACK", fused)
        calls.update(fused=0, declined=0)
        llm = LLM(folder, **kw)
        model = llm.llm_engine.engine_core.runner.model
        assert {m.backend for m in model.modules() if isinstance(m, packed_linear.PackedLinear)} == {backend}
        results[fused] = [_tokens_and_logprobs(o) for o in llm.generate(prompts, sp, use_tqdm=False)]
        counts[fused] = dict(calls)
        del llm
    assert counts["1"]["fused"] >= 11 and counts["1"]["declined"] > 0  # decode steps fused, prefill steps not
    assert counts["0"] == {"fused": 0, "declined": 0}
    assert all(len(r[0]) == 12 for r in results["1"])
    assert results["1"] == results["0"]


@pytest.mark.slow
@pytest.mark.skipif(kernels.lib("kquant") is None, reason="no kquant kernels here (level none)")
def test_gemma_fused_stack_kquant_equals_python_layer_loop(monkeypatch):
    """Gemma-3-270M Q4_K_M as stored (Q5_0 / Q8_0 / Q4_K / Q6_K linears, a tied Q8_0 head outside the loop): decode
    steps fused; greedy tokens and logprobs equal the Python loop's, two prompts side by side and one alone."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.model_files import gemma3_270m_path

    calls = _count_gemma_fused(monkeypatch)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    results = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_FUSED_STACK", fused)
        calls.update(fused=0, declined=0)
        llm = LLM(model=gemma3_270m_path(), quantization="gguf", kv_cache_memory_bytes=32 << 20, max_model_len=256)
        outs = llm.generate(prompts, sp, use_tqdm=False) + llm.generate(prompts[:1], sp, use_tqdm=False)
        results[fused] = [_tokens_and_logprobs(o) for o in outs]
        assert (calls["fused"] >= 18) == (fused == "1")
        del llm
    assert results["1"] == results["0"]
