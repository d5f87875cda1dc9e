"""Speculative decoding on the real SmolLM2-135M-Instruct (bundled GGUF), on the code-editing workload it is for.

Greedy output with n-gram speculation must equal greedy output without it, token for token, with prefix caching
(the prompts share a system prompt; one is asked twice), chunked prefill, preemption and n = 2 in the mix. float32
activations: in bf16 near-tied logits can flip with the batch shape (see conftest.py), which verification changes.
"""

import json

import pytest

from pagedllm.benchmarks.datasets import load_tokenizer, make_requests
from pagedllm.entrypoints.cli import main as cli_main
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
        "step_token_budget": 64}


@pytest.fixture(scope="module")
def smollm():
    return LLM(None, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_greedy_identical_with_ngram(smollm):
    tok = smollm.get_tokenizer()
    reqs = make_requests("code-edit", tok, 4, output_len=80, seed=1)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    prompts.append(dict(prompts[0]))  # asked twice: a prefix-cache hit on the whole prompt
    params = [SamplingParams(temperature=0.0, max_tokens=80, n=2 if i == 1 else 1) for i in range(len(prompts))]
    ref = [[c.token_ids for c in o.outputs] for o in smollm.generate(prompts, params, use_tqdm=False)]
    assert ref[1][0] == ref[1][1]
    longest = max(len(p["prompt_token_ids"]) for p in prompts) + 80
    layout = smollm.llm_engine.engine_core.runner.layout
    variants = {
        "batched": {},
        "chunked": {"max_num_batched_tokens": 48},
        "preempt": {"num_gpu_blocks_override": layout.blocks_for_one_request(longest, 16, 64) + 4,
                    "max_model_len": longest, "max_num_batched_tokens": 64},
    }
    for name, extra in variants.items():
        eng = smollm.with_engine_args(speculative_config=SPEC, **extra)
        got = [[c.token_ids for c in o.outputs] for o in eng.generate(prompts, params, use_tqdm=False)]
        assert got == ref, f"{name}: output differs from no speculation"
        core = eng.llm_engine.engine_core
        st = core.scheduler.spec_stats
        assert st.num_draft_tokens > 100 and st.num_accepted_tokens > 0.3 * st.num_draft_tokens, (name, st)
        if name == "preempt":
            assert core.scheduler.num_preemptions > 0
        pool = core.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks - 1


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_stop_strings_cut_accepted_drafts_exactly(smollm):
    """A stop string completed by a token in the middle of a step's accepted drafts ends the output right there:
    token ids, text, finish and stop reasons equal those without speculation."""
    tok = smollm.get_tokenizer()
    reqs = make_requests("code-edit", tok, 6, output_len=120, seed=2)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    stops = [["return"], ["):"], ["self."], ["\n\n"], ["0"], ["in range"]]
    params = [SamplingParams(temperature=0.0, max_tokens=120, stop=st) for st in stops]

    def run(llm):
        return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                for o in llm.generate(prompts, params, use_tqdm=False)]

    ref = run(smollm)
    assert sum(r[2] == "stop" and r[3] is not None for r in ref) >= 3
    eng = smollm.with_engine_args(speculative_config=SPEC)
    assert run(eng) == ref
    assert eng.llm_engine.engine_core.scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_bench_latency_and_speculative_ab_print_acceptance(capsys, tmp_path):
    cfg = json.dumps(SPEC)
    small = ["--max-model-len", "1024", "--kv-cache-memory-bytes", "64M", "--dtype", "float32"]
    rc = cli_main(["bench", "latency", "--dataset-name", "code-edit", "--output-len", "24", "--num-iters", "1",
                   "--num-iters-warmup", "0", "--speculative-config", cfg, *small, "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["dataset_name"] == "code-edit" and data["spec_num_draft_tokens"] > 0
    assert 0 <= data["spec_acceptance_rate"] <= 1 and data["spec_mean_acceptance_length"] >= 1
    out = tmp_path / "ab.json"
    rc = cli_main(["bench", "speculative", "--num-prompts", "2", "--rounds", "1", "--output-len", "24",
                   "--speculative-config", cfg, *small, "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "decode speed-up" in text and "acceptance rate" in text
    res = json.loads(out.read_text())
    assert res["num_runs"] == 2 and res["num_identical"] == 2
    assert [r["order"] for r in res["runs"]] == [["base", "spec"], ["spec", "base"]]
