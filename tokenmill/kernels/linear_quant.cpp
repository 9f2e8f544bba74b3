// y = x W^T for a few bfloat16 rows of x and an int8 or int4 W (tokenmill/quant), on CPUs with
// AVX-512 BF16 (and so AVX-512 VNNI: every CPU with the one has the other).
//
// Decode streams every weight once a step and is bound by memory, so fewer bytes a weight is
// the whole gain, as long as unpacking the codes costs less than the bytes saved. int8: up to
// four rows of x, x is quantized to int16 codes and multiplied with the weight codes by VPDPWSSD
// in registers (below); with more rows of x, each block of four rows of W is widened to bfloat16
// once into a buffer that stays in L1 and linear_bf16.cpp's tile multiplies it by every four rows
// of x (the codes are exact in bfloat16 and the row's scale multiplies the sum), or, with AMX,
// linear_amx.cpp's tiles. int4: widening its codes bounded the product on two cores, so at a few
// rows x is quantized to int8 codes instead and multiplied with VPDPBUSD (below).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// The width of group g of a row `padded` long in `groups` groups of group_size: whole groups,
// then a last one as narrow as the rest's power of two from 32 (quant/int4.py's group_widths).
// Group g's codes start at byte g * group_size / 2 of the row.
inline int64_t group_width(int64_t g, int64_t groups, int64_t padded, int64_t group_size) {
  return g + 1 < groups ? group_size : padded - (groups - 1) * group_size;
}

#if defined(__AVX512BW__)
// Values first..first + 63 of an int4 group `half` bytes of codes wide (the layout above), one
// byte each: the low nibbles of 64 bytes, or their high ones; a group of 64 or 32 (first 0) as
// its low nibbles, then its high ones, then zeros.
inline __m512i int4_codes_64(const uint8_t* bytes, int64_t half, int64_t first) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  if (half >= 64) {
    const __m512i raw = _mm512_loadu_si512(bytes + (first < half ? first : first - half));
    return _mm512_and_si512(first < half ? raw : _mm512_srli_epi16(raw, 4), nibble);
  }
  const __m512i raw =
      half == 32 ? _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)))
                 : _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512i high = _mm512_srli_epi16(raw, 4);
  return _mm512_and_si512(half == 32 ? _mm512_inserti64x4(raw, _mm512_castsi512_si256(high), 1)
                                     : _mm512_inserti32x4(raw, _mm512_castsi512_si128(high), 1),
                          nibble);
}
#endif

#if defined(__AVX512BF16__)
// 32 int8 codes as bfloat16 (exact: |code| <= 127 needs 7 bits).
inline __m512bh widen_int8(const int8_t* codes) {
  const __m512 low = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  const __m512 high = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))));
  return _mm512_cvtne2ps_pbh(high, low);
}

// Up to kInputRows rows, x meets the int8 codes as int16 codes: VPDPWSSD multiplies 32 codes of
// W, sign-extended to 16 bits by one instruction, by 32 of x into 16 int32 lanes, where widening
// them to bfloat16 for VDPBF16PS took five, and bounded the one-row product on the AMX machine (in
// cache, one thread, SmolLM2's down_proj: 56 us, int4's 22). Each row of x gets one scale,
// max |x| / q, with q (at most 32767) as large as keeps every int32 sum exact
// (K * 127 * q < 2^31): a row's product is exact but for x's rounding to q levels, at most
// max |x| / 2q a value (2^-16 to 2^-13 of the largest for K up to 4864), far below the output's
// bfloat16 rounding. Each row is quantized on its own: its result doesn't depend on the others.
struct Int16Activations {
  int16_t* codes;  // [M, K]
  float* scales;   // [M]

  explicit Int16Activations(const torch::Tensor& x)
      : codes(reused_buffer<int16_t, 0>(x.size(0) * x.size(1))),
        scales(reused_buffer<float, 0>(x.size(0))) {
    const int64_t in_features = x.size(1);
    const float levels = std::min(32767.0, std::floor(2147483647.0 / (127.0 * in_features)));
    const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const auto load = [](const uint16_t* at) {  // 16 bfloat16 as float32
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))), 16));
    };
    for (int64_t m = 0; m < x.size(0); ++m) {
      const uint16_t* row = xs + m * x.stride(0);
      __m512 largest = _mm512_setzero_ps();
      for (int64_t k = 0; k < in_features; k += 16)
        largest = _mm512_max_ps(largest, _mm512_abs_ps(load(row + k)));
      const float biggest = _mm512_reduce_max_ps(largest);
      const __m512 inverse = _mm512_set1_ps(biggest > 0.f ? levels / biggest : 0.f);
      for (int64_t k = 0; k < in_features; k += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + m * in_features + k),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(
                                _mm512_mul_ps(load(row + k), inverse))));
      scales[m] = biggest / levels;
    }
  }
};

// sums[m][n] = dot(x row m, codes row n) for MT rows of x's int16 codes (from row m0) and
// kWeightRows int8 rows (K a multiple of 32), scaled back by x's row scales. With `ahead` (the
// next rows' codes), each line read asks for the same line of those (kernels/prefetch.cpp). The
// int32 sums are exact in any order, so each row of W is read through before the next, two
// accumulators a row of x: one stream of the block's bytes in address order, which the hardware
// prefetcher follows, where four rows side by side are four streams of 576 bytes (SmolLM2) that
// it barely starts on.
template <int MT>
inline void int8_tile(const Int16Activations& a, int64_t m0, const int8_t* codes,
                      int64_t in_features, float out[kInputRows][kWeightRows],
                      const int8_t* ahead) {
  const int16_t* xq = a.codes + m0 * in_features;
  for (int n = 0; n < kWeightRows; ++n) {
    const int8_t* row = codes + n * in_features;
    __m512i even[MT], odd[MT];
    for (int m = 0; m < MT; ++m) even[m] = odd[m] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 64 <= in_features; k += 64) {
      if (ahead != nullptr) _mm_prefetch(ahead + n * in_features + k, _MM_HINT_T1);
      const __m512i w0 = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k)));
      const __m512i w1 = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k + 32)));
      for (int m = 0; m < MT; ++m) {
        even[m] = _mm512_dpwssd_epi32(even[m], _mm512_loadu_si512(xq + m * in_features + k), w0);
        odd[m] = _mm512_dpwssd_epi32(odd[m], _mm512_loadu_si512(xq + m * in_features + k + 32),
                                     w1);
      }
    }
    if (k < in_features) {  // a last 32
      if (ahead != nullptr) _mm_prefetch(ahead + n * in_features + k, _MM_HINT_T1);
      const __m512i w = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k)));
      for (int m = 0; m < MT; ++m)
        even[m] = _mm512_dpwssd_epi32(even[m], _mm512_loadu_si512(xq + m * in_features + k), w);
    }
    for (int m = 0; m < MT; ++m)
      out[m][n] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(even[m], odd[m]))) *
                  a.scales[m0 + m];
  }
}

// Columns [k0, k1) (multiples of 32) of `rows` int8 rows, K long, -> bfloat16 in `out` (column k0
// first, rows `stride` apart).
inline void widen_int8_columns(const int8_t* codes, int64_t in_features, int64_t rows,
                               int64_t k0, int64_t k1, uint16_t* out, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = k0; k < k1; k += 32)
      _mm512_storeu_si512(out + r * stride + k - k0,
                          (__m512i)widen_int8(codes + r * in_features + k));
}

// 32 int8 codes times their group's scale as bfloat16: code * scale rounded to float32, then to
// bfloat16, the values dequantize_int8 gives.
inline __m512bh widen_scaled_int8(const int8_t* at, float group_scale) {
  const __m512 scale = _mm512_set1_ps(group_scale);
  const auto half = [&](int64_t offset) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + offset)))),
                         scale);
  };
  return _mm512_cvtne2ps_pbh(half(16), half(0));
}

// Columns [k0, k1) of `rows` int8 rows with a float32 scale a group (group_size a multiple of 32)
// -> bfloat16 (widen_scaled_int8) as widen_int8_columns lays them out. The group walks along
// with k: finding it by k / group_size had cost a 64-bit division every 32 values (a gguf pass
// over SmolLM2, whose Q8_0 lm_head this widens, took 0.94-0.95x the time without it).
inline void widen_scaled_int8_columns(const int8_t* codes, const float* scales,
                                      int64_t in_features, int64_t group_size, int64_t rows,
                                      int64_t k0, int64_t k1, uint16_t* out, int64_t stride) {
  const int64_t groups = in_features / group_size, first_group = k0 / group_size;
  for (int64_t r = 0; r < rows; ++r) {
    const float* group_scale = scales + r * groups + first_group;
    int64_t group_end = (first_group + 1) * group_size;
    for (int64_t k = k0; k < k1; k += 32) {
      if (k == group_end) {
        ++group_scale;
        group_end += group_size;
      }
      _mm512_storeu_si512(out + r * stride + k - k0,
                          (__m512i)widen_scaled_int8(codes + r * in_features + k, *group_scale));
    }
  }
}

// linear_bf16.cpp's tile on the values widen_scaled_int8_columns gives, widened in registers
// instead of into a buffer the tile reads back: the same VDPBF16PS on the same values in the
// same order, so the same sums, bit for bit (gguf's Q8_0 layers).
template <int MT>
inline void scaled_int8_tile(const uint16_t* x, int64_t x_stride, const int8_t* codes,
                             const float* scales, int64_t in_features, int64_t group_size,
                             float out[kInputRows][kWeightRows]) {
  const int64_t groups = in_features / group_size;
  __m512 acc[MT][kWeightRows];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < kWeightRows; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t k = 0, g = 0, group_end = group_size; k < in_features; k += 32) {
    if (k == group_end) {
      ++g;
      group_end += group_size;
    }
    __m512bh inputs[MT];
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) inputs[m] = (__m512bh)_mm512_loadu_si512(x + m * x_stride + k);
#pragma GCC unroll 4
    for (int n = 0; n < kWeightRows; ++n) {
      const __m512bh w = widen_scaled_int8(codes + n * in_features + k, scales[n * groups + g]);
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], inputs[m], w);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) store_sums(acc[m], out[m]);
}

// int4 rows are padded / 2 bytes in groups (group_width): byte i of a group `width` wide holds
// value i in its low nibble, i + width / 2 in its high one; each group has a float32 scale and min.
//
// Above kInt8ActivationMaxRows rows of x, each block of four rows of W is widened once to
// bfloat16 into a buffer that stays in L1, and linear_bf16.cpp's tile multiplies it by every four
// rows of x: the widening is shared by many rows there, and the tile's VDPBF16PS does less a
// product than the int8-code path below (measured at 32 and 64 rows: 10 to 30% less time). Up to
// it, x is quantized to int8 codes.
constexpr int64_t kInt8ActivationMaxRows = 16;
// With AMX tiles (linear_amx.cpp), widening int4 codes for them is the tiles' main cost; the
// int8-code path still won up to 8 rows there (SmolLM2's gate_up: 124 against 133 us at 8 rows,
// AMX 122 against about 180 at 12; benchmarks/bench_quant_kernels.py). Groups of 128 or more
// skip the widening: AMX-INT8 tiles take them from kInt4TileMinRows rows (below).
constexpr int64_t kInt8ActivationMaxRowsWithAmx = 8;

// Widened, a group's 16 possible values, code * scale + min rounded to
// bfloat16, make a table that VPERMW looks 32 codes up in at once.
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

// Values k..k + 63 of an int4 row of groups of 32 (GGUF's Q4_0 and Q4_1; k a multiple of 64) as
// bfloat16, in order: values k..k + 31 in `first`, the next 32 in `second`. Two groups a lookup,
// their tables in one register, the second's levels at 16..31; each level is code * scale, then
// + min, each rounded to float32, then to bfloat16: the values dequantize_int4 gives.
inline void widen_int4_64(const uint8_t* bytes, const float* scales, const float* mins, int64_t k,
                          __m512i& first, __m512i& second) {
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i upper = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  const int64_t g = k / 32;
  const auto level_values = [&](int64_t group) {
    return _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(scales[group])),
                         _mm512_set1_ps(mins[group]));
  };
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(level_values(g + 1), level_values(g));
  const __m512i wide = _mm512_cvtepu8_epi16(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + k / 2)));
  const __m512i low = _mm512_permutexvar_epi16(
      _mm512_or_si512(_mm512_and_si512(wide, nibble), upper), table);
  const __m512i high = _mm512_permutexvar_epi16(
      _mm512_or_si512(_mm512_srli_epi16(wide, 4), upper), table);
  first = _mm512_inserti64x4(low, _mm512_castsi512_si256(high), 1);
  second = _mm512_shuffle_i64x2(low, high, _MM_SHUFFLE(3, 2, 3, 2));
}

// widen_int4_columns for `rows` rows of groups of 32, k0 and k1 multiples of 64. A group's own
// loop (the table, the widening, the lookup, its bounds) had been a third of gguf's 32-row
// product (perf, AMX VM).
inline void widen_int4_pairs(const uint8_t* codes, const float* scales, const float* mins,
                             int64_t padded, int64_t k0, int64_t k1, uint16_t* out,
                             int64_t stride, int64_t rows = kWeightRows) {
  const int64_t groups = padded / 32;
  for (int64_t row = 0; row < rows; ++row) {
    uint16_t* row_out = out + row * stride - k0;
    for (int64_t k = k0; k < k1; k += 64) {
      __m512i first, second;
      widen_int4_64(codes + row * padded / 2, scales + row * groups, mins + row * groups, k,
                    first, second);
      _mm512_storeu_si512(row_out + k, first);
      _mm512_storeu_si512(row_out + k + 32, second);
    }
  }
}

// linear_bf16.cpp's tile on the values widen_int4_pairs gives, widened in registers instead of
// into a buffer that the tile reads back: the same VDPBF16PS on the same values in the same order,
// so the same sums, bit for bit. K (padded) a multiple of 64. With scaled_int8_tile for gguf's
// Q8_0 lm_head, SmolLM2's 30 layers and lm_head from memory took 0.87x the time at one row and
// 0.90x at two (benchmarks/bench_kernels_ab.py --formats gguf, AMX VM).
template <int MT>
inline void int4_exact_tile(const uint16_t* x, int64_t x_stride, const uint8_t* codes,
                            const float* scales, const float* mins, int64_t padded,
                            float out[kInputRows][kWeightRows]) {
  const int64_t groups = padded / 32;
  __m512 acc[MT][kWeightRows];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < kWeightRows; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < padded; k += 64) {
    __m512bh inputs[MT][2];
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h)
        inputs[m][h] = (__m512bh)_mm512_loadu_si512(x + m * x_stride + k + 32 * h);
#pragma GCC unroll 4
    for (int n = 0; n < kWeightRows; ++n) {
      __m512i first, second;
      widen_int4_64(codes + n * padded / 2, scales + n * groups, mins + n * groups, k, first,
                    second);
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        acc[m][n] = _mm512_dpbf16_ps(acc[m][n], inputs[m][0], (__m512bh)first);
        acc[m][n] = _mm512_dpbf16_ps(acc[m][n], inputs[m][1], (__m512bh)second);
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) store_sums(acc[m], out[m]);
}

// Columns [k0, k1) of kWeightRows int4 rows -> bfloat16 in `out` (column k0 first, rows `stride`
// apart), each group of 64 or more in the codes' order: 32 values of the low nibbles, the 32 of
// their high nibbles, the next 32 low... (fused_order puts x in the same order). k0 and k1 start
// or end whole groups or runs of 64 within one.
inline void widen_int4_columns(const uint8_t* codes, const float* scales, const float* mins,
                               int64_t padded, int64_t group_size, int64_t groups, int64_t k0,
                               int64_t k1, uint16_t* out, int64_t stride) {
  if (group_size == 32 && padded % 64 == 0 && k1 <= padded) {
    widen_int4_pairs(codes, scales, mins, padded, k0, k1, out, stride);
    return;
  }
  for (int64_t row = 0; row < kWeightRows; ++row)
    for (int64_t g = k0 / group_size; g < groups && g * group_size < k1; ++g) {
      const int64_t r = row * groups + g, first = g * group_size;
      const int64_t half = group_width(g, groups, padded, group_size) / 2;
      const __m512i table = int4_table(scales[r], mins[r]);
      const uint8_t* group_codes = codes + row * padded / 2 + first / 2;
      uint16_t* group_out = out + row * stride + first - k0;
      if (half % 32 == 0) {
        for (int64_t i = std::max<int64_t>(0, (k0 - first) / 2); i < half && first + 2 * i < k1;
             i += 32) {
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

// kWeightRows int4 rows -> bfloat16 [kWeightRows, padded] in `out`, in widen_int4_columns' order.
inline void widen_int4_rows(const uint8_t* codes, const float* scales, const float* mins,
                            int64_t padded, int64_t group_size, int64_t groups, uint16_t* out) {
  widen_int4_columns(codes, scales, mins, padded, group_size, groups, 0, padded, out, padded);
}

// x [M, K] in widen_int4_rows' order, zero-padded to `padded`: bfloat16 [M, padded].
torch::Tensor fused_order(const torch::Tensor& x, int64_t padded, int64_t group_size,
                          int64_t groups) {
  const int64_t rows = x.size(0), in_features = x.size(1);
  auto out = torch::zeros({rows, padded}, x.options());
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t start = 0; start < padded; start += 32) {  // a group's i-th 32 (low or high)
      const int64_t g = start / group_size, within = start % group_size;
      const int64_t half = group_width(g, groups, padded, group_size) / 2;
      const int64_t to = g * group_size + (within < half ? 2 * within : 2 * (within - half) + 32);
      const int64_t count = std::max<int64_t>(0, std::min<int64_t>(32, in_features - start));
      std::memcpy(os + m * padded + to, xs + m * x.stride(0) + start, count * sizeof(uint16_t));
    }
  return out;
}

// Up to kInt8ActivationMaxRows rows, x meets the int4 codes as int8 codes (llama.cpp's Q4 x Q8
// product, and QuaRot's int4 x int8): per row, codes round(x / s) with s = max |x| / 127 over 32
// values (below). VPDPBUSD multiplies 64 unsigned codes of W by 64 signed codes of x into 16
// int32 lanes of four products each, half the instructions a value of widening W to bfloat16
// took. A group's sum is scale * sum(s * (code - 8) * xq) + (min + 8 * scale) * sum(x): centring
// the codes halves the weight on x's rounding errors, and the second term takes x's exact sum.
// Each row of x is quantized on its own, so a row's result doesn't depend on the rows beside it.

// Row m of bfloat16 x into values[0, K) as float32, rotated (hadamard.cpp) where signs are given:
// what the int8 codes of x are made from.
inline void float_row(const torch::Tensor& x, int64_t m, const float* rotation_signs,
                      float* values) {
  const int64_t in_features = x.size(1);
  const auto* row = x.data_ptr<c10::BFloat16>() + m * x.stride(0);
  for (int64_t k = 0; k < in_features; ++k) values[k] = static_cast<float>(row[k]);
  if (rotation_signs)
    for (int64_t k = 0; k < in_features; k += kHadamardBlock) rotate_block(values + k, rotation_signs);
}

// For each of a chunk's 16 VPDPBUSD lanes (4 bytes each), its group counted from the chunk's
// first: byte / half, for group_size / 2 = half, a power of two.
inline __m512i int4_lane_groups(int64_t half) {
  return _mm512_srli_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60),
      __builtin_ctzll(half));
}

// The first min(count, 16) of 16 lanes.
inline __mmask16 first_lanes(int64_t count) {
  return static_cast<__mmask16>(count >= 16 ? 0xFFFF : (1u << count) - 1);
}

// What a chunk (64 bytes of a weight row) needs to know of where it lies, the same for every
// row of W: the bytes of it the row has (the last may be short), its first group, and the lanes
// whose groups the row has. Worked out once a call: in the tile, a 64-bit division and the
// masks' arithmetic had been about a fifth of the one-row loop's instructions.
struct Int4Chunk {
  __mmask64 bytes;
  __mmask16 lanes;
  int64_t first_group;
};

// Into chunks [ceil(row_bytes / 64)].
void int4_chunks(int64_t row_bytes, int64_t half, int64_t groups, Int4Chunk* chunks) {
  for (int64_t first_byte = 0; first_byte < row_bytes; first_byte += 64) {
    const int64_t first_group = first_byte / half;
    chunks[first_byte / 64] = {row_bytes - first_byte >= 64
                                   ? ~__mmask64{0}
                                   : (__mmask64{1} << (row_bytes - first_byte)) - 1,
                               first_lanes(groups - first_group), first_group};
  }
}

// x [M, K] quantized for the int4 product, laid out 64 bytes of a weight row (a "chunk") at a
// time: for each chunk, the 64 codes its low nibbles meet, then the 64 its high nibbles meet;
// for each chunk's 16 lanes, x's scale and -8 times the sum of the lane's 8 codes. x's codes
// share a scale per 16 bytes of W (4 lanes: 16 values the low nibbles meet and 16 the high),
// finer than W's groups at no cost in the product.
// With rotation signs, x is rotated first (hadamard.cpp), in float32, never rounded. In the
// calling thread's reused buffers (kernels/scratch.cpp): the product reads them until it returns.
struct Int4Activations {
  int64_t chunks, groups;
  Int4Chunk* layout;  // [chunks]: where each chunk of W's rows lies
  int8_t* codes;      // [M, chunks, 2, 64]
  int32_t* offsets;   // [M, chunks, 16]
  float* scales;      // [M, chunks, 16]
  float* sums;        // [M, groups]: sum of x over the group, in float32

  Int4Activations(const torch::Tensor& x, int64_t padded, int64_t group_size, int64_t groups_,
                  const float* rotation_signs)
      : chunks((padded / 2 + 63) / 64), groups(groups_),
        layout(reused_buffer<Int4Chunk, 0>(chunks)),
        codes(reused_buffer<int8_t, 0>(x.size(0) * chunks * 128)),
        offsets(reused_buffer<int32_t, 0>(x.size(0) * chunks * 16)),
        scales(reused_buffer<float, 1>(x.size(0) * chunks * 16)),
        sums(reused_buffer<float, 2>(x.size(0) * groups)) {
    int4_chunks(padded / 2, group_size / 2, groups, layout);
    // A last chunk's bytes past the row are loaded too (the masks leave them out of the sums)
    std::fill_n(codes, x.size(0) * chunks * 128, int8_t{0});
    std::fill_n(scales, x.size(0) * chunks * 16, 0.f);
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      float* const values = reused_buffer<float, 3>(padded);
      std::fill(values + x.size(1), values + padded, 0.f);  // float_row writes the first K
      for (int64_t m = begin; m < end; ++m) {
        float_row(x, m, rotation_signs, values);
        int8_t* row_codes = codes + m * chunks * 128;
        for (int64_t g = 0; g < groups; ++g) {
          const float* group = values + g * group_size;
          const int64_t width = group_width(g, groups, padded, group_size), half = width / 2;
          __m512 sum = _mm512_setzero_ps();
          for (int64_t i = 0; i < width; i += 16)
            sum = _mm512_add_ps(sum, _mm512_loadu_ps(group + i));
          sums[m * groups + g] = _mm512_reduce_add_ps(sum);
          for (int64_t i = 0; i < half; i += 16) {  // bytes g * half + i.. of the weight row
            const __m512 low = _mm512_loadu_ps(group + i), high = _mm512_loadu_ps(group + half + i);
            const float piece_max = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
            const __m512 inverse = _mm512_set1_ps(piece_max > 0.f ? 127.f / piece_max : 0.f);
            const int64_t byte = g * group_size / 2 + i, chunk = byte / 64;
            int8_t* out = row_codes + chunk * 128 + byte % 64;
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(
                                 _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse))));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 64), _mm512_cvtsepi32_epi8(
                                 _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse))));
            std::fill_n(scales + (m * chunks + chunk) * 16 + byte % 64 / 4, 4,
                        piece_max / 127.f);
          }
        }
        const __m512i ones = _mm512_set1_epi8(1);
        for (int64_t c = 0; c < chunks; ++c) {
          const int8_t* chunk = row_codes + c * 128;
          const __m512i lane_sums = _mm512_dpbusd_epi32(
              _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(chunk)), ones,
              _mm512_loadu_si512(chunk + 64));
          _mm512_storeu_si512(offsets + (m * chunks + c) * 16,
                              _mm512_mullo_epi32(lane_sums, _mm512_set1_epi32(-8)));
        }
      }
    });
  }
};

// out[m][n] = dot(x row m0 + m, W row n) for MT rows of quantized x and NR int4 rows of W (codes
// row_bytes apart, scales and mins `groups` apart). x's codes, offsets and scales for a chunk are
// loaded once for the NR rows and each row's codes are unpacked once for the MT rows of x, so
// the loop is mostly the product's own instructions. Eight rows of W a tile instead of four, at
// one row of x: SmolLM2's products in cache in 0.77-0.93x the time (one thread), the 30 layers'
// from memory in 0.88x (benchmarks/bench_kernels_ab.py --formats int4). WholeGroups: each chunk
// lies in one group (groups of 128 or more), whose scale is broadcast. With `ahead` (the next
// rows' codes), each chunk read asks for the same chunk of those (kernels/prefetch.cpp).
template <int MT, int NR, bool WholeGroups>
inline void int4_tile(const Int4Activations& a, int64_t m0, const uint8_t* codes,
                      int64_t row_bytes, const float* scales, const float* mins, int64_t half,
                      float (*out)[NR], const uint8_t* ahead) {
  static_assert(NR % kWeightRows == 0, "store_sums sums four rows at a time");
  const int64_t groups = a.groups;
  const __m512i lane_group = int4_lane_groups(half);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[MT][NR];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t c = 0; c < a.chunks; ++c) {
    const Int4Chunk chunk = a.layout[c];
    const int64_t first_byte = 64 * c;
    if (ahead != nullptr) prefetch_rows(ahead, NR, row_bytes, first_byte);
    __m512i x_low[MT], x_high[MT], offsets[MT];
    __m512 x_scale[MT];
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) {
      const int64_t at = (m0 + m) * a.chunks + c;
      x_low[m] = _mm512_loadu_si512(a.codes + at * 128);
      x_high[m] = _mm512_loadu_si512(a.codes + at * 128 + 64);
      offsets[m] = _mm512_loadu_si512(a.offsets + at * 16);
      x_scale[m] = _mm512_loadu_ps(a.scales + at * 16);
    }
#pragma GCC unroll 8
    for (int n = 0; n < NR; ++n) {
      const __m512i raw = _mm512_maskz_loadu_epi8(chunk.bytes, codes + n * row_bytes + first_byte);
      const __m512i low = _mm512_and_si512(raw, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
      const float* row_scales = scales + n * groups + chunk.first_group;
      const __m512 w_scale = WholeGroups ? _mm512_set1_ps(*row_scales)
                                         : _mm512_permutexvar_ps(lane_group, _mm512_maskz_loadu_ps(
                                               chunk.lanes, row_scales));
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        const __m512i sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(offsets[m], low, x_low[m]),
                                                high, x_high[m]);
        acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(w_scale, x_scale[m]),
                                    acc[m][n]);
      }
    }
  }
  // + (min + 8 * scale) * sum(x) of every group, 16 groups at a time, into the lanes summed next.
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 lanes = first_lanes(groups - g);
#pragma GCC unroll 8
    for (int n = 0; n < NR; ++n) {
      const __m512 zero = _mm512_fmadd_ps(
          _mm512_set1_ps(8.f), _mm512_maskz_loadu_ps(lanes, scales + n * groups + g),
          _mm512_maskz_loadu_ps(lanes, mins + n * groups + g));
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m)
        acc[m][n] = _mm512_fmadd_ps(
            zero, _mm512_maskz_loadu_ps(lanes, a.sums + (m0 + m) * groups + g), acc[m][n]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NR; n += kWeightRows) store_sums(acc[m] + n, out[m] + n);
}

// One tile of NR rows of W (from n0) against every row of x, into ys: four rows of x at a time
// by four rows of W (16 accumulators), then two or one by all NR (x's registers are 4 a row).
template <int NR, bool WholeGroups, typename Finish>
inline void int4_rows(const Int4Activations& a, int64_t rows, const uint8_t* codes,
                      int64_t row_bytes, const float* scales, const float* mins, int64_t half,
                      const uint8_t* ahead, int64_t n0, int64_t out_features, c10::BFloat16* ys,
                      Finish finish) {
  float sums[kInputRows][NR];
  const int64_t groups = a.groups;
  for (int64_t m0 = 0; m0 < rows;) {
    const uint8_t* asks = m0 == 0 ? ahead : nullptr;
    const int64_t left = rows - m0;
    const int64_t mt = left >= 4 ? 4 : std::min<int64_t>(left, 2);
    if (mt == 4) {
      for (int64_t n = 0; n < NR; n += kWeightRows) {
        float quarter[kInputRows][kWeightRows];
        int4_tile<4, kWeightRows, WholeGroups>(
            a, m0, codes + n * row_bytes, row_bytes, scales + n * groups,
            mins + n * groups, half, quarter, asks ? asks + n * row_bytes : nullptr);
        for (int64_t m = 0; m < 4; ++m)
          std::copy(quarter[m], quarter[m] + kWeightRows, sums[m] + n);
      }
    } else if (mt == 2) {
      int4_tile<2, NR, WholeGroups>(a, m0, codes, row_bytes, scales, mins, half, sums, asks);
    } else {
      int4_tile<1, NR, WholeGroups>(a, m0, codes, row_bytes, scales, mins, half, sums, asks);
    }
    for (int64_t m = 0; m < mt; ++m)
      for (int64_t n = 0; n < NR; ++n)
        ys[(m0 + m) * out_features + n0 + n] =
            static_cast<c10::BFloat16>(finish(n0 + n, sums[m][n]));
    m0 += mt;
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
// From kInt4TileMinRows rows, int4 groups of 128 or more meet x's int8 codes on AMX-INT8 tiles
// (TDPBUSD: W's unsigned codes by x's signed ones, 16 x 16 x 64 products), where widening every
// code to bfloat16 for TDPBF16PS had been a third of the product's time at 32 rows. Unpacking a
// code is an AND (and a shift for the high nibbles), and a tile step covers 64 values of K
// instead of 32, so the tiles load half the bytes a product. The price: W's scale and min
// change every group, so each group's int32 sums leave the tiles and are scaled into float32
// sums. x is quantized per row and group, s = max |x| / 127; as in the few-row path the
// codes are centred, scale * s * (sum(code * xq) - 8 sum(xq)) + (min + 8 scale) * sum(x), with
// x's exact sum. A row's result doesn't depend on the rows beside it.
constexpr int64_t kCodeStep = 64;  // values of K a tile step: 16 rows of 4 bytes in x's tiles
// Groups of 64 or 32 would leave the tiles every step or two: those keep the widened path.
constexpr int64_t kInt4TileMinGroup = 128;
// Below 7 rows the VPDPBUSD tiles (int4_tile) took less time (SmolLM2's products from memory:
// 1.18x and 1.06x the time at 5 and 6 rows, 0.89x and 0.86x at 7 and 8;
// benchmarks/bench_kernels_ab.py --formats int4, AMX VM).
constexpr int64_t kInt4TileMinRows = 7;

// Where each group's values lie among the tile steps: groups of 128 or more fill whole steps;
// a last group of 64 or 32 takes one, zero-padded.
struct Int4TileSteps {
  std::vector<int64_t> first;  // [groups + 1]: the group's first step; first[groups]: all
  Int4TileSteps(int64_t padded, int64_t group_size, int64_t groups) : first(groups + 1, 0) {
    for (int64_t g = 0; g < groups; ++g)
      first[g + 1] = first[g] + (group_width(g, groups, padded, group_size) + kCodeStep - 1) /
                                    kCodeStep;
  }
};

// x [M, K] as the tiles' B operand, 16 rows of x a block: for block b and step t, 16 rows of 4
// consecutive values of K by 16 rows of x (element (r, 4 m + j) is value 4 r + j of the step
// for row 16 b + m); then per block and group, lanes of the 16 rows: s, 8 s sum(xq), sum(x).
struct Int4TileActivations {
  int64_t blocks, steps, groups;
  std::vector<int8_t> tiles;  // [blocks, steps, 16, 64]
  std::vector<float> lanes;   // [blocks, groups, 3, 16]

  Int4TileActivations(const torch::Tensor& x, int64_t padded, int64_t group_size,
                      const Int4TileSteps& layout, const float* rotation_signs)
      : blocks((x.size(0) + kTileRows - 1) / kTileRows),
        steps(layout.first.back()),
        groups(static_cast<int64_t>(layout.first.size()) - 1),
        tiles(blocks * steps * kTileRows * 64, 0),
        lanes(blocks * groups * 3 * kTileRows, 0.f) {
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      std::vector<float> values(padded, 0.f);
      alignas(64) int8_t codes[kCodeStep];
      for (int64_t m = begin; m < end; ++m) {
        float_row(x, m, rotation_signs, values.data());
        const int64_t b = m / kTileRows, lane = m % kTileRows;
        for (int64_t g = 0; g < groups; ++g) {
          const float* group = values.data() + g * group_size;
          const int64_t width = group_width(g, groups, padded, group_size);
          __m512 sum = _mm512_setzero_ps(), peak = _mm512_setzero_ps();
          for (int64_t i = 0; i < width; i += 16) {
            const __m512 v = _mm512_loadu_ps(group + i);
            sum = _mm512_add_ps(sum, v);
            peak = _mm512_max_ps(peak, _mm512_abs_ps(v));
          }
          const float max = _mm512_reduce_max_ps(peak), scale = max / 127.f;
          const __m512 inverse = _mm512_set1_ps(max > 0.f ? 127.f / max : 0.f);
          int32_t code_sum = 0;
          for (int64_t i = 0; i < width; i += kCodeStep) {
            std::fill_n(codes, kCodeStep, int8_t{0});
            for (int64_t j = 0; j < std::min(kCodeStep, width - i); j += 16) {
              const __m512i q = _mm512_cvtps_epi32(
                  _mm512_mul_ps(_mm512_loadu_ps(group + i + j), inverse));
              code_sum += _mm512_reduce_add_epi32(q);
              _mm_store_si128(reinterpret_cast<__m128i*>(codes + j), _mm512_cvtsepi32_epi8(q));
            }
            int8_t* tile = tiles.data() + (b * steps + layout.first[g] + i / kCodeStep) * 1024;
            for (int64_t r = 0; r < kTileRows; ++r)
              std::memcpy(tile + r * 64 + lane * 4, codes + 4 * r, 4);
          }
          float* at = lanes.data() + (b * groups + g) * 3 * kTileRows + lane;
          at[0] = scale;
          at[kTileRows] = 8.f * scale * static_cast<float>(code_sum);
          at[2 * kTileRows] = _mm512_reduce_add_ps(sum);
        }
      }
    });
  }
};

// The codes of `outputs` int4 rows from n0 unpacked to one byte each, in tile steps: [outputs,
// steps, 64], each group's values in order (low nibbles, then high; a group of 32 or 64 in one
// zero-padded step).
inline void unpack_int4_steps(const uint8_t* codes, int64_t row_bytes, int64_t outputs,
                              int64_t group_size, int64_t groups, int64_t padded,
                              const Int4TileSteps& layout, uint8_t* out) {
  const int64_t steps = layout.first.back();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t r = 0; r < outputs; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* bytes = codes + r * row_bytes + g * group_size / 2;
      uint8_t* step = out + (r * steps + layout.first[g]) * kCodeStep;
      const int64_t half = group_width(g, groups, padded, group_size) / 2;
      if (half < kCodeStep) {
        _mm512_storeu_si512(step, int4_codes_64(bytes, half, 0));
        continue;
      }
      for (int64_t i = 0; i < half; i += kCodeStep) {  // each 64 bytes read once for both halves
        const __m512i raw = _mm512_loadu_si512(bytes + i);
        _mm512_storeu_si512(step + i, _mm512_and_si512(raw, nibble));
        _mm512_storeu_si512(step + half + i, _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble));
      }
    }
}

// One block of NW tiles of W's unpacked codes (`unpacked`, [NW * 16, steps, 64]) by NX tiles of
// x (blocks xb, xb + 1), group by group: each group's int32 sums, scaled, into sums [NW * 16
// outputs][kBlockInputs rows of x] (float32, zeroed here). With `ahead` (the next block's codes,
// ahead_bytes from there), each output's scaling asks for a line of them, a group's share of the
// lines a group (kernels/prefetch.cpp): asked for in one burst a block, or a line of each row a
// step, the loop asking had held an eighth of the product's time.
template <int NW, int NX>
inline void int4_code_block(const uint8_t* unpacked, const Int4TileActivations& a, int64_t xb,
                            const Int4TileSteps& layout, const float* scales, const float* zeros,
                            float* sums, const uint8_t* ahead, int64_t ahead_bytes) {
  const int64_t steps = a.steps, groups = a.groups, w_stride = steps * kCodeStep;
  const int8_t* x_tiles = a.tiles.data() + xb * steps * 1024;
  const auto first_line = reinterpret_cast<uintptr_t>(ahead) & ~uintptr_t{63};
  const int64_t lines = ahead == nullptr ? 0 : (reinterpret_cast<uintptr_t>(ahead) + ahead_bytes -
                                                first_line + 63) / 64;
  const int64_t group_lines = (lines + groups - 1) / groups;
  alignas(64) int32_t c[4][kTileRows * kTileRows];
  std::fill_n(sums, kBlockOutputs * kBlockInputs, 0.f);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t = layout.first[g]; t < layout.first[g + 1]; ++t) {
      const uint8_t* w = unpacked + t * kCodeStep;
      _tile_loadd(4, w, w_stride);
      _tile_loadd(6, x_tiles + t * 1024, 64);
      _tile_dpbusd(0, 4, 6);
      if constexpr (NX == 2) {
        _tile_loadd(7, x_tiles + (steps + t) * 1024, 64);
        _tile_dpbusd(1, 4, 7);
      }
      if constexpr (NW == 2) {
        _tile_loadd(5, w + kTileRows * w_stride, w_stride);
        _tile_dpbusd(2, 5, 6);
        if constexpr (NX == 2) _tile_dpbusd(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], 64);
    if constexpr (NX == 2) _tile_stored(1, c[1], 64);
    if constexpr (NW == 2) {
      _tile_stored(2, c[2], 64);
      if constexpr (NX == 2) _tile_stored(3, c[3], 64);
    }
    for (int i = 0; i < NW; ++i)
      for (int j = 0; j < NX; ++j) {
        const float* lanes = a.lanes.data() + ((xb + j) * groups + g) * 3 * kTileRows;
        const __m512 x_scale = _mm512_loadu_ps(lanes), x_offset = _mm512_loadu_ps(lanes + 16),
                     x_sum = _mm512_loadu_ps(lanes + 32);
#pragma GCC unroll 16
        for (int64_t r = 0; r < kTileRows; ++r) {
          const int64_t n = i * kTileRows + r;
          const int64_t line = g * group_lines + n;
          if (j == 0 && n < group_lines && line < lines)
            __builtin_prefetch(reinterpret_cast<const void*>(first_line + line * 64), 0, 2);
          float* at = sums + n * kBlockInputs + j * kTileRows;
          const __m512 centred = _mm512_fmsub_ps(
              _mm512_cvtepi32_ps(_mm512_load_si512(c[2 * i + j] + r * kTileRows)), x_scale,
              x_offset);
          __m512 sum = _mm512_fmadd_ps(centred, _mm512_set1_ps(scales[n * groups + g]),
                                       _mm512_load_ps(at));
          sum = _mm512_fmadd_ps(x_sum, _mm512_set1_ps(zeros[n * groups + g]), sum);
          _mm512_store_ps(at, sum);
        }
      }
  }
}
#endif
#endif

#if defined(__AVX512BF16__)
// An int4 layer's arguments to linear_int4, checked, and what both of its paths share.
struct Int4Weights {
  int64_t out_features, padded, group_size, groups;
  const uint8_t* codes;
  const float* scales;
  const float* mins;
  Bias bias;

  Int4Weights(const torch::Tensor& x, const torch::Tensor& codes_, const torch::Tensor& scales_,
              const torch::Tensor& mins_, int64_t group_size_,
              const c10::optional<torch::Tensor>& bias_, const char* name)
      : out_features(codes_.size(0)), padded(codes_.size(1) * 2), group_size(group_size_),
        groups((padded + group_size_ - 1) / group_size_), bias(bias_) {
    const int64_t in_features = x.size(1);
    check_few_rows_input(x, bias_, out_features, name);
    const int64_t last = group_width(groups - 1, groups, padded, group_size);
    TORCH_CHECK(group_size >= 32 && (group_size & (group_size - 1)) == 0 && last >= 32 &&
                    (last & (last - 1)) == 0 && in_features <= padded &&
                    padded - in_features < last,
                name, ": P is x's K padded to whole groups of a power of two from 32, the last "
                "as narrow as the rest's power of two");
    TORCH_CHECK(codes_.dim() == 2 && codes_.is_contiguous() &&
                    codes_.scalar_type() == torch::kByte && out_features % kWeightRows == 0,
                name, ": codes [N, P / 2] uint8 contiguous, N a multiple of 4");
    for (const auto& t : {scales_, mins_})
      TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat &&
                      t.numel() == out_features * groups,
                  name, ": scales and mins [N, groups] float32");
    codes = codes_.data_ptr<uint8_t>();
    scales = scales_.data_ptr<float>();
    mins = mins_.data_ptr<float>();
  }

  // x by W through x's int8 codes (`a`, up to kInt8ActivationMaxRows rows), eight rows of W a
  // tile (four for a last four), each thread a run of tiles.
  torch::Tensor code_product(const torch::Tensor& x, const Int4Activations& a,
                             const torch::Tensor& out) const {
    constexpr int64_t kTileOutputs = 8;
    const int64_t rows = x.size(0), row_bytes = padded / 2, half = group_size / 2;
    auto* ys = out.data_ptr<c10::BFloat16>();
    const auto finish = [&](int64_t n, float sum) { return sum + bias[n]; };
    const int64_t tiles = (out_features + kTileOutputs - 1) / kTileOutputs;
    at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * kTileOutputs;
        const uint8_t* tile_codes = codes + n0 * row_bytes;
        const uint8_t* ahead = t + 1 < end ? tile_codes + kTileOutputs * row_bytes : nullptr;
        const auto run = [&](auto outputs, auto whole_groups) {
          int4_rows<decltype(outputs)::value, decltype(whole_groups)::value>(
              a, rows, tile_codes, row_bytes, scales + n0 * groups, mins + n0 * groups,
              half, ahead, n0, out_features, ys, finish);
        };
        using Eight = std::integral_constant<int, kTileOutputs>;
        using Four = std::integral_constant<int, kWeightRows>;
        const bool four = out_features - n0 < kTileOutputs;
        if (half >= 64) {
          if (four) run(Four{}, std::true_type{});
          else run(Eight{}, std::true_type{});
        } else {
          if (four) run(Four{}, std::false_type{});
          else run(Eight{}, std::false_type{});
        }
      }
    });
    return out;
  }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
  // x by W on AMX-INT8 tiles through x's int8 codes per row and group (groups of 128 or more):
  // each block of 32 rows of W unpacked once for every row of x, each thread a run of blocks.
  torch::Tensor tile_code_product(const torch::Tensor& x, const float* rotation_signs,
                                  const torch::Tensor& out) const {
    const Int4TileSteps layout(padded, group_size, groups);
    const Int4TileActivations a(x, padded, group_size, layout, rotation_signs);
    const int64_t rows = x.size(0), row_bytes = padded / 2;
    auto* ys = reinterpret_cast<uint16_t*>(out.data_ptr());
    const int64_t w_blocks = (out_features + kBlockOutputs - 1) / kBlockOutputs;
    at::parallel_for(0, w_blocks, 1, [&](int64_t begin, int64_t end) {
      const Tiles tiles;
      std::vector<uint8_t> unpacked(kBlockOutputs * a.steps * kCodeStep);
      std::vector<float> zeros(kBlockOutputs * groups);  // the block's min + 8 scale
      alignas(64) float sums[kBlockOutputs * kBlockInputs];
      for (int64_t block = begin; block < end; ++block) {
        const int64_t n0 = block * kBlockOutputs;
        const int64_t outputs = std::min(kBlockOutputs, out_features - n0);
        unpack_int4_steps(codes + n0 * row_bytes, row_bytes, outputs, group_size, groups, padded,
                          layout, unpacked.data());
        const float* block_scales = scales + n0 * groups;
        for (int64_t i = 0; i < outputs * groups; ++i)
          zeros[i] = mins[n0 * groups + i] + 8.f * block_scales[i];
        const int64_t ahead_rows =
            block + 1 < end ? std::min(kBlockOutputs, out_features - n0 - kBlockOutputs) : 0;
        for (int64_t xb = 0; xb < a.blocks; xb += 2) {
          const uint8_t* ahead =  // asked for on the first pass over a block
              xb == 0 && ahead_rows > 0 ? codes + (n0 + kBlockOutputs) * row_bytes : nullptr;
          with_block_shape(outputs == kBlockOutputs, xb + 1 < a.blocks, [&](auto nw, auto nx) {
            int4_code_block<decltype(nw)::value, decltype(nx)::value>(
                unpacked.data(), a, xb, layout, block_scales, zeros.data(), sums, ahead,
                ahead_rows * row_bytes);
          });
          finish_block(sums, n0, outputs, xb * kTileRows, rows, nullptr, bias.values, ys,
                       out_features);
        }
      }
    });
    return out;
  }
#endif

  auto prefetch() const {
    return [this](int64_t n0) {
      // The block three ahead of the one being multiplied (n0 is the next): a block of int4
      // rows is read faster than memory answers. Asking for the next two blocks every block
      // asked for each line twice; one block three ahead took SmolLM2's one-row products
      // (30 layers and the lm_head, from memory) from 4.23-4.90 to 3.96-4.68 ms, four to
      // eight ahead no less (AMD VM, alternating builds in one process). Asking for the
      // scales and mins too slowed the one-row product by a quarter (576 x 1536 from memory:
      // 50 us a call, 39 without them).
      prefetch_bytes(codes + (n0 + 2 * kWeightRows) * padded / 2, kWeightRows * padded / 2);
    };
  }

  // Each block of W widened to bfloat16 once for every row of x (already rotated). `tiles`:
  // multiplied on AMX tiles (linear_amx.cpp); else from kLanesMinRows rows, where `lanes` allows
  // (not for gguf's exact layers: they sum as linear_bf16's tile does), by lanes_product; else
  // by linear_bf16.cpp's tile.
  torch::Tensor widened_product(const torch::Tensor& x, bool tiles, bool lanes,
                                const torch::Tensor& out) const {
    const torch::Tensor xo = group_size % 64 == 0 ? fused_order(x, padded, group_size, groups) : x;
    if (!tiles && lanes && x.size(0) >= kLanesMinRows && out_features % kLaneOutputs == 0 &&
        padded % 32 == 0)
      return lanes_product(
          xo, out, padded,
          [&](int64_t n0, uint16_t* rows) {
            for (int64_t r = 0; r < kLaneOutputs; r += kWeightRows)
              widen_int4_rows(codes + (n0 + r) * padded / 2, scales + (n0 + r) * groups,
                              mins + (n0 + r) * groups, padded, group_size, groups,
                              rows + r * padded);
          },
          bias);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles)
      return amx_product(
          xo, out, padded, true,
          [&](int64_t n0, int64_t count, int64_t k0, int64_t k1, uint16_t* scratch,
              int64_t stride) {
            for (int64_t r = 0; r < count; r += kWeightRows)
              widen_int4_columns(codes + (n0 + r) * padded / 2, scales + (n0 + r) * groups,
                                 mins + (n0 + r) * groups, padded, group_size, groups, k0, k1,
                                 scratch + r * stride, stride);
            return std::pair<const uint16_t*, int64_t>{scratch, stride};
          },
          nullptr, bias.values, codes, padded / 2);
#endif
    if (group_size == 32 && padded % 64 == 0)
      return few_rows_product(
          xo, out, 0, [](int64_t n0, uint16_t*) { return n0; },
          [&](auto mt, int64_t n0, const uint16_t* xm, int64_t x_stride, int64_t,
              float sums[kInputRows][kWeightRows]) {
            int4_exact_tile<decltype(mt)::value>(xm, x_stride, codes + n0 * padded / 2,
                                                 scales + n0 * groups, mins + n0 * groups,
                                                 padded, sums);
          },
          [&](int64_t n, float sum) { return sum + bias[n]; }, prefetch());
    return few_rows_product(
        xo, out, kWeightRows * padded,
        [&](int64_t n0, uint16_t* scratch) {
          widen_int4_rows(codes + n0 * padded / 2, scales + n0 * groups, mins + n0 * groups,
                          padded, group_size, groups, scratch);
          return static_cast<const uint16_t*>(scratch);
        },
        BFloat16Rows{padded, xo.size(1)}, [&](int64_t n, float sum) { return sum + bias[n]; },
        prefetch());
  }
};
#endif

}  // namespace

// x [M, K] bfloat16 with contiguous rows; codes int8 [N, K] contiguous, N a multiple of 4 and K of
// 32; scales float32 [N], one per row, or [N, K / group_size] for groups of a multiple of 32
// (GGUF's Q8_0); bias [N] bfloat16 or None. Returns [M, N] bfloat16. Grouped, each block of W is
// widened to its de-quantized bfloat16 values and multiplied by linear_bf16's tile: the result is
// linear_bf16's on the de-quantized W, bit for bit, at any number of rows.
torch::Tensor linear_int8_out(const torch::Tensor& x, const torch::Tensor& codes,
                              const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias,
                              const c10::optional<torch::Tensor>& into) {
  const WithoutGil without_gil;
#if defined(__AVX512BF16__)
  const int64_t in_features = x.size(1), out_features = codes.size(0);
  check_few_rows_input(x, bias, out_features, "linear_int8");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == torch::kChar &&
                  codes.size(1) == in_features && out_features % kWeightRows == 0 &&
                  in_features % 32 == 0,
              "linear_int8: codes [N, K] int8 contiguous, N a multiple of 4, K of 32");
  const int64_t groups = scales.numel() / out_features;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat &&
                  scales.numel() == out_features * groups && groups > 0 &&
                  in_features % (32 * groups) == 0,
              "linear_int8: scales float32, [N] or [N, K / group_size], groups of 32 or more");
  const torch::Tensor out = product_output(x, out_features, into, "linear_int8");
  const int8_t* cs = codes.data_ptr<int8_t>();
  const float* ss = scales.data_ptr<float>();
  const Bias b(bias);
  const auto prefetch = [&](int64_t n0) {
    // Two blocks: 3072 x 576 from memory at one row, 129 -> 111 us a call (576 x 1536 unchanged).
    prefetch_bytes(cs + n0 * in_features, 2 * kWeightRows * in_features);
  };
  if (groups > 1) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    // as linear_bf16 multiplies the de-quantized W
    if (use_amx(x.size(0), out_features, in_features))
      return amx_product(
          x, out, in_features, true,
          [&](int64_t n0, int64_t count, int64_t k0, int64_t k1, uint16_t* scratch,
              int64_t stride) {
            widen_scaled_int8_columns(cs + n0 * in_features, ss + n0 * groups, in_features,
                                      in_features / groups, count, k0, k1, scratch, stride);
            return std::pair<const uint16_t*, int64_t>{scratch, stride};
          },
          nullptr, b.values, cs, in_features);
#endif
    return few_rows_product(
        x, out, 0, [](int64_t n0, uint16_t*) { return n0; },
        [&](auto mt, int64_t n0, const uint16_t* xm, int64_t x_stride, int64_t,
            float sums[kInputRows][kWeightRows]) {
          scaled_int8_tile<decltype(mt)::value>(xm, x_stride, cs + n0 * in_features,
                                                ss + n0 * groups, in_features,
                                                in_features / groups, sums);
        },
        [&](int64_t n, float sum) { return sum + b[n]; }, prefetch);
  }
  const auto finish = [&](int64_t n, float sum) { return sum * ss[n] + b[n]; };
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (use_amx(x.size(0), out_features, in_features))
    return amx_product(
        x, out, in_features, true,
        [&](int64_t n0, int64_t count, int64_t k0, int64_t k1, uint16_t* scratch,
            int64_t stride) {
          widen_int8_columns(cs + n0 * in_features, in_features, count, k0, k1, scratch, stride);
          return std::pair<const uint16_t*, int64_t>{scratch, stride};
        },
        ss, b.values, cs, in_features);
#endif
  if (x.size(0) > kInputRows) {
    return few_rows_product(
        x, out, kWeightRows * in_features,
        [&](int64_t n0, uint16_t* scratch) {
          widen_int8_columns(cs + n0 * in_features, in_features, kWeightRows, 0, in_features,
                             scratch, in_features);
          return static_cast<const uint16_t*>(scratch);
        },
        BFloat16Rows{in_features, in_features}, finish, prefetch);
  }
  const Int16Activations activations(x);
  return few_rows_product(
      x, out, 0, [&](int64_t n0, uint16_t*) { return cs + n0 * in_features; },
      [&](auto mt, const int8_t* rows, const uint16_t*, int64_t, int64_t m0,
          float sums[kInputRows][kWeightRows]) {
        int8_tile<decltype(mt)::value>(activations, m0, rows, in_features, sums,
                                       m0 == 0 ? rows + kWeightRows * in_features : nullptr);
      },
      finish, [](int64_t) {});
#else
  TORCH_CHECK(false, "linear_int8: built without AVX-512 BF16");
  return x;
#endif
}

torch::Tensor linear_int8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias) {
  return linear_int8_out(x, codes, scales, bias, c10::nullopt);
}

// x [M, K] bfloat16 with contiguous rows; codes uint8 [N, P / 2] contiguous, P the row's length
// in groups of group_size (a power of two, 32 or more) but for a narrower last one (group_width),
// N a multiple of 4; scales and mins float32 [N, groups]; bias [N] bfloat16 or None; rotation_signs, when given, rotate
// x first (hadamard.cpp): the layer's codes are of W R. Returns [M, N] bfloat16.
torch::Tensor linear_int4_out(const torch::Tensor& x, const torch::Tensor& codes,
                              const torch::Tensor& scales, const torch::Tensor& mins,
                              int64_t group_size, const c10::optional<torch::Tensor>& bias,
                              const c10::optional<torch::Tensor>& rotation_signs,
                              const c10::optional<torch::Tensor>& into) {
  const WithoutGil without_gil;
#if defined(__AVX512BF16__)
  const Int4Weights w(x, codes, scales, mins, group_size, bias, "linear_int4");
  const torch::Tensor out = product_output(x, w.out_features, into, "linear_int4");
  if (rotation_signs)
    TORCH_CHECK(rotation_signs->is_contiguous() && rotation_signs->scalar_type() == torch::kFloat &&
                    rotation_signs->numel() == kHadamardBlock && x.size(1) % kHadamardBlock == 0,
                "linear_int4: rotation signs float32 [64], K a multiple of 64");
  const bool amx = use_amx(x.size(0), w.out_features, w.padded);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
  if (amx && x.size(0) >= kInt4TileMinRows && group_size >= kInt4TileMinGroup)
    return w.tile_code_product(x, rotation_signs ? rotation_signs->data_ptr<float>() : nullptr,
                               out);
#endif
  const bool tiles = x.size(0) > kInt8ActivationMaxRowsWithAmx && amx;
  if (tiles || x.size(0) > kInt8ActivationMaxRows)
    return w.widened_product(rotation_signs ? hadamard_rotate(x, *rotation_signs) : x, tiles,
                             true, out);
  const Int4Activations activations(
      x, w.padded, group_size, w.groups,
      rotation_signs ? rotation_signs->data_ptr<float>() : nullptr);
  return w.code_product(x, activations, out);
#else
  TORCH_CHECK(false, "linear_int4: built without AVX-512 BF16");
  return x;
#endif
}

torch::Tensor linear_int4(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                          torch::Tensor mins, int64_t group_size,
                          c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> rotation_signs) {
  return linear_int4_out(x, codes, scales, mins, group_size, bias, rotation_signs, c10::nullopt);
}

// linear_bf16(x, W) on the de-quantized W, bit for bit, at any number of rows, for int4 layers of
// groups of 32 without padding (GGUF's Q4_0 and Q4_1): each block of W is widened to the
// bfloat16 values dequantize_int4 gives, in order, and multiplied by linear_bf16's tile. Arguments
// as linear_int4's.
torch::Tensor linear_int4_exact_out(const torch::Tensor& x, const torch::Tensor& codes,
                                    const torch::Tensor& scales, const torch::Tensor& mins,
                                    const c10::optional<torch::Tensor>& bias,
                                    const c10::optional<torch::Tensor>& into) {
  const WithoutGil without_gil;
#if defined(__AVX512BF16__)
  const Int4Weights w(x, codes, scales, mins, 32, bias, "linear_int4_exact");
  TORCH_CHECK(w.padded == x.size(1), "linear_int4_exact: K a multiple of 32, no padding");
  // As linear_bf16 does: never lanes_product, whose sums run in another order.
  return w.widened_product(x, use_amx(x.size(0), w.out_features, w.padded), false,
                           product_output(x, w.out_features, into, "linear_int4_exact"));
#else
  TORCH_CHECK(false, "linear_int4_exact: built without AVX-512 BF16");
  return x;
#endif
}

torch::Tensor linear_int4_exact(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                torch::Tensor mins, c10::optional<torch::Tensor> bias) {
  return linear_int4_exact_out(x, codes, scales, mins, bias, c10::nullopt);
}

// Writes W into `out` [R, C] (float32, bfloat16 or float16, contiguous; C <= P, the columns past
// C dropped: the padding a product can skip) from int4 codes [R, P / 2] (the layout above),
// scales and mins float32 [R, groups]: code * scale, then + min, each rounded to float32
// as Int4Linear.dequantize_padded's PyTorch path does, then once to out's dtype. One pass, for
// the de-quantize + GEMM path, where the PyTorch ops took five.
void dequantize_int4(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                     int64_t group_size, torch::Tensor out) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == torch::kByte &&
                  group_size % 2 == 0,
              "dequantize_int4: codes [R, P / 2] uint8 contiguous");
  const int64_t rows = codes.size(0), padded = codes.size(1) * 2;
  const int64_t groups = (padded + group_size - 1) / group_size;
  for (const auto& t : {scales, mins})
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat &&
                    t.numel() == rows * groups,
                "dequantize_int4: scales and mins [R, groups] float32");
  const int64_t width = out.size(-1);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == rows && width <= padded,
              "dequantize_int4: out [R, C] contiguous, C at most P");
  const uint8_t* cs = codes.data_ptr<uint8_t>();
  const float* ss = scales.data_ptr<float>();
  const float* ms = mins.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_int4", [&] {
    scalar_t* os = out.data_ptr<scalar_t>();
    // A thread a run of rows, each walked group by group: one task a group, found by dividing
    // its index, had cost two 64-bit divisions every group.
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const uint8_t* row_codes = cs + row * padded / 2;
        const float* row_scales = ss + row * groups;
        const float* row_mins = ms + row * groups;
        scalar_t* row_out = os + row * width;
#if defined(__AVX512BF16__)
        // Whole rows of groups of 32 (GGUF's), two groups a lookup.
        if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
          if (group_size == 32 && width == padded && padded % 64 == 0) {
            widen_int4_pairs(row_codes, row_scales, row_mins, padded, 0, padded,
                             reinterpret_cast<uint16_t*>(row_out), padded, 1);
            continue;
          }
        }
#endif
        for (int64_t g = 0; g < groups && g * group_size < width; ++g) {
          const int64_t first = g * group_size;  // the group's first column
          const int64_t half = group_width(g, groups, padded, group_size) / 2;
          const uint8_t* bytes = row_codes + first / 2;
          scalar_t* values = row_out + first;
          const float scale = row_scales[g], min = row_mins[g];
          const int64_t count = std::min(2 * half, width - first);
#if defined(__AVX512BF16__)
          // A whole group in bfloat16 by int4_table's lookups, the same values as the loop
          // below: that loop ran 1.3 G values a second in groups of 32 (GGUF's), a sixth of its
          // rate in groups of 128, and made a 2,048-row step's de-quantize 3 ms a layer
          // (SmolLM2, AMD VM).
          if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
            if (count == 2 * half) {
              const __m512i table = int4_table(scale, min);
              auto* out16 = reinterpret_cast<uint16_t*>(values);
              if (half % 32 == 0) {
                for (int64_t i = 0; i < half; i += 32) {
                  __m512i low, high;
                  lookup_int4_32(bytes + i, table, low, high);
                  _mm512_storeu_si512(out16 + i, low);
                  _mm512_storeu_si512(out16 + half + i, high);
                }
              } else {
                _mm512_storeu_si512(out16, lookup_int4_16(bytes, table));
              }
              continue;
            }
          }
#endif
          for (int64_t i = 0; i < std::min(half, count); ++i)
            values[i] = static_cast<scalar_t>(static_cast<float>(bytes[i] & 0x0F) * scale + min);
          for (int64_t i = half; i < count; ++i)
            values[i] =
                static_cast<scalar_t>(static_cast<float>(bytes[i - half] >> 4) * scale + min);
        }
      }
    });
  });
}

// Writes W R R^T = W, the float weight of a rotated int4 layer, into `out` [R, C] (float32,
// bfloat16 or float16, contiguous; C a multiple of 64, at most P), from codes of W R (the layout
// above, every group 64 or more wide), scales and mins [R, groups] and the rotation's signs
// float32 [64] (hadamard.cpp): each 64 values as dequantize_int4 computes them, in float32, then
// times H diag(signs) / 8 and rounded once. A prefill's products past packed_max_rows then take
// x as it is: rotating x there had been an eighth of an int4 prefill's time (2,048 rows, perf,
// AMX VM), about twice this arithmetic, since x had twice W's values and a pass of its own.
void dequantize_int4_unrotated(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                               int64_t group_size, torch::Tensor signs, torch::Tensor out) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == torch::kByte,
              "dequantize_int4_unrotated: codes [R, P / 2] uint8 contiguous");
  const int64_t rows = codes.size(0), padded = codes.size(1) * 2;
  const int64_t groups = (padded + group_size - 1) / group_size;
  TORCH_CHECK(group_size >= 64 && group_width(groups - 1, groups, padded, group_size) >= 64,
              "dequantize_int4_unrotated: groups 64 or more wide");
  for (const auto& t : {scales, mins})
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat &&
                    t.numel() == rows * groups,
                "dequantize_int4_unrotated: scales and mins [R, groups] float32");
  TORCH_CHECK(signs.is_contiguous() && signs.scalar_type() == torch::kFloat &&
                  signs.numel() == kHadamardBlock, "dequantize_int4_unrotated: signs float32 [64]");
  const int64_t width = out.size(-1), blocks = width / kHadamardBlock;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == rows && width <= padded &&
                  width % kHadamardBlock == 0,
              "dequantize_int4_unrotated: out [R, C] contiguous, C a multiple of 64, at most P");
  const uint8_t* cs = codes.data_ptr<uint8_t>();
  const float* ss = scales.data_ptr<float>();
  const float* ms = mins.data_ptr<float>();
  const float* sign = signs.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(),
                                  "dequantize_int4_unrotated", [&] {
    scalar_t* os = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
      alignas(64) float v[kHadamardBlock];
      for (int64_t t = begin; t < end; ++t) {  // t: 64 columns of one row
        const int64_t r = t / blocks, first = t % blocks * kHadamardBlock;
        const int64_t g = first / group_size, within = first - g * group_size;
        const int64_t half = group_width(g, groups, padded, group_size) / 2;
        const uint8_t* bytes = cs + r * padded / 2 + g * group_size / 2;
        const float scale = ss[r * groups + g], min = ms[r * groups + g];
#if defined(__AVX512BW__)
        const __m512i raw = int4_codes_64(bytes, half, within);
        const auto values = [&](__m128i sixteen) {  // code * scale, then + min, in float32
          return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sixteen)),
                                             _mm512_set1_ps(scale)),
                               _mm512_set1_ps(min));
        };
        _mm512_store_ps(v, values(_mm512_castsi512_si128(raw)));
        _mm512_store_ps(v + 16, values(_mm512_extracti32x4_epi32(raw, 1)));
        _mm512_store_ps(v + 32, values(_mm512_extracti32x4_epi32(raw, 2)));
        _mm512_store_ps(v + 48, values(_mm512_extracti32x4_epi32(raw, 3)));
#else
        for (int64_t i = 0; i < kHadamardBlock; ++i) {
          const int64_t j = within + i;  // value j of the group: byte j's low nibble, or j - half's high
          const uint8_t byte = bytes[j < half ? j : j - half];
          v[i] = static_cast<float>(j < half ? byte & 0x0F : byte >> 4) * scale + min;
        }
#endif
        unrotate_block(v, sign);
        store_block(v, os + r * width + first);
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
