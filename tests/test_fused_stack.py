"""The fused C layer loop (pagedllm/models/fused_stack.py) against the model's Python layer loop: the same kernels in
the same order, so greedy tokens and their logprobs must be equal exactly, on decode-only and mixed steps; with the
linears on the AMX kernel, and on the dpbf16 kernel with every AMX kernel off (as on a CPU without AMX)."""

import pytest
import torch

from pagedllm.layers.packed_linear import amx_linear_supported, dpbf16_backend_supported
from pagedllm.models.fused_stack import FusedStack

_NEEDS_AMX = pytest.mark.skipif(not amx_linear_supported(), reason="the fused loop needs the AMX linear kernel")
_BACKENDS = [pytest.param("amx", marks=_NEEDS_AMX),
             pytest.param("dpbf16", marks=pytest.mark.skipif(not dpbf16_backend_supported(),
                                                              reason="no AVX512-BF16 for the dpbf16 kernel"))]


def _tokens_and_logprobs(out) -> tuple:
    c = out.outputs[0]
    return c.token_ids, [{k: v.logprob for k, v in d.items()} for d in c.logprobs]


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("name", ["llama-tied-bias", "mistral-sliding", "qwen2-bias"])
def test_fused_stack_equals_python_layer_loop(name, backend, tmp_path_factory, monkeypatch):
    """llama-tied-bias: biases everywhere, head_dim 16 (prefill steps take the Python loop, decode steps the fused
    one); mistral-sliding: head_dim 32 and a 5-token window (prefill and mixed steps fused too on AMX; without AMX
    only decode-only steps); qwen2-bias: q/k/v bias. A 16-token budget chunks the prompts, so steps mix prefill
    chunks with decodes."""
    from test_models import _load_pair

    from pagedllm.layers import packed_linear

    from pagedllm import LLM, SamplingParams

    hf, _ = _load_pair(name, tmp_path_factory)
    folder = str(tmp_path_factory.mktemp(f"fused-{name}"))
    hf.save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 200, (n,), generator=gen).tolist()} for n in (5, 23, 40)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    kw = dict(dtype="bfloat16", skip_tokenizer_init=True, max_model_len=64, kv_cache_memory_bytes=4 << 20,
              quantization="none", max_num_batched_tokens=16, enable_prefix_caching=False)
    calls = {"fused": 0, "prefill": 0}
    orig = FusedStack.forward

    def counting(self, x, cos, kv_caches, meta):
        out = orig(self, x, cos, kv_caches, meta)
        if out is not None:
            calls["fused"] += 1
            calls["prefill"] += bool(meta.prefills)
        return out

    monkeypatch.setattr(FusedStack, "forward", counting)
    if backend == "dpbf16":  # no AMX kernel at all (linears, prefill and decode attention), as on AMD Zen 4
        monkeypatch.setenv("PAGEDLLM_AMX_LINEAR", "0")
        monkeypatch.setenv("PAGEDLLM_AMX_ATTENTION", "0")
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


@_NEEDS_AMX
@pytest.mark.slow
def test_fused_stack_int4_smollm2_equals_python_layer_loop(monkeypatch):
    """The bundled SmolLM2 GGUF kept 4-bit (int4 linears on the int4 GEMV, int8 embedding / LM head outside the loop):
    steps of up to 8 tokens (decode, a short prompt's prefill) take the fused loop, larger prefill steps the Python one;
    greedy tokens and logprobs equal."""
    from pagedllm import LLM, SamplingParams

    calls = []
    orig = FusedStack.forward
    monkeypatch.setattr(FusedStack, "forward", lambda self, *a: calls.append(orig(self, *a)) or calls[-1])
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    results = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_FUSED_STACK", fused)
        llm = LLM(dtype="bfloat16", quantization="gguf", kv_cache_memory_bytes=32 << 20, max_model_len=256)
        kinds = {m.kind for m in llm.llm_engine.engine_core.runner.model.quant_modules.values()}
        assert "int4" in kinds
        # both prompts in one prefill step (13 tokens: the Python loop), then one alone (6 tokens: fused prefill)
        outs = llm.generate(prompts, sp, use_tqdm=False) + llm.generate(prompts[:1], sp, use_tqdm=False)
        results[fused] = [_tokens_and_logprobs(o) for o in outs]
        if fused == "1":
            assert any(c is not None for c in calls) and any(c is None for c in calls)
            n_calls = len(calls)
    assert len(calls) == n_calls
    assert results["1"] == results["0"]
