"""The router's workers (engine replicas): address, long-context tag, health and load.

A worker leaves rotation the moment a request to it fails to connect or a health check fails,
and comes back when `/health` answers 200 again. Load is the number of requests the router has
in flight on it, the measure SGLang's router balances by too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import httpx

logger = logging.getLogger("tokenmill.router")

LONG_TAG = "long"
HEALTH_TIMEOUT_S = 2.0


@dataclass(eq=False)
class Worker:
    url: str
    long_context: bool = False  # tagged `URL#long`: takes the long prompts under prompt_length
    healthy: bool = True
    load: int = 0  # requests in flight through this router

    @classmethod
    def parse(cls, spec: str) -> "Worker":
        url, _, tag = spec.partition("#")
        if not url.startswith(("http://", "https://")) or tag not in ("", LONG_TAG):
            raise ValueError(f"invalid router option worker={spec!r}: must be http(s)://host:port"
                             f", optionally followed by #{LONG_TAG}")
        return cls(url.rstrip("/"), long_context=tag == LONG_TAG)


class WorkerPool:
    def __init__(self, workers: list[Worker],
                 on_change: Callable[[Worker], None] = lambda worker: None) -> None:
        """`on_change` hears of every worker that goes down or comes back."""
        if not workers:
            raise ValueError("invalid router option worker: give at least one --worker URL")
        urls = [w.url for w in workers]
        if len(set(urls)) != len(urls):
            raise ValueError(f"invalid router option worker: {urls} lists a worker twice")
        self.workers = workers
        self.on_change = on_change

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]

    def mark_down(self, worker: Worker, reason: str) -> None:
        if worker.healthy:
            logger.warning("worker %s out of rotation: %s", worker.url, reason)
            worker.healthy = False
            self.on_change(worker)

    def mark_up(self, worker: Worker) -> None:
        if not worker.healthy:
            logger.info("worker %s healthy again, back in rotation", worker.url)
            worker.healthy = True
            self.on_change(worker)

    async def check(self, client: httpx.AsyncClient) -> None:
        async def one(worker: Worker) -> None:
            try:
                response = await client.get(f"{worker.url}/health", timeout=HEALTH_TIMEOUT_S)
                ok, reason = response.status_code == 200, f"/health {response.status_code}"
            except httpx.HTTPError as error:
                ok, reason = False, f"/health failed: {error!r}"
            if ok:
                self.mark_up(worker)
            else:
                self.mark_down(worker, reason)
        await asyncio.gather(*(one(w) for w in self.workers))

    async def watch(self, client: httpx.AsyncClient, interval: float) -> None:
        while True:
            await self.check(client)
            await asyncio.sleep(interval)
