"""The load generator: sends a workload's conversations to an OpenAI-compatible server as streaming
requests, on an arrival schedule, under a concurrency cap and a time bound.

It records raw timestamps and usage per request; metrics.py turns them into figures. A failed
request never raises: it is recorded with the kind of its failure, and the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import httpx
from tqdm.auto import tqdm

from tokenmill.bench.arrivals import arrival_times
from tokenmill.bench.datasets import Conversation

TIME_BOUND = "time bound"  # the error kind of a request cut off by the run's time bound


@dataclass(frozen=True)
class Target:
    """A server to measure, and what every request body carries besides the workload."""
    base_url: str
    model: str
    api_key: str | None = None
    # Sent with every request; ignore_eos makes output lengths equal across engines.
    extra_body: dict = field(default_factory=lambda: {"ignore_eos": True, "temperature": 0.0})


@dataclass(frozen=True)
class LoadShape:
    request_rate: float = math.inf  # conversations per second; inf: all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1 is Poisson
    max_concurrency: int | None = None  # conversations in flight at once
    max_duration_s: float = 600.0  # the run stops by itself after this
    request_timeout_s: float = 300.0
    seed: int = 0


@dataclass
class RequestRecord:
    """One request's raw timings (time.perf_counter seconds) and usage."""
    group: str
    sent: float
    chunk_times: list[float] = field(default_factory=list)  # each chunk that carried output text
    finished: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    usage_reported: bool = False  # False: output_tokens counts chunks, the server sent no usage
    error: str | None = None  # the failure's kind, e.g. "HTTP 500", "timeout", "time bound"
    error_detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration_s: float
    num_not_sent: int  # requests never sent: the time bound came first, or an earlier turn failed
    stopped_by_time_bound: bool


def request_body(target: Target, conversation: Conversation, turn: int,
                 answers: list[str]) -> tuple[str, dict]:
    """The endpoint and JSON body of a conversation's `turn`-th request."""
    body = {"model": target.model, "max_tokens": conversation.output_len, "stream": True,
            "stream_options": {"include_usage": True}, **target.extra_body}
    if conversation.prompt is not None:
        prompt = conversation.prompt
        return "/v1/completions", {**body, "prompt": list(prompt) if isinstance(prompt, tuple)
                                   else prompt}
    messages = [{"role": "system", "content": conversation.system_prompt}] \
        if conversation.system_prompt else []
    for question, answer in zip(conversation.user_turns[:turn], answers):
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": conversation.user_turns[turn]})
    return "/v1/chat/completions", {**body, "messages": messages}


async def send_request(http: httpx.AsyncClient, target: Target, conversation: Conversation,
                       turn: int, answers: list[str], record: RequestRecord) -> str:
    """Streams one request into `record`; returns the answer text (for the next turn)."""
    path, body = request_body(target, conversation, turn, answers)
    text: list[str] = []
    try:
        await _stream(http, target.base_url.rstrip("/") + path, body, record, text)
    except asyncio.CancelledError:
        record.error = TIME_BOUND
        raise
    except httpx.TimeoutException as error:
        record.error, record.error_detail = "timeout", repr(error)
    except httpx.ConnectError as error:
        record.error, record.error_detail = "connect error", repr(error)
    except httpx.HTTPError as error:  # the connection broke mid-stream, a protocol error, ...
        record.error, record.error_detail = type(error).__name__, repr(error)
    except json.JSONDecodeError as error:
        record.error, record.error_detail = "bad stream data", repr(error)
    finally:
        record.finished = time.perf_counter()
    if record.ok and not record.usage_reported:
        record.output_tokens = len(record.chunk_times)
    if record.ok and not record.chunk_times:
        record.error = "empty response"
    return "".join(text)


async def _stream(http: httpx.AsyncClient, url: str, body: dict, record: RequestRecord,
                  text: list[str]) -> None:
    async with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}"
            record.error_detail = (await response.aread()).decode(errors="replace")[:300]
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if chunk.get("error"):
                record.error, record.error_detail = "stream error", str(chunk["error"])[:300]
                return
            piece = "".join(_choice_text(choice) for choice in chunk.get("choices") or [])
            if piece:
                record.chunk_times.append(time.perf_counter())
                text.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
                record.usage_reported = True
                record.output_tokens = usage.get("completion_tokens") or 0
                record.prompt_tokens = usage.get("prompt_tokens") or 0
                details = usage.get("prompt_tokens_details") or {}
                record.cached_tokens = details.get("cached_tokens") or 0


def _choice_text(choice: dict) -> str:
    delta = choice.get("delta")
    return (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")


async def run_load(target: Target, conversations: list[Conversation], load: LoadShape,
                   progress: bool = True, description: str = "bench") -> LoadResult:
    """Runs the workload to the end, or to the time bound, whichever comes first."""
    if load.max_concurrency is not None and load.max_concurrency < 1:
        raise ValueError(f"invalid benchmark option max_concurrency={load.max_concurrency!r}: "
                         "must be >= 1")
    starts = arrival_times(len(conversations), load.request_rate, load.burstiness, load.seed)
    seats = asyncio.Semaphore(load.max_concurrency or len(conversations))
    records: list[RequestRecord] = []
    total = sum(c.num_requests for c in conversations)
    bar = tqdm(total=total, desc=description, unit="req", disable=not progress, leave=False)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    timeout = httpx.Timeout(load.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, headers=headers,
                                 limits=httpx.Limits(max_connections=None)) as http:
        start = time.perf_counter()

        async def converse(conversation: Conversation, offset: float) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with seats:
                answers: list[str] = []
                for turn in range(conversation.num_requests):
                    record = RequestRecord(conversation.groups[turn], time.perf_counter())
                    records.append(record)
                    answers.append(await send_request(http, target, conversation, turn,
                                                      answers, record))
                    bar.update(1)
                    if not record.ok:
                        return  # later turns need this answer; they count as not sent

        tasks = [asyncio.create_task(converse(c, s)) for c, s in zip(conversations, starts)]
        _, pending = await asyncio.wait(tasks, timeout=load.max_duration_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    bar.close()
    return LoadResult(records, duration, total - len(records), bool(pending))
