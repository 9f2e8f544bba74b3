// y = x W^T (+ b) in bfloat16 for a few rows of x, on CPUs with AVX-512 BF16.
//
// Decode multiplies a handful of rows by every weight matrix, so it streams the weights once and
// does little arithmetic on them: it is bound by memory. torch's bfloat16 product reached 10 to 20
// GB/s on these shapes here (a 49152 x 576 lm_head at 10 GB/s). This kernel reads each weight row
// once for all of x's rows, multiplies with VDPBF16PS (bf16 pairs, exact products, float32 sums),
// and rounds each output once, after the bias. A row's result doesn't depend on how many rows come
// with it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kWeightRows = 4;  // outputs computed together: each x chunk loaded once for them
constexpr int64_t kInputRows = 4;   // rows of x a pass: 16 accumulators of the 32 registers

// out[0..3] = the lane sums of acc[0..3]: one fold to 256 bits each, then three horizontal adds
// for all four (a quarter of four separate reductions' shuffles).
inline void store_sums(const __m512 acc[kWeightRows], float out[kWeightRows]) {
  static_assert(kWeightRows == 4, "four sums a call");
  __m256 halves[kWeightRows];
  for (int n = 0; n < kWeightRows; ++n)
    halves[n] = _mm256_add_ps(_mm512_castps512_ps256(acc[n]), _mm512_extractf32x8_ps(acc[n], 1));
  const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(halves[0], halves[1]),
                                    _mm256_hadd_ps(halves[2], halves[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1)));
}

// out[m][n] = dot(x row m, w row n) for MT rows of x and kWeightRows rows of w. Row n's values
// k..k + 31 start at w + n * w_stride + k / 32 * chunk_stride: rows as they lie have chunk_stride
// 32 and w_stride their length (a decoded W may be padded to whole quantization groups);
// interleaved rows (interleave_bf16 in model/layers.py) have w_stride 32 and chunk_stride 128.
// Masked loads throughout (full masks but for the tail) keep the loop branch-free, so the
// compiler holds the accumulators in registers instead of spilling them every step. With
// `ahead` (the next tile's rows, laid out as w's), each chunk read asks for the same chunk of the
// next rows: spread so, rather than a burst a tile (kernels/prefetch.cpp), SmolLM2's products
// at one row took 0.79-0.87x the time (benchmarks/bench_kernels_ab.py --formats bf16, AMX VM).
template <int MT>
inline void tile(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t w_stride,
                 int64_t chunk_stride, int64_t in_features, float out[kInputRows][kWeightRows],
                 const uint16_t* ahead = nullptr) {
  __m512 acc[MT][kWeightRows];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < kWeightRows; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in_features; k += 32) {
    const int64_t remaining = in_features - k;
    const __mmask32 mask =
        remaining >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << remaining) - 1);
    __m512i weights[kWeightRows];
#pragma GCC unroll 4
    for (int n = 0; n < kWeightRows; ++n)
      weights[n] = _mm512_maskz_loadu_epi16(mask, w + n * w_stride + k / 32 * chunk_stride);
    if (ahead != nullptr)
      prefetch_rows(ahead, kWeightRows, w_stride * 2, k / 32 * chunk_stride * 2);
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) {
      const __m512i inputs = _mm512_maskz_loadu_epi16(mask, x + m * x_stride + k);
#pragma GCC unroll 4
      for (int n = 0; n < kWeightRows; ++n)
        acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)inputs, (__m512bh)weights[n]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) store_sums(acc[m], out[m]);
}

// out[m][n] = finish(n, dot(x row m, W row n)) for bfloat16 x [M, K] and a W of out_features
// rows, kWeightRows rows at a time: `rows_at(n0, scratch)` locates rows n0.. (in W's format, or
// decoded to bfloat16 into `scratch`, scratch_size elements a thread), once for all of x's rows,
// and `multiply(MT, located, x rows, x_stride, m0, sums)` fills sums for MT (a
// std::integral_constant) rows of x, from row m0, and those rows of W. `prefetch(n0)` asks for
// rows n0.. in W's format (kernels/prefetch.cpp says why); it is called a block of rows ahead.
template <typename RowsAt, typename Multiply, typename Finish, typename Prefetch>
torch::Tensor few_rows_product(const torch::Tensor& x, const torch::Tensor& out,
                               int64_t scratch_size,
                               RowsAt rows_at, Multiply multiply, Finish finish,
                               Prefetch prefetch) {
  const int64_t rows = x.size(0), out_features = out.size(1);
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* ys = out.data_ptr<c10::BFloat16>();
  const int64_t x_stride = x.stride(0);
  // Threads share out runs of kRunTiles tiles (kernels/work_sharing.cpp).
  constexpr int64_t kRunTiles = 8;
  const int64_t tiles = out_features / kWeightRows;
  share_blocks((tiles + kRunTiles - 1) / kRunTiles, [&](auto take) {
    uint16_t* const scratch = reused_buffer<uint16_t, 1>(scratch_size);
    float sums[kInputRows][kWeightRows];
    take([&](int64_t run, int64_t next_run) {
      const int64_t end = std::min(tiles, (run + 1) * kRunTiles);
      for (int64_t tile_index = run * kRunTiles; tile_index < end; ++tile_index) {
        const int64_t n0 = tile_index * kWeightRows;
        if (tile_index + 1 < end) prefetch(n0 + kWeightRows);
        else if (next_run >= 0) prefetch(next_run * kRunTiles * kWeightRows);
        const auto located = rows_at(n0, scratch);
        for (int64_t m0 = 0; m0 < rows; m0 += kInputRows) {
          const uint16_t* xm = xs + m0 * x_stride;
          switch (std::min(kInputRows, rows - m0)) {
            case 1:
              multiply(std::integral_constant<int, 1>{}, located, xm, x_stride, m0, sums);
              break;
            case 2:
              multiply(std::integral_constant<int, 2>{}, located, xm, x_stride, m0, sums);
              break;
            case 3:
              multiply(std::integral_constant<int, 3>{}, located, xm, x_stride, m0, sums);
              break;
            default: multiply(std::integral_constant<int, 4>{}, located, xm, x_stride, m0, sums);
          }
          for (int64_t m = 0; m < std::min(kInputRows, rows - m0); ++m)
            for (int64_t n = 0; n < kWeightRows; ++n)
              ys[(m0 + m) * out_features + n0 + n] =
                  static_cast<c10::BFloat16>(finish(n0 + n, sums[m][n]));
        }
      }
    });
  });
  return out;
}

// The bias's entries as float, or 0 without one.
struct Bias {
  const c10::BFloat16* values;
  explicit Bias(const c10::optional<torch::Tensor>& bias)
      : values(bias ? bias->data_ptr<c10::BFloat16>() : nullptr) {}
  float operator[](int64_t n) const { return values ? static_cast<float>(values[n]) : 0.f; }
};

// r[c] = column c of the 16 x 16 dwords whose row i is r[i].
inline void transpose_16x16(__m512i r[16]) {
  __m512i a[16], b[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {  // b[i + c]: in 128-bit lane L, column 4L + c of rows i..i+3
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i even_low = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88);
    const __m512i odd_low = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
    const __m512i even_high = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
    const __m512i odd_high = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(even_low, even_high, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(even_low, even_high, 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(odd_low, odd_high, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(odd_low, odd_high, 0xDD);
  }
}

// pairs[p * stride_out + i] = 32-bit pair p (values 2p, 2p + 1) of row i, for 16 rows of
// `pair_count` pairs (a multiple of 16) `stride` dwords apart.
inline void pairs_by_row(const uint32_t* rows, int64_t stride, int64_t pair_count,
                         uint32_t* pairs, int64_t stride_out) {
  for (int64_t p0 = 0; p0 < pair_count; p0 += 16) {
    __m512i r[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows + i * stride + p0);
    transpose_16x16(r);
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) _mm512_storeu_si512(pairs + (p0 + c) * stride_out, r[c]);
  }
}

// Outputs a block of lanes_product (16 a register) and rows of x a pass: 24 accumulators.
constexpr int64_t kLaneVectors = 4, kLaneRows = 6, kLaneOutputs = 16 * kLaneVectors;
// Rows of x from which lanes_product multiplies widened int4 codes (linear_quant.cpp) instead of
// the dot-product tiles: a decode pass of SmolLM2's 30 int4 layers, alternating the two in one
// process on the AMD VM, took 26.3 against 26.9 ms at 32 rows, 34.7 against 38.5 at 48, 43.0
// against 49.8 at 64 and 143.5 against 190.3 at 256; at 17 rows the tiles won (16.4 against
// 17.6). Widening a block of W and turning it into pairs costs the same at any row count.
constexpr int64_t kLanesMinRows = 33;

// out rows 0..MT-1 = x pairs of each row (broadcast) . W pairs [pair_count][kLaneOutputs] + bias.
template <int MT>
inline void lanes_tile(const uint32_t* x_pairs, int64_t pair_count, const uint32_t* w_pairs,
                       const float* bias, uint16_t* out, int64_t out_stride) {
  __m512 acc[MT][kLaneVectors];
#pragma GCC unroll 12
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < kLaneVectors; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pair_count; ++p) {
    __m512bh w[kLaneVectors];
#pragma GCC unroll 4
    for (int v = 0; v < kLaneVectors; ++v)
      w[v] = (__m512bh)_mm512_loadu_si512(w_pairs + p * kLaneOutputs + 16 * v);
#pragma GCC unroll 12
    for (int m = 0; m < MT; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(x_pairs[m * pair_count + p]);
#pragma GCC unroll 4
      for (int v = 0; v < kLaneVectors; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], w[v], xb);
    }
  }
#pragma GCC unroll 12
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < kLaneVectors; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * out_stride + 16 * v),
                          (__m256i)_mm512_cvtneps_pbh(
                              _mm512_add_ps(acc[m][v], _mm512_loadu_ps(bias + 16 * v))));
}

// x W^T + b with the outputs in the lanes: for each block of kLaneOutputs rows of W,
// `widen(n0, rows)` writes rows n0.. as bfloat16, `width` values each, into rows
// [kLaneOutputs, width]; they become pairs [width / 2][kLaneOutputs], and each row of x meets
// them through VDPBF16PS on its pairs broadcast: a load of W serves kLaneRows rows and a
// broadcast of x kLaneVectors registers, with no horizontal sums, where the dot-product tiles
// load W once for four rows and sum lanes at the end. x [M, K], K <= width (past K, x counts as
// zero) and even; width a multiple of 32; out_features a multiple of kLaneOutputs. Each output is
// rounded once, after the bias.
template <typename Widen>
torch::Tensor lanes_product(const torch::Tensor& x, const torch::Tensor& out, int64_t width,
                            Widen widen, const Bias& bias) {
  const int64_t rows = x.size(0), in_features = x.size(1), pair_count = width / 2;
  const int64_t out_features = out.size(1);
  TORCH_CHECK(in_features % 2 == 0 && in_features <= width && width % 32 == 0 &&
                  out_features % kLaneOutputs == 0,
              "lanes_product: K even, W rows a multiple of 32");
  std::vector<uint32_t> x_pairs(rows * pair_count, 0);  // x's rows, zero past K
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int64_t m = 0; m < rows; ++m)
    std::memcpy(x_pairs.data() + m * pair_count, xs + m * x.stride(0),
                in_features * sizeof(uint16_t));
  auto* ys = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, out_features / kLaneOutputs, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> widened(kLaneOutputs * width);
    std::vector<uint32_t> w_pairs(pair_count * kLaneOutputs);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kLaneOutputs;
      widen(n0, widened.data());
      for (int64_t v = 0; v < kLaneVectors; ++v)
        pairs_by_row(reinterpret_cast<const uint32_t*>(widened.data() + 16 * v * width),
                     pair_count, pair_count, w_pairs.data() + 16 * v, kLaneOutputs);
      float bias_values[kLaneOutputs];
      for (int64_t i = 0; i < kLaneOutputs; ++i) bias_values[i] = bias[n0 + i];
      for (int64_t m0 = 0; m0 < rows; m0 += kLaneRows) {
        const uint32_t* xp = x_pairs.data() + m0 * pair_count;
        uint16_t* y = ys + m0 * out_features + n0;
        const int64_t count = std::min(kLaneRows, rows - m0);
        switch (count) {
#define TOKENMILL_LANES_CASE(MT) \
  case MT: lanes_tile<MT>(xp, pair_count, w_pairs.data(), bias_values, y, out_features); break;
          TOKENMILL_LANES_CASE(1) TOKENMILL_LANES_CASE(2) TOKENMILL_LANES_CASE(3)
          TOKENMILL_LANES_CASE(4) TOKENMILL_LANES_CASE(5) TOKENMILL_LANES_CASE(6)
          TOKENMILL_LANES_CASE(7) TOKENMILL_LANES_CASE(8) TOKENMILL_LANES_CASE(9)
          TOKENMILL_LANES_CASE(10) TOKENMILL_LANES_CASE(11)
#undef TOKENMILL_LANES_CASE
          default: lanes_tile<kLaneRows>(xp, pair_count, w_pairs.data(), bias_values, y,
                                            out_features);
        }
      }
    }
  });
  return out;
}

// few_rows_product's `multiply` for bfloat16 x [M, in_features] and rows of W laid out as `tile`
// reads them: as they lie, w_stride apart, by default. `spread`, for rows as they lie only: the
// first pass over a tile's rows asks for the next tile's as it goes.
struct BFloat16Rows {
  int64_t w_stride, in_features, chunk_stride = 32;
  bool spread = false;
  template <typename MT>
  void operator()(MT, const uint16_t* w, const uint16_t* x, int64_t x_stride, int64_t m0,
                  float sums[kInputRows][kWeightRows]) const {
    tile<MT::value>(x, x_stride, w, w_stride, chunk_stride, in_features, sums,
                    spread && m0 == 0 ? w + kWeightRows * w_stride : nullptr);
  }
};

void check_few_rows_input(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kBFloat16, name,
              ": x [M, K] bfloat16 with contiguous rows");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == torch::kBFloat16 &&
                        bias->numel() == out_features), name, ": bias [N] bfloat16");
}

// A product's output [M, N]: `out` where the caller gives one (decode_layers.cpp keeps a step's
// outputs from layer to layer), else a new tensor.
torch::Tensor product_output(const torch::Tensor& x, int64_t out_features,
                             const c10::optional<torch::Tensor>& out, const char* name) {
  if (!out) return torch::empty({x.size(0), out_features}, x.options());
  TORCH_CHECK(out->dim() == 2 && out->size(0) == x.size(0) && out->size(1) == out_features &&
                  out->is_contiguous() && out->scalar_type() == x.scalar_type(),
              name, ": out [M, N] contiguous, x's dtype");
  return *out;
}

#endif

}  // namespace

bool linear_bf16_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [M, K] bfloat16 with contiguous rows; weight bfloat16 contiguous, [N, K] or interleaved
// [N / 4, K / 32, 4, 32] (model/layers.py's interleave_bf16), N a multiple of 4; bias [N]
// bfloat16 or None. Returns [M, N] bfloat16, the same values from either layout.
//
// Interleaved, each block of four rows is one run of memory, read in order: the hardware
// prefetcher follows it, where four rows as they lie are four short streams (1,152 bytes for
// SmolLM2's 576 inputs) that it barely starts on, even with prefetch_bytes asking for them.
torch::Tensor linear_bf16_out(const torch::Tensor& x, const torch::Tensor& weight,
                              const c10::optional<torch::Tensor>& bias,
                              const c10::optional<torch::Tensor>& into) {
  const WithoutGil without_gil;
#if defined(__AVX512BF16__)
  const bool interleaved = weight.dim() == 4;
  const int64_t out_features = interleaved ? weight.size(0) * kWeightRows : weight.size(0);
  check_few_rows_input(x, bias, out_features, "linear_bf16");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == torch::kBFloat16 &&
                  (interleaved ? weight.size(1) * 32 == x.size(1) && weight.size(2) == kWeightRows
                                     && weight.size(3) == 32
                               : weight.dim() == 2 && weight.size(1) == x.size(1) &&
                                     out_features % kWeightRows == 0),
              "linear_bf16: weight bfloat16 contiguous, [N, K] with N a multiple of 4, or "
              "[N / 4, K / 32, 4, 32]");
  const torch::Tensor out = product_output(x, out_features, into, "linear_bf16");
  const auto* ws = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const Bias b(bias);
  const int64_t in_features = x.size(1);
  // Either way rows n0.. start n0 * K values in.
  const auto rows_at = [&](int64_t n0, uint16_t*) { return ws + n0 * in_features; };
  const auto finish = [&](int64_t n, float sum) { return sum + b[n]; };
  if (interleaved)
    return few_rows_product(x, out, 0, rows_at, BFloat16Rows{32, in_features, 128},
                            finish, [](int64_t) {});
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (use_amx(x.size(0), out_features, in_features))
    return amx_product(
        x, out, in_features, false,
        [&](int64_t n0, int64_t, int64_t k0, int64_t, uint16_t*, int64_t) {
          return std::pair<const uint16_t*, int64_t>{ws + n0 * in_features + k0, in_features};
        },
        nullptr, b.values, ws, in_features * static_cast<int64_t>(sizeof(uint16_t)));
#endif
  return few_rows_product(x, out, 0, rows_at,
                          BFloat16Rows{in_features, in_features, 32, true}, finish,
                          [](int64_t) {});
#else
  TORCH_CHECK(false, "linear_bf16: built without AVX-512 BF16");
  return x;
#endif
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  return linear_bf16_out(x, weight, bias, c10::nullopt);
}
