"""The C++ decode stack (model/decode_layers.py) against the eager layers, in one process.

For each weight format one engine is loaded; single-stream greedy generations of --output-len
tokens then alternate between the model with its DecodePlan and the same model with the plan
removed (every step through the Python layers), --rounds times each, so both see the same
machine. Prints the median decode tokens/s of each and their ratio, and saves JSON.

    python benchmarks/bench_decode_plan.py --configs none,int8,int4,gguf
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import DEFAULT_MODEL

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, save_report  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the ships she watches."


def decode_rate(llm: LLM, output_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    output = llm.generate([PROMPT], params, use_tqdm=False)[0]
    metrics = output.metrics
    return (len(output.outputs[0].token_ids) - 1) / (metrics.last_token_time
                                                     - metrics.first_token_time)


def measure(model: str, quantization: str, output_len: int, rounds: int) -> dict:
    llm = LLM(model, dtype="bfloat16", quantization=quantization)
    runner_model = llm.engine.runner.model
    plan = runner_model.decode_plan
    if plan is None:
        return {"quantization": quantization, "plan": None}
    decode_rate(llm, 8)  # warm-up
    rates: dict[str, list[float]] = {"plan": [], "eager": []}
    for _ in range(rounds):
        for label in ("plan", "eager"):
            runner_model.decode_plan = plan if label == "plan" else None
            rates[label].append(decode_rate(llm, output_len))
    runner_model.decode_plan = plan
    medians = {label: statistics.median(values) for label, values in rates.items()}
    return {"quantization": quantization, "plan": True, "tokens_per_s": rates, "median": medians,
            "plan_over_eager": medians["plan"] / medians["eager"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--configs", default="none,int8,int4,gguf")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-json", type=Path,
                        default=REPO_ROOT / "benchmarks/results/decode_plan.json")
    args = parser.parse_args()
    results = [measure(args.model, q, args.output_len, args.rounds)
               for q in args.configs.split(",")]
    print(f"{'format':8} {'plan tok/s':>11} {'eager tok/s':>12} {'plan / eager':>13}")
    for result in results:
        if result["plan"] is None:
            print(f"{result['quantization']:8} no plan: the step stays in Python")
            continue
        median = result["median"]
        print(f"{result['quantization']:8} {median['plan']:11.1f} {median['eager']:12.1f} "
              f"{result['plan_over_eager']:12.2f}x")
    save_report(args.output_json, "decode_plan", model=args.model, output_len=args.output_len,
                rounds=args.rounds, results=results)


if __name__ == "__main__":
    main()
