"""Per-request block tables on top of the ``BlockPool`` (integers only; no torch).

The manager never writes ``num_computed_tokens``: it returns counts, and the scheduler decides.

KV cache groups (``group_windows``; see ``pagedllm.kv_cache_spec.KVCacheLayout``): every group has its own block
table per request, all allocating from the one pool. Group 0 is the one the scheduler's messages carry
(``req_to_blocks``, ``get_block_ids``, the blocks ``allocate_slots`` returns); the other groups' new block ids are
collected for the runner by ``take_new_group_block_ids``. A group with a sliding window ``w`` frees, before each
allocation, the blocks no query of the request can see any more: with ``c`` tokens computed, the next query (at
position ``c``) sees keys ``>= c - w + 1``, so blocks ``[0, (c - w + 1) // block_size)`` go back to the pool and the
table keeps the null block in their place (also when a step ends: ``release_out_of_window``). E.g. ``w = 512``, ``block_size = 16``, ``c = 2000``: blocks 0..91 are
freed and blocks 92..124 (33 = ``cdiv(512, 16) + 1``) held. Freed blocks keep their prefix hash (reusable until
evicted), in the group's own key space (the hash with the group index appended), since the same tokens have
different KV in different groups.

A prefix-cache hit of ``n`` blocks needs, in a full group, blocks ``[0, n)`` cached and, in a window group, the
blocks of the window before position ``n * block_size``; the hit is the longest ``n`` all groups agree on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from pagedllm.core.block_pool import NONE_HASH, BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupHits(list):
    """Prefix-cache hit blocks of group 0 (a plain list to the scheduler) carrying every group's hit blocks in
    ``groups`` (window groups: the null block before the window)."""

    groups: list[list[KVCacheBlock]]


class _SuffixedHashes:
    """``hashes[i] + suffix`` on demand: a group's key space for ``BlockPool.cache_full_blocks``."""

    __slots__ = ("hashes", "suffix")

    def __init__(self, hashes: Sequence[bytes], suffix: bytes) -> None:
        self.hashes = hashes
        self.suffix = suffix

    def __getitem__(self, i: int) -> bytes:
        return self.hashes[i] + self.suffix


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
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 group_windows: Optional[Sequence[Optional[int]]] = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Per group: the sliding window (None = full attention), request id -> blocks (block i holds tokens
        # [i * block_size, (i + 1) * block_size); the null block where a window group freed one), how many leading
        # blocks are registered in the prefix cache, how many leading blocks a window group has released.
        self.group_windows: list[Optional[int]] = list(group_windows) if group_windows else [None]
        self.num_groups = len(self.group_windows)
        self._window_groups = [g for g, w in enumerate(self.group_windows) if w is not None]
        self.group_req_to_blocks: list[dict[str, list[KVCacheBlock]]] = [{} for _ in self.group_windows]
        self.group_num_cached_block: list[dict[str, int]] = [{} for _ in self.group_windows]
        self.group_num_skipped: list[dict[str, int]] = [{} for _ in self.group_windows]
        self._hash_suffix = [b"" if g == 0 else b"\xffgroup" + g.to_bytes(2, "little")
                             for g in range(self.num_groups)]
        self.req_to_blocks = self.group_req_to_blocks[0]
        self.num_cached_block = self.group_num_cached_block[0]
        # Block ids of groups >= 1 allocated since the last take_new_group_block_ids, per request.
        self._new_group_block_ids: dict[str, list[list[int]]] = {}
        # Per request, after an allocate_slots that found all it needed: (tokens its blocks hold in every group,
        # tokens below which no further block fills for the prefix cache, num_computed_tokens below which no window
        # group releases a block). A call within all three (a decode step inside its last block) has nothing to do
        # and returns at once (scheduling a decode step of 16 Gemma 3 requests, six groups: 164 -> 45 us). Dropped
        # whenever the request's blocks change outside allocate_slots (free, a window release).
        self._quiet: dict[str, tuple[int, int, int]] = {}
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
    def _first_visible_block(self, num_computed: int, window: int) -> int:
        """Index of the first block the next query (at position ``num_computed``) can see through ``window``."""
        return max(0, (num_computed - window + 1) // self.block_size)

    def _cached(self, group: int, block_hash: bytes) -> Optional[KVCacheBlock]:
        return self.block_pool.get_cached_block(block_hash + self._hash_suffix[group])

    def _window_hit(self, group: int, hashes: Sequence[bytes], n: int, window: int) -> int:
        """The largest ``m <= n`` whose window blocks ``[first_visible(m), m)`` are all cached in ``group``.

        Scanning right to left: if block ``j`` in the window of ``m`` is missing, every ``m' > j`` has ``j`` in its
        window too (the window start only moves right as ``m`` grows), so the next candidate is ``m = j``."""
        m = n
        while m > 0:
            first = self._first_visible_block(m * self.block_size, window)
            j = next((i for i in range(m - 1, first - 1, -1) if self._cached(group, hashes[i]) is None), None)
            if j is None:
                return m
            m = j
        return 0

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request: (blocks, number of tokens).

        At most ``num_tokens - 1`` tokens are reported, so the last token is always computed (its logits are
        needed). Requests asking for prompt logprobs get no hits (those need logits at every prompt position).
        With several groups the blocks are a ``GroupHits`` (group 0's list, every group's in ``.groups``).
        Doesn't change any state.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self.update_block_hashes(request)
        hashes = request.block_hashes
        n = (request.num_tokens - 1) // self.block_size
        for g, w in enumerate(self.group_windows):
            if w is None:
                n = next((i for i in range(n) if self._cached(g, hashes[i]) is None), n)
        changed = True
        while changed:  # window groups may shorten the hit, which may break another window group's
            changed = False
            for g, w in enumerate(self.group_windows):
                if w is not None:
                    m = self._window_hit(g, hashes, n, w)
                    changed |= m < n
                    n = m
        groups = []
        null = self.block_pool.null_block
        for g, w in enumerate(self.group_windows):
            first = 0 if w is None else self._first_visible_block(n * self.block_size, w)
            groups.append([null] * first + [self._cached(g, hashes[i]) for i in range(first, n)])
        if self.num_groups == 1 and self.group_windows[0] is None:
            return groups[0], n * self.block_size
        hits = GroupHits(groups[0])
        hits.groups = groups
        return hits, n * self.block_size

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        s = self.prefix_cache_stats
        s.requests += 1
        s.queries += num_prompt_tokens
        s.hits += num_hit_tokens

    def release_out_of_window(self, request: Request) -> None:
        """Frees, in every sliding-window group, the request's blocks that no query after its
        ``num_computed_tokens`` can see (also done by ``allocate_slots``; calling it when a step ends frees them
        for the next schedule). No-op without window groups."""
        if self._window_groups:
            quiet = self._quiet.get(request.request_id)
            if quiet is not None and request.num_computed_tokens < quiet[2]:
                return
            for g in self._window_groups:
                self._release_out_of_window(g, request.request_id, request.num_computed_tokens)

    def _release_out_of_window(self, group: int, req_id: str, num_computed: int) -> None:
        blocks = self.group_req_to_blocks[group].get(req_id)
        if not blocks:
            return
        skipped = self.group_num_skipped[group].get(req_id, 0)
        first = min(self._first_visible_block(num_computed, self.group_windows[group]), len(blocks))
        if first <= skipped:
            return
        self._quiet.pop(req_id, None)
        null = self.block_pool.null_block
        released = [b for b in blocks[skipped:first] if not b.is_null]
        blocks[skipped:first] = [null] * (first - skipped)
        self.group_num_skipped[group][req_id] = first
        self.block_pool.free_blocks(released)  # oldest first: evicted before the later ones

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
        num_new_computed_tokens: int = 0,
    ) -> Optional[list[KVCacheBlock]]:
        """Makes room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens`` (+ prefix hits).

        Returns group 0's newly allocated blocks (possibly empty), or None if the pool lacks free blocks (then
        nothing changed, except that window groups may have released blocks no query needs any more). Blocks that
        will be full after this step are registered in the prefix cache now, so requests scheduled later in the
        same step can share them (their KV is written before any attention reads it).
        """
        req_id = request.request_id
        quiet = self._quiet.get(req_id)
        if quiet is not None and not new_computed_blocks and not num_new_computed_tokens:
            num_tokens = request.num_computed_tokens + num_new_tokens
            if (num_tokens <= quiet[0] and min(num_tokens, request.num_tokens) < quiet[1]
                    and request.num_computed_tokens < quiet[2]):
                return []
        if new_computed_blocks and isinstance(new_computed_blocks, GroupHits):
            hits = new_computed_blocks.groups
        elif self.num_groups == 1:
            hits = [new_computed_blocks or []]
        else:
            assert not new_computed_blocks, "hits for several groups come from get_computed_blocks"
            hits = [[] for _ in range(self.num_groups)]
        for g in self._window_groups:
            self._release_out_of_window(g, req_id, request.num_computed_tokens)
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_blocks = cdiv(num_tokens, self.block_size)
        needed = []
        num_evictable_hits = 0
        for g in range(self.num_groups):
            blocks = self.group_req_to_blocks[g].get(req_id, ())
            needed.append(max(num_blocks - len(blocks) - len(hits[g]), 0))
            # Hit blocks with ref_cnt 0 sit in the free list: touching them uses up free blocks too.
            num_evictable_hits += sum(1 for b in hits[g] if b.ref_cnt == 0 and not b.is_null)
        if sum(needed) + num_evictable_hits > self.block_pool.get_num_free_blocks():
            return None
        new_group0: list[KVCacheBlock] = []
        for g in range(self.num_groups):
            blocks = self.group_req_to_blocks[g].setdefault(req_id, [])
            if hits[g]:
                self.block_pool.touch(b for b in hits[g] if not b.is_null)
                blocks.extend(hits[g])
                nulls = next((i for i, b in enumerate(hits[g]) if not b.is_null), len(hits[g]))
                if nulls:
                    self.group_num_skipped[g][req_id] = nulls
            new_blocks = self.block_pool.get_new_blocks(needed[g]) if needed[g] else []
            blocks.extend(new_blocks)
            if g == 0:
                new_group0 = new_blocks
            elif hits[g] or new_blocks:
                new_ids = self._new_group_block_ids.get(req_id)
                if new_ids is None:
                    new_ids = self._new_group_block_ids[req_id] = [[] for _ in range(self.num_groups - 1)]
                new_ids[g - 1].extend(b.block_id for b in hits[g])
                new_ids[g - 1].extend(b.block_id for b in new_blocks)
            if self.enable_caching:
                num_cached = self.group_num_cached_block[g].get(req_id, 0)
                num_full = min(num_tokens, request.num_tokens) // self.block_size
                if num_full > num_cached:
                    self.update_block_hashes(request)
                    start = max(num_cached, self.group_num_skipped[g].get(req_id, 0))  # never hash the null block
                    hashes = request.block_hashes if g == 0 else _SuffixedHashes(request.block_hashes,
                                                                                   self._hash_suffix[g])
                    if num_full > start:
                        self.block_pool.cache_full_blocks(blocks, hashes, start, num_full)
                    self.group_num_cached_block[g][req_id] = num_full
        self._quiet[req_id] = self._quiet_limits(req_id)
        return new_group0

    def _quiet_limits(self, req_id: str) -> tuple[int, int, int]:
        """``_quiet``'s record of the request from its blocks now (see ``__init__``)."""
        bs = self.block_size
        held = min(len(self.group_req_to_blocks[g].get(req_id, ())) for g in range(self.num_groups)) * bs
        # a block j becomes full, and is cached, once min(num_tokens, request.num_tokens) reaches (j + 1) * bs
        fills = ((min(self.group_num_cached_block[g].get(req_id, 0) for g in range(self.num_groups)) + 1) * bs
                 if self.enable_caching else 1 << 62)
        # window group g releases once _first_visible_block(num_computed) > its skipped blocks s:
        # num_computed >= (s + 1) * bs + window - 1
        releases = min(((self.group_num_skipped[g].get(req_id, 0) + 1) * bs + self.group_windows[g] - 1
                        for g in self._window_groups), default=1 << 62)
        return held, fills, releases

    def take_new_group_block_ids(self) -> dict[str, list[list[int]]]:
        """Block ids of groups 1.. allocated since the last call, per request (``[group - 1][i]``): appended to the
        runner's tables, or its whole tables for a request (re)starting this step. Empty with one group."""
        out = self._new_group_block_ids
        self._new_group_block_ids = {}
        return out

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first (so its later blocks are evicted first)."""
        rid = request.request_id
        self._quiet.pop(rid, None)
        for g in range(self.num_groups):
            blocks = self.group_req_to_blocks[g].pop(rid, None)
            self.group_num_cached_block[g].pop(rid, None)
            self.group_num_skipped[g].pop(rid, None)
            if blocks:
                self.block_pool.free_blocks(b for b in reversed(blocks) if not b.is_null)
        self._new_group_block_ids.pop(rid, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block table of the request."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_group_block_ids(self, request_id: str, group: int) -> list[int]:
        return [b.block_id for b in self.group_req_to_blocks[group].get(request_id, ())]

    # ------------------------------------------------------------------ stats
    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def num_allocated_blocks(self) -> int:
        """Distinct blocks referenced by some request (all groups)."""
        return self.block_pool.num_blocks - 1 - self.block_pool.get_num_free_blocks()

    def count_live_tokens(self, requests: Iterable[Request]) -> tuple[int, int]:
        """``(live, refs)`` over ``requests`` and all groups: ``refs`` block references (null blocks excluded) and
        ``live`` computed token positions inside them (a block shared by k requests counts k times in both)."""
        bs = self.block_size
        live = refs = 0
        for g in range(self.num_groups):
            req_to_blocks = self.group_req_to_blocks[g]
            skipped = self.group_num_skipped[g]
            for req in requests:
                blocks = req_to_blocks.get(req.request_id)
                if blocks:
                    s = skipped.get(req.request_id, 0)
                    refs += len(blocks) - s
                    live += max(min(req.num_computed_tokens, len(blocks) * bs) - s * bs, 0)
        return live, refs

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
