"""GET /stats and the web pages' routes, in process (no model): the stats sampler against the Prometheus counters it
reads (brute-force quantiles, exact rates), the routes through ``build_app`` over the fake engine of
test_async_llm.py (content types, CSP, --disable-frontend, --api-key), and a static scan of the page sources.
The browser tests against a real server are in test_web_browser.py."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
from types import SimpleNamespace

import httpx
import pytest
from test_async_llm import FakeEngine

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.api_server import add_serve_parser, build_app
from pagedllm.entrypoints.web import (ASSET_PREFIX, PAGE_PATHS, PUBLIC_PATHS, STATIC_DIR, build_web_router,
                                      is_public_path)
from pagedllm.entrypoints.web.stats import StatsSampler, histogram_quantile, read_snapshot
from pagedllm.metrics import ITL_BUCKETS, TTFT_BUCKETS, EngineMetrics


# ---------------------------------------------------------------------------------------------------- quantiles
def test_histogram_quantile_worked_example_and_edges():
    inf = float("inf")
    assert histogram_quantile(0.5, (0.1, 0.5, inf), (2, 6, 6)) == pytest.approx(0.2)
    assert histogram_quantile(0.5, (0.1, 0.5, inf), (0, 0, 0)) is None
    assert histogram_quantile(0.5, (), ()) is None
    # All in the +inf bucket: the largest finite bound (Prometheus' answer).
    assert histogram_quantile(0.99, (0.1, 0.5, inf), (0, 0, 3)) == 0.5
    # Within the first bucket the lower edge is 0.
    assert histogram_quantile(0.5, (0.1, 0.5, inf), (4, 4, 4)) == pytest.approx(0.05)


@pytest.mark.parametrize("seed", range(5))
def test_histogram_quantile_lies_in_the_bucket_of_the_true_quantile(seed):
    """Against brute force: the estimate from the bucket counts of random latencies lies in the bucket that holds the
    exact quantile of the samples (nearest-rank definition)."""
    rng = random.Random(seed)
    bounds = tuple(TTFT_BUCKETS) + (float("inf"),)
    xs = [rng.lognormvariate(math.log(0.08), 1.2) for _ in range(rng.randint(1, 400))]
    counts = [sum(x <= b for x in xs) for b in bounds]
    for q in (0.5, 0.9, 0.99):
        est = histogram_quantile(q, bounds, counts)
        exact = sorted(xs)[max(0, math.ceil(q * len(xs)) - 1)]
        k = next(i for i, b in enumerate(bounds) if exact <= b)
        lo = bounds[k - 1] if k else 0.0
        hi = bounds[k] if not math.isinf(bounds[k]) else bounds[k - 1]
        assert lo - 1e-12 <= est <= hi + 1e-12, (q, est, exact, lo, hi)


# ---------------------------------------------------------------------------------------------------- the sampler
def _engine(metrics):
    cfg = SimpleNamespace(
        model=SimpleNamespace(model="/m.gguf", served_model_name="m", architecture="LlamaForCausalLM",
                              dtype="torch.bfloat16", quantization=SimpleNamespace(method="gguf"), max_model_len=64),
        cache=SimpleNamespace(block_size=16, enable_prefix_caching=True),
        scheduler=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=128, long_prefill_token_threshold=96),
        kernel=SimpleNamespace(isa="avx512_bf16"))
    return SimpleNamespace(config=cfg, metrics=metrics, num_kv_blocks=11, num_in_flight=0, engine_mode="thread")


def _output(rid, n_prompt, n_new, arrival, finish=None):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(n_prompt)),
                           outputs=[SimpleNamespace(token_ids=list(range(n_new)), finish_reason=finish)],
                           metrics=SimpleNamespace(arrival_time=arrival), finished=finish is not None)


def test_sampler_rates_percentiles_and_since_match_the_counters():
    m = EngineMetrics("m", 64)
    eng = _engine(m)
    s = StatsSampler(eng, interval_s=1.0, history_s=5.0, window_s=2.0, version="9.9")
    t = 1000.0
    s.sample(t)
    # Second 1: one request arrives at t, its first 3 tokens at t+0.25 (TTFT 0.25 s), 10 prompt tokens.
    m.record_outputs([_output("a", 10, 3, arrival=t)], now=t + 0.25)
    m.record_scheduler_stats(SchedulerStats(num_running_reqs=1, num_waiting_reqs=2, kv_cache_usage=0.5,
                                            prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1))
    s.sample(t + 1)
    # Second 2: 4 more tokens (ITL 0.6 s), then it finishes.
    m.record_outputs([_output("a", 10, 4, arrival=t, finish="length")], now=t + 0.85)
    m.record_scheduler_stats(SchedulerStats(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0,
                                            prefix_cache_queries=6, prefix_cache_hits=6))
    s.sample(t + 2)
    d = s.to_dict()
    ser = d["series"]
    assert ser["time"] == [t, t + 1, t + 2]
    assert ser["generation_tokens_per_s"] == [None, 3.0, 4.0]
    assert ser["prompt_tokens_per_s"] == [None, 10.0, 0.0]
    assert ser["num_requests_running"] == [0.0, 1.0, 0.0] and ser["num_requests_waiting"] == [0.0, 2.0, 0.0]
    assert ser["kv_cache_usage_perc"] == [0.0, 0.5, 0.0]
    assert ser["prefix_cache_hit_rate"] == [None, 0.4, pytest.approx(10 / 16)]
    assert ser["num_preemptions"] == [0.0, 1.0, 1.0]
    bounds = tuple(TTFT_BUCKETS) + (float("inf"),)
    assert ser["ttft_p50_s"][1] == pytest.approx(histogram_quantile(0.5, bounds, [float(0.25 <= b) for b in bounds]))
    assert 0.1 < ser["ttft_p50_s"][1] <= 0.25 and ser["ttft_p99_s"][1] <= 0.25
    ib = tuple(ITL_BUCKETS) + (float("inf"),)
    assert ser["itl_p50_s"] == [None, None, pytest.approx(histogram_quantile(0.5, ib, [float(0.6 <= b) for b in ib]))]
    # The totals are the registry's own values (what /metrics shows).
    reg = m.registry
    tot = d["totals"]
    assert tot["generation_tokens"] == reg.get_sample_value("pagedllm:generation_tokens_total", {"model_name": "m"}) == 7
    assert tot["prompt_tokens"] == 10 and tot["num_preemptions"] == 1 and tot["prefix_cache_hits"] == 10
    assert tot["request_success"]["length"] == 1 and tot["prefix_cache_hit_rate"] == pytest.approx(10 / 16)
    assert d["config"] == {
        "model": "/m.gguf", "served_model_name": "m", "architecture": "LlamaForCausalLM", "dtype": "bfloat16",
        "quantization": "gguf", "isa": "avx512_bf16", "max_model_len": 64, "block_size": 16, "num_kv_blocks": 11,
        "kv_cache_tokens": 160, "enable_prefix_caching": True, "max_num_seqs": 8, "max_num_batched_tokens": 128,
        "long_prefill_token_threshold": 96, "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "engine_mode": "thread", "version": "9.9"}
    assert d["current"]["num_requests_running"] == 0.0
    # since: only newer points.
    assert s.to_dict(since=t + 1)["series"]["time"] == [t + 2]
    assert s.to_dict(since=t + 2)["series"]["time"] == []
    # The ring keeps history_s of points (plus the window behind the oldest).
    for k in range(3, 30):
        s.sample(t + k)
    ser = s.to_dict()["series"]
    assert ser["time"] == [t + k for k in range(25, 30)]
    assert ser["generation_tokens_per_s"] == [0.0] * 5


def test_sampler_without_metrics_and_live_gauges():
    eng = _engine(None)
    s = StatsSampler(eng)
    assert s.sample() is None
    d = s.to_dict()
    assert d["current"] is None and d["series"]["time"] == [] and d["config"]["served_model_name"] == "m"
    m = EngineMetrics("m", 64)
    s = StatsSampler(_engine(m))
    m.record_scheduler_stats(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25))
    cur = s.to_dict()["current"]  # read live, before any sample was taken
    assert (cur["num_requests_running"], cur["num_requests_waiting"], cur["kv_cache_usage_perc"]) == (3, 1, 0.25)
    snap = read_snapshot(m.registry, 5.0)
    assert snap.time == 5.0 and len(snap.ttft_buckets) == len(TTFT_BUCKETS) + 1


def test_sampler_task_samples_on_the_event_loop():
    s = StatsSampler(_engine(EngineMetrics("m", 64)), interval_s=0.02, history_s=1.0, window_s=0.02)

    async def main():
        s.start()
        s.start()  # idempotent
        await asyncio.sleep(0.15)
        await s.stop()

    asyncio.run(main())
    n = len(s.to_dict()["series"]["time"])
    assert 4 <= n <= 9, n


# ---------------------------------------------------------------------------------------------------- routes
def _client(llm, **kw):
    app = build_app(llm, shutdown_engine=False, **kw)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_pages_assets_and_stats_routes():
    llm = AsyncLLM(FakeEngine())

    async def main():
        async with _client(llm) as c:
            for path in ("/", "/ui", "/dashboard"):
                r = await c.get(path)
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
                csp = r.headers["content-security-policy"]
                assert "script-src 'self'" in csp and "default-src 'none'" in csp
                assert "<script type=\"module\"" in r.text
            assert "chat.js" in (await c.get("/")).text and "dashboard.js" in (await c.get("/dashboard")).text
            for name in ("chat.js", "dashboard.js", "markdown.js", "charts.js", "api.js", "sse.js", "style.css"):
                r = await c.get(ASSET_PREFIX + name)
                assert r.status_code == 200 and r.content == (STATIC_DIR / name).read_bytes(), name
                want = "text/css" if name.endswith(".css") else "text/javascript"
                assert r.headers["content-type"].startswith(want) and r.headers["x-content-type-options"] == "nosniff"
            for bad in ("nope.js", "..%2F__init__.py", "%2E%2E%2Fstats.py"):
                assert (await c.get(ASSET_PREFIX + bad)).status_code == 404, bad
            r = await c.get("/stats")
            assert r.status_code == 200
            d = r.json()
            assert d["object"] == "stats" and d["config"]["served_model_name"] == "fake"
            assert d["config"]["num_kv_blocks"] == 8 and set(d["series"]) >= {"time", "generation_tokens_per_s"}
            # Values move: 5 generated tokens show in the totals.
            r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
            assert r.status_code == 200
            d2 = (await c.get("/stats")).json()
            assert d2["totals"]["generation_tokens"] - d["totals"]["generation_tokens"] == 5
            assert d2["totals"]["request_success"]["length"] == 1
            for bad in ("nan", "inf", "abc"):
                r = await c.get("/stats", params={"since": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == "since", (bad, r.text)

    asyncio.run(main())
    llm.shutdown()


def test_disable_frontend_is_404_and_stats_stays():
    llm = AsyncLLM(FakeEngine())

    async def main():
        async with _client(llm, enable_frontend=False) as c:
            for path in ("/", "/ui", "/dashboard", ASSET_PREFIX + "chat.js"):
                r = await c.get(path)
                assert r.status_code == 404 and "error" in r.json(), path
            assert (await c.get("/stats")).status_code == 200

    asyncio.run(main())
    llm.shutdown()
    ns = add_serve_parser(__import__("argparse").ArgumentParser().add_subparsers()).parse_args(["--disable-frontend"])
    assert ns.disable_frontend is True


def test_api_key_guards_stats_and_not_the_page_shells():
    llm = AsyncLLM(FakeEngine())

    async def main():
        async with _client(llm, api_key="sekret") as c:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                r = await c.get("/stats", headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
            assert (await c.get("/stats", headers={"Authorization": "Bearer sekret"})).status_code == 200
            # The shells and scripts hold no data and load without the key; the pages then ask for it.
            for path in ("/", "/ui", "/dashboard", ASSET_PREFIX + "api.js"):
                assert (await c.get(path)).status_code == 200, path
                assert is_public_path(path) and path in PUBLIC_PATHS
            assert not is_public_path("/stats") and not is_public_path("/v1/models")
            assert "/stats" not in PUBLIC_PATHS and all(is_public_path(p) for p in PUBLIC_PATHS)

    asyncio.run(main())
    llm.shutdown()


def test_several_keys():
    from fastapi import FastAPI

    app = FastAPI()
    app.include_router(build_web_router(AsyncLLM(FakeEngine()), api_key=["k1", "k2"]))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            for key, code in (("k1", 200), ("k2", 200), ("k3", 401)):
                assert (await c.get("/stats", headers={"Authorization": f"Bearer {key}"})).status_code == code

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------- the sources
def test_page_sources_fetch_nothing_external_and_never_parse_html():
    """No CDN or other origin anywhere, no inline script, no HTML parsing of strings in the scripts (model text
    reaches the DOM only as text)."""
    files = sorted(p for p in STATIC_DIR.iterdir() if p.is_file())
    assert {p.name for p in files} >= {"index.html", "dashboard.html", "chat.js", "dashboard.js", "style.css"}
    for p in files:
        text = p.read_text()
        for m in re.finditer(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", text):
            assert m.group(1).startswith(("/", "data:", "#")), (p.name, m.group(1))
        assert "@import" not in text and "url(http" not in text, p.name
        if p.suffix == ".js":
            for banned in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                           "new Function", "DOMParser", "createContextualFragment"):
                assert banned not in text, (p.name, banned)
            for m in re.finditer(r"""(?:fetch|apiFetch)\(\s*[`"']([^`"']*)""", text):
                assert m.group(1).startswith("/"), (p.name, m.group(1))  # same origin only
            for m in re.finditer(r"""from\s+["']([^"']+)["']""", text):
                assert m.group(1).startswith("./"), (p.name, m.group(1))
        if p.suffix == ".html":
            assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", text), p.name  # no inline script
            assert not re.search(r"\son\w+\s*=", text), p.name  # no inline handlers
            assert "style=" not in text, p.name
            ids = re.findall(r'\sid="([^"]+)"', text)
            assert len(ids) == len(set(ids)), (p.name, sorted(i for i in ids if ids.count(i) > 1))
    assert set(PAGE_PATHS.values()) <= {p.name for p in files}
    json.dumps(PAGE_PATHS)
