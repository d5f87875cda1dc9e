"""Prometheus metrics of the serving engine, named after vLLM's (``vllm:`` -> ``pagedllm:``).

Every metric lives in a per-app ``CollectorRegistry`` (two servers in one process, or a test that builds several
apps, never collide in the global registry) and carries a ``model_name`` label, as vLLM's do.

The engine thread calls ``EngineMetrics.record_step`` once per step with that step's ``RequestOutput``s (always
DELTA outputs, see ``AsyncLLM``) and the scheduler's stats. Cost per step: one dict lookup and a histogram
``observe`` (a few microseconds) per request that got tokens, plus a handful of gauge sets; nothing is formatted.

Units: seconds for latencies, tokens for counts. ``kv_cache_usage_perc`` is a fraction in [0, 1] like vLLM's
(despite the name): the share of usable KV blocks referenced by requests. ``kv_cache_utilization_perc`` is the
share of token slots in those blocks that hold a computed token (1.0 when none is allocated).
"""

from __future__ import annotations

from typing import Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "pagedllm:"

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def _token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's ``build_1_2_5_buckets``)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > max_model_len:
                return out
            out.append(v)
        exp += 1


class EngineMetrics:
    """The engine's Prometheus metrics, in ``registry`` (a fresh ``CollectorRegistry`` when None)."""

    def __init__(self, model_name: str, max_model_len: int = 8192,
                 registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        labels = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, labels + list(extra), registry=r)

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Number of requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc",
                                    "KV cache usage: fraction of usable KV blocks held by requests (1 = full).")
        self.kv_cache_utilization = gauge(
            "kv_cache_utilization_perc",
            "Fraction of token slots in allocated KV blocks that hold a computed token (1 when none allocated).")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preempted requests.").labels(
            model_name)
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prefix cache queries, in tokens.").labels(model_name)
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in tokens.").labels(model_name)
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.").labels(model_name)
        self.generation_tokens = counter("generation_tokens",
                                         "Number of generation tokens processed.").labels(model_name)
        self._request_success = counter("request_success", "Count of finished requests, by finish reason.",
                                        ["finished_reason"])
        self._success_by_reason = {
            reason: self._request_success.labels(model_name, reason) for reason in ("stop", "length", "abort")}
        self._model_name = model_name
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Histogram of end-to-end request latency in seconds.", E2E_BUCKETS)
        tok_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens",
                                               "Number of prefill tokens per request.", tok_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens per request.", tok_buckets)
        # Speculative decoding (vLLM's names): acceptance rate = accepted / draft tokens, mean acceptance length
        # = 1 + accepted / drafts; per position i: drafts whose token i was accepted.
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts",
                                              "Number of spec decoding drafts (request-steps verifying drafts).").labels(
            model_name)
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens",
                                                    "Number of draft tokens.").labels(model_name)
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Number of accepted tokens.").labels(model_name)
        self._spec_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", ["position"])
        self._spec_per_pos_children: list = []
        # request_id -> [time of its last token batch, generated tokens so far]; engine thread only.
        self._live: dict[str, list] = {}

    def _success(self, reason: str):
        c = self._success_by_reason.get(reason)
        if c is None:
            c = self._success_by_reason[reason] = self._request_success.labels(self._model_name, reason)
        return c

    # ------------------------------------------------------------------ engine thread
    def record_outputs(self, outputs: Iterable, now: float) -> None:
        """Per-request latencies and token counts from one step's DELTA ``RequestOutput``s."""
        gen = 0
        for ro in outputs:
            n_new = 0
            for c in ro.outputs:
                n_new += len(c.token_ids)
            live = self._live.get(ro.request_id)
            if n_new:
                gen += n_new
                if live is None:
                    arrival = ro.metrics.arrival_time if ro.metrics is not None else now
                    self.time_to_first_token.observe(now - arrival)
                    self.prompt_tokens.inc(len(ro.prompt_token_ids))
                    self.request_prompt_tokens.observe(len(ro.prompt_token_ids))
                    live = self._live[ro.request_id] = [now, n_new]
                else:
                    self.inter_token_latency.observe(now - live[0])
                    live[0] = now
                    live[1] += n_new
            if ro.finished:
                self._live.pop(ro.request_id, None)
                if ro.metrics is not None:
                    self.e2e_request_latency.observe(now - ro.metrics.arrival_time)
                self.request_generation_tokens.observe(live[1] if live is not None else 0)
                for c in ro.outputs:
                    if c.finish_reason is not None:
                        self._success(c.finish_reason).inc()
        if gen:
            self.generation_tokens.inc(gen)

    def record_scheduler_stats(self, stats) -> None:
        """``stats``: a ``SchedulerStats`` (preemptions and prefix-cache counts are deltas since the last call)."""
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.kv_cache_utilization.set(stats.kv_cache_utilization)
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        spec = stats.spec_decoding_stats
        if spec is not None and spec.num_drafts:
            self.spec_decode_num_drafts.inc(spec.num_drafts)
            self.spec_decode_num_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(spec.num_accepted_tokens)
            children = self._spec_per_pos_children
            for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                if pos == len(children):
                    children.append(self._spec_per_pos.labels(self._model_name, str(pos)))
                if n:
                    children[pos].inc(n)
