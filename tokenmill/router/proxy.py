"""Forwarding one request to a worker, with retries before the first byte and a clean end after.

Until the client has received a byte, a failure (no connection, a broken response, 502/503/504)
sends the request to another healthy worker, so a dead or overloaded worker loses nothing. A
non-streaming response is only relayed once complete, so it stays retriable to the end. Once a
stream has started, a worker failure ends it with an OpenAI-style error event and `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import Policy, least_loaded
from tokenmill.router.workers import Worker, WorkerPool
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ErrorResponse

RETRIABLE_STATUSES = frozenset({502, 503, 504})
WORKER_HEADER = "x-tokenmill-worker"  # on every relayed response: the worker that answered
FORWARDED_REQUEST_HEADERS = ("authorization", "content-type", "accept")
FORWARDED_RESPONSE_HEADERS = ("content-type", "retry-after")


def routing_text(body: dict) -> str:
    """The prompt text the policies route by: a completion's prompt(s) or the chat messages."""
    if "messages" in body:
        parts = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{message.get('role') if isinstance(message, dict) else ''}>"
                         f"{content or ''}")
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):  # several prompts, or token ids
        return "\n".join(p if isinstance(p, str) else json.dumps(p) for p in prompt)
    return str(prompt)


def error_event(message: str) -> bytes:
    error = APIError(502, message, type="internal_server_error", code="worker_failed")
    return f"data: {ErrorResponse(error=error.info).model_dump_json()}\n\ndata: [DONE]\n\n" \
        .encode()


class Proxy:
    def __init__(self, pool: WorkerPool, policy: Policy, metrics: RouterMetrics,
                 client: httpx.AsyncClient) -> None:
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.client = client

    async def forward(self, method: str, path: str, headers: dict[str, str], content: bytes,
                      route: bool) -> Response:
        """`route`: pick the worker by the policy (generation); else the least-loaded one."""
        body = _json_object(content) if route else {}
        text = routing_text(body)
        streaming = bool(body.get("stream"))
        headers = {k: v for k, v in headers.items() if k.lower() in FORWARDED_REQUEST_HEADERS}
        tried: set[str] = set()
        refused: Response | None = None  # the last retriable error a worker answered
        while candidates := [w for w in self.pool.healthy() if w.url not in tried]:
            if route:
                worker, decision = self.policy.choose(candidates, text)
            else:
                worker, decision = least_loaded(candidates), "any"
            self.metrics.routed(worker, decision)
            tried.add(worker.url)
            worker.load += 1
            response = await self._attempt(worker, method, path, headers, content, streaming)
            if response is not None and response.status_code not in RETRIABLE_STATUSES:
                return response
            refused = response or refused
            self.metrics.retries.labels(worker.url).inc()
        if refused is not None:
            return refused
        self.metrics.unroutable.inc()
        return APIError(503, "no healthy worker can take the request; retry later",
                        type="server_overloaded", code="no_healthy_worker",
                        headers={"Retry-After": "1"}).response()

    async def _attempt(self, worker: Worker, method: str, path: str, headers: dict[str, str],
                       content: bytes, streaming: bool) -> Response | None:
        """The response to relay, a retriable error response, or None when the worker failed.
        Owns one unit of `worker.load` and gives it back when the response is done."""
        request = self.client.build_request(method, worker.url + path, headers=headers,
                                            content=content)
        handed_over = False
        try:
            upstream = await self.client.send(request, stream=True)
            try:
                relayed = {k: v for k, v in upstream.headers.items()
                           if k.lower() in FORWARDED_RESPONSE_HEADERS}
                relayed[WORKER_HEADER] = worker.url
                if not streaming or upstream.status_code != 200:
                    return Response(await upstream.aread(), upstream.status_code, relayed)
                chunks = upstream.aiter_raw()
                first = await anext(chunks)
                handed_over = True
                lease = _Lease(worker, upstream)
                # The background task releases a stream whose client left before it began.
                return StreamingResponse(self._relay(lease, chunks, first), upstream.status_code,
                                         relayed, background=BackgroundTask(lease.release))
            finally:
                if not handed_over:
                    await upstream.aclose()
        except (httpx.TransportError, StopAsyncIteration) as error:
            self.pool.mark_down(worker, f"request failed before its first byte: {error!r}")
            return None
        finally:
            if not handed_over:
                worker.load -= 1

    async def _relay(self, lease: _Lease, chunks: AsyncIterator[bytes],
                     first: bytes) -> AsyncIterator[bytes]:
        last = first
        try:
            yield first
            async for last in chunks:
                yield last
        except httpx.TransportError as error:
            self.metrics.broken_streams.labels(lease.worker.url).inc()
            self.pool.mark_down(lease.worker, f"stream broken: {error!r}")
            # Close a half-sent event first, so the error is an event of its own.
            yield (b"" if last.endswith(b"\n\n") else b"\n\n") + error_event(
                f"the worker serving this request failed mid-stream: {error!r}")
        finally:
            await lease.release()


class _Lease:
    """One streamed response's hold on its worker: the upstream connection and a unit of load."""

    def __init__(self, worker: Worker, upstream: httpx.Response) -> None:
        self.worker = worker
        self.upstream = upstream
        self.released = False

    async def release(self) -> None:
        if not self.released:
            self.released = True
            self.worker.load -= 1
            await self.upstream.aclose()


def _json_object(content: bytes) -> dict:
    try:
        body = json.loads(content)
    except ValueError as error:
        raise APIError(400, f"invalid request: the body is not JSON: {error}") from error
    if not isinstance(body, dict):
        raise APIError(400, "invalid request: the body must be a JSON object")
    return body
