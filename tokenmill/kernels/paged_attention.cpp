// Decode attention read straight from the paged KV cache: one query token per sequence.
//
// The PyTorch fallback has to gather every sequence's blocks into a padded copy before it can
// attend; this kernel walks the block table in place instead, one (sequence, KV head) pair per
// task, so each K/V row is read once from the pool and shared by the query heads of its group.
// An int8 cache (tokenmill/model/kv_int8.py) is de-quantized row by row as it is read: each row
// holds head_dim codes and then its float32 scale.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline void load_row(const T* cached, int64_t head_dim, float* row) {
  for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(cached[d]);
}

// bfloat16 is the top half of a float32: a shift, which the compiler vectorizes (the generic
// conversion above it does not).
inline void load_row(const c10::BFloat16* cached, int64_t head_dim, float* row) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(cached);
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) {
    const uint32_t word = static_cast<uint32_t>(bits[d]) << 16;
    std::memcpy(row + d, &word, sizeof word);
  }
}

// code * scale in float32, one rounding: the same values as kv_int8.dequantize_rows.
inline void load_row(const int8_t* cached, int64_t head_dim, float* row) {
  float scale;
  std::memcpy(&scale, cached + head_dim, sizeof scale);
  for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(cached[d]) * scale;
}

// A cached row as float32: float rows are read in place, others converted into `scratch`.
template <typename T>
inline const float* as_floats(const T* cached, int64_t head_dim, float* scratch) {
  load_row(cached, head_dim, scratch);
  return scratch;
}

inline const float* as_floats(const float* cached, int64_t, float*) { return cached; }

#if defined(__AVX512F__)
// Written with intrinsics: the compiler's own vectorization of these loops (a horizontal sum for
// every dot product, scalar exp) ran at about 4 GFLOP/s.
inline float dot(const float* a, const float* b, int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), sum);
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + i), _mm512_maskz_loadu_ps(tail, b + i), sum);
  }
  return _mm512_reduce_add_ps(sum);
}

inline void add_scaled(float w, const float* x, float* acc, int64_t n) {
  const __m512 weight = _mm512_set1_ps(w);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(weight, _mm512_loadu_ps(x + i), _mm512_loadu_ps(acc + i)));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(acc + i, tail, _mm512_fmadd_ps(weight, _mm512_maskz_loadu_ps(tail, x + i),
                                                         _mm512_maskz_loadu_ps(tail, acc + i)));
  }
}

// exp(x) = 2^n e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by Cephes' degree-6
// polynomial (about 1 ulp); softmax arguments are <= 0, clamped where exp underflows anyway.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// s[i] = exp(s[i] - max s), in place; returns {max s, the sum}.
inline std::pair<float, float> exp_from_peak(float* s, int64_t n) {
  __m512 peak = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) peak = _mm512_max_ps(peak, _mm512_loadu_ps(s + i));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  if (i < n) peak = _mm512_mask_max_ps(peak, tail, peak, _mm512_maskz_loadu_ps(tail, s + i));
  const float max = _mm512_reduce_max_ps(peak);
  const __m512 top = _mm512_set1_ps(max);
  __m512 total = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), top));
    _mm512_storeu_ps(s + i, e);
    total = _mm512_add_ps(total, e);
  }
  if (i < n) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), top));
    _mm512_mask_storeu_ps(s + i, tail, e);
    total = _mm512_mask_add_ps(total, tail, total, e);
  }
  return {max, _mm512_reduce_add_ps(total)};
}

inline void softmax_(float* s, int64_t n) {
  const __m512 inv = _mm512_set1_ps(1.f / exp_from_peak(s, n).second);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  if (i < n) _mm512_mask_storeu_ps(s + i, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + i), inv));
}
#else
inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void add_scaled(float w, const float* x, float* acc, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += w * x[i];
}

inline std::pair<float, float> exp_from_peak(float* s, int64_t n) {
  const float peak = *std::max_element(s, s + n);
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += (s[i] = std::exp(s[i] - peak));
  return {peak, total};
}

inline void softmax_(float* s, int64_t n) {
  const float inv = 1.f / exp_from_peak(s, n).second;
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}
#endif

// Scores of one query head against `count` consecutive cached rows (row i at rows + i * stride),
// and the weighted sum of such rows into acc: the plain versions go row by row.
template <typename T>
void score_rows(const float* query, const T* rows, int64_t stride, int64_t count, int64_t head_dim,
                float scale, float* scores, float* scratch) {
  for (int64_t i = 0; i < count; ++i)
    scores[i] = dot(query, as_floats(rows + i * stride, head_dim, scratch), head_dim) * scale;
}

template <typename T>
void accumulate_rows(const float* weights, const T* rows, int64_t stride, int64_t count,
                     int64_t head_dim, float* acc, float* scratch) {
  for (int64_t i = 0; i < count; ++i)
    add_scaled(weights[i], as_floats(rows + i * stride, head_dim, scratch), acc, head_dim);
}

#if defined(__AVX512F__)
// Sixteen rows at a time for float, bfloat16 and int8 caches: one horizontal sum (a transpose-add
// of 16 registers) for 16 dot products instead of one each, and the weighted sum in registers.
constexpr int64_t kRun = 16;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 16 values of a cached row from dimension c as float32: an int8 row's codes times its scale
// (stored after its head_dim codes), one rounding each, load_row's values; a float row's as they
// are.
template <typename T>
inline __m512 row16(const T* row, int64_t c, int64_t head_dim) {
  if constexpr (std::is_same_v<T, int8_t>) {
    float scale;
    std::memcpy(&scale, row + head_dim, sizeof scale);
    return _mm512_mul_ps(load16(row + c), _mm512_set1_ps(scale));
  } else {
    return load16(row + c);
  }
}

// out[i] = the sum of v[i]'s 16 lanes.
inline __m512 sum_each(__m512 v[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

// All 16 rows are read (the caller guarantees they lie inside one block); scores past `count`
// are not stored, and no lane mixes two rows, so a stale row changes nothing.
template <typename T>
void score_run(const float* query, const T* rows, int64_t stride, int64_t count, int64_t head_dim,
               float scale, float* scores) {
  __m512 sums[kRun];
#pragma GCC unroll 16
  for (int i = 0; i < kRun; ++i) sums[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < head_dim; c += 16) {
    const __m512 q = _mm512_loadu_ps(query + c);
#pragma GCC unroll 16
    for (int i = 0; i < kRun; ++i)
      sums[i] = _mm512_fmadd_ps(q, row16(rows + i * stride, c, head_dim), sums[i]);
  }
  _mm512_mask_storeu_ps(scores, static_cast<__mmask16>((1u << count) - 1),
                        _mm512_mul_ps(sum_each(sums), _mm512_set1_ps(scale)));
}

#if defined(__AVX512BF16__)
// score_run for a bfloat16 query over bfloat16 rows: VDPBF16PS multiplies bf16 pairs exactly and
// sums them in float32, 32 elements an instruction where the widened rows take 16 and a shift.
// head_dim a multiple of 32.
inline void score_run(const c10::BFloat16* query, const c10::BFloat16* rows, int64_t stride,
                      int64_t count, int64_t head_dim, float scale, float* scores) {
  __m512 sums[kRun];
#pragma GCC unroll 16
  for (int i = 0; i < kRun; ++i) sums[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < head_dim; c += 32) {
    const __m512bh q = (__m512bh)_mm512_loadu_si512(query + c);
#pragma GCC unroll 16
    for (int i = 0; i < kRun; ++i)
      sums[i] = _mm512_dpbf16_ps(sums[i], q, (__m512bh)_mm512_loadu_si512(rows + i * stride + c));
  }
  _mm512_mask_storeu_ps(scores, static_cast<__mmask16>((1u << count) - 1),
                        _mm512_mul_ps(sum_each(sums), _mm512_set1_ps(scale)));
}
#endif

// acc[j] += sum_i weights[j * weight_stride + i] * row i, for the HEADS query heads that share
// these rows (a KV head's group): each row is widened to float once for all of them. head_dim a
// multiple of 64: four registers of each head's acc at a time.
template <int HEADS, typename T>
void accumulate_run(const float* weights, int64_t weight_stride, const T* rows, int64_t stride,
                    int64_t count, int64_t head_dim, float* acc) {
  for (int64_t c = 0; c < head_dim; c += 64) {
    __m512 a[HEADS][4];
#pragma GCC unroll 4
    for (int j = 0; j < HEADS; ++j)
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) a[j][r] = _mm512_loadu_ps(acc + j * head_dim + c + 16 * r);
    for (int64_t i = 0; i < count; ++i) {
      __m512 v[4];
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        const T* row = rows + i * stride + c;
        // 32 bfloat16 a load, split into their even and odd elements as float32 by two
        // instructions, where widening 16 takes three: acc holds each 32 dimensions as 16 even
        // then 16 odd (in_dimension_order puts them back), the same sums in the same order.
        // 30 layers' attention of 64 sequences from memory, AMX VM (bench_kernels_ab.py
        // --formats attention): 30.1 -> 28.9 and 30.4 -> 29.9 ms a step; 32: 15.5 -> 15.3.
#pragma GCC unroll 2
        for (int r = 0; r < 4; r += 2) {
          const __m512i bits = _mm512_loadu_si512(row + 16 * r);
          v[r] = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
          v[r + 1] = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(~0xFFFF)));
        }
      } else {
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) v[r] = row16(rows + i * stride, c + 16 * r, head_dim);
      }
#pragma GCC unroll 4
      for (int j = 0; j < HEADS; ++j) {
        const __m512 w = _mm512_set1_ps(weights[j * weight_stride + i]);
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) a[j][r] = _mm512_fmadd_ps(w, v[r], a[j][r]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < HEADS; ++j)
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) _mm512_storeu_ps(acc + j * head_dim + c + 16 * r, a[j][r]);
  }
}

// accumulate_run for the `heads` query heads of one group (their weights weight_stride apart,
// their acc head_dim apart), up to three at a time: twelve accumulators, four widened rows and a
// weight in the 32 registers.
template <typename T>
void accumulate_heads(const float* weights, int64_t weight_stride, const T* rows, int64_t stride,
                      int64_t count, int64_t head_dim, int64_t heads, float* acc) {
  for (int64_t j = 0; j < heads; j += 3) {
    const float* w = weights + j * weight_stride;
    float* a = acc + j * head_dim;
    switch (std::min<int64_t>(3, heads - j)) {
      case 1: accumulate_run<1>(w, weight_stride, rows, stride, count, head_dim, a); break;
      case 2: accumulate_run<2>(w, weight_stride, rows, stride, count, head_dim, a); break;
      default: accumulate_run<3>(w, weight_stride, rows, stride, count, head_dim, a);
    }
  }
}

template <typename T>
constexpr bool kVectorRows = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> ||
                             std::is_same_v<T, int8_t>;

// acc [n] as accumulate_run leaves it over bfloat16 rows, each 32 values 16 even then 16 odd
// dimensions, back in dimension order, in place. n a multiple of 32.
inline void in_dimension_order(float* acc, int64_t n) {
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                         15, 31);
  for (int64_t c = 0; c < n; c += 32) {
    const __m512 even = _mm512_loadu_ps(acc + c), odd = _mm512_loadu_ps(acc + c + 16);
    _mm512_storeu_ps(acc + c, _mm512_permutex2var_ps(even, low, odd));
    _mm512_storeu_ps(acc + c + 16, _mm512_permutex2var_ps(even, high, odd));
  }
}
#endif

// The lines a run's reader asks for while it works: its share of the block read after this one.
// The reader spreads them over its work (`part`), a few lines at a time: a block's 96 lines asked
// for at once filled the core's miss buffers, stalling the loop that asked, and nothing was read
// meanwhile (kernels/prefetch.cpp). 30 layers' attention of 64 sequences from memory, AMX VM:
// 0.77-0.79x the time, spread over the heads (benchmarks/bench_kernels_ab.py --formats
// attention); spread over every row of V instead, 1.01-1.07x that.
struct Ahead {
  const char* start = nullptr;
  int64_t bytes = 0;
  // Slice i of n of the share.
  void part(int64_t i, int64_t n) const {
    if (start == nullptr) return;
    const int64_t from = bytes * i / n;
    prefetch_bytes(start + from, bytes * (i + 1) / n - from);
  }
};

// Calls fn(t, rows, room, count, ahead) for each run of a sequence's first `len` cached tokens
// that lies in one block: `count` tokens from token t, `room` rows before the block ends. A
// token's KV heads are adjacent, so the walk reads the pool sequentially. The block's runs share
// out the next block between them as `ahead` (blocks lie anywhere in the pool); during the last
// block, the block at `then`: the first of what the caller reads next (the sequence's V after
// its K, the next sequence's K after V), which had started cold. 64 sequences over 30 layers'
// caches from memory, AMX VM (benchmarks/bench_kernels_ab.py --formats attention, three runs):
// 29.2 -> 28.5, 26.5 -> 25.4 and 30.2 -> 29.0 ms a step, 3 to 4% less.
template <typename T, typename Fn>
inline void for_each_run(const T* cache, const int64_t* table, int64_t len, int64_t block_size,
                         int64_t token_stride, int64_t run, Fn fn, const T* then = nullptr) {
  const int64_t block_bytes = block_size * token_stride * static_cast<int64_t>(sizeof(T));
  const int64_t runs = (block_size + run - 1) / run;
  for (int64_t block = 0, t = 0; t < len; ++block) {
    const T* tokens = cache + table[block] * block_size * token_stride;
    const T* next = t + block_size < len ? cache + table[block + 1] * block_size * token_stride
                                         : then;
    for (int64_t offset = 0, r = 0; offset < block_size && t < len; offset += run, ++r) {
      const int64_t count = std::min({run, block_size - offset, len - t});
      const Ahead ahead = next == nullptr ? Ahead{}
          : Ahead{reinterpret_cast<const char*>(next) + block_bytes * r / runs,
                  block_bytes * (r + 1) / runs - block_bytes * r / runs};
      fn(t, tokens + offset * token_stride, block_size - offset, count, ahead);
      t += count;
    }
  }
}

// Task i of n, in an order whose contiguous shares (at::parallel_for's, a thread each) take equal
// work when the work grows with the task: first, last, second, second last... A prefill chunk's
// query tokens attend to more keys the later they are, and in their own order the thread given
// the first half had a quarter of the work (16 tiles: 36 of 136 tiles' runs), then spun at the
// barrier while the other finished: a fifth of a 2,048-token bf16 prefill's samples were
// libgomp's spin, AMX VM. A chunk's attention took 0.69-0.80x the time so
// (benchmarks/bench_kernels_ab.py --formats prefill). Decode's sequences, whose lengths don't
// grow with their index, keep their order: the pool's blocks lie in it (1.01-1.06x otherwise).
inline int64_t balanced_order(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

// Sequences longer than this attend in parts of it (flash decoding's split of the keys), each
// part a task: one long sequence decoding had all its attention on one thread (6,000 cached
// tokens: 11 of a 23 ms step). A part keeps exp(score - its max) unnormalised, its max and sum
// and its weighted sum of V; the task that finishes a sequence's last part rescales them all to
// the sequence's max, in part order, and divides once. Shorter sequences keep the one-pass
// softmax. Whether a sequence is split, and where, depends on its length alone, never on the
// batch beside it. Parts of 256 had cost batches of a few 84-364-token sequences 1.15x the
// time (a second pass to merge, and more tasks); 512 leaves such sequences whole.
constexpr int64_t kPartTokens = 512;

struct Part {
  int64_t sequence, first, end;  // tokens [first, end) of the sequence
  int64_t slot;                  // its row in the parts' buffers; -1: the whole sequence
  int64_t split;                 // its sequence's index among the split ones
};

struct Split {
  int64_t first_part, parts;  // parts [first_part, first_part + parts) of the task list
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// A run's scores on AMX tiles, over a bfloat16 cache with a bfloat16 query. C tile 0 is the
// run's 16 tokens by the query heads; for each KV head and each 32 of its dimensions, A tile 1
// holds the run's 16 rows of that head as they lie in the pool, and a B tile (2 to 7, loaded
// once a sequence) the query heads of its group as pairs of dimensions, zero in the other
// heads' columns, so every head's scores sum in the one C tile. VDPBF16PS had multiplied each
// query head by the rows again and reduced every dot product across lanes: 64 sequences' step
// of 30 layers with the cache in L2 in 0.79x the time, from memory 0.92-0.98x
// (benchmarks/bench_kernels_ab.py --formats attention-in-cache,attention, AMX VM). Tried and
// left out: a C tile per KV head, with the B tiles read from L1 for each product instead of
// staying in tiles (slower in cache: the products then wait on the loads).
class TileScores {
 public:
  static constexpr int64_t kQueryTiles = 6;  // tiles 2 to 7

  TileScores(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t row_width,
             int64_t token_stride)
      : num_heads_(num_heads), group_(num_heads / num_kv_heads), num_kv_heads_(num_kv_heads),
        chunks_(head_dim / kTileDepth), head_dim_(head_dim), row_width_(row_width),
        token_stride_(token_stride) {}

  // Whether a cache of this shape fits: the query heads in C's 16 columns, a KV head's
  // dimensions in 32s, a B tile for each.
  static bool fits(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
    return num_heads <= kTileRows && head_dim % kTileDepth == 0 &&
           num_kv_heads * (head_dim / kTileDepth) <= kQueryTiles && amx_permitted();
  }

  // B tile (KV head h, dimensions 32 c..): element (r, 2 n + j) is query head n's dimension
  // 32 c + 2 r + j for n in h's group, else zero.
  void load_queries(const c10::BFloat16* q) const {
    alignas(64) uint32_t tiles[kQueryTiles][kTileRows * kTileRows] = {};
    for (int64_t n = 0; n < num_heads_; ++n)
      for (int64_t c = 0; c < chunks_; ++c)
        for (int64_t r = 0; r < kTileRows; ++r)
          std::memcpy(&tiles[n / group_ * chunks_ + c][r * kTileRows + n],
                      q + n * head_dim_ + c * kTileDepth + 2 * r, sizeof(uint32_t));
    for (int64_t i = 0; i < num_kv_heads_ * chunks_; ++i) load_query_tile(i, tiles[i]);
  }

  // scores[n * len + i] = scale * (query head n . row i) for the first `count` of the 16 rows
  // from `tokens` (all 16 inside one block: rows past count are read, never stored).
  void score(const c10::BFloat16* tokens, int64_t count, float scale, float* scores, int64_t len,
             const Ahead& ahead) const {
    _tile_zero(0);
    for (int64_t h = 0; h < num_kv_heads_; ++h) {
      ahead.part(h, num_kv_heads_);
      for (int64_t c = 0; c < chunks_; ++c) {
        _tile_loadd(1, tokens + h * row_width_ + c * kTileDepth, token_stride_ * 2);
        add_product(h * chunks_ + c);
      }
    }
    alignas(64) float sums[kTileRows * kTileRows];
    _tile_stored(0, sums, 64);
    __m512 rows[kTileRows];
    for (int64_t i = 0; i < kTileRows; ++i) rows[i] = _mm512_load_ps(sums + i * kTileRows);
    transpose16x16(rows);
    const auto lanes = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t n = 0; n < num_heads_; ++n)
      _mm512_mask_storeu_ps(scores + n * len, lanes, _mm512_mul_ps(rows[n], _mm512_set1_ps(scale)));
  }

 private:
  // B tile i is tile 2 + i; the intrinsics take tile numbers as literals.
  static void load_query_tile(int64_t i, const void* tile) {
    switch (i) {
      case 0: _tile_loadd(2, tile, 64); break;
      case 1: _tile_loadd(3, tile, 64); break;
      case 2: _tile_loadd(4, tile, 64); break;
      case 3: _tile_loadd(5, tile, 64); break;
      case 4: _tile_loadd(6, tile, 64); break;
      default: _tile_loadd(7, tile, 64);
    }
  }

  // C (tile 0) += A (tile 1) times B tile i.
  static void add_product(int64_t i) {
    switch (i) {
      case 0: _tile_dpbf16ps(0, 1, 2); break;
      case 1: _tile_dpbf16ps(0, 1, 3); break;
      case 2: _tile_dpbf16ps(0, 1, 4); break;
      case 3: _tile_dpbf16ps(0, 1, 5); break;
      case 4: _tile_dpbf16ps(0, 1, 6); break;
      default: _tile_dpbf16ps(0, 1, 7);
    }
  }

  int64_t num_heads_, group_, num_kv_heads_, chunks_, head_dim_, row_width_, token_stride_;
};
#endif

// One task a part of a sequence, all its heads together: a task reading one head's rows strided
// through the pool was bound by memory latency (3 GB/s); whole tokens are contiguous.
template <typename Q, typename T>
void decode(const Q* q, int64_t q_token_stride, const T* k_cache, const T* v_cache,
            const int64_t* block_tables, const int64_t* seq_lens, Q* out, int64_t batch,
            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t row_width,
            int64_t block_size, int64_t table_stride, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * row_width;
  const int64_t block_stride = block_size * token_stride;
#if defined(__AVX512F__)
  const bool vector_rows = kVectorRows<T> && head_dim % 64 == 0;
  const int64_t run = vector_rows ? kRun : block_size;
#else
  const int64_t run = block_size;
#endif
  // One table for every query: the tokens of a prefill chunk (paged_prefill_attention).
  const auto order = [&](int64_t i) { return table_stride == 0 ? balanced_order(i, batch) : i; };
  const int64_t part_tokens = (kPartTokens + block_size - 1) / block_size * block_size;
  std::vector<Part> parts;
  std::vector<Split> splits;
  int64_t slots = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t b = order(i), len = seq_lens[b];
    if (len <= part_tokens) {
      parts.push_back({b, 0, len, -1, -1});
      continue;
    }
    const int64_t index = static_cast<int64_t>(splits.size());
    splits.push_back({static_cast<int64_t>(parts.size()), (len + part_tokens - 1) / part_tokens});
    for (int64_t first = 0; first < len; first += part_tokens)
      parts.push_back({b, first, std::min(len, first + part_tokens), slots++, index});
  }
  // A part's weighted sum of V [heads][head_dim], then its max and sum a head.
  const int64_t slot_floats = num_heads * (head_dim + 2);
  std::vector<float> partial(slots * slot_floats);
  std::vector<std::atomic<int64_t>> unfinished(splits.size());
  for (size_t s = 0; s < splits.size(); ++s) unfinished[s] = splits[s].parts;
  const int64_t acc_floats = num_heads * head_dim;
  // Sequence b's attention, from float32 acc.
  const auto store = [&](int64_t b, const float* acc) {
    Q* dst = out + b * acc_floats;
    for (int64_t i = 0; i < acc_floats; ++i) dst[i] = static_cast<Q>(acc[i]);
  };
  // Each split sequence: its parts' sums, each rescaled from its own max to the largest.
  const auto merge = [&](const Split& split, float* acc) {
    const int64_t first = split.first_part, count = split.parts, b = parts[first].sequence;
    float* const weights = reused_buffer<float, 10>(count);
    std::fill_n(acc, acc_floats, 0.f);
    for (int64_t g = 0; g < num_heads; ++g) {
      const auto stat = [&](int64_t p, int64_t which) {
        return partial[parts[first + p].slot * slot_floats + num_heads * head_dim + 2 * g + which];
      };
      float peak = -INFINITY, total = 0.f;
      for (int64_t p = 0; p < count; ++p) peak = std::max(peak, stat(p, 0));
      for (int64_t p = 0; p < count; ++p)
        total += (weights[p] = std::exp(stat(p, 0) - peak)) * stat(p, 1);
      for (int64_t p = 0; p < count; ++p) {
        const float w = weights[p] / total;
        const float* part_acc = partial.data() + parts[first + p].slot * slot_floats + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] += w * part_acc[d];
      }
    }
    store(b, acc);
  };
  const auto first_key = [&](const Part& part) {
    return block_tables[part.sequence * table_stride + part.first / block_size] * block_stride;
  };
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  constexpr bool kTilesApply = std::is_same_v<T, c10::BFloat16> && std::is_same_v<Q, c10::BFloat16>;
  const bool tile_scores = kTilesApply && run == kRun && block_size % kRun == 0 &&
                           TileScores::fits(num_heads, num_kv_heads, head_dim);
  const TileScores scorer(num_heads, num_kv_heads, head_dim, row_width, token_stride);
#endif
  // Threads share the parts out (kernels/work_sharing.cpp): a thread's sequences summed to more
  // tokens than the other's, or came from memory later.
  share_blocks(static_cast<int64_t>(parts.size()), [&](auto take) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    std::optional<Tiles> tiles;
    if (tile_scores) tiles.emplace();
#endif
    float* const row = reused_buffer<float, 11>(head_dim);
    float* const acc = reused_buffer<float, 12>(acc_floats);
    float* const queries = reused_buffer<float, 13>(acc_floats);
    take([&](int64_t i, int64_t next) {
      const Part& part = parts[i];
      const int64_t b = part.sequence, len = part.end - part.first;
      const int64_t* table = block_tables + b * table_stride + part.first / block_size;
      load_row(q + b * q_token_stride, acc_floats, queries);
      float* const scores = reused_buffer<float, 14>(num_heads * len);  // [head][t]
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if constexpr (kTilesApply)
        if (tile_scores) scorer.load_queries(q + b * q_token_stride);
#endif
      for_each_run(k_cache, table, len, block_size, token_stride, run,
                   [&](int64_t t, const T* tokens, int64_t room, int64_t count, const Ahead& ahead) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if constexpr (kTilesApply) {
          if (tile_scores) {  // runs of 16 in blocks of a multiple of 16
            scorer.score(tokens, count, scale, scores + t, len, ahead);
            return;
          }
        }
#endif
        for (int64_t g = 0; g < num_heads; ++g) {
          ahead.part(g, num_heads);
          const T* rows = tokens + (g / group) * row_width;
          float* out_scores = scores + g * len + t;
#if defined(__AVX512F__)
          if constexpr (kVectorRows<T>) {
            if (vector_rows && room >= kRun) {
#if defined(__AVX512BF16__)
              if constexpr (std::is_same_v<T, c10::BFloat16>) {  // then q is bfloat16 too
                score_run(q + b * q_token_stride + g * head_dim, rows, token_stride, count,
                          head_dim, scale, out_scores);
                continue;
              }
#endif
              score_run(queries + g * head_dim, rows, token_stride, count, head_dim,
                        scale, out_scores);
              continue;
            }
          }
#endif
          score_rows(queries + g * head_dim, rows, token_stride, count, head_dim, scale,
                     out_scores, row);
        }
      }, v_cache + table[0] * block_stride);
      float* slot = part.slot < 0 ? nullptr : partial.data() + part.slot * slot_floats;
      for (int64_t g = 0; g < num_heads; ++g) {
        if (slot == nullptr) {
          softmax_(scores + g * len, len);
        } else {
          const auto [peak, total] = exp_from_peak(scores + g * len, len);
          slot[num_heads * head_dim + 2 * g] = peak;
          slot[num_heads * head_dim + 2 * g + 1] = total;
        }
      }
      std::fill_n(acc, acc_floats, 0.f);
      for_each_run(v_cache, table, len, block_size, token_stride, run,
                   [&](int64_t t, const T* tokens, int64_t, int64_t count, const Ahead& ahead) {
#if defined(__AVX512F__)
        if constexpr (kVectorRows<T>) {
          if (vector_rows) {
            for (int64_t h = 0; h < num_kv_heads; ++h) {
              ahead.part(h, num_kv_heads);
              accumulate_heads(scores + h * group * len + t, len,
                               tokens + h * row_width, token_stride, count, head_dim, group,
                               acc + h * group * head_dim);
            }
            return;
          }
        }
#endif
        ahead.part(0, 1);
        for (int64_t g = 0; g < num_heads; ++g)
          accumulate_rows(scores + g * len + t, tokens + (g / group) * row_width,
                          token_stride, count, head_dim, acc + g * head_dim, row);
      }, next >= 0 ? k_cache + first_key(parts[next]) : nullptr);
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        if (vector_rows) in_dimension_order(acc, acc_floats);
#endif
      if (slot != nullptr) {
        std::copy_n(acc, acc_floats, slot);
        // The last part done merges; acq_rel: it sees the other parts' writes.
        if (unfinished[part.split].fetch_sub(1, std::memory_order_acq_rel) == 1)
          merge(splits[part.split], acc);
        return;
      }
      store(b, acc);
    });
  });
}

#if defined(__AVX512BF16__)
// Prefill of one chunk over a bfloat16 cache, in tiles of 16 query tokens by a run of up to 16
// keys. Attending each query token as a decode sequence re-reads its whole context once a token
// and reduces every dot product across lanes; here a tile's 16 queries sit in the 16 lanes of a
// register, so both products are VDPBF16PS on a broadcast pair of the other side, with no
// horizontal sums, and each key and value row is read once a tile for all of its group's heads.
// The softmax is online (flash attention's running max and sum, per lane), and the
// probabilities meet V rounded to bfloat16, as flash attention's do: each lane's arithmetic
// depends only on its own query and the keys (runs lie in blocks, so on their absolute
// positions), never on which queries share its tile.
constexpr int64_t kQueryTile = 16;

// pairs[k][d] = (row 2k, row 2k + 1) of dimension d, as two bfloat16 in 32 bits; a missing odd
// row is zero. head_dim a multiple of 32. VPUNPCK{L,H}WD interleave within 128-bit lanes; the
// permutes put the dimensions back in order.
inline void tiled_values(const c10::BFloat16* rows, int64_t stride, int64_t count,
                         int64_t head_dim, uint32_t* pairs) {
  const __m512i first_half =
      _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t k = 0; 2 * k < count; ++k) {
    const auto* first = reinterpret_cast<const uint16_t*>(rows + 2 * k * stride);
    const auto* second = reinterpret_cast<const uint16_t*>(rows + (2 * k + 1) * stride);
    for (int64_t c = 0; c < head_dim; c += 32) {
      const __m512i a = _mm512_loadu_si512(first + c);
      const __m512i b = 2 * k + 1 < count ? _mm512_loadu_si512(second + c) : _mm512_setzero_si512();
      const __m512i low = _mm512_unpacklo_epi16(a, b), high = _mm512_unpackhi_epi16(a, b);
      _mm512_storeu_si512(pairs + k * head_dim + c,
                          _mm512_permutex2var_epi32(low, first_half, high));
      _mm512_storeu_si512(pairs + k * head_dim + c + 16,
                          _mm512_permutex2var_epi32(low, second_half, high));
    }
  }
}

// acc += a . {b, b, ...}: VDPBF16PS with a 32-bit memory operand broadcast to every lane, one
// instruction where the compiler emitted a broadcast and the product.
inline __m512 dot_pairs_broadcast(__m512 acc, __m512bh a, const uint32_t* b) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*b));
  return acc;
}

// One query head's tile state: its queries as pairs of dimensions ([D / 2][16 lanes]), the
// running max and sum per lane, and the output [D][16 lanes]. D is a template
// argument so that every broadcast operand sits at a constant offset and folds into VDPBF16PS.
template <int D>
struct QueryTile {
  alignas(64) uint32_t queries[D / 2 * kQueryTile];
  alignas(64) float acc[D * kQueryTile];
  alignas(64) float max[kQueryTile];
  alignas(64) float sum[kQueryTile];

  void start(const c10::BFloat16* q, int64_t token_stride, int64_t count) {
    for (int64_t lane = 0; lane < kQueryTile; ++lane)
      for (int64_t p = 0; p < D / 2; ++p) {
        uint32_t pair = 0;
        if (lane < count) std::memcpy(&pair, q + lane * token_stride + 2 * p, sizeof(pair));
        queries[p * kQueryTile + lane] = pair;
      }
    std::fill_n(acc, D * kQueryTile, 0.f);
    std::fill_n(max, kQueryTile, -INFINITY);
    std::fill_n(sum, kQueryTile, 0.f);
  }

  // The run of `count` keys from position `first` (`keys`: 16 rows D apart, rows past count
  // anything finite), their values as tiled_values' pairs, for queries at positions
  // `positions` (lanes). Scores past count are masked out.
  void attend(const uint32_t* keys, int64_t count, int64_t first, __m512i positions,
              const uint32_t* values, float scale) {
    __m512 s[kRun];
#pragma GCC unroll 16
    for (int j = 0; j < kRun; ++j) s[j] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int p = 0; p < D / 2; ++p) {
      const __m512bh qp = (__m512bh)_mm512_load_si512(queries + p * kQueryTile);
#pragma GCC unroll 16
      for (int j = 0; j < kRun; ++j)
        s[j] = dot_pairs_broadcast(s[j], qp, keys + j * D / 2 + p);
    }
    __mmask16 valid[kRun];
    const __m512 old_max = _mm512_load_ps(max);
    __m512 top = old_max;
#pragma GCC unroll 16
    for (int j = 0; j < kRun; ++j) {
      valid[j] = j < count ? _mm512_cmp_epi32_mask(_mm512_set1_epi32(first + j), positions,
                                                   _MM_CMPINT_LE) : 0;
      s[j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid[j], s[j], _mm512_set1_ps(scale));
      top = _mm512_max_ps(top, s[j]);
    }
    __m512 total = _mm512_load_ps(sum);
    if (_mm512_cmp_ps_mask(top, old_max, _CMP_NEQ_OQ)) {  // a lane's max rose: rescale its sums
      const __m512 alpha = exp16(_mm512_sub_ps(old_max, top));
      total = _mm512_mul_ps(total, alpha);
      for (int i = 0; i < D; ++i)
        _mm512_store_ps(acc + i * kQueryTile,
                        _mm512_mul_ps(_mm512_load_ps(acc + i * kQueryTile), alpha));
      _mm512_store_ps(max, top);
    }
    __m512i weights[kRun / 2];  // (key 2k, key 2k + 1) per lane, bfloat16
#pragma GCC unroll 8
    for (int k = 0; k < kRun / 2; ++k) {
      const __m512 even = _mm512_maskz_mov_ps(valid[2 * k], exp16(_mm512_sub_ps(s[2 * k], top)));
      const __m512 odd = _mm512_maskz_mov_ps(valid[2 * k + 1],
                                             exp16(_mm512_sub_ps(s[2 * k + 1], top)));
      total = _mm512_add_ps(total, _mm512_add_ps(even, odd));
      weights[k] = _mm512_or_si512(
          _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even)),
          _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd)), 16));
    }
    _mm512_store_ps(sum, total);
    const int64_t pairs = (count + 1) / 2;
    for (int i0 = 0; i0 < D; i0 += 16) {
      __m512 a[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) a[i] = _mm512_load_ps(acc + (i0 + i) * kQueryTile);
      for (int64_t k = 0; k < pairs; ++k) {
        const uint32_t* v = values + k * D + i0;
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
          a[i] = dot_pairs_broadcast(a[i], (__m512bh)weights[k], v + i);
      }
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) _mm512_store_ps(acc + (i0 + i) * kQueryTile, a[i]);
    }
  }

  void finish(c10::BFloat16* out, int64_t token_stride, int64_t count) const {
    alignas(64) uint16_t rounded[D][kQueryTile];  // acc / sum, rounded as static_cast would
    const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_load_ps(sum));
    for (int i = 0; i < D; ++i)
      _mm256_store_si256(reinterpret_cast<__m256i*>(rounded[i]), (__m256i)_mm512_cvtneps_pbh(
                             _mm512_mul_ps(_mm512_load_ps(acc + i * kQueryTile), inverse)));
    for (int64_t lane = 0; lane < count; ++lane) {
      auto* row = reinterpret_cast<uint16_t*>(out + lane * token_stride);
      for (int i = 0; i < D; ++i) row[i] = rounded[i][lane];
    }
  }
};

// q [Tq, H, D] and out contiguous heads, token i at position prefix + i; one task a (KV head,
// tile of 16 query tokens), its group's heads together.
template <int D>
void tiled_prefill(const c10::BFloat16* q, int64_t q_token_stride, const c10::BFloat16* k_cache,
                   const c10::BFloat16* v_cache, const int64_t* table, int64_t query_len,
                   int64_t prefix, c10::BFloat16* out, int64_t num_heads, int64_t num_kv_heads,
                   int64_t block_size, float scale) {
  const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * D;
  const int64_t tiles = (query_len + kQueryTile - 1) / kQueryTile;
  at::parallel_for(0, num_kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<QueryTile<D>> heads(group);
    alignas(64) uint32_t keys[kRun * D / 2] = {};  // the run's K rows, D apart
    alignas(64) uint32_t values[kRun / 2 * D];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % num_kv_heads;
      const int64_t t0 = balanced_order(task / num_kv_heads, tiles) * kQueryTile;
      const int64_t count = std::min(kQueryTile, query_len - t0);
      for (int64_t j = 0; j < group; ++j)
        heads[j].start(q + t0 * q_token_stride + (h * group + j) * D, q_token_stride, count);
      const __m512i positions = _mm512_add_epi32(
          _mm512_set1_epi32(prefix + t0),
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      for_each_run(k_cache + h * D, table, prefix + t0 + count, block_size, token_stride, kRun,
                   [&](int64_t t, const c10::BFloat16* rows, int64_t, int64_t run,
                       const Ahead& ahead) {
        ahead.part(0, 1);
        for (int64_t j = 0; j < run; ++j)
          std::memcpy(keys + j * D / 2, rows + j * token_stride, D * sizeof(c10::BFloat16));
        tiled_values(v_cache + (rows - k_cache), token_stride, run, D, values);
        for (auto& head : heads) head.attend(keys, run, t, positions, values, scale);
      });
      for (int64_t j = 0; j < group; ++j)
        heads[j].finish(out + t0 * num_heads * D + (h * group + j) * D, num_heads * D, count);
    }
  });
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// tiled_prefill's tiles of 16 queries on AMX, for head_dim 64 and runs of 16 keys: its
// VDPBF16PS products were most of its work, and a TDPBF16PS does 16 x 16 x 32 products where one
// of those does 16 x 2. Per task (KV head, tile of 16 queries, its group's heads), two passes over
// the keys, with no online rescaling:
// - each run of 16 keys meets the queries as S^T = K Q^T, the keys' rows as they lie against Q
//   transposed into the tiles' pairs, so a C tile's rows are keys and its lanes queries, as
//   tiled_prefill's registers are: each lane's max is taken as its scores come;
// - then, 32 keys at a time, p = exp(s * scale - max) (the lane's sum in float32), rounded to
//   bfloat16 and turned to [queries][keys], meets V's pairs (tiled_values) in four C tiles of
//   [queries][16 dimensions] that hold the head's output over all the keys.
// Each query's result depends on its own position and the keys only, whatever the chunk. A
// 2,048-token step's attention took 0.31-0.41x tiled_prefill's time at 64 to 1,024 tokens a
// sequence (benchmarks/bench_kernels_ab.py --formats prefill, AMX VM).
constexpr int64_t kAmxDim = 64;
constexpr int64_t kChunkKeys = 32;

// Tile 4 = S^T for one head: the run's keys (`keys`, 16 rows of kAmxDim) by its queries
// (`pairs`: two B tiles, dimensions 0-31 and 32-63), stored at `scores` [16 keys][16 lanes].
inline void run_scores(const uint16_t* keys, const uint32_t* pairs, float* scores) {
  _tile_zero(4);
  _tile_loadd(5, keys, kAmxDim * 2);
  _tile_loadd(6, pairs, 64);
  _tile_dpbf16ps(4, 5, 6);
  _tile_loadd(5, keys + 32, kAmxDim * 2);
  _tile_loadd(6, pairs + 256, 64);
  _tile_dpbf16ps(4, 5, 6);
  _tile_stored(4, scores, 64);
}

// Tiles 0-3 += P V for 32 keys: P [16 queries][32 keys] bfloat16 in `probs`, V as tiled_values'
// pairs of those keys (16 rows of kAmxDim pairs).
inline void chunk_values(const uint16_t* probs, const uint32_t* values) {
  _tile_loadd(5, probs, 64);
  _tile_loadd(6, values, kAmxDim * 4);
  _tile_dpbf16ps(0, 5, 6);
  _tile_loadd(6, values + 16, kAmxDim * 4);
  _tile_dpbf16ps(1, 5, 6);
  _tile_loadd(6, values + 32, kAmxDim * 4);
  _tile_dpbf16ps(2, 5, 6);
  _tile_loadd(6, values + 48, kAmxDim * 4);
  _tile_dpbf16ps(3, 5, 6);
}

void amx_prefill(const c10::BFloat16* q, int64_t q_token_stride, const c10::BFloat16* k_cache,
                 const c10::BFloat16* v_cache, const int64_t* table, int64_t query_len,
                 int64_t prefix, c10::BFloat16* out, int64_t num_heads, int64_t num_kv_heads,
                 int64_t block_size, float scale) {
  constexpr int64_t D = kAmxDim;
  const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * D;
  const int64_t tiles = (query_len + kQueryTile - 1) / kQueryTile;
  at::parallel_for(0, num_kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    const Tiles amx;
    std::vector<float> scores;     // [head][key][16 lanes]
    std::vector<uint32_t> values;  // [key / 2][D]: tiled_values' pairs
    std::vector<uint32_t> pairs(group * 2 * 256);  // per head, dimensions 0-31 and 32-63
    std::vector<__m512> top;                        // per head, each lane's largest score
    alignas(64) uint16_t keys[kRun * D];
    alignas(64) uint16_t probs[kQueryTile * kChunkKeys];
    alignas(64) float acc[kQueryTile * D];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % num_kv_heads;
      const int64_t t0 = balanced_order(task / num_kv_heads, tiles) * kQueryTile;
      const int64_t count = std::min(kQueryTile, query_len - t0);
      const int64_t len = prefix + t0 + count;
      const int64_t padded = (len + kChunkKeys - 1) / kChunkKeys * kChunkKeys;
      const __m512i positions = _mm512_add_epi32(
          _mm512_set1_epi32(prefix + t0),
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      for (int64_t j = 0; j < group; ++j)
        for (int64_t half = 0; half < 2; ++half)
          pair_tile(reinterpret_cast<const uint16_t*>(q + t0 * q_token_stride +
                                                      (h * group + j) * D + 32 * half),
                    q_token_stride, count, pairs.data() + (j * 2 + half) * 256);
      scores.resize(group * padded * kQueryTile);
      values.assign(padded / 2 * D, 0);  // keys past len meet p = 0, so must be finite
      top.assign(group, _mm512_set1_ps(-INFINITY));
      for_each_run(k_cache + h * D, table, len, block_size, token_stride, kRun,
                   [&](int64_t t, const c10::BFloat16* rows, int64_t, int64_t run,
                       const Ahead& ahead) {
        ahead.part(0, 1);
        for (int64_t r = 0; r < kRun; ++r)
          if (r < run) std::memcpy(keys + r * D, rows + r * token_stride, D * 2);
          else std::memset(keys + r * D, 0, D * 2);
        tiled_values(v_cache + (rows - k_cache), token_stride, run, D, values.data() + t / 2 * D);
        for (int64_t j = 0; j < group; ++j) {
          float* run_scores_at = scores.data() + (j * padded + t) * kQueryTile;
          run_scores(keys, pairs.data() + j * 2 * 256, run_scores_at);
          for (int64_t r = 0; r < run; ++r) {
            const __mmask16 valid = _mm512_cmp_epi32_mask(_mm512_set1_epi32(t + r), positions,
                                                          _MM_CMPINT_LE);
            top[j] = _mm512_mask_max_ps(top[j], valid, top[j],
                                        _mm512_loadu_ps(run_scores_at + r * kQueryTile));
          }
        }
      });
      for (int64_t j = 0; j < group; ++j) {
        const __m512 shift = _mm512_mul_ps(top[j], _mm512_set1_ps(scale));
        __m512 total = _mm512_setzero_ps();
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < padded; c += kChunkKeys) {
          __m512 p[kChunkKeys];  // lanes: queries
          for (int64_t k = 0; k < kChunkKeys; ++k) {
            const __mmask16 valid = _mm512_cmp_epi32_mask(_mm512_set1_epi32(c + k), positions,
                                                          _MM_CMPINT_LE);
            const __m512 s = _mm512_loadu_ps(scores.data() + (j * padded + c + k) * kQueryTile);
            p[k] = _mm512_maskz_mov_ps(valid, exp16(_mm512_fmsub_ps(s, _mm512_set1_ps(scale),
                                                                     shift)));
            total = _mm512_add_ps(total, p[k]);
          }
          transpose16x16(p);
          transpose16x16(p + kQueryTile);
          for (int64_t n = 0; n < kQueryTile; ++n)  // query n's 32 keys in order
            _mm512_store_si512(probs + n * kChunkKeys,
                               (__m512i)_mm512_cvtne2ps_pbh(p[kQueryTile + n], p[n]));
          chunk_values(probs, values.data() + c / 2 * D);
        }
        _tile_stored(0, acc, D * 4);
        _tile_stored(1, acc + 16, D * 4);
        _tile_stored(2, acc + 32, D * 4);
        _tile_stored(3, acc + 48, D * 4);
        alignas(64) float sums[kQueryTile];
        _mm512_store_ps(sums, total);
        for (int64_t n = 0; n < count; ++n) {
          const __m512 inverse = _mm512_set1_ps(1.f / sums[n]);
          auto* row = reinterpret_cast<__m256i*>(out + (t0 + n) * num_heads * D +
                                                 (h * group + j) * D);
          for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256(row + d / 16, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(
                                    _mm512_load_ps(acc + n * D + d), inverse)));
        }
      }
    }
  });
}
#endif

}  // namespace

// q [B, H, D] in float32, bfloat16 or float16, its head_dim rows contiguous and its heads
// adjacent (a view into the fused qkv product is fine); caches [num_blocks, block_size, Hkv, row]
// of q's dtype (row = D), or int8 (row = D + 4: codes, then the scale's bytes); block_tables
// [B, max_blocks] int64 (rows contiguous; a row stride of 0 gives every query one table, as for
// the tokens of one prefill chunk, each its own "sequence" ending at its position); seq_lens [B]
// int64. Writes [B, H, D] into `out`, contiguous, of q's dtype.
void paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                            torch::Tensor out) {
  const WithoutGil without_gil;
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: [B, H, D] with contiguous heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() &&
                  out.scalar_type() == q.scalar_type(), "out: contiguous, q's shape and dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables and seq_lens must be int64");
  const bool int8_cache = k_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(int8_cache || k_cache.scalar_type() == q.scalar_type(),
              "a float cache must hold q's dtype");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t row_width = k_cache.size(3);
  TORCH_CHECK(row_width == head_dim + (int8_cache ? 4 : 0), "cache rows: ", row_width,
              " elements for head_dim ", head_dim);
  if (block_tables.stride(1) != 1) block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode", [&] {
    auto run = [&](auto* k, auto* v) {
      decode(q.data_ptr<scalar_t>(), q.stride(0), k, v, block_tables.data_ptr<int64_t>(),
             seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), batch, num_heads,
             num_kv_heads, head_dim, row_width, block_size, block_tables.stride(0),
             static_cast<float>(scale));
    };
    if (int8_cache) {
      run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
    } else {
      run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
    }
  });
}

// One prefill chunk's attention: q [Tq, H, D] (heads contiguous; a view into the fused qkv
// product is fine), token i at position seq_lens[i] - 1 of the sequence whose blocks are
// block_table [blocks] int64, seq_lens [Tq] int64 consecutive (attention.py's prefill_chunk);
// caches as paged_decode_attention's. bfloat16 q and cache (or an int8 cache, de-quantized to
// bfloat16 first) with head_dim 64 or 128 run tiled_prefill on AVX-512 BF16 (amx_prefill for 64
// on AMX, blocks a multiple of 16); anything else attends each token as a decode sequence, the
// numbers decode gives (float32's chunked prefill, prefix hits and recomputes rely on it).
// Writes [Tq, H, D] into `out`, contiguous, of q's dtype.
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                             torch::Tensor out) {
  TORCH_CHECK(block_table.dim() == 1 && seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0),
              "block_table [blocks], seq_lens [Tq]");
#if defined(__AVX512BF16__)
  if (q.scalar_type() == torch::kBFloat16 && k_cache.scalar_type() == torch::kChar &&
      q.dim() == 3 && (q.size(2) == 64 || q.size(2) == 128) && q.size(0) > 0) {
    // An int8 cache: the chunk's blocks de-quantized to bfloat16 (dequantize_rows' values, rounded
    // as .to(torch.bfloat16) rounds them), then the tiled prefill over those. Each query token
    // attending as a decode sequence had taken 2x the bf16 cache's prefill time (2,048-token
    // steps of 400-token prompts).
    const WithoutGil without_gil;
    const int64_t block_size = k_cache.size(1), heads = k_cache.size(2), head_dim = q.size(2);
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    v_cache.scalar_type() == torch::kChar && k_cache.size(3) == head_dim + 4 &&
                    block_table.scalar_type() == torch::kInt64 &&
                    seq_lens.scalar_type() == torch::kInt64,
                "int8 caches [num_blocks, block_size, Hkv, D + 4], int64 block_table and seq_lens");
    block_table = block_table.contiguous();
    const int64_t last = seq_lens[q.size(0) - 1].item<int64_t>();
    const int64_t blocks = (last + block_size - 1) / block_size;
    TORCH_CHECK(0 < last && blocks <= block_table.size(0),
                "block_table: too few blocks for the chunk's positions");
    const int64_t* table = block_table.data_ptr<int64_t>();
    for (int64_t b = 0; b < blocks; ++b)
      TORCH_CHECK(0 <= table[b] && table[b] < k_cache.size(0), "block_table: block out of range");
    const int64_t block_rows = block_size * heads, width = head_dim + 4;
    const auto widened = [&](const torch::Tensor& cache) {
      torch::Tensor into = torch::empty({blocks, block_size, heads, head_dim}, q.options());
      const int8_t* src = cache.data_ptr<int8_t>();
      c10::BFloat16* dst = into.data_ptr<c10::BFloat16>();
      at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> row(head_dim);
        for (int64_t b = begin; b < end; ++b)
          for (int64_t r = 0; r < block_rows; ++r) {
            load_row(src + (table[b] * block_rows + r) * width, head_dim, row.data());
            c10::BFloat16* out_row = dst + (b * block_rows + r) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) out_row[d] = c10::BFloat16(row[d]);
          }
      });
      return into;
    };
    paged_prefill_attention(q, widened(k_cache), widened(v_cache),
                            torch::arange(blocks, block_table.options()), seq_lens, scale, out);
    return;
  }
  if (q.scalar_type() == torch::kBFloat16 && k_cache.scalar_type() == torch::kBFloat16 &&
      q.dim() == 3 && (q.size(2) == 64 || q.size(2) == 128) && q.size(0) > 0) {
    TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2),
                "q: [Tq, H, D] with contiguous heads");
    TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() &&
                    out.scalar_type() == q.scalar_type(), "out: contiguous, q's shape and dtype");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    v_cache.scalar_type() == torch::kBFloat16 && k_cache.size(3) == q.size(2),
                "caches: contiguous bfloat16 [num_blocks, block_size, Hkv, D]");
    TORCH_CHECK(block_table.scalar_type() == torch::kInt64 &&
                    seq_lens.scalar_type() == torch::kInt64,
                "block_table and seq_lens must be int64");
    block_table = block_table.contiguous();
    seq_lens = seq_lens.contiguous();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    const int64_t query_len = q.size(0);
    TORCH_CHECK(lens[query_len - 1] - lens[0] == query_len - 1 && lens[0] >= 1,
                "seq_lens: consecutive positions + 1");
    TORCH_CHECK(block_table.size(0) * k_cache.size(1) >= lens[query_len - 1],
                "block_table: too few blocks for the chunk's positions");
    const WithoutGil without_gil;
    auto tiled = q.size(2) == 64 ? tiled_prefill<64> : tiled_prefill<128>;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (q.size(2) == kAmxDim && k_cache.size(1) % kRun == 0 && amx_permitted()) tiled = amx_prefill;
#endif
    tiled(q.data_ptr<c10::BFloat16>(), q.stride(0), k_cache.data_ptr<c10::BFloat16>(),
          v_cache.data_ptr<c10::BFloat16>(), block_table.data_ptr<int64_t>(), query_len,
          lens[0] - 1, out.data_ptr<c10::BFloat16>(), q.size(1), k_cache.size(2), k_cache.size(1),
          static_cast<float>(scale));
    return;
  }
#endif
  paged_decode_attention(q, k_cache, v_cache, block_table.expand({q.size(0), -1}), seq_lens,
                         scale, out);
}
