"""Offline throughput of vLLM (``vllm.LLM.generate``) on a request file written by ``pagedllm bench throughput``.

Runs with the vLLM peer's own Python (``.peers/vllm-venv/bin/python``), so it imports nothing from pagedllm:

    V/bin/python peer_vllm_offline.py --model HF_FOLDER --requests reqs.json --output-json out.json

``reqs.json``: ``{"requests": [{"prompt_token_ids": [...], "output_len": N}, ...], "ignore_eos": true}``.
Start-up (model load, torch.compile) is not timed; one short warm-up generate runs before the timed ones
(``--num-iters``, default 1, each after ``LLM.reset_prefix_cache()``; all their times go to ``elapsed_times``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--requests", required=True)
    p.add_argument("--output-json", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-iters", type=int, default=1)
    p.add_argument("--runs-from-stdin", action="store_true",
                   help="print READY, then time one run per `run` line on stdin (pagedllm bench throughput's protocol)")
    args = p.parse_args()
    with open(args.requests) as f:
        spec = json.load(f)
    reqs = spec["requests"]
    ignore_eos = bool(spec.get("ignore_eos", True))

    import vllm
    from vllm import LLM, SamplingParams

    kw = {}
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    t_load = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0, **kw)
    load_s = time.perf_counter() - t_load
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=ignore_eos) for r in reqs]
    llm.generate(prompts[:1], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)], use_tqdm=False)
    times, outs = [], []

    def run_once() -> None:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs[:] = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)

    if args.runs_from_stdin:  # the protocol of pagedllm/benchmarks/throughput.py (PROTOCOL_*)
        print("PAGEDLLM-BENCH READY", flush=True)
        for line in sys.stdin:
            if line.strip() == "run":
                run_once()
                print(f"PAGEDLLM-BENCH DONE {times[-1]:.6f}", flush=True)
    else:
        for _ in range(max(1, args.num_iters)):
            run_once()
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    res = {"backend": "vllm", "vllm_version": vllm.__version__, "elapsed_times": times, "load_time": load_s,
           "num_requests": len(outs), "total_input_tokens": n_in, "total_output_tokens": n_out}
    with open(args.output_json, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":  # vLLM spawns worker processes: the guard is required
    main()
