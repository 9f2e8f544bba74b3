"""`tokenmill bench serve|sweep|peers`: flags, and the glue from flags to a run and its report.

serve measures a server that is already running; sweep and peers start their servers themselves.
Every command prints the report on the terminal and can write JSON (--output-json) and PNG plots
(--plot-dir).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokenmill.bench.benchmark import run_benchmark
from tokenmill.bench.client import LoadShape, Target
from tokenmill.bench.datasets import DATASETS, DatasetSpec, build_dataset
from tokenmill.bench.grid import GridResult, ServerPlan, Workload, run_grid
from tokenmill.bench.launch import PACKAGE_ROOT
from tokenmill.bench.metrics import SLO
from tokenmill.bench.peers import PEERS, PeerSettings, default_peers_dir
from tokenmill.bench.report import (comparison_table, format_run, plot_latency_cdfs,
                                    plot_throughput, ratio_table, write_json)
from tokenmill.bench.sweep import sweep_plans
from tokenmill.model.loader import DEFAULT_MODEL, load_tokenizer


def _int_list(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _name_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown) or 'empty list'}; "
                                             f"choose from {', '.join(choices)}")
        return names
    return parse


def _add_workload_args(parser: argparse.ArgumentParser, grid: bool) -> None:
    data = parser.add_argument_group("workload")
    if grid:
        data.add_argument("--datasets", type=_name_list(DATASETS), default=["shared-prefix"],
                          help=f"comma-separated: {', '.join(DATASETS)}")
        data.add_argument("--concurrency", type=_int_list, default=[1, 16],
                          help="comma-separated max concurrencies, e.g. 1,4,16,64")
        data.add_argument("--num-prompts", type=_int_list, default=[32],
                          help="conversations per run: one count, or one per concurrency")
    else:
        data.add_argument("--dataset", choices=DATASETS, default="random")
        data.add_argument("--num-prompts", type=int, default=100, help="conversations to send")
        data.add_argument("--max-concurrency", type=int, default=None,
                          help="conversations in flight at once (default: no limit)")
    data.add_argument("--output-len", type=int, default=128,
                      help="output tokens per request (sharegpt: the cap)")
    data.add_argument("--input-len", type=int, default=256,
                      help="random: prompt tokens; multi-turn: the first turn's passage")
    data.add_argument("--range-ratio", type=float, default=0.0,
                      help="random: lengths uniform in len*(1-r)..len*(1+r)")
    data.add_argument("--random-format", choices=["ids", "text"], default="ids",
                      help="random: prompts as token ids, or as text")
    data.add_argument("--num-prefixes", type=int, default=8,
                      help="shared-prefix: distinct system prompts")
    data.add_argument("--prefix-len", type=int, default=1000,
                      help="shared-prefix: tokens per system prompt")
    data.add_argument("--long-fraction", type=float, default=0.25,
                      help="mixed: share of long-document requests")
    data.add_argument("--document-len", type=int, default=1500,
                      help="mixed: tokens per long document")
    data.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    data.add_argument("--sharegpt-path", type=Path, help="sharegpt: a ShareGPT-format JSON file")
    data.add_argument("--tokenizer", help="model whose tokenizer sizes the prompts (name, .gguf "
                      f"or folder; default: {'--model' if grid else DEFAULT_MODEL})")
    data.add_argument("--seed", type=int, default=0)
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="conversations per second, Poisson (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps: 1 Poisson, <1 burstier, >1 more even")
    load.add_argument("--max-duration", type=float, default=600.0,
                      help="seconds after which a run stops by itself")
    load.add_argument("--request-timeout", type=float, default=300.0)
    load.add_argument("--slo", help="goodput objectives in ms, e.g. ttft=2000,tpot=100,e2el=10000")
    load.add_argument("--cost-per-hour", type=float, help="price of the server per hour")
    out = parser.add_argument_group("output")
    out.add_argument("--output-json", type=Path, help="write every figure here")
    out.add_argument("--plot-dir", type=Path, help="write PNG plots here")
    out.add_argument("--plot-prefix", default="bench", help="file name prefix of the plots")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)


def _dataset_spec(args: argparse.Namespace, name: str, num_prompts: int) -> DatasetSpec:
    return DatasetSpec(name=name, num_prompts=num_prompts, output_len=args.output_len,
                       input_len=args.input_len, range_ratio=args.range_ratio,
                       random_format=args.random_format, num_prefixes=args.num_prefixes,
                       prefix_len=args.prefix_len, long_fraction=args.long_fraction,
                       document_len=args.document_len, num_turns=args.num_turns,
                       sharegpt_path=args.sharegpt_path, seed=args.seed,
                       nonce=f"{time.time_ns() % 10**8:08d}")


def _load_shape(args: argparse.Namespace, max_concurrency: int | None) -> LoadShape:
    return LoadShape(request_rate=args.request_rate, burstiness=args.burstiness,
                     max_concurrency=max_concurrency, max_duration_s=args.max_duration,
                     request_timeout_s=args.request_timeout, seed=args.seed)


def _environment() -> dict:
    """What a reader needs to rerun and judge the figures."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=PACKAGE_ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        commit = ""
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    versions = {}
    for package in ("torch", "transformers"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.platform(),
            "cpu": cpu, "cores": os.cpu_count(), "versions": versions, "commit": commit,
            "command": "tokenmill " + shlex.join(sys.argv[1:])}


def _served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
        return models.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "default"


def _serve(args: argparse.Namespace) -> None:
    slo = SLO.parse(args.slo)
    tokenizer = load_tokenizer(args.tokenizer or DEFAULT_MODEL)
    conversations = build_dataset(_dataset_spec(args, args.dataset, args.num_prompts), tokenizer)
    extra_body = {"temperature": 0.0, **({"ignore_eos": True} if args.ignore_eos else {})}
    target = Target(args.base_url, args.model or _served_model(args.base_url, args.api_key),
                    args.api_key, extra_body)
    run = run_benchmark(target, conversations, _load_shape(args, args.max_concurrency),
                        args.label or target.model, args.dataset, slo, args.cost_per_hour,
                        args.progress)
    print(format_run(run))
    if args.output_json:
        write_json(args.output_json, {"environment": _environment(), "runs": [run.to_dict()]})
        print(f"wrote {args.output_json}")
    if args.plot_dir:
        path = plot_latency_cdfs([run], args.plot_dir / f"{args.plot_prefix}-latency-cdf.png",
                                 f"{run.label} · {run.dataset}")
        print(f"wrote {path}")


def _run_grid(args: argparse.Namespace, plans: list[ServerPlan], settings: dict,
              reference: str | None = None) -> None:
    num_prompts = args.num_prompts * len(args.concurrency) if len(args.num_prompts) == 1 \
        else args.num_prompts
    workload = Workload(datasets=tuple(_dataset_spec(args, name, 1) for name in args.datasets),
                        concurrencies=tuple(args.concurrency), num_prompts=tuple(num_prompts),
                        load=_load_shape(args, None), slo=SLO.parse(args.slo),
                        cost_per_hour=args.cost_per_hour)
    log_dir = Path(tempfile.mkdtemp(prefix="tokenmill-bench."))
    print(f"server logs: {log_dir}")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    result: GridResult = run_grid(plans, workload, tokenizer, log_dir, args.start_timeout,
                                  args.progress)
    print()
    print(comparison_table(result.runs, result.unavailable))
    ratios = ratio_table(result.runs, reference) if reference else ""
    if ratios:
        print(f"\n{ratios}")
    if args.output_json:
        write_json(args.output_json, {"environment": _environment(), "settings": settings,
                                      "runs": [run.to_dict() for run in result.runs],
                                      "unavailable": result.unavailable})
        print(f"wrote {args.output_json}")
    if args.plot_dir and result.runs:
        for dataset in args.datasets:
            runs = [run for run in result.runs if run.dataset == dataset]
            if runs:
                print("wrote", plot_latency_cdfs(
                    runs, args.plot_dir / f"{args.plot_prefix}-latency-cdf-{dataset}.png",
                    f"latency CDFs · {dataset}"))
        if len(args.concurrency) > 1:
            print("wrote", plot_throughput(result.runs,
                                           args.plot_dir / f"{args.plot_prefix}-throughput.png"))


def _sweep(args: argparse.Namespace) -> None:
    plans = sweep_plans(args.model, args.server_args, tuple(args.toggle or ()))
    _run_grid(args, plans, {"model": args.model, "server_args": args.server_args,
                            "toggles": args.toggle or []})


def _peers(args: argparse.Namespace) -> None:
    settings = PeerSettings(model=args.model, parallel=args.parallel, threads=args.threads,
                            hf_dtype=args.hf_dtype,
                            tokenmill_args=tuple(shlex.split(args.tokenmill_args)),
                            peers_dir=args.peers_dir)
    plans = [ServerPlan(name, functools.partial(PEERS[name], settings),
                        args.hf_num_prompts if name == "hf-generate" else None)
             for name in args.peers]
    _run_grid(args, plans, {"model": args.model, "parallel": args.parallel,
                            "threads": args.threads, "hf_dtype": args.hf_dtype,
                            "tokenmill_args": args.tokenmill_args,
                            "hf_num_prompts": args.hf_num_prompts}, reference="tokenmill")


def add_bench_commands(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="serving benchmark (docs/benchmarks.md)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    serve = kinds.add_parser("serve", help="measure a running OpenAI-compatible server")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--model", help="model name in requests (default: the server's first)")
    serve.add_argument("--api-key")
    serve.add_argument("--label", help="name of the server in the report (default: the model)")
    serve.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                       help="ask for exactly --output-len tokens (vLLM/tokenmill/llama.cpp field)")
    _add_workload_args(serve, grid=False)
    serve.set_defaults(handler=_serve)

    sweep = kinds.add_parser("sweep", help="tokenmill servers over concurrencies and settings")
    sweep.add_argument("--model", default=DEFAULT_MODEL)
    sweep.add_argument("--server-args", default="", help="flags every variant's server gets")
    sweep.add_argument("--toggle", action="append",
                       help="server flags to add alone, then with the other toggles "
                            "(repeatable), e.g. --toggle=--no-enable-prefix-caching")
    sweep.add_argument("--start-timeout", type=float, default=300.0)
    _add_workload_args(sweep, grid=True)
    sweep.set_defaults(handler=_sweep)

    peers = kinds.add_parser("peers", help="tokenmill and its peers, one after another")
    peers.add_argument("--peers", type=_name_list(tuple(PEERS)), default=list(PEERS),
                       help=f"comma-separated: {', '.join(PEERS)}")
    peers.add_argument("--model", default=DEFAULT_MODEL, help="the GGUF every peer serves")
    peers.add_argument("--parallel", type=int, default=16,
                       help="llama-server -np slots (set it to the highest concurrency)")
    peers.add_argument("--threads", type=int, default=2, help="CPU threads of every server")
    peers.add_argument("--hf-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    peers.add_argument("--hf-num-prompts", type=int, default=4,
                       help="cap on conversations per run for hf-generate (about 20 tok/s)")
    peers.add_argument("--tokenmill-args", default="", help="extra `tokenmill serve` flags")
    peers.add_argument("--peers-dir", type=Path, default=default_peers_dir(),
                       help="where scripts/build_peers.sh put llama.cpp")
    peers.add_argument("--start-timeout", type=float, default=300.0)
    _add_workload_args(peers, grid=True)
    peers.set_defaults(handler=_peers)
