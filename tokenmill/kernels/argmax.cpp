// Greedy sampling's pass over the logits: each row's largest value's index (the first, on ties),
// as torch.argmax gives it. torch's CPU argmax took 2 ms on 64 x 49,152 float32 logits on the AMX
// machine, and 5 ms on the bfloat16 ones (3 ms with the float32 copy the sampler made first): 5%
// of a 64-sequence decode step, for 6 MB read. Here each of 16 lanes keeps its best value and
// index, and the lanes are folded once a row. NaN never wins (torch would pick it): logits with
// NaN have no meaningful argmax.
#include <torch/extension.h>
#include <ATen/Parallel.h>

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

}  // namespace

// logits [rows, n] float32 or bfloat16 with contiguous rows, n < 2^31 -> [rows] int64.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0 &&
                  logits.size(1) < (int64_t{1} << 31) &&
                  (logits.scalar_type() == torch::kFloat ||
                   logits.scalar_type() == torch::kBFloat16),
              "argmax_rows: logits [rows, n] float32 or bfloat16 with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  int64_t* indices = out.data_ptr<int64_t>();
  const auto each_row = [&](const auto* data) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) indices[r] = row_argmax(data + r * stride, n);
    });
  };
  if (logits.scalar_type() == torch::kFloat) each_row(logits.data_ptr<float>());
  else each_row(logits.data_ptr<c10::BFloat16>());
  return out;
}
