"""Benchmark tools: `pagedllm bench throughput|latency|serve|compare` and the peer helpers they use."""


def command_line() -> str:
    """This process's command as a user would type it (``pagedllm bench ...``)."""
    import os
    import shlex
    import sys

    prog = os.path.basename(sys.argv[0]) if sys.argv else ""
    if prog in ("cli.py", "pagedllm", "__main__.py"):
        prog = "pagedllm"
    return " ".join([prog] + [shlex.quote(a) for a in sys.argv[1:]])
