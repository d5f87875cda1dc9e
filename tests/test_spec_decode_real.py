"""Speculative decoding on the real SmolLM2-135M-Instruct (bundled GGUF), on the code-editing workload it is for.

Greedy output with n-gram speculation must equal greedy output without it, token for token, with prefix caching
(the prompts share a system prompt; one is asked twice), chunked prefill, preemption and n = 2 in the mix: in float32,
and in bf16 and the 4-bit GGUF at every ISA level this CPU runs, where a verify row's logits must equal the plain
decode step's bit for bit (verify rows run the decode kernels: ``build_attention_metadata(verify=...)``,
``step_rows``).
"""

import json

import pytest
import torch

from pagedllm.benchmarks.datasets import load_tokenizer, make_requests
from pagedllm.entrypoints.cli import main as cli_main
from pagedllm.entrypoints.llm import LLM
from pagedllm.kernels.config import LEVELS, supported_levels
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
        # chunked: verify rows move the prompts' chunk boundaries (prefill attention is chunk-invariant); preempt:
        # the recompute runs the output tokens as decode rows (build_attention_metadata's prefill_rows), as their
        # decode steps ran them
        assert got == ref, f"{name}: output differs from no speculation"
        core = eng.llm_engine.engine_core
        st = core.scheduler.spec_stats
        assert st.num_draft_tokens > 100 and st.num_accepted_tokens > 0.3 * st.num_draft_tokens, (name, st)
        if name == "preempt":
            assert core.scheduler.num_preemptions > 0
        pool = core.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks - 1
    # and without speculation, the same preemption (recompute) leaves the output as it was
    eng = smollm.with_engine_args(**variants["preempt"])
    got = [[c.token_ids for c in o.outputs] for o in eng.generate(prompts, params, use_tqdm=False)]
    assert eng.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert got == ref


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


def _record_logits(llm):
    """Wraps the model's forward and ``compute_logits``: each call appends ``(positions of the logits rows, {position:
    input token} of the step, logits [rows, V])`` (one request per step: its logits rows are its last rows)."""
    model = llm.llm_engine.engine_core.runner.model
    rec, cur = [], {}
    fwd, logits_fn = model.forward, model.compute_logits

    def forward(input_ids, positions, *a, **kw):
        cur["pos"], cur["ids"] = positions.tolist(), input_ids.tolist()
        return fwd(input_ids, positions, *a, **kw)

    def compute_logits(hidden):
        out = logits_fn(hidden)
        rec.append((cur["pos"][-out.shape[0]:], dict(zip(cur["pos"], cur["ids"])), out.clone()))
        return out

    model.forward, model.compute_logits = forward, compute_logits
    return rec, lambda: (delattr(model, "forward"), delattr(model, "compute_logits"))


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("quantization", ["none", "gguf"])  # dequantized to bf16, and the bundled 4-bit
def test_smollm2_bf16_greedy_identical_with_ngram_at_each_level(quantization, level):
    """bf16 activations: greedy output identical with and without n-gram speculation on several prompts (code-edit,
    one asked twice for a prefix-cache hit, and a chat prompt), prefill chunked by a 48-token budget; and on one
    prompt alone, every verify row's logits equal bit for bit those the plain decode step computed at its position
    (rows whose context equals the plain run's). Level ``none`` (torch / oneDNN paths, not promised batch
    invariant: measured, its logits differ by ~1e-5) is held to identical output only, and a difference there is an
    expected failure, as in tests/test_isa_levels.py."""
    if level not in supported_levels():
        pytest.skip(f"this CPU runs below {level}")
    llm = LLM(None, dtype="bfloat16", quantization=quantization, cpu_isa=level, max_model_len=1024,
              kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=48, enable_prefix_caching=True)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in make_requests("code-edit", tok, 3, output_len=48,
                                                                                 seed=3)]
    prompts.append(dict(prompts[0]))
    chat = tok.apply_chat_template([{"role": "user", "content": "List the planets of the solar system in order, "
                                     "one per line, then list them again in reverse order."}],
                                   add_generation_prompt=True, tokenize=False)
    prompts.append({"prompt_token_ids": tok.encode(chat, add_special_tokens=False)})
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    spec = llm.with_engine_args(speculative_config=SPEC)

    # one prompt alone: verify rows' logits against the decode steps'
    rec, undo = _record_logits(llm)
    ref0 = llm.generate([prompts[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
    undo()
    full = list(prompts[0]["prompt_token_ids"]) + list(ref0)
    plain = {p: lg[j] for pos, _, lg in rec for j, p in enumerate(pos)}
    rec, undo = _record_logits(spec)
    got0 = spec.generate([prompts[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
    undo()
    compared = differ = 0
    for pos, ids, lg in rec:
        if len(pos) < 2:
            continue  # no drafts this step
        for j, p in enumerate(pos):
            if p in plain and all(full[t] == x for t, x in ids.items() if t <= p):
                compared += 1
                differ += not torch.equal(lg[j], plain[p])
    assert compared >= 10
    bitwise = differ == 0

    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    st = spec.llm_engine.engine_core.scheduler.spec_stats
    assert st.num_accepted_tokens > 0.3 * st.num_draft_tokens > 20, st
    identical = got == ref and got0 == ref0
    if level == "none":  # torch paths: not promised batch or chunk invariant (MKL sums by the number of rows)
        if not identical:  # say which part differed: the verify rows alone, or the batch whose chunks moved
            pytest.xfail(f"level none: {differ}/{compared} verify rows' logits differ; the prompt alone "
                         f"{'differs' if got0 != ref0 else 'is identical'}, the batch (verify rows move the other "
                         f"prompts' prefill chunk boundaries; torch's prefill is not chunk invariant) "
                         f"{'differs' if got != ref else 'is identical'}")
    else:
        assert bitwise, f"{differ} of {compared} verify rows' logits differ from the decode step's"
    assert got0 == ref0
    # verify rows take token budget and so move other prompts' chunk boundaries: identical because prefill attention
    # is chunk-invariant at every level with our kernels (the AMX kernel at amx, paged_prefill below)
    assert got == ref, [i for i, (a, b) in enumerate(zip(got, ref)) if a != b]
