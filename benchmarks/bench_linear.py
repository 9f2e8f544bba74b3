"""The AVX-512 BF16 few-rows kernel and oneDNN's product on a packed W (what `Linear` runs past
FEW_ROWS_MAX) against torch's bf16 product (F.linear), per row count, on SmolLM2's shapes; it sets
FEW_ROWS_MAX in tokenmill/model/layers.py (one value for CPUs with AMX, where torch
multiplies on AMX tiles, one for those without).

    python benchmarks/bench_linear.py
    python benchmarks/bench_linear.py --rows 1,2,3,4,5,6,8,16,32,64,256,2048 \
        --output-json benchmarks/results/linear_bf16-amx.json   # on a CPU with AMX
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu_kernels
from tokenmill.model.layers import Linear, pack_bf16, packed_bf16

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, save_report, seconds  # noqa: E402
# (out, in) of SmolLM2's products: qkv, o, gate_up, down, lm_head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,64")
    parser.add_argument("--repeats", type=int, default=40)
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
        for rows in (int(r) for r in args.rows.split(",")):
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
    save_report(args.output_json, "bench_linear", torch_threads=torch.get_num_threads(),
                results=results)


if __name__ == "__main__":
    main()
