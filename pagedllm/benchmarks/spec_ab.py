"""``pagedllm bench speculative``: the same requests with and without speculative decoding, runs interleaved.

One process loads the model once and builds two engines on it: ``base`` (no speculation) and ``spec``
(``--speculative-config``). On a shared machine a slow minute must fall on both, so the runs alternate: for every
round and every batch of ``--batch-size`` prompts, one engine runs it and then the other (the order flips each
time). Per run it records

* decode tok/s: output tokens after the first / (time of the last token - time of the first), summed over the
  batch's requests (= the single-stream decode speed at ``--batch-size 1``);
* throughput: all output tokens / the run's wall time (prefill included);
* whether the two engines' outputs are identical (greedy: they must be).

It prints min / median / max of each engine's figures and of the per-run ratios ``spec / base``, the acceptance
figures (draft tokens, accepted, acceptance rate, mean acceptance length) and how many runs had identical output.

    pagedllm bench speculative --dataset-name code-edit --num-prompts 8 --rounds 3 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 5}'
    pagedllm bench speculative --batch-size 32 --num-prompts 32 --rounds 3 --speculative-config ...
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


def add_spec_ab_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.cli import add_engine_args

    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled SmolLM2).")
    p.add_argument("--dataset-name", default="code-edit", choices=("code-edit", "chat", "shared-prefix", "random"))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=1, help="Requests submitted together in one run.")
    p.add_argument("--rounds", type=int, default=3, help="Passes over the prompts (each engine runs each batch once "
                                                         "per round).")
    p.add_argument("--input-len", type=int, default=256, help="random: prompt tokens.")
    p.add_argument("--output-len", type=int, default=256, help="Most output tokens per request.")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--output-json", default=None)
    p.add_argument("--json", action="store_true")
    add_engine_args(p)


def _run_batch(eng, prompts, sp, tag: str) -> dict:
    """Runs ``prompts`` together through ``eng`` (an ``LLMEngine``) -> timings and outputs."""
    ids = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
        ids.append(rid)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    toks: dict[str, list[int]] = {i: [] for i in ids}
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            new = o.outputs[0].token_ids
            if not new:
                continue
            toks[o.request_id].extend(new)
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
    wall = time.perf_counter() - t0
    decode_tokens = sum(len(toks[i]) - 1 for i in ids)
    decode_time = sum(last[i] - first[i] for i in ids if i in first)
    n_out = sum(len(t) for t in toks.values())
    return {"wall_s": wall, "output_tokens": n_out,
            "decode_tokens_per_second": decode_tokens / decode_time if decode_time > 0 else float("nan"),
            "throughput": n_out / wall, "outputs": [toks[i] for i in ids]}


def _summary(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "all": xs}


def run_spec_ab(ns: argparse.Namespace) -> dict:
    from pagedllm.entrypoints.cli import engine_args_from_namespace
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

    args = engine_args_from_namespace(ns)
    if args.speculative_config is None:
        raise SystemExit("bench speculative needs --speculative-config")
    kw = {k: v for k, v in vars(args).items() if k not in ("model", "speculative_config")}
    base = LLM(ns.model, **kw)
    spec = base.with_engine_args(speculative_config=args.speculative_config)
    tok = load_tokenizer(ns.tokenizer, ns.model)
    reqs = make_requests(ns.dataset_name, tok, ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len,
                         seed=ns.seed)
    prompts = [r.prompt_token_ids for r in reqs]
    sp = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=ns.ignore_eos)
    sp.output_kind = RequestOutputKind.DELTA
    B = ns.batch_size
    batches = [prompts[i:i + B] for i in range(0, len(prompts), B)]
    engines = {"base": base.llm_engine, "spec": spec.llm_engine}
    for name, eng in engines.items():  # warm-up (kernels, allocator), not timed
        _run_batch(eng, batches[0][:1], SamplingParams(temperature=0.0, max_tokens=8), f"warm-{name}")
        eng.engine_core.make_stats()
    runs = []
    n = 0
    for rnd in range(ns.rounds):
        for bi, batch in enumerate(batches):
            order = ["base", "spec"] if (rnd + bi) % 2 == 0 else ["spec", "base"]
            res = {}
            for name in order:
                engines[name].reset_prefix_cache()
                res[name] = _run_batch(engines[name], batch, sp, f"{name}-{n}")
                n += 1
            print(f"round {rnd} batch {bi}: decode tok/s base {res['base']['decode_tokens_per_second']:.1f} "
                  f"spec {res['spec']['decode_tokens_per_second']:.1f}, throughput base "
                  f"{res['base']['throughput']:.1f} spec {res['spec']['throughput']:.1f}", file=sys.stderr, flush=True)
            runs.append({"round": rnd, "batch": bi, "order": order,
                         "identical": res["base"]["outputs"] == res["spec"]["outputs"],
                         **{f"{k}_{name}": res[name][k] for name in res
                            for k in ("decode_tokens_per_second", "throughput", "output_tokens", "wall_s")}})
    st = engines["spec"].engine_core.make_stats().spec_decoding_stats
    out = {
        "model": base.llm_engine.config.model.model, "dataset_name": ns.dataset_name, "num_prompts": len(prompts),
        "batch_size": B, "rounds": ns.rounds, "output_len": ns.output_len, "ignore_eos": ns.ignore_eos,
        "speculative_config": args.speculative_config,
        "num_runs": len(runs), "num_identical": sum(r["identical"] for r in runs),
        "spec_num_drafts": st.num_drafts, "spec_num_draft_tokens": st.num_draft_tokens,
        "spec_num_accepted_tokens": st.num_accepted_tokens,
        "spec_acceptance_rate": st.num_accepted_tokens / st.num_draft_tokens if st.num_draft_tokens else float("nan"),
        "spec_mean_acceptance_length": 1 + st.num_accepted_tokens / st.num_drafts if st.num_drafts else float("nan"),
        "command": command_line(), "runs": runs,
    }
    for k in ("decode_tokens_per_second", "throughput"):
        for name in ("base", "spec"):
            out[f"{k}_{name}"] = _summary([r[f"{k}_{name}"] for r in runs])
        out[f"{k}_ratio"] = _summary([r[f"{k}_spec"] / r[f"{k}_base"] for r in runs])
    return out


def format_result(res: dict) -> str:
    def line(label, s, fmt="{:.2f}"):
        return f"{label:<34} min {fmt.format(s['min'])}  median {fmt.format(s['median'])}  max {fmt.format(s['max'])}"

    return "\n".join([
        f"Speculative A/B: {res['dataset_name']}, {res['num_prompts']} prompts, batch {res['batch_size']}, "
        f"{res['rounds']} rounds ({res['num_runs']} interleaved run pairs)",
        f"config: {json.dumps(res['speculative_config']) if not isinstance(res['speculative_config'], str) else res['speculative_config']}",
        line("decode tok/s, no speculation:", res["decode_tokens_per_second_base"], "{:.1f}"),
        line("decode tok/s, speculation:", res["decode_tokens_per_second_spec"], "{:.1f}"),
        line("decode speed-up (per run pair):", res["decode_tokens_per_second_ratio"], "{:.3f}"),
        line("throughput tok/s, no speculation:", res["throughput_base"], "{:.1f}"),
        line("throughput tok/s, speculation:", res["throughput_spec"], "{:.1f}"),
        line("throughput ratio (per run pair):", res["throughput_ratio"], "{:.3f}"),
        f"identical greedy output: {res['num_identical']} of {res['num_runs']} run pairs",
        f"draft tokens {res['spec_num_draft_tokens']} in {res['spec_num_drafts']} drafts, accepted "
        f"{res['spec_num_accepted_tokens']} (acceptance rate {res['spec_acceptance_rate']:.3f}, mean acceptance "
        f"length {res['spec_mean_acceptance_length']:.2f})",
    ])


def cmd_spec_ab(ns: argparse.Namespace) -> int:
    res = run_spec_ab(ns)
    print(json.dumps(res, default=str) if ns.json else format_result(res))
    if ns.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(ns.output_json)), exist_ok=True)
        with open(ns.output_json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0
