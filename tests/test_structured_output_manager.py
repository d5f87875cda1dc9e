"""StructuredOutputManager on its own (no model): compile cache, failed compiles, which rows get a bitmask, the
reasoning gate (no mask while thinking; qwen3's optional <think> opener), matcher advance."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.manager import ReasoningEnd, StructuredOutputManager
from pagedllm.structured_output.xgrammar_backend import XgrammarBackend

VOCAB = ["<eos>", "<think>", "</think>", "yes", "no", "hmm", "y", "es"]
EOS, THINK, END, YES, NO, HMM = 0, 1, 2, 3, 4, 5


def _backend():
    import xgrammar as xgr

    return XgrammarBackend(xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB), stop_token_ids=[EOS]),
                           len(VOCAB))


class FakeTokenizer:
    def get_vocab(self):
        return {t: i for i, t in enumerate(VOCAB)}

    def decode(self, ids):
        return "".join(VOCAB[i] for i in ids)


def _req(rid: str, so: StructuredOutputsParams, prompt=(7,)):
    return SimpleNamespace(request_id=rid, sampling_params=SamplingParams(structured_outputs=so),
                           prompt_token_ids=list(prompt), output_token_ids=[], num_computed_tokens=len(prompt),
                           num_tokens=len(prompt))


def _mgr(reasoning=None):
    rend = ReasoningEnd(FakeTokenizer(), reasoning) if reasoning else None
    return StructuredOutputManager(StructuredOutputsConfig(), _backend, rend)


def _allowed(bitmask, row):
    w = bitmask[row].tolist()
    return {t for t in range(len(VOCAB)) if (w[t // 32] >> (t % 32)) & 1}


def _ready(m, *reqs):
    for r in reqs:
        m.add_request(r)
    while m.has_pending():
        m.wait_pending(5)
        ready, failed = m.take_ready()
        assert not failed
    return {r.request_id: r for r in reqs}


def _sched(reqs):
    return SimpleNamespace(num_scheduled_tokens={rid: 1 for rid in reqs})


CHOICE = StructuredOutputsParams(choice=["yes", "no"])


def test_cache_and_rows():
    m = _mgr()
    reqs = _ready(m, _req("a", CHOICE), _req("b", StructuredOutputsParams(choice=["yes", "no"])))
    assert m.num_compiles == 1  # same (kind, spec, whitespace): one compile
    prefill = _req("c", CHOICE, prompt=(7, 7, 7))
    prefill.num_computed_tokens = 0  # a prompt chunk of 1 of 3 tokens: doesn't sample this step
    _ready(m, prefill)
    reqs["c"] = prefill
    reqs["plain"] = SimpleNamespace(num_computed_tokens=1, num_tokens=1)
    bitmask, rows, _ = m.grammar_bitmask(_sched(reqs), reqs)
    assert set(rows) == {"a", "b"} and bitmask.shape[0] == 2
    assert _allowed(bitmask, rows["a"]) == {YES, NO, 6}  # "y" starts "yes"
    assert m.accept_tokens("a", [YES])
    bitmask, rows, _ = m.grammar_bitmask(_sched(["a"]), reqs)
    assert _allowed(bitmask, rows["a"]) == {EOS}  # done: only EOS
    assert not m.accept_tokens("b", [HMM])  # rejected: b is no longer constrained (logged)
    m.remove_requests(["a", "b", "c"])
    assert not m.has_constrained()


def test_failed_compile_is_reported():
    m = _mgr()
    m.add_request(_req("bad", StructuredOutputsParams(grammar="root ::= (")))
    m.wait_pending(5)
    ready, failed = m.take_ready()
    assert not ready and failed[0][0].request_id == "bad" and "xgrammar" in failed[0][1]


def test_no_mask_while_thinking_then_grammar():
    m = _mgr("deepseek_r1")
    reqs = _ready(m, _req("r", CHOICE))
    assert m.grammar_bitmask(_sched(reqs), reqs) is None  # R1 starts thinking: unconstrained
    assert m.accept_tokens("r", [HMM, HMM, NO])  # inside the reasoning: not fed to the grammar
    assert m.accept_tokens("r", [END])
    bitmask, rows, _ = m.grammar_bitmask(_sched(reqs), reqs)
    assert _allowed(bitmask, rows["r"]) == {YES, NO, 6}  # the grammar starts after </think>
    assert m.accept_tokens("r", [NO]) and not m.accept_tokens("r", [NO])


def test_qwen3_may_open_think_with_its_first_token():
    m = _mgr("qwen3")
    reqs = _ready(m, _req("q", CHOICE), _req("p", CHOICE, prompt=(7, THINK)), _req("d", CHOICE, prompt=(THINK, END)))
    bitmask, rows, _ = m.grammar_bitmask(_sched(reqs), reqs)
    assert "p" not in rows  # the prompt left a <think> open
    assert _allowed(bitmask, rows["q"]) == {YES, NO, 6, THINK}
    assert _allowed(bitmask, rows["d"]) == {YES, NO, 6}  # the prompt closed it
    assert m.accept_tokens("q", [THINK])
    assert m.grammar_bitmask(_sched(["q"]), reqs) is None  # thinking now: no mask
    assert m.accept_tokens("q", [HMM, END, YES, EOS]) and m.is_terminated("q")


def test_duplicate_request_id():
    m = _mgr()
    m.add_request(_req("x", CHOICE))
    with pytest.raises(ValueError, match="already in use"):
        m.add_request(_req("x", CHOICE))
    m.shutdown()


def test_warm_up_builds_the_backend_once_in_the_pool():
    """warm_up returns at once and builds the backend in the pool; a compile asking meanwhile gets the same one."""
    import threading as th

    from pagedllm.config import StructuredOutputsConfig
    from pagedllm.structured_output.manager import StructuredOutputManager

    gate, built = th.Event(), []

    def make():
        gate.wait(10)
        built.append(object())
        return built[-1]

    mgr = StructuredOutputManager(StructuredOutputsConfig(), make)
    mgr.warm_up()
    assert not built  # not waited for
    other = mgr._pool.submit(mgr._backend_now)
    gate.set()
    assert other.result(10) is mgr._backend_now() and len(built) == 1
    mgr.shutdown()


def test_a_compiling_request_that_samples_waits_a_bounded_time_then_gets_its_matcher():
    """The mask thread waits for a compile until the runner needs the mask plus ``sample_wait_s``, no longer; the
    request is then ``unsampled`` and stays pending. Once compiled, a sampling step adopts it (``finish_step``)."""
    import threading
    import time

    m = _mgr()
    m.sample_wait_s = 0.05
    release = threading.Event()
    real_compile = m._compile
    m._compile = lambda key: (release.wait(10), real_compile(key))[1]
    r = _req("w", StructuredOutputsParams(regex="y(es)?"))
    m.add_request(r)
    reqs = {"w": r}
    try:
        handle = m.grammar_bitmask_async(_sched(reqs), reqs)
        time.sleep(0.1)
        assert not handle.future.done()  # the forward pass hasn't asked for the mask yet: it waits
        t0 = time.monotonic()
        gb = handle.result()
        waited = time.monotonic() - t0
        assert gb.unsampled == {"w"} and gb.row_of == {} and 0.04 <= waited < 2.0
        assert m.finish_step() == [] and m.has_pending()
        release.set()
        m.wait_pending(5)
        gb = m.grammar_bitmask_async(_sched(reqs), reqs).result()
        assert gb.row_of == {"w": 0} and not gb.unsampled
        assert _allowed(gb.bitmask, 0) == {YES, 6}
        assert m.finish_step() == [r] and not m.has_pending() and m.has_constrained()
    finally:
        release.set()
        m.shutdown()


def test_compile_threads_run_niced():
    """Compiles run below the engine's priority (``compile_thread_nice``), so they don't stall the forward pass's
    OpenMP threads."""
    import os
    import threading

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    m = StructuredOutputManager(StructuredOutputsConfig(compile_thread_nice=5), _backend)
    try:
        nice = m._pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(5)
        assert nice == min(base + 5, 19)
    finally:
        m.shutdown()
