"""This machine's ceilings beside the engine's decode kernels: how far the kernels are from what
the memory system and the AMX unit give.

Decode attention and the products at decode's row counts are bound by the machine, not by the
arithmetic, and which part of the machine decides what can help: more threads help where one
core's misses in flight are the limit, huge pages where page walks are, cache blocking where the
tiles wait for L2. Measured here, in one process:

- memory latency: a dependent chase through one random cycle over 512 MiB of cache lines, on 4 KB
  pages and on 2 MB ones (madvise(MADV_HUGEPAGE) before the first touch);
- memory bandwidth: a sum over 1 GiB (torch, contiguous), with 1 and with all threads;
- decode attention over 30 layers' bf16 caches of `--rows` sequences (bench_kernels_ab.py's
  attention pass, tokenmill's kernel), with 1 and with all threads, and the bytes it reads a
  second: where both rise with the threads in step, each core's own reads bound them (the misses
  one core keeps in flight), not the memory they share; and the same pass with every sequence on
  one sequence's blocks, which stay in cache: the kernel's arithmetic alone;
- the AMX unit: TDPBF16PS one after another with no loads (the peak), then the product loop of
  linear_amx.cpp's blocks (two tiles of W by two of x, four loads for four products) with its
  operands cycling through 16 KB to 4 MB (L1, L2, the last-level cache), one thread.

    python benchmarks/bench_machine.py
    python benchmarks/bench_machine.py --rows 32 --output-json /tmp/machine.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels_ab import (BLOCK, HEAD_DIM, KV_HEADS, LAYERS, attention_lengths,  # noqa: E402
                             attention_over)
from common import REPO_ROOT, memory_sum_gb_per_s, save_report  # noqa: E402

from tokenmill.kernels import CFLAGS, cpu_kernels  # noqa: E402

PROBES = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

namespace {
double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

// ns a load, chasing one random cycle through `mib` MiB of 64-byte lines.
double chase_ns(int64_t mib, bool huge_pages) {
  const int64_t bytes = mib << 20, lines = bytes / 64;
  auto* memory = static_cast<int64_t*>(std::aligned_alloc(1 << 21, bytes));
  TORCH_CHECK(memory != nullptr, "chase_ns: allocation failed");
  if (huge_pages) madvise(memory, bytes, MADV_HUGEPAGE);
  std::vector<int64_t> order(lines);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(1));
  for (int64_t i = 0; i < lines; ++i) memory[order[i] * 8] = order[(i + 1) % lines] * 8;
  const int64_t loads = 20'000'000;
  int64_t at = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < loads; ++i) at = memory[at];
  const double ns = seconds_since(start) / loads * 1e9;
  std::free(memory);
  return at >= 0 ? ns : -1.0;  // `at` used, so the chase is not optimized away
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// ns a TDPBF16PS: with span_kb 0, four independent products on tiles already loaded; else each
// step loads two tiles of W and two of x (1 KB each, in turn from a span_kb KB buffer) and does
// the four products of linear_amx.cpp's amx_block.
double amx_tdp_ns(int64_t span_kb) {
  TORCH_CHECK(syscall(SYS_arch_prctl, 0x1023, 18) == 0, "amx_tdp_ns: no AMX permission");
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
  const int64_t tiles = std::max<int64_t>(span_kb, 4);
  std::vector<uint8_t> span(tiles * 1024 + 64, 0);
  const uint8_t* base = reinterpret_cast<const uint8_t*>(
      (reinterpret_cast<uintptr_t>(span.data()) + 63) & ~uintptr_t{63});
  _tile_loadd(4, base, 64);  // tile numbers are immediates
  _tile_loadd(5, base, 64);
  _tile_loadd(6, base, 64);
  _tile_loadd(7, base, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t steps = 4'000'000;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < steps; ++i) {
    if (span_kb > 0) {
      const uint8_t* at = base + (i * 4 % tiles) * 1024;
      _tile_loadd(4, at, 64);
      _tile_loadd(6, at + 1024, 64);
      _tile_loadd(5, at + 2048, 64);
      _tile_loadd(7, at + 3072, 64);
    }
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const double ns = seconds_since(start) / (4 * steps) * 1e9;
  _tile_release();
  return ns;
}

bool amx_available() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }
#else
double amx_tdp_ns(int64_t) { return -1.0; }
bool amx_available() { return false; }
#endif
"""


def sum_gb_per_s(threads: int) -> float:
    """common.memory_sum_gb_per_s with `threads` threads."""
    torch.set_num_threads(threads)
    return memory_sum_gb_per_s()


def attention_rate(kernels, rows: int, threads: int, passes: int,
                   in_cache: bool = False) -> dict[str, float]:
    """Decode attention over 30 layers' caches: ms a pass (median) and the cache read a second.
    `in_cache`: every sequence reads one sequence's blocks, which stay in L2, so the pass is the
    kernel's arithmetic over as many bytes."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    lengths = attention_lengths(rows)
    run = attention_over(lengths, shared=in_cache)
    cache_bytes = LAYERS * 2 * int(lengths.sum()) * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
    run(kernels)
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        run(kernels)
        times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    return {"ms": ms, "cache_gb_per_s": cache_bytes / ms / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="sequences in decode attention")
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--output-json", type=Path,
                        default=REPO_ROOT / "benchmarks/results/bench_machine.json")
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("bench_machine: tokenmill's kernels did not build")
    probes = load_inline(name="tokenmill_machine_probes", cpp_sources=[PROBES],
                         functions=["chase_ns", "amx_tdp_ns", "amx_available"],
                         extra_cflags=CFLAGS)
    threads = torch.get_num_threads()
    latency = {"4k_pages": probes.chase_ns(512, False), "2m_pages": probes.chase_ns(512, True)}
    print(f"memory latency (512 MiB, random): {latency['4k_pages']:.0f} ns on 4 KB pages, "
          f"{latency['2m_pages']:.0f} ns on 2 MB pages")
    bandwidth = {str(t): sum_gb_per_s(t) for t in sorted({1, threads})}
    print("memory bandwidth (sum over 1 GiB): " +
          ", ".join(f"{gb:.1f} GB/s with {t} thread(s)" for t, gb in bandwidth.items()))
    attention = {str(t): attention_rate(kernels, args.rows, t, args.passes)
                 for t in sorted({1, threads})}
    for t, a in attention.items():
        share = a["cache_gb_per_s"] / bandwidth[t]
        print(f"decode attention, {args.rows} sequences x 30 layers, {t} thread(s): "
              f"{a['ms']:.2f} ms, the cache read at {a['cache_gb_per_s']:.1f} GB/s "
              f"({share:.0%} of the sum's rate with as many threads)")
    in_cache = attention_rate(kernels, args.rows, threads, args.passes, in_cache=True)
    print(f"decode attention, the same work with every sequence on one sequence's blocks (in "
          f"cache), {threads} thread(s): {in_cache['ms']:.2f} ms")
    tdp = {}
    if probes.amx_available():
        torch.set_num_threads(1)
        for span_kb in (0, 16, 32, 64, 256, 1024, 2048, 4096):
            tdp[str(span_kb)] = probes.amx_tdp_ns(span_kb)
        print("AMX TDPBF16PS, one thread, ns each: " + ", ".join(
            f"{'no loads' if kb == '0' else kb + ' KB'} {ns:.1f}" for kb, ns in tdp.items()))
    save_report(args.output_json, "bench_machine", rows=args.rows, torch_threads=threads,
                block_size=BLOCK, memory_latency_ns=latency, sum_gb_per_s=bandwidth,
                decode_attention=attention, decode_attention_in_cache=in_cache, amx_tdp_ns=tdp)


if __name__ == "__main__":
    main()
