"""Attention: the C++ paged kernel against torch's SDPA, on SmolLM2's shapes (9 query heads, 3 KV
heads, head_dim 64, blocks of 16), one layer's call; x 30 is what the model's step spends in it.
Decode, per batch size and context length: the kernel against the SDPA fallback (gather blocks +
padding mask). Prefill of a fresh chunk, per length: the kernel path (in bfloat16 tiles of 16
queries, else each query token over the cache up to its position) against causal SDPA on the
chunk, and the two kernels alone on the cache: tiled against per-token.

    python benchmarks/bench_attention.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from tokenmill.kernels import cpu_kernels
from tokenmill.model.attention import (AttentionMetadata, PagedAttention, padding_mask,
                                       prefill_chunk)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, save_report, seconds  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def case(batch: int, context: int, dtype: torch.dtype, repeats: int) -> dict:
    blocks_per_seq = -(-context // BLOCK)
    k_cache = torch.randn(batch * blocks_per_seq + 1, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(k_cache.shape[0] - 1) + 1  # scattered, as in a used pool
    tables = order[:batch * blocks_per_seq].view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context)
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    attention = PagedAttention(HEADS, KV_HEADS, HEAD_DIM)
    empty = torch.empty(0, dtype=torch.long)
    kernel_meta = AttentionMetadata(empty, [], 0, tables, seq_lens, None)
    fallback_meta = AttentionMetadata(empty, [], 0, tables, seq_lens,
                                      padding_mask(seq_lens, blocks_per_seq * BLOCK, dtype))
    kernel = seconds(lambda: attention._decode(q, k_cache, v_cache, kernel_meta, out), repeats)
    fallback = seconds(lambda: attention._decode(q, k_cache, v_cache, fallback_meta, out),
                       repeats)
    return {"batch": batch, "context": context, "dtype": str(dtype)[6:],
            "kernel_ms": kernel * 1e3, "sdpa_fallback_ms": fallback * 1e3,
            "kernel_ms_per_step": kernel * 1e3 * LAYERS, "speedup": fallback / kernel}


def prefill_case(length: int, dtype: torch.dtype, repeats: int) -> dict:
    blocks = -(-length // BLOCK)
    k_cache = torch.zeros(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q = torch.randn(length, HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(length, KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn(length, KV_HEADS, HEAD_DIM).to(dtype)
    table = torch.arange(blocks)
    attention = PagedAttention(HEADS, KV_HEADS, HEAD_DIM)
    timings = {}
    for path, use_kernel in (("kernel", True), ("sdpa", False)):
        chunk = prefill_chunk(0, length, length, table, use_kernel, dtype, q.device)
        meta = AttentionMetadata(torch.arange(length), [chunk], length, None, None, None)
        timings[path] = seconds(lambda: attention.forward(q, k, v, k_cache, v_cache, meta),
                                repeats)
    kernels, seq_lens, out = cpu_kernels(), torch.arange(1, length + 1), torch.empty_like(q)
    timings["prefill_kernel"] = seconds(lambda: kernels.paged_prefill_attention(
        q, k_cache, v_cache, table, seq_lens, attention.scale, out), repeats)
    timings["per_token"] = seconds(lambda: kernels.paged_decode_attention(
        q, k_cache, v_cache, table.expand(length, -1), seq_lens, attention.scale, out), repeats)
    return {"prefill_len": length, "dtype": str(dtype)[6:], "kernel_ms": timings["kernel"] * 1e3,
            "sdpa_ms": timings["sdpa"] * 1e3, "kernel_ms_per_step": timings["kernel"] * 1e3 * LAYERS,
            "speedup": timings["sdpa"] / timings["kernel"],
            "prefill_kernel_ms": timings["prefill_kernel"] * 1e3,
            "per_token_kernel_ms": timings["per_token"] * 1e3,
            "prefill_kernel_over_per_token": timings["per_token"] / timings["prefill_kernel"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="1x170,16x170,16x1000,64x300",
                        help="BATCHxCONTEXT, comma-separated")
    parser.add_argument("--prefill-lens", default="160,1000,2048")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output-json", type=Path,
                        default=REPO_ROOT / "benchmarks/results/attention.json")
    args = parser.parse_args()
    if cpu_kernels() is None:
        raise SystemExit("bench_attention: the C++ kernels did not build here")
    results = []
    print(f"{'dtype':<10}{'batch':>6}{'context':>8}{'kernel ms':>11}{'SDPA ms':>9}"
          f"{'speed-up':>10}{'x30 layers ms':>15}")
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for spec in args.cases.split(","):
            batch, context = (int(v) for v in spec.split("x"))
            r = case(batch, context, dtype, args.repeats)
            results.append(r)
            print(f"{r['dtype']:<10}{batch:>6}{context:>8}{r['kernel_ms']:>11.3f}"
                  f"{r['sdpa_fallback_ms']:>9.3f}{r['speedup']:>9.1f}x"
                  f"{r['kernel_ms_per_step']:>15.1f}")
    print(f"\n{'dtype':<10}{'prefill':>8}{'kernel ms':>11}{'SDPA ms':>9}{'speed-up':>10}"
          f"{'x30 layers ms':>15}{'per-token ms':>14}{'prefill kernel':>16}")
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for length in (int(v) for v in args.prefill_lens.split(",")):
            r = prefill_case(length, dtype, max(2, args.repeats // 4))
            results.append(r)
            print(f"{r['dtype']:<10}{length:>8}{r['kernel_ms']:>11.2f}{r['sdpa_ms']:>9.2f}"
                  f"{r['speedup']:>9.1f}x{r['kernel_ms_per_step']:>15.1f}"
                  f"{r['per_token_kernel_ms']:>14.2f}{r['prefill_kernel_over_per_token']:>15.2f}x")
    save_report(args.output_json, "bench_attention", torch_threads=torch.get_num_threads(),
                results=results)


if __name__ == "__main__":
    main()
