"""The ``pagedllm`` command: ``generate`` (offline), ``serve`` (OpenAI-compatible server), ``bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from pagedllm.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineArgs


def _int_bytes(s: str) -> int:
    """Parses byte sizes like ``2147483648``, ``2G``, ``512M``, ``2GiB``."""
    t = s.strip().upper().replace("IB", "").replace("B", "")
    mult = 1
    for suf, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suf):
            mult, t = m, t[:-1]
            break
    try:
        return int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {s!r}")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, with vLLM's names."""
    g = p.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, help="Tokenizer path (default: the model's own).")
    g.add_argument("--served-model-name", default=None,
                   help="Model name reported by the API and accepted in requests (default: the model path).")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="Weight and activation dtype. auto = bfloat16 on CPUs with AVX-512-BF16/AMX, else float32.")
    g.add_argument("--cpu-isa", default=None, choices=["auto", "amx", "avx512_bf16", "avx2", "none"],
                   help="Force a lower ISA level for the CPU kernels (default auto: the best this CPU has; a level "
                        "above it is an error). Same as $PAGEDLLM_CPU_ISA; see README 'CPU kernels and ISA levels'.")
    g.add_argument("--quantization", "-q", default=None,
                   choices=["auto", "none", "gguf", "gptq", "awq", "int8"],
                   help="Weight quantization. Default auto: as the checkpoint is stored (a GGUF runs quantized; "
                        "GPTQ/AWQ from config.json). none: dense in --dtype (a GGUF is dequantized).")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="Longest sequence (prompt + output) in tokens (default: the model's context length).")
    g.add_argument("--max-num-seqs", type=int, default=256, help="Most requests in one step's batch.")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="Token budget of one step (prefill chunks + decodes; default 2048).")
    g.add_argument("--block-size", type=int, default=16, help="Tokens per KV cache block.")
    g.add_argument("--kv-cache-memory-bytes", type=_int_bytes, default=None,
                   help=f"KV cache size in bytes, e.g. 2G (default {DEFAULT_KV_CACHE_MEMORY_BYTES >> 30} GiB).")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="Exact number of KV blocks (overrides --kv-cache-memory-bytes).")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="Reuse KV blocks of shared prompt prefixes (on by default).")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="Split long prompts across steps to keep decodes flowing (on by default).")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="Most prompt tokens one request computes in a step (default 0: up to the token budget). A "
                        "long prompt then shares each step with the prompts queued behind it.")
    g.add_argument("--max-logprobs", type=int, default=20, help="Largest logprobs / top_logprobs a request may ask.")
    g.add_argument("--seed", type=int, default=0, help="Random seed of the engine.")
    g.add_argument("--chat-template", default=None, help="Chat template: a Jinja file path or the template itself.")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="Tensor-parallel ranks.")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="Pipeline-parallel stages.")
    g.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "external_launcher"],
                   help="mp: start one worker process per rank here; external_launcher: this process is one rank "
                        "of a torchrun (or --nnodes/--node-rank) launch.")
    g.add_argument("--distributed-init-method", default=None,
                   help="torch.distributed init URL, e.g. tcp://HOST:PORT (default: a free local port, or env:// "
                        "under torchrun).")
    g.add_argument("--nnodes", type=int, default=1, help="Machines in an external_launcher launch.")
    g.add_argument("--node-rank", type=int, default=0, help="This machine's rank in an external_launcher launch.")
    g.add_argument("--speculative-config", default=None,
                   help='Speculative decoding, vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (also "disable_by_batch_size", and '
                        '"adaptive": false for a fixed draft length).')
    g.add_argument("--structured-outputs-config", default=None,
                   help="Structured outputs, as JSON (vLLM's keys), e.g. '{\"backend\": \"xgrammar\"}'. JSON "
                        "grammars are compact by default here (\"disable_any_whitespace\": true; false for vLLM's "
                        "any-whitespace form).")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="Split <think>...</think> into message.reasoning_content; structured outputs apply after it.")
    g.add_argument("--max-in-flight-batches", type=int, default=1,
                   help="Pipeline parallel: micro-batches in flight at once, so stages overlap (e.g. "
                        "--pipeline-parallel-size). 1: one step at a time, the CPU default (a decode step of half "
                        "the batch costs about as much as the whole one here).")
    add_limit_args(p)


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """The request bounds (``InputLimits``; the README's "Request bounds" table), with vLLM's names where vLLM has
    the bound."""
    from pagedllm.config import InputLimits as L

    g = p.add_argument_group("request bounds (each failure is a 400 naming the field; see the README)")
    g.add_argument("--max-n", type=int, default=L.max_n, help=f"Most choices (n) per request (default {L.max_n}).")
    g.add_argument("--max-num-stop-strings", type=int, default=L.max_num_stop_strings,
                   help=f"Most stop strings per request (default {L.max_num_stop_strings}).")
    g.add_argument("--max-stop-string-len", type=int, default=L.max_stop_string_len,
                   help=f"Longest stop string, characters (default {L.max_stop_string_len}).")
    g.add_argument("--max-num-stop-token-ids", type=int, default=L.max_num_stop_token_ids,
                   help=f"Most stop_token_ids per request (default {L.max_num_stop_token_ids}).")
    g.add_argument("--max-num-logit-bias", type=int, default=L.max_num_logit_bias,
                   help=f"Most logit_bias entries per request (default {L.max_num_logit_bias}).")
    g.add_argument("--max-num-allowed-token-ids", type=int, default=L.max_num_allowed_token_ids,
                   help=f"Most allowed_token_ids per request (default {L.max_num_allowed_token_ids}).")
    g.add_argument("--max-cache-salt-len", type=int, default=L.max_cache_salt_len,
                   help=f"Longest cache_salt, characters (default {L.max_cache_salt_len}).")
    g.add_argument("--max-num-prompts", type=int, default=L.max_num_prompts,
                   help=f"Most prompts in one completions request (default {L.max_num_prompts}, vLLM's cap).")
    g.add_argument("--max-request-body-bytes", type=_int_bytes, default=L.max_request_body_bytes,
                   help=f"Largest HTTP request body; 413 past it (default {L.max_request_body_bytes >> 20} MiB).")
    g.add_argument("--max-chat-template-chars", type=int, default=L.max_chat_template_chars,
                   help=f"Longest rendered chat prompt, characters (default {L.max_chat_template_chars}).")
    g.add_argument("--max-num-queued-reqs", type=int, default=L.max_num_queued_reqs,
                   help=f"Admission queue: most requests admitted but not yet producing output; 429 past it "
                        f"(default {L.max_num_queued_reqs}; 0: unbounded).")
    g.add_argument("--max-num-queued-tokens", type=int, default=L.max_num_queued_tokens,
                   help=f"Admission queue: most prompt tokens waiting; 429 past it (default "
                        f"{L.max_num_queued_tokens}; 0: unbounded).")


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    names = EngineArgs.field_names()
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})


def _cmd_generate(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    prompts = ns.prompt or []
    if not prompts:
        print("error: give at least one --prompt", file=sys.stderr)
        return 2
    try:
        sp = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.sampling_seed, stop=ns.stop or None, n=ns.n,
                            ignore_eos=ns.ignore_eos)
        llm = LLM(**vars(engine_args_from_namespace(ns)))
        if ns.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp, use_tqdm=False)
        else:
            outs = llm.generate(prompts, sp, use_tqdm=False)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p, o in zip(prompts, outs):
        if ns.json:
            print(json.dumps({"prompt": p, "outputs": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason} for c in o.outputs]}))
        else:
            for c in o.outputs:
                print(f"--- prompt: {p!r}\n{c.text}\n[finish_reason={c.finish_reason}, tokens={len(c.token_ids)}]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: paged-KV LLM inference and serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="Generate text offline and print it.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("model", nargs="?", default=None,
                   help="GGUF file or Hugging Face folder (default: bundled SmolLM2-135M-Instruct).")
    g.add_argument("--prompt", action="append", help="A prompt (repeat for a batch).")
    g.add_argument("--chat", action="store_true", help="Wrap each prompt as a user turn in the chat template.")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", help="Stop string (repeatable).")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed.")
    g.add_argument("--json", action="store_true", help="Print one JSON object per prompt.")
    add_engine_args(g)
    g.set_defaults(func=_cmd_generate)

    from pagedllm.entrypoints.openai.api_server import add_serve_parser

    add_serve_parser(sub)
    try:
        from pagedllm.benchmarks.cli import add_bench_parser
    except ImportError:
        add_bench_parser = None
    if add_bench_parser is not None:
        add_bench_parser(sub)
    return parser


# OpenMP threads (torch's libgomp, shared by our C kernels) wait at the end of every parallel region. libgomp's
# default spins 300,000 `pause`s (~6 ms here) before sleeping. A thread that loses its core while it spins holds
# every region up until the scheduler's next tick (one other busy process on these 2 cores: a 32x576x3072 bf16
# linear 7.7 ms instead of 0.35 ms), and a server shares its cores with its event loop and clients; a spin shorter
# than the gaps between regions inside a step makes every region wake a sleeping worker instead. `serve` spins
# 30,000 (~0.6 ms), longer than those gaps, bounded when the engine idles. Measured with the engine built in its
# stepping thread (engine/async_llm.py), interleaved runs: 16 concurrent chat streams (bf16) 340 / 293 output tok/s
# vs 327 / 312 with the default spin and 285 / 289 with 3,000; int4 single stream TPOT 14.4 / 14.0 ms vs 17.5 / 12.8
# (default) and 16.6 / 18.2 (3,000). Offline runs keep libgomp's default.
# libgomp reads it once, when torch is imported: set here, before that; your own GOMP_SPINCOUNT or
# OMP_WAIT_POLICY wins.
SERVE_GOMP_SPINCOUNT = "30000"


def set_openmp_spin(command: str) -> None:
    """Sets ``GOMP_SPINCOUNT`` for ``serve`` (see above) unless the user chose a spin or wait policy."""
    if command == "serve" and "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules:
        os.environ.setdefault("GOMP_SPINCOUNT", SERVE_GOMP_SPINCOUNT)


def set_cpu_isa(cpu_isa: Optional[str]) -> None:
    """With ``--cpu-isa`` below the CPU's level, caps torch's oneDNN/ATen at it too (they read their variables when
    first used, so this runs before torch does any work); the user's own settings win."""
    if cpu_isa and cpu_isa != "auto":
        from pagedllm.kernels.config import level_environ

        for k, v in level_environ(cpu_isa).items():
            if k != "PAGEDLLM_CPU_ISA":
                os.environ.setdefault(k, v)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    set_openmp_spin(ns.command)
    set_cpu_isa(getattr(ns, "cpu_isa", None))
    return ns.func(ns) or 0


if __name__ == "__main__":
    sys.exit(main())
