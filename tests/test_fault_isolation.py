"""Fault isolation with a real ``pagedllm serve --fault-injection`` (the test hook of engine/fault_injection.py):

- a request whose per-request processing raises fails alone (500 ``request_failed``, or an error event and
  ``[DONE]`` in a stream) while 8 concurrent requests finish with exactly their solo outputs, and the server stays
  healthy;
- a fault in the model forward (no one request's) stops the engine: every open stream ends with an error event
  and ``[DONE]``, and ``serve`` exits non-zero (1) so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conftest import start_server, stop_server
from pagedllm.engine.fault_injection import FORWARD_FAULT_MARKER, REQUEST_FAULT_MARKER

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):", "Water boils at",
           "The largest planet is", "Roses are red,", "import numpy as", "My favourite colour is"]


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory):
    handle = start_server(str(tmp_path_factory.mktemp("fault") / "serve.log"), "--fault-injection")
    yield handle
    stop_server(handle, timeout=10)


def _body(prompt: str, stream: bool, max_tokens: int = 8) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


async def _stream_text(ac: httpx.AsyncClient, body: dict) -> tuple[str, list]:
    text, events = "", []
    async with ac.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            ev = data if data == "[DONE]" else json.loads(data)
            events.append(ev)
            if isinstance(ev, dict) and "choices" in ev and ev["choices"]:
                text += ev["choices"][0]["text"]
    return text, events


def test_per_request_fault_fails_alone(fault_server):
    url = fault_server.url
    with httpx.Client(base_url=url, timeout=300) as c:
        solo = [c.post("/v1/completions", json=_body(p, False)).json()["choices"][0]["text"] for p in PROMPTS]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=300) as ac:
            good = [asyncio.create_task(_stream_text(ac, _body(p, True))) for p in PROMPTS]
            await asyncio.sleep(0.3)
            bad_plain = await ac.post("/v1/completions", json=_body("Say " + REQUEST_FAULT_MARKER, False))
            bad_stream = await _stream_text(ac, _body("Tell " + REQUEST_FAULT_MARKER, True))
            bad_chat = await ac.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": REQUEST_FAULT_MARKER}], "max_tokens": 4})
            return [await t for t in good], bad_plain, bad_stream, bad_chat

    outs, bad_plain, bad_stream, bad_chat = asyncio.run(main())
    assert [t for t, _ in outs] == solo
    for _, events in outs:
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
    assert bad_plain.status_code == 500 and bad_plain.json()["error"]["code"] == "request_failed"
    assert bad_chat.status_code == 500 and bad_chat.json()["error"]["code"] == "request_failed"
    _, events = bad_stream
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_failed", events[-3:]
    with httpx.Client(base_url=url, timeout=120) as c:
        assert c.get("/health").status_code == 200
        again = c.post("/v1/completions", json=_body(PROMPTS[0], False)).json()["choices"][0]["text"]
        assert again == solo[0]
    assert fault_server.proc.poll() is None


def test_forward_fault_stops_engine_and_serve_exits_nonzero(fault_server):
    url = fault_server.url

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=300) as ac:
            streams = [asyncio.create_task(_stream_text(ac, _body(p, True, max_tokens=200))) for p in PROMPTS[:4]]
            await asyncio.sleep(1.0)
            killer = asyncio.create_task(_stream_text(ac, _body("Go " + FORWARD_FAULT_MARKER, True)))
            return await asyncio.gather(*streams, killer)

    results = asyncio.run(main())
    for _, events in results:
        assert events[-1] == "[DONE]", events[-3:]
        assert isinstance(events[-2], dict) and events[-2]["error"]["code"] == "engine_dead", events[-3:]
    rc = fault_server.proc.wait(60)
    assert rc == 1, fault_server.log_tail()


def test_sigterm_drains_then_cuts_streams_with_an_error_event(tmp_path):
    """SIGTERM: new requests get 503 at once; a stream that finishes within --graceful-shutdown-timeout finishes;
    the rest end with an error event and [DONE]; the exit code is 0."""
    import signal

    # The long streams must outlast the grace on any machine: 2,000 tokens each (a fast CPU decodes 1,500 float32
    # tokens of three streams within 30 s), 10 s of grace (the 2-token stream is running when the signal comes).
    handle = start_server(str(tmp_path / "serve.log"), "--graceful-shutdown-timeout", "10")
    try:
        async def main():
            async with httpx.AsyncClient(base_url=handle.url, timeout=300) as ac:
                long = [asyncio.create_task(_stream_text(ac, _body(p, True, max_tokens=2000))) for p in PROMPTS[:3]]
                started = asyncio.Event()

                async def short_stream():
                    events = []
                    async with ac.stream("POST", "/v1/completions", json=_body(PROMPTS[3], True, 2)) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                                started.set()
                    return "", events

                short = asyncio.create_task(short_stream())
                await asyncio.wait_for(started.wait(), 240)  # it is running: it must finish within the grace
                handle.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.05)  # the same stop again (a process group's signal, then its parent's)
                handle.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                refused = await ac.post("/v1/completions", json=_body(PROMPTS[4], False))
                return await asyncio.gather(*long), await short, refused

        long, short, refused = asyncio.run(main())
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert short[1][-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in short[1])
        for _, events in long:
            assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
            assert events[-2]["error"]["code"] == "engine_dead", events[-3:]
        assert handle.proc.wait(60) == 0, handle.log_tail()
        with open(tmp_path / "serve.log") as f:  # one stop, delivered twice: one drain
            assert f.read().count("draining (up to") == 1
    finally:
        stop_server(handle, timeout=10)


def test_a_second_sigterm_during_the_drain_exits_at_once(tmp_path):
    """A SIGTERM more than ``SIGNAL_REPEAT_S`` after the first is an operator's second signal: the server stops
    without waiting out --graceful-shutdown-timeout (streams that were still running end), and exits 0."""
    import signal
    import time

    from pagedllm.entrypoints.openai.api_server import SIGNAL_REPEAT_S

    handle = start_server(str(tmp_path / "serve.log"), "--graceful-shutdown-timeout", "60")
    try:
        async def main():
            async with httpx.AsyncClient(base_url=handle.url, timeout=300) as ac:
                started = asyncio.Event()

                async def long_stream():
                    async with ac.stream("POST", "/v1/completions", json=_body(PROMPTS[0], True, 1500)) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                started.set()

                task = asyncio.create_task(long_stream())
                await asyncio.wait_for(started.wait(), 240)
                handle.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(SIGNAL_REPEAT_S + 0.5)
                assert handle.proc.poll() is None  # draining: the stream has most of 60 s left
                t0 = time.monotonic()
                handle.proc.send_signal(signal.SIGTERM)
                rc = await asyncio.to_thread(handle.proc.wait, 50)
                task.cancel()
                return rc, time.monotonic() - t0

        rc, took = asyncio.run(main())
        assert rc == 0 and took < 20, (rc, took, handle.log_tail())
    finally:
        stop_server(handle, timeout=10)
