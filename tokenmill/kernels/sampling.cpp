// The sampler's passes over the logits: greedy, sampling and logprobs.
//
// Greedy: each row's largest value's index (the first, on ties), as torch.argmax gives it.
// torch's CPU argmax took 2 ms on 64 x 49,152 float32 logits on the AMX machine, and 5 ms on the
// bfloat16 ones (3 ms with the float32 copy the sampler made first): 5% of a 64-sequence decode
// step, for 6 MB read. Here each of 16 lanes keeps its best value and
// index, and the lanes are folded once a row. NaN never wins (torch would pick it): logits with
// NaN have no meaningful argmax.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  int64_t found = 0;
  float value = static_cast<float>(row[0]);
  int64_t i = 1;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 best = load16(row);  // paged_attention.cpp's
    __m512i best_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i index = best_index;
    const __m512i step = _mm512_set1_epi32(16);
    for (i = 16; i + 16 <= n; i += 16) {
      index = _mm512_add_epi32(index, step);
      const __m512 v = load16(row + i);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, greater, v);
      best_index = _mm512_mask_mov_epi32(best_index, greater, index);
    }
    value = _mm512_reduce_max_ps(best);
    const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(value), _CMP_EQ_OQ);
    found = _mm512_mask_reduce_min_epi32(holders, best_index);
  }
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (v > value) {
      value = v;
      found = i;
    }
  }
  return found;
}

// Sampling: the token where a uniform number falls in the row's cumulative distribution after
// temperature, top-k, top-p and min-p, as model/sampler.py's shaped_probs and invert_cdf find
// it. The row's max, then each share exp((l - max) / T) into a buffer, the cuts (least_kept),
// the kept shares summed in float64 a block of kCdfBlock, and the block the number falls in
// walked value by value. The torch path's copy, scaling, softmax and sums took about 7 ms for 64
// rows of 49,152, and top-p's topk candidates more.
constexpr int64_t kCdfBlock = 256;

// out[i] = exp((row[i] - peak) * scale) for the row's n values.
template <typename T>
void shares(const T* row, int64_t n, float peak, float scale, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 top = _mm512_set1_ps(peak), by = _mm512_set1_ps(scale);
  const auto share16 = [&](__m512 x) { return exp16(_mm512_mul_ps(_mm512_sub_ps(x, top), by)); };
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, share16(load16(row + i)));
  if (i < n) {
    alignas(64) float tail[16] = {};
    for (int64_t j = i; j < n; ++j) tail[j - i] = static_cast<float>(row[j]);
    _mm512_store_ps(tail, share16(_mm512_load_ps(tail)));
    std::copy(tail, tail + (n - i), out + i);
  }
#else
  for (; i < n; ++i) out[i] = std::exp((static_cast<float>(row[i]) - peak) * scale);
#endif
}

// Shares are in [0, 1]: no sign bit, and a larger exponent holds larger shares.
inline uint32_t exponent(float share) {
  uint32_t bits;
  std::memcpy(&bits, &share, sizeof bits);
  return bits >> 23;
}

// The shares above `floor` with exponent e, and `ties` more equal to floor if it has exponent e,
// largest first. With AVX-512, 16 shares are compared at a time and the matches compress-stored:
// the branchy scalar pass had been a fifth of a top-p draw's time (perf).
std::vector<float> exponent_shares(const std::vector<float>& values, float floor, int64_t ties,
                                   uint32_t e) {
  std::vector<float> found(values.size() + 16);
  const int64_t n = static_cast<int64_t>(values.size());
  int64_t i = 0, count = 0;
#if defined(__AVX512F__)
  const __m512 above = _mm512_set1_ps(floor);
  const __m512i wanted = _mm512_set1_epi32(static_cast<int32_t>(e));
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(values.data() + i);
    const __m512i exponents = _mm512_srli_epi32(_mm512_castps_si512(v), 23);
    const __mmask16 match = _mm512_cmp_ps_mask(v, above, _CMP_GT_OQ) &
                            _mm512_cmpeq_epi32_mask(exponents, wanted);
    _mm512_mask_compressstoreu_ps(found.data() + count, match, v);
    count += __builtin_popcount(match);
  }
#endif
  for (; i < n; ++i)
    if (values[i] > floor && exponent(values[i]) == e) found[count++] = values[i];
  found.resize(count);
  if (exponent(floor) == e) found.insert(found.end(), ties, floor);
  std::sort(found.begin(), found.end(), std::greater<float>());
  return found;
}

// Histograms by exponent, kept in kCopies interleaved copies and summed at the end: one copy's
// adds into the few busy exponents waited on each other (a top-p draw's mass pass).
constexpr int kCopies = 4;

// fn(copy, i) for i in [0, n), value i into copy i % kCopies, unrolled by kCopies.
template <typename Fn>
inline void for_each_copy(int64_t n, Fn fn) {
  int64_t i = 0;
  for (; i + kCopies <= n; i += kCopies)
#pragma GCC unroll 4
    for (int c = 0; c < kCopies; ++c) fn(c, i + c);
  for (; i < n; ++i) fn(static_cast<int>(i % kCopies), i);
}

// The least share kept, as kept_from and shaped_probs keep them: top-k's k-th largest (ties with
// it too); then top-p's among the top k (exactly k, counting ties with the k-th as kept_from's
// ranks do): from the largest, a share stays while those above it sum to less than top_p of the
// k's total; then min-p's, a share of at least min_p of the largest, which is 1. Each cut is
// found from the shares' float exponents (their count or mass by exponent), then a sort of the
// one exponent where it falls, not of the row.
float least_kept(const std::vector<float>& values, int64_t top_k, float top_p, float min_p) {
  float least = 0.f;
  int64_t ties = 0;  // shares equal to least among the top k (top-k on)
  const int64_t n = static_cast<int64_t>(values.size());
  if (0 < top_k && top_k < n) {
    int64_t copies[kCopies][256] = {}, count[256] = {};
    for_each_copy(n, [&](int c, int64_t i) { ++copies[c][exponent(values[i])]; });
    for (int c = 0; c < kCopies; ++c)
      for (int x = 0; x < 256; ++x) count[x] += copies[c][x];
    int64_t above = 0;
    uint32_t e = 255;
    for (; e > 0 && above + count[e] < top_k; --e) above += count[e];
    least = exponent_shares(values, -1.f, 0, e)[top_k - above - 1];
    ties = top_k;
    for (const float v : values) ties -= v > least;
  }
  if (top_p < 1.f) {
    double copies[kCopies][256] = {}, mass[256] = {}, total = 0.0;
    const float kept = ties == 0 ? least : std::nextafter(least, 2.f);  // the least share counted
    for_each_copy(n, [&](int c, int64_t i) {
      const float v = values[i];
      copies[c][exponent(v)] += v >= kept ? v : 0.f;
    });
    for (int x = 0; x < 256; ++x) {
      for (int c = 0; c < kCopies; ++c) mass[x] += copies[c][x];
      total += mass[x];
    }
    total += static_cast<double>(ties) * least;
    mass[exponent(least)] += static_cast<double>(ties) * least;
    const double target = static_cast<double>(top_p) * total;
    double above = 0.0;
    uint32_t e = 255;
    for (; e > 0 && above + mass[e] < target; --e) above += mass[e];
    const float floor = ties > 0 ? least : std::nextafter(least, -1.f);
    for (const float v : exponent_shares(values, floor, ties, e)) {
      if (above >= target) break;
      least = v;
      above += v;
    }
  }
  return std::max(least, min_p);
}

#if defined(__AVX512F__)
// 16 floats added in float64 into two 8-lane accumulators, the low 8 and the high 8.
struct SumF64 {
  __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
  void add(__m512 x) {
    low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
    high = _mm512_add_pd(high, _mm512_cvtps_pd(_mm256_castpd_ps(
                                   _mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
  }
  double total() const { return _mm512_reduce_add_pd(_mm512_add_pd(low, high)); }
};
#endif

// The sum of n floats in float64, 16 at a time with AVX-512: a scalar chain of float64 adds (4
// cycles each, 49,152 a row) had been most of a draw at a temperature alone.
inline double sum_f64(const float* v, int64_t n) {
  double sum = 0.0;
  int64_t i = 0;
#if defined(__AVX512F__)
  SumF64 sums;
  for (; i + 16 <= n; i += 16) sums.add(_mm512_loadu_ps(v + i));
  sum = sums.total();
#endif
  for (; i < n; ++i) sum += v[i];
  return sum;
}

template <typename T>
int64_t sample_row(const T* row, int64_t n, float temperature, int64_t top_k, float top_p,
                   float min_p, double uniform, std::vector<float>& values,
                   std::vector<double>& block_sums) {
  const float peak = static_cast<float>(row[row_argmax(row, n)]), scale = 1.f / temperature;
  const int64_t blocks = (n + kCdfBlock - 1) / kCdfBlock;
  values.resize(n);
  shares(row, n, peak, scale, values.data());
  if ((0 < top_k && top_k < n) || top_p < 1.f || min_p > 0.f) {  // the cut shares become 0
    const float least = least_kept(values, top_k, top_p, min_p);
    for (float& v : values)
      if (v < least) v = 0.f;
  }
  block_sums.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kCdfBlock;
    const int64_t end = std::min(n, begin + kCdfBlock);
    total += (block_sums[b] = sum_f64(values.data() + begin, end - begin));
  }
  // The first block, then value, whose running sum passes the target; past the end (rounding,
  // a uniform near 1), the last with a share.
  double target = uniform * total;
  int64_t b = 0;
  for (; b + 1 < blocks && block_sums[b] <= target; ++b) target -= block_sums[b];
  while (block_sums[b] == 0.0) --b;
  const int64_t begin = b * kCdfBlock, end = std::min(n, begin + kCdfBlock);
  int64_t last = begin;
  double running = 0.0;
  for (int64_t i = begin; i < end; ++i) {
    if (values[i] == 0.f) continue;
    last = i;
    if ((running += values[i]) > target) return i;
  }
  return last;
}

// Logprobs: each row's log-sum-exp (its max, then the shares exp(l - max) summed in float64),
// the chosen token's l - lse, and the row's num_top largest values (the lower index first on
// ties), found in one pass that compares 16 values at a time with the num_top-th so far. The torch
// path (a float32 copy, logsumexp, a subtraction over the row, then topk row by row) took 17 ms a
// step for 64 rows of 49,152 with the chosen token alone, 34 ms with the top one.
template <typename T>
float row_log_sum_exp(const T* row, int64_t n, float peak) {
  double sum = 0.0;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 top = _mm512_set1_ps(peak);
  SumF64 sums;
  for (; i + 16 <= n; i += 16) sums.add(exp16(_mm512_sub_ps(load16(row + i), top)));
  sum = sums.total();
#endif
  for (; i < n; ++i) sum += std::exp(static_cast<double>(static_cast<float>(row[i]) - peak));
  return static_cast<float>(static_cast<double>(peak) + std::log(sum));
}

using Ranked = std::vector<std::pair<float, int64_t>>;  // (value, index), largest first

template <typename T>
void row_top(const T* row, int64_t n, int64_t num_top, Ranked& top) {
  top.clear();
  if (num_top == 0) return;
  float threshold = -INFINITY;  // the num_top-th largest so far, once there are num_top
  const auto offer = [&](int64_t i) {
    const float v = static_cast<float>(row[i]);
    if (static_cast<int64_t>(top.size()) == num_top) {
      if (!(v > threshold)) return;
      top.pop_back();
    } else if (v != v) {
      return;  // NaN
    }
    // After every value >= v: scanning in index order, a tie keeps the lower index first.
    top.insert(std::upper_bound(top.begin(), top.end(), v,
                                [](float value, const auto& entry) { return value > entry.first; }),
               {v, i});
    if (static_cast<int64_t>(top.size()) == num_top) threshold = top.back().first;
  };
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __mmask16 above = _mm512_cmp_ps_mask(load16(row + i), _mm512_set1_ps(threshold), _CMP_GT_OQ);
    for (; above; above &= above - 1) offer(i + __builtin_ctz(above));
  }
#endif
  for (; i < n; ++i) offer(i);
}

void check_logits(const torch::Tensor& logits, const char* name) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0 &&
                  logits.size(1) < (int64_t{1} << 31) &&
                  (logits.scalar_type() == torch::kFloat ||
                   logits.scalar_type() == torch::kBFloat16),
              name, ": logits [rows, n] float32 or bfloat16 with contiguous rows");
}

// fn(row values, r, scratch) for each row of checked logits, over the threads, each with its
// own Scratch.
template <typename Scratch, typename Fn>
void for_each_row(const torch::Tensor& logits, Fn fn) {
  const int64_t rows = logits.size(0), stride = logits.stride(0);
  const auto each_row = [&](const auto* data) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t r = begin; r < end; ++r) fn(data + r * stride, r, scratch);
    });
  };
  if (logits.scalar_type() == torch::kFloat) each_row(logits.data_ptr<float>());
  else each_row(logits.data_ptr<c10::BFloat16>());
}

// A token a row of checked logits, [rows] int64: token(row values, r, scratch).
template <typename Scratch, typename Token>
torch::Tensor token_per_row(const torch::Tensor& logits, Token token) {
  auto out = torch::empty({logits.size(0)}, logits.options().dtype(torch::kLong));
  int64_t* tokens = out.data_ptr<int64_t>();
  for_each_row<Scratch>(logits, [&](const auto* row, int64_t r, Scratch& scratch) {
    tokens[r] = token(row, r, scratch);
  });
  return out;
}

struct NoScratch {};

struct SampleScratch {
  std::vector<float> values;
  std::vector<double> block_sums;
};

}  // namespace

// logits [rows, n] float32 or bfloat16 with contiguous rows, n < 2^31 -> [rows] int64.
torch::Tensor argmax_rows(torch::Tensor logits) {
  check_logits(logits, "argmax_rows");
  const int64_t n = logits.size(1);
  return token_per_row<NoScratch>(logits, [&](const auto* row, int64_t, NoScratch&) {
    return row_argmax(row, n);
  });
}

// logits as argmax_rows takes them; temperatures [rows] float32 (> 0), top_ks [rows] int64 (0:
// no cut), top_ps and min_ps [rows] float32 (1 and 0: no cut), uniforms [rows] float64 in [0, 1)
// -> [rows] int64: each row's token by sample_row.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperatures, torch::Tensor top_ks,
                          torch::Tensor top_ps, torch::Tensor min_ps, torch::Tensor uniforms) {
  check_logits(logits, "sample_rows");
  const int64_t rows = logits.size(0), n = logits.size(1);
  const auto per_row = [&](const torch::Tensor& t, torch::ScalarType type) {
    return t.scalar_type() == type && t.numel() == rows;
  };
  TORCH_CHECK(per_row(temperatures, torch::kFloat) && per_row(top_ks, torch::kLong) &&
                  per_row(top_ps, torch::kFloat) && per_row(min_ps, torch::kFloat) &&
                  per_row(uniforms, torch::kDouble),
              "sample_rows: temperatures, top_ps and min_ps [rows] float32, top_ks [rows] int64, "
              "uniforms [rows] float64");
  temperatures = temperatures.contiguous();
  top_ks = top_ks.contiguous();
  top_ps = top_ps.contiguous();
  min_ps = min_ps.contiguous();
  uniforms = uniforms.contiguous();
  const float *temps = temperatures.data_ptr<float>(), *ps = top_ps.data_ptr<float>();
  const float* mins = min_ps.data_ptr<float>();
  const int64_t* ks = top_ks.data_ptr<int64_t>();
  const double* us = uniforms.data_ptr<double>();
  return token_per_row<SampleScratch>(logits, [&](const auto* row, int64_t r,
                                                 SampleScratch& scratch) {
    return sample_row(row, n, temps[r], ks[r], ps[r], mins[r], us[r], scratch.values,
                      scratch.block_sums);
  });
}

// logits as argmax_rows takes them, chosen [rows] int64 (a token of each row), num_top >= 0 ->
// values [rows, 1 + num_top] float32 (the chosen token's logprob, then the num_top largest
// logprobs, largest first) and their tokens, ids [rows, num_top] int64.
std::tuple<torch::Tensor, torch::Tensor> logprob_rows(torch::Tensor logits, torch::Tensor chosen,
                                                      int64_t num_top) {
  check_logits(logits, "logprob_rows");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(chosen.scalar_type() == torch::kLong && chosen.numel() == rows && 0 <= num_top &&
                  num_top <= n,
              "logprob_rows: chosen [rows] int64, 0 <= num_top <= n");
  chosen = chosen.contiguous();
  const int64_t* tokens = chosen.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(0 <= tokens[r] && tokens[r] < n, "logprob_rows: chosen token out of range");
  auto values = torch::empty({rows, 1 + num_top}, logits.options().dtype(torch::kFloat));
  auto ids = torch::empty({rows, num_top}, logits.options().dtype(torch::kLong));
  float* value_out = values.data_ptr<float>();
  int64_t* id_out = ids.data_ptr<int64_t>();
  for_each_row<Ranked>(logits, [&](const auto* row, int64_t r, Ranked& top) {
    const float lse = row_log_sum_exp(row, n, static_cast<float>(row[row_argmax(row, n)]));
    float* out = value_out + r * (1 + num_top);
    out[0] = static_cast<float>(row[tokens[r]]) - lse;
    row_top(row, n, num_top, top);
    for (int64_t j = 0; j < num_top; ++j) {
      out[1 + j] = top[j].first - lse;
      id_out[r * num_top + j] = top[j].second;
    }
  });
  return {values, ids};
}
