"""``pagedllm bench throughput``: offline throughput on a workload, for ours or a peer.

``--backend pagedllm`` (default) runs ``LLM.generate`` on all requests at once (greedy; per-request ``max_tokens``;
``ignore_eos`` by default). ``--backend hf`` runs Hugging Face Transformers ``generate`` on padded static batches of
``--hf-batch-size`` requests in workload order (left padding; each batch generates its longest request's output length,
and only each request's own output length counts as output). ``--backend vllm`` runs ``vllm.LLM.generate`` in the vLLM
peer's venv (``make bench-peers``). Model loading and a short warm-up are not timed.

``--num-iters N`` times the whole workload N times in the same process (after the one warm-up; ours and vLLM clear
their prefix caches before each run, so no run reuses another's prompts) and reports the median run: the figures
below come from ``elapsed_time`` = the median of ``elapsed_times`` (seconds). On a shared machine one run can land in
a slow minute; the median of a few is steadier, and every run is kept in the JSON.

Prints requests/s, total tokens/s and output tokens/s, like ``vllm bench throughput``; ``--output-json FILE`` saves
them, ``--json`` prints them as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import statistics
import tempfile
import time
from typing import Optional

from pagedllm.benchmarks import command_line
from pagedllm.benchmarks.datasets import BenchRequest, add_dataset_args, load_tokenizer, requests_from_args, summarize

RESULT_KEYS = ("backend", "dataset_name", "num_requests", "elapsed_time", "requests_per_second", "tokens_per_second",
               "output_tokens_per_second", "total_input_tokens", "total_output_tokens", "total_num_tokens",
               "num_iters", "elapsed_times")


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.cli import add_engine_args

    p.add_argument("--backend", default="pagedllm", choices=["pagedllm", "hf", "vllm"])
    p.add_argument("--model", default=None,
                   help="GGUF file or HF folder (default: bundled SmolLM2; hf/vllm default to the exported HF folder).")
    p.add_argument("--hf-batch-size", type=int, default=32, help="hf: requests per padded static batch.")
    p.add_argument("--hf-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--vllm-timeout", type=float, default=1800.0, help="vllm: seconds before the run is stopped.")
    p.add_argument("--output-json", default=None, help="Save the results to this JSON file.")
    p.add_argument("--json", action="store_true", help="Print the results as one JSON object.")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--num-iters", type=int, default=1,
                   help="Timed runs of the whole workload; the median run is reported (default 1).")
    p.add_argument("--runs-from-stdin", action="store_true",
                   help="For `bench compare`'s interleaved runs: after the warm-up print a READY line, then time one "
                        "run per `run` line read from stdin (printing a DONE line with its seconds) until end of "
                        "input; --num-iters is ignored.")
    add_engine_args(p)
    add_dataset_args(p, engine_flags=True)


def _finish(res: dict, reqs: list[BenchRequest]) -> dict:
    res["num_iters"] = len(res["elapsed_times"])
    el = res["elapsed_time"] = statistics.median(res["elapsed_times"])
    res.setdefault("total_input_tokens", sum(r.prompt_len for r in reqs))
    res["total_num_tokens"] = res["total_input_tokens"] + res["total_output_tokens"]
    res["requests_per_second"] = res["num_requests"] / el
    res["tokens_per_second"] = res["total_num_tokens"] / el
    res["output_tokens_per_second"] = res["total_output_tokens"] / el
    res["workload"] = summarize(reqs)
    return res


def run_pagedllm(ns: argparse.Namespace, reqs: list[BenchRequest]) -> dict:
    from pagedllm.entrypoints.cli import engine_args_from_namespace
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    args = engine_args_from_namespace(ns)
    kwargs = {k: v for k, v in vars(args).items() if k != "model"}
    t = time.perf_counter()
    llm = LLM(ns.model, **kwargs)
    load_s = time.perf_counter() - t
    if ns.warmup:
        llm.generate([{"prompt_token_ids": reqs[0].prompt_token_ids[:16]}],
                     SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=ns.ignore_eos) for r in reqs]
    outs = []

    def run_once() -> float:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs[:] = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    times = timed_runs(ns, run_once)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"backend": "pagedllm", "elapsed_times": times, "load_time": load_s, "num_requests": len(outs),
            "total_output_tokens": n_out, "engine_args": {k: v for k, v in vars(args).items()}}


# Lines of the --runs-from-stdin protocol (a prefix no engine log line starts with).
PROTOCOL_READY = "PAGEDLLM-BENCH READY"
PROTOCOL_DONE = "PAGEDLLM-BENCH DONE"


def timed_runs(ns: argparse.Namespace, run_once) -> list[float]:
    """Seconds of each timed run of ``run_once()``: ``--num-iters`` in a row, or one per ``run`` line on stdin
    (``--runs-from-stdin``, see PROTOCOL_*)."""
    times = []
    if not ns.runs_from_stdin:
        for _ in range(_num_iters(ns)):
            times.append(run_once())
        return times
    print(PROTOCOL_READY, flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            continue
        times.append(run_once())
        print(f"{PROTOCOL_DONE} {times[-1]:.6f}", flush=True)
    if not times:
        raise RuntimeError("--runs-from-stdin: stdin closed before any `run` line")
    return times


def _num_iters(ns: argparse.Namespace) -> int:
    if ns.num_iters < 1:
        raise ValueError(f"--num-iters must be at least 1, got {ns.num_iters}")
    return ns.num_iters


def _hf_source(model: Optional[str]):
    from pagedllm.benchmarks.peers import hf_export_dir

    if model is None:
        model = hf_export_dir()
        if model is None:
            from pagedllm.model_files import default_model_path

            model = default_model_path()
    return model


def run_hf(ns: argparse.Namespace, reqs: list[BenchRequest]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _hf_source(ns.model)
    dtype = getattr(torch, ns.hf_dtype)
    t = time.perf_counter()
    if os.path.isfile(src):
        folder, name = os.path.dirname(src), os.path.basename(src)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    else:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(src)
    model.eval()
    load_s = time.perf_counter() - t
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    def run_batch(batch: list[BenchRequest], ignore_eos: bool) -> int:
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding
            ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.prompt_len:] = 1
        new = max(r.output_len for r in batch)
        kw = {"min_new_tokens": new} if ignore_eos else {}
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                 pad_token_id=pad_id, **kw)
        gen = out[:, width:]
        useful = 0
        for i, r in enumerate(batch):
            row = gen[i].tolist()
            n = len(row)
            if not ignore_eos and tok.eos_token_id in row:
                n = row.index(tok.eos_token_id) + 1
            useful += min(n, r.output_len)
        return useful

    if ns.warmup:
        run_batch([BenchRequest(prompt="", prompt_token_ids=reqs[0].prompt_token_ids[:16], output_len=4)], True)
    bs = max(1, ns.hf_batch_size)
    n_out = 0

    def run_once() -> float:
        nonlocal n_out
        t0 = time.perf_counter()
        n_out = sum(run_batch(reqs[i:i + bs], ns.ignore_eos) for i in range(0, len(reqs), bs))
        return time.perf_counter() - t0

    times = timed_runs(ns, run_once)
    return {"backend": "hf", "elapsed_times": times, "load_time": load_s, "num_requests": len(reqs),
            "total_output_tokens": n_out, "hf_model": src, "hf_batch_size": bs, "hf_dtype": ns.hf_dtype,
            "torch_threads": torch.get_num_threads()}


def run_vllm(ns: argparse.Namespace, reqs: list[BenchRequest]) -> dict:
    from pagedllm.benchmarks.peers import hf_export_dir, vllm_env, vllm_python

    py = vllm_python()
    folder = ns.model or hf_export_dir()
    if py is None or folder is None:
        raise RuntimeError("the vLLM peer is not installed: run `make bench-peers` (see benchmarks/README.md)")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_vllm_offline.py")
    with tempfile.TemporaryDirectory(prefix="pagedllm-vllm-") as d:
        spec = os.path.join(d, "requests.json")
        out = os.path.join(d, "out.json")
        with open(spec, "w") as f:
            json.dump({"ignore_eos": ns.ignore_eos,
                       "requests": [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}
                                    for r in reqs]}, f)
        cmd = [py, script, "--model", folder, "--requests", spec, "--output-json", out,
               "--max-model-len", str(ns.max_model_len or 2048), "--num-iters", str(_num_iters(ns))]
        if ns.runs_from_stdin:  # the peer reads our stdin and prints the protocol lines on our stdout
            r = subprocess.run(cmd + ["--runs-from-stdin"], env=vllm_env(), cwd=d, stdin=sys.stdin,
                               stdout=sys.stdout, stderr=subprocess.PIPE, text=True, timeout=ns.vllm_timeout)
            r.stdout = ""
        else:
            r = subprocess.run(cmd, env=vllm_env(), cwd=d, capture_output=True, text=True, timeout=ns.vllm_timeout)
        if r.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"vLLM run failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
        with open(out) as f:
            res = json.load(f)
    res["backend"] = "vllm"
    res["vllm_command"] = " ".join(cmd[:2] + ["--model", folder])
    return res


def run_throughput(ns: argparse.Namespace) -> dict:
    num = ns.num_prompts or 64
    # Every backend's prompts from its model's tokenizer (or --tokenizer): vLLM and HF were given the bundled
    # SmolLM2's before, so with another model they ran other prompts than ours (Qwen2.5-1.5B's offline `mixed`: 12,342
    # input / 4,376 output tokens against our 11,309 / 4,689).
    tok = load_tokenizer(ns.tokenizer, ns.model)
    reqs = requests_from_args(ns, tok, num, max_model_len=ns.max_model_len or 2048)
    runner = {"pagedllm": run_pagedllm, "hf": run_hf, "vllm": run_vllm}[ns.backend]
    res = runner(ns, reqs)
    res["dataset_name"] = ns.dataset_name
    res["ignore_eos"] = ns.ignore_eos
    res["command"] = command_line()
    return _finish(res, reqs)


def format_result(res: dict) -> str:
    return (f"Throughput: {res['requests_per_second']:.2f} requests/s, {res['tokens_per_second']:.2f} total tokens/s, "
            f"{res['output_tokens_per_second']:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {res['total_input_tokens']}\n"
            f"Total num output tokens:  {res['total_output_tokens']}\n"
            f"Elapsed: {res['elapsed_time']:.2f} s ({res['backend']}, {res['dataset_name']}, "
            f"{res['num_requests']} requests)"
            + (f"; median of {res['num_iters']} runs: " + ", ".join(f"{t:.2f}" for t in res["elapsed_times"]) + " s"
               if res["num_iters"] > 1 else ""))


def cmd_throughput(ns: argparse.Namespace) -> int:
    res = run_throughput(ns)
    if ns.json:
        print(json.dumps(res))
    else:
        print(format_result(res))
    if ns.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(ns.output_json)), exist_ok=True)
        with open(ns.output_json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
