"""Export the bundled GGUF (or any llama-family GGUF) to a Hugging Face folder in bf16, for peers that need one (vLLM).

    python -m pagedllm.benchmarks.export_hf --out .peers/smollm2-hf-bf16 [--gguf PATH]

transformers 5 refuses `save_pretrained` on a model that was loaded from a GGUF, so the model is read from the GGUF,
then its (dequantized) weights are copied into a fresh model built from the same config without the quantization
config, which saves normally. Needs `gguf` and `accelerate` (both installed with the project's test extras).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path


def export(gguf_path: str, out_dir: str, dtype: str = "bfloat16") -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    gguf_path = os.path.abspath(gguf_path)
    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch_dtype
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    state = loaded.state_dict()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    # A tied lm_head is legitimately absent from the state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and getattr(config, "tie_word_embeddings", False))]
    if missing or unexpected:
        raise RuntimeError(f"weight mismatch: missing={missing} unexpected={unexpected}")
    fresh.tie_weights()
    fresh = fresh.to(torch_dtype).eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.save_pretrained(out)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="GGUF file (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args(argv)
    gguf_path = args.gguf
    if gguf_path is None:
        from pagedllm.model_files import default_model_path
        gguf_path = default_model_path()
    out = export(gguf_path, args.out, args.dtype)
    print(f"exported {gguf_path} -> {out}: " + ", ".join(sorted(os.listdir(out))))


if __name__ == "__main__":
    main()
