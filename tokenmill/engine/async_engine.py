"""AsyncEngine: the LLMEngine step loop on a background thread, one async stream per request.

Only the engine thread touches the LLMEngine: adds and aborts arrive as commands on a thread-safe
queue and are applied between steps, never during one. Outputs go back to each request's
asyncio.Queue through `loop.call_soon_threadsafe`. A stream its reader leaves early (client gone,
task cancelled) aborts its request at once, so its KV blocks go back to the pool.

A thread, not a process: torch releases the GIL inside its kernels, and docs/server.md has the
measurement of what the HTTP side costs the step loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.metrics import EngineStats
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill.engine")

StepObserver = Callable[[list[RequestOutput], EngineStats], None]


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class EngineLoopError(RuntimeError):
    """The engine loop hit an unexpected fault; the requests in flight failed, the loop lives on."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    prompt_token_ids: list[int] | None
    arrival_time: float
    stream: RequestStream
    accepted: asyncio.Future  # resolved on the loop once the engine has queued it, or refused it


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Stop:
    """Sentinel command: the loop exits once the engine holds no request."""


class RequestStream:
    """The outputs of one request, as an async iterator; `async with` aborts it if left early."""

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._engine = engine

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        # Outputs are cumulative, so a reader that fell behind needs only the newest one.
        while not self._queue.empty() and not isinstance(item, BaseException):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: StepObserver | None = None) -> None:
        self.engine = engine
        self.on_step = on_step
        self.accepting = True
        self._stats = engine.stats()
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        # Adds queued minus adds in the stats snapshot; each counter has a single writer thread.
        self._adds_submitted = 0  # event loop
        self._adds_applied = 0  # engine thread, only after the snapshot that holds them
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)

    def start(self) -> None:
        """Call from the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    # ---- the event-loop side ----------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """The snapshot taken after the engine's latest step or command."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be scheduled, counting adds the engine has not applied yet."""
        applied = self._adds_applied  # read before the snapshot, which is never older than it
        return self._stats.num_waiting + self._adds_submitted - applied

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams, cache_salt: str | None = None,
                          prompt_token_ids: list[int] | None = None) -> RequestStream:
        """Queue a request and return its stream once the engine holds it. Raises what the
        engine's add_request raised (ValueError: bad input), or EngineStoppedError."""
        if not self.accepting:
            raise EngineStoppedError("the server is shutting down")
        stream = RequestStream(request_id, self)
        accepted = asyncio.get_running_loop().create_future()
        self._adds_submitted += 1
        self._commands.put(_Add(request_id, prompt, params, cache_salt, prompt_token_ids,
                                time.time(), stream, accepted))
        try:
            await accepted
        except asyncio.CancelledError:  # the caller left before the engine took the request
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def shutdown(self, timeout: float) -> EngineStats:
        """Stop taking requests, let running ones finish for up to `timeout` seconds, abort the
        rest, stop the loop; returns the final stats (every block should be free)."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while (self._stats.num_running or self._stats.num_waiting) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        return self._stats

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not (stopping and not self.engine.has_unfinished_requests()):
            busy = self.engine.has_unfinished_requests()
            outputs, stop = self._apply_commands(block=not busy)
            stopping = stopping or stop
            if stopping:  # the shutdown grace period is over: nothing more runs
                outputs += [o for i in list(self._streams)
                            if (o := self.engine.abort_request(i)) is not None]
            if self.engine.has_unfinished_requests():
                outputs += self._step()
            self._publish(outputs)

    def _apply_commands(self, block: bool) -> tuple[list[RequestOutput], bool]:
        outputs: list[RequestOutput] = []
        added: list[tuple[_Add, Exception | None]] = []
        stop = False
        try:
            command = self._commands.get(block=block)
            while True:
                if isinstance(command, _Add):
                    added.append((command, self._add(command)))
                elif isinstance(command, _Abort):
                    output = self.engine.abort_request(command.request_id)
                    if output is not None:
                        outputs.append(output)
                else:
                    stop = True
                command = self._commands.get_nowait()
        except queue.Empty:
            pass
        if added:
            # The snapshot must count the new requests before their callers can see them
            # accepted, or a request arriving in between would pass the waiting-queue check.
            self._stats = self.engine.stats()
            self._adds_applied += len(added)
            for command, error in added:
                self._resolve(command.accepted, error)
        return outputs, stop

    def _add(self, command: _Add) -> Exception | None:
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    cache_salt=command.cache_salt,
                                    arrival_time=command.arrival_time,
                                    prompt_token_ids=command.prompt_token_ids)
        except Exception as error:  # ValueError: a bad request; anything else is ours
            return error
        self._streams[command.request_id] = command.stream
        return None

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as error:  # a bug outside the model step: fail what is in flight
            logger.exception("engine step failed; failing %d requests", len(self._streams))
            failure = EngineLoopError(f"engine error: {error}")
            for request_id, stream in self._streams.items():
                self.engine.abort_request(request_id)
                self._loop.call_soon_threadsafe(stream.put, failure)
            self._streams.clear()
            return []

    def _publish(self, outputs: list[RequestOutput]) -> None:
        # The snapshot first: a caller that sees an output must see the stats after its step.
        self._stats = self.engine.stats()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            self._loop.call_soon_threadsafe(stream.put, output)
            if output.finished:
                del self._streams[output.request_id]
        if self.on_step is not None:
            self.on_step(outputs, self._stats)

    def _resolve(self, future: asyncio.Future, error: Exception | None) -> None:
        def settle() -> None:
            if future.done():  # the caller was cancelled meanwhile
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
        self._loop.call_soon_threadsafe(settle)
