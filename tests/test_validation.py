"""Bad input raises ValueError naming the field, before anything reaches the engine, and never disturbs others."""

import pytest
import torch

from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 300


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                   initializer_range=0.3)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=64, block_size=4,
               kv_cache_memory_bytes=1 << 20, max_logprobs=5)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
])
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, params, field", [
    ([], SamplingParams(max_tokens=4), "prompt"),
    ([1, 2, VOCAB], SamplingParams(max_tokens=4), "prompt_token_ids"),
    ([1, -1], SamplingParams(max_tokens=4), "prompt_token_ids"),
    (list(range(1, 66)), SamplingParams(max_tokens=4), "max_model_len"),
    (list(range(1, 61)), SamplingParams(max_tokens=10), "max_tokens"),
    ([1, 2, 3], SamplingParams(max_tokens=4, logprobs=6), "logprobs"),
    ([1, 2, 3], SamplingParams(max_tokens=4, prompt_logprobs=6), "prompt_logprobs"),
    ([1, 2, 3], SamplingParams(max_tokens=4, logit_bias={VOCAB + 5: 1.0}), "logit_bias"),
    ([1, 2, 3], SamplingParams(max_tokens=4, allowed_token_ids=[VOCAB]), "allowed_token_ids"),
    ("text prompt", SamplingParams(max_tokens=4), "prompt"),
])
def test_engine_validation(tiny_llm, prompt, params, field):
    eng = tiny_llm.llm_engine
    with pytest.raises(ValueError, match=field):
        tiny_llm.generate([{"prompt_token_ids": prompt}] if isinstance(prompt, list) else [prompt], params,
                          use_tqdm=False)
    assert not eng.has_unfinished_requests()


def test_bad_request_in_batch_rejects_before_running(tiny_llm):
    eng = tiny_llm.llm_engine
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError):
        tiny_llm.generate([good, {"prompt_token_ids": [VOCAB + 1]}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not eng.has_unfinished_requests()  # the good one was never queued either


def test_bad_request_does_not_disturb_running_ones(tiny_llm):
    eng = tiny_llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = tiny_llm.generate([{"prompt_token_ids": [3, 4, 5, 6]}], sp, use_tqdm=False)[0].outputs[0].token_ids
    eng.add_request("good", {"prompt_token_ids": [3, 4, 5, 6]}, sp.clone())
    eng.step()
    for bad in ([VOCAB + 1], [], list(range(1, 70))):
        with pytest.raises(ValueError):
            eng.add_request("bad", {"prompt_token_ids": bad}, sp.clone())
    with pytest.raises(ValueError):
        eng.add_request("good", {"prompt_token_ids": [1]}, sp.clone())  # duplicate id
    got = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got = o.outputs[0].token_ids
    assert got == ref


def test_unknown_engine_arg():
    with pytest.raises(TypeError, match="bogus"):
        LLM(bogus=1)


def test_bad_engine_args(tmp_path):
    from pagedllm.config import EngineArgs

    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(block_size=3).create_engine_config()
    with pytest.raises(ValueError, match="dtype"):
        EngineArgs(dtype="int3").create_engine_config()
    with pytest.raises(FileNotFoundError):
        EngineArgs(model=str(tmp_path / "nope.gguf")).create_engine_config()
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be a non-negative integer"):
        EngineArgs(long_prefill_token_threshold=-1).create_engine_config()
    with pytest.raises(ValueError, match="long_prefill_token_threshold needs chunked prefill"):
        EngineArgs(long_prefill_token_threshold=64, enable_chunked_prefill=False).create_engine_config()


def test_long_prefill_token_threshold_from_the_cli():
    """vLLM's flag reaches the scheduler: ``--long-prefill-token-threshold 96`` caps each request's prompt chunk."""
    from pagedllm.entrypoints.cli import build_parser, engine_args_from_namespace

    ns = build_parser().parse_args(["serve", "--long-prefill-token-threshold", "96"])
    assert engine_args_from_namespace(ns).long_prefill_token_threshold == 96
    ns = build_parser().parse_args(["serve"])
    assert engine_args_from_namespace(ns).long_prefill_token_threshold == 0


def test_kv_too_small_for_max_model_len(tiny_llm):
    with pytest.raises(ValueError, match="max_model_len"):
        tiny_llm.with_engine_args(num_gpu_blocks_override=4, max_model_len=64)


# ---------------------------------------------------------------------------------------------------- issue 18
@pytest.mark.parametrize("params, prompt, field", [
    (dict(seed=18446744073709551616), [1, 2, 3], "seed"),  # 2**64: torch.Generator raised inside step()
    (dict(seed=-(2 ** 63) - 1), [1, 2, 3], "seed"),
    (dict(seed=2 ** 64 - 1, n=2, temperature=1.0), [1, 2, 3], "seed"),  # the second child's seed + 1 overflows
    (dict(n=129), [1, 2, 3], "n"),
    (dict(temperature=2.5), [1, 2, 3], "temperature"),
    (dict(top_k=VOCAB + 1), [1, 2, 3], "top_k"),
    (dict(repetition_penalty=float("inf")), [1, 2, 3], "repetition_penalty"),
    (dict(stop=["x"] * 65), [1, 2, 3], "stop"),
    (dict(stop=["\ud800"]), [1, 2, 3], "stop"),
    (dict(stop_token_ids=list(range(1025))), [1, 2, 3], "stop_token_ids"),
    (dict(logit_bias={1: float("nan")}), [1, 2, 3], "logit_bias"),
    (dict(allowed_token_ids=list(range(VOCAB)) * 14), [1, 2, 3], "allowed_token_ids"),
    (dict(), {"prompt_token_ids": [1, 2] * 10, "cache_salt": "\ud800"}, "cache_salt"),  # the block hasher raised
    (dict(), {"prompt_token_ids": [1.5]}, "prompt"),
])
def test_engine_killers_are_refused_up_front(tiny_llm, params, prompt, field):
    eng = tiny_llm.llm_engine
    with pytest.raises(ValueError, match=field) as e:
        tiny_llm.generate([prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt}],
                          SamplingParams(max_tokens=4, **params), use_tqdm=False)
    assert getattr(e.value, "param", field) in (field, "prompt")
    assert not eng.has_unfinished_requests()
    out = tiny_llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0),
                            use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_largest_valid_seed_runs(tiny_llm):
    out = tiny_llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                            SamplingParams(max_tokens=3, seed=2 ** 64 - 2, n=2, temperature=1.0), use_tqdm=False)
    assert [len(c.token_ids) for c in out[0].outputs] == [3, 3]


def _run(eng):
    got = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o
    return got


def test_per_request_fault_fails_alone_offline(tiny_llm):
    """A request whose output processing raises (the fault-injection hook) ends with finish_reason "error" and is
    reported by take_request_errors; the others in the batch finish with their solo outputs."""
    from pagedllm.engine.exceptions import RequestFailedError

    eng = tiny_llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = {f"g{i}": [3 + i, 4, 5, 6] for i in range(4)}
    solo = {rid: tiny_llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
            for rid, p in prompts.items()}
    for rid, p in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": p}, sp.clone())
    eng.add_request("bad", {"prompt_token_ids": [9, 9, 9]}, SamplingParams(temperature=0.0, max_tokens=8, n=2))
    eng.step()
    for c in eng.output_processor.parents["bad"].children:
        c.fault = "request"
    got = _run(eng)
    errors = eng.take_request_errors()
    assert [rid for rid, _ in errors] == ["bad"] and isinstance(errors[0][1], RequestFailedError)
    assert {c.finish_reason for c in got["bad"].outputs} == {"error"}
    assert {rid: got[rid].outputs[0].token_ids for rid in prompts} == solo
    assert not eng.engine_core.scheduler.requests and eng.engine_core.kv_cache_manager.usage == 0


def test_request_setup_fault_queues_nothing(tiny_llm):
    """A request whose set-up raises in the engine (here: a salt the validator would refuse, hashed on add) is
    not queued and leaves the engine unharmed."""
    import time

    from pagedllm.engine.input_processor import EngineCoreRequest

    eng = tiny_llm.llm_engine
    req = EngineCoreRequest("raw", None, [1, 2, 3, 4] * 3, SamplingParams(max_tokens=2), time.time(),
                            cache_salt="\ud800")
    with pytest.raises(UnicodeEncodeError):
        eng.add_core_request(req)
    assert not eng.has_unfinished_requests() and "raw" not in eng.output_processor.parents
    assert len(_run_one(tiny_llm)) == 2


def _run_one(tiny_llm):
    return tiny_llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)[0] \
        .outputs[0].token_ids


def test_forward_fault_propagates(tiny_llm):
    from pagedllm.engine.fault_injection import InjectedFault

    eng = tiny_llm.with_engine_args().llm_engine  # a fresh engine: this one is left broken
    eng.add_request("f", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))
    eng.engine_core.forward_fault_req_ids.add("f")
    with pytest.raises(InjectedFault):
        eng.step()


def test_prompt_logprobs_one_entry_per_prompt_token_with_n(tiny_llm):
    out = tiny_llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                            SamplingParams(max_tokens=2, n=3, temperature=1.0, seed=1, prompt_logprobs=1),
                            use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == 4 and out.prompt_logprobs[0] is None
    assert all(d is not None and t in d for d, t in zip(out.prompt_logprobs[1:], [6, 7, 8]))
