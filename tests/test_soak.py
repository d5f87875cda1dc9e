"""A bounded soak test of the real server (the shared ``pagedllm serve`` of conftest.py): 64 concurrent streams,
a third of them disconnected at random moments, bad requests mixed in. Afterwards: zero running and waiting
requests, zero KV blocks in use, every finished greedy output equal to its solo run, and the abort counter
(``request_success_total{finished_reason="abort"}``) grown by exactly the number of disconnects.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):", "Water boils at",
           "The largest planet is", "Roses are red,", "import numpy as", "My favourite colour is"]
NUM_STREAMS = 64
MAX_TOKENS = 12
DISCONNECT_MAX_TOKENS = 400  # disconnected streams would run long: their abort always beats their end
BAD = [
    {"prompt": "hi", "seed": 2 ** 64},
    {"prompt": "hi", "temperature": 9},
    {"prompt": [1, 10 ** 9]},
    {"prompt": "hi", "n": 1000},
    {"prompt": "hi", "stop": ["\ud800"]},
    {"prompt": "hi", "cache_salt": "\udfff"},
    {"prompt": "hi", "max_tokens": 10 ** 9},
    {"prompt": "hi", "logit_bias": {"x": 1}},
]


def _metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if all(got.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _body(prompt: str, max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_soak_64_streams_with_disconnects_and_bad_requests(pagedllm_server):
    url = pagedllm_server.url
    with httpx.Client(base_url=url, timeout=300) as c:
        solo = {p: c.post("/v1/completions", json=_body(p, MAX_TOKENS)).json()["choices"][0]["text"]
                for p in PROMPTS}
        aborts_before = _metric(c.get("/metrics").text, "pagedllm:request_success_total", finished_reason="abort")
    rng = random.Random(18)
    to_cut = set(rng.sample(range(NUM_STREAMS), NUM_STREAMS // 3))
    cut_after = {i: rng.randint(1, 3) for i in to_cut}

    async def stream(ac: httpx.AsyncClient, i: int):
        prompt = PROMPTS[i % len(PROMPTS)]
        await asyncio.sleep(rng.random() * 2.0)
        cut = i in to_cut
        body = {**_body(prompt, DISCONNECT_MAX_TOKENS if cut else MAX_TOKENS), "stream": True}
        text, seen = "", 0
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                ch = ev["choices"][0]
                text += ch["text"]
                seen += 1
                if cut and seen >= cut_after[i]:
                    assert ch["finish_reason"] is None
                    return i, None  # disconnect: leave the stream unread
        return i, text

    async def bad(ac: httpx.AsyncClient, j: int) -> int:
        await asyncio.sleep(rng.random() * 3.0)
        r = await ac.post("/v1/completions", content=json.dumps(BAD[j % len(BAD)]).encode(),
                          headers={"content-type": "application/json"})
        return r.status_code

    async def main():
        limits = httpx.Limits(max_connections=NUM_STREAMS + 32, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as ac:
            streams = [asyncio.create_task(stream(ac, i)) for i in range(NUM_STREAMS)]
            bads = [asyncio.create_task(bad(ac, j)) for j in range(2 * len(BAD))]
            return await asyncio.gather(*streams), await asyncio.gather(*bads)

    t0 = time.monotonic()
    results, bad_status = asyncio.run(asyncio.wait_for(main(), 300))
    elapsed = time.monotonic() - t0
    assert all(s == 400 for s in bad_status), bad_status
    finished = [(i, t) for i, t in results if t is not None]
    assert len(finished) == NUM_STREAMS - len(to_cut)
    for i, text in finished:
        assert text == solo[PROMPTS[i % len(PROMPTS)]], i

    deadline = time.monotonic() + 60
    with httpx.Client(base_url=url, timeout=60) as c:
        while True:
            m = c.get("/metrics").text
            running = _metric(m, "pagedllm:num_requests_running")
            waiting = _metric(m, "pagedllm:num_requests_waiting")
            kv = _metric(m, "pagedllm:kv_cache_usage_perc")
            aborts = _metric(m, "pagedllm:request_success_total", finished_reason="abort") - aborts_before
            if (running, waiting, kv, aborts) == (0, 0, 0, len(to_cut)) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (running, waiting, kv) == (0, 0, 0), (running, waiting, kv)
        assert aborts == len(to_cut), (aborts, len(to_cut))
        assert c.get("/health").status_code == 200
    print(f"soak: {NUM_STREAMS} streams, {len(to_cut)} cut, {len(bad_status)} bad requests in {elapsed:.1f} s")
