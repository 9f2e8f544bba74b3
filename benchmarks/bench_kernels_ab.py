"""This checkout's bf16, int8 and int4 product kernels, or its decode attention, against another
commit's, in one process.

This VM's run-to-run noise (single-stream decode moves 10 to 40% between runs) hides a 10 to 15%
change in a kernel, so both builds are timed in one process, interleaved, on the same weights.
A pass calls every decode product of SmolLM2 in model order (30 layers of qkv, o, gate_up and down,
then the lm_head), each with its own random weight, so every weight comes from memory as in decode;
bf16 weights go to linear_bf16 as they lie (its few-row tiles, or AMX tiles from 3 rows), int4
layers are group 128 with rotated inputs, as `gptq-hadamard` makes them (the lm_head without), and
gguf layers Q4_1's groups of 32 through linear_int4_exact, the lm_head Q8_0's int8 codes with a
scale per 32 through linear_int8, as SmolLM2's GGUF file holds them. The `attention` format instead
runs bf16 decode attention over 30 layers' own KV caches (SmolLM2's heads, blocks of 16), `--rows`
sequences of 84 to 364 cached tokens (the prompts of bench_engine.py plus half their output;
`--context N`: N each), so the cache comes from memory as in a decode step; `prefill` runs the bf16
prefill attention of a 2,048-token step, sequences of `--rows` tokens each attended from position
0; `attention-int8` and `prefill-int8` the same over int8 caches (`--kv-cache-dtype int8`'s rows),
and `attention-in-cache` the bf16 pass with every sequence on one sequence's blocks, which stay in
cache: the kernel's arithmetic alone; `sample`, `sample-top-p` and `sample-top-k` one step's draws
(kernels/sampling.cpp) for `--rows` sequences; `kv-write` and `kv-write-int8` one step's K/V
written into 30 layers' caches, `--rows` tokens. The builds take turns going first; the figure is
the median pass, in ms. The other commit's kernels are built from its `tokenmill/kernels` sources,
with this checkout's flags.

    python benchmarks/bench_kernels_ab.py --against 12e58c7 --rows 1,32
    python benchmarks/bench_kernels_ab.py --against 10226fd --formats attention --rows 32,64
    python benchmarks/bench_kernels_ab.py --against HEAD --formats attention --rows 1 --context 4000
"""

from __future__ import annotations

import argparse
import hashlib
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch.utils.cpp_extension import load_inline

from tokenmill.kernels import CFLAGS, FUNCTIONS, SOURCES, cpu_kernels
from tokenmill.model.kv_int8 import quantize_rows
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.linear import QuantizedLinear
from tokenmill.quant.rotation import rotation_signs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, save_report  # noqa: E402

LAYERS = 30
# SmolLM2's attention: query heads, KV heads, head_dim; the engine's block size
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (out, in) of qkv, o, gate_up and down
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)


def kernels_at(revision: str) -> ModuleType:
    """The C++ kernels as they were at `revision`."""
    def show(name: str) -> str:
        """The file at `revision`; empty where it didn't exist yet."""
        shown = subprocess.run(["git", "show", f"{revision}:tokenmill/kernels/{name}"],
                               cwd=REPO_ROOT, capture_output=True, text=True)
        return shown.stdout if shown.returncode == 0 else ""

    source = "\n".join(show(name) for name in SOURCES)
    functions = [name for name in FUNCTIONS if re.search(rf"\b{name}\(", source)]
    digest = hashlib.sha256("\n".join([source, *CFLAGS]).encode()).hexdigest()[:12]
    return load_inline(name=f"tokenmill_kernels_ab_{digest}", cpp_sources=[source],
                       functions=functions, extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"])


def model_layers(quantization: str) -> list[QuantizedLinear | torch.Tensor]:
    shapes = LAYER_SHAPES * LAYERS + [LM_HEAD]
    layers = []
    for index, (out_features, in_features) in enumerate(shapes):
        weight = torch.randn(out_features, in_features).bfloat16()
        if quantization == "bf16":
            layers.append(weight)
        elif quantization == "int8":
            layers.append(Int8Linear.quantize(weight))
        elif quantization == "gguf" and index == len(shapes) - 1:  # SmolLM2's Q8_0 lm_head
            codes = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
            scales = torch.rand(out_features, in_features // 32) / 64
            layers.append(Int8Linear(codes, scales, None, torch.bfloat16, exact=True))
        elif quantization == "gguf":  # Q4_1's layout: groups of 32, linear_int4_exact
            layers.append(Int4Linear.quantize(weight, 32))
        else:
            rotation = rotation_signs(in_features) if index < len(shapes) - 1 else None
            layers.append(Int4Linear.quantize(weight, 128, input_rotation=rotation))
    return layers


def products_pass(quantization: str, rows: int) -> Callable[[ModuleType], None]:
    """One decode step's products in model order, each with its own weight."""
    layers = model_layers(quantization)
    inputs = {k: torch.randn(rows, k).bfloat16() for k in {width(l) for l in layers}}
    return lambda kernels: [product(kernels, l, inputs[width(l)]) for l in layers]


def width(layer: QuantizedLinear | torch.Tensor) -> int:
    return layer.shape[1] if isinstance(layer, torch.Tensor) else layer.in_features


def kv_cache(shape: tuple[int, ...], int8: bool) -> torch.Tensor:
    """Random K or V rows in bf16, or as an int8 cache holds them (codes and a scale a row)."""
    values = torch.randn(shape)
    return quantize_rows(values) if int8 else values.bfloat16()


def attention_pass(batch: int, context: int | None = None, int8: bool = False,
                   in_cache: bool = False) -> Callable[[ModuleType], None]:
    """One decode step's attention: 30 layers, each over its own bf16 (or int8) KV cache;
    `context` cached tokens a sequence, else 84 to 364 (attention_lengths); `in_cache`: every
    sequence on the same blocks (attention_over's `shared`)."""
    return attention_over(attention_lengths(batch, context), int8, shared=in_cache)


def attention_lengths(batch: int, context: int | None = None) -> torch.Tensor:
    """Cached tokens of each of `batch` sequences: `context`, else drawn from 84 to 364."""
    return torch.randint(84, 365, (batch,)) if context is None else torch.full((batch,), context)


def attention_over(lengths: torch.Tensor, int8: bool = False,
                   shared: bool = False) -> Callable[[ModuleType], None]:
    """attention_pass over sequences of these lengths; `shared`: every sequence reads the same
    blocks (the longest one's), which then stay in cache, so the pass times the arithmetic."""
    batch = lengths.shape[0]
    blocks = (lengths + BLOCK - 1) // BLOCK
    if shared:
        tables = torch.arange(int(blocks.max())).expand(batch, -1).contiguous()
    else:
        tables = torch.zeros(batch, int(blocks.max()), dtype=torch.long)
        for b, start in enumerate((blocks.cumsum(0) - blocks).tolist()):
            tables[b, :blocks[b]] = torch.arange(start, start + int(blocks[b]))
    shape = (int(blocks.max() if shared else blocks.sum()), BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(kv_cache(shape, int8), kv_cache(shape, int8)) for _ in range(LAYERS)]
    q = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()
    out = torch.empty_like(q)
    return lambda kernels: [kernels.paged_decode_attention(q, k, v, tables, lengths,
                                                           HEAD_DIM ** -0.5, out)
                            for k, v in caches]


def prefill_pass(length: int, int8: bool = False) -> Callable[[ModuleType], None]:
    """A 2,048-token prefill step's attention: 2048 // length sequences of `length` tokens, each
    one chunk from position 0, over 30 layers' own bf16 (or int8) KV caches (the chunk's K and
    V in place, as the step writes them before attending)."""
    sequences = 2048 // length
    blocks = (length + BLOCK - 1) // BLOCK
    shape = (sequences * blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(kv_cache(shape, int8), kv_cache(shape, int8)) for _ in range(LAYERS)]
    tables = torch.arange(sequences * blocks).view(sequences, blocks)
    positions = torch.arange(1, length + 1)
    q = torch.randn(length, HEADS, HEAD_DIM).bfloat16()
    out = torch.empty_like(q)
    return lambda kernels: [kernels.paged_prefill_attention(q, k, v, tables[s], positions,
                                                            HEAD_DIM ** -0.5, out)
                            for k, v in caches for s in range(sequences)]


def kv_write_pass(tokens: int, int8: bool) -> Callable[[ModuleType], None]:
    """One step's K/V writes into 30 layers' caches (bf16, or int8 rows quantized on the way),
    `tokens` tokens scattered over the pool."""
    shape = (4096, BLOCK, KV_HEADS, HEAD_DIM + 4 * int8)
    caches = [tuple(torch.zeros(shape, dtype=torch.int8 if int8 else torch.bfloat16)
                    for _ in range(2)) for _ in range(LAYERS)]
    k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM).bfloat16() for _ in range(2))
    slots = torch.randperm(4096 * BLOCK)[:tokens]
    return lambda kernels: [kernels.write_kv_cache(k, v, kc, vc, slots) for kc, vc in caches]


# The sampling formats: (top_k, top_p) at temperature 0.8.
SAMPLING = {"sample": (0, 1.0), "sample-top-p": (0, 0.9), "sample-top-k": (50, 1.0)}


def sampling_pass(shaping: str, rows: int) -> Callable[[ModuleType], None]:
    """One step's draws for `rows` sequences over SmolLM2's 49,152 tokens: random logits (normal,
    standard deviation 2.5, in bf16's values), temperature 0.8 and the format's top-k / top-p."""
    top_k, top_p = SAMPLING[shaping]
    logits = (torch.randn(rows, 49152) * 2.5).bfloat16().float()
    args = (logits, torch.full((rows,), 0.8), torch.full((rows,), top_k, dtype=torch.long),
            torch.full((rows,), top_p), torch.zeros(rows), torch.rand(rows, dtype=torch.float64))
    return lambda kernels: kernels.sample_rows(*args)


def product(kernels: ModuleType, layer: QuantizedLinear | torch.Tensor, x: torch.Tensor
            ) -> torch.Tensor:
    """layer(x) by `kernels`' product, as the layer's own packed_matmul (or a bf16 W's
    Linear on this CPU, as W lies) calls it."""
    if isinstance(layer, torch.Tensor):
        return kernels.linear_bf16(x, layer, None)
    if isinstance(layer, Int8Linear):
        return kernels.linear_int8(x, layer.codes, layer.own_kernel_scales, layer.bias)
    if layer.group_size == 32:
        return kernels.linear_int4_exact(x, layer.codes, layer.scales, layer.mins, layer.bias)
    return kernels.linear_int4(x, layer.codes, layer.scales, layer.mins, layer.group_size,
                               layer.bias, layer.input_rotation)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", required=True, help="git revision whose kernels to time")
    parser.add_argument("--formats", default="int4,int8")
    parser.add_argument("--rows", default="1,32", help="rows of x (sequences decoding)")
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--context", type=int, default=None,
                        help="attention: cached tokens a sequence (default 84 to 364)")
    parser.add_argument("--output-json", type=Path,
                        default=REPO_ROOT / "benchmarks/results/kernels_ab.json")
    args = parser.parse_args()
    builds = {"this checkout": cpu_kernels(), args.against: kernels_at(args.against)}
    if builds["this checkout"] is None:
        raise SystemExit("bench_kernels_ab: this checkout's kernels did not build")
    torch.manual_seed(0)
    results = []
    for quantization in args.formats.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            int8_cache = quantization.endswith("-int8")  # attention-int8, prefill-int8
            run = attention_pass(rows, args.context, int8_cache,
                                 in_cache=quantization == "attention-in-cache") \
                if quantization.startswith("attention") \
                else prefill_pass(rows, int8_cache) if quantization.startswith("prefill") \
                else sampling_pass(quantization, rows) if quantization in SAMPLING \
                else kv_write_pass(rows, int8_cache) if quantization.startswith("kv-write") \
                else products_pass(quantization, rows)
            passes: dict[str, list[float]] = {name: [] for name in builds}
            for index in range(args.passes + 1):  # the first pass warms up
                # Each build goes first in every other pass: the second in a pass ran ~5% faster.
                for name, kernels in list(builds.items())[::1 if index % 2 else -1]:
                    start = time.perf_counter()
                    run(kernels)
                    passes[name].append((time.perf_counter() - start) * 1e3)
            medians = {name: statistics.median(times[1:]) for name, times in passes.items()}
            results.append({"quantization": quantization, "rows": rows, "median_ms": medians,
                            "passes_ms": passes})
            print(f"{quantization} rows={rows:>3}: " + ", ".join(
                f"{name} {ms:.2f} ms" for name, ms in medians.items()) +
                f"  ({medians['this checkout'] / medians[args.against]:.2f}x the time)")
            del run
    save_report(args.output_json, "bench_kernels_ab", against=args.against, context=args.context,
                torch_threads=torch.get_num_threads(), passes=args.passes, results=results)


if __name__ == "__main__":
    main()
