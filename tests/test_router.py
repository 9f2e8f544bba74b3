"""The router: its radix tree and policies alone, then real processes on loopback.

`tokenmill serve --data-parallel-size 2` runs two real SmolLM2 replicas (fp32, one thread each)
behind a cache-aware router; a second, round-robin router is started over the same replicas.
Requests that share a system prompt must stay on one replica under cache_aware and spread under
round_robin. Then one replica is killed during a load of 40 requests: every request completes or
ends with an error event, none hangs, and none that had not started streaming is lost.
"""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import subprocess
import sys

import httpx
import psutil
import pytest

from tests.prompts import CHAT_QUESTIONS, SYSTEM_PROMPT
from tests.server_process import REPO_ROOT, ServerProcess, free_port, start_server, wait_healthy
from tests.waiting import eventually
from tokenmill.router.policies import (CacheAware, LeastLoad, PolicySettings, PromptLength,
                                       RoundRobin, make_policy)
from tokenmill.router.proxy import WORKER_HEADER, routing_text
from tokenmill.router.radix_tree import RadixTree
from tokenmill.router.workers import Worker

MODEL = "smollm2-135m-instruct"


# ---- the radix tree and the policies ------------------------------------------------------------

def test_radix_tree_matches_the_longest_prefix_across_split_edges():
    tree = RadixTree(max_chars=1000)
    tree.insert("hello world")
    tree.insert("hello there")
    tree.insert("hello world")  # already there: adds nothing
    assert tree.num_chars == len("hello ") + len("world") + len("there")
    assert tree.match("hello world, again") == len("hello world")
    assert tree.match("hello th") == len("hello th")
    assert tree.match("help") == len("hel")
    assert tree.match("goodbye") == 0
    assert tree.match("") == 0


def test_radix_tree_stays_in_bounds_evicting_the_least_recently_used():
    tree = RadixTree(max_chars=30)
    tree.insert("a" * 10 + "1" * 5)
    tree.insert("b" * 10)
    tree.match("a" * 10)  # the a-prompt is now more recent than the b-prompt
    tree.insert("c" * 10)  # 35 characters: the b-prompt goes
    assert tree.num_chars == 25
    assert (tree.match("b" * 10), tree.match("a" * 10 + "1" * 5), tree.match("c" * 10)) == \
        (0, 15, 10)
    tree.insert("d" * 20)  # the a-prompt, least recently used, goes
    assert tree.num_chars == 30
    assert (tree.match("a" * 10), tree.match("c" * 10), tree.match("d" * 20)) == (0, 10, 20)


def workers(count: int) -> list[Worker]:
    return [Worker(f"http://w{i}") for i in range(count)]


def test_round_robin_and_least_load():
    pool = workers(3)
    policy = RoundRobin()
    assert [policy.choose(pool, "x")[0].url for _ in range(4)] == [
        "http://w0", "http://w1", "http://w2", "http://w0"]
    pool[0].load, pool[1].load, pool[2].load = 3, 1, 2
    assert LeastLoad().choose(pool, "x") == (pool[1], "least_load")


def test_cache_aware_follows_prefixes_until_load_is_imbalanced():
    pool = workers(2)
    policy = CacheAware(PolicySettings(balance_abs_threshold=4, balance_rel_threshold=2.0))
    first_a, decision = policy.choose(pool, "system A. question 1")
    assert decision == "new_prefix"
    first_b, decision = policy.choose(pool, "system B. question 1")
    assert decision == "new_prefix" and first_b is not first_a  # the smaller tree takes it
    for question in range(2, 5):
        assert policy.choose(pool, f"system A. question {question}") == (first_a, "cache_hit")
        assert policy.choose(pool, f"system B. question {question}") == (first_b, "cache_hit")
    # 5 - 0 > 4 and 5 > 2 * 0: imbalanced, the idle worker takes even a cached prefix.
    first_a.load = 5
    assert policy.choose(pool, "system A. question 9") == (first_b, "balance")
    first_a.load, first_b.load = 9, 5  # 9 - 5 = 4, not past the absolute threshold
    assert policy.choose(pool, "system A. question 2") == (first_a, "cache_hit")
    first_a.load, first_b.load = 10, 5  # past the absolute one, but 10 = 2 * 5, not above
    assert policy.choose(pool, "system A. question 2") == (first_a, "cache_hit")
    # A worker that went down or came back has lost its cache: its tree is forgotten.
    policy.forget(first_a)
    assert policy.tree(first_a).num_chars == 0 and policy.tree(first_b).num_chars > 0


def test_prompt_length_sends_long_prompts_to_long_workers():
    short, long_context = Worker("http://short"), Worker.parse("http://long:8000#long")
    assert long_context.long_context and long_context.url == "http://long:8000"
    policy = PromptLength(PolicySettings(long_prompt_threshold=100))
    assert policy.choose([short, long_context], "x" * 100) == (long_context, "long")
    assert policy.choose([short, long_context], "x" * 99) == (short, "short")
    assert policy.choose([short], "x" * 500) == (short, "fallback")


def test_bad_router_options_name_the_option():
    with pytest.raises(ValueError, match="policy='fastest'"):
        make_policy("fastest", PolicySettings())
    with pytest.raises(ValueError, match="worker='localhost:8000'"):
        Worker.parse("localhost:8000")
    with pytest.raises(ValueError, match="max_tree_chars=0"):
        RadixTree(0)
    with pytest.raises(ValueError, match="cache_threshold=1.5"):
        PolicySettings(cache_threshold=1.5)


def test_routing_text_of_completions_and_chats():
    assert routing_text({"prompt": "abc"}) == "abc"
    assert routing_text({"prompt": ["abc", [1, 2]]}) == "abc\n[1, 2]"
    assert routing_text({"messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": [{"type": "text",
                                                                    "text": "hi"}]}]}) == \
        "<system>be brief\n<user>hi"


# ---- real replicas ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> ServerProcess:
    """Two replicas (one thread each) behind the cache-aware router of `serve -dp 2`."""
    server = start_server(tmp_path_factory.mktemp("dp") / "dp.log",
                          "--data-parallel-size", "2", "--num-kv-blocks", "512",
                          "--max-num-seqs", "8", "--policy", "cache_aware",
                          "--health-check-interval", "0.5",
                          base_flags=("--dtype", "float32", "--num-threads", "2",
                                      "--log-interval", "2"))
    yield server
    children = psutil.Process(server.process.pid).children(recursive=True)
    log = server.stop()
    assert server.process.returncode in (0, -signal.SIGTERM), log
    _, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, log  # the replicas stopped with the router


def worker_urls(router: ServerProcess) -> list[str]:
    return sorted(name.split('"')[1] for name in router.metrics()
                  if name.startswith("tokenmill_router:worker_healthy"))


@pytest.fixture(scope="module")
def round_robin(replicas, tmp_path_factory) -> ServerProcess:
    port = free_port()
    flags = [f"--worker={url}" for url in worker_urls(replicas)]
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    command = [sys.executable, "-m", "tokenmill.cli", "router", "--port", str(port),
               "--policy", "round_robin", "--health-check-interval", "0.5", *flags]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log_path.open("w"),
                               stderr=subprocess.STDOUT)
    router = wait_healthy(ServerProcess(process, f"http://127.0.0.1:{port}", log_path))
    yield router
    router.stop()


def chat(router: ServerProcess, system: str, question: str) -> tuple[str, dict]:
    response = httpx.post(f"{router.base_url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert response.status_code == 200, response.text
    return response.headers[WORKER_HEADER], response.json()["usage"]


def test_cache_aware_keeps_a_prefix_on_one_replica_round_robin_spreads_it(replicas,
                                                                         round_robin):
    systems = {name: f"[{name}] {SYSTEM_PROMPT}" for name in ("alpha", "beta")}
    served: dict[str, set[str]] = {name: set() for name in systems}
    for question in CHAT_QUESTIONS[:4]:
        for name, system in systems.items():
            worker, usage = chat(replicas, system, question)
            served[name].add(worker)
            if len(served[name]) == 1 and question != CHAT_QUESTIONS[0]:
                assert usage["prompt_tokens_details"]["cached_tokens"] >= 192
    assert [len(s) for s in served.values()] == [1, 1]
    assert served["alpha"] != served["beta"]  # a new prefix goes to the emptier replica
    decisions = replicas.metrics()
    assert decisions['tokenmill_router:policy_decisions_total{decision="cache_hit",'
                     'policy="cache_aware"}'] == 6

    spread = {chat(round_robin, systems["alpha"], q)[0] for q in CHAT_QUESTIONS[4:8]}
    assert spread == set(worker_urls(replicas))


async def one_request(client: httpx.AsyncClient, url: str, index: int,
                      started: collections.Counter) -> dict:
    """Streams completions (30 of 40) or waits for a whole one; records what came back and
    counts, per replica, the streams that received their first event in `started`."""
    stream = index % 4 != 0
    body = {"model": MODEL, "prompt": f"Story {index}: once upon a time", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        response = await client.post(url, json=body)
        return {"stream": False, "status": response.status_code,
                "tokens": response.json().get("usage", {}).get("completion_tokens")}
    events, error, done = 0, None, False
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
            elif "error" in json.loads(line[6:]):
                error = json.loads(line[6:])["error"]
            else:
                events += 1
                started[response.headers[WORKER_HEADER]] += events == 1
    return {"stream": True, "events_before_error": events, "error": error, "done": done}


def test_a_replica_killed_under_load_loses_no_request(replicas, round_robin):
    victim_url = worker_urls(replicas)[1]
    victim = next(p for p in psutil.Process(replicas.process.pid).children()
                  if victim_url.rpartition(":")[2] in p.cmdline())

    async def main() -> list[dict]:
        started: collections.Counter = collections.Counter()
        async with httpx.AsyncClient(timeout=httpx.Timeout(180.0)) as client:
            url = f"{round_robin.base_url}/v1/completions"
            tasks = [asyncio.create_task(one_request(client, url, i, started))
                     for i in range(40)]
            # Kill once the victim streams its first batch (24 tokens to go) and holds the
            # rest of its share in its queue: 8 requests run at most on each replica.
            await eventually(lambda: started[victim_url] >= 2, "the victim to stream",
                             timeout_s=180, interval_s=0.05)
            victim.kill()
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)

    results = asyncio.run(main())
    whole = [r for r in results if not r["stream"]]
    assert all(r["status"] == 200 and r["tokens"] == 24 for r in whole), whole
    streams = [r for r in results if r["stream"]]
    assert all(r["done"] for r in streams), streams  # every stream ends with [DONE]
    broken = [r for r in streams if r["error"] is not None]
    assert broken and all(r["events_before_error"] >= 1 for r in broken), broken  # started
    assert all(r["error"]["code"] == "worker_failed" for r in broken)
    metrics = round_robin.metrics()
    assert metrics[f'tokenmill_router:worker_healthy{{worker="{victim_url}"}}'] == 0
    assert sum(v for k, v in metrics.items() if k.startswith("tokenmill_router:retries_total")) \
        >= 1
    # The survivor serves what comes next.
    worker, _ = chat(round_robin, "Be brief.", "Hello?")
    assert worker != victim_url
