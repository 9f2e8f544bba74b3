"""Packed int8/int4 CPU kernels against de-quantize + GEMM, per row count: where each path wins.

For SmolLM2's and Qwen2.5-0.5B's projection shapes, each activation dtype and each row count
(tokens in a step) it times the float GEMM, tokenmill's few-row kernels
(kernels/linear_quant.cpp, bfloat16 on AVX-512 BF16 only), aten's `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu`, and the de-quantize paths of tokenmill.quant, and prints, per
kernel, the largest row count at which it still beats de-quantize + GEMM: CPU_PACKED_MAX_ROWS
in tokenmill/quant/linear.py (a win at the largest count measured is taken as no limit).
Run it on an otherwise idle machine: other processes on the cores move the crossover.

    python benchmarks/bench_quant_kernels.py
    python benchmarks/bench_quant_kernels.py --rows 1,8 --dtypes float32 --min-time 0.05
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from tokenmill.config import DTYPES  # noqa: E402
from tokenmill.quant.int4 import Int4Linear  # noqa: E402
from tokenmill.quant.int8 import Int8Linear  # noqa: E402
from tokenmill.quant.linear import (NO_ROW_LIMIT, PACKED_KERNELS, QuantizedLinear,  # noqa: E402
                                    own_kernels)

# (name, out_features, in_features): the fused products of a decoder layer, and SmolLM2's lm_head.
SHAPES = (("smollm2.qkv", 960, 576), ("smollm2.o_proj", 576, 576),
          ("smollm2.gate_up", 3072, 576), ("smollm2.down", 576, 1536),
          ("smollm2.lm_head", 49152, 576), ("qwen0.5b.qkv", 1152, 896),
          ("qwen0.5b.gate_up", 9728, 896), ("qwen0.5b.down", 896, 4864))


def time_call(call: Callable[[], object], min_time: float) -> float:
    """Median seconds of one call, over repeats filling at least `min_time` seconds."""
    call()  # warm-up: first-call allocations and kernel dispatch
    times: list[float] = []
    deadline = time.perf_counter() + min_time
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paths(weight: torch.Tensor, group_size: int) -> dict[str, Callable[[torch.Tensor], object]]:
    own = own_kernels(weight.device, weight.dtype, *weight.shape) is not None
    kernels = [kernel for kernel in PACKED_KERNELS if kernel == "aten" or own]

    def each(make: Callable[[int, str | None], QuantizedLinear], name: str) -> dict:
        return {**{f"{name}_{kernel}": make(NO_ROW_LIMIT, kernel) for kernel in kernels},
                f"{name}_dequant": make(0, None)}

    return {"float": lambda x: F.linear(x, weight),
            **each(lambda rows, kernel: Int8Linear.quantize(
                weight, packed_max_rows=rows, packed_kernel=kernel), "int8"),
            **each(lambda rows, kernel: Int4Linear.quantize(
                weight, group_size, packed_max_rows=rows, packed_kernel=kernel),
                f"int4_g{group_size}")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64,256,1024")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument("--max-time", type=float, default=0.5,
                        help="a path slower than this and 10x the float GEMM isn't timed at "
                        "more rows")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results"
                        / "quant_kernels.json")
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    timings: list[dict] = []
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        for shape_name, out_features, in_features in SHAPES:
            weight = (torch.randn(out_features, in_features) * 0.02).to(dtype)
            float_seconds: dict[int, float] = {}
            for path, layer in paths(weight, args.group_size).items():
                for rows in row_counts:
                    x = torch.randn(rows, in_features).to(dtype)
                    with torch.inference_mode():
                        seconds = time_call(lambda: layer(x), args.min_time)
                    float_seconds.setdefault(rows, seconds)  # "float" runs first
                    timings.append({"dtype": dtype_name, "shape": shape_name, "path": path,
                                    "rows": rows, "us": round(seconds * 1e6, 1)})
                    print(f"{dtype_name:9} {shape_name:17} {path:17} rows={rows:4} "
                          f"{seconds * 1e6:10.1f} us", flush=True)
                    if seconds > max(args.max_time, 10 * float_seconds[rows]):
                        # More rows only take longer, and this path has lost: don't wait.
                        timings += [{"dtype": dtype_name, "shape": shape_name, "path": path,
                                     "rows": more, "us": None} for more in row_counts
                                    if more > rows]
                        break
    load = os.getloadavg()[1]
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "group_size": args.group_size, "load_average_5min": round(load, 2),
              "note": (f"the machine was busy (load {load:.1f} on {os.cpu_count()} cores): "
                       "re-run alone before trusting the crossovers"
                       if load > 0.5 * (os.cpu_count() or 1) else "the machine was idle"),
              "timings": timings,
              "packed_wins_up_to_rows": crossovers(timings, row_counts, args.group_size)}
    print(json.dumps(result["packed_wins_up_to_rows"], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


def crossovers(timings: list[dict], row_counts: list[int], group_size: int) -> dict:
    """Per format, kernel and dtype: the largest row count up to which the packed kernel beats
    de-quantize + GEMM on most shapes, at that count and every smaller one (0: never). A call
    too slow to time loses to one that was timed."""
    us = {(t["dtype"], t["shape"], t["path"], t["rows"]): t["us"] for t in timings}
    timed_paths = {(t["dtype"], t["path"]) for t in timings}
    result: dict[str, int] = {}
    for dtype in sorted({t["dtype"] for t in timings}):
        for fmt in ("int8", f"int4_g{group_size}"):
            for kernel in PACKED_KERNELS:
                if (dtype, f"{fmt}_{kernel}") not in timed_paths:
                    continue
                wins = 0
                for rows in sorted(row_counts):
                    votes = [_faster(us[(dtype, shape, f"{fmt}_{kernel}", rows)],
                                     us[(dtype, shape, f"{fmt}_dequant", rows)])
                             for shape, _, _ in SHAPES]
                    if 2 * sum(votes) <= len(votes):
                        break
                    wins = rows
                result[f"{fmt}/{kernel}/{dtype}"] = wins
    return result


def _faster(first: float | None, second: float | None) -> bool:
    return first is not None and (second is None or first < second)

if __name__ == "__main__":
    main()
