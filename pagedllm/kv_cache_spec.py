"""What each layer keeps in the paged KV cache, per token (no torch: shapes and element counts only).

A model's ``kv_cache_spec()`` returns one spec per layer, in layer order. The runner allocates each layer's cache
tensor with ``spec.cache_shape(num_blocks, block_size)`` and sizes the cache with ``spec.elements_per_token``;
the attention of that layer reads and writes its own layout.

| spec | per token | cache tensor |
|---|---|---|
| ``AttentionSpec(kvh, d)`` | K and V: ``2 * kvh * d`` | ``[2, num_blocks, block_size, kvh, d]`` |
| ``MLASpec(r, p)`` (DeepSeek MLA) | one latent ``c_kv`` (r) and the shared rotary key (p): ``r + p`` | ``[num_blocks, block_size, r + p]`` |

``sliding_window`` (tokens, None = full attention) says how far back the layer looks; the KV cache manager may free
blocks that fell out of every window of a layer group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union


@dataclass(frozen=True)
class AttentionSpec:
    """Full K and V of ``num_kv_heads`` heads of ``head_dim`` per token."""

    num_kv_heads: int
    head_dim: int
    sliding_window: Optional[int] = None

    @property
    def elements_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_token(self, dtype_size: int) -> int:
        return self.elements_per_token * dtype_size


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek multi-head latent attention: the compressed ``kv_lora_rank`` latent (after its RMSNorm) and the
    ``qk_rope_head_dim`` rotary key shared by all heads (after RoPE), concatenated; keys and values of every head
    are recomputed (or absorbed into the query / output projections) from it."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    sliding_window: Optional[int] = None

    @property
    def elements_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.elements_per_token)

    def bytes_per_token(self, dtype_size: int) -> int:
        return self.elements_per_token * dtype_size


KVCacheSpec = Union[AttentionSpec, MLASpec]


def as_kv_cache_specs(specs: Sequence) -> list[KVCacheSpec]:
    """Specs as spec objects; a plain ``(num_kv_heads, head_dim)`` pair (the older form) means ``AttentionSpec``."""
    return [s if isinstance(s, (AttentionSpec, MLASpec)) else AttentionSpec(int(s[0]), int(s[1])) for s in specs]


@dataclass(frozen=True)
class KVCacheLayout:
    """How the layers share the paged KV cache: KV cache groups and cache tensors ("slots").

    Layers are split into groups of ``layers_per_group`` layers that attend the same way (one sliding window, or
    full attention). Each group has its own block table per request (``core.kv_cache_manager``), so a
    sliding-window group can free the blocks that fell out of its window while a full-attention group keeps all of
    them. All groups allocate from one block pool: block ``b`` of slot tensor ``j`` belongs to whichever group
    holds block ``b``, for its ``j``-th layer. So a block is ``layers_per_group`` layers deep, and memory moves
    freely between groups.

    Example, Gemma 3 270M (18 layers, layers 5, 11, 17 global, the rest window 512): 3 layers per group; group 0 =
    layers 5, 11, 17 (full); groups 1-5 = (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16) (window 512);
    3 slot tensors; layer 13 uses group 4's block table and slot 2. A 2,000-token request holds 125 blocks in
    group 0 and at most 33 in each window group (block_size 16): 290 blocks of 3 layers instead of 125 of 18.

    Models whose layers all attend alike have one group and one slot per layer (the plain layout).
    """

    group_windows: tuple[Optional[int], ...]  # per group: sliding window in tokens, None = full attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: the cache tensor it uses
    slot_specs: tuple[KVCacheSpec, ...]  # per slot tensor: its spec

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def layers_per_group(self) -> int:
        return len(self.slot_specs)

    def bytes_per_block(self, block_size: int, dtype_size: int) -> int:
        """Bytes of one pool block: ``block_size`` tokens of one layer per slot."""
        return block_size * sum(spec.bytes_per_token(dtype_size) for spec in self.slot_specs)

    def blocks_for_one_request(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Pool blocks one request of ``num_tokens`` tokens may hold at once, computed in chunks of at most
        ``max_chunk`` tokens: everything in full groups; in window-``w`` groups the window before the chunk and the
        chunk (at most ``cdiv(w - 1 + chunk, block_size) + 1`` blocks)."""
        full = -(-num_tokens // block_size)
        total = 0
        for w in self.group_windows:
            total += full if w is None else min(full, -(-(w - 1 + max_chunk) // block_size) + 1)
        return total


def plan_kv_cache_layout(specs: Sequence) -> KVCacheLayout:
    """Groups layers by sliding window (full attention first) into groups of ``gcd`` of the per-window layer
    counts. Layers whose cache specs differ (beyond the window) can't share tensors: then one group, one slot per
    layer, and no window freeing (``group_windows == (None,)`` unless every layer has the same window)."""
    from dataclasses import replace
    from math import gcd

    specs = as_kv_cache_specs(specs)
    num_layers = len(specs)
    windows = [s.sliding_window for s in specs]
    bases = {replace(s, sliding_window=None) for s in specs}
    distinct = sorted(set(windows), key=lambda w: -1 if w is None else w)
    if len(bases) != 1 or len(distinct) == 1:
        window = distinct[0] if len(distinct) == 1 else None
        return KVCacheLayout((window,), (0,) * num_layers, tuple(range(num_layers)), tuple(specs))
    per_group = 0
    for w in distinct:
        per_group = gcd(per_group, windows.count(w))
    group_windows: list[Optional[int]] = []
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    for w in distinct:
        layers = [i for i in range(num_layers) if windows[i] == w]
        for start in range(0, len(layers), per_group):
            for slot, layer in enumerate(layers[start : start + per_group]):
                layer_group[layer] = len(group_windows)
                layer_slot[layer] = slot
            group_windows.append(w)
    base = bases.pop()
    return KVCacheLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot), (base,) * per_group)
