"""Shared fixtures. ``pagedllm_server``: a real ``pagedllm serve`` subprocess (bundled SmolLM2) on a free loopback
port, started once per session and stopped with SIGTERM at the end (which must exit 0)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest


def pytest_addoption(parser):
    parser.addoption("--update-screenshots", action="store_true",
                     help="tests/test_web_browser.py writes the README's screenshots (docs/*.png); default: a temp dir")

SERVER_MAX_MODEL_LEN = 2048
SERVER_KV_BYTES = str(128 << 20)  # ~5.8k tokens of SmolLM2 KV: room for 32 short concurrent streams
SERVER_START_TIMEOUT_S = 300.0
# float32, not the bf16 "auto" picks on this CPU: in bf16 near-tied logits flip with the batch shape, so greedy
# output at batch 32 differs from batch 1 for ~5 of 32 prompts (an engine-numerics matter, not the server's);
# the concurrency test compares each stream with its solo output.
SERVER_DTYPE = "float32"


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    port: int
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_path: str, *extra: str) -> ServerHandle:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(SERVER_MAX_MODEL_LEN), "--kv-cache-memory-bytes", SERVER_KV_BYTES,
           "--dtype", SERVER_DTYPE,
           "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", *extra]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    log.close()
    handle = ServerHandle(proc, port, log_path)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"pagedllm serve exited with {proc.returncode}:\n{handle.log_tail()}")
        try:
            if httpx.get(handle.url + "/health", timeout=2).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(handle)
            raise RuntimeError(f"pagedllm serve not healthy after {SERVER_START_TIMEOUT_S} s:\n{handle.log_tail()}")
        time.sleep(0.5)


def stop_server(handle: ServerHandle, timeout: float = 30.0) -> int:
    """SIGTERM, then SIGKILL if it doesn't exit in ``timeout`` s. Returns the exit code."""
    proc = handle.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


@pytest.fixture(scope="session")
def pagedllm_server(tmp_path_factory):
    # The shared server keeps the flag-gated features on that its tests use (/reset_prefix_cache, cached_tokens).
    handle = start_server(str(tmp_path_factory.mktemp("server") / "serve.log"), "--server-dev-mode",
                          "--enable-prompt-tokens-details")
    yield handle
    rc = stop_server(handle)
    assert rc == 0, f"pagedllm serve exited with {rc} on SIGTERM:\n{handle.log_tail()}"


def require_native(lib) -> None:
    """A kernel test's guard: at ISA level ``none`` (pure torch) the C library is absent by design: skip; at any other
    level its absence is a failed build: fail."""
    import pytest

    from pagedllm import kernels

    if lib is None:
        if not kernels.config().native:
            pytest.skip(f"no C kernels at ISA level {kernels.config().level!r}")
        pytest.fail("the CPU kernels failed to build (is gcc installed?)")


@pytest.fixture(autouse=True)
def _restore_kernel_config():
    """An engine started in a test makes its KernelConfig the process's (``kernels.set_config``); the next test
    starts from the configuration before it."""
    from pagedllm import kernels

    prev = kernels.config()
    yield
    kernels.set_config(prev)
