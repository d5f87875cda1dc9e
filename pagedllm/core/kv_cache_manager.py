"""Per-request block tables on top of the ``BlockPool`` (integers only; no torch).

The manager never writes ``num_computed_tokens``: it returns counts, and the scheduler decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedllm.core.block_pool import NONE_HASH, BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Counted in tokens, over requests admitted since the last ``take``."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache
    requests: int = 0

    def take(self) -> "PrefixCacheStats":
        s = PrefixCacheStats(self.queries, self.hits, self.requests)
        self.queries = self.hits = self.requests = 0
        return s


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # ------------------------------------------------------------------ hashes
    def update_block_hashes(self, request: Request) -> None:
        """Extends ``request.block_hashes`` to cover every full block of ``request.all_token_ids``."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        n_full = len(tokens) // bs
        while len(hashes) < n_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else NONE_HASH
            extra = request.cache_salt if i == 0 else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], extra))

    # ------------------------------------------------------------------ lookup / allocation
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request: (blocks, number of tokens).

        At most ``num_tokens - 1`` tokens are reported, so the last token is always computed (its logits are
        needed). Requests asking for prompt logprobs get no hits (those need logits at every prompt position).
        Doesn't change any state.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for h in request.block_hashes[:max_blocks]:
            b = self.block_pool.get_cached_block(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * self.block_size

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        s = self.prefix_cache_stats
        s.requests += 1
        s.queries += num_prompt_tokens
        s.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
        num_new_computed_tokens: int = 0,
    ) -> Optional[list[KVCacheBlock]]:
        """Makes room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens`` (+ prefix hits).

        Returns the newly allocated blocks (possibly empty), or None if the pool lacks free blocks (then nothing
        changed). Blocks that will be full after this step are registered in the prefix cache now, so requests
        scheduled later in the same step can share them (their KV is written before any attention reads it).
        """
        new_computed_blocks = new_computed_blocks or []
        req_id = request.request_id
        blocks = self.req_to_blocks.setdefault(req_id, [])
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = cdiv(num_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        num_needed = max(num_needed, 0)
        # Hit blocks with ref_cnt 0 sit in the free list: touching them uses up free blocks too.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed + num_evictable_hits > self.block_pool.get_num_free_blocks():
            if not blocks:
                del self.req_to_blocks[req_id]
            return None
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed) if num_needed else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            num_cached = self.num_cached_block.get(req_id, 0)
            num_full = min(num_tokens, request.num_tokens) // self.block_size
            if num_full > num_cached:
                self.update_block_hashes(request)
                self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full)
                self.num_cached_block[req_id] = num_full
        return new_blocks

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first (so its later blocks are evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # ------------------------------------------------------------------ stats
    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def num_allocated_blocks(self) -> int:
        """Distinct blocks referenced by some request."""
        return self.block_pool.num_blocks - 1 - self.block_pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
