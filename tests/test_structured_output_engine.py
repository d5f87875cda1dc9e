"""Structured outputs through the engine on the bundled SmolLM2: a grammar that allows everything changes nothing
(greedy), preemption in the middle of constrained requests still ends valid (and equal to the run without
preemption), n > 1 children each follow the grammar, compiled grammars are cached, and a slow compile never
stalls the other requests of the batch."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "color": {"type": "string", "enum": ["red", "green", "blue"]}}, "required": ["ok", "n", "color"],
    "additionalProperties": False}
PROMPTS = ["Describe a traffic light in JSON.", "Give me a JSON object about the sky.",
           "Write JSON for a green apple.", "JSON please: is water wet?"]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256, max_num_seqs=8)


def _chat(llm, prompts, sp):
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], sp, use_tqdm=False)


def test_allow_everything_grammar_equals_unconstrained(llm):
    plain = _chat(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12))
    anything = _chat(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, structured_outputs=(
        StructuredOutputsParams(regex=r"(.|\n)*"))))
    for a, b in zip(plain, anything):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason


def test_constrained_json_is_valid_for_each_child_and_cached(llm):
    so_mgr = llm.llm_engine.engine_core.structured_output_manager
    before = so_mgr.num_compiles
    sp = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=48,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = _chat(llm, PROMPTS[:2], sp)
    for o in outs:
        assert len(o.outputs) == 3
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
            assert c.text == json.dumps(json.loads(c.text))  # compact: json.dumps' separators, no other space
    assert so_mgr.num_compiles - before <= 1  # six matchers, one compiled grammar (or a cache hit)


def test_preemption_mid_constrained_request_ends_valid_and_unchanged(llm):
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=48, structured_outputs=StructuredOutputsParams(
        json=SCHEMA))
    ref = _chat(llm, PROMPTS, sp)
    # 11 blocks of 16 tokens: each request (~40 prompt + ~25 output tokens) fits alone, the four together don't
    # -> recompute preemption.
    small = llm.with_engine_args(num_gpu_blocks_override=11, kv_cache_memory_bytes=None, max_model_len=160)
    outs = _chat(small, PROMPTS, sp)
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    for r, o in zip(ref, outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert c.token_ids == r.outputs[0].token_ids  # seeded: preemption changes nothing


def test_slow_compile_does_not_stall_the_batch(llm):
    eng = llm.llm_engine
    so_mgr = eng.engine_core.structured_output_manager
    release = threading.Event()
    real_compile = so_mgr._compile

    def slow_compile(key):
        release.wait(60)
        return real_compile(key)

    so_mgr._compile = slow_compile
    try:
        eng.add_request("plain", "Count: one, two,", SamplingParams(temperature=0, max_tokens=6))
        eng.add_request("json", "JSON:", SamplingParams(temperature=0, max_tokens=30, structured_outputs=(
            StructuredOutputsParams(choice=["never compiled before A", "never compiled before B"]))))
        finished = {}
        for _ in range(200):
            for ro in eng.step():
                if ro.finished:
                    finished[ro.request_id] = ro
            if "plain" in finished:
                break
        assert "plain" in finished and "json" not in finished  # the plain request ran while the grammar compiled
        waiting = eng.engine_core.scheduler.requests["json"]  # ... and the constrained one prefilled meanwhile,
        assert waiting.awaiting_grammar and waiting.num_output_tokens == 0  # up to the token it samples
        assert waiting.num_computed_tokens == waiting.num_prompt_tokens - 1 > 0
        release.set()
        while eng.has_unfinished_requests():
            for ro in eng.step():
                if ro.finished:
                    finished[ro.request_id] = ro
        assert finished["json"].outputs[0].text in ("never compiled before A", "never compiled before B")
    finally:
        release.set()
        so_mgr._compile = real_compile


def test_abort_while_waiting_for_grammar(llm):
    eng = llm.llm_engine
    so_mgr = eng.engine_core.structured_output_manager
    release = threading.Event()
    real_compile = so_mgr._compile
    so_mgr._compile = lambda key: (release.wait(60), real_compile(key))[1]
    try:
        eng.add_request("a", "x", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            regex="abandoned[0-9]")))
        assert eng.has_unfinished_requests()
        eng.abort_request("a")
        release.set()
        assert not so_mgr.has_pending()
        assert not eng.has_unfinished_requests()
    finally:
        release.set()
        so_mgr._compile = real_compile


def _hold_compiles(so_mgr):
    """Makes every compile wait for the returned event (then compile for real); returns (event, undo)."""
    release = threading.Event()
    real_compile = so_mgr._compile
    so_mgr._compile = lambda key: (release.wait(60), real_compile(key))[1]

    def undo():
        release.set()
        so_mgr._compile = real_compile

    return release, undo


def _run(eng, rid):
    tokens = []
    while eng.has_unfinished_requests():
        for ro in eng.step():
            if ro.request_id == rid and ro.finished:
                tokens = ro.outputs[0].token_ids
    return list(tokens)


def test_compile_done_during_the_forward_samples_in_that_step(llm):
    """A new grammar whose compile finishes while the step that computes the request's whole prompt runs: the
    first token is sampled in that same step (no extra step for the grammar), under the mask."""
    eng = llm.llm_engine
    so_mgr = eng.engine_core.structured_output_manager
    runner = eng.engine_core.runner
    release, undo = _hold_compiles(so_mgr)
    real_execute = runner.execute_model

    def execute_and_release(sched):
        release.set()  # the compile runs beside this step's forward pass
        return real_execute(sched)

    runner.execute_model = execute_and_release
    wait_s, so_mgr.sample_wait_s = so_mgr.sample_wait_s, 60.0  # a loaded machine may compile slower than the forward
    unsampled = so_mgr.num_unsampled
    try:
        eng.add_request("same-step", "Pick a letter:", SamplingParams(temperature=0, max_tokens=4, structured_outputs=(
            StructuredOutputsParams(regex="(q|z)[0-9]{3}"))))
        outs = [ro for ro in eng.step() if ro.request_id == "same-step"]
        assert outs and len(outs[0].outputs[0].token_ids) >= 1, "no token in the step that computed the prompt"
        assert so_mgr.num_unsampled == unsampled
        assert eng.engine_core.scheduler.requests["same-step"].awaiting_grammar is False
        _run(eng, "same-step")
    finally:
        del runner.execute_model
        so_mgr.sample_wait_s = wait_s
        undo()


def test_seeded_request_that_missed_its_compile_samples_the_same_tokens(llm):
    """The step that computed the prompt couldn't wait for the compile: the request drew nothing (its seeded
    generator is put back), computed its last prompt token again once the grammar was ready, and sampled exactly
    what it samples with the grammar already compiled."""
    import re

    eng = llm.llm_engine
    so_mgr = eng.engine_core.structured_output_manager
    regex = "(yes|no|maybe), because [a-z ]{4,30}\\."
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=30,
                        structured_outputs=StructuredOutputsParams(regex=regex))
    release, undo = _hold_compiles(so_mgr)
    unsampled = so_mgr.num_unsampled
    try:
        eng.add_request("missed", "Is the sky blue? Answer:", sp)
        assert not [ro for ro in eng.step() if ro.request_id == "missed"]
        assert so_mgr.num_unsampled == unsampled + 1
        req = eng.engine_core.scheduler.requests["missed"]
        assert req.awaiting_grammar and req.num_computed_tokens == req.num_prompt_tokens - 1
        release.set()
        missed = _run(eng, "missed")
    finally:
        undo()
    eng.add_request("cached", "Is the sky blue? Answer:", sp)  # the grammar is cached now
    cached = _run(eng, "cached")
    assert so_mgr.num_unsampled == unsampled + 1
    assert missed == cached and missed
    assert re.fullmatch(regex, llm.get_tokenizer().decode(missed, skip_special_tokens=True))
