"""Token-budget scheduler: decides which requests advance by how many tokens each step.

There are no prefill and decode phases. Each request's `num_computed_tokens` catches up to its
token count under one per-step budget, running requests first, then waiting ones in arrival
order. That one rule gives continuous batching, chunked prefill and prefix-cache reuse. When the
pool runs dry the newest running request is preempted: its blocks are freed and it is recomputed
later from its tokens, so its output does not change. A decoding request's speculative
proposals count in the budget like any token (1 + K for the step), cut first when it runs short. A waiting request whose next prefix block
a running request is computing right now waits for it (it hits the cache a step later) instead of
computing the same tokens beside it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.config import EngineConfig
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus

# A shorter shared run (a chat template's default system prompt) costs less to recompute beside
# the request computing it than a step of waiting would.
MIN_SHARED_BLOCKS_TO_WAIT = 4


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int  # including the speculative tokens
    num_spec_tokens: int = 0  # the last ones: request.spec_token_ids, to be verified

    @property
    def completes_sequence(self) -> bool:
        """After this chunk every known token is computed, so the next token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens \
            == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Called when a request gives up its blocks (finish, abort, preemption), so state kept
        # beside them (a draft model's KV) goes too.
        self.on_release: Callable[[Request], None] | None = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_known = request.num_tokens - request.num_computed_tokens
            num_new = min(num_known + len(request.spec_token_ids), budget)
            del request.spec_token_ids[max(num_new - num_known, 0):]  # cut to the budget
            while not self.kv_cache.allocate(request, num_new):
                if request.spec_token_ids:  # speculation gives way before any request does
                    num_new -= len(request.spec_token_ids)
                    request.spec_token_ids = []
                    continue
                victim = self.running.pop()  # the newest running request gives way
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.chunks.append(ScheduledChunk(request, num_new, len(request.spec_token_ids)))
                budget -= num_new
                index += 1
                continue
            break
        # A preemption means the pool is tight: admitting new work now would only thrash.
        deferred: list[Request] = []
        while self.waiting and budget > 0 and not out.preempted \
                and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            # Prompt logprobs need every prompt position computed, so such a request never hits.
            if request.sampling_params.prompt_logprobs is not None:
                cached = []
            else:
                cached = self.kv_cache.find_cached_prefix(request)
                if self._computed_elsewhere(request, len(cached)):
                    deferred.append(self.waiting.popleft())
                    continue
            num_cached = len(cached) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv_cache.allocate(request, num_new, cached):
                break
            self.waiting.popleft()
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.time()
                request.metrics.num_cached_tokens = num_cached
            self.kv_cache.stats.record(request.num_tokens, num_cached)
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        return out

    def _computed_elsewhere(self, request: Request, index: int) -> bool:
        """A running request is computing prefix blocks `index`, `index + 1`, ... that `request`
        would compute next, for at least MIN_SHARED_BLOCKS_TO_WAIT blocks. Waiting one step for
        them turns a recompute into a cache hit."""
        if not self.kv_cache.enable_prefix_caching:
            return False
        key, bs = self.kv_cache.block_key, self.kv_cache.block_size
        for other in self.running:
            if not other.num_committed_blocks <= index < len(other.block_ids):
                continue  # it is not computing that block right now
            end = min(other.num_prompt_tokens, request.num_tokens - 1) // bs
            shared = index
            while shared < end and key(request, shared) == key(other, shared):
                shared += 1
                if shared - index >= MIN_SHARED_BLOCKS_TO_WAIT:
                    return True
        return False

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues for good and return its blocks to the pool."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def _release(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.spec_token_ids = []
        if self.on_release is not None:
            self.on_release(request)
