// Buffers that a thread keeps from one kernel call to the next.
//
// A decode step calls a product about 120 times and each had allocated and zeroed its buffers
// (x laid out for the tiles, 73 to 196 KB at 64 rows; W's decoded block, 36 KB a thread) while
// the other thread waited: glibc's _int_malloc and memset were 3 to 5% of a 64-sequence decode
// run's samples on the calling thread (perf, AMX VM). The int8 / int4 products' quantized x and
// decode attention's scores and sums keep theirs here too: at one sequence a step's allocations
// had cost a tenth of its time (kernels/decode_layers.cpp). The contents are whatever the last
// call left, so a caller writes every element it reads.
#include <cstdint>
#include <vector>

namespace {

// At least n elements of T for this thread; `Slot` tells apart buffers of one type that a thread
// can hold at once (each user takes its own numbers).
template <typename T, int Slot>
T* reused_buffer(int64_t n) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

}  // namespace
