"""Request: one sequence's tokens, progress, KV blocks, status and timings.

`num_computed_tokens` is the one number the scheduler moves: it catches up to `num_tokens`, in
chunks or one decode token at a time, and drops to 0 on preemption. A request owns its block
table; only the KV cache manager changes it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    num_preemptions: int = 0


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_total_tokens: int  # prompt + output may not pass this (max_model_len)
    cache_salt: str | None = None
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # One entry per prompt token when sampling_params.prompt_logprobs is set; the first is None.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # digests of the full blocks so far
    num_committed_blocks: int = 0  # leading blocks already offered to the prefix cache
    # Proposed by speculative decoding for the next step; unverified, so never in the tokens.
    spec_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None
    generator: torch.Generator | None = None  # per-request RNG for seeded sampling
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_output_tokens(self) -> int:
        room = self.max_total_tokens - self.num_prompt_tokens
        limit = self.sampling_params.max_tokens
        return room if limit is None else min(limit, room)

    @property
    def finished(self) -> bool:
        return self.status.finished

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without joining the whole lists (a decode step takes one
        token of each sequence)."""
        prompt = self.num_prompt_tokens
        if start >= prompt:
            return self.output_token_ids[start - prompt:end - prompt]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - prompt)]

    def token_at(self, index: int) -> int:
        if index < self.num_prompt_tokens:
            return self.prompt_token_ids[index]
        return self.output_token_ids[index - self.num_prompt_tokens]
