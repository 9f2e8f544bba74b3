"""The AVX-512 BF16 few-rows kernel and oneDNN's product on a packed W (what `Linear` runs past
FEW_ROWS_MAX) against torch's bf16 product (F.linear), per row count, on SmolLM2's shapes; it sets
FEW_ROWS_MAX in tokenmill/model/layers.py (with AMX the kernel and oneDNN both multiply on AMX
tiles from 3 rows). Those products reuse one W, which stays in cache;
a second table times what a decode step does instead: the decoder's four products for each of
SmolLM2's 30 layers, every layer its own W (212 MB, streamed from memory), the few-rows kernel
against the packed product in alternating rounds (the median of --step-rounds).

    python benchmarks/bench_linear.py
    python benchmarks/bench_linear.py --step-rows 1,8,12,16,32   # the step table only: --rows ""
    python benchmarks/bench_linear.py --rows 1,2,3,4,5,6,8,16,32,64,256,2048 \
        --output-json benchmarks/results/bench_linear-intel-xeon-amx-$(date +%F).json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu_kernels
from tokenmill.model.layers import Linear, pack_bf16, packed_bf16

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, save_report, seconds  # noqa: E402
# (out, in) of SmolLM2's products: qkv, o, gate_up, down, lm_head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
LAYERS = 30


def step_products(rows_list: list[int], rounds: int) -> list[dict]:
    """ms of one decode step's decoder products (LAYERS x the four layer shapes, distinct
    weights) at each row count: the few-rows kernel against the packed product."""
    kernels = cpu_kernels()
    layers = [[Linear(torch.randn(n, k).bfloat16()) for n, k in SHAPES[:4]] for _ in range(LAYERS)]
    products = [linear for layer in layers for linear in layer]
    copies = [(linear.packed, linear.few_rows_weight) for linear in products]  # made on first use
    results = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in SHAPES[:4]}}
        paths = {
            "kernel": lambda: [kernels.linear_bf16(inputs[linear.weight.shape[1]], few_rows, None)
                               for linear, (_, few_rows) in zip(products, copies)],
            "packed": lambda: [packed_bf16(inputs[linear.weight.shape[1]], packed, None)
                               for linear, (packed, _) in zip(products, copies)]}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(rounds):
            for name, step in paths.items():
                step()
                start = time.perf_counter()
                step()
                times[name].append((time.perf_counter() - start) * 1e3)
        kernel_ms, packed_ms = (statistics.median(times[n]) for n in ("kernel", "packed"))
        results.append({"step_rows": rows, "layers": LAYERS, "kernel_ms": kernel_ms,
                        "packed_ms": packed_ms, "kernel_over_packed": packed_ms / kernel_ms,
                        "rounds": times})
        print(f"{rows:>5}{kernel_ms:>12.1f}{packed_ms:>12.1f}{packed_ms / kernel_ms:>12.2f}x")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,64")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--step-rows", default="1,8,12,16,32",
                        help="row counts of the decode-step table (empty: none)")
    parser.add_argument("--step-rounds", type=int, default=7)
    parser.add_argument("--output-json", type=Path,
                        default=REPO_ROOT / "benchmarks/results/linear_bf16.json")
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None or not kernels.linear_bf16_available():
        raise SystemExit("bench_linear: this CPU or build has no AVX-512 BF16 kernel")
    results = []
    print(f"{'rows':>5}{'out':>7}{'in':>6}{'torch us':>10}{'kernel us':>11}{'speed-up':>10}"
          f"{'packed us':>11}{'speed-up':>10}")
    for out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features).bfloat16()
        packed = pack_bf16(weight)
        few_rows_weight = Linear(weight).few_rows_weight  # as the engine lays it out here
        for rows in (int(r) for r in args.rows.split(",") if r):
            x = torch.randn(rows, in_features).bfloat16()
            torch_s = seconds(lambda: F.linear(x, weight), args.repeats)
            kernel_s = seconds(lambda: kernels.linear_bf16(x, few_rows_weight, None), args.repeats)
            packed_s = seconds(lambda: packed_bf16(x, packed, None), args.repeats)
            results.append({"rows": rows, "out_features": out_features,
                            "in_features": in_features, "torch_us": torch_s * 1e6,
                            "kernel_us": kernel_s * 1e6, "speedup": torch_s / kernel_s,
                            "packed_us": packed_s * 1e6, "packed_speedup": torch_s / packed_s})
            print(f"{rows:>5}{out_features:>7}{in_features:>6}{torch_s * 1e6:>10.0f}"
                  f"{kernel_s * 1e6:>11.0f}{torch_s / kernel_s:>9.2f}x"
                  f"{packed_s * 1e6:>11.0f}{torch_s / packed_s:>9.2f}x")
    step_rows, step = [int(r) for r in args.step_rows.split(",") if r], []
    if step_rows:
        print(f"\n{LAYERS} layers' products, weights streamed\n{'rows':>5}{'kernel ms':>12}"
              f"{'packed ms':>12}{'kernel wins':>12}")
        step = step_products(step_rows, args.step_rounds)
    save_report(args.output_json, "bench_linear", torch_threads=torch.get_num_threads(),
                results=results, decode_step_products=step)


if __name__ == "__main__":
    main()
