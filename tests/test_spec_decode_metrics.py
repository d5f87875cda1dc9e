"""Speculative-decoding metrics: the scheduler's SpecDecodingStats -> Prometheus (vLLM's names) -> the serve
bench's scrape of /metrics."""

from prometheus_client import generate_latest

from pagedllm.benchmarks import serve
from pagedllm.core.scheduler import SchedulerStats, SpecDecodingStats
from pagedllm.metrics import EngineMetrics


def _stats(drafts, draft_toks, accepted, per_pos):
    return SchedulerStats(spec_decoding_stats=SpecDecodingStats(drafts, draft_toks, accepted, per_pos))


def test_spec_metrics_exported_and_scraped(monkeypatch):
    m = EngineMetrics("m")
    m.record_scheduler_stats(_stats(3, 10, 6, [3, 2, 1, 0]))
    m.record_scheduler_stats(_stats(1, 4, 4, [1, 1, 1, 1]))
    m.record_scheduler_stats(SchedulerStats())  # no speculation: nothing changes
    text = generate_latest(m.registry).decode()
    assert 'pagedllm:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'pagedllm:spec_decode_num_draft_tokens_total{model_name="m"} 14.0' in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_total{model_name="m"} 10.0' in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0' in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="3"} 1.0' in text

    class Resp:
        def __init__(self, t):
            self.text = t

    monkeypatch.setattr("httpx.get", lambda *a, **k: Resp(text))
    before = {"spec_decode_num_drafts": 0.0, "spec_decode_num_draft_tokens": 0.0,
              "spec_decode_num_accepted_tokens": 0.0}
    after = serve.scrape_spec_counters("http://x")
    assert after == {"spec_decode_num_drafts": 4.0, "spec_decode_num_draft_tokens": 14.0,
                     "spec_decode_num_accepted_tokens": 10.0}
    d = serve.spec_delta(before, after)
    assert d["acceptance_rate"] == 10 / 14 and d["mean_acceptance_length"] == 1 + 10 / 4
    table = serve.format_table({**_level(), "spec_decode": d})
    assert "Acceptance rate:" in table and "0.714" in table and "3.50" in table
    monkeypatch.setattr("httpx.get", lambda *a, **k: Resp("# no spec\npagedllm:num_requests_running 0\n"))
    assert serve.scrape_spec_counters("http://x") is None


def _level():
    return serve.compute_metrics([], 1.0, max_concurrency=1, request_rate=float("inf"))
