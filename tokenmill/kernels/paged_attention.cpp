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
#include <cmath>
#include <cstring>
#include <type_traits>
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

inline void softmax_(float* s, int64_t n) {
  __m512 peak = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) peak = _mm512_max_ps(peak, _mm512_loadu_ps(s + i));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  if (i < n) peak = _mm512_mask_max_ps(peak, tail, peak, _mm512_maskz_loadu_ps(tail, s + i));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
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
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
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

inline void softmax_(float* s, int64_t n) {
  const float peak = *std::max_element(s, s + n);
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += (s[i] = std::exp(s[i] - peak));
  const float inv = 1.f / total;
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
// Sixteen rows at a time for float and bfloat16 caches: one horizontal sum (a transpose-add of 16
// registers) for 16 dot products instead of one each, and the weighted sum in registers.
constexpr int64_t kRun = 16;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
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
    for (int i = 0; i < kRun; ++i) sums[i] = _mm512_fmadd_ps(q, load16(rows + i * stride + c), sums[i]);
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
      const T* row = rows + i * stride + c;
      __m512 v[4];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) v[r] = load16(row + 16 * r);
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
constexpr bool kVectorRows = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#endif

// Calls fn(t, rows, room, count) for each run of a sequence's first `len` cached tokens that lies
// in one block: `count` tokens from token t, `room` rows before the block ends. A token's KV heads
// are adjacent, so the walk reads the pool sequentially.
template <typename T, typename Fn>
inline void for_each_run(const T* cache, const int64_t* table, int64_t len, int64_t block_size,
                         int64_t token_stride, int64_t run, Fn fn) {
  const int64_t block_bytes = block_size * token_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t block = 0, t = 0; t < len; ++block) {
    const T* tokens = cache + table[block] * block_size * token_stride;
    if (t + block_size < len)  // the next block, while this one is read: blocks lie anywhere
      prefetch_bytes(cache + table[block + 1] * block_size * token_stride, block_bytes);
    for (int64_t offset = 0; offset < block_size && t < len; offset += run) {
      const int64_t count = std::min({run, block_size - offset, len - t});
      fn(t, tokens + offset * token_stride, block_size - offset, count);
      t += count;
    }
  }
}

// One task a sequence, all its heads together: a task reading one head's rows strided through the
// pool was bound by memory latency (3 GB/s); whole tokens are contiguous.
template <typename Q, typename T>
void decode(const Q* q, int64_t q_token_stride, const T* k_cache, const T* v_cache,
            const int64_t* block_tables, const int64_t* seq_lens, Q* out, int64_t batch,
            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t row_width,
            int64_t block_size, int64_t table_stride, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * row_width;
#if defined(__AVX512F__)
  const bool vector_rows = kVectorRows<T> && head_dim % 64 == 0;
  const int64_t run = vector_rows ? kRun : block_size;
#else
  const int64_t run = block_size;
#endif
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row(head_dim), acc(num_heads * head_dim);
    std::vector<float> queries(num_heads * head_dim);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = seq_lens[b];
      const int64_t* table = block_tables + b * table_stride;
      load_row(q + b * q_token_stride, num_heads * head_dim, queries.data());
      scores.resize(num_heads * len);  // [head][t]
      for_each_run(k_cache, table, len, block_size, token_stride, run,
                   [&](int64_t t, const T* tokens, int64_t room, int64_t count) {
        for (int64_t g = 0; g < num_heads; ++g) {
          const T* rows = tokens + (g / group) * row_width;
          float* out_scores = scores.data() + g * len + t;
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
              score_run(queries.data() + g * head_dim, rows, token_stride, count, head_dim,
                        scale, out_scores);
              continue;
            }
          }
#endif
          score_rows(queries.data() + g * head_dim, rows, token_stride, count, head_dim, scale,
                     out_scores, row.data());
        }
      });
      for (int64_t g = 0; g < num_heads; ++g) softmax_(scores.data() + g * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_run(v_cache, table, len, block_size, token_stride, run,
                   [&](int64_t t, const T* tokens, int64_t, int64_t count) {
#if defined(__AVX512F__)
        if constexpr (kVectorRows<T>) {
          if (vector_rows) {
            for (int64_t h = 0; h < num_kv_heads; ++h)
              accumulate_heads(scores.data() + h * group * len + t, len,
                               tokens + h * row_width, token_stride, count, head_dim, group,
                               acc.data() + h * group * head_dim);
            return;
          }
        }
#endif
        for (int64_t g = 0; g < num_heads; ++g)
          accumulate_rows(scores.data() + g * len + t, tokens + (g / group) * row_width,
                          token_stride, count, head_dim, acc.data() + g * head_dim, row.data());
      });
      Q* dst = out + b * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) dst[i] = static_cast<Q>(acc[i]);
    }
  });
}

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
