"""AsyncLLM and the HTTP layer over a fake engine (no model, runs in a second): streaming, FINAL_ONLY merging,
aborts, no busy-wait when idle, engine-thread crash -> errors + /health 503 + in-stream error event, API key."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class FakeTokenizer:
    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    eos_token_id = 0

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 90 + 5 for c in text]

    def decode(self, ids, **kwargs):
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [self.decode([i]) for i in ids]

    def apply_chat_template(self, messages, chat_template=None, tokenize=False, **kwargs):
        return "".join(m["content"] for m in messages)


class FakeEngine:
    """Each request emits token ``10 + i`` at its i-th step (one per step) until ``max_tokens``.

    ``crash_at_step`` makes ``step`` raise; ``gate`` (an Event), when set up, must be set for a step to run.
    ``AsyncLLM`` validates with the real ``InputProcessor`` before anything reaches ``add_core_request``.
    """

    def __init__(self, crash_at_step=None, step_s=0.002):
        self.config = SimpleNamespace(
            model=SimpleNamespace(served_model_name="fake", max_model_len=64, vocab_size=100, max_logprobs=5,
                                  chat_template=None, model="/fake", dtype="float32",
                                  architecture="FakeForCausalLM"),
            cache=SimpleNamespace(block_size=16))
        self.tokenizer = FakeTokenizer()
        self.engine_core = self
        self.num_blocks = 8
        self.reqs = {}
        self.added, self.aborted = [], []
        self.num_steps = 0
        self.crash_at_step = crash_at_step
        self.step_s = step_s
        self.thread_ids = set()

    def add_core_request(self, req):
        self.thread_ids.add(threading.get_ident())
        if req.request_id in self.reqs:
            raise ValueError(f"request_id {req.request_id!r} is already in use.")
        self.added.append(req.request_id)
        self.reqs[req.request_id] = (req, req.sampling_params, [], req.arrival_time)

    def take_request_errors(self):
        return []

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        r = self.reqs.pop(request_id, None)
        if r is None:
            return []
        return [self._output(request_id, r, [], "abort")]

    def _output(self, rid, r, new, finish):
        prompt, params, toks, arrival = r
        return RequestOutput(rid, prompt.prompt, prompt.prompt_token_ids, None,
                             [CompletionOutput(0, self.tokenizer.decode(new), list(new), finish_reason=finish)],
                             finished=finish is not None, metrics=RequestMetrics(arrival_time=arrival))

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        if self.crash_at_step is not None and self.num_steps >= self.crash_at_step:
            raise RuntimeError("boom")
        time.sleep(self.step_s)
        outs = []
        for rid, r in list(self.reqs.items()):
            toks = r[2]
            toks.append(10 + len(toks))
            finish = "length" if len(toks) >= r[1].max_tokens else None
            outs.append(self._output(rid, r, [toks[-1]], finish))
            if finish:
                del self.reqs[rid]
        return outs

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def make_stats(self):
        return SchedulerStats(num_running_reqs=len(self.reqs), kv_cache_usage=0.1 * len(self.reqs))

    def reset_prefix_cache(self):
        return True


def _params(max_tokens=5, kind=RequestOutputKind.DELTA):
    return SamplingParams(max_tokens=max_tokens, temperature=0, output_kind=kind)


def test_stream_deltas_and_final_only():
    eng = FakeEngine()
    llm = AsyncLLM(eng)

    async def main():
        deltas = [o async for o in llm.generate("abc", _params(5), "r1")]
        finals = [o async for o in llm.generate("abc", _params(4, RequestOutputKind.FINAL_ONLY), "r2")]
        return deltas, finals

    deltas, finals = asyncio.run(main())
    toks = [t for o in deltas for t in o.outputs[0].token_ids]
    assert toks == [10, 11, 12, 13, 14]
    assert [o.finished for o in deltas][-1] and not any(o.finished for o in deltas[:-1])
    assert len(finals) == 1 and finals[0].outputs[0].token_ids == [10, 11, 12, 13]
    assert finals[0].outputs[0].finish_reason == "length"
    assert eng.thread_ids == {llm._backend.thread.ident}  # only the engine thread touched the engine
    llm.shutdown()


def test_validation_fails_in_caller_before_queueing():
    eng = FakeEngine()
    llm = AsyncLLM(eng)

    async def main():
        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in llm.generate("abc", _params(1000), "r1"):
                pass
        with pytest.raises(ValueError, match="prompt"):
            async for _ in llm.generate("", _params(2), "r2"):
                pass

    asyncio.run(main())
    time.sleep(0.05)
    assert eng.added == []
    llm.shutdown()


def test_close_aborts_and_idle_thread_sleeps():
    eng = FakeEngine(step_s=0.01)
    llm = AsyncLLM(eng)

    async def main():
        gen = llm.generate("abc", _params(50), "r1")
        async for out in gen:
            break
        await gen.aclose()
        for _ in range(100):
            if "r1" in eng.aborted:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert eng.aborted == ["r1"] and not eng.reqs
    steps = eng.num_steps
    time.sleep(0.3)
    assert eng.num_steps == steps  # no stepping (or spinning through step) while idle
    text = llm.metrics.registry.get_sample_value("pagedllm:num_requests_running", {"model_name": "fake"})
    assert text == 0.0
    assert llm.metrics.registry.get_sample_value(
        "pagedllm:request_success_total", {"model_name": "fake", "finished_reason": "abort"}) == 1.0
    llm.shutdown()


def test_metrics_count_tokens_and_latencies():
    eng = FakeEngine()
    llm = AsyncLLM(eng)

    async def main():
        await asyncio.gather(*[_drain(llm.generate("abcd", _params(6), f"r{i}")) for i in range(3)])

    asyncio.run(main())
    reg = llm.metrics.registry
    lab = {"model_name": "fake"}
    assert reg.get_sample_value("pagedllm:generation_tokens_total", lab) == 18
    assert reg.get_sample_value("pagedllm:prompt_tokens_total", lab) == 12
    assert reg.get_sample_value("pagedllm:time_to_first_token_seconds_count", lab) == 3
    assert reg.get_sample_value("pagedllm:inter_token_latency_seconds_count", lab) == 15
    assert reg.get_sample_value("pagedllm:e2e_request_latency_seconds_count", lab) == 3
    assert reg.get_sample_value("pagedllm:request_success_total", {**lab, "finished_reason": "length"}) == 3
    llm.shutdown()


async def _drain(gen):
    return [o async for o in gen]


def test_engine_crash_fails_requests_and_refuses_new():
    eng = FakeEngine(crash_at_step=3)
    llm = AsyncLLM(eng)

    async def main():
        results = await asyncio.gather(*[_drain(llm.generate("abc", _params(20), f"r{i}")) for i in range(3)],
                                       return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert llm.is_dead
        with pytest.raises(EngineDeadError):
            await _drain(llm.generate("abc", _params(2), "late"))

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------- HTTP layer
def _client(llm, api_key=None):
    app = build_app(llm, api_key=api_key, shutdown_engine=False)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_http_crash_mid_stream_sends_error_event_then_done_and_health_503():
    eng = FakeEngine(crash_at_step=4, step_s=0.01)
    llm = AsyncLLM(eng)

    async def main():
        async with _client(llm) as c:
            assert (await c.get("/health")).status_code == 200
            r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 20, "stream": True})
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert set(err) == {"message", "type", "param", "code"} and "boom" in err["message"]
            assert any("choices" in json.loads(e) for e in events[:-2])  # it had started streaming
            h = await c.get("/health")
            assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead"
            r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
            assert r.status_code == 503 and "error" in r.json()

    asyncio.run(main())


def test_http_api_key():
    llm = AsyncLLM(FakeEngine())

    async def main():
        async with _client(llm, api_key="sekret") as c:
            r = await c.get("/v1/models")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            r = await c.get("/v1/models", headers={"Authorization": "Bearer sekret"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake"
            r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3},
                             headers={"Authorization": "Bearer sekret"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert (await c.get("/health")).status_code == 200  # only /v1/* is guarded

    asyncio.run(main())
    llm.shutdown()


def test_engine_factory_runs_in_the_engine_thread():
    """Given a function, AsyncLLM builds the engine in the thread that steps it (one OpenMP pool: see the module
    note), serves with it, and raises the function's error from the constructor."""
    built_in, stepped_in = [], set()

    class RecordingEngine(FakeEngine):
        def step(self):
            stepped_in.add(threading.current_thread().name)
            return super().step()

    def factory():
        built_in.append(threading.current_thread().name)
        return RecordingEngine()

    llm = AsyncLLM(factory)
    assert isinstance(llm.engine, RecordingEngine) and llm.num_kv_blocks == 8

    async def main():
        return [o async for o in llm.generate("abc", _params(max_tokens=3), "r1")]

    outs = asyncio.run(main())
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 3
    llm.shutdown()
    assert built_in == ["pagedllm-engine"] and stepped_in == {"pagedllm-engine"}

    def broken():
        raise ValueError("bad model folder")

    with pytest.raises(ValueError, match="bad model folder"):
        AsyncLLM(broken)


# ---------------------------------------------------------------------------------------------------- real model
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_process_mode_on_real_model():
    """The engine in a child process: generation, abort, an engine call and shutdown across the pipes. (Both modes
    run the same ``_engine_loop``; the fake-engine tests above cover its logic.)"""
    from pagedllm.config import EngineArgs

    llm = AsyncLLM.from_engine_args(EngineArgs(max_model_len=512, kv_cache_memory_bytes=32 << 20),
                                    engine_mode="process")
    running = ("pagedllm:num_requests_running", {"model_name": llm.config.model.served_model_name})

    async def run():
        sp = SamplingParams(max_tokens=8, temperature=0, output_kind=RequestOutputKind.FINAL_ONLY)
        final = [o async for o in llm.generate("The capital of France is", sp, "a")]
        assert len(final) == 1 and len(final[0].outputs[0].token_ids) == 8 and final[0].outputs[0].text
        gen = llm.generate("Tell me a story.", _params(400), "b")
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(200):  # the abort lands within a step
            if llm.metrics.registry.get_sample_value(*running) == 0:
                break
            await asyncio.sleep(0.05)
        assert llm.metrics.registry.get_sample_value(*running) == 0
        assert isinstance(await llm.reset_prefix_cache(), bool)

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()
    assert not llm._backend.is_alive() and llm._backend.proc.exitcode == 0


# ---------------------------------------------------------------------------------------------------- issue 18
class GatedEngine(FakeEngine):
    """A step waits until ``gate`` is set (a stalled or slow engine)."""

    def __init__(self, limits=None, **kw):
        super().__init__(**kw)
        self.gate = threading.Event()
        if limits is not None:
            self.config.limits = limits

    def step(self):
        self.gate.wait(10)
        return super().step()


def test_http_api_key_guards_every_route_but_health(tmp_path):
    from pagedllm.entrypoints.openai.guards import load_api_keys

    key_file = tmp_path / "keys"
    key_file.write_text("# ops\nk-file\n\n")
    keys = load_api_keys(["k1", "k2"], str(key_file))
    assert keys == ["k1", "k2", "k-file"]
    llm = AsyncLLM(FakeEngine())

    async def main():
        for open_metrics in (False, True):
            app = build_app(llm, api_key=keys, shutdown_engine=False, allow_unauthenticated_metrics=open_metrics)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                assert (await c.get("/health")).status_code == 200
                for method, path, body in (("GET", "/v1/models", None), ("GET", "/openapi.json", None),
                                           ("GET", "/docs", None), ("GET", "/version", None),
                                           ("POST", "/tokenize", {"prompt": "ab"}),
                                           ("POST", "/detokenize", {"tokens": [5]}),
                                           ("POST", "/v1/completions", {"prompt": "ab", "max_tokens": 1})):
                    r = await c.request(method, path, json=body)
                    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
                    for k in keys:
                        r = await c.request(method, path, json=body, headers={"Authorization": f"Bearer {k}"})
                        assert r.status_code == 200, (path, r.text)
                assert (await c.get("/metrics")).status_code == (200 if open_metrics else 401)

    asyncio.run(main())
    llm.shutdown()


def test_dev_endpoint_and_cached_tokens_are_opt_in():
    llm = AsyncLLM(FakeEngine())

    async def main():
        for flags in (False, True):
            app = build_app(llm, shutdown_engine=False, server_dev_mode=flags, enable_prompt_tokens_details=flags)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.post("/reset_prefix_cache")
                assert r.status_code == (200 if flags else 404)
                r = await c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
                details = r.json()["usage"]["prompt_tokens_details"]
                assert details == ({"cached_tokens": 0} if flags else None)

    asyncio.run(main())
    llm.shutdown()


def test_admission_queue_full_is_429_with_retry_after():
    from pagedllm.config import InputLimits

    eng = GatedEngine(limits=InputLimits(max_num_queued_reqs=3, max_num_queued_tokens=10))
    llm = AsyncLLM(eng)

    async def main():
        app = build_app(llm, shutdown_engine=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body = {"prompt": "abc", "max_tokens": 2}
            first = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(2)]
            await asyncio.sleep(0.2)
            assert llm.num_queued == (2, 6)
            r = await c.post("/v1/completions", json={"prompt": "abcde", "max_tokens": 2})  # 11 tokens > 10
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
            first.append(asyncio.create_task(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})))
            await asyncio.sleep(0.2)
            assert llm.num_queued == (3, 7)
            r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})  # 4 requests > 3
            assert r.status_code == 429
            eng.gate.set()
            assert [(await t).status_code for t in first] == [200, 200, 200]
            assert llm.num_queued == (0, 0)
            assert (await c.post("/v1/completions", json=body)).status_code == 200

    asyncio.run(main())
    llm.shutdown()


def test_health_watchdog_and_graceful_drain():
    eng = GatedEngine()
    llm = AsyncLLM(eng)

    async def main():
        app = build_app(llm, shutdown_engine=False, health_step_timeout=0.3)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            task = asyncio.create_task(c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3,
                                                                        "stream": True}))
            await asyncio.sleep(0.6)  # the engine has work but no step finishes
            h = await c.get("/health")
            assert h.status_code == 503 and h.json()["error"]["code"] == "engine_stalled"
            eng.gate.set()
            assert (await task).status_code == 200
            assert (await c.get("/health")).status_code == 200
            # Drain: in-flight streams that can't finish in time end with an error event and [DONE].
            eng.gate.clear()
            slow = asyncio.create_task(c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 50,
                                                                        "stream": True}))
            await asyncio.sleep(0.2)
            cut = asyncio.create_task(llm.drain(0.3))
            await asyncio.sleep(0.05)
            r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            assert await cut == 1
            events = [e[6:] for e in (await slow).text.splitlines() if e.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead"
            eng.gate.set()

    asyncio.run(main())
    llm.shutdown()


def test_per_request_engine_error_fails_only_that_request():
    from pagedllm.engine.exceptions import RequestFailedError

    class OneBadEngine(FakeEngine):
        def __init__(self):
            super().__init__()
            self.errors = []

        def step(self):
            outs = super().step()
            if "bad" in self.reqs:
                del self.reqs["bad"]
                self.errors.append(("bad", RequestFailedError("request bad failed in the engine: boom")))
            return [o for o in outs if o.request_id != "bad"]

        def take_request_errors(self):
            errors, self.errors = self.errors, []
            return errors

    llm = AsyncLLM(OneBadEngine())

    async def main():
        good = [asyncio.create_task(_drain(llm.generate("abc", _params(6), f"g{i}"))) for i in range(3)]
        with pytest.raises(RequestFailedError):
            await _drain(llm.generate("abc", _params(6), "bad"))
        outs = await asyncio.gather(*good)
        assert all(sum(len(o.outputs[0].token_ids) for o in out) == 6 for out in outs)
        assert not llm.is_dead

    asyncio.run(main())
    llm.shutdown()
