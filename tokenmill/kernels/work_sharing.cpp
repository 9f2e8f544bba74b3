// Blocks of work (a product's blocks of W, decode attention's parts) shared out between threads
// that take equal shares but not equal times.
//
// at::parallel_for gives each thread one contiguous share of the blocks and waits for the last
// to finish. A decode step's products split W's blocks evenly, yet one thread's blocks come from
// memory later than the other's, and libgomp's spin at the end of each product, the finished
// thread waiting, was a fifth of the samples of a pass over SmolLM2's 64-row products (AMX VM).
// Here each thread walks its own share from the front, in order, so the next block it will take
// is known and can be asked for early; one that is done takes the others' last blocks, one at a
// time, from the back, until every share is empty.
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace {

// A share's blocks [front, end), both in one word so that the owner taking the front and a
// thief taking the back never take the same block.
class Share {
 public:
  void assign(int64_t front, int64_t end) { bounds_.store(pack(front, end)); }

  // The front block, or -1 when the share is empty; `next` the block after it, or -1.
  int64_t take_front(int64_t& next) {
    uint64_t bounds = bounds_.load();
    while (true) {
      const int64_t front = bounds >> 32, end = bounds & kLow;
      if (front >= end) return -1;
      if (bounds_.compare_exchange_weak(bounds, pack(front + 1, end))) {
        next = front + 1 < end ? front + 1 : -1;
        return front;
      }
    }
  }

  // The last block, or -1 when the share is empty.
  int64_t take_back() {
    uint64_t bounds = bounds_.load();
    while (true) {
      const int64_t front = bounds >> 32, end = bounds & kLow;
      if (front >= end) return -1;
      if (bounds_.compare_exchange_weak(bounds, pack(front, end - 1))) return end - 1;
    }
  }

 private:
  static constexpr uint64_t kLow = 0xffffffffu;
  static uint64_t pack(int64_t front, int64_t end) {
    return static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(end);
  }
  std::atomic<uint64_t> bounds_{0};
};

// Runs worker(take) once on each thread, where take(fn) calls fn(block, next) for every block
// [0, blocks) that this thread takes (next: the block it will take after this one, or -1 where
// that is not known), so that the worker can keep state across its blocks and finish after them.
template <typename Worker>
void share_blocks(int64_t blocks, Worker worker) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t)
    shares[t].assign(blocks * t / threads, blocks * (t + 1) / threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      worker([&](auto fn) {
        int64_t next = -1;
        for (int64_t block; (block = shares[t].take_front(next)) >= 0;) fn(block, next);
        for (int64_t other = 1; other < threads; ++other)
          for (int64_t block; (block = shares[(t + other) % threads].take_back()) >= 0;)
            fn(block, int64_t{-1});
      });
  });
}

}  // namespace
