"""From engine streams to HTTP: merging several streams, owning them (a request whose client
left is aborted at once), waiting for final outputs while watching for a disconnect, and the
server-sent-event framing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from tokenmill.engine.async_engine import RequestStream
from tokenmill.outputs import RequestOutput
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ErrorResponse


def event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def error_event(message: str) -> str:
    error = APIError(500, message, type="internal_server_error", code="engine_error")
    return f"data: {ErrorResponse(error=error.info).model_dump_json()}\n\ndata: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A server-sent-event response that owns its engine streams for its whole life: however it
    ends (finished, failed, or the client gone, even before the first byte went out, when the
    event generator never started), every unfinished request is aborted."""

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        async with owned(self.streams):
            await super().__call__(scope, receive, send)


@contextlib.asynccontextmanager
async def owned(streams: list[RequestStream]):
    """Abort every stream not finished when the block exits (error, cancel, client gone)."""
    async with contextlib.AsyncExitStack() as stack:
        for stream in streams:
            await stack.enter_async_context(stream)
        yield


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams, in the order they arrive."""
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                output = task.result()
                yield index, output
                if not output.finished:
                    pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for task in pending:
            task.cancel()


async def final_outputs(streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
    """The finished outputs, in order; a client that disconnects first aborts them all."""
    async def collect() -> list[RequestOutput]:
        last: dict[int, RequestOutput] = {}
        async for index, output in merge(streams):
            last[index] = output
        return [last[i] for i in range(len(streams))]

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    async with owned(streams):
        work = asyncio.ensure_future(collect())
        watch = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            work.cancel()  # no-op once done
            watch.cancel()
        if work not in done:
            raise APIError(499, "the client closed the request", code="client_closed")
        outputs = work.result()  # raises what the engine loop raised
    for output in outputs:
        if output.error:
            raise APIError(500, output.error, type="internal_server_error", code="engine_error")
        if any(c.finish_reason == "abort" for c in output.outputs):
            raise APIError(503, "the request was aborted: the server is shutting down",
                           type="server_overloaded")
    return outputs

