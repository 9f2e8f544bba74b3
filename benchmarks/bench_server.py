"""Serving benchmark: streaming chat clients against `tokenmill serve`, with vllm bench's metrics.

Scenarios:
  sweep    - for each concurrency (default 1, 8, 32): that many clients, each sending requests
             back to back, 128 output tokens each (ignore_eos), short varied questions.
  target   - the issue's load: 16 concurrent clients, 32 requests, 64 output tokens, 8 different
             system prompts of about 1,000 tokens each, from a cold cache (a per-run nonce opens
             every system prompt, so nothing cached earlier can match).
  overhead - (with --launch) the same batch of chats offline, on an LLMEngine in this process,
             then through the server: what the HTTP side, which shares the GIL with the engine
             thread, costs the step loop (mean gap between two tokens, and output tokens/s).
Metrics follow vllm bench serve: TTFT; TPOT = (latency - TTFT) / (output_tokens - 1); ITL pooled
over every chunk gap; E2EL; output tokens/s over the scenario's wall time; mean, median and P99.

  python benchmarks/bench_server.py --launch                  # starts a server, runs both
  python benchmarks/bench_server.py --base-url http://127.0.0.1:8000 --scenario target
Results go to benchmarks/results/bench_server_<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain why the sky is blue.", "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish.", "What is 17 times 23?",
    "Give me a short recipe for pancakes.", "Summarise Romeo and Juliet.",
]
POLICY_SENTENCES = [
    "Instances come in small, medium and large sizes and are billed per second.",
    "Object storage is billed per gigabyte per month, with free ingress.",
    "Managed databases take automated backups every six hours and keep them seven days.",
    "Enterprise customers get support around the clock; others get business hours.",
    "Billing disputes go to a human agent; never promise refunds yourself.",
    "Cite the documentation section that answers the question, and keep answers short.",
    "Never reveal internal identifiers, hostnames or the names of on-call engineers.",
    "The message queue keeps undelivered messages for fourteen days.",
]


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def system_prompt(index: int, nonce: str, target_tokens: int) -> str:
    """About `target_tokens` SmolLM2 tokens (22 per sentence), distinct per index and run."""
    sentences = [f"Policy {index}.{n}: {POLICY_SENTENCES[(index + n) % len(POLICY_SENTENCES)]}"
                 for n in range(max(1, target_tokens // 22))]
    return f"[run {nonce}] You are support assistant number {index}. " + " ".join(sentences)


async def one_request(http: httpx.AsyncClient, base_url: str, model: str, messages: list,
                      max_tokens: int) -> RequestResult:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False)
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = result.output_tokens > 0
    return result


async def run_load(base_url: str, model: str, conversations: list[list], concurrency: int,
                   max_tokens: int) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for messages in conversations:
        queue.put_nowait(messages)
    results: list[RequestResult] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            results.append(await one_request(http, base_url, model, queue.get_nowait(),
                                             max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summarise(results, wall, concurrency)


def summarise(results: list[RequestResult], wall: float, concurrency: int) -> dict:
    ok = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict:
        if not values:
            return {}
        ordered = sorted(values)
        return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered),
                "p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]}

    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency, "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": wall, "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall if wall else 0.0,
        "request_per_s": len(ok) / wall if wall else 0.0,
        "mean_prompt_tokens": statistics.fmean(r.prompt_tokens for r in ok) if ok else 0,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "ttft_s": stats([r.ttft for r in ok]),
        "tpot_s": stats([(r.latency - r.ttft) / (r.output_tokens - 1)
                         for r in ok if r.output_tokens > 1]),
        "itl_s": stats([gap for r in ok for gap in r.itls]),
        "e2el_s": stats([r.latency for r in ok]),
    }


def sweep(args: argparse.Namespace) -> list[dict]:
    rows = []
    for concurrency in args.concurrency:
        count = concurrency * args.requests_per_client
        conversations = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
                         for i in range(count)]
        row = asyncio.run(run_load(args.base_url, args.model, conversations, concurrency,
                                   args.output_tokens))
        print(f"sweep c={concurrency}: TTFT median {row['ttft_s'].get('median', 0):.3f} s, "
              f"TPOT median {row['tpot_s'].get('median', 0) * 1000:.1f} ms, "
              f"{row['output_tokens_per_s']:.1f} output tok/s, failed {row['failed']}",
              flush=True)
        rows.append(row)
    return rows


def target(args: argparse.Namespace) -> dict:
    nonce = uuid.uuid4().hex[:12]
    prompts = [system_prompt(i, nonce, args.system_prompt_tokens)
               for i in range(args.target_system_prompts)]
    conversations = [[{"role": "system", "content": prompts[i % len(prompts)]},
                      {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
                     for i in range(args.target_requests)]
    row = asyncio.run(run_load(args.base_url, args.model, conversations, args.target_clients,
                               args.target_output_tokens))
    print(f"target: {row['requests']} requests, failed {row['failed']}, TTFT P50 "
          f"{row['ttft_s'].get('median', 0):.3f} s, mean prompt {row['mean_prompt_tokens']:.0f}"
          f" tokens, {row['output_tokens_per_s']:.1f} output tok/s", flush=True)
    return row


def overhead(args: argparse.Namespace, server) -> dict:
    from tokenmill import LLM, SamplingParams
    from tokenmill.cli import build_parser, engine_config_from_args
    from tokenmill.engine.engine import LLMEngine

    conversations = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" (#{i})"}]
                     for i in range(args.overhead_requests)]
    tokens = args.target_output_tokens
    config = engine_config_from_args(
        build_parser().parse_args(["serve", *shlex.split(args.server_args)]))
    llm = LLM.from_engine(LLMEngine(config))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.chat(conversations[:2], params, use_tqdm=False)  # warm-up, as the server had
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    offline_wall = time.perf_counter() - start
    offline_gap = statistics.fmean((o.metrics.last_token_time - o.metrics.first_token_time)
                                   / (tokens - 1) for o in outputs)
    del llm, outputs
    before = server.metrics()
    loop_cpu_before = main_thread_cpu_s(server.process.pid)
    row = asyncio.run(run_load(server.base_url, args.model, conversations, len(conversations),
                               tokens))
    loop_cpu = main_thread_cpu_s(server.process.pid) - loop_cpu_before
    after = server.metrics()
    gaps = "tokenmill:inter_token_latency_seconds"
    server_gap = (after[gaps + "_sum"] - before[gaps + "_sum"]) / \
        max(1.0, after[gaps + "_count"] - before[gaps + "_count"])
    result = {"requests": len(conversations), "output_tokens": tokens,
              "offline_wall_s": offline_wall,
              "offline_output_tokens_per_s": len(conversations) * tokens / offline_wall,
              "offline_mean_token_gap_s": offline_gap,
              "server_wall_s": row["wall_s"],
              "server_output_tokens_per_s": row["output_tokens_per_s"],
              "server_mean_token_gap_s": server_gap, "server_failed": row["failed"],
              "step_slowdown": server_gap / offline_gap - 1.0,
              # The event-loop thread holds the GIL while it runs Python: its CPU share bounds
              # the time the engine thread can lose waiting for the GIL.
              "event_loop_cpu_share": loop_cpu / row["wall_s"]}
    print(f"overhead: token gap offline {offline_gap * 1000:.1f} ms, in the server "
          f"{server_gap * 1000:.1f} ms ({result['step_slowdown']:+.1%}); output tok/s "
          f"{result['offline_output_tokens_per_s']:.1f} offline, "
          f"{result['server_output_tokens_per_s']:.1f} served; the HTTP event loop used "
          f"{result['event_loop_cpu_share']:.1%} of one core", flush=True)
    return result


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds of a process's main thread (uvicorn's event loop) from /proc."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def launch(server_args: str):
    """A `tokenmill serve` with the engine's defaults plus `server_args`, on a free port."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.server_process import start_server

    log = Path(tempfile.mkdtemp(prefix="bench_server.")) / "server.log"
    print(f"server log: {log}", flush=True)
    return start_server(log, *shlex.split(server_args), base_flags=())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--launch", action="store_true",
                        help="start `tokenmill serve` (engine defaults) for the run")
    parser.add_argument("--server-args", default="",
                        help="flags for the launched server, e.g. '--dtype float32'")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--scenario", choices=["sweep", "target", "overhead", "all"],
                        default="all", help="all: sweep and target")
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")],
                        default=[1, 8, 32])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--target-clients", type=int, default=16)
    parser.add_argument("--target-requests", type=int, default=32)
    parser.add_argument("--target-output-tokens", type=int, default=64)
    parser.add_argument("--target-system-prompts", type=int, default=8)
    parser.add_argument("--system-prompt-tokens", type=int, default=1000)
    parser.add_argument("--overhead-requests", type=int, default=32)
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/bench_server_*.json")
    args = parser.parse_args()

    server = None
    if args.launch:
        server = launch(args.server_args)
        args.base_url = server.base_url
    try:
        report = {"machine": platform.platform(), "python": platform.python_version(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  "arguments": {k: str(v) if isinstance(v, Path) else v
                                for k, v in vars(args).items()}}
        if args.scenario in ("sweep", "all"):
            report["sweep"] = sweep(args)
        if args.scenario in ("target", "all"):
            report["target"] = target(args)
        if args.scenario == "overhead":
            if server is None:
                parser.error("--scenario overhead needs --launch (it must know the engine flags)")
            report["overhead"] = overhead(args, server)
    finally:
        if server is not None:
            server.stop()
    out = args.out or REPO_ROOT / "benchmarks" / "results" / \
        f"bench_server_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
