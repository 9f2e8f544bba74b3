"""Prometheus export of engine and request metrics, and the periodic one-line stats log.

Names follow vLLM's with the `tokenmill:` prefix, so existing dashboards need only a rename. The
engine thread feeds `observe_step` after every step; counters move by the deltas of the engine's
running totals. This module reads outputs and stats; it never touches the engine.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.engine.metrics import EngineStats
from tokenmill.spec.stats import SpecDecodeStats
from tokenmill.outputs import RequestOutput

logger = logging.getLogger("tokenmill.server")

PREFIX = "tokenmill:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0)
TOKEN_GAP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                     2.5, 5.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def metric(kind, name: str, doc: str, labels: tuple[str, ...] = (), **kwargs):
            return kind(PREFIX + name, doc, ("model_name", *labels), registry=self.registry,
                        **kwargs)

        self.ttft = metric(Histogram, "time_to_first_token_seconds",
                           "Time from arrival to the first output token.",
                           buckets=LATENCY_BUCKETS).labels(model_name)
        self.itl = metric(Histogram, "inter_token_latency_seconds",
                          "Time between two output tokens of one request.",
                          buckets=TOKEN_GAP_BUCKETS).labels(model_name)
        self.e2e = metric(Histogram, "e2e_request_latency_seconds",
                          "Time from arrival to the end of the request.",
                          buckets=LATENCY_BUCKETS).labels(model_name)
        self.queue_time = metric(Histogram, "request_queue_time_seconds",
                                 "Time from arrival to the first schedule.",
                                 buckets=LATENCY_BUCKETS).labels(model_name)
        self.prompt_tokens = metric(Counter, "prompt_tokens",
                                    "Prompt tokens computed (prefix-cache hits excluded).")
        self.generation_tokens = metric(Counter, "generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = metric(Counter, "prefix_cache_queries",
                                           "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = metric(Counter, "prefix_cache_hits",
                                        "Prompt tokens found in the prefix cache.")
        self.preemptions = metric(Counter, "num_preemptions", "Requests preempted.")
        self.request_success = metric(Counter, "request_success",
                                      "Finished requests by finish reason.", ("finished_reason",))
        # Counters are exported from the start at 0, as vLLM's are, so a scrape before any
        # preemption (a benchmark's "before") already shows them.
        for counter in (self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries,
                        self.prefix_cache_hits, self.preemptions):
            counter.labels(model_name)
        self.running = metric(Gauge, "num_requests_running",
                              "Requests in the running batch.").labels(model_name)
        self.waiting = metric(Gauge, "num_requests_waiting",
                              "Requests waiting for a first schedule.").labels(model_name)
        self.kv_usage = metric(Gauge, "kv_cache_usage_perc",
                               "Fraction of KV blocks in use (1 = full).").labels(model_name)
        self.spec_drafts = metric(Counter, "spec_decode_num_drafts",
                                  "Request-steps that carried speculative proposals.")
        self.spec_draft_tokens = metric(Counter, "spec_decode_num_draft_tokens",
                                        "Speculative tokens proposed.")
        self.spec_accepted_tokens = metric(Counter, "spec_decode_num_accepted_tokens",
                                           "Speculative tokens accepted by the target model.")
        self.spec_accepted_per_pos = metric(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                            "Speculative tokens accepted, by proposal position.",
                                            ("position",))
        self.spec_num_tokens = metric(Gauge, "spec_decode_num_speculative_tokens",
                                      "Proposals per request that load and acceptance allow "
                                      "now.").labels(model_name)
        self.stats: EngineStats | None = None
        self._last_token_time: dict[str, float] = {}  # engine thread only
        self._logged: tuple[float, EngineStats] | None = None

    def observe_step(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """Called on the engine thread after each step or applied command."""
        for output in outputs:
            self._observe_request(output)
        previous = self.stats
        for counter, attribute in ((self.prompt_tokens, "prompt_tokens_total"),
                                   (self.generation_tokens, "generation_tokens_total"),
                                   (self.prefix_cache_queries, "prefix_cache_queries"),
                                   (self.prefix_cache_hits, "prefix_cache_hits"),
                                   (self.preemptions, "num_preemptions")):
            delta = getattr(stats, attribute) - (getattr(previous, attribute) if previous else 0)
            if delta:
                counter.labels(self.model_name).inc(delta)
        if stats.spec_decode is not None:
            self._observe_spec_decode(stats.spec_decode, previous.spec_decode if previous else None)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.stats = stats

    def _observe_spec_decode(self, spec: SpecDecodeStats,
                             previous: SpecDecodeStats | None) -> None:
        for counter, attribute in ((self.spec_drafts, "num_drafts"),
                                   (self.spec_draft_tokens, "num_draft_tokens"),
                                   (self.spec_accepted_tokens, "num_accepted_tokens")):
            delta = getattr(spec, attribute) - (getattr(previous, attribute) if previous else 0)
            if delta:
                counter.labels(self.model_name).inc(delta)
        for position, accepted in enumerate(spec.num_accepted_tokens_per_pos):
            delta = accepted - (previous.num_accepted_tokens_per_pos[position] if previous else 0)
            self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(delta)
        self.spec_num_tokens.set(spec.current_num_speculative_tokens)

    def _observe_request(self, output: RequestOutput) -> None:
        m = output.metrics
        previous = self._last_token_time.get(output.request_id)
        if m.last_token_time is not None and m.last_token_time != previous:
            if previous is None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
            else:
                self.itl.observe(m.last_token_time - previous)
            self._last_token_time[output.request_id] = m.last_token_time
        if not output.finished:
            return
        self._last_token_time.pop(output.request_id, None)
        self.e2e.observe((m.finished_time or time.time()) - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        reason = "error" if output.error else output.outputs[0].finish_reason
        self.request_success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def log_line(self) -> str | None:
        """Throughput since the previous line, load, KV use and prefix hit rate; None when the
        engine stayed idle since then."""
        stats, now = self.stats, time.monotonic()
        if stats is None:
            return None
        last_time, last = self._logged or (now, stats)
        self._logged = (now, stats)
        generated = stats.generation_tokens_total - last.generation_tokens_total
        prompt = stats.prompt_tokens_total - last.prompt_tokens_total
        if not (generated or prompt or stats.num_running or stats.num_waiting):
            return None
        elapsed = max(now - last_time, 1e-9)
        line = (f"prompt {prompt / elapsed:.1f} tok/s, generation {generated / elapsed:.1f} tok/s,"
                f" running {stats.num_running}, waiting {stats.num_waiting}, "
                f"KV cache {stats.kv_cache_usage:.1%}, prefix cache hit rate "
                f"{stats.prefix_hit_rate:.1%}")
        if stats.spec_decode is not None:
            line += ", " + spec_decode_summary(stats.spec_decode, last.spec_decode)
        return line


def spec_decode_summary(spec: SpecDecodeStats, last: SpecDecodeStats | None) -> str:
    """Acceptance since `last` (a snapshot of the same counters), as vLLM logs it."""
    drafts = spec.num_drafts - (last.num_drafts if last else 0)
    drafted = spec.num_draft_tokens - (last.num_draft_tokens if last else 0)
    accepted = spec.num_accepted_tokens - (last.num_accepted_tokens if last else 0)
    per_pos = []
    for position, (a, d) in enumerate(zip(spec.num_accepted_tokens_per_pos,
                                           spec.num_draft_tokens_per_pos)):
        if last:
            a -= last.num_accepted_tokens_per_pos[position]
            d -= last.num_draft_tokens_per_pos[position]
        per_pos.append(f"{a / d:.2f}" if d else "-")
    return (f"spec decode: {drafted} drafted, acceptance {accepted / drafted if drafted else 0:.1%}"
            f", mean accepted length {1 + accepted / drafts if drafts else 0:.2f}, per position "
            f"{' '.join(per_pos)}, proposing {spec.current_num_speculative_tokens}")
