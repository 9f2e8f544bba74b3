// Software prefetch for reads the hardware prefetcher misses: short streams.
//
// The few-row products read four weight rows side by side: four streams of one row's length (18
// cache lines for a 576-wide bf16 row), and every block of rows starts four new ones. The
// hardware prefetcher barely gets going on streams that short: reading weights in the product's
// order ran at 9.5 GB/s on one core here against 21 GB/s for one long stream, and asking for the
// next block of rows in address order while the current one is multiplied brought it to 20
// (benchmarks/bench_weight_streaming.py measures the products). Decode attention, which reads a
// few KB of one KV block and then jumps to the next, showed no gain from the same (not used).
#include <cstdint>

namespace {

// Asks for the cache lines of [start, start + bytes) in address order; never faults.
inline void prefetch_bytes(const void* start, int64_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(start);
  for (uintptr_t line = begin & ~uintptr_t{63}; line < begin + bytes; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
}

}  // namespace
