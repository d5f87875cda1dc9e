"""Helpers for the real-weight model tests (test_real_qwen25.py, test_real_gemma3.py).

The HF reference model is built with ``AutoModelForCausalLM.from_config`` from the config our GGUF reader produced
and given our dequantized weights (split back to HF names). Loading the GGUF through transformers instead would
cost 50-65 s per model on 2 cores; what that path adds is checked separately and cheaply:

- dequantization: every quant type in the file, one real tensor each, equals ``gguf.quants.dequantize`` (what
  transformers uses), bit for bit;
- names / layout: the synthetic-GGUF tests in test_loader.py and test_gguf_gemma3_and_quants.py compare our loader with
  tensors written under llama.cpp's names;
- config: the fields are compared with the published values of each model.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.quants import dequantize

from pagedllm.attention.torch_attn import build_attention_metadata
from pagedllm.model_loader.gguf_loader import GGUFTensorInfo, _to_torch, read_gguf_header
from pagedllm.models.utils import fused_shard_sizes
from pagedllm.worker.model_runner import allocate_kv_caches

SHARD_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Our parameters under HF names: fused q/k/v and gate/up rows split back."""
    sizes = fused_shard_sizes(model)
    out = {}
    for name, p in model.named_parameters():
        fused = next((f for f in SHARD_NAMES if f".{f}." in name), None)
        if fused is None:
            out[name] = p.data
            continue
        for shard, t in zip(SHARD_NAMES[fused], p.data.split(list(sizes[name]))):
            out[name.replace(f".{fused}.", f".{shard}.")] = t
    return out


def hf_reference(model):
    """HF's implementation of ``model.hf_config`` on ``model``'s weights (float32, eval, SDPA). The tensors are
    shared (``assign``), not copied, and HF's random init is skipped: seconds and GBs saved on a 0.5B model."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        hf = AutoModelForCausalLM.from_config(model.hf_config, dtype=torch.float32, attn_implementation="sdpa")
    state = hf_state_dict(model)
    if model.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = hf.load_state_dict(state, strict=True, assign=True)
    assert not missing and not unexpected
    return hf.eval()


@torch.inference_mode()
def hf_logits_of_continuation(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """HF's logits at every position of ``prompt + generated[:-1]`` (one forward pass). Greedy decoding by HF
    produces ``generated`` iff ``logits[len(prompt) - 1 + i].argmax() == generated[i]`` for every i."""
    return hf(torch.tensor([prompt + generated[:-1]])).logits[0]


def assert_hf_greedy_agrees(hf_logits: torch.Tensor, prompt: list[int], generated: list[int], what: str) -> None:
    picks = hf_logits[len(prompt) - 1 :].argmax(-1).tolist()
    assert picks == generated, f"{what}: HF's greedy pick differs at token {next(i for i, (a, b) in enumerate(zip(picks, generated)) if a != b)}"


def smallest_tensor_per_type(path: str) -> dict[str, GGUFTensorInfo]:
    """quant type name -> the smallest tensor of that type in the file."""
    out: dict[str, GGUFTensorInfo] = {}
    for info in read_gguf_header(path).tensors.values():
        best = out.get(info.ggml_type.name)
        if best is None or info.nbytes < best.nbytes:
            out[info.ggml_type.name] = info
    return out


def assert_dequantizes_like_gguf(path: str) -> list[str]:
    """Our dequantization of one real tensor per quant type == gguf.quants.dequantize. Returns the types seen."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    types = smallest_tensor_per_type(path)
    for tname, info in types.items():
        data = np.array(raw[info.offset : info.offset + info.nbytes])
        ours = _to_torch(data, info, torch.float32)
        ref = torch.from_numpy(np.ascontiguousarray(dequantize(data, info.ggml_type))).reshape(info.shape)
        assert torch.equal(ours, ref.float()), f"{tname}: {info.name}"
    return sorted(types)


@torch.inference_mode()
def prefill_logits(model, tokens: list[int], chunk: int, keep_last: int = 0, block_size: int = 16,
                   kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits of every position (of the last ``keep_last`` ones if > 0), computed in chunks of ``chunk`` tokens
    through a fresh paged cache (of ``kv_dtype``: the model's dtype)."""
    n = len(tokens)
    num_blocks = -(-n // block_size)
    kv = allocate_kv_caches(model.kv_cache_spec(), num_blocks + 1, block_size, kv_dtype)
    table = torch.arange(num_blocks, 0, -1, dtype=torch.int32)[None]  # blocks in reverse order
    out = []
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        pos = torch.arange(s, e)
        slots = table[0, pos // block_size].long() * block_size + pos % block_size
        meta = build_attention_metadata([e - s], [e], table, slots, block_size, sliding_window=model.sliding_window)
        hidden = model(torch.tensor(tokens[s:e]), pos, kv, meta)
        if keep_last:
            hidden = hidden[max(0, n - keep_last - s):]
        out.append(model.compute_logits(hidden).float())
    return torch.cat(out)


INVARIANCE_TARGET = "Explain in a few sentences why the sky is blue and why sunsets are red."


def greedy_alone_and_among_others(llm, max_tokens: int) -> tuple[list[int], list[int]]:
    """The greedy tokens of one prompt run alone, and the same prompt's run as the 5th of 9 concurrent prompts of
    different lengths (batch invariance: the two must be equal)."""
    from pagedllm import SamplingParams

    others = [f"Write a short story about a robot number {i} who learns to paint." + " Please." * i
              for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    alone = llm.generate([INVARIANCE_TARGET], sp, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(others[:4] + [INVARIANCE_TARGET] + others[4:], sp, use_tqdm=False)[4].outputs[0].token_ids
    return list(alone), list(mixed)
