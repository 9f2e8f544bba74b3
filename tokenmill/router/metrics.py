"""The router's Prometheus metrics (`tokenmill_router:` names): requests and retries per worker,
the policy's decisions, broken streams, and each worker's health and load."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tokenmill.router.workers import Worker

PREFIX = "tokenmill_router:"


class RouterMetrics:
    def __init__(self, policy: str, workers: list[Worker]) -> None:
        self.registry = CollectorRegistry()
        self.policy = policy
        self.requests = Counter(PREFIX + "requests", "Requests sent to each worker (retries "
                                "included).", ("worker",), registry=self.registry)
        self.retries = Counter(PREFIX + "retries", "Requests that failed on a worker before "
                               "their first byte and went to another.", ("worker",),
                               registry=self.registry)
        self.decisions = Counter(PREFIX + "policy_decisions", "Routing decisions by policy and "
                                 "kind.", ("policy", "decision"), registry=self.registry)
        self.broken_streams = Counter(PREFIX + "broken_streams", "Streams cut by a worker failure "
                                      "after their first byte; the client got an error event.",
                                      ("worker",), registry=self.registry)
        self.unroutable = Counter(PREFIX + "unroutable_requests", "Requests answered 503: no "
                                  "healthy worker left to try.", registry=self.registry)
        healthy = Gauge(PREFIX + "worker_healthy", "1 while the worker is in rotation.",
                        ("worker",), registry=self.registry)
        load = Gauge(PREFIX + "worker_load", "Requests in flight on the worker.", ("worker",),
                     registry=self.registry)
        for worker in workers:
            healthy.labels(worker.url).set_function(lambda w=worker: float(w.healthy))
            load.labels(worker.url).set_function(lambda w=worker: float(w.load))

    def routed(self, worker: Worker, decision: str) -> None:
        self.requests.labels(worker.url).inc()
        self.decisions.labels(self.policy, decision).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
