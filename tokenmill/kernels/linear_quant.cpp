// y = x W^T for a few bfloat16 rows of x and an int8 or int4 W (tokenmill/quant), on CPUs with
// AVX-512 BF16.
//
// Decode streams every weight once a step and is bound by memory, so fewer bytes a weight is
// the whole gain, as long as widening the codes costs less than the bytes saved. Up to four rows
// of x, the codes of four rows of W are widened to bfloat16 in registers, never stored, and
// multiplied with VDPBF16PS as in linear_bf16.cpp; with more rows of x, each block of four rows
// of W is widened once into a buffer that stays in L1 and linear_bf16.cpp's tile multiplies it
// by every four rows of x. int8 codes are exact in bfloat16 and the row's scale multiplies the sum;
// int4 values are de-quantized as tokenmill/quant/int4.py does it (code * scale, then + min, in
// float32) and rounded to bfloat16, the weights the de-quantize path feeds its GEMM.

#include <algorithm>
#include <cstring>

namespace {

#if defined(__AVX512BF16__)
// 32 int8 codes as bfloat16 (exact: |code| <= 127 needs 7 bits).
inline __m512bh widen_int8(const int8_t* codes) {
  const __m512 low = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  const __m512 high = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))));
  return _mm512_cvtne2ps_pbh(high, low);
}

// sums[m][n] = dot(x row m, codes row n) for MT rows of x and kWeightRows int8 rows (K a multiple
// of 32), the codes widened in registers.
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
      const __m512bh w = widen_int8(codes + n * in_features + k);
      for (int m = 0; m < MT; ++m) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)xs[m], w);
    }
  }
  for (int m = 0; m < MT; ++m) store_sums(acc[m], out[m]);
}

// kWeightRows int8 rows -> bfloat16 [kWeightRows, K] in `out`.
inline void widen_int8_rows(const int8_t* codes, int64_t in_features, uint16_t* out) {
  for (int64_t i = 0; i < kWeightRows * in_features; i += 32)
    _mm512_storeu_si512(out + i, (__m512i)widen_int8(codes + i));
}

// A mask of the first `remaining` of 32 lanes (none, or all).
inline __mmask32 first_lanes(int64_t remaining) {
  return remaining >= 32 ? ~__mmask32{0}
                         : remaining <= 0 ? 0 : static_cast<__mmask32>((1u << remaining) - 1);
}

// int4 rows are padded / 2 bytes in groups of group_size / 2: byte i of a group holds value i in
// its low nibble, i + group_size / 2 in its high one; each group has a float32 scale and min. A
// group's 16 possible values, code * scale + min rounded to bfloat16, make a table that VPERMW
// looks 32 codes up in at once.
inline __m512i int4_table(float scale, float min) {
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(
      _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(scale)), _mm512_set1_ps(min))));
}

// 32 bytes of a group of 64 or more: values i..i+31 (low nibbles) and half+i.. (high), as bfloat16.
inline void lookup_int4_32(const uint8_t* bytes, __m512i table, __m512i& low, __m512i& high) {
  const __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
  low = _mm512_permutexvar_epi16(_mm512_and_si512(wide, _mm512_set1_epi16(0x0F)), table);
  high = _mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), table);
}

// A group of 32 (16 bytes): values 0..15 (low nibbles) then 16..31 (high), as bfloat16.
inline __m512i lookup_int4_16(const uint8_t* bytes, __m512i table) {
  const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512i indices = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_and_si256(wide, _mm256_set1_epi16(0x0F))),
      _mm256_srli_epi16(wide, 4), 1);
  return _mm512_permutexvar_epi16(indices, table);
}

// sums[m][n] = dot(x row m, W row n) for MT rows of x and kWeightRows int4 rows of W, decoded in
// registers; x's in_features may stop short of the rows' padded length.
template <int MT>
inline void int4_tile(const uint16_t* x, int64_t x_stride, int64_t in_features,
                      const uint8_t* codes, const float* scales, const float* mins,
                      int64_t padded, int64_t group_size, float out[kInputRows][kWeightRows]) {
  const int64_t half = group_size / 2, groups = padded / group_size, row_bytes = padded / 2;
  __m512 acc[MT][kWeightRows];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < kWeightRows; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i table[kWeightRows];
    for (int n = 0; n < kWeightRows; ++n)
      table[n] = int4_table(scales[n * groups + g], mins[n * groups + g]);
    const uint8_t* group_codes = codes + g * half;
    if (half % 32 == 0) {
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
          __m512i w_low, w_high;
          lookup_int4_32(group_codes + n * row_bytes + i, table[n], w_low, w_high);
          for (int m = 0; m < MT; ++m) {
            acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)x_low[m], (__m512bh)w_low);
            acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)x_high[m], (__m512bh)w_high);
          }
        }
      }
    } else {
      const int64_t k = g * group_size;
      const __mmask32 mask = first_lanes(in_features - k);
      __m512i xs[MT];
      for (int m = 0; m < MT; ++m) xs[m] = _mm512_maskz_loadu_epi16(mask, x + m * x_stride + k);
      for (int n = 0; n < kWeightRows; ++n) {
        const __m512i w = lookup_int4_16(group_codes + n * row_bytes, table[n]);
        for (int m = 0; m < MT; ++m)
          acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)xs[m], (__m512bh)w);
      }
    }
  }
  for (int m = 0; m < MT; ++m) store_sums(acc[m], out[m]);
}

// kWeightRows int4 rows -> bfloat16 [kWeightRows, padded] in `out`, each group of 64 or more in
// int4_tile's order: 32 values of the low nibbles, the 32 of their high nibbles, the next 32 low...
// (so that a row sums in the same order on both paths: see fused_order).
inline void widen_int4_rows(const uint8_t* codes, const float* scales, const float* mins,
                            int64_t padded, int64_t group_size, uint16_t* out) {
  const int64_t half = group_size / 2, groups = padded / group_size;
  for (int64_t r = 0; r < kWeightRows * groups; ++r) {  // r: a group of some row
    const __m512i table = int4_table(scales[r], mins[r]);
    const uint8_t* group_codes = codes + r * half;
    uint16_t* group_out = out + r * group_size;
    if (half % 32 == 0) {
      for (int64_t i = 0; i < half; i += 32) {
        __m512i low, high;
        lookup_int4_32(group_codes + i, table, low, high);
        _mm512_storeu_si512(group_out + 2 * i, low);
        _mm512_storeu_si512(group_out + 2 * i + 32, high);
      }
    } else {
      _mm512_storeu_si512(group_out, lookup_int4_16(group_codes, table));
    }
  }
}

// x [M, K] in widen_int4_rows' order, zero-padded to `padded`: bfloat16 [M, padded].
torch::Tensor fused_order(const torch::Tensor& x, int64_t padded, int64_t group_size) {
  const int64_t rows = x.size(0), in_features = x.size(1), half = group_size / 2;
  auto out = torch::zeros({rows, padded}, x.options());
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t start = 0; start < padded; start += 32) {  // a group's i-th 32 (low or high)
      const int64_t g = start / group_size, within = start % group_size;
      const int64_t to = g * group_size + (within < half ? 2 * within : 2 * (within - half) + 32);
      const int64_t count = std::max<int64_t>(0, std::min<int64_t>(32, in_features - start));
      std::memcpy(os + m * padded + to, xs + m * x.stride(0) + start, count * sizeof(uint16_t));
    }
  return out;
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
  const auto finish = [&](int64_t n, float sum) { return sum * ss[n] + b[n]; };
  const auto prefetch = [&](int64_t n0) {
    prefetch_bytes(cs + n0 * in_features, kWeightRows * in_features);
  };
  if (x.size(0) > kInputRows) {
    return few_rows_product(
        x, out_features, kWeightRows * in_features,
        [&](int64_t n0, uint16_t* scratch) {
          widen_int8_rows(cs + n0 * in_features, in_features, scratch);
          return static_cast<const uint16_t*>(scratch);
        },
        BFloat16Rows{in_features, in_features}, finish, prefetch);
  }
  return few_rows_product(
      x, out_features, 0, [&](int64_t n0, uint16_t*) { return cs + n0 * in_features; },
      [&](auto mt, const int8_t* rows, const uint16_t* xm, int64_t x_stride,
          float sums[kInputRows][kWeightRows]) {
        int8_tile<decltype(mt)::value>(xm, x_stride, rows, in_features, sums);
      },
      finish, prefetch);
#else
  TORCH_CHECK(false, "linear_int8: built without AVX-512 BF16");
  return x;
#endif
}

// x [M, K] bfloat16 with contiguous rows; codes uint8 [N, P / 2] contiguous, P the row's length
// padded to whole groups (group_size a multiple of 32), N a multiple of 4; scales and mins float32
// [N, P / group_size]; bias [N] bfloat16 or None; rotation_signs, when given, rotate x first
// (hadamard.cpp): the layer's codes are of W R. Returns [M, N] bfloat16.
torch::Tensor linear_int4(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                          torch::Tensor mins, int64_t group_size,
                          c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> rotation_signs) {
#if defined(__AVX512BF16__)
  if (rotation_signs) x = hadamard_rotate(x, *rotation_signs);
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
                "linear_int4: scales and mins [N, P / group_size] float32");
  const uint8_t* cs = codes.data_ptr<uint8_t>();
  const float* ss = scales.data_ptr<float>();
  const float* ms = mins.data_ptr<float>();
  const Bias b(bias);
  const auto finish = [&](int64_t n, float sum) { return sum + b[n]; };
  const auto prefetch = [&](int64_t n0) {
    prefetch_bytes(cs + n0 * padded / 2, kWeightRows * padded / 2);
    prefetch_bytes(ss + n0 * groups, kWeightRows * groups * sizeof(float));
    prefetch_bytes(ms + n0 * groups, kWeightRows * groups * sizeof(float));
  };
  if (x.size(0) > kInputRows) {
    const torch::Tensor xo = group_size % 64 == 0 ? fused_order(x, padded, group_size) : x;
    return few_rows_product(
        xo, out_features, kWeightRows * padded,
        [&](int64_t n0, uint16_t* scratch) {
          widen_int4_rows(cs + n0 * padded / 2, ss + n0 * groups, ms + n0 * groups, padded,
                          group_size, scratch);
          return static_cast<const uint16_t*>(scratch);
        },
        BFloat16Rows{padded, xo.size(1)}, finish, prefetch);
  }
  return few_rows_product(
      x, out_features, 0, [](int64_t n0, uint16_t*) { return n0; },
      [&](auto mt, int64_t n0, const uint16_t* xm, int64_t x_stride,
          float sums[kInputRows][kWeightRows]) {
        int4_tile<decltype(mt)::value>(xm, x_stride, in_features, cs + n0 * padded / 2,
                                       ss + n0 * groups, ms + n0 * groups, padded, group_size,
                                       sums);
      },
      finish, prefetch);
#else
  TORCH_CHECK(false, "linear_int4: built without AVX-512 BF16");
  return x;
#endif
}

// Writes W into `out` [R, P] (float32, bfloat16 or float16, contiguous) from int4 codes [R, P / 2]
// (the layout above), scales and mins float32 [R, P / group_size]: code * scale, then + min, each
// rounded to float32 as Int4Linear.dequantize_padded's PyTorch path does, then once to out's
// dtype. One pass, for the de-quantize + GEMM path, where the PyTorch ops took five.
void dequantize_int4(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                     int64_t group_size, torch::Tensor out) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == torch::kByte &&
                  group_size % 2 == 0 && (codes.size(1) * 2) % group_size == 0,
              "dequantize_int4: codes [R, P / 2] uint8 contiguous, P whole groups");
  const int64_t rows = codes.size(0), padded = codes.size(1) * 2, groups = padded / group_size;
  for (const auto& t : {scales, mins})
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat &&
                    t.numel() == rows * groups,
                "dequantize_int4: scales and mins [R, P / group_size] float32");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == rows &&
                  out.size(1) == padded, "dequantize_int4: out [R, P] contiguous");
  const uint8_t* cs = codes.data_ptr<uint8_t>();
  const float* ss = scales.data_ptr<float>();
  const float* ms = mins.data_ptr<float>();
  const int64_t half = group_size / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_int4", [&] {
    scalar_t* os = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows * groups, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {  // r: one group of one row
        const uint8_t* bytes = cs + r * half;
        scalar_t* values = os + r * group_size;
        const float scale = ss[r], min = ms[r];
        for (int64_t i = 0; i < half; ++i) {
          const float low = static_cast<float>(bytes[i] & 0x0F) * scale;
          const float high = static_cast<float>(bytes[i] >> 4) * scale;
          values[i] = static_cast<scalar_t>(low + min);
          values[i + half] = static_cast<scalar_t>(high + min);
        }
      }
    });
  });
}

// Writes W into `out` [R, K] (float32, bfloat16 or float16, contiguous) from int8 codes [R, K]
// and float32 scales [R, K / group_size]: code * scale rounded to float32, as
// Int8Linear.dequantize_padded's PyTorch path does, then once to out's dtype.
void dequantize_int8(torch::Tensor codes, torch::Tensor scales, int64_t group_size,
                     torch::Tensor out) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == torch::kChar &&
                  codes.size(1) % group_size == 0,
              "dequantize_int8: codes [R, K] int8 contiguous, K whole groups");
  const int64_t rows = codes.size(0), in_features = codes.size(1);
  const int64_t groups = in_features / group_size;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat &&
                  scales.numel() == rows * groups,
              "dequantize_int8: scales [R, K / group_size] float32");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == rows &&
                  out.size(1) == in_features, "dequantize_int8: out [R, K] contiguous");
  const int8_t* cs = codes.data_ptr<int8_t>();
  const float* ss = scales.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_int8", [&] {
    scalar_t* os = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows * groups, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {  // r: one group of one row
        const int8_t* group_codes = cs + r * group_size;
        scalar_t* values = os + r * group_size;
        const float scale = ss[r];
        for (int64_t i = 0; i < group_size; ++i)
          values[i] = static_cast<scalar_t>(static_cast<float>(group_codes[i]) * scale);
      }
    });
  });
}
