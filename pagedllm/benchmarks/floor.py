"""``pagedllm bench floor``: the bare-matmul floor of one decode step — just the weight matmuls of the model, nothing
else — to compare the engine's decode step time with (issue 5: within 1.3x at batch 32).

The model's shapes come from its GGUF header (or HF ``config.json``); the weights are random, in ``--dtype``, one set
per layer (so the step reads every weight once, as a real step does): per layer fused QKV, O, fused gate/up and down
projections through ``torch.nn.functional.linear``, then the LM head on the last hidden state of each sequence.

    pagedllm bench floor --batch-size 1 32 [--dtype bfloat16] [--json]

It also measures the machine's real limits (``measure_limits``): the GEMM peak (the best of large bf16 matmuls, the
issue-17 shapes 2048^3 and 2048 x 576 x 1536) and the memory read bandwidth (the best read of a 512 MB buffer:
torch's sum, or our C streaming read with prefetch, as the decode kernels read their weights), and gives
each batch's roofline floor from them: ``max(weight bytes / bandwidth, 2 * parameters * batch / peak)``. Our own
matmul calls are not the limit (at decode sizes they read the weights well under the bandwidth), so the roofline is
the figure to compare an engine step with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Optional


def model_shapes(model: Optional[str] = None) -> dict:
    """hidden, intermediate, heads, kv_heads, head_dim, layers, vocab of ``model`` (default: the bundled GGUF)."""
    if model is None:
        from pagedllm.model_files import default_model_path

        model = default_model_path()
    if os.path.isdir(model):
        with open(os.path.join(model, "config.json")) as f:
            c = json.load(f)
        heads = c["num_attention_heads"]
        return {"hidden": c["hidden_size"], "intermediate": c["intermediate_size"], "heads": heads,
                "kv_heads": c.get("num_key_value_heads", heads),
                "head_dim": c.get("head_dim") or c["hidden_size"] // heads, "layers": c["num_hidden_layers"],
                "vocab": c["vocab_size"], "source": model}
    from pagedllm.model_files import read_gguf_metadata

    arch = read_gguf_metadata(model, ["general.architecture"])["general.architecture"]
    keys = [f"{arch}.{k}" for k in ("embedding_length", "feed_forward_length", "attention.head_count",
                                    "attention.head_count_kv", "block_count", "attention.key_length", "vocab_size")]
    md = read_gguf_metadata(model, keys + ["tokenizer.ggml.tokens"])
    g = lambda k, d=None: md.get(f"{arch}.{k}", d)  # noqa: E731
    heads = g("attention.head_count")
    vocab = g("vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
    return {"hidden": g("embedding_length"), "intermediate": g("feed_forward_length"), "heads": heads,
            "kv_heads": g("attention.head_count_kv", heads),
            "head_dim": g("attention.key_length") or g("embedding_length") // heads, "layers": g("block_count"),
            "vocab": vocab, "source": model}


def gguf_bytes_per_token(path: str) -> dict:
    """Bytes of a GGUF's tensors that one decode token reads as stored (issue 20's memory floor): every tensor but
    the token embedding, of which a step reads one row per token, unless the LM head is tied to it (no
    ``output.weight``), when the LM head reads it whole. Returns ``{"weight_bytes_per_token", "tensor_bytes",
    "embedding_bytes", "tied_lm_head"}`` (bytes)."""
    import gguf

    reader = gguf.GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total, emb = sum(sizes.values()), sizes.get("token_embd.weight", 0)
    tied = "output.weight" not in sizes
    return {"weight_bytes_per_token": total - (0 if tied else emb), "tensor_bytes": total, "embedding_bytes": emb,
            "tied_lm_head": tied}


def measure_floor(shapes: dict, batch_sizes: list[int], dtype: str = "bfloat16", reps: int = 10,
                  warmup: int = 3) -> list[dict]:
    import torch
    import torch.nn.functional as F

    dt = getattr(torch, dtype)
    h, i_, nh, nkv, hd, L, V = (shapes[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim",
                                                    "layers", "vocab"))
    gen = torch.Generator().manual_seed(0)

    def w(o, i):
        return (torch.randn(o, i, generator=gen) * 0.02).to(dt)

    layers = [(w((nh + 2 * nkv) * hd, h), w(h, nh * hd), w(2 * i_, h), w(h, i_)) for _ in range(L)]
    head = w(V, h)
    weight_bytes = sum(t.numel() * t.element_size() for ly in layers for t in ly) + head.numel() * head.element_size()
    # The floor is the fastest bare matmul of these weights: with oneDNN-packed bf16 weights when this CPU has them
    # (as the engine runs them, see pagedllm/layers/packed_linear.py), else plain F.linear.
    from pagedllm.layers.packed_linear import PackedLinear, packing_supported

    packed = packing_supported(dt, torch.device("cpu"))
    if packed:
        layers = [tuple(PackedLinear(t, None) for t in ly) for ly in layers]
        head = PackedLinear(head, None)
        mm = lambda x, lin: lin(x)  # noqa: E731
    else:
        mm = F.linear
    out = []
    with torch.inference_mode():
        for B in batch_sizes:
            x = torch.randn(B, h, generator=gen).to(dt)
            xa = torch.randn(B, nh * hd, generator=gen).to(dt)
            xi = torch.randn(B, i_, generator=gen).to(dt)

            def step():
                for wqkv, wo, wgu, wd in layers:
                    mm(x, wqkv)
                    mm(xa, wo)
                    mm(x, wgu)
                    mm(xi, wd)
                mm(x, head)

            for _ in range(warmup):
                step()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            out.append({"batch_size": B, "dtype": dtype, "step_ms_median": med * 1e3, "step_ms_min": min(times) * 1e3,
                        "tokens_per_second": B / med, "weight_bytes": weight_bytes,
                        "effective_gb_per_s": weight_bytes / med / 1e9,
                        "torch_threads": torch.get_num_threads(),
                        "matmul": "onednn-packed" if packed else "F.linear"})
    return out


def measure_limits(dtype: str = "bfloat16", buffer_bytes: int = 512 << 20, gemm_sizes=None, reps: int = 5) -> dict:
    """The machine's limits with the current torch threads: ``gemm_peak_gflops`` (best over ``gemm_sizes``, M x K x N
    matmuls in ``dtype``, and in float32 too: a bf16 matmul can run at the float32 FMA rate with the same bits, as
    the dpbf16 kernel's FMA path does where VDPBF16PS is the slower one; ``gemm_peak_dtype`` says which won) and
    ``mem_read_gb_per_s`` (the best read of a ``buffer_bytes`` buffer, once per pass: torch's sum, or our C streaming
    read at a few prefetch distances (``stream_read_rates``), each in ``mem_read_gb_per_s_by_probe``; the better of
    ordinary 4 KiB pages and huge pages where the OS grants them, each in ``mem_read_gb_per_s_by_pages``)."""
    import torch

    gemm_sizes = gemm_sizes or [(2048, 2048, 2048), (2048, 576, 1536)]
    best_flops, best_dtype = 0.0, dtype
    with torch.inference_mode():
        # A 512^3 probe per dtype first: where the CPU has no bf16 instructions, oneDNN's bf16 GEMM runs at ~1
        # GFLOP/s (an AVX2 EPYC Zen 3: one 2048^3 call took 13 s), so a dtype far below the best probe is not timed
        # at the large sizes: it cannot be the peak.
        probe = {}
        for name in dict.fromkeys((dtype, "float32")):
            a, b = torch.randn(512, 512).to(getattr(torch, name)), torch.randn(512, 512).to(getattr(torch, name))
            torch.mm(a, b)
            t0 = time.perf_counter()
            torch.mm(a, b)
            probe[name] = 2 * 512 ** 3 / (time.perf_counter() - t0)
        for name in [n for n, f in probe.items() if f >= max(probe.values()) / 4]:
            dt = getattr(torch, name)
            for m, k, n in gemm_sizes:
                a, b = torch.randn(m, k).to(dt), torch.randn(k, n).to(dt)
                torch.mm(a, b)
                for _ in range(reps):
                    t0 = time.perf_counter()
                    torch.mm(a, b)
                    flops = 2 * m * k * n / (time.perf_counter() - t0)
                    if flops > best_flops:
                        best_flops, best_dtype = flops, name
        from pagedllm.utils.hugepages import advised_mapping

        bws, by_probe = {}, {}
        for pages in ("small", "huge"):
            if pages == "small":
                buf = torch.ones(buffer_bytes // 4, dtype=torch.float32)
            else:  # our K-quant weights live in huge pages (utils/hugepages.py): the machine reads those faster
                raw = advised_mapping(buffer_bytes)
                if raw is None:
                    continue
                buf = raw[: buffer_bytes // 4 * 4].view(torch.float32)
                buf.fill_(1.0)
            buf.sum()
            sum_bw = 0.0
            for _ in range(reps):
                t0 = time.perf_counter()
                buf.sum()
                sum_bw = max(sum_bw, buf.numel() * 4 / (time.perf_counter() - t0))
            rates = {"torch.sum": sum_bw}
            rates.update((f"stream_read {a} B ahead", bw) for a, bw in stream_read_rates(buf, reps).items())
            for k, v in rates.items():
                by_probe[k] = max(by_probe.get(k, 0.0), v)
            bws[pages] = max(rates.values())
            del buf
        best_bw = max(bws.values())
    return {"gemm_peak_gflops": best_flops / 1e9, "gemm_peak_dtype": best_dtype, "mem_read_gb_per_s": best_bw / 1e9,
            "mem_read_gb_per_s_by_pages": {k: v / 1e9 for k, v in bws.items()},
            "mem_read_gb_per_s_by_probe": {k: v / 1e9 for k, v in by_probe.items()},
            "gemm_probe_gflops": {n: f / 1e9 for n, f in probe.items()},
            "gemm_sizes": [list(s) for s in gemm_sizes], "buffer_bytes": buffer_bytes,
            "torch_threads": torch.get_num_threads()}


def stream_read_rates(buf, reps: int = 5, aheads=(0, 2048, 8192)) -> dict:
    """Bytes/s of the C streaming read (``stream_read`` in kernels/csrc/cpu_ops.c: every thread one contiguous share,
    prefetching ``ahead`` bytes ahead, as our decode kernels stream their weights) over the contiguous tensor ``buf``,
    best of ``reps``, for each of ``aheads``; {} where the C library doesn't load (level none). torch's sum is not
    always the machine's best read (an AMD EPYC Zen 5: 49 GB/s, while the K-quant GEMV streamed 59 GB/s)."""
    from pagedllm import kernels

    lib = kernels.lib("cpu")
    if lib is None:
        return {}
    n = buf.numel() * buf.element_size() // 64 * 64
    out = {}
    for ahead in aheads:
        lib.stream_read(buf.data_ptr(), n, ahead)
        best = 0.0
        for _ in range(reps):
            t0 = time.perf_counter()
            lib.stream_read(buf.data_ptr(), n, ahead)
            best = max(best, n / (time.perf_counter() - t0))
        out[ahead] = best
    return out


_PROBE_BUF = None


def host_read_gb_per_s(buffer_bytes: int = 256 << 20, reps: int = 3) -> float:
    """The host's memory read bandwidth right now, GB/s: the best of ``reps`` reads of a ``buffer_bytes`` buffer
    (kept for the process's next call) by the C streaming read 8 KB ahead (``stream_read_rates``), or torch's sum
    where the C library doesn't load. Tens of ms. ``compare`` takes it before and after every benchmark run: on a
    shared host it moves (an AMD EPYC Zen 5 VM: 25-83 GB/s within one hour), and memory-bound decode speeds move with
    it."""
    global _PROBE_BUF
    import torch

    if _PROBE_BUF is None or _PROBE_BUF.numel() * 8 != buffer_bytes:
        _PROBE_BUF = torch.ones(buffer_bytes // 8, dtype=torch.float64)
    rates = stream_read_rates(_PROBE_BUF, reps, aheads=(8192,))
    if rates:
        return rates[8192] / 1e9
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        _PROBE_BUF.sum()
        best = max(best, buffer_bytes / (time.perf_counter() - t0))
    return best / 1e9


def engine_step_vs_read(model: str, rounds: int = 8, input_len: int = 128, output_len: int = 64,
                        quantization: Optional[str] = "gguf", seed: int = 0) -> dict:
    """The engine's decode step over the memory floor, with the bandwidth measured in the same seconds.

    One request at a time (``input_len`` random prompt ids, ``output_len`` greedy tokens, EOS ignored) through
    ``LLMEngine.step``, ``rounds`` times; around each request the host's read bandwidth is probed
    (``host_read_gb_per_s``) and the request's median decode step is divided by its floor: the GGUF's bytes per
    token (``gguf_bytes_per_token``) over the better of the two probes. A floor from a probe taken minutes away
    means little on a shared host (AMD EPYC Zen 5: 40-97 GB/s within the hour), and a memory-bound step moves with
    it; so each request's ratio takes the bandwidth of its own seconds (the faster probe: the lower floor).

    Returns ``{"weight_bytes_per_token", "rounds": [{"step_ms", "read_gb_per_s": [before, after], "floor_ms",
    "ratio"}], "median_ratio", "median_step_ms", "median_read_gb_per_s"}`` (ms, GB/s). The first two decode steps
    of each request are left out (the step after prefill, and the first one reading the new blocks).

    Raises:
        ValueError: if ``model`` is not a GGUF file (the floor is the file's bytes as stored), or for
            ``output_len < 6`` / ``rounds < 1``.
    """
    import random

    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    if not str(model).endswith(".gguf"):
        raise ValueError("--engine-step needs --model GGUF (the floor is the file's bytes per token as stored)")
    if output_len < 6 or rounds < 1:
        raise ValueError("engine_step_vs_read needs output_len >= 6 and rounds >= 1")
    weight = gguf_bytes_per_token(model)["weight_bytes_per_token"]
    llm = LLM(model=model, quantization=quantization, enable_prefix_caching=False, max_model_len=2048)
    eng = llm.llm_engine
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    vocab = eng.config.model.vocab_size
    rng = random.Random(seed)
    rows = []
    for r in range(rounds):
        sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        sp.output_kind = RequestOutputKind.DELTA
        before = host_read_gb_per_s()
        eng.add_request(f"floor-{r}", {"prompt_token_ids": [rng.randrange(vocab // 8, vocab // 2)
                                                            for _ in range(input_len)]}, sp)
        steps = []
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t0)
        after = host_read_gb_per_s()
        step_ms = 1e3 * statistics.median(steps[3:])  # steps[0]: prefill; [1], [2]: see the docstring
        floor_ms = 1e3 * weight / (max(before, after) * 1e9)
        rows.append({"step_ms": step_ms, "read_gb_per_s": [before, after], "floor_ms": floor_ms,
                     "ratio": step_ms / floor_ms})
    return {"weight_bytes_per_token": weight, "rounds": rows,
            "median_ratio": statistics.median(x["ratio"] for x in rows),
            "median_step_ms": statistics.median(x["step_ms"] for x in rows),
            "median_read_gb_per_s": statistics.median(max(x["read_gb_per_s"]) for x in rows)}


def num_matmul_params(shapes: dict) -> int:
    """Weights one token multiplies: every layer's QKV, O, gate/up and down projections, plus the LM head."""
    h, i_, nh, nkv, hd, L, V = (shapes[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim",
                                                    "layers", "vocab"))
    return L * ((nh + 2 * nkv) * hd * h + h * nh * hd + 2 * i_ * h + h * i_) + V * h


def offline_floor_s(workload: dict, shapes: dict, limits: dict, weight_bytes: float) -> float:
    """A lower bound on an offline run's time, seconds: its prompt tokens' matmul FLOPs at the GEMM peak, plus its
    decode at best one step per output position of the longest request (every request batched in each step), each
    step reading the weights once at the measured bandwidth, or its output tokens' FLOPs at the peak if longer.
    ``workload``: ``datasets.summarize`` (total_input_tokens, total_output_tokens, output_len_max). Attention and
    the KV reads are left out (a floor, not an estimate)."""
    params = num_matmul_params(shapes)
    peak, bw = limits["gemm_peak_gflops"] * 1e9, limits["mem_read_gb_per_s"] * 1e9
    prefill = 2 * params * workload["total_input_tokens"] / peak
    decode = max(workload["output_len_max"] * weight_bytes / bw, 2 * params * workload["total_output_tokens"] / peak)
    return prefill + decode


def roofline(rows: list[dict], shapes: dict, limits: dict) -> None:
    """Adds each row's ``roofline_ms`` (weight bytes at the measured bandwidth, or the matmul FLOPs at the measured
    peak, whichever is longer) and ``matmul_vs_roofline`` (the timed bare matmuls over it), in place."""
    params = num_matmul_params(shapes)
    for r in rows:
        mem_ms = r["weight_bytes"] / (limits["mem_read_gb_per_s"] * 1e9) * 1e3
        flop_ms = 2 * params * r["batch_size"] / (limits["gemm_peak_gflops"] * 1e9) * 1e3
        r["roofline_ms"] = max(mem_ms, flop_ms)
        r["roofline_bound"] = "memory" if mem_ms >= flop_ms else "compute"
        r["matmul_vs_roofline"] = r["step_ms_median"] / r["roofline_ms"]


def add_floor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF folder whose shapes to use (default: bundled).")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 32])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.add_argument("--output-json", default=None)
    p.add_argument("--engine-step", action="store_true",
                   help="Also time the engine's own decode step on --model (a GGUF, kept as stored) against the "
                        "memory floor, the read bandwidth probed around each request (engine_step_vs_read).")
    p.add_argument("--engine-step-rounds", type=int, default=8)


def cmd_floor(ns: argparse.Namespace) -> int:
    shapes = model_shapes(ns.model)
    rows = measure_floor(shapes, ns.batch_size, ns.dtype, ns.reps)
    limits = measure_limits(ns.dtype)
    roofline(rows, shapes, limits)
    res = {"shapes": shapes, "floor": rows, "limits": limits}
    if str(shapes.get("source", "")).endswith(".gguf"):  # the file's own bytes, read as stored (K-quants, Q4_1...)
        q = gguf_bytes_per_token(shapes["source"])
        q["memory_floor_ms"] = 1000.0 * q["weight_bytes_per_token"] / (limits["mem_read_gb_per_s"] * 1e9)
        res["quantized"] = q
    if ns.engine_step:
        res["engine_step"] = engine_step_vs_read(shapes["source"], rounds=ns.engine_step_rounds)
    if ns.json:
        print(json.dumps(res))
    else:
        print(f"bare-matmul floor of one decode step ({shapes['layers']} layers, hidden {shapes['hidden']}, "
              f"{rows[0]['weight_bytes'] / 1e6:.0f} MB of {ns.dtype} weights):")
        print(f"machine limits ({limits['torch_threads']} threads): {limits['gemm_peak_dtype']} GEMM peak "
              f"{limits['gemm_peak_gflops']:.0f} GFLOP/s, memory read {limits['mem_read_gb_per_s']:.1f} GB/s")
        for r in rows:
            print(f"  batch {r['batch_size']:>4}: {r['step_ms_median']:8.2f} ms/step (min {r['step_ms_min']:.2f}), "
                  f"{r['tokens_per_second']:9.1f} tok/s, {r['effective_gb_per_s']:.1f} GB/s of weights; roofline "
                  f"{r['roofline_ms']:.2f} ms ({r['roofline_bound']}-bound), matmuls {r['matmul_vs_roofline']:.2f}x it")
        if "quantized" in res:
            q = res["quantized"]
            head = "tied" if q["tied_lm_head"] else "separate"
            print(f"the GGUF as stored: {q['weight_bytes_per_token'] / 1e6:.0f} MB read per decode token ({head} LM "
                  f"head): memory floor {q['memory_floor_ms']:.2f} ms")
        if "engine_step" in res:
            e = res["engine_step"]
            print(f"engine decode step (one request, {len(e['rounds'])} requests): median {e['median_step_ms']:.2f} "
                  f"ms = {e['median_ratio']:.2f}x the memory floor at the bandwidth probed around each request "
                  f"(median {e['median_read_gb_per_s']:.0f} GB/s)")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
