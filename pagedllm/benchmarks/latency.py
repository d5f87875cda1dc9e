"""``pagedllm bench latency``: latency of one batch of requests (default a single request) through our engine.

Each iteration submits ``--batch-size`` fresh random-token prompts of ``--input-len`` tokens (fresh, so no prefix
cache hit flatters the prefill) and drives the engine step by step, timing every token as it arrives:

* TTFT: submit -> first token (mean over the batch); prefill tok/s = prompt tokens of the batch / time until every
  request has its first token;
* ITL: gaps between successive tokens of a request = the decode step time at this batch size; decode tok/s =
  batch size / mean ITL;
* E2E: submit -> last token.

    pagedllm bench latency --input-len 128 --output-len 128 --num-iters 3 [--batch-size 32] [--json]

``--dataset-name code-edit`` (or ``chat``, ``shared-prefix``) takes the batches' prompts from that workload instead
(each iteration the next ones; output stops at EOS unless ``--ignore-eos``). With ``--speculative-config`` the
result also gives the draft tokens verified, how many were accepted, the acceptance rate and the mean acceptance
length (tokens per verifying step of a request: 1 + accepted / drafts), over the timed iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from pagedllm.benchmarks import command_line
from pagedllm.benchmarks.datasets import load_tokenizer, make_requests

RESULT_KEYS = ("batch_size", "input_len", "output_len", "num_iters", "mean_ttft_ms", "median_ttft_ms",
               "prefill_tokens_per_second", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "decode_tokens_per_second",
               "mean_e2e_latency_s", "itl_per_token_ms")
SPEC_KEYS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_acceptance_rate",
             "spec_mean_acceptance_length")


def add_latency_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.cli import add_engine_args

    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled SmolLM2).")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dataset-name", default="random", choices=("random", "code-edit", "chat", "shared-prefix"),
                   help="random: --input-len random tokens; otherwise that workload's prompts (see datasets.py).")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="Generate exactly --output-len tokens (default: on for random, off for the other workloads).")
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--output-json", default=None)
    p.add_argument("--json", action="store_true", help="Print the results as one JSON object.")
    add_engine_args(p)


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_latency(ns: argparse.Namespace) -> dict:
    from pagedllm.entrypoints.cli import engine_args_from_namespace
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

    args = engine_args_from_namespace(ns)
    llm = LLM(ns.model, **{k: v for k, v in vars(args).items() if k != "model"})
    eng = llm.llm_engine
    tok = load_tokenizer(ns.tokenizer, ns.model)
    B = ns.batch_size
    n_iter = ns.num_iters_warmup + ns.num_iters
    dataset = getattr(ns, "dataset_name", "random")
    ignore_eos = getattr(ns, "ignore_eos", None)
    ignore_eos = dataset == "random" if ignore_eos is None else ignore_eos
    reqs = make_requests(dataset, tok, B * n_iter, input_len=ns.input_len, output_len=ns.output_len, seed=ns.seed)
    spec_totals = [0, 0, 0]  # drafts, draft tokens, accepted tokens over the timed iterations
    num_output_tokens = 0
    ttfts: list[float] = []
    prefill_rates: list[float] = []
    itls: list[float] = []
    e2es: list[float] = []
    per_token: list[list[float]] = [[] for _ in range(ns.output_len)]  # ITL by output position (1 = 2nd token)
    rid = 0
    for it in range(n_iter):
        batch = reqs[it * B:(it + 1) * B]
        t0 = time.perf_counter()
        ids = []
        for r in batch:
            sp = SamplingParams(max_tokens=ns.output_len, temperature=0.0, ignore_eos=ignore_eos)
            sp.output_kind = RequestOutputKind.DELTA
            name = f"lat-{rid}"
            rid += 1
            eng.add_request(name, {"prompt_token_ids": r.prompt_token_ids}, sp)
            ids.append(name)
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        count: dict[str, int] = {i: 0 for i in ids}
        gaps: list[float] = []
        while eng.has_unfinished_requests():
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                n_new = sum(len(c.token_ids) for c in o.outputs)
                if n_new == 0:
                    continue
                if o.request_id not in first:
                    first[o.request_id] = now
                else:
                    gap = (now - last[o.request_id]) / n_new
                    for k in range(n_new):
                        gaps.append(gap)
                        pos = count[o.request_id] + k
                        if pos < len(per_token):
                            per_token[pos].append(gap)
                last[o.request_id] = now
                count[o.request_id] += n_new
        stats = eng.engine_core.make_stats().spec_decoding_stats
        if it < ns.num_iters_warmup:
            llm.reset_prefix_cache()
            continue
        if stats is not None:
            spec_totals[0] += stats.num_drafts
            spec_totals[1] += stats.num_draft_tokens
            spec_totals[2] += stats.num_accepted_tokens
        num_output_tokens += sum(count.values())
        ttfts.extend(first[i] - t0 for i in ids)
        prefill_rates.append(sum(r.prompt_len for r in batch) / (max(first.values()) - t0))
        itls.extend(gaps)
        e2es.append(max(last.values()) - t0)
        llm.reset_prefix_cache()
    mean_itl = statistics.fmean(itls) if itls else float("nan")
    res = {
        "backend": "pagedllm",
        "batch_size": B, "input_len": ns.input_len, "output_len": ns.output_len, "num_iters": ns.num_iters,
        "mean_ttft_ms": statistics.fmean(ttfts) * 1e3, "median_ttft_ms": statistics.median(ttfts) * 1e3,
        "prefill_tokens_per_second": statistics.fmean(prefill_rates),
        "mean_itl_ms": mean_itl * 1e3,
        "median_itl_ms": statistics.median(itls) * 1e3 if itls else float("nan"),
        "p99_itl_ms": _pct(itls, 99) * 1e3 if itls else float("nan"),
        "decode_tokens_per_second": B / mean_itl if itls else float("nan"),
        "mean_e2e_latency_s": statistics.fmean(e2es),
        "dataset_name": dataset,
        "num_output_tokens": num_output_tokens,
        "itl_per_token_ms": [statistics.fmean(x) * 1e3 if x else None for x in per_token[1:]],
        "engine_args": vars(args),
        "command": command_line(),
    }
    if args.speculative_config is not None:
        drafts, draft_toks, accepted = spec_totals
        res.update(spec_num_drafts=drafts, spec_num_draft_tokens=draft_toks, spec_num_accepted_tokens=accepted,
                   spec_acceptance_rate=accepted / draft_toks if draft_toks else float("nan"),
                   spec_mean_acceptance_length=1 + accepted / drafts if drafts else float("nan"))
    return res


def format_result(res: dict) -> str:
    return "\n".join([
        f"Latency: batch {res['batch_size']}, {res['input_len']} in / {res['output_len']} out, "
        f"{res['num_iters']} iterations",
        f"TTFT mean {res['mean_ttft_ms']:.1f} ms, median {res['median_ttft_ms']:.1f} ms; "
        f"prefill {res['prefill_tokens_per_second']:.1f} tok/s",
        f"ITL (decode step) mean {res['mean_itl_ms']:.2f} ms, median {res['median_itl_ms']:.2f} ms, "
        f"P99 {res['p99_itl_ms']:.2f} ms; decode {res['decode_tokens_per_second']:.1f} tok/s",
        f"E2E latency mean {res['mean_e2e_latency_s']:.3f} s",
    ] + ([f"Speculative decoding: {res['spec_num_draft_tokens']} draft tokens in {res['spec_num_drafts']} drafts, "
          f"{res['spec_num_accepted_tokens']} accepted (acceptance rate {res['spec_acceptance_rate']:.3f}, "
          f"mean acceptance length {res['spec_mean_acceptance_length']:.2f})"] if "spec_num_drafts" in res else []))


def cmd_latency(ns: argparse.Namespace) -> int:
    res = run_latency(ns)
    print(json.dumps(res) if ns.json else format_result(res))
    if ns.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(ns.output_json)), exist_ok=True)
        with open(ns.output_json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
