"""Load client for ``pagedllm serve`` (or any OpenAI-compatible server): N concurrent streaming chat clients.

Each client sends chat requests one after another until ``--num-requests`` have been sent in total. A prompt is a
slice of random English-like text of ``--min-prompt-tokens``..``--max-prompt-tokens`` tokens (uniform; sliced
with the server's /tokenize + /detokenize so lengths are exact), the output is ``--max-tokens`` tokens
(``ignore_eos``, so every request decodes the same amount).

Reports requests/s, output tokens/s, TTFT (request sent -> first content chunk) and ITL (gap between successive
content chunks; a chunk normally carries one token) as P50/P99, and mean TPOT per request.

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --num-clients 16 --num-requests 48
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("the of and to in is was that for on with as by at from his her they this which be are have had one "
         "an not but all were when we there can more if out so what up its about into than them only other new "
         "some time could these two may first then do any like my now over such our man me even most made after "
         "also did many before must through back years where much your way well down should because each just "
         "those people how too little state good very make world still own see men work long get here between both "
         "life being under never day same another know while last might us great old year off come since against "
         "go came right used take three river mountain city garden history music science engine window market "
         "summer winter story paper letter question answer number water light sound voice school family").split()


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def make_prompts(client: httpx.AsyncClient, n: int, lo: int, hi: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(hi * 3 + 200))
    ids = (await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()["tokens"]
    prompts = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randint(0, len(ids) - length)
        r = await client.post("/detokenize", json={"tokens": ids[start:start + length]})
        prompts.append("Continue this text: " + r.json()["prompt"])
    return prompts


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_completion_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    res = Result(ok=False)
    last = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    res.error = d["error"]["message"]
                    return res
                if d.get("usage"):
                    res.prompt_tokens = d["usage"]["prompt_tokens"]
                    res.output_tokens = d["usage"]["completion_tokens"]
                for ch in d.get("choices", ()):
                    if ch["delta"].get("content"):
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.itls.append(now - last)
                        last = now
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.ok = last is not None
    return res


async def run(args) -> dict:
    limits = httpx.Limits(max_connections=args.num_clients + 4, max_keepalive_connections=args.num_clients + 4)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = await make_prompts(client, args.num_requests, args.min_prompt_tokens, args.max_prompt_tokens,
                                     args.seed)
        if args.warmup:
            await one_request(client, model, prompts[0], 8)
        queue: asyncio.Queue = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        results: list[Result] = []

        async def worker() -> None:
            while True:
                try:
                    p = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await one_request(client, model, p, args.max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(args.num_clients)])
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itls]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "num_clients": args.num_clients, "num_requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": wall, "requests_per_s": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
        "mean_prompt_tokens": statistics.mean(r.prompt_tokens for r in ok) if ok else 0,
        "mean_output_tokens": out_tokens / len(ok) if ok else 0,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
        "tpot_mean_s": statistics.mean(tpots) if tpots else float("nan"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--num-clients", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--min-prompt-tokens", type=int, default=100)
    p.add_argument("--max-prompt-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    res = asyncio.run(run(args))
    print(f"clients={res['num_clients']} requests={res['num_requests']} failed={res['failed']} "
          f"wall={res['wall_s']:.1f}s")
    print(f"requests/s={res['requests_per_s']:.3f}  output tok/s={res['output_tokens_per_s']:.1f}  "
          f"(mean prompt {res['mean_prompt_tokens']:.0f} tok, output {res['mean_output_tokens']:.0f} tok)")
    print(f"TTFT P50={res['ttft_p50_s'] * 1e3:.0f} ms  P99={res['ttft_p99_s'] * 1e3:.0f} ms")
    print(f"ITL  P50={res['itl_p50_s'] * 1e3:.0f} ms  P99={res['itl_p99_s'] * 1e3:.0f} ms  "
          f"mean TPOT={res['tpot_mean_s'] * 1e3:.0f} ms")
    if res["errors"]:
        print("errors:", res["errors"], file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
