"""One measured run: a workload sent to one server after a warm-up request, with the figures over
the whole run and per group, and the server's own counters scraped before and after.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tokenmill.bench.client import LoadShape, RequestRecord, Target, run_load
from tokenmill.bench.datasets import Conversation
from tokenmill.bench.metrics import (SLO, BenchmarkMetrics, RequestTimings, compute_metrics,
                                     metrics_by_group)
from tokenmill.bench.prometheus import ServerCounters, scrape

WARM_UP_CHAT = Conversation(("warm-up",), 4, user_turns=("Say hello.",))
WARM_UP_COMPLETION = Conversation(("warm-up",), 4, prompt="Hello")


@dataclass
class BenchmarkRun:
    label: str  # the server or variant measured
    dataset: str
    max_concurrency: int | None
    request_rate: float
    num_prompts: int
    metrics: BenchmarkMetrics
    groups: dict[str, BenchmarkMetrics]
    server: ServerCounters
    stopped_by_time_bound: bool
    latencies_s: dict[str, list[float]]  # ttft, tpot, e2el of successful requests (CDF plots)
    error_examples: dict[str, str]  # one detail per failure kind

    def to_dict(self) -> dict:
        return {"label": self.label, "dataset": self.dataset,
                "max_concurrency": self.max_concurrency, "request_rate": self.request_rate,
                "num_prompts": self.num_prompts, "metrics": self.metrics.to_dict(),
                "groups": {name: m.to_dict() for name, m in self.groups.items()},
                "server": self.server.to_dict(),
                "stopped_by_time_bound": self.stopped_by_time_bound,
                "error_examples": self.error_examples, "latencies_s": self.latencies_s}


def run_benchmark(target: Target, conversations: list[Conversation], load: LoadShape, label: str,
                  dataset: str, slo: SLO | None = None, cost_per_hour: float | None = None,
                  progress: bool = True) -> BenchmarkRun:
    warm_up = WARM_UP_COMPLETION if conversations[0].prompt is not None else WARM_UP_CHAT
    asyncio.run(run_load(target, [warm_up], LoadShape(max_duration_s=load.request_timeout_s),
                         progress=False))
    before = scrape(target.base_url)
    concurrency = "inf" if load.max_concurrency is None else load.max_concurrency
    result = asyncio.run(run_load(target, conversations, load, progress,
                                  description=f"{label} {dataset} c={concurrency}"))
    after = scrape(target.base_url)
    completed = [RequestTimings.of(r) for r in result.records if r.ok]
    return BenchmarkRun(
        label=label, dataset=dataset, max_concurrency=load.max_concurrency,
        request_rate=load.request_rate, num_prompts=len(conversations),
        metrics=compute_metrics(result.records, result.duration_s, result.num_not_sent, slo,
                                cost_per_hour),
        groups=metrics_by_group(result.records, result.duration_s, slo),
        server=ServerCounters.between(before, after),
        stopped_by_time_bound=result.stopped_by_time_bound,
        latencies_s={"ttft": [t.ttft for t in completed],
                     "tpot": [t.tpot for t in completed if t.output_tokens > 1],
                     "e2el": [t.e2el for t in completed]},
        error_examples=_error_examples(result.records))


def _error_examples(records: list[RequestRecord]) -> dict[str, str]:
    examples: dict[str, str] = {}
    for record in records:
        if record.error is not None:
            examples.setdefault(record.error, record.error_detail)
    return examples

