"""``pagedllm bench serve``: an async streaming client for any OpenAI-compatible server (ours, vLLM, llama.cpp's
``llama-server``), shaped like ``vllm bench serve``.

Requests are sent at ``--request-rate`` (Poisson arrivals; ``inf``, the default, sends them all at once) with at
most ``--max-concurrency`` in flight; a list of concurrency levels (``--max-concurrency 1 4 16``) runs one pass per
level on the same prompts. Each request streams; per request it records

* TTFT: request sent -> first chunk carrying text;
* ITL: the gaps between successive text chunks (a chunk normally carries one token);
* TPOT: (E2E - TTFT) / (output tokens - 1);
* E2E: request sent -> stream finished.

Output tokens come from the server's ``usage`` (``stream_options.include_usage``) when it sends it, else from
tokenizing the generated text locally; prompt tokens likewise. Prints the table, saves every figure (and every
per-request sample) as JSON, and a PNG plot: CDFs of TTFT, ITL and E2E latency per level, and throughput per level.

    pagedllm bench serve --base-url http://127.0.0.1:8000 --dataset-name chat --num-prompts 64 --max-concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm.benchmarks import command_line
from pagedllm.benchmarks.datasets import BenchRequest, add_dataset_args, load_tokenizer, requests_from_args

# Keys of one level's results (besides the per-request samples); the test checks these.
METRIC_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
               "output_throughput", "total_token_throughput")
LATENCY_NAMES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""
    start_time: float = 0.0
    schema: Optional[dict] = None  # the JSON schema the request was constrained to (json-schema workload)
    finish_reason: Optional[str] = None


def _percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(math.floor(k))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _request_body(req: BenchRequest, backend: str, model: str, ignore_eos: bool, temperature: float,
                  use_token_ids: bool) -> tuple[str, dict]:
    common = {"model": model, "temperature": temperature, "stream": True,
              "stream_options": {"include_usage": True}, "max_tokens": req.output_len}
    schema = req.extra.get("constrain")
    if schema is not None:
        # OpenAI's strict json_schema (chat) / vLLM's structured_outputs (completions); a constrained output ends
        # where its grammar does, so ignore_eos is off for it.
        ignore_eos = False
        if backend == "openai-chat":
            common["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": schema, "strict": True}}
        else:
            common["structured_outputs"] = {"json": schema}
    if ignore_eos:
        common["ignore_eos"] = True  # a vLLM extension that llama-server and ours accept too
    if backend == "openai-chat":
        messages = req.messages or [{"role": "user", "content": req.prompt}]
        common["max_completion_tokens"] = req.output_len
        return "/v1/chat/completions", {**common, "messages": messages}
    prompt: Any = req.prompt_token_ids if (req.token_prompt and use_token_ids) else req.prompt
    if not (req.token_prompt and use_token_ids) and req.messages is not None:
        # chat-templated text already carries the special tokens; ask servers not to add a BOS of their own.
        common["add_special_tokens"] = False
    return "/v1/completions", {**common, "prompt": prompt}


async def _send(session, base_url: str, headers: dict, req: BenchRequest, backend: str, model: str, ignore_eos: bool,
                temperature: float, use_token_ids: bool, tokenizer, timeout_s: float) -> RequestResult:
    import aiohttp

    path, body = _request_body(req, backend, model, ignore_eos, temperature, use_token_ids)
    res = RequestResult(prompt_len=req.prompt_len, schema=req.extra.get("constrain"))
    usage = None
    texts: list[str] = []
    st = time.perf_counter()
    res.start_time = st
    last = None
    try:
        async with session.post(base_url + path, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return res
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n" in buf:
                    raw, buf = buf.split(b"\n", 1)
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    d = json.loads(data)
                    if d.get("error"):
                        err = d["error"]
                        res.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                        return res
                    if d.get("usage"):
                        usage = d["usage"]
                    for ch in d.get("choices") or ():
                        res.finish_reason = ch.get("finish_reason") or res.finish_reason
                        text = (ch.get("delta") or {}).get("content") if backend == "openai-chat" else ch.get("text")
                        if text:
                            now = time.perf_counter()
                            if last is None:
                                res.ttft = now - st
                            else:
                                res.itl.append(now - last)
                            last = now
                            texts.append(text)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - st
    res.generated_text = "".join(texts)
    if usage and usage.get("completion_tokens"):
        res.output_tokens = int(usage["completion_tokens"])
    else:
        res.output_tokens = len(tokenizer.encode(res.generated_text, add_special_tokens=False)) if tokenizer else 0
    if usage and usage.get("prompt_tokens"):
        res.prompt_len = int(usage["prompt_tokens"])
    res.success = last is not None
    if not res.success:
        res.error = "no text in the stream"
    return res


async def _arrivals(n: int, rate: float, rng: random.Random):
    """Yields 0..n-1, waiting exponential gaps (Poisson process of ``rate`` req/s) unless rate is inf."""
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def run_level(base_url: str, reqs: list[BenchRequest], *, backend: str, model: str, max_concurrency: Optional[int],
                    request_rate: float, ignore_eos: bool, temperature: float = 0.0, use_token_ids: bool = True,
                    tokenizer=None, seed: int = 0, api_key: Optional[str] = None, timeout_s: float = 3600.0,
                    num_warmups: int = 1, percentiles: tuple[float, ...] = (99.0,)) -> dict:
    """One benchmark pass at one concurrency level. Returns the level's metrics and per-request samples."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(reqs)
    # A fresh connection per request (as vLLM's client does): a pooled keep-alive connection that the server has
    # closed meanwhile (llama-server does) fails with "Can not write request body".
    conn = aiohttp.TCPConnector(limit=limit + 2, force_close=True)
    async with aiohttp.ClientSession(connector=conn, trust_env=False) as session:
        for w in range(num_warmups):
            warm = BenchRequest(prompt=reqs[w % len(reqs)].prompt, prompt_token_ids=reqs[w % len(reqs)].prompt_token_ids,
                                output_len=4, messages=reqs[w % len(reqs)].messages,
                                token_prompt=reqs[w % len(reqs)].token_prompt)
            r = await _send(session, base_url, headers, warm, backend, model, ignore_eos, temperature, use_token_ids,
                            tokenizer, timeout_s)
            if not r.success:
                raise RuntimeError(f"warm-up request failed: {r.error}")
        sem = asyncio.Semaphore(limit)
        rng = random.Random(seed)
        results: list[Optional[RequestResult]] = [None] * len(reqs)

        async def one(i: int) -> None:
            async with sem:
                results[i] = await _send(session, base_url, headers, reqs[i], backend, model, ignore_eos, temperature,
                                         use_token_ids, tokenizer, timeout_s)

        t0 = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(reqs), request_rate, rng):
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return compute_metrics([r for r in results if r is not None], duration, max_concurrency=max_concurrency,
                           request_rate=request_rate, percentiles=percentiles)


def compute_metrics(results: list[RequestResult], duration: float, *, max_concurrency: Optional[int],
                    request_rate: float, percentiles: tuple[float, ...] = (99.0,)) -> dict:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itl]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    e2els = [r.latency for r in ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    m: dict[str, Any] = {
        "max_concurrency": max_concurrency,
        "request_rate": request_rate if request_rate != float("inf") else "inf",
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        ms = [x * 1000.0 for x in xs]
        m[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else float("nan")
        m[f"median_{name}_ms"] = statistics.median(ms) if ms else float("nan")
        m[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else float("nan")
        for p in percentiles:
            m[f"p{_pct_name(p)}_{name}_ms"] = _percentile(ms, p)
    constrained = [r for r in results if r.schema is not None]
    if constrained:
        m["structured_requests"] = len(constrained)
        m["valid_outputs"] = sum(_valid_json(r.generated_text, r.schema) for r in constrained if r.success)
        m["valid_output_rate"] = m["valid_outputs"] / len(constrained)
        # invalid ones cut off by max_tokens (an unfinished JSON text) vs finished but invalid (a grammar bug)
        m["structured_cut_by_length"] = sum(1 for r in constrained if r.success and r.finish_reason == "length")
        # TTFT by what the server had to do first: compile a schema it sees for the first time in this run (a cache
        # miss when the server is fresh or --fresh-schemas is on), reuse one, or nothing (unconstrained).
        seen: set[str] = set()
        split: dict[str, list[float]] = {"new_schema": [], "seen_schema": [], "unconstrained": []}
        kinds: dict[int, str] = {}
        for i in sorted(range(len(results)), key=lambda i: results[i].start_time):
            r = results[i]
            if r.schema is None:
                kinds[i] = "unconstrained"
            else:
                key = json.dumps(r.schema, sort_keys=True)
                kinds[i] = "seen_schema" if key in seen else "new_schema"
                seen.add(key)
            if r.success:
                split[kinds[i]].append(r.ttft)
        for kind, xs in split.items():
            m[f"num_{kind}"] = len(xs)
            m[f"median_ttft_ms_{kind}"] = statistics.median(xs) * 1000.0 if xs else float("nan")
            # ITL by kind too: what new schemas (their compiles) do to the other requests' streams
            gaps = [x * 1000.0 for i, r in enumerate(results) if r.success and kinds[i] == kind for x in r.itl]
            m[f"median_itl_ms_{kind}"] = statistics.median(gaps) if gaps else float("nan")
            m[f"p99_itl_ms_{kind}"] = _percentile(gaps, 99.0) if gaps else float("nan")
        # per request, in request order, to compare with the same requests run unconstrained (bench compare)
        m["request_kinds"] = [kinds[i] for i in range(len(results))]
    m["request_ttfts_ms"] = [r.ttft * 1000.0 if r.success else None for r in results]
    m["request_output_tokens"] = [r.output_tokens if r.success else None for r in results]
    # per request, a digest of its text: whether two runs of the same requests (with and without speculation) agree
    m["request_text_sha1"] = [hashlib.sha1(r.generated_text.encode()).hexdigest()[:16] if r.success else None
                              for r in results]
    m["errors"] = sorted({r.error for r in results if not r.success})[:10]
    m["input_lens"] = [r.prompt_len for r in ok]
    m["output_lens"] = [r.output_tokens for r in ok]
    m["ttfts"] = ttfts
    m["itls"] = itls
    m["e2els"] = e2els
    return m


SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def scrape_spec_counters(base_url: str, api_key: Optional[str] = None) -> Optional[dict[str, float]]:
    """The server's speculative-decoding counters from ``/metrics`` (ours ``pagedllm:``, vLLM's ``vllm:``; summed
    over label sets), or None when it has none (no speculation, no Prometheus endpoint)."""
    import httpx

    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        text = httpx.get(base_url + "/metrics", headers=headers, timeout=10.0).text
    except httpx.HTTPError:
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or ":spec_decode_num_" not in line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].split(":", 1)[1]
        name = name[:-len("_total")] if name.endswith("_total") else name
        if name in SPEC_COUNTERS:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return out if len(out) == len(SPEC_COUNTERS) else None


def spec_delta(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """One level's speculative-decoding figures from the counters before and after it."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    drafts, draft_toks, acc = (d[k] for k in SPEC_COUNTERS)
    return {"num_drafts": int(drafts), "num_draft_tokens": int(draft_toks), "num_accepted_tokens": int(acc),
            "acceptance_rate": acc / draft_toks if draft_toks else float("nan"),
            "mean_acceptance_length": 1 + acc / drafts if drafts else float("nan")}
def _valid_json(text: str, schema: dict) -> bool:
    """Whether ``text`` is JSON valid against ``schema`` (failed or cut-off outputs are not)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
        return False
    return True


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def format_table(m: dict, percentiles: tuple[float, ...] = (99.0,), title: str = "Serving Benchmark Result") -> str:
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, value, fmt: str = "{:<10.2f}") -> None:
        v = value if isinstance(value, str) else fmt.format(value)
        lines.append(f"{label:<40}{v}")

    row("Successful requests:", m["completed"], "{:<10}")
    row("Failed requests:", m["failed"], "{:<10}")
    row("Maximum request concurrency:", str(m["max_concurrency"]) if m["max_concurrency"] else "unlimited")
    row("Request rate (req/s):", str(m["request_rate"]))
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", m["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    if "structured_requests" in m:
        row("Structured requests:", m["structured_requests"], "{:<10}")
        row("Valid outputs (JSON, schema):", f"{m['valid_outputs']} ({100 * m['valid_output_rate']:.1f}%)")
        row("Structured outputs cut by max_tokens:", m["structured_cut_by_length"], "{:<10}")
        for kind, label in (("new_schema", "new schema"), ("seen_schema", "seen schema"),
                            ("unconstrained", "unconstrained")):
            if m.get(f"num_{kind}"):
                row(f"Median TTFT, {label} (ms, n={m[f'num_{kind}']}):", m[f"median_ttft_ms_{kind}"])
        if m.get("num_unconstrained"):
            row("Median / P99 ITL, unconstrained (ms):",
                f"{m['median_itl_ms_unconstrained']:.2f} / {m['p99_itl_ms_unconstrained']:.2f}")
    for name, head in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{head:-^{w}}")
        up = name.upper()
        row(f"Mean {up} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {up} (ms):", m[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{_pct_name(p)} {up} (ms):", m[f"p{_pct_name(p)}_{name}_ms"])
    spec = m.get("spec_decode")
    if spec is not None:
        lines.append(f"{'Speculative Decoding':-^{w}}")
        row("Drafts:", spec["num_drafts"], "{:<10}")
        row("Draft tokens:", spec["num_draft_tokens"], "{:<10}")
        row("Accepted tokens:", spec["num_accepted_tokens"], "{:<10}")
        row("Acceptance rate:", spec["acceptance_rate"], "{:<10.3f}")
        row("Mean acceptance length:", spec["mean_acceptance_length"])
    lines.append("=" * w)
    return "\n".join(lines)


def plot_results(levels: list[dict], path: str, title: str = "") -> str:
    """Saves a 2x2 PNG: CDFs of TTFT, ITL and E2E latency per level, and throughput per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for ax, key, label in ((axes[0][0], "ttfts", "TTFT (ms)"), (axes[0][1], "itls", "inter-token latency (ms)"),
                           (axes[1][0], "e2els", "end-to-end latency (s)")):
        for lv in levels:
            xs = sorted(lv.get(key) or [])
            if not xs:
                continue
            scale = 1.0 if key == "e2els" else 1000.0
            ys = [0.0] + [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step([xs[0] * scale] + [x * scale for x in xs], ys, where="post", label=f"concurrency {lv['max_concurrency'] or 'inf'}")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"CDF of {label}")
        ax.grid(alpha=0.3)
        if any(lv.get(key) for lv in levels):
            ax.legend(fontsize=8)
    ax = axes[1][1]
    names = [str(lv["max_concurrency"] or "inf") for lv in levels]
    outs = [lv["output_throughput"] for lv in levels]
    bars = ax.bar(names, outs, color="tab:blue", label="output tok/s")
    for b, lv in zip(bars, levels):
        ax.annotate(f"{lv['output_throughput']:.0f}\n({lv['request_throughput']:.2f} req/s)",
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(outs + [1e-9]) * 1.25)
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput per concurrency level")
    ax.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _parse_rate(s: str) -> float:
    if s.lower() in ("inf", "infinity"):
        return float("inf")
    v = float(s)
    if v <= 0:
        raise argparse.ArgumentTypeError("request rate must be positive or inf")
    return v


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server root (without /v1).")
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat"],
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions.")
    p.add_argument("--model", default=None, help="Model name sent in requests (default: the server's first model).")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                   help="Most requests in flight; several values run one pass per level (default: unlimited).")
    p.add_argument("--request-rate", type=_parse_rate, default=float("inf"),
                   help="Poisson arrival rate in requests/s (default inf: all at once).")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--text-prompts", action="store_true",
                   help="Send random-token prompts as decoded text even to /v1/completions.")
    p.add_argument("--num-warmups", type=int, default=1, help="Short warm-up requests before each level.")
    p.add_argument("--percentile-metrics", "--percentiles", dest="percentiles", type=float, nargs="+",
                   default=[99.0], help="Percentiles to report (default 99).")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--label", default=None, help="Name of the server under test (in the JSON and the plot title).")
    p.add_argument("--result-file", "--save-result", dest="result_file", default=None,
                   help="JSON file to save (default: benchmarks/results/serve-<label>-<time>.json).")
    p.add_argument("--plot", default=None, help="PNG to save (default: the result file with .png).")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--speculative-config", default=None,
                   help="The server's --speculative-config (it is started separately), recorded in the result; the "
                        "acceptance figures come from its /metrics, and with this flag a server without them is an "
                        "error.")
    p.add_argument("--structured-output-ratio", type=float, default=1.0,
                   help="json-schema workload: share of requests constrained to their schema (response_format "
                        "json_schema on chat, structured_outputs on completions); the valid-output rate is reported.")
    p.add_argument("--output-lens-from", default=None, metavar="RESULT_JSON",
                   help="Give request i the output length request i had in an earlier result file of the same "
                        "workload and seed (its first level's request_output_tokens; use with --ignore-eos): e.g. "
                        "the same requests unconstrained at the lengths their constrained answers took.")
    p.add_argument("--fresh-schemas", action="store_true",
                   help="json-schema workload: tag this run's schemas (a $comment) so the server compiles each "
                        "anew; the table's 'new schema' TTFT is then the cost of a grammar cache miss.")
    add_dataset_args(p)


async def _first_model(base_url: str, api_key: Optional[str]) -> str:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(trust_env=False) as s:
        async with s.get(base_url + "/v1/models", headers=headers) as r:
            r.raise_for_status()
            return (await r.json())["data"][0]["id"]


def apply_output_lens(reqs: list[BenchRequest], result_json: str) -> None:
    """Sets each request's ``output_len`` from ``result_json``'s first level (``request_output_tokens``; a request
    that failed there keeps its own).

    Raises:
        ValueError: the file has no per-request lengths, or another number of requests.
    """
    with open(result_json) as f:
        lens = json.load(f)["levels"][0].get("request_output_tokens")
    if lens is None or len(lens) != len(reqs):
        raise ValueError(f"{result_json}: no request_output_tokens for {len(reqs)} requests")
    for r, n in zip(reqs, lens):
        if n:
            r.output_len = int(n)


def mark_structured(reqs: list[BenchRequest], ratio: float, seed: int, fresh_tag: Optional[str] = None) -> int:
    """Constrains ``round(ratio * n)`` of the requests that carry a schema (json-schema workload), chosen with
    ``seed``; the others run unconstrained (same prompts). Returns how many were constrained. ``fresh_tag``: added
    to each schema as a ``$comment`` (no meaning to validation), so a server that cached the shipped schemas in an
    earlier run compiles them again: the "new schema" TTFT is then a real cache miss."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"structured_output_ratio must be in [0, 1], got {ratio}.")
    with_schema = [i for i, r in enumerate(reqs) if "schema" in r.extra]
    k = round(ratio * len(with_schema))
    chosen = set(random.Random(seed).sample(with_schema, k)) if k else set()
    for i in with_schema:
        if i in chosen:
            schema = reqs[i].extra["schema"]
            reqs[i].extra["constrain"] = {**schema, "$comment": f"bench {fresh_tag}"} if fresh_tag else schema
        else:
            reqs[i].extra.pop("constrain", None)
    return k


def run_serve_benchmark(ns: argparse.Namespace) -> dict:
    base_url = ns.base_url.rstrip("/")
    if base_url.endswith("/v1"):
        base_url = base_url[:-3]
    num_prompts = ns.num_prompts or 64
    tok = load_tokenizer(ns.tokenizer)
    reqs = requests_from_args(ns, tok, num_prompts)
    if ns.output_lens_from:
        apply_output_lens(reqs, ns.output_lens_from)
    mark_structured(reqs, ns.structured_output_ratio, ns.seed,
                    fresh_tag=f"{os.getpid()}-{time.time_ns()}" if ns.fresh_schemas else None)
    model = ns.model or asyncio.run(_first_model(base_url, ns.api_key))
    percentiles = tuple(ns.percentiles)
    levels = []
    if getattr(ns, "speculative_config", None) and scrape_spec_counters(base_url, ns.api_key) is None:
        raise SystemExit(f"--speculative-config given but {base_url}/metrics has no spec_decode_* counters")
    for conc in ns.max_concurrency:
        spec_before = scrape_spec_counters(base_url, ns.api_key)
        m = asyncio.run(run_level(base_url, reqs, backend=ns.backend, model=model, max_concurrency=conc,
                                  request_rate=ns.request_rate, ignore_eos=ns.ignore_eos, temperature=ns.temperature,
                                  use_token_ids=not ns.text_prompts, tokenizer=tok, seed=ns.seed, api_key=ns.api_key,
                                  timeout_s=ns.request_timeout, num_warmups=ns.num_warmups, percentiles=percentiles))
        m["spec_decode"] = spec_delta(spec_before, scrape_spec_counters(base_url, ns.api_key))  # warm-ups included
        print(format_table(m, percentiles), flush=True)
        if m["errors"]:
            print("errors:", m["errors"], file=sys.stderr)
        levels.append(m)
    label = ns.label or base_url.split("//")[-1]
    out = {
        "tool": "pagedllm bench serve",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "label": label,
        "base_url": base_url,
        "backend": ns.backend,
        "model": model,
        "dataset_name": ns.dataset_name,
        "num_prompts": num_prompts,
        "ignore_eos": ns.ignore_eos,
        "structured_output_ratio": ns.structured_output_ratio if ns.dataset_name == "json-schema" else None,
        "request_rate": ns.request_rate if ns.request_rate != float("inf") else "inf",
        "max_concurrency": ns.max_concurrency,
        "percentiles": list(percentiles),
        "speculative_config": getattr(ns, "speculative_config", None),
        "command": command_line(),
        "levels": levels,
    }
    path = ns.result_file
    if path is None:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
        path = os.path.join("benchmarks", "results", f"serve-{safe}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=_json_default)
    print(f"saved {path}")
    if not ns.no_plot:
        png = ns.plot or os.path.splitext(path)[0] + ".png"
        plot_results(levels, png, title=f"{label}: {ns.dataset_name}, {num_prompts} prompts, {ns.backend}")
        print(f"saved {png}")
        out["plot"] = png
    out["result_file"] = path
    return out


def _json_default(o):
    if isinstance(o, float) and (math.isinf(o) or math.isnan(o)):
        return str(o)
    raise TypeError(type(o).__name__)


def cmd_serve(ns: argparse.Namespace) -> int:
    out = run_serve_benchmark(ns)
    return 1 if any(lv["failed"] for lv in out["levels"]) else 0
