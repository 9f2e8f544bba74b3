"""Server-side counters over a run: /metrics scraped before and after, the difference reported.

Counters are matched by vLLM's names after any `prefix:` (tokenmill:, vllm:), summed over labels:
prefix-cache queries and hits (in tokens), preemptions, and speculative-decoding draft and accepted
tokens. A server without /metrics, or without one of the counters, reports None for it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = {
    "prefix_cache_queries": "prefix_cache_queries_total",
    "prefix_cache_hits": "prefix_cache_hits_total",
    "preemptions": "num_preemptions_total",
    "spec_decode_draft_tokens": "spec_decode_num_draft_tokens_total",
    "spec_decode_accepted_tokens": "spec_decode_num_accepted_tokens_total",
}


def scrape(base_url: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    """Every sample of /metrics as {name without prefix: value summed over labels}; None when
    the server has no readable /metrics."""
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
        if response.status_code != 200:
            return None
        families = list(text_string_to_metric_families(response.text))
    except (httpx.HTTPError, ValueError):
        return None
    samples: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            name = sample.name.rpartition(":")[2]
            samples[name] = samples.get(name, 0.0) + sample.value
    return samples


@dataclass(frozen=True)
class ServerCounters:
    metrics_endpoint: bool
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    preemptions: float | None = None
    spec_decode_draft_tokens: float | None = None
    spec_decode_accepted_tokens: float | None = None

    @classmethod
    def between(cls, before: dict[str, float] | None,
                after: dict[str, float] | None) -> "ServerCounters":
        if before is None or after is None:
            return cls(metrics_endpoint=False)
        deltas = {field: after[name] - before.get(name, 0.0)
                  for field, name in COUNTERS.items() if name in after}
        return cls(metrics_endpoint=True, **deltas)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def spec_decode_acceptance_rate(self) -> float | None:
        if not self.spec_decode_draft_tokens or self.spec_decode_accepted_tokens is None:
            return None
        return self.spec_decode_accepted_tokens / self.spec_decode_draft_tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
                "spec_decode_acceptance_rate": self.spec_decode_acceptance_rate}
