"""AsyncEngine on the real SmolLM2 weights: streams, aborts, faults and shutdown.

Every test ends with every KV block back in the pool.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.waiting import eventually
from tokenmill import SamplingParams
from tokenmill.engine.async_engine import AsyncEngine, EngineLoopError, EngineStoppedError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def engine(make_llm):
    return make_llm(num_kv_blocks=256).engine


async def collect(async_engine: AsyncEngine, request_id: str, prompt: str,
                  params: SamplingParams = GREEDY):
    outputs = []
    async with await async_engine.add_request(request_id, prompt, params) as stream:
        async for output in stream:
            outputs.append(output)
    return outputs


async def wait_idle(async_engine: AsyncEngine) -> None:
    def idle() -> bool:
        stats = async_engine.stats
        return not (stats.num_running or stats.num_waiting or stats.num_kv_blocks_used)

    await eventually(idle, "the engine to go idle")


def test_concurrent_streams_match_offline_generation(engine, make_llm):
    prompts = ["The capital of France is", "Once upon a time", "def add(a, b):"]
    reference = [o.outputs[0].token_ids
                 for o in make_llm(num_kv_blocks=256).generate(prompts, GREEDY, use_tqdm=False)]
    seen_steps = []

    async def main():
        async_engine = AsyncEngine(engine, on_step=lambda outputs, stats: seen_steps.append(
            stats.num_running))
        async_engine.start()
        results = await asyncio.gather(*(collect(async_engine, f"r{i}", p)
                                         for i, p in enumerate(prompts)))
        await async_engine.shutdown(timeout=1.0)
        return results

    results = asyncio.run(main())
    for outputs, tokens in zip(results, reference):
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == tokens
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(lengths)  # cumulative outputs
    assert max(seen_steps) == 3  # the three requests ran in one batch
    assert engine.stats().num_kv_blocks_used == 0


def test_leaving_a_stream_or_cancelling_aborts_at_once(engine):
    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        async with await async_engine.add_request("left", "Tell me a story", LONG) as stream:
            async for output in stream:
                if len(output.outputs[0].token_ids) >= 3:
                    break
        reader = asyncio.create_task(collect(async_engine, "cancelled", "Hello", LONG))
        await eventually(lambda: async_engine.stats.num_running >= 1, "the request to run")
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await wait_idle(async_engine)
        stats = await async_engine.shutdown(timeout=0.0)
        return stats

    stats = asyncio.run(main())
    assert stats.num_kv_blocks_used == 0 and not engine.has_unfinished_requests()


def test_a_model_fault_fails_only_its_request(engine):
    poison = engine.tokenize(" zebra")[0]
    execute = engine.runner.execute

    def faulty_execute(scheduled):
        if any(poison in c.request.prompt_token_ids for c in scheduled.chunks):
            raise RuntimeError("simulated kernel fault")
        return execute(scheduled)

    engine.runner.execute = faulty_execute

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        failed = await collect(async_engine, "bad", "A zebra")
        served = await collect(async_engine, "good", "The capital of France is")
        await async_engine.shutdown(timeout=1.0)
        return failed, served

    failed, served = asyncio.run(main())
    assert failed[-1].error and "simulated kernel fault" in failed[-1].error
    assert failed[-1].outputs[0].finish_reason == "error"
    assert served[-1].error is None and len(served[-1].outputs[0].token_ids) == 12
    assert engine.stats().num_kv_blocks_used == 0


def test_an_unexpected_step_fault_fails_the_streams_and_the_loop_lives(engine):
    step = engine.step
    calls = []

    def step_failing_once():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("scheduler bug")
        return step()

    engine.step = step_failing_once

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        with pytest.raises(EngineLoopError, match="scheduler bug"):
            await collect(async_engine, "hit", "Hello there")
        served = await collect(async_engine, "after", "Hello there")
        await async_engine.shutdown(timeout=1.0)
        return served

    served = asyncio.run(main())
    assert served[-1].finished and served[-1].error is None
    assert engine.stats().num_kv_blocks_used == 0


def test_bad_input_is_refused_before_streaming(engine):
    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        with pytest.raises(ValueError, match="prompt is empty"):
            await async_engine.add_request("empty", "", GREEDY)
        await async_engine.shutdown(timeout=1.0)

    asyncio.run(main())


def test_shutdown_finishes_short_requests_and_aborts_the_rest(engine):
    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        short = await async_engine.add_request("short", "Hi", SHORT)
        long = await async_engine.add_request("long", "Tell me a story", LONG)
        stats = await async_engine.shutdown(timeout=6.0)
        with pytest.raises(EngineStoppedError):
            await async_engine.add_request("late", "Hi", GREEDY)
        return [o async for o in short][-1], [o async for o in long][-1], stats

    short, long, stats = asyncio.run(main())
    assert short.outputs[0].finish_reason == "length"
    assert long.outputs[0].finish_reason == "abort"
    assert stats.num_kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def test_a_stream_whose_client_left_before_the_first_byte_is_aborted(engine):
    """The SSE response owns its requests: a client gone before the event generator ever ran
    (the ASGI server reports the disconnect at once) still aborts them."""
    from starlette.requests import ClientDisconnect

    from tokenmill.server.streaming import EventStream

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        stream = await async_engine.add_request("gone", "Tell me a story", LONG)

        async def never_iterated():
            yield "data: never sent\n\n"

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                raise OSError("the client closed the connection")

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}}
        with pytest.raises(ClientDisconnect):  # Starlette's name for the failed send
            await EventStream(never_iterated(), [stream])(scope, receive, send)
        await wait_idle(async_engine)
        return await async_engine.shutdown(timeout=0.0)

    stats = asyncio.run(main())
    assert stats.num_kv_blocks_used == 0 and not engine.has_unfinished_requests()
