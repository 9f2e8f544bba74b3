"""A grid of runs: every dataset at every concurrency, against each of a list of servers that it
starts and stops itself, one server at a time. Sweeps and peer comparisons are such grids.

Each run on a server gets a fresh nonce in its prompts, so it starts from a cold prefix cache even
after the run before it; the n-th run on every server gets the same prompts.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.bench.benchmark import BenchmarkRun, run_benchmark
from tokenmill.bench.client import LoadShape, Target
from tokenmill.bench.datasets import DatasetSpec, build_dataset
from tokenmill.bench.launch import ServerUnavailable, free_port, launch
from tokenmill.bench.metrics import SLO
from tokenmill.bench.peers import PeerServer
from tokenmill.bench.report import format_run

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ServerPlan:
    label: str
    start: Callable[[int], PeerServer]  # port -> how to start the server
    max_num_prompts: int | None = None  # a cap for slow servers (per run)


@dataclass(frozen=True)
class Workload:
    datasets: tuple[DatasetSpec, ...]
    concurrencies: tuple[int, ...]
    num_prompts: tuple[int, ...]  # per concurrency
    load: LoadShape
    slo: SLO | None = None
    cost_per_hour: float | None = None

    def __post_init__(self) -> None:
        if len(self.num_prompts) != len(self.concurrencies):
            raise ValueError(f"invalid benchmark option num_prompts={list(self.num_prompts)}: "
                             "give one count, or one per concurrency "
                             f"({len(self.concurrencies)})")


@dataclass
class GridResult:
    runs: list[BenchmarkRun]
    unavailable: dict[str, str]  # label -> why it could not run


def run_grid(plans: list[ServerPlan], workload: Workload, tokenizer: PreTrainedTokenizerBase,
             log_dir: Path, start_timeout_s: float = 300.0, progress: bool = True,
             show: Callable[[str], None] = print) -> GridResult:
    result = GridResult([], {})
    run_id = uuid.uuid4().hex[:8]
    for plan in plans:
        port = free_port()
        try:
            peer = plan.start(port)
            server = launch(plan.label, peer.command, port, log_dir / f"{plan.label}.log",
                            start_timeout_s=start_timeout_s, env=peer.env)
        except ServerUnavailable as error:
            result.unavailable[plan.label] = str(error)
            show(f"{plan.label} did not run: {error}")
            continue
        target = Target(server.base_url, peer.request_model, extra_body=peer.extra_body)
        with server:
            runs_before = len(result.runs)
            for spec in workload.datasets:
                for concurrency, count in zip(workload.concurrencies, workload.num_prompts):
                    count = min(count, plan.max_num_prompts or count)
                    nonce = f"{run_id}{len(result.runs) - runs_before:03d}"
                    conversations = build_dataset(replace(spec, num_prompts=count, nonce=nonce),
                                                  tokenizer)
                    run = run_benchmark(target, conversations,
                                        replace(workload.load, max_concurrency=concurrency),
                                        plan.label, spec.name, workload.slo,
                                        workload.cost_per_hour, progress)
                    result.runs.append(run)
                    show(format_run(run))
    return result
