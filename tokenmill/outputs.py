"""What the engine hands back: RequestOutput with one CompletionOutput per sample (vLLM's shape).

Outputs are cumulative: each carries the whole text and token list so far, so a streaming caller
derives its delta from the lengths it already sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutputMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int
    num_preemptions: int


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestOutputMetrics
    error: str | None = None
    num_cached_tokens: int = field(default=0)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token, first None
