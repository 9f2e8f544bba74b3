"""Block pool and prefix cache: ref counts, LRU eviction, salted chained hashes, token compare."""

from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams


def make_request(tokens: list[int], salt: str | None = None, rid: str = "r") -> Request:
    return Request(rid, list(tokens), SamplingParams(), frozenset(), 10_000, cache_salt=salt)


def run_prefill(kv: KVCacheManager, request: Request) -> None:
    """What the scheduler and engine do for a whole-prompt prefill."""
    cached = kv.find_cached_prefix(request)
    num_cached = len(cached) * kv.block_size
    assert kv.allocate(request, request.num_tokens - num_cached, cached)
    request.num_computed_tokens = request.num_tokens
    kv.commit_full_blocks(request)


def test_allocate_and_free_return_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    request = make_request(list(range(10)))
    run_prefill(kv, request)
    assert len(request.block_ids) == 3 and kv.pool.num_free == 5
    kv.free(request)
    assert kv.pool.num_free == 8
    kv.check_invariants([])


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = make_request(list(range(12)), rid="a")
    run_prefill(kv, first)
    second = make_request(list(range(12)), rid="b")
    cached = kv.find_cached_prefix(second)
    # 12 tokens = 3 full blocks, but the last token must be computed: only 2 blocks may hit.
    assert [b.block_id for b in cached] == first.block_ids[:2]
    assert kv.allocate(second, 4, cached)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert kv.pool.blocks[first.block_ids[0]].ref_count == 2
    kv.check_invariants([first, second])


def test_salt_isolates_tenants_and_only_enters_first_block():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    run_prefill(kv, make_request(list(range(12)), salt="tenant-a", rid="a"))
    assert kv.find_cached_prefix(make_request(list(range(12)), salt="tenant-b")) == []
    assert kv.find_cached_prefix(make_request(list(range(12)))) == []
    assert len(kv.find_cached_prefix(make_request(list(range(12)), salt="tenant-a"))) == 2


def test_different_tokens_miss_even_with_same_prefix_length():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    run_prefill(kv, make_request([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    hit = kv.find_cached_prefix(make_request([1, 2, 3, 4, 0, 6, 7, 8, 9]))
    assert len(hit) == 1  # the chain breaks at the first differing block


def test_freed_blocks_stay_cached_until_reused_lru():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    old = make_request(list(range(9)), rid="old")
    run_prefill(kv, old)
    kv.free(old)
    # Still cached after free: a new request revives the blocks from the free list.
    again = make_request(list(range(9)), rid="again")
    cached = kv.find_cached_prefix(again)
    assert len(cached) == 2
    assert kv.allocate(again, 1, cached)
    kv.free(again)
    # Filling the whole pool with other content evicts them.
    other = make_request(list(range(100, 116)), rid="other")
    assert kv.allocate(other, 16)
    assert kv.find_cached_prefix(make_request(list(range(9)))) == []
    kv.free(other)
    kv.check_invariants([])


def test_allocate_refuses_when_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    request = make_request(list(range(12)))
    assert not kv.allocate(request, 12)
    assert request.block_ids == [] and kv.pool.num_free == 2


def test_uncomputed_tokens_are_never_indexed():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    request = make_request(list(range(12)))
    assert kv.allocate(request, 12)
    request.num_computed_tokens = 5  # only the first block is fully computed
    kv.commit_full_blocks(request)
    assert len(kv.pool.index) == 1


def test_reset_prefix_cache_forgets_every_prefix_but_not_while_blocks_are_held():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    held = make_request(list(range(12)), rid="a")
    run_prefill(kv, held)
    assert not kv.reset_prefix_cache()  # a request still holds its blocks
    assert len(kv.find_cached_prefix(make_request(list(range(12))))) == 2
    kv.free(held)
    assert kv.reset_prefix_cache()
    assert kv.find_cached_prefix(make_request(list(range(12)))) == []
    assert all(block.key is None for block in kv.pool.blocks)
    again = make_request(list(range(12)), rid="b")  # computed afresh, and cached again
    run_prefill(kv, again)
    assert len(kv.find_cached_prefix(make_request(list(range(12))))) == 2
    kv.check_invariants([again])


def test_token_ids_between_reads_across_prompt_and_output() -> None:
    request = make_request([10, 11, 12])
    request.output_token_ids += [20, 21]
    for start in range(6):
        for end in range(start, 6):
            assert request.token_ids_between(start, end) == request.all_token_ids[start:end]
