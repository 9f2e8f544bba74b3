"""Benchmark figures from raw request records, with vllm bench serve's definitions.

- TTFT: from sending a request to its first chunk of output text.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request with more than one output token.
- ITL: every gap between two consecutive output chunks, pooled over all requests.
- E2EL: from sending a request to the end of its stream.
- Throughputs divide by the run's duration; output tokens come from the server's usage.
- Goodput: requests per second that met every SLO given (TPOT counts as 0 for one-token outputs).
- Cost per successful request: the run's time at --cost-per-hour over the requests that succeeded,
  so failed requests (and any retry) still cost.
Only successful requests enter the latency distributions; each distribution carries its count.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from tokenmill.bench.client import RequestRecord

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Distribution:
    """Summary of a latency sample, in milliseconds."""
    count: int
    mean: float
    median: float
    p90: float
    p95: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> "Distribution":
        if not seconds:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        values = np.asarray(seconds, dtype=np.float64) * 1000.0
        p50, p90, p95, p99 = np.percentile(values, PERCENTILES)  # linear, as vllm bench
        return cls(len(values), float(values.mean()), float(p50), float(p90), float(p95),
                   float(p99))


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; None leaves a metric unconstrained."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> "SLO | None":
        """'ttft=500,tpot=50,e2el=4000' (milliseconds) -> SLO."""
        if not text:
            return None
        values: dict[str, float] = {}
        for item in text.split(","):
            name, _, value = item.partition("=")
            name = name.strip().lower()
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if name not in ("ttft", "tpot", "e2el") or not number > 0:
                raise ValueError(f"invalid benchmark option slo={text!r}: expected "
                                 "ttft=MS,tpot=MS,e2el=MS with positive milliseconds")
            values[f"{name}_ms"] = number
        return cls(**values)

    def met_by(self, timings: "RequestTimings") -> bool:
        return all(limit is None or value * 1000.0 <= limit
                   for limit, value in ((self.ttft_ms, timings.ttft), (self.tpot_ms, timings.tpot),
                                        (self.e2el_ms, timings.e2el)))


@dataclass(frozen=True)
class RequestTimings:
    """One successful request's latencies in seconds."""
    ttft: float
    tpot: float  # 0 when the request produced a single token
    e2el: float
    itls: tuple[float, ...]
    output_tokens: int

    @classmethod
    def of(cls, record: RequestRecord) -> "RequestTimings":
        assert record.finished is not None and record.chunk_times
        ttft = record.chunk_times[0] - record.sent
        e2el = record.finished - record.sent
        tokens = record.output_tokens
        tpot = (e2el - ttft) / (tokens - 1) if tokens > 1 else 0.0
        itls = tuple(b - a for a, b in zip(record.chunk_times, record.chunk_times[1:]))
        return cls(ttft, tpot, e2el, itls, tokens)


@dataclass(frozen=True)
class BenchmarkMetrics:
    num_requests: int  # sent
    num_completed: int
    num_failed: int
    num_not_sent: int
    errors: dict[str, int]  # failure kind -> count
    duration_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    request_throughput: float  # successful requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    ttft_ms: Distribution
    tpot_ms: Distribution  # over requests with more than one output token
    itl_ms: Distribution
    e2el_ms: Distribution
    usage_reported: bool  # False: some output counts are chunk counts (no usage from the server)
    goodput: float | None = None  # requests / s meeting every SLO
    slo: SLO | None = None
    cost_per_hour: float | None = None
    cost_per_request: float | None = None  # over successful requests

    def to_dict(self) -> dict:
        return asdict(self)


def compute_metrics(records: list[RequestRecord], duration_s: float, num_not_sent: int = 0,
                    slo: SLO | None = None,
                    cost_per_hour: float | None = None) -> BenchmarkMetrics:
    completed = [r for r in records if r.ok]
    timings = [RequestTimings.of(r) for r in completed]
    duration = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_tokens for r in completed)
    output_tokens = sum(r.output_tokens for r in completed)
    goodput = sum(slo.met_by(t) for t in timings) / duration if slo else None
    cost_per_request = None
    if cost_per_hour is not None:
        cost = cost_per_hour * duration_s / 3600.0
        cost_per_request = cost / len(completed) if completed else math.inf
    return BenchmarkMetrics(
        num_requests=len(records), num_completed=len(completed),
        num_failed=len(records) - len(completed), num_not_sent=num_not_sent,
        errors=dict(Counter(r.error for r in records if r.error is not None)),
        duration_s=duration_s, input_tokens=input_tokens, output_tokens=output_tokens,
        cached_tokens=sum(r.cached_tokens for r in completed),
        request_throughput=len(completed) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft_ms=Distribution.of([t.ttft for t in timings]),
        tpot_ms=Distribution.of([t.tpot for t in timings if t.output_tokens > 1]),
        itl_ms=Distribution.of([gap for t in timings for gap in t.itls]),
        e2el_ms=Distribution.of([t.e2el for t in timings]),
        usage_reported=all(r.usage_reported for r in completed),
        goodput=goodput, slo=slo, cost_per_hour=cost_per_hour,
        cost_per_request=cost_per_request)


def metrics_by_group(records: list[RequestRecord], duration_s: float,
                     slo: SLO | None = None) -> dict[str, BenchmarkMetrics]:
    """The same figures per reporting group (throughputs still over the whole run's duration)."""
    groups = sorted({r.group for r in records})
    return {group: compute_metrics([r for r in records if r.group == group], duration_s,
                                   slo=slo)
            for group in groups} if len(groups) > 1 else {}
