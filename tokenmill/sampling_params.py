"""SamplingParams: how one request picks its tokens and when it stops.

Validated once at construction, so the engine never sees a bad value; every error names the
parameter, the value and the allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field


OUTPUT_KINDS = ("cumulative", "final_only")


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as in vLLM) means no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # logprob of the chosen token plus this many top alternatives
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # vLLM's RequestOutputKind: "cumulative", an output every step (streaming), or "final_only",
    # one when the request finishes (LLM.generate's: building the others cost 0.5 ms of a
    # 64-sequence step, more as outputs grow).
    output_kind: str = "cumulative"
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        if self.top_k == -1:
            self.top_k = 0
        _check(self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (0 or -1 disables it)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(self.n >= 1, "n", self.n, "must be >= 1")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs,
               "must be between 0 and 20")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
               "prompt_logprobs", self.prompt_logprobs, "must be between 0 and 20")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        stops = tuple(self.stop or ())
        _check(all(isinstance(s, str) and s for s in stops), "stop", self.stop,
               "must be non-empty strings")
        self.stop_strings = stops
        ids = self.stop_token_ids or []
        _check(all(isinstance(t, int) and t >= 0 for t in ids), "stop_token_ids",
               self.stop_token_ids, "must be non-negative integers")
        _check(self.output_kind in OUTPUT_KINDS, "output_kind", self.output_kind,
               f"must be one of {', '.join(OUTPUT_KINDS)}")
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", self.seed, "must be an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling parameter {name}={value!r}: {rule}")
