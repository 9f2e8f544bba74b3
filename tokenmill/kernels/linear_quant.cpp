// y = x W^T for a few bfloat16 rows of x and an int8 or int4 W (tokenmill/quant), on CPUs with
// AVX-512 BF16.
//
// Decode streams every weight once a step and is bound by memory, so fewer bytes a weight is
// the whole gain, as long as widening the codes costs less than the bytes saved: the codes of
// four rows of W are widened to bfloat16 in registers, never stored, and multiplied with VDPBF16PS
// as in linear_bf16.cpp. int8 codes are exact in bfloat16 and the row's scale multiplies the sum;
// int4 values are de-quantized as tokenmill/quant/int4.py does it (code * scale, then + min, in
// float32) and rounded to bfloat16, the weights the de-quantize path feeds its GEMM.

namespace {

#if defined(__AVX512BF16__)
// sums[m][n] = dot(x row m, codes row n) for MT rows of x and kWeightRows int8 rows (K a multiple
// of 32), each code widened to bfloat16 in registers (exact: |code| <= 127 needs 7 bits).
template <int MT>
inline void int8_tile(const uint16_t* x, int64_t x_stride, const int8_t* codes,
                      int64_t in_features, float out[kInputRows][kWeightRows]) {
  __m512 acc[MT][kWeightRows];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < kWeightRows; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in_features; k += 32) {
    __m512i xs[MT];
    for (int m = 0; m < MT; ++m) xs[m] = _mm512_loadu_si512(x + m * x_stride + k);
    for (int n = 0; n < kWeightRows; ++n) {
      const int8_t* row = codes + n * in_features + k;
      const __m512 low = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
      const __m512 high = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
      const __m512bh w = _mm512_cvtne2ps_pbh(high, low);
      for (int m = 0; m < MT; ++m) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)xs[m], w);
    }
  }
  for (int m = 0; m < MT; ++m) store_sums(acc[m], out[m]);
}

// A mask of the first `remaining` of 32 lanes (none, or all).
inline __mmask32 first_lanes(int64_t remaining) {
  return remaining >= 32 ? ~__mmask32{0}
                         : remaining <= 0 ? 0 : static_cast<__mmask32>((1u << remaining) - 1);
}

// sums[m][n] = dot(x row m, W row n) for MT rows of x and kWeightRows int4 rows of W, decoded in
// registers. A row is padded / 2 bytes in groups of group_size / 2 (byte i holds value i in its
// low nibble, i + group_size / 2 in its high one), with a scale and min a group; x's in_features
// may stop short of padded. A group's 16 possible values, code * scale + min rounded to bfloat16,
// make a table that VPERMW looks 32 codes up in at once.
template <int MT>
inline void int4_tile(const uint16_t* x, int64_t x_stride, int64_t in_features,
                      const uint8_t* codes, const float* scales, const float* mins,
                      int64_t padded, int64_t group_size, float out[kInputRows][kWeightRows]) {
  const int64_t half = group_size / 2, groups = padded / group_size, row_bytes = padded / 2;
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  __m512 acc[MT][kWeightRows];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < kWeightRows; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i table[kWeightRows];
    for (int n = 0; n < kWeightRows; ++n)
      table[n] = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(
          _mm512_mul_ps(levels, _mm512_set1_ps(scales[n * groups + g])),
          _mm512_set1_ps(mins[n * groups + g]))));
    if (half % 32 == 0) {  // 32 bytes: values i..i+31 (low nibbles), half+i..half+i+31 (high)
      for (int64_t i = 0; i < half; i += 32) {
        const int64_t k = g * group_size + i;
        const __mmask32 low_mask = first_lanes(in_features - k);
        const __mmask32 high_mask = first_lanes(in_features - k - half);
        __m512i x_low[MT], x_high[MT];
        for (int m = 0; m < MT; ++m) {
          x_low[m] = _mm512_maskz_loadu_epi16(low_mask, x + m * x_stride + k);
          x_high[m] = _mm512_maskz_loadu_epi16(high_mask, x + m * x_stride + k + half);
        }
        for (int n = 0; n < kWeightRows; ++n) {
          const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(codes + n * row_bytes + g * half + i)));
          const __m512i w_low = _mm512_permutexvar_epi16(_mm512_and_si512(bytes, nibble), table[n]);
          const __m512i w_high = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table[n]);
          for (int m = 0; m < MT; ++m) {
            acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)x_low[m], (__m512bh)w_low);
            acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)x_high[m], (__m512bh)w_high);
          }
        }
      }
    } else {  // groups of 32, 16 bytes: values 0..15 (low nibbles) then 16..31 (high)
      const int64_t k = g * group_size;
      const __mmask32 mask = first_lanes(in_features - k);
      __m512i xs[MT];
      for (int m = 0; m < MT; ++m) xs[m] = _mm512_maskz_loadu_epi16(mask, x + m * x_stride + k);
      for (int n = 0; n < kWeightRows; ++n) {
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(codes + n * row_bytes + g * half)));
        const __m512i indices = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(0x0F))),
            _mm256_srli_epi16(bytes, 4), 1);
        const __m512i w = _mm512_permutexvar_epi16(indices, table[n]);
        for (int m = 0; m < MT; ++m)
          acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)xs[m], (__m512bh)w);
      }
    }
  }
  for (int m = 0; m < MT; ++m) store_sums(acc[m], out[m]);
}
#endif

}  // namespace

// x [M, K] bfloat16 with contiguous rows; codes int8 [N, K] contiguous, N a multiple of 4 and K of
// 32; scales float32 [N], one per row; bias [N] bfloat16 or None. Returns [M, N] bfloat16.
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias) {
#if defined(__AVX512BF16__)
  const int64_t in_features = x.size(1), out_features = codes.size(0);
  check_few_rows_input(x, bias, out_features, "linear_int8");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == torch::kChar &&
                  codes.size(1) == in_features && out_features % kWeightRows == 0 &&
                  in_features % 32 == 0,
              "linear_int8: codes [N, K] int8 contiguous, N a multiple of 4, K of 32");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat &&
                  scales.numel() == out_features, "linear_int8: scales [N] float32");
  const int8_t* cs = codes.data_ptr<int8_t>();
  const float* ss = scales.data_ptr<float>();
  const Bias b(bias);
  return few_rows_product(
      x, out_features, [&](int64_t n0) { return cs + n0 * in_features; },
      [&](auto mt, const int8_t* rows, const uint16_t* xm, int64_t x_stride,
          float sums[kInputRows][kWeightRows]) {
        int8_tile<decltype(mt)::value>(xm, x_stride, rows, in_features, sums);
      },
      [&](int64_t n, float sum) { return sum * ss[n] + b[n]; });
#else
  TORCH_CHECK(false, "linear_int8: built without AVX-512 BF16");
  return x;
#endif
}

// x [M, K] bfloat16 with contiguous rows; codes uint8 [N, P / 2] contiguous, P the row's length
// padded to whole groups (group_size a multiple of 32), N a multiple of 4; scales and mins float32
// [N, P / group_size]; bias [N] bfloat16 or None. Returns [M, N] bfloat16.
torch::Tensor linear_int4(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                          torch::Tensor mins, int64_t group_size,
                          c10::optional<torch::Tensor> bias) {
#if defined(__AVX512BF16__)
  const int64_t in_features = x.size(1), out_features = codes.size(0);
  const int64_t padded = codes.size(1) * 2;
  check_few_rows_input(x, bias, out_features, "linear_int4");
  TORCH_CHECK(group_size % 32 == 0 && padded % group_size == 0 && in_features <= padded &&
                  padded - in_features < group_size,
              "linear_int4: P is x's K padded to whole groups, of a multiple of 32");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == torch::kByte &&
                  out_features % kWeightRows == 0,
              "linear_int4: codes [N, P / 2] uint8 contiguous, N a multiple of 4");
  const int64_t groups = padded / group_size;
  for (const auto& t : {scales, mins})
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat &&
                    t.numel() == out_features * groups,
                "linear_int4: scales and mins [N, K / group_size] float32");
  const uint8_t* cs = codes.data_ptr<uint8_t>();
  const float* ss = scales.data_ptr<float>();
  const float* ms = mins.data_ptr<float>();
  const Bias b(bias);
  return few_rows_product(
      x, out_features, [](int64_t n0) { return n0; },
      [&](auto mt, int64_t n0, const uint16_t* xm, int64_t x_stride,
          float sums[kInputRows][kWeightRows]) {
        int4_tile<decltype(mt)::value>(xm, x_stride, in_features, cs + n0 * padded / 2,
                                       ss + n0 * groups, ms + n0 * groups, padded, group_size,
                                       sums);
      },
      [&](int64_t n, float sum) { return sum + b[n]; });
#else
  TORCH_CHECK(false, "linear_int4: built without AVX-512 BF16");
  return x;
#endif
}
