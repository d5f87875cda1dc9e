"""``GET /stats``: the dashboard's JSON, derived from the Prometheus counters of ``pagedllm.metrics``.

A ``StatsSampler`` reads the engine's ``EngineMetrics`` registry once a second (an asyncio task on the server's
event loop; the engine thread is never touched) into a ring of ``Snapshot``s, the last ``history_s`` seconds.
Rates and percentiles are differences between snapshots, the way Prometheus' ``rate()`` and
``histogram_quantile()`` compute them from the same counters; ``/metrics`` and ``/stats`` therefore never disagree.

Units: seconds for times and latencies, tokens per second for rates, fractions in [0, 1] for
``kv_cache_usage_perc`` (vLLM's name, despite the ``perc``) and ``prefix_cache_hit_rate``.

Cost: one ``registry.collect()`` pass (~50 samples) per second, and per ``/stats`` call O(points x buckets) float
operations for the points it returns (300 points x 4 quantiles over ~22 buckets: well under a millisecond per ten
points on this CPU).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["Snapshot", "StatsSampler", "engine_info", "histogram_quantile", "read_snapshot"]

_PREFIX = "pagedllm:"
_TTFT = _PREFIX + "time_to_first_token_seconds"
_ITL = _PREFIX + "inter_token_latency_seconds"
_SCALARS = {
    _PREFIX + "num_requests_running": "num_requests_running",
    _PREFIX + "num_requests_waiting": "num_requests_waiting",
    _PREFIX + "kv_cache_usage_perc": "kv_cache_usage_perc",
    _PREFIX + "prompt_tokens_total": "prompt_tokens",
    _PREFIX + "generation_tokens_total": "generation_tokens",
    _PREFIX + "num_preemptions_total": "num_preemptions",
    _PREFIX + "prefix_cache_queries_total": "prefix_cache_queries",
    _PREFIX + "prefix_cache_hits_total": "prefix_cache_hits",
}
_SUCCESS = _PREFIX + "request_success_total"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The engine's counters at one instant (``time``: Unix seconds). Histogram buckets are cumulative counts, one per
    upper bound in the sampler's ``*_bounds`` (the last bound is +inf), as Prometheus exports them."""

    time: float
    num_requests_running: float = 0.0
    num_requests_waiting: float = 0.0
    kv_cache_usage_perc: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    num_preemptions: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    ttft_buckets: tuple[float, ...] = ()
    itl_buckets: tuple[float, ...] = ()
    request_success: tuple[tuple[str, float], ...] = ()  # (finished_reason, count), sorted


def _bounds_of(registry, name: str) -> tuple[float, ...]:
    for fam in registry.collect():
        if fam.name == name:
            return tuple(float(s.labels["le"]) for s in fam.samples if s.name == name + "_bucket")
    return ()


def read_snapshot(registry, now: Optional[float] = None) -> Snapshot:
    """One pass over ``registry`` (an ``EngineMetrics.registry``). Labels other than ``le`` / ``finished_reason`` are
    summed over (one model per server today)."""
    vals: dict[str, float] = dict.fromkeys(_SCALARS.values(), 0.0)
    ttft: dict[float, float] = {}
    itl: dict[float, float] = {}
    success: dict[str, float] = {}
    for fam in registry.collect():
        for s in fam.samples:
            key = _SCALARS.get(s.name)
            if key is not None:
                vals[key] += s.value
            elif s.name == _TTFT + "_bucket":
                le = float(s.labels["le"])
                ttft[le] = ttft.get(le, 0.0) + s.value
            elif s.name == _ITL + "_bucket":
                le = float(s.labels["le"])
                itl[le] = itl.get(le, 0.0) + s.value
            elif s.name == _SUCCESS:
                r = s.labels.get("finished_reason", "")
                success[r] = success.get(r, 0.0) + s.value
    return Snapshot(time=time.time() if now is None else now, **vals,
                    ttft_buckets=tuple(ttft[k] for k in sorted(ttft)), itl_buckets=tuple(itl[k] for k in sorted(itl)),
                    request_success=tuple(sorted(success.items())))


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> Optional[float]:
    """The ``q``-quantile (0 < q < 1) of a histogram with cumulative ``counts`` per upper bound ``bounds`` (the last
    +inf), by linear interpolation inside the bucket that holds the rank (Prometheus' ``histogram_quantile``: the
    first bucket's lower edge is 0; a rank in the +inf bucket answers the largest finite bound). None when empty.

    Example: bounds (0.1, 0.5, +inf), counts (2, 6, 6): q=0.5 -> rank 3, in (0.1, 0.5] holding ranks 2..6 ->
    0.1 + (3 - 2) / 4 * 0.4 = 0.2.
    """
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank and count > prev_count:
            if math.isinf(bound):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def _first_attr(obj: Any, names: Sequence[str]) -> Any:
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    return None


def engine_info(engine, version: str = "") -> dict:
    """The engine's configuration for the dashboard (plain JSON values; None where the config doesn't say).
    ``engine``: an ``AsyncLLM`` (anything with ``config`` and ``num_kv_blocks``)."""
    cfg = engine.config
    mc = cfg.model
    cc = getattr(cfg, "cache", None)
    sc = getattr(cfg, "scheduler", None)
    pc = getattr(cfg, "parallel", None)

    def get(obj, name, cast=None):
        v = getattr(obj, name, None)
        return v if v is None or cast is None else cast(v)

    quant = getattr(mc, "quantization", None)
    quant_name = None if quant is None else str(_first_attr(quant, ("method", "name")) or quant)
    # The kernels' ISA level lives in a KernelConfig once the kernels wing has one; until then: unknown (None).
    kernel = _first_attr(cfg, ("kernel", "kernel_config", "kernels"))
    isa = _first_attr(kernel, ("isa", "isa_level", "level")) if kernel is not None else None
    num_blocks = int(engine.num_kv_blocks)
    block_size = get(cc, "block_size", int)
    return {
        "model": str(mc.model),
        "served_model_name": mc.served_model_name,
        "architecture": get(mc, "architecture"),
        "dtype": str(mc.dtype).replace("torch.", ""),
        "quantization": quant_name,
        "isa": None if isa is None else str(getattr(isa, "value", isa)),
        "max_model_len": get(mc, "max_model_len", int),
        "block_size": block_size,
        "num_kv_blocks": num_blocks,
        # Block 0 is the null block: usable tokens = (blocks - 1) * block_size.
        "kv_cache_tokens": None if block_size is None else max(num_blocks - 1, 0) * block_size,
        "enable_prefix_caching": get(cc, "enable_prefix_caching", bool),
        "max_num_seqs": get(sc, "max_num_seqs", int),
        "max_num_batched_tokens": get(sc, "max_num_batched_tokens", int),
        "long_prefill_token_threshold": get(sc, "long_prefill_token_threshold", int),
        "tensor_parallel_size": get(pc, "tensor_parallel_size", int) or 1,
        "pipeline_parallel_size": get(pc, "pipeline_parallel_size", int) or 1,
        "engine_mode": getattr(engine, "engine_mode", None),
        "version": version,
    }


def _ratio(num: float, den: float) -> Optional[float]:
    return num / den if den > 0 else None


def _delta(a: Sequence[float], b: Sequence[float]) -> tuple[float, ...]:
    if len(a) != len(b):  # not expected (fixed buckets); treat the older as empty
        return tuple(b)
    return tuple(y - x for x, y in zip(a, b))


class StatsSampler:
    """Snapshots of ``engine.metrics`` every ``interval_s`` seconds, the last ``history_s`` seconds of them.

    ``window_s``: the trailing window for each point's percentiles and hit rate (and for the ``current`` rates).
    """

    SERIES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
              "prompt_tokens_per_s", "generation_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
              "num_preemptions")

    def __init__(self, engine, interval_s: float = 1.0, history_s: float = 300.0, window_s: float = 10.0,
                 version: str = "") -> None:
        if not (interval_s > 0 and history_s >= interval_s and window_s >= interval_s):
            raise ValueError("need interval_s > 0 and history_s, window_s >= interval_s")
        self.engine = engine
        self.interval_s = float(interval_s)
        self.history_s = float(history_s)
        self.window_s = float(window_s)
        self.version = version
        self.started = time.time()
        self._window_points = max(1, round(window_s / interval_s))
        # One extra point so the oldest kept point still has a full window behind it for its rate.
        self._ring: deque[Snapshot] = deque(maxlen=int(round(history_s / interval_s)) + self._window_points + 1)
        registry = self.registry
        self.ttft_bounds = _bounds_of(registry, _TTFT) if registry is not None else ()
        self.itl_bounds = _bounds_of(registry, _ITL) if registry is not None else ()
        self._info: Optional[dict] = None
        self._task: Optional[asyncio.Task] = None

    @property
    def registry(self):
        m = getattr(self.engine, "metrics", None)
        return None if m is None else m.registry

    # ------------------------------------------------------------------ sampling
    def sample(self, now: Optional[float] = None) -> Optional[Snapshot]:
        """Takes one snapshot into the ring and returns it (None without metrics: ``log_stats=False``)."""
        registry = self.registry
        if registry is None:
            return None
        snap = read_snapshot(registry, now)
        self._ring.append(snap)
        return snap

    async def run(self) -> None:
        """Samples forever every ``interval_s`` (cancel to stop)."""
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        while True:
            self.sample()
            next_t += self.interval_s
            delay = next_t - loop.time()
            if delay < 0:  # the loop was blocked: don't try to catch up with a burst of samples
                next_t, delay = loop.time(), 0.0
            await asyncio.sleep(delay)

    def start(self) -> None:
        """Starts ``run`` on the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name="pagedllm-stats-sampler")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # ------------------------------------------------------------------ reading
    def _point(self, i: int, snaps: Sequence[Snapshot]) -> dict:
        cur = snaps[i]
        prev = snaps[i - 1] if i > 0 else None
        win = snaps[max(0, i - self._window_points)]
        dt = cur.time - prev.time if prev is not None else 0.0
        ttft = _delta(win.ttft_buckets, cur.ttft_buckets)
        itl = _delta(win.itl_buckets, cur.itl_buckets)

        def rate(field: str) -> Optional[float]:
            if prev is None or dt <= 0:
                return None
            return max(0.0, getattr(cur, field) - getattr(prev, field)) / dt

        return {
            "time": cur.time,
            "num_requests_running": cur.num_requests_running,
            "num_requests_waiting": cur.num_requests_waiting,
            "kv_cache_usage_perc": cur.kv_cache_usage_perc,
            "prefix_cache_hit_rate": _ratio(cur.prefix_cache_hits - win.prefix_cache_hits,
                                            cur.prefix_cache_queries - win.prefix_cache_queries),
            "prompt_tokens_per_s": rate("prompt_tokens"),
            "generation_tokens_per_s": rate("generation_tokens"),
            "ttft_p50_s": histogram_quantile(0.5, self.ttft_bounds, ttft),
            "ttft_p99_s": histogram_quantile(0.99, self.ttft_bounds, ttft),
            "itl_p50_s": histogram_quantile(0.5, self.itl_bounds, itl),
            "itl_p99_s": histogram_quantile(0.99, self.itl_bounds, itl),
            "num_preemptions": cur.num_preemptions,
        }

    def to_dict(self, since: Optional[float] = None) -> dict:
        """The ``/stats`` body. ``series`` holds the points newer than ``since`` (Unix seconds; all when None), each
        list aligned with ``series["time"]``; ``current`` is read live (gauges) and over the last ``window_s``."""
        if self._info is None:
            self._info = engine_info(self.engine, self.version)
        now = time.time()
        out: dict[str, Any] = {
            "object": "stats",
            "time": now,
            "uptime_s": now - self.started,
            "interval_s": self.interval_s,
            "window_s": self.window_s,
            "history_s": self.history_s,
            "config": self._info,
            "num_requests_in_flight": int(getattr(self.engine, "num_in_flight", 0)),
        }
        registry = self.registry
        if registry is None:
            out.update(current=None, totals=None, series={k: [] for k in ("time",) + self.SERIES})
            return out
        live = read_snapshot(registry, now)
        snaps = list(self._ring)
        # current: the live gauges; rates and percentiles over the last window (the newest kept snapshot that is at
        # least window_s old, else the oldest one).
        base = next((s for s in reversed(snaps) if s.time <= now - self.window_s), snaps[0] if snaps else None)
        cur = {"num_requests_running": live.num_requests_running, "num_requests_waiting": live.num_requests_waiting,
               "kv_cache_usage_perc": live.kv_cache_usage_perc}
        if base is not None and now - base.time > 0:
            dt = now - base.time
            ttft = _delta(base.ttft_buckets, live.ttft_buckets)
            itl = _delta(base.itl_buckets, live.itl_buckets)
            cur.update(
                prompt_tokens_per_s=max(0.0, live.prompt_tokens - base.prompt_tokens) / dt,
                generation_tokens_per_s=max(0.0, live.generation_tokens - base.generation_tokens) / dt,
                prefix_cache_hit_rate=_ratio(live.prefix_cache_hits - base.prefix_cache_hits,
                                             live.prefix_cache_queries - base.prefix_cache_queries),
                ttft_p50_s=histogram_quantile(0.5, self.ttft_bounds, ttft),
                ttft_p99_s=histogram_quantile(0.99, self.ttft_bounds, ttft),
                itl_p50_s=histogram_quantile(0.5, self.itl_bounds, itl),
                itl_p99_s=histogram_quantile(0.99, self.itl_bounds, itl),
                window_s=dt)
        else:
            cur.update(dict.fromkeys(("prompt_tokens_per_s", "generation_tokens_per_s", "prefix_cache_hit_rate",
                                      "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "window_s")))
        out["current"] = cur
        out["totals"] = {
            "prompt_tokens": live.prompt_tokens,
            "generation_tokens": live.generation_tokens,
            "num_preemptions": live.num_preemptions,
            "prefix_cache_queries": live.prefix_cache_queries,
            "prefix_cache_hits": live.prefix_cache_hits,
            "prefix_cache_hit_rate": _ratio(live.prefix_cache_hits, live.prefix_cache_queries),
            "request_success": dict(live.request_success),
            "ttft_p50_s": histogram_quantile(0.5, self.ttft_bounds, live.ttft_buckets),
            "ttft_p99_s": histogram_quantile(0.99, self.ttft_bounds, live.ttft_buckets),
            "itl_p50_s": histogram_quantile(0.5, self.itl_bounds, live.itl_buckets),
            "itl_p99_s": histogram_quantile(0.99, self.itl_bounds, live.itl_buckets),
        }
        # Points: skip the window-only head of the ring (kept so the oldest shown point has its full window).
        first = max(0, len(snaps) - int(round(self.history_s / self.interval_s)))
        if since is not None:
            while first < len(snaps) and snaps[first].time <= since:
                first += 1
        points = [self._point(i, snaps) for i in range(first, len(snaps))]
        out["series"] = {k: [p[k] for p in points] for k in ("time",) + self.SERIES}
        return out
