"""Decode speed of the weight formats: bf16, int8, int4 (group 128) and gguf, beside llama.cpp.

In one run, on the same prompts (token slices of pydoc_data.topics) and the same weights: each
format's single-stream decode tokens/s (the median of --single-runs prompts, each alone) and its
output tokens/s with --num-seqs concurrent sequences, each format alone in a fresh subprocess;
then llama.cpp's `llama-bench -p 0 -n 128` (tg128) on the model's GGUF file, when a llama-bench
binary is under ~/.cache/tokenmill/peers (or given by --llama-bench), else reported as not built.
All of that --rounds times, the formats taking turns, so that a minute when this machine's memory
is slow falls on every format alike: each figure is the median over rounds, and the targets are
judged on those medians (the ratios of every round are saved too). It prints the targets beside
the figures and writes benchmarks/results/bench_quant.json.

    python benchmarks/bench_quant.py                       # about 3 minutes a round for SmolLM2
    python benchmarks/bench_quant.py --output-len 8 --num-seqs 4 --configs none,int8 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import build_prompts  # noqa: E402
from common import git_commit, machine_info  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.model.loader import DEFAULT_MODEL, resolve_model_path  # noqa: E402

CONFIGS = ("none", "int8", "int4", "gguf")
PEERS_DIR = Path.home() / ".cache" / "tokenmill" / "peers"
TARGETS = {"int8_over_bf16_single_stream": 1.5, "int4_over_bf16_single_stream": 2.0,
           "best_quantized_over_llama_bench_tg128": 1.0,
           "worst_quantized_over_bf16_at_num_seqs": 1.0}
Result = dict[str, Any]


def run_config(spec: dict[str, Any]) -> Result:
    """One format in this process: warm-up, single-stream decode, then --num-seqs at once."""
    llm = LLM(spec["model"], dtype="bfloat16", quantization=spec["quantization"],
              quant_group_size=128, max_num_seqs=spec["num_seqs"], num_threads=spec["threads"])
    prompts, output_len = spec["prompts"], spec["output_len"]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([spec["warmup_prompt"]], SamplingParams(temperature=0.0, max_tokens=8,
                                                         ignore_eos=True), use_tqdm=False)
    singles = [llm.generate([prompt], params, use_tqdm=False)[0].metrics
               for prompt in prompts[:spec["single_runs"]]]
    single_rates = [(output_len - 1) / (m.last_token_time - m.first_token_time) for m in singles]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    if lengths != [output_len] * len(prompts):
        raise RuntimeError(f"expected {len(prompts)} x {output_len} tokens, got {lengths}")
    return {"single_stream_decode_tokens_per_s": statistics.median(single_rates),
            "single_stream_runs_tokens_per_s": single_rates,
            "concurrent_output_tokens_per_s": sum(lengths) / wall, "concurrent_wall_s": wall,
            "model_bytes": llm.engine.runner.model_bytes}


def run_in_subprocess(spec: dict[str, Any]) -> Result:
    with tempfile.TemporaryDirectory(prefix="bench_quant.") as folder:
        spec_path, result_path = Path(folder) / "spec.json", Path(folder) / "result.json"
        spec_path.write_text(json.dumps(spec))
        subprocess.run([sys.executable, __file__, "--worker", str(spec_path), str(result_path)],
                       check=True, env=os.environ | {"TQDM_DISABLE": "1"})
        return json.loads(result_path.read_text())


def find_llama_bench(given: str | None) -> Path | None:
    if given:
        return Path(given)
    found = sorted(p for p in PEERS_DIR.rglob("llama-bench")
                   if p.is_file() and os.access(p, os.X_OK)) if PEERS_DIR.is_dir() else []
    return found[0] if found else None


def run_llama_bench(binary: Path | None, model_path: Path, output_len: int,
                    threads: int | None) -> Result:
    if binary is None:
        return {"status": f"not built (no llama-bench under {PEERS_DIR})"}
    command = [str(binary), "-m", str(model_path), "-p", "0", "-n", str(output_len), "-o", "json"]
    if threads:
        command += ["-t", str(threads)]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        return {"status": f"failed: {completed.stderr.strip()[-300:]}", "command": command}
    [entry] = [e for e in json.loads(completed.stdout) if e.get("n_gen") == output_len]
    return {"status": "ok", "command": command, "tokens_per_s": entry["avg_ts"],
            "stddev_tokens_per_s": entry.get("stddev_ts"), "threads": entry.get("n_threads"),
            "build_commit": entry.get("build_commit")}


def median_result(per_round: list[Result]) -> Result:
    """A format's (or llama-bench's) figures: each number the median over the rounds."""
    ok = [r for r in per_round if r.get("status", "ok") == "ok"]
    if not ok:
        return per_round[0]

    def numbers(key: str) -> list[float] | None:
        values = [r.get(key) for r in ok]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        return values if numeric else None

    return ok[0] | {key: statistics.median(numbers(key)) for key in ok[0] if numbers(key)}


def ratios(results: dict[str, Result], llama: Result) -> dict[str, float | None]:
    def single(name: str) -> float | None:
        return results[name]["single_stream_decode_tokens_per_s"] if name in results else None

    def over(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    quantized = [n for n in results if n != "none"]
    best = max((single(n) for n in quantized), default=None)
    worst_batch = min((results[n]["concurrent_output_tokens_per_s"] for n in quantized),
                      default=None)
    bf16_batch = results["none"]["concurrent_output_tokens_per_s"] if "none" in results else None
    return {"int8_over_bf16_single_stream": over(single("int8"), single("none")),
            "int4_over_bf16_single_stream": over(single("int4"), single("none")),
            "best_quantized_over_llama_bench_tg128": over(best, llama.get("tokens_per_s")),
            "worst_quantized_over_bf16_at_num_seqs": over(worst_batch, bf16_batch)}


def print_report(report: dict[str, Any]) -> None:
    workload = report["workload"]
    print(f"\n== bench_quant: {report['model']}, bf16 activations, {workload['output_len']} "
          f"tokens a sequence, {workload['num_seqs']} concurrent sequences")
    concurrent = f"{workload['num_seqs']} seqs tok/s"
    print(f"{'format':<8}{'weights MiB':>12}{'1-stream tok/s':>16}{concurrent:>16}")
    for name, r in report["configs"].items():
        print(f"{name:<8}{r['model_bytes'] / 2**20:>12.1f}"
              f"{r['single_stream_decode_tokens_per_s']:>16.1f}"
              f"{r['concurrent_output_tokens_per_s']:>16.1f}")
    llama = report["llama_bench"]
    shown = f"{llama['tokens_per_s']:.1f} tok/s" if llama["status"] == "ok" else llama["status"]
    print(f"llama-bench tg{workload['output_len']}: {shown}")
    by_round = [r["ratios"] for r in report["rounds"]]
    for name, value in report["ratios"].items():
        verdict = "n/a" if value is None else \
            f"{value:.2f}x {'met' if value >= TARGETS[name] else 'MISSED'}"
        rounds = " / ".join("n/a" if r[name] is None else f"{r[name]:.2f}" for r in by_round)
        print(f"{name}: {verdict} (target >= {TARGETS[name]:g}x; by round {rounds})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name or .gguf file")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="weight formats (--quantization values), bf16 activations")
    parser.add_argument("--output-len", type=int, default=128, help="tokens a sequence (tg128)")
    parser.add_argument("--num-seqs", type=int, default=32, help="concurrent sequences")
    parser.add_argument("--single-runs", type=int, default=5,
                        help="single-stream generations a format a round (the median counts)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times every format and llama-bench run, taking turns")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads, and llama-bench -t (default: each one's default)")
    parser.add_argument("--llama-bench", help="llama-bench binary (default: under ~/.cache/"
                                              "tokenmill/peers)")
    parser.add_argument("--output-json", default="benchmarks/results/bench_quant.json")
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        spec_path, result_path = args.worker
        result_path.write_text(json.dumps(run_config(json.loads(spec_path.read_text()))))
        return
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown format(s) {unknown}; choose from {', '.join(CONFIGS)}")
    model_path = resolve_model_path(args.model)
    prompts, warmup_prompt = build_prompts(model_path, args.num_seqs)
    rounds: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        results = {}
        for name in configs:  # one at a time: they would share the cores
            print(f"[bench_quant] round {round_index + 1}: running {name}", flush=True)
            results[name] = run_in_subprocess({
                "model": args.model, "quantization": name, "prompts": prompts,
                "warmup_prompt": warmup_prompt, "output_len": args.output_len,
                "num_seqs": args.num_seqs, "threads": args.threads,
                "single_runs": args.single_runs})
        print(f"[bench_quant] round {round_index + 1}: running llama-bench", flush=True)
        llama = run_llama_bench(find_llama_bench(args.llama_bench), model_path, args.output_len,
                                args.threads)
        rounds.append({"configs": results, "llama_bench": llama,
                       "ratios": ratios(results, llama)})
    results = {name: median_result([r["configs"][name] for r in rounds]) for name in configs}
    llama = median_result([r["llama_bench"] for r in rounds])
    report = {"benchmark": "bench_quant", "model": args.model, "model_path": str(model_path),
              "workload": {"output_len": args.output_len, "num_seqs": args.num_seqs,
                           "prompt_lengths": [len(p) for p in prompts], "greedy": True,
                           "ignore_eos": True, "dtype": "bfloat16", "int4_group_size": 128,
                           "prompt_source": "disjoint token slices of pydoc_data.topics"},
              "machine": machine_info() | {"threads_requested": args.threads},
              "git": git_commit(), "configs": results, "llama_bench": llama,
              "ratios": ratios(results, llama), "targets": TARGETS, "rounds": rounds}
    print_report(report)
    path = Path(args.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
