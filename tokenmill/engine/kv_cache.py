"""KV block accounting: the block pool, the prefix cache and each request's block table.

`BlockPool` owns every block: reference counts, an LRU free list, and the index of full blocks by
content. `KVCacheManager` turns requests into block operations. Neither touches tensor memory:
the K/V tensors live in the model runner and are addressed by the block ids handed out here.

Prefix hashing: a full block's digest is sha256(parent digest, tenant salt on the first block
only, its tokens). The index key is (digest, tokens), so a lookup also compares the tokens and a
hash collision can never return another prompt's K/V.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.engine.request import Request

BlockKey = tuple[bytes, tuple[int, ...]]


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None  # set while the block is in the prefix index


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Oldest-freed first: allocation evicts the least recently used cached block.
        self.free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.index: dict[BlockKey, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[KVBlock]:
        assert count <= len(self.free), "caller must check num_free first"
        taken = []
        for _ in range(count):
            _, block = self.free.popitem(last=False)
            if block.key is not None:  # evict its prefix-cache entry
                del self.index[block.key]
                block.key = None
            block.ref_count = 1
            taken.append(block)
        return taken

    def lookup(self, key: BlockKey) -> KVBlock | None:
        return self.index.get(key)

    def acquire(self, block: KVBlock) -> None:
        """Take a reference to a cached block, reviving it from the free list if needed."""
        if block.ref_count == 0:
            del self.free[block.block_id]
        block.ref_count += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop references; pass a table tail first so its prefix stays cached the longest."""
        for block in blocks:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} released twice"
            if block.ref_count == 0:
                self.free[block.block_id] = block

    def forget_cached(self) -> bool:
        """Empty the prefix index; False, forgetting nothing, while any block is in use, as vLLM's
        reset: the running requests would go on indexing their blocks, so the cache would not
        start empty."""
        if len(self.free) != len(self.blocks):
            return False
        for block in self.index.values():
            block.key = None
        self.index.clear()
        return True

    def register(self, block: KVBlock, key: BlockKey) -> None:
        # Two requests may compute the same content at once; the first copy stays indexed.
        if block.key is None and key not in self.index:
            block.key = key
            self.index[key] = block


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached

    def record(self, num_queried: int, num_hit: int) -> None:
        self.queries += num_queried
        self.hits += num_hit


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Leading full blocks of the request already cached; at least one token stays to compute."""
        if not self.enable_prefix_caching:
            return []
        found = []
        max_blocks = (request.num_tokens - 1) // self.block_size
        for index in range(max_blocks):
            block = self.pool.lookup(self.block_key(request, index))
            if block is None:
                break
            found.append(block)
        return found

    def allocate(self, request: Request, num_new_tokens: int,
                 cached_prefix: list[KVBlock] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens; False if the pool is short."""
        revived = sum(1 for b in cached_prefix if b.ref_count == 0)
        num_tokens = request.num_computed_tokens + len(cached_prefix) * self.block_size \
            + num_new_tokens
        needed = -(-num_tokens // self.block_size) - len(request.block_ids) - len(cached_prefix)
        if needed + revived > self.pool.num_free:
            return False
        for block in cached_prefix:
            self.pool.acquire(block)
        request.block_ids.extend(b.block_id for b in cached_prefix)
        request.num_committed_blocks += len(cached_prefix)
        request.block_ids.extend(b.block_id for b in self.pool.allocate(max(needed, 0)))
        return True

    def reset_prefix_cache(self) -> bool:
        return self.pool.forget_cached()

    def commit_full_blocks(self, request: Request) -> None:
        """Index the request's newly completed blocks; only computed tokens are ever indexed."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        for index in range(request.num_committed_blocks, num_full):
            block = self.pool.blocks[request.block_ids[index]]
            self.pool.register(block, self.block_key(request, index))
        request.num_committed_blocks = max(request.num_committed_blocks, num_full)

    def trim(self, request: Request) -> None:
        """Release the blocks past the computed tokens: those of rejected speculative tokens."""
        keep = -(-request.num_computed_tokens // self.block_size)
        tail = request.block_ids[keep:]
        self.pool.release([self.pool.blocks[i] for i in reversed(tail)])
        del request.block_ids[keep:]

    def free(self, request: Request) -> None:
        self.pool.release([self.pool.blocks[i] for i in reversed(request.block_ids)])
        request.block_ids = []
        request.num_committed_blocks = 0

    def block_key(self, request: Request, index: int) -> BlockKey:
        start = index * self.block_size
        tokens = tuple(request.token_at(i) for i in range(start, start + self.block_size))
        hashes = request.block_hashes
        while len(hashes) <= index:  # digests depend only on content, so they outlive preemption
            i = len(hashes)
            parent = hashes[i - 1] if i else (request.cache_salt or "").encode()
            chunk = array("q", (request.token_at(t) for t in range(
                i * self.block_size, (i + 1) * self.block_size)))
            hashes.append(hashlib.sha256(parent + chunk.tobytes()).digest())
        return hashes[index], tokens

    def check_invariants(self, live_requests: list[Request]) -> None:
        """Every block is free or owned, and reference counts match the owners (debug check)."""
        owners: dict[int, int] = {}
        for request in live_requests:
            for block_id in request.block_ids:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_count == owners.get(block.block_id, 0), \
                f"block {block.block_id}: ref_count {block.ref_count} != owners"
            assert (block.ref_count == 0) == (block.block_id in self.pool.free), \
                f"block {block.block_id} is neither free nor owned"
