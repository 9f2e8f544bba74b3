"""bench_engine.py's tokenmill run, this checkout against another commit, in alternating rounds.

This VM's speed moves up to 1.7x within the hour, so two engine builds are only compared in
rounds that alternate them (the one that goes first swaps each round), and the figures are the
medians. The other commit's tokenmill runs from a temporary git worktree at that revision, with
its own kernels, under this checkout's bench_engine.py (so that both builds run the same
workload and options); this checkout runs as it stands, uncommitted changes included.

    python benchmarks/bench_engine_ab.py --against HEAD --rounds 3
    python benchmarks/bench_engine_ab.py --against 96ab027 --dtype float32
    python benchmarks/bench_engine_ab.py --against HEAD --output-len 2   # mostly prefill
    python benchmarks/bench_engine_ab.py --against HEAD --quantization int4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, save_report  # noqa: E402

FIGURES = ("wall_s", "output_tokens_per_s", "single_stream_decode_tokens_per_s", "peak_rss_mib")


def run_engine(tree: Path, dtype: str, quantization: str, output_len: int, report: Path) -> dict:
    """bench_engine.py's tokenmill figures for the tokenmill of the checkout at `tree`."""
    subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks/bench_engine.py"), "--engines",
                    "tokenmill", "--dtypes", dtype, "--quantization", quantization,
                    "--output-len", str(output_len), "--output-json", str(report)],
                   cwd=tree, env=os.environ | {"PYTHONPATH": str(tree)}, check=True,
                   stdout=subprocess.DEVNULL)
    engine = json.loads(report.read_text())["engines"]["tokenmill"]
    return {figure: engine[figure] for figure in FIGURES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", required=True, help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--output-len", type=int, default=128,
                        help="output tokens a prompt (2: the run is mostly its prefill)")
    parser.add_argument("--output-json", type=Path,
                        default=REPO_ROOT / "benchmarks/results/bench_engine_ab.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokenmill-ab-") as scratch:
        other = Path(scratch) / "other"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(other),
                        args.against], cwd=REPO_ROOT, check=True)
        try:
            trees = {"this checkout": REPO_ROOT, args.against: other}
            rounds = []
            for index in range(args.rounds):
                for name, tree in list(trees.items())[::-1 if index % 2 else 1]:
                    figures = run_engine(tree, args.dtype, args.quantization, args.output_len,
                                         Path(scratch) / "report.json")
                    rounds.append({"round": index + 1, "build": name, **figures})
                    print(f"round {index + 1} {name:>14}: " + ", ".join(
                        f"{figure} {value:.1f}" for figure, value in figures.items()),
                          flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)],
                           cwd=REPO_ROOT, check=True)
    medians = {name: {figure: statistics.median(r[figure] for r in rounds if r["build"] == name)
                      for figure in FIGURES} for name in trees}
    for name, figures in medians.items():
        print(f"median {name:>14}: " + ", ".join(f"{f} {v:.1f}" for f, v in figures.items()))
    save_report(args.output_json, "bench_engine A/B", against=args.against, dtype=args.dtype,
                quantization=args.quantization,
                output_len=args.output_len,
                command="python benchmarks/bench_engine.py --engines tokenmill, alternating",
                rounds=rounds, medians=medians)


if __name__ == "__main__":
    main()
