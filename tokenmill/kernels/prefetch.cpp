// Software prefetch for reads the hardware prefetcher misses: short streams.
//
// The few-row products read four weight rows side by side: four streams of one row's length (18
// cache lines for a 576-wide bf16 row), and every block of rows starts four new ones. The
// hardware prefetcher barely gets going on streams that short. Asking for the next block of rows
// in address order while the current one is multiplied lifted the one-row bf16 product on the
// 576-wide shapes from 9 to 15 GB/s to 15 to 26 (python benchmarks/bench_weight_streaming.py);
// on 1536-wide rows, long enough for the hardware, it gained nothing.
// Decode attention reads a few KB of one KV block and then jumps to the next, anywhere in the
// pool: asking for the next block while one is read took a 64-sequence decode step's attention
// from 0.99 to 0.75 ms a layer in bf16 and 1.38 to 1.18 in fp32 on the AMX machine
// (benchmarks/profile_engine_steps.py; an engine A/B on the AMD VM had shown nothing, and a
// kernel benchmark whose cache fits in the last-level cache shows little).
//
// Asked for in one burst, a block's lines fill the core's few miss buffers and the loop asking
// stalls until they drain, with nothing read meanwhile: on the AMX VM a third of decode
// attention's time sat in those loops. The bf16 products and decode attention now ask for the
// next block's lines a few at a time as they read the current one (linear_bf16.cpp's `tile`,
// linear_amx.cpp's `amx_block`, paged_attention.cpp's `Ahead`): scattered 6 KB blocks were
// summed at 20.4-23.3 GB/s with bursts and 27.2-28.6 spread, a line asked for a line read.
#include <cstdint>

namespace {

// Asks for the cache lines of [start, start + bytes) in address order; never faults. Into L2, not
// L1 (locality 2, prefetcht1): a KV block or a block of weight rows is 100 or so lines, more
// than L1 has miss buffers for, and on the AMD VM such a burst into L1 stalled the loop issuing
// it. There, alternating builds (benchmarks/profile_engine_steps.py): decode attention at 64
// sequences 1.01 -> 0.61-0.65 ms a layer (the cache read at 10.9 -> 17-18 GB/s), a 64-sequence
// decode step 98-100 -> 83-84 ms; one sequence's bf16 decode 57-78 -> 81-83 tokens/s.
inline void prefetch_bytes(const void* start, int64_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(start);
  for (uintptr_t line = begin & ~uintptr_t{63}; line < begin + bytes; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
}

// Asks for the line at `offset` of each of `rows` rows, `row_bytes` apart from `start`: what the
// products' loops ask for as they go (above), the line of the next rows that they just read of
// the current ones.
inline void prefetch_rows(const void* start, int64_t rows, int64_t row_bytes, int64_t offset) {
  const char* at = static_cast<const char*>(start) + offset;
  for (int64_t r = 0; r < rows; ++r) __builtin_prefetch(at + r * row_bytes, 0, 2);
}

}  // namespace
