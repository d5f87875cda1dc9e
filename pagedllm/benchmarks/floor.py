"""``pagedllm bench floor``: the bare-matmul floor of one decode step — just the weight matmuls of the model, nothing
else — to compare the engine's decode step time with (issue 5: within 1.3x at batch 32).

The model's shapes come from its GGUF header (or HF ``config.json``); the weights are random, in ``--dtype``, one set
per layer (so the step reads every weight once, as a real step does): per layer fused QKV, O, fused gate/up and down
projections through ``torch.nn.functional.linear``, then the LM head on the last hidden state of each sequence.

    pagedllm bench floor --batch-size 1 32 [--dtype bfloat16] [--json]
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


def add_floor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF folder whose shapes to use (default: bundled).")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 32])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.add_argument("--output-json", default=None)


def cmd_floor(ns: argparse.Namespace) -> int:
    shapes = model_shapes(ns.model)
    rows = measure_floor(shapes, ns.batch_size, ns.dtype, ns.reps)
    res = {"shapes": shapes, "floor": rows}
    if ns.json:
        print(json.dumps(res))
    else:
        print(f"bare-matmul floor of one decode step ({shapes['layers']} layers, hidden {shapes['hidden']}, "
              f"{rows[0]['weight_bytes'] / 1e6:.0f} MB of {ns.dtype} weights):")
        for r in rows:
            print(f"  batch {r['batch_size']:>4}: {r['step_ms_median']:8.2f} ms/step (min {r['step_ms_min']:.2f}), "
                  f"{r['tokens_per_second']:9.1f} tok/s, {r['effective_gb_per_s']:.1f} GB/s of weights")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
