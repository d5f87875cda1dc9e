"""``pagedllm bench {throughput,latency,serve,floor,compare,speculative}`` (registered by ``pagedllm.entrypoints.cli``)."""

from __future__ import annotations

import argparse


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults and keeps the module docstrings' layout."""


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="Benchmarks: offline throughput, latency, serving, peer comparison.")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    fmt = _Formatter

    from pagedllm.benchmarks import compare, floor, latency, serve, spec_ab, throughput

    p = sub.add_parser("throughput", help="Offline throughput through LLM.generate (or a peer: hf, vllm).",
                       description=throughput.__doc__, formatter_class=fmt)
    throughput.add_throughput_args(p)
    p.set_defaults(func=throughput.cmd_throughput)

    p = sub.add_parser("latency", help="Latency of one request (or one batch): TTFT, ITL, prefill/decode tok/s.",
                       description=latency.__doc__, formatter_class=fmt)
    latency.add_latency_args(p)
    p.set_defaults(func=latency.cmd_latency)

    p = sub.add_parser("serve", help="Streaming load client for any OpenAI-compatible server.",
                       description=serve.__doc__, formatter_class=fmt)
    serve.add_serve_bench_args(p)
    p.set_defaults(func=serve.cmd_serve)

    p = sub.add_parser("floor", help="Bare-matmul floor of one decode step at given batch sizes.",
                       description=floor.__doc__, formatter_class=fmt)
    floor.add_floor_args(p)
    p.set_defaults(func=floor.cmd_floor)

    p = sub.add_parser("compare", help="Ours vs every installed peer on the same workloads; writes RESULTS.md.",
                       description=compare.__doc__, formatter_class=fmt)
    compare.add_compare_args(p)
    p.set_defaults(func=compare.cmd_compare)

    p = sub.add_parser("speculative", help="The same requests with and without --speculative-config, interleaved.",
                       description=spec_ab.__doc__, formatter_class=fmt)
    spec_ab.add_spec_ab_args(p)
    p.set_defaults(func=spec_ab.cmd_spec_ab)
    return bench
