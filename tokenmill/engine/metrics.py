"""Engine-wide statistics: a snapshot the engine fills each step, read by the API and exporters."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.spec.stats import SpecDecodeStats


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int
    prompt_tokens_total: int  # prompt tokens computed (cache hits excluded)
    generation_tokens_total: int
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding on

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries \
            else 0.0
