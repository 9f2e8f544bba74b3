"""The router's FastAPI app: the OpenAI routes forwarded through the Proxy, `/health` (200 while
a worker is in rotation), `/metrics`, and the health-check loop in the lifespan."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

import tokenmill
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import make_policy
from tokenmill.router.proxy import Proxy
from tokenmill.router.settings import RouterSettings
from tokenmill.router.workers import Worker, WorkerPool
from tokenmill.server.errors import install_error_handlers

# Generation routes go through the policy; the others to any healthy worker.
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
FORWARDED_POSTS = ("/tokenize", "/detokenize")
FORWARDED_GETS = ("/v1/models", "/version")


def build_router_app(settings: RouterSettings) -> FastAPI:
    policy = make_policy(settings.policy, settings.policy_settings)
    workers = [Worker.parse(spec) for spec in settings.workers]
    pool = WorkerPool(workers, on_change=policy.forget)
    metrics = RouterMetrics(settings.policy, workers)
    timeout = httpx.Timeout(settings.request_timeout, connect=5.0)
    # No connection limit: the engines, not the router, decide how much they take.
    client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None,
                                                                   max_keepalive_connections=64))
    proxy = Proxy(pool, policy, metrics, client)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await pool.check(client)
        watcher = asyncio.create_task(pool.watch(client, settings.health_check_interval))
        yield
        watcher.cancel()
        await client.aclose()

    app = FastAPI(title="tokenmill router", version=tokenmill.__version__, lifespan=lifespan)
    install_error_handlers(app)

    def forward(method: str, path: str, route: bool):
        async def endpoint(request: Request) -> Response:
            return await proxy.forward(method, path, dict(request.headers), await request.body(),
                                       route)
        return endpoint

    for path in ROUTED_PATHS:
        app.add_api_route(path, forward("POST", path, route=True), methods=["POST"])
    for path in FORWARDED_POSTS:
        app.add_api_route(path, forward("POST", path, route=False), methods=["POST"])
    for path in FORWARDED_GETS:
        app.add_api_route(path, forward("GET", path, route=False), methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if pool.healthy() else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.state.pool = pool
    app.state.policy = policy
    return app
