"""Physical KV blocks: ref counts, an O(1) LRU free list, and the prefix-hash -> block table.

Integers only; no torch. Design after vLLM v1's ``BlockPool`` (vllm/v1/core/block_pool.py):

- Block 0 is the *null block*: never handed out; block tables are padded with it.
- Free blocks sit in a doubly-linked list in eviction order: ``get_new_blocks`` takes from the head (least recently
  freed), ``free_blocks`` appends a cached block at the tail. A request frees its blocks tail first, so when two
  blocks were freed together, the later block of a prompt is evicted before the earlier one (the earlier one is more
  likely shared, and a later block is useless once its parent is gone). A freed block that holds no cached prefix
  (a partial last block, or any block with caching off) goes to the head instead: reusing it evicts nothing.
- A freed block keeps its hash and stays findable (a prefix-cache hit takes it back out of the free list) until it
  is reallocated: only then is its hash dropped (eviction).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

# Parent hash of the first block of every request.
NONE_HASH: bytes = hashlib.sha256(b"pagedllm-prefix-cache-v1").digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], extra_keys: Optional[str] = None) -> bytes:
    """Prefix hash of one full block: sha256(parent_hash || int64 token ids || utf-8 extra key).

    Chained through ``parent_hash``, it identifies the whole prefix up to and including this block. sha256 makes a
    collision (two different prefixes sharing KV) practically impossible, so a hit needs no token comparison.
    ``extra_keys`` carries anything else that changes the KV of the block (e.g. a tenant's ``cache_salt``); the token
    part always has ``8 * block_size`` bytes and the key carries an 8-byte length, so the encoding is unambiguous.
    """
    h = hashlib.sha256(parent_hash)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        e = extra_keys.encode()
        h.update(len(e).to_bytes(8, "little"))
        h.update(e)
    return h.digest()


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[bytes] = None
    prev_free: Optional["KVCacheBlock"] = None
    next_free: Optional["KVCacheBlock"] = None
    is_null: bool = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly-linked list of free blocks with sentinels; every operation is O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        b = self.head.next_free
        if b is self.tail:
            raise ValueError("no free blocks")
        self.remove(b)
        return b

    def remove(self, b: KVCacheBlock) -> None:
        if b.prev_free is None or b.next_free is None:
            raise RuntimeError(f"{b} is not in the free list")
        b.prev_free.next_free = b.next_free
        b.next_free.prev_free = b.prev_free
        b.prev_free = b.next_free = None
        self.num_free_blocks -= 1

    def appendleft(self, b: KVCacheBlock) -> None:
        first = self.head.next_free
        first.prev_free = b
        b.next_free = first
        b.prev_free = self.head
        self.head.next_free = b
        self.num_free_blocks += 1

    def append(self, b: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free = b
        b.prev_free = last
        b.next_free = self.tail
        self.tail.prev_free = b
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (next evicted) to tail; O(n), for tests and debugging."""
        out = []
        b = self.head.next_free
        while b is not self.tail:
            out.append(b.block_id)
            b = b.next_free
        return out


class BlockPool:
    """Owns all ``num_blocks`` blocks (block 0 = null block, so ``num_blocks - 1`` are usable)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Share of usable blocks referenced by a request (cached-but-free blocks count as free)."""
        total = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total

    def get_cached_block(self, block_hash: bytes) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

    # ------------------------------------------------------------------ allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes ``num_blocks`` blocks from the head of the free list (evicting their cached hashes).

        Raises:
            ValueError: if fewer are free (callers check ``get_num_free_blocks`` first).
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} free")
        out = []
        for _ in range(num_blocks):
            b = self.free_block_queue.popleft()
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: KVCacheBlock) -> None:
        if self.cached_block_hash_to_block.get(b.block_hash) is b:
            del self.cached_block_hash_to_block[b.block_hash]
        b.block_hash = None
        self.num_evictions += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds a reference to each block (prefix-cache hit); a free one leaves the free list."""
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block. Blocks reaching 0 join the free list in the given order: cached ones
        at the tail (most recently used), hashless ones at the head (next to be reused)."""
        q = self.free_block_queue
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt < 0:
                raise RuntimeError(f"{b} freed more often than allocated")
            if b.ref_cnt == 0 and not b.is_null:
                if b.block_hash is None:
                    q.appendleft(b)
                else:
                    q.append(b)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Registers ``blocks[num_cached_blocks:num_full_blocks]`` under ``block_hashes`` of the same indices.

        A hash already held by another block (two requests computed the same prefix at once) keeps the first block;
        the duplicate stays uncached and is freed like any other block.
        """
        if not self.enable_caching:
            return
        table = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            b = blocks[i]
            if b.block_hash is not None:
                continue  # a hit: already cached
            h = block_hashes[i]
            if h in table:
                continue
            b.block_hash = h
            table[h] = b

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash (blocks in use keep their KV but can no longer be hit). Returns True."""
        for b in self.cached_block_hash_to_block.values():
            b.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
