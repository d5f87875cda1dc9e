"""The fused C layer loop (pagedllm/models/fused_stack.py) against the model's Python layer loop: the same kernels in
the same order, so greedy tokens and their logprobs must be equal exactly, on decode-only and mixed steps."""

import pytest
import torch

from pagedllm import kernels
from pagedllm.layers.packed_linear import linear_backend
from pagedllm.layers.quantization import cpu_kernels
from pagedllm.models.fused_stack import FusedStack

# The bf16 fused loop needs a packed bf16 linear kernel at this level (AMX; or another LINEAR_BACKENDS entry).
needs_packed_kernel = pytest.mark.skipif(linear_backend(64, 64) is None, reason="no packed bf16 linear kernel here")


def _tokens_and_logprobs(out) -> tuple:
    c = out.outputs[0]
    return c.token_ids, [{k: v.logprob for k, v in d.items()} for d in c.logprobs]


@needs_packed_kernel
@pytest.mark.parametrize("name", ["llama-tied-bias", "mistral-sliding", "qwen2-bias"])
def test_fused_stack_equals_python_layer_loop(name, tmp_path_factory, monkeypatch):
    """llama-tied-bias: biases everywhere, head_dim 16 (prefill steps take the Python loop, decode steps the fused
    one); mistral-sliding: head_dim 32 and a 5-token window (prefill and mixed steps fused too); qwen2-bias: q/k/v
    bias. A 16-token budget chunks the prompts, so steps mix prefill chunks with decodes."""
    from test_models import _load_pair

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
    results = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_FUSED_STACK", fused)
        llm = LLM(folder, **kw)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        results[fused] = [_tokens_and_logprobs(o) for o in outs]
        if fused == "1":
            assert calls["fused"] > 0
            if name == "mistral-sliding":  # head_dim 32: the AMX prefill kernel runs, so prefill steps fuse too
                assert calls["prefill"] > 0
            fused_calls = dict(calls)
    assert calls == fused_calls  # PAGEDLLM_FUSED_STACK=0: no fused call
    assert all(len(r[0]) == 8 for r in results["1"])
    assert results["1"] == results["0"]


@pytest.mark.slow
@pytest.mark.skipif(not cpu_kernels.int4_gemv_supported(), reason="no int4 GEMV (AVX512-VNNI/VBMI/BF16) here")
def test_fused_stack_int4_smollm2_equals_python_layer_loop(monkeypatch):
    """The bundled SmolLM2 GGUF kept 4-bit (int4 linears on the int4 GEMV, int8 embedding / LM head outside the loop).
    Batch invariant (the default): the GEMV takes every step, so every step fuses (prefill too, on AMX); with
    PAGEDLLM_BATCH_INVARIANT=0, steps of up to 8 tokens fuse and larger prefill steps take the Python loop (its
    per-size int4 paths). Greedy tokens and logprobs equal fused vs not, in both modes."""
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
            if fused == "1":
                assert any(c is not None for c in calls)
                if invariant == "0":
                    assert any(c is None for c in calls)  # the 13-token prefill step
                elif kernels.lib("amx") is not None:
                    assert all(c is not None for c in calls)
            else:
                assert not calls
        assert results["1"] == results["0"], invariant
