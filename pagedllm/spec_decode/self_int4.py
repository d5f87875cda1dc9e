"""``self_int4``: a bf16 model drafts for itself with an int4 copy of its own weights, verified by the bf16 weights.

The draft (``int4_draft_model``) is the target's module tree with every decoder linear requantized at load with
``quantize_int4_minmax`` (asymmetric min-max, groups of 32; our int4 kernels, ``layers/quantization``) and the
token embedding (and a tied LM head) as per-row int8 (``Int8Rows``): about 0.6 byte per weight, ~30% more weight
memory than bf16 alone. Norms and rotary tables are the target's tensors, shared.

KV cache, mirroring and proposing: as a ``draft_model`` draft (``pagedllm.spec_decode.draft_model``, whose
``DraftModelDrafter`` runs it): its own paged cache of the target's layout and dtype, indexed by the target's block
tables, its bytes counted in the KV budget.

Exactness never rests on the draft: a draft token is kept only when the bf16 target samples it itself
(``spec_decode/verify.py``), so a stale or wrong draft K/V only costs acceptance.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from pagedllm.layers.quantization import QuantConfig, QuantEmbedding, QuantLinear
from pagedllm.layers.quantization.kernels import int4_kernel_supports, quantize_int4_minmax
from pagedllm.spec_decode.draft_model import DraftModelDrafter

DRAFT_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
GROUP_SIZE = 32
_KEY = "_self_int4_draft"


def _dense_weight(mod: nn.Module) -> Optional[torch.Tensor]:
    """``[out, in]`` weight of a plain ``nn.Linear`` or of a ``PackedLinear`` on one of our packed kernels (its
    layout undone: the pack is a permutation of elements, found by packing the elements' indices), else None."""
    from pagedllm.layers.packed_linear import PackedLinear, _interleave_halves, linear_backend

    if type(mod) is nn.Linear:
        return mod.weight.detach()
    if not isinstance(mod, PackedLinear) or mod._amx is None:
        return None
    found = linear_backend(mod.out_features, mod.in_features)
    if found is None or found[0].name != mod.backend:
        return None
    backend, lib = found
    n, k = mod.out_features, mod.in_features
    idx = torch.arange(n * k, dtype=torch.int32).view(n, k)
    if mod.gated:
        idx = _interleave_halves(idx)
    halves = []
    for part in (idx & 0xFFFF, idx >> 16):  # each 16-bit half of every index, through the pack
        src = part.contiguous().view(torch.int16)[..., ::2].contiguous()  # little endian: the low 16 bits
        dst = torch.empty(n * k, dtype=torch.int16)
        getattr(lib, backend.pack)(src.data_ptr(), n, k, dst.data_ptr())
        halves.append(dst.to(torch.int64) & 0xFFFF)
    where = halves[0] | (halves[1] << 16)  # packed element i is weight element where[i]
    w = torch.empty(n * k, dtype=torch.bfloat16)
    w[where] = mod.packed_weight.view(-1)
    return w.view(n, k)


def _int4_linear(mod: nn.Module, w: torch.Tensor) -> QuantLinear:
    ql = QuantLinear(mod.in_features, mod.out_features, getattr(mod, "bias", None) is not None, torch.bfloat16,
                     QuantConfig("gguf"))
    ql.load_shard(0, "weight", quantize_int4_minmax(w.float(), GROUP_SIZE))
    ql.process_weights_after_loading()
    if ql.bias is not None:
        ql.bias.data.copy_(mod.bias.detach())
    if hasattr(mod, "output_sizes"):
        ql.output_sizes = mod.output_sizes
    return ql


def _int8_embedding(emb: nn.Embedding) -> QuantEmbedding:
    qe = QuantEmbedding(emb.num_embeddings, emb.embedding_dim, torch.bfloat16, QuantConfig("int8"))
    qe.load_shard(0, "weight", emb.weight.detach())
    qe.process_weights_after_loading()
    return qe


def int4_draft_model(model: nn.Module) -> nn.Module:
    """The int4 draft of a bf16 Llama-family ``model`` (``LlamaForCausalLM``: ``model.model.layers`` with
    ``qkv_proj``/``o_proj``/``gate_up_proj``/``down_proj``), made once and kept on ``model``.

    Raises:
        ValueError: not a bf16 Llama-family model, a linear whose weight can't be read back (oneDNN-packed) or
            that the int4 kernels don't take (``in_features % 32``).
    """
    draft = model.__dict__.get(_KEY)
    if draft is not None:
        return draft
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if getattr(model, "dtype", None) != torch.bfloat16 or layers is None or not hasattr(model, "compute_logits"):
        raise ValueError("speculative_config.method 'self_int4' needs a bf16 Llama-family model (dtype bfloat16, "
                         "no --quantization).")
    swaps: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        if name.rpartition(".")[2] in DRAFT_LINEARS:
            w = _dense_weight(mod)
            if w is None or not int4_kernel_supports(mod.in_features, GROUP_SIZE):
                raise ValueError(f"speculative_config.method 'self_int4': layer {name} ({type(mod).__name__}) "
                                 f"can't be requantized to int4.")
            swaps[name] = _int4_linear(mod, w)
    emb = getattr(inner, "embed_tokens", None)
    if type(emb) is not nn.Embedding:
        raise ValueError("speculative_config.method 'self_int4' needs a plain token embedding.")
    swaps["model.embed_tokens"] = _int8_embedding(emb)
    head = getattr(model, "lm_head", None)
    if head is not emb:
        w = _dense_weight(head) if head is not None else None
        if w is None:
            raise ValueError("speculative_config.method 'self_int4': the LM head can't be requantized.")
        ql = QuantLinear(head.in_features, head.out_features, False, torch.bfloat16, QuantConfig("int8"))
        ql.load_shard(0, "weight", w)
        ql.process_weights_after_loading()
        swaps["lm_head"] = ql
    # A copy of the module tree sharing every tensor (norms, rotary tables); replaced modules and the C layer loop
    # (rebuilt for the draft's layers on first use) are not copied.
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    for name, mod in model.named_modules():
        if name in swaps or name == "lm_head_packed":
            memo[id(mod)] = mod
    stack = inner.__dict__.get("_stack")
    if stack is not None:
        memo[id(stack)] = None
    draft = copy.deepcopy(model, memo)
    draft.model.__dict__.pop("_stack", None)
    draft.__dict__.pop("lm_head_packed", None)
    draft._modules.pop("lm_head_packed", None)
    for name, new in swaps.items():
        parent, _, attr = name.rpartition(".")
        setattr(draft.get_submodule(parent) if parent else draft, attr, new)
    if head is emb:
        draft.lm_head = draft.model.embed_tokens
    model.__dict__[_KEY] = draft
    return draft


class SelfInt4Drafter(DraftModelDrafter):
    """The runner's drafter for ``self_int4`` (see the module docstring). ``runner``: the ``ModelRunner`` (its
    model, block size, ``num_blocks``, KV layout).

    Raises:
        ValueError: as ``int4_draft_model``, or for more than one KV cache group.
    """

    method = "self_int4"

    def __init__(self, config, runner) -> None:
        super().__init__(config, runner, int4_draft_model(runner.model), runner.layout, torch.bfloat16)
