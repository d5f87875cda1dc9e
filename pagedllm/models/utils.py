"""Pieces shared by the model modules: skip-init linears and embeddings, and checkpoint loading with fused /
stacked parameters.

Checkpoint tensors (Hugging Face names) land in parameters that may be

- *fused* along dim 0: ``qkv_proj`` holds q, k and v rows; a module declares its shard row counts in
  ``output_sizes`` and the model maps shard names onto it (``("qkv_proj", "k_proj", 1)``: "…k_proj.weight" fills
  rows ``[q_size, q_size + kv_size)`` of "…qkv_proj.weight");
- *stacked* over experts along a new dim 0: ``experts.w13 [E, 2I, H]`` takes "…experts.3.gate_proj.weight" in
  ``w13[3, :I]``; a module declares ``num_experts``.

The model gives a ``resolve(name) -> WeightTarget | None`` (None: skip the tensor); ``load_named_weights`` copies,
checks shapes and reports unknown and missing weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import nn


def skip_init_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    """An ``nn.Linear`` over uninitialized memory, without the random init (load_weights overwrites it; seconds saved
    for a large model).

    Not ``torch.nn.utils.skip_init``: its ``to_empty`` from the meta device goes through ``torch._refs``, which
    imports ``torch.fx.experimental.symbolic_shapes`` (~0.4 s of every start-up on 2 cores, measured)."""
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = in_features, out_features
    linear.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
    if bias:
        linear.bias = nn.Parameter(torch.empty(out_features, dtype=dtype))
    else:
        linear.register_parameter("bias", None)
    return linear


def skip_init_embedding(num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> nn.Embedding:
    """An ``nn.Embedding [num_embeddings, embedding_dim]`` over uninitialized memory (load_weights overwrites it).

    Not ``torch.nn.utils.skip_init``: its meta-device ``normal_`` goes through ``torch._refs``, whose wrapper imports
    ``torch._dynamo`` and with it triton (~0.9 s of start-up, measured; and triton's nanobind prints "leaked"
    warnings when the process exits)."""
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim, dtype=dtype))


@dataclass(frozen=True)
class WeightTarget:
    param: str  # parameter name in the model
    shard: Optional[int] = None  # index into the module's ``output_sizes`` (fused along dim 0)
    expert: Optional[int] = None  # index along dim 0 of a stacked expert parameter


def fused_shard_sizes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """parameter name -> row counts of its shards, from modules declaring ``output_sizes``: a tuple (for every
    parameter of the module) or a dict ``{parameter: tuple}``. Rows are counted along dim 0 (after the expert
    index for stacked expert parameters)."""
    out: dict[str, tuple[int, ...]] = {}
    for mod_name, mod in model.named_modules():
        sizes = getattr(mod, "output_sizes", None)
        if sizes is None:
            continue
        for p_name, _ in mod.named_parameters(recurse=False):
            p_sizes = sizes.get(p_name) if isinstance(sizes, dict) else sizes
            if p_sizes is not None:
                out[f"{mod_name}.{p_name}" if mod_name else p_name] = tuple(p_sizes)
    return out


def stacked_expert_counts(model: nn.Module) -> dict[str, int]:
    """parameter name -> number of experts, for modules declaring ``num_experts`` (their 3D parameters)."""
    out: dict[str, int] = {}
    for mod_name, mod in model.named_modules():
        n = getattr(mod, "num_experts", None)
        if isinstance(n, int):
            for p_name, p in mod.named_parameters(recurse=False):
                if p.dim() == 3 and p.shape[0] == n:
                    out[f"{mod_name}.{p_name}" if mod_name else p_name] = n
    return out


def stacked_params_resolver(
    mapping: Iterable[tuple[str, str, int]],
) -> Callable[[str], WeightTarget]:
    """``resolve`` for plain and fused names: the first ``(fused, shard_name, shard_id)`` whose ``.shard_name.``
    occurs in the name redirects it to the fused parameter."""
    mapping = tuple(mapping)

    def resolve(name: str) -> WeightTarget:
        for fused, shard_name, shard_id in mapping:
            if f".{shard_name}." in name:
                return WeightTarget(name.replace(f".{shard_name}.", f".{fused}."), shard=shard_id)
        return WeightTarget(name)

    return resolve


@torch.no_grad()
def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    resolve: Callable[[str], Optional[WeightTarget]],
) -> None:
    """Copies ``(hf_name, tensor)`` pairs into ``model``'s parameters (converting dtype).

    Raises:
        ValueError: for a name with no parameter, a shape mismatch, or parameters (or shards / experts of them)
            the checkpoint didn't fill.
    """
    params = dict(model.named_parameters())
    shard_sizes = fused_shard_sizes(model)
    expert_counts = stacked_expert_counts(model)
    expected: set[tuple[str, int, int]] = set()
    for name in params:
        for e in range(expert_counts.get(name, 1)):
            for s in range(len(shard_sizes.get(name, (None,)))):
                expected.add((name, e, s))
    loaded: set[tuple[str, int, int]] = set()
    for name, tensor in weights:
        target = resolve(name)
        if target is None:
            continue
        param = params.get(target.param)
        if param is None:
            raise ValueError(f"checkpoint weight {name!r} has no parameter in {type(model).__name__}")
        dest = param.data
        if target.expert is not None:
            dest = dest[target.expert]
        if target.shard is not None:
            sizes = shard_sizes[target.param]
            dest = dest.narrow(0, sum(sizes[: target.shard]), sizes[target.shard])
        if dest.shape != tensor.shape:
            raise ValueError(f"weight {name!r}: checkpoint shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        # A tensor without an expert / shard index fills all of them (e.g. HF's stacked [E, 2I, H] experts).
        experts = [target.expert] if target.expert is not None else range(expert_counts.get(target.param, 1))
        shards = [target.shard] if target.shard is not None else range(len(shard_sizes.get(target.param, (None,))))
        loaded.update((target.param, e, s) for e in experts for s in shards)
    missing = sorted({name for name, _, _ in expected - loaded})
    if missing:
        raise ValueError(
            f"checkpoint is missing weights for: {', '.join(missing[:10])}"
            + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        )
