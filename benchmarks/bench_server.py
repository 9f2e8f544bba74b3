"""What serving costs the engine loop: one batch of chats offline, on an LLMEngine in this process,
then through a launched `tokenmill serve`, sent by the `tokenmill bench` client.

The HTTP side shares the GIL with the engine thread. This compares the mean gap between two tokens
(engine timestamps offline, the server's inter_token_latency histogram served) and output
tokens/s, and reads the CPU share of the server's event-loop thread from /proc: that share bounds
what the engine can lose to the GIL (docs/server.md). Latency and throughput under load are
`tokenmill bench`'s job (docs/benchmarks.md).

  python benchmarks/bench_server.py --server-args "--dtype float32 --num-kv-blocks 1024"
Results go to benchmarks/results/bench_server_<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import tempfile
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.bench.client import LoadShape, Target, run_load
from tokenmill.bench.datasets import QUESTIONS, Conversation
from tokenmill.bench.launch import free_port, launch, tokenmill_command
from tokenmill.bench.metrics import compute_metrics
from tokenmill.bench.prometheus import scrape
from tokenmill.bench.report import write_json
from tokenmill.cli import build_parser, engine_config_from_args
from tokenmill.engine.engine import LLMEngine

REPO_ROOT = Path(__file__).resolve().parent.parent


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds of a process's main thread (uvicorn's event loop) from /proc."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def offline(server_args: list[str], questions: list[str], tokens: int) -> tuple[float, float]:
    """Wall time and mean token gap of the batch on an in-process engine."""
    config = engine_config_from_args(build_parser().parse_args(["serve", *server_args]))
    llm = LLM.from_engine(LLMEngine(config))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    chats = [[{"role": "user", "content": q}] for q in questions]
    llm.chat(chats[:2], params, use_tqdm=False)  # warm-up, as the server gets
    start = time.perf_counter()
    outputs = llm.chat(chats, params, use_tqdm=False)
    wall = time.perf_counter() - start
    gap = statistics.fmean((o.metrics.last_token_time - o.metrics.first_token_time) / (tokens - 1)
                           for o in outputs)
    return wall, gap


def served(server_args: list[str], questions: list[str], tokens: int) -> dict:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="bench_server.")) / "server.log"
    print(f"server log: {log}", flush=True)
    conversations = [Conversation(("all",), tokens, user_turns=(q,)) for q in questions]
    with launch("tokenmill", tokenmill_command(port, *server_args), port, log) as server:
        target = Target(server.base_url, "smollm2-135m-instruct")
        asyncio.run(run_load(target, conversations[:2], LoadShape(), progress=False))
        before, cpu_before = scrape(server.base_url), main_thread_cpu_s(server.process.pid)
        result = asyncio.run(run_load(target, conversations, LoadShape(), progress=False))
        cpu = main_thread_cpu_s(server.process.pid) - cpu_before
        after = scrape(server.base_url)
    assert before is not None and after is not None
    metrics = compute_metrics(result.records, result.duration_s)
    gaps = [after[f"inter_token_latency_seconds_{k}"] - before[f"inter_token_latency_seconds_{k}"]
            for k in ("sum", "count")]
    return {"wall_s": result.duration_s, "output_tokens_per_s": metrics.output_throughput,
            "failed": metrics.num_failed, "mean_token_gap_s": gaps[0] / max(1.0, gaps[1]),
            # The event-loop thread holds the GIL while it runs Python: its CPU share bounds the
            # time the engine thread can lose waiting for the GIL.
            "event_loop_cpu_share": cpu / result.duration_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-args", default="", help="engine flags, e.g. '--dtype float32'")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/bench_server_*.json")
    args = parser.parse_args()
    server_args = shlex.split(args.server_args)
    questions = [f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})" for i in range(args.requests)]
    offline_wall, offline_gap = offline(server_args, questions, args.output_tokens)
    serving = served(server_args, questions, args.output_tokens)
    report = {"arguments": vars(args) | {"out": str(args.out)},
              "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "offline_wall_s": offline_wall,
              "offline_output_tokens_per_s": args.requests * args.output_tokens / offline_wall,
              "offline_mean_token_gap_s": offline_gap, "served": serving,
              "step_slowdown": serving["mean_token_gap_s"] / offline_gap - 1.0}
    print(f"token gap offline {offline_gap * 1000:.1f} ms, served "
          f"{serving['mean_token_gap_s'] * 1000:.1f} ms ({report['step_slowdown']:+.1%}); "
          f"output tok/s {report['offline_output_tokens_per_s']:.1f} offline, "
          f"{serving['output_tokens_per_s']:.1f} served; the event loop used "
          f"{serving['event_loop_cpu_share']:.1%} of one core")
    out = args.out or REPO_ROOT / "benchmarks" / "results" / \
        f"bench_server_{time.strftime('%Y%m%d_%H%M%S')}.json"
    write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
