"""How benchmark results are shown: a block of figures per run and comparison tables on the terminal
(Markdown, so they paste into docs as they are), a JSON file, and PNG plots: latency CDFs, and
output throughput against concurrency for sweeps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tokenmill.bench.benchmark import BenchmarkRun
from tokenmill.bench.metrics import BenchmarkMetrics, Distribution


def _number(value: float | None, digits: int = 1) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def _concurrency(run: BenchmarkRun) -> str:
    return "∞" if run.max_concurrency is None else str(run.max_concurrency)


def format_run(run: BenchmarkRun) -> str:
    """vllm bench serve's summary block, with sample counts, errors, goodput, cost and counters."""
    m, s = run.metrics, run.server
    errors = ", ".join(f"{kind}: {count}" for kind, count in sorted(m.errors.items())) or "none"
    cut = " — stopped by the time bound" if run.stopped_by_time_bound else ""
    lines = [f"{'=' * 20} {run.label} · {run.dataset} · concurrency {_concurrency(run)} "
             f"{'=' * 20}",
             f"Requests: {m.num_completed} completed of {m.num_requests} sent "
             f"({m.num_not_sent} not sent){cut}",
             f"Failed: {m.num_failed} ({errors})",
             f"Duration: {m.duration_s:.2f} s; input tokens {m.input_tokens:,} "
             f"({m.cached_tokens:,} cached); output tokens {m.output_tokens:,}"
             f"{'' if m.usage_reported else ' (counted as chunks: no usage from the server)'}",
             f"Throughput: {m.request_throughput:.3f} req/s, {m.output_throughput:.1f} output "
             f"tok/s, {m.total_token_throughput:.1f} total tok/s"]
    if m.slo is not None:
        lines.append(f"Goodput: {m.goodput:.3f} req/s meeting {_slo_text(m)}")
    if m.cost_per_request is not None:
        lines.append(f"Cost: {m.cost_per_request:.6f} per successful request at "
                     f"{m.cost_per_hour} per hour")
    if s.metrics_endpoint:
        lines.append(f"Server: prefix-cache hit rate {_percent(s.prefix_cache_hit_rate)}, "
                     f"preemptions {_number(s.preemptions, 0)}, spec-decode acceptance "
                     f"{_percent(s.spec_decode_acceptance_rate)}")
    else:
        lines.append("Server: no Prometheus /metrics")
    lines += ["", f"{'ms':<6}{'count':>7}{'mean':>10}{'median':>10}{'P90':>10}{'P95':>10}"
                  f"{'P99':>10}"]
    for name, dist in (("TTFT", m.ttft_ms), ("TPOT", m.tpot_ms), ("ITL", m.itl_ms),
                       ("E2EL", m.e2el_ms)):
        lines.append(f"{name:<6}{dist.count:>7}" + "".join(
            f"{_number(v):>10}" for v in (dist.mean, dist.median, dist.p90, dist.p95, dist.p99)))
    for group, g in run.groups.items():
        lines.append(f"  group {group}: {g.num_completed}/{g.num_requests} ok, TTFT P50 "
                     f"{_number(g.ttft_ms.median)} ms (n={g.ttft_ms.count}), TPOT P50 "
                     f"{_number(g.tpot_ms.median)} ms, E2EL P50 {_number(g.e2el_ms.median)} ms")
    return "\n".join(lines)


def _slo_text(m: BenchmarkMetrics) -> str:
    assert m.slo is not None
    limits = [f"{name} <= {limit:g} ms" for name, limit in (
        ("TTFT", m.slo.ttft_ms), ("TPOT", m.slo.tpot_ms), ("E2EL", m.slo.e2el_ms)) if limit]
    return " and ".join(limits)


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def comparison_table(runs: list[BenchmarkRun], unavailable: dict[str, str] | None = None) -> str:
    """One row per run, then one row per group of the runs that have groups, then why each
    unavailable server did not run."""
    header = ("| server | dataset | conc | ok/sent | req/s | output tok/s | TTFT P50 ms | "
              "TTFT P99 ms | TPOT P50 ms | ITL P50 ms | E2EL P50 ms | prefix hit | errors |")
    rows = [header, "|" + "---|" * 4 + "---:|" * 8 + "---|"]
    for run in runs:
        m = run.metrics
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(m.errors.items())) or "–"
        rows.append(f"| {run.label} | {run.dataset} | {_concurrency(run)} | "
                    f"{m.num_completed}/{m.num_requests + m.num_not_sent} | "
                    f"{m.request_throughput:.2f} | {m.output_throughput:.1f} | "
                    f"{_cells(m.ttft_ms, 'median', 'p99')} | {_cells(m.tpot_ms, 'median')} | "
                    f"{_cells(m.itl_ms, 'median')} | {_cells(m.e2el_ms, 'median')} | "
                    f"{_percent(run.server.prefix_cache_hit_rate)} | {errors} |")
    grouped = [run for run in runs if run.groups]
    if grouped:
        rows += ["", "| server | dataset | conc | group | ok | TTFT P50 ms | TTFT P99 ms | "
                     "TPOT P50 ms | E2EL P50 ms |", "|" + "---|" * 4 + "---:|" * 5]
        for run in grouped:
            for group, g in run.groups.items():
                rows.append(f"| {run.label} | {run.dataset} | {_concurrency(run)} | {group} | "
                            f"{g.num_completed}/{g.num_requests} | "
                            f"{_cells(g.ttft_ms, 'median', 'p99')} | "
                            f"{_cells(g.tpot_ms, 'median')} | {_cells(g.e2el_ms, 'median')} |")
    for name, reason in (unavailable or {}).items():
        rows.append(f"\n{name} did not run: {reason.splitlines()[0] if reason else ''}")
    return "\n".join(rows)


def ratio_table(runs: list[BenchmarkRun], reference: str) -> str:
    """How the reference server compares with each other one on the same dataset and
    concurrency: output throughput as reference / other (above 1: the reference leads) and TTFT
    P50 as other / reference (above 1: the reference answers first)."""
    rows = [f"| dataset | conc | other server | {reference} output tok/s ÷ other | other TTFT "
            f"P50 ÷ {reference} |", "|---|---|---|---:|---:|"]
    for base in (run for run in runs if run.label == reference):
        for other in runs:
            if other.label == reference or (other.dataset, other.max_concurrency) != (
                    base.dataset, base.max_concurrency):
                continue
            throughput = base.metrics.output_throughput / other.metrics.output_throughput \
                if other.metrics.output_throughput else math.inf
            ttft = other.metrics.ttft_ms.median / base.metrics.ttft_ms.median
            rows.append(f"| {base.dataset} | {_concurrency(base)} | {other.label} | "
                        f"{_number(throughput, 2)} | {_number(ttft, 2)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def _cells(dist: Distribution, *fields: str) -> str:
    return " | ".join(_number(getattr(dist, f)) for f in fields)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(payload), indent=1, ensure_ascii=False) + "\n")


def _json_safe(value: object) -> object:
    """JSON has no NaN or infinity: an empty sample's NaN becomes null, an infinite rate 'inf'."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as pyplot
    return pyplot


def plot_latency_cdfs(runs: list[BenchmarkRun], path: Path, title: str = "") -> Path:
    """TTFT, TPOT and E2EL cumulative distributions, one line per run."""
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(1, 3, figsize=(15, 4.2))
    for axis, (metric, name) in zip(axes, (("ttft", "TTFT"), ("tpot", "TPOT"),
                                           ("e2el", "E2EL"))):
        for run in runs:
            values = sorted(v * 1000.0 for v in run.latencies_s[metric])
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                axis.step([values[0], *values], [0.0, *fractions], where="post",
                          label=f"{run.label} c={_concurrency(run)} (n={len(values)})")
        axis.set_xscale("log")
        axis.set_xlabel(f"{name} (ms, log scale)")
        axis.set_ylabel("fraction of requests")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.suptitle(title or "latency CDFs")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return path


def plot_throughput(runs: list[BenchmarkRun], path: Path, title: str = "") -> Path:
    """Output tokens/s against concurrency, one line per server (or variant) and dataset."""
    pyplot = _pyplot()
    figure, axis = pyplot.subplots(figsize=(7, 4.5))
    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for run in runs:
        if run.max_concurrency is not None:
            lines.setdefault((run.label, run.dataset), []).append(
                (run.max_concurrency, run.metrics.output_throughput))
    for (label, dataset), points in lines.items():
        points.sort()
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                  label=f"{label} · {dataset}")
    axis.set_xscale("log", base=2)
    ticks = sorted({c for points in lines.values() for c, _ in points})
    axis.set_xticks(ticks, labels=[str(t) for t in ticks])
    axis.minorticks_off()
    axis.set_xlabel("max concurrency")
    axis.set_ylabel("output tokens/s")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=7)
    axis.set_title(title or "output throughput against concurrency")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return path
