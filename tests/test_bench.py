"""`tokenmill bench`: metrics against hand-made timestamps, datasets, arrivals, failures counted
(a real local server that fails on purpose, bad requests to tokenmill, a closed port), and the
client end to end against the real `tokenmill serve` shared with tests/test_server.py.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import math
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from tests.server_process import REPO_ROOT, ServerProcess
from tokenmill.bench.arrivals import arrival_times
from tokenmill.bench.benchmark import BenchmarkRun, run_benchmark
from tokenmill.bench.client import TIME_BOUND, LoadShape, RequestRecord, Target, run_load
from tokenmill.bench.datasets import Conversation, DatasetSpec, build_dataset
from tokenmill.bench.grid import ServerPlan, Workload, run_grid
from tokenmill.bench.launch import free_port
from tokenmill.bench.metrics import SLO, Distribution, compute_metrics
from tokenmill.bench.peers import PEERS, PeerServer, PeerSettings
from tokenmill.bench.prometheus import ServerCounters
from tokenmill.bench.report import (comparison_table, format_run, plot_latency_cdfs,
                                    plot_throughput, ratio_table)
from tokenmill.bench.sweep import sweep_plans
from tokenmill.model.loader import DEFAULT_MODEL, load_tokenizer

MODEL = "smollm2-135m-instruct"


def record(sent: float, chunks: list[float], finished: float, output_tokens: int,
           prompt_tokens: int = 10) -> RequestRecord:
    return RequestRecord("all", sent, chunks, finished, output_tokens, prompt_tokens,
                         usage_reported=True)


# Three successful requests and one failure over a 4-second run (times in seconds).
RECORDS = [
    record(0.0, [0.1, 0.15, 0.25, 0.3], 0.35, 4),  # TTFT 100 ms, TPOT 250/3 ms, ITL 50, 100, 50
    record(1.0, [1.2, 1.4], 1.4, 2),  # TTFT 200 ms, TPOT 200 ms, ITL 200
    record(2.0, [2.5], 2.6, 1),  # TTFT 500 ms, one token: no TPOT, no ITL
    RequestRecord("all", 3.0, finished=3.1, error="HTTP 500"),
]


def test_metrics_follow_vllm_definitions_on_hand_made_timestamps():
    m = compute_metrics(RECORDS, duration_s=4.0, num_not_sent=2)
    assert (m.num_requests, m.num_completed, m.num_failed, m.num_not_sent) == (4, 3, 1, 2)
    assert m.errors == {"HTTP 500": 1}
    assert (m.input_tokens, m.output_tokens) == (30, 7)
    assert m.request_throughput == pytest.approx(3 / 4)
    assert m.output_throughput == pytest.approx(7 / 4)
    assert m.total_token_throughput == pytest.approx(37 / 4)
    assert m.ttft_ms.count == 3 and m.ttft_ms.mean == pytest.approx(800 / 3)
    assert m.ttft_ms.median == pytest.approx(200)
    assert m.tpot_ms.count == 2  # the one-token request has no TPOT
    assert m.tpot_ms.mean == pytest.approx((250 / 3 + 200) / 2)
    assert m.itl_ms.count == 4  # pooled over every gap of every request
    assert m.itl_ms.median == pytest.approx(75)
    assert m.itl_ms.p99 == pytest.approx(100 + 0.97 * 100)  # linear, between 100 and 200
    assert m.e2el_ms.count == 3 and m.e2el_ms.p90 == pytest.approx(400 + 0.8 * 200)
    assert m.goodput is None and m.cost_per_request is None


def test_percentiles_come_with_sample_counts():
    dist = Distribution.of([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert dist.count == 100
    assert (dist.median, dist.p90, dist.p95, dist.p99) == pytest.approx(
        tuple(np.percentile(np.arange(1, 101), [50, 90, 95, 99])))
    empty = Distribution.of([])
    assert empty.count == 0 and math.isnan(empty.median)


def test_goodput_counts_requests_meeting_every_slo():
    goodput = lambda slo: compute_metrics(RECORDS, 4.0, slo=SLO.parse(slo)).goodput  # noqa: E731
    assert goodput("ttft=150") == pytest.approx(1 / 4)
    assert goodput("ttft=250") == pytest.approx(2 / 4)
    assert goodput("ttft=250,tpot=100") == pytest.approx(1 / 4)  # the 2nd has TPOT 200 ms
    assert goodput("e2el=450") == pytest.approx(2 / 4)
    assert goodput("tpot=1") == pytest.approx(1 / 4)  # only the one-token request: TPOT 0
    assert goodput("ttft=1000,tpot=1,e2el=1000") == pytest.approx(1 / 4)
    with pytest.raises(ValueError, match="slo="):
        SLO.parse("ttft=fast")
    with pytest.raises(ValueError, match="slo="):
        SLO.parse("latency=10")


def test_cost_per_request_charges_failed_requests_too():
    m = compute_metrics(RECORDS, duration_s=4.0, cost_per_hour=3.6)
    assert m.cost_per_request == pytest.approx(3.6 * 4 / 3600 / 3)  # 4 sent, 3 paid for it


def run_of(label: str, concurrency: int, duration_s: float) -> BenchmarkRun:
    """A run made of RECORDS, as if it had lasted `duration_s`."""
    return BenchmarkRun(label, "shared-prefix", concurrency, math.inf, 4,
                        compute_metrics(RECORDS, duration_s), {}, ServerCounters(False), False,
                        {"ttft": [0.1, 0.2, 0.5], "tpot": [0.08, 0.2], "e2el": [0.35, 0.4, 0.6]},
                        {"HTTP 500": "engine fault"})


def test_ratio_table_and_plots(tmp_path):
    runs = [run_of("tokenmill", 1, 8.0), run_of("tokenmill", 16, 2.0),
            run_of("llama-server", 1, 4.0), run_of("llama-server", 16, 4.0)]
    table = ratio_table(runs, "tokenmill")
    assert "| shared-prefix | 16 | llama-server | 2.00 | 1.00 |" in table
    assert "| shared-prefix | 1 | llama-server | 0.50 | 1.00 |" in table
    assert "HTTP 500: 1" in comparison_table(runs)
    for path in (plot_latency_cdfs(runs, tmp_path / "cdf.png"),
                 plot_throughput(runs, tmp_path / "throughput.png")):
        assert path.read_bytes()[:4] == b"\x89PNG"


def test_arrivals_poisson_bursty_and_all_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5
    times = arrival_times(4000, request_rate=10.0, seed=1)
    assert times == arrival_times(4000, request_rate=10.0, seed=1)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    bursty = np.diff(arrival_times(4000, 10.0, burstiness=0.25, seed=1))
    even = np.diff(arrival_times(4000, 10.0, burstiness=4.0, seed=1))
    assert bursty.std() / bursty.mean() > 1.5 > 1 > 0.7 > even.std() / even.mean()
    with pytest.raises(ValueError, match="request_rate"):
        arrival_times(3, 0.0)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


def count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_datasets_are_generated_to_size(tokenizer, tmp_path):
    random_ids = build_dataset(DatasetSpec("random", 20, output_len=100, input_len=50,
                                           range_ratio=0.2, seed=3), tokenizer)
    assert all(40 <= len(c.prompt) <= 60 and 80 <= c.output_len <= 120 for c in random_ids)
    assert random_ids == build_dataset(DatasetSpec("random", 20, output_len=100, input_len=50,
                                                   range_ratio=0.2, seed=3), tokenizer)
    [text] = build_dataset(DatasetSpec("random", 1, input_len=64, random_format="text"),
                           tokenizer)
    assert isinstance(text.prompt, str) and 56 <= count(tokenizer, text.prompt) <= 72

    shared = build_dataset(DatasetSpec("shared-prefix", 12, num_prefixes=3, prefix_len=400,
                                       nonce="n1"), tokenizer)
    prompts = {c.system_prompt for c in shared}
    assert len(prompts) == 3 and all(p.startswith("[run n1]") for p in prompts)
    assert all(380 <= count(tokenizer, p) <= 420 and '"search_docs"' in p for p in prompts)
    assert all(count(tokenizer, c.user_turns[0]) < 30 for c in shared)

    mixed = build_dataset(DatasetSpec("mixed", 40, long_fraction=0.25, document_len=300),
                          tokenizer)
    long = [c for c in mixed if c.groups == ("long",)]
    assert 4 <= len(long) <= 20 and len(long) + sum(c.groups == ("short",) for c in mixed) == 40
    assert all(count(tokenizer, c.user_turns[0]) > 290 for c in long)

    [chat] = build_dataset(DatasetSpec("multi-turn", 1, num_turns=3), tokenizer)
    assert chat.groups == ("turn 1", "turn 2", "turn 3") and len(chat.user_turns) == 3

    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Hi there"},
                           {"from": "gpt", "value": "Hello! How can I help you today?"}]},
        {"conversations": [{"from": "gpt", "value": "starts with the model: skipped"},
                           {"from": "human", "value": "?"}]}]))
    sharegpt = build_dataset(DatasetSpec("sharegpt", 3, output_len=4, sharegpt_path=path),
                             tokenizer)
    assert [c.user_turns for c in sharegpt] == [("Hi there",)] * 3
    assert all(c.output_len == 4 for c in sharegpt)  # the reply's length, capped
    path.write_text("{not json")
    with pytest.raises(ValueError, match="sharegpt_path"):
        build_dataset(DatasetSpec("sharegpt", 1, sharegpt_path=path), tokenizer)
    with pytest.raises(ValueError, match="range_ratio"):
        DatasetSpec("random", 1, range_ratio=1.5)


class FaultyHandler(BaseHTTPRequestHandler):
    """A real HTTP server that fails in turn: a 500, a stream cut short, an error event."""
    turns = itertools.count()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        kind = next(self.turns) % 3
        if kind == 0:
            body = b'{"error": {"message": "engine fault", "code": 500}}'
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        chunk = b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if kind == 1:  # promises more than it sends, then hangs up
            self.send_header("Content-Length", "10000")
            self.end_headers()
            self.wfile.write(chunk)
            self.close_connection = True
            return
        event = b'data: {"error": {"message": "out of blocks"}}\n\ndata: [DONE]\n\n'
        self.send_header("Content-Length", str(len(chunk + event)))
        self.end_headers()
        self.wfile.write(chunk + event)

    def log_message(self, *args: object) -> None:
        pass


def test_failures_are_counted_by_kind_not_raised():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FaultyHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        conversations = [Conversation(("all",), 8, user_turns=("Hello?",))] * 6
        target = Target(f"http://127.0.0.1:{server.server_address[1]}", MODEL)
        result = asyncio.run(run_load(target, conversations, LoadShape(max_concurrency=1),
                                      progress=False))
    finally:
        server.shutdown()
    m = compute_metrics(result.records, result.duration_s)
    assert m.num_completed == 0 and m.num_failed == 6
    assert m.errors == {"HTTP 500": 2, "RemoteProtocolError": 2, "stream error": 2}
    assert math.isnan(m.ttft_ms.median) and m.output_throughput == 0

    closed = Target(f"http://127.0.0.1:{free_port()}", MODEL)
    result = asyncio.run(run_load(closed, conversations[:2], LoadShape(), progress=False))
    assert [r.error for r in result.records] == ["connect error"] * 2


@pytest.fixture(scope="module")
def server(tokenmill_server: ServerProcess) -> ServerProcess:
    return tokenmill_server


def test_client_end_to_end_against_tokenmill(server, tokenizer):
    target = Target(server.base_url, MODEL)
    conversations = build_dataset(DatasetSpec("shared-prefix", 6, output_len=8, num_prefixes=2,
                                              prefix_len=200, nonce="e2e"), tokenizer)
    run = run_benchmark(target, conversations, LoadShape(max_concurrency=3), "tokenmill",
                        "shared-prefix", SLO.parse("ttft=1"), progress=False)
    m = run.metrics
    assert (m.num_completed, m.num_failed, m.output_tokens) == (6, 0, 48), run.error_examples
    assert m.usage_reported and m.input_tokens > 6 * 200
    assert m.ttft_ms.count == m.tpot_ms.count == m.e2el_ms.count == 6
    assert 0 < m.itl_ms.count <= 6 * 7
    # No request over HTTP has its first token 1 ms after sending (a 200-token prefill alone
    # takes longer), so none meets this SLO; test_goodput_counts_requests_meeting_every_slo
    # checks the count where some do.
    assert min(run.latencies_s["ttft"]) > 0.001 and m.goodput == 0
    assert m.request_throughput == pytest.approx(6 / m.duration_s)
    # The server's own counters agree with the usage it reported to the client.
    assert run.server.metrics_endpoint and run.server.preemptions == 0
    assert run.server.prefix_cache_hits == m.cached_tokens > 0
    assert 0 < run.server.prefix_cache_hit_rate < 1
    assert "TTFT" in format_run(run) and "| tokenmill | shared-prefix | 3 | 6/6 |" in \
        comparison_table([run])

    chats = build_dataset(DatasetSpec("multi-turn", 2, output_len=6, input_len=80, num_turns=3,
                                      nonce="e2e"), tokenizer)
    run = run_benchmark(target, chats, LoadShape(max_concurrency=2), "tokenmill",
                        "multi-turn", progress=False)
    assert run.metrics.num_completed == 6 and set(run.groups) == {"turn 1", "turn 2", "turn 3"}
    turns = [run.groups[f"turn {k}"] for k in (1, 2, 3)]
    assert turns[0].input_tokens < turns[1].input_tokens < turns[2].input_tokens
    assert turns[1].cached_tokens > 0  # each turn re-sends the conversation so far


def test_bad_requests_and_the_time_bound_are_counted(server):
    requests = [Conversation(("all",), 4, user_turns=("Hi",))] * 2
    result = asyncio.run(run_load(Target(server.base_url, "no-such-model"), requests,
                                  LoadShape(), progress=False))
    assert [r.error for r in result.records] == ["HTTP 404"] * 2
    too_long = [Conversation(("all",), 4, prompt=tuple([42] * 9000))]
    result = asyncio.run(run_load(Target(server.base_url, MODEL), too_long, LoadShape(),
                                  progress=False))
    assert result.records[0].error == "HTTP 400" and "8192" in result.records[0].error_detail

    endless = [Conversation(("all",), 4000, user_turns=("Tell me a long story.",))] * 2
    result = asyncio.run(run_load(Target(server.base_url, MODEL), endless,
                                  LoadShape(max_concurrency=1, max_duration_s=1.5),
                                  progress=False))
    assert result.stopped_by_time_bound and result.duration_s < 10
    assert [r.error for r in result.records] == [TIME_BOUND] and result.num_not_sent == 1
    metrics = server.wait_until_idle()  # the cut request was aborted in the engine
    assert metrics["tokenmill:kv_cache_usage_perc"] == 0


def test_cli_serve_writes_json_and_plots(server, tmp_path):
    out = tmp_path / "run.json"
    command = [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url",
               server.base_url, "--dataset", "random", "--num-prompts", "3", "--input-len", "32",
               "--output-len", "4", "--max-concurrency", "2", "--slo", "ttft=600000",
               "--cost-per-hour", "2.5", "--output-json", str(out), "--plot-dir", str(tmp_path),
               "--no-progress"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TTFT" in done.stdout and "Goodput" in done.stdout
    [run] = json.loads(out.read_text())["runs"]
    assert run["metrics"]["num_completed"] == 3 and run["metrics"]["output_tokens"] == 12
    assert run["metrics"]["goodput"] == pytest.approx(run["metrics"]["request_throughput"])
    assert run["metrics"]["cost_per_request"] > 0 and run["request_rate"] == "inf"
    assert (tmp_path / "bench-latency-cdf.png").read_bytes()[:4] == b"\x89PNG"

    bad = subprocess.run([*command[:4], "serve", "--base-url", server.base_url, "--slo", "x=1"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "slo=" in bad.stderr and "Traceback" not in bad.stderr


def test_grid_reports_peers_that_cannot_run(tmp_path, tokenizer):
    settings = PeerSettings(peers_dir=tmp_path / "no-peers")
    crashing = PeerServer([sys.executable, "-c", "raise SystemExit(3)"], MODEL, {})
    plans = [ServerPlan("llama-server", functools.partial(PEERS["llama-server"], settings)),
             ServerPlan("crashing", lambda port: crashing)]
    workload = Workload((DatasetSpec("mixed", 1),), (1,), (2,), LoadShape())
    result = run_grid(plans, workload, tokenizer, tmp_path, progress=False, show=lambda _: None)
    assert result.runs == []
    assert "scripts/build_peers.sh" in result.unavailable["llama-server"]
    assert "exited with status 3" in result.unavailable["crashing"]
    assert "llama-server did not run" in comparison_table([], result.unavailable)


def test_sweep_toggles_one_at_a_time_then_together():
    plans = sweep_plans(MODEL, "--dtype float32", ("--no-enable-prefix-caching",
                                                   "--quantization int8"))
    assert [p.label for p in plans] == ["baseline", "--no-enable-prefix-caching",
                                        "--quantization int8", "all toggles"]
    tails = [p.start(8123).command[6:] for p in plans]  # after `... serve --port 8123`
    assert tails == [[MODEL, "--dtype", "float32"],
                     [MODEL, "--dtype", "float32", "--no-enable-prefix-caching"],
                     [MODEL, "--dtype", "float32", "--quantization", "int8"],
                     [MODEL, "--dtype", "float32", "--no-enable-prefix-caching",
                      "--quantization", "int8"]]
