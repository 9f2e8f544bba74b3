"""How fast one-row products stream weights that are not in cache, as decode reads them.

Every decode step reads each weight once, from memory (SmolLM2's 270 MB in bf16 is many times the
last-level cache), so its speed is the bytes per second a one-row product pulls from memory. This
prints that rate for torch's bf16 product and tokenmill's bf16, int8 and int4 kernels on
SmolLM2's shapes, beside the machine's ceiling: a plain sum over the same bytes, one long stream.
Each figure cycles through copies of the weight totalling `--megabytes`, so nothing is reused
from cache, and takes the median of `--repeats` passes.

    python benchmarks/bench_weight_streaming.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu_kernels
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, save_report  # noqa: E402

# (out, in) of SmolLM2's products: qkv, gate_up, down, lm_head
SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]


def gigabytes_per_second(calls: list[Callable[[], object]], nbytes: int, repeats: int) -> float:
    """Median rate over `repeats` passes through every call (one pass warms up)."""
    rates = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for call in calls:
            call()
        rates.append(nbytes * len(calls) / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=int, default=512,
                        help="bf16 weight bytes cycled through per shape")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output-json", type=Path,
                        default=REPO_ROOT / "benchmarks/results/weight_streaming.json")
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None or not kernels.linear_bf16_available():
        raise SystemExit("bench_weight_streaming: this CPU or build has no AVX-512 BF16 kernel")
    columns = ["sum (ceiling)", "torch bf16", "tokenmill bf16", "tokenmill int8",
               "tokenmill int4"]
    print(f"{'out':>6}{'in':>6}" + "".join(f"{c:>16}" for c in columns) + "   (GB/s)")
    results = []
    for out_features, in_features in SHAPES:
        copies = max(2, args.megabytes * 2**20 // (out_features * in_features * 2))
        weights = [torch.randn(out_features, in_features).bfloat16() for _ in range(copies)]
        x = torch.randn(1, in_features).bfloat16()
        bf16_bytes = out_features * in_features * 2
        rates = {
            "sum (ceiling)": gigabytes_per_second([w.sum for w in weights], bf16_bytes,
                                                  args.repeats),
            "torch bf16": gigabytes_per_second(
                [lambda w=w: F.linear(x, w) for w in weights], bf16_bytes, args.repeats),
            "tokenmill bf16": gigabytes_per_second(
                [lambda w=w: kernels.linear_bf16(x, w, None) for w in weights], bf16_bytes,
                args.repeats),
        }
        for name, quantize in (("tokenmill int8", Int8Linear.quantize),
                               ("tokenmill int4", lambda w: Int4Linear.quantize(w, 128))):
            layers = [quantize(w) for w in weights]
            nbytes = sum(t.nbytes for t in layers[0].buffers() if t is not None)
            rates[name] = gigabytes_per_second([lambda l=l: l(x) for l in layers],
                                               nbytes, args.repeats)
            del layers
        del weights
        results.append({"out_features": out_features, "in_features": in_features,
                        "gb_per_s": rates})
        print(f"{out_features:>6}{in_features:>6}" + "".join(f"{rates[c]:>16.1f}" for c in columns))
    save_report(args.output_json, "bench_weight_streaming", torch_threads=torch.get_num_threads(),
                megabytes=args.megabytes, results=results)


if __name__ == "__main__":
    main()
