// y = x W^T on AMX tiles, for the rows of x past the few-row kernels, on CPUs with AMX-BF16.
//
// From a few dozen rows a product is bound by arithmetic, not by the bytes of W: at 32 rows the
// VDPBF16PS tile of linear_bf16.cpp took 4.6x oneDNN's AMX product on SmolLM2's gate_up, and int8
// and int4 weights widened for it lost to bf16 at 32 sequences (python benchmarks/bench_linear.py). One
// TDPBF16PS does 16 x 16 x 32 products where VDPBF16PS does 16 x 2, so widening the codes to
// bfloat16, which every row of x shares, becomes the main cost.
//
// W is the tiles' A operand: rows of outputs as they lie, bfloat16 [outputs, K], so a block of W
// widened from codes needs no reordering. x is the B operand, laid out once a call in the tiles'
// pair-interleaved order. A C tile holds 16 outputs for 16 rows of x, and each output's sum runs
// over K in the same order whatever the number of rows, so a row's result doesn't depend on the
// rows beside it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr int64_t kTileRows = 16;   // outputs a tile of W and of C; rows of x a tile of x
constexpr int64_t kTileDepth = 32;  // bfloat16 values of K a tile
constexpr int64_t kTileElements = kTileRows * kTileDepth;
constexpr int64_t kBlockOutputs = 2 * kTileRows;  // W rows a block: tiles 4 and 5
constexpr int64_t kBlockInputs = 2 * kTileRows;   // x rows a pass: tiles 6 and 7

// Linux hands a process the tiles' 8 KB of state only when asked; once is enough for every thread.
bool amx_permitted() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
  static const bool permitted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return permitted;
}

// Every tile 16 rows of 64 bytes: C tiles 0-3 (fp32), W tiles 4-5, x tiles 6-7 (bfloat16 pairs).
// The configuration is the thread's: oneDNN loads its own before each of its products, so this
// is loaded before each of ours and released after.
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

struct Tiles {
  Tiles() {
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
      config.bytes_per_row[t] = 64;
      config.rows[t] = kTileRows;
    }
    _tile_loadconfig(&config);
  }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  ~Tiles() { _tile_release(); }
};

// rows[c][r] = rows[r][c] for 16 rows of 16 lanes of 32 bits: 4 x 4 within each 128-bit lane,
// then the 128-bit lanes 4 x 4.
inline void transpose16x16(__m512 rows[16]) {
  __m512 pairs[16];
  for (int i = 0; i < 16; i += 2) {
    pairs[i] = _mm512_unpacklo_ps(rows[i], rows[i + 1]);
    pairs[i + 1] = _mm512_unpackhi_ps(rows[i], rows[i + 1]);
  }
  __m512 quads[16];  // quads[4 g + j], lane L: rows 4 g..4 g + 3 at column 4 L + j
  for (int g = 0; g < 16; g += 4) {
    quads[g] = _mm512_shuffle_ps(pairs[g], pairs[g + 2], _MM_SHUFFLE(1, 0, 1, 0));
    quads[g + 1] = _mm512_shuffle_ps(pairs[g], pairs[g + 2], _MM_SHUFFLE(3, 2, 3, 2));
    quads[g + 2] = _mm512_shuffle_ps(pairs[g + 1], pairs[g + 3], _MM_SHUFFLE(1, 0, 1, 0));
    quads[g + 3] = _mm512_shuffle_ps(pairs[g + 1], pairs[g + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 low_ab = _mm512_shuffle_f32x4(quads[j], quads[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 high_ab = _mm512_shuffle_f32x4(quads[j], quads[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 low_cd = _mm512_shuffle_f32x4(quads[8 + j], quads[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 high_cd = _mm512_shuffle_f32x4(quads[8 + j], quads[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
    rows[j] = _mm512_shuffle_f32x4(low_ab, low_cd, _MM_SHUFFLE(2, 0, 2, 0));
    rows[4 + j] = _mm512_shuffle_f32x4(low_ab, low_cd, _MM_SHUFFLE(3, 1, 3, 1));
    rows[8 + j] = _mm512_shuffle_f32x4(high_ab, high_cd, _MM_SHUFFLE(2, 0, 2, 0));
    rows[12 + j] = _mm512_shuffle_f32x4(high_ab, high_cd, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// One B tile of pairs from `rows` (at most 16) rows of 32 bfloat16, `stride` elements apart:
// element (r, 2 m + j) of `tile` is element 2 r + j of row m; rows past `rows` are zero.
inline void pair_tile(const uint16_t* first, int64_t stride, int64_t rows, uint32_t* tile) {
  __m512 pairs[kTileRows];  // each row's 16 pairs, as 32 bits
  for (int64_t m = 0; m < kTileRows; ++m)
    pairs[m] = m < rows ? _mm512_loadu_ps(reinterpret_cast<const float*>(first + m * stride))
                        : _mm512_setzero_ps();
  transpose16x16(pairs);
  for (int64_t r = 0; r < kTileRows; ++r)
    _mm512_storeu_ps(reinterpret_cast<float*>(tile) + r * kTileRows, pairs[r]);
}

// x [M, K] bfloat16 -> [ceil(M / 16), K / 32] pair_tiles of 16 pairs of K (rows) by 16 rows of x:
// element (r, 2 m + j) of tile (b, s) is x[16 b + m, 32 s + 2 r + j]; rows past M are zero.
// Into the calling thread's reused buffer.
const uint32_t* pair_interleaved(const torch::Tensor& x) {
  const int64_t rows = x.size(0), steps = x.size(1) / kTileDepth;
  const int64_t blocks = (rows + kTileRows - 1) / kTileRows;
  uint32_t* out = reused_buffer<uint32_t, 0>(blocks * steps * kTileElements / 2);
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t s = 0; s < steps; ++s)
      pair_tile(xs + b * kTileRows * x.stride(0) + s * kTileDepth, x.stride(0),
                std::min(kTileRows, rows - b * kTileRows),
                out + (b * steps + s) * kTileElements / 2);
  return out;
}

// One block of W (kBlockOutputs rows from w, w_stride apart, or NW = 1 tile of them) by NX tiles
// of x (16 rows each) from `x_tiles`, into sums [NW * 16 outputs][NX * 16 rows of x]. With
// `ahead` (the next block's rows as stored: bfloat16, or the codes widened into w; row_bytes
// apart, step_bytes of each a step of K), each step asks for the lines of the next block that
// it reads of this one (kernels/prefetch.cpp): 32 rows of x over SmolLM2's bf16 products in
// 0.71x the time (benchmarks/bench_kernels_ab.py --formats bf16, AMX VM). Where x takes
// `passes` passes over the block (more than 32 rows), pass p asks only for rows p, p + passes,
// ..., so memory serves the next block evenly over all of them: asked for on the first pass
// alone, 48 and 64 rows took 1.10-1.14x the time, 1.01x at 32 (one pass either way).
//
// `between(s)` runs after step s's products are issued: the AVX-512 work that the caller has
// meanwhile (amx_product writes out the previous pass's sums there), done while the tiles work.
template <int NW, int NX, typename WAt, typename Between>
inline void amx_block(WAt w_at, const uint32_t* x_tiles, int64_t x_block_stride, int64_t steps,
                      float* sums, const char* ahead, int64_t row_bytes, int64_t step_bytes,
                      int64_t pass, int64_t passes, Between between) {
  const int64_t ahead_rows = (NW * kTileRows - pass + passes - 1) / passes;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const auto [ws, w_stride] = w_at(s);
    const uint32_t* xs = x_tiles + s * kTileElements / 2;
    if (ahead != nullptr && s * step_bytes % 64 < step_bytes)  // a step that starts a line
      prefetch_rows(ahead + pass * row_bytes, ahead_rows, passes * row_bytes, s * step_bytes);
    _tile_loadd(4, ws, w_stride * 2);
    _tile_loadd(6, xs, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NX == 2) {
      _tile_loadd(7, xs + x_block_stride, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NW == 2) {
      _tile_loadd(5, ws + kTileRows * w_stride, w_stride * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NX == 2) _tile_dpbf16ps(3, 5, 7);
    }
    between(s);
  }
  // sums [outputs][rows of x], kBlockInputs floats a row of outputs.
  constexpr int64_t stride = kBlockInputs * sizeof(float);
  _tile_stored(0, sums, stride);
  if constexpr (NX == 2) _tile_stored(1, sums + kTileRows, stride);
  if constexpr (NW == 2) {
    _tile_stored(2, sums + kTileRows * kBlockInputs, stride);
    if constexpr (NX == 2) _tile_stored(3, sums + kTileRows * kBlockInputs + kTileRows, stride);
  }
}

// fn(NW, NX) as std::integral_constants: a block of two tiles of W's rows or one (a last 16),
// by two tiles of x's rows or one (a last 16).
template <typename Fn>
inline void with_block_shape(bool two_w, bool two_x, Fn fn) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  if (two_w) {
    if (two_x) fn(Two{}, Two{});
    else fn(Two{}, One{});
  } else {
    if (two_x) fn(One{}, Two{});
    else fn(One{}, One{});
  }
}

// Writes one 16 x 16 tile of a block's sums [outputs][kBlockInputs rows of x, from m_first]:
// outputs nt..nt + 15 of the block (which starts at output n0) for its rows of x mt..mt + 15,
// turned to [rows of x][outputs], scaled by row_scales (may be null), shifted by bias (may be
// null) and rounded into out[m][n0 + nt + ...] (bfloat16, out_features a row). A tile past the
// block's outputs or x's rows writes nothing.
inline void finish_tile(const float* sums, int64_t n0, int64_t outputs, int64_t m_first,
                        int64_t nt, int64_t mt, int64_t rows, const float* row_scales,
                        const c10::BFloat16* bias, uint16_t* ys, int64_t out_features) {
  const int64_t n = n0 + nt, m0 = m_first + mt;
  if (nt >= outputs || m0 >= rows) return;
  const __m512 scale = row_scales ? _mm512_loadu_ps(row_scales + n) : _mm512_set1_ps(1.f);
  const __m512 shift = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + n))), 16))
                            : _mm512_setzero_ps();
  __m512 tile[kTileRows];
  for (int64_t r = 0; r < kTileRows; ++r)
    tile[r] = _mm512_load_ps(sums + (nt + r) * kBlockInputs + mt);
  transpose16x16(tile);
  for (int64_t m = 0; m < std::min(kTileRows, rows - m0); ++m) {
    __m512 value = tile[m];
    if (row_scales) value = _mm512_mul_ps(value, scale);
    value = _mm512_add_ps(value, shift);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ys + (m0 + m) * out_features + n),
                        (__m256i)_mm512_cvtneps_pbh(value));
  }
}

constexpr int64_t kBlockTiles = (kBlockOutputs / kTileRows) * (kBlockInputs / kTileRows);

// finish_tile's tile i of a block's sums, i < kBlockTiles: outputs first, then rows of x.
inline void finish_tile(const float* sums, int64_t n0, int64_t outputs, int64_t m_first,
                        int64_t i, int64_t rows, const float* row_scales,
                        const c10::BFloat16* bias, uint16_t* ys, int64_t out_features) {
  constexpr int64_t across = kBlockInputs / kTileRows;
  finish_tile(sums, n0, outputs, m_first, i / across * kTileRows, i % across * kTileRows, rows,
              row_scales, bias, ys, out_features);
}

// Every tile of a block's sums, as finish_tile writes them.
inline void finish_block(const float* sums, int64_t n0, int64_t outputs, int64_t m_first,
                         int64_t rows, const float* row_scales, const c10::BFloat16* bias,
                         uint16_t* ys, int64_t out_features) {
  for (int64_t i = 0; i < kBlockTiles; ++i)
    finish_tile(sums, n0, outputs, m_first, i, rows, row_scales, bias, ys, out_features);
}

// Columns of W widened a slice at a time: kSliceDepth of them for a block's rows, 8 KB.
constexpr int64_t kSliceDepth = 128;
constexpr int64_t kSliceSteps = kSliceDepth / kTileDepth;

// out[m][n] = dot(x row m, W row n) * row_scales[n] + bias[n] for bfloat16 x [M, K] (K a
// multiple of 32) and a W of out_features rows (a multiple of 16); row_scales and bias may be
// null. `rows_at(n0, rows, k0, k1, scratch, scratch_stride)` locates columns [k0, k1) of `rows`
// rows of W from n0 as bfloat16, {first, stride}: as W lies, or decoded into `scratch`
// (`needs_scratch`), once for all of x's rows; k0 is a multiple of kSliceDepth. A decoded W is
// decoded kSliceDepth columns at a time, just before the tiles read them, where x's rows take
// one pass over each block (up to 32): the whole block decoded first (36 KB for K 576) and x's
// tiles for 32 rows (as much again) did not fit L1 together. SmolLM2's products, 30 layers and
// the lm_head from memory, in 0.90x the time at 32 rows for int4, 0.88-0.94x at 16-32 for
// gguf's exact layers and 0.80-0.86x for int8 (bench_kernels_ab.py, AMX VM). `stored` is where
// W's rows lie in memory as stored (bfloat16, or the codes decoded from), `stored_row_bytes`
// apart.
template <typename RowsAt>
torch::Tensor amx_product(const torch::Tensor& x, const torch::Tensor& out, int64_t w_stride,
                          bool needs_scratch, RowsAt rows_at, const float* row_scales,
                          const c10::BFloat16* bias, const void* stored,
                          int64_t stored_row_bytes) {
  const int64_t rows = x.size(0), steps = x.size(1) / kTileDepth;
  const int64_t x_blocks = (rows + kTileRows - 1) / kTileRows;
  const bool sliced = needs_scratch && x_blocks <= 2;
  const uint32_t* x_tiles = pair_interleaved(x);
  const int64_t x_block_stride = steps * kTileElements / 2;
  const int64_t out_features = out.size(1);
  auto* ys = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t w_blocks = (out_features + kBlockOutputs - 1) / kBlockOutputs;
  // Each pass's sums are written out during the next pass's product, a tile every `spacing`
  // steps, so that their transposes and rounding run beside the AMX unit instead of after it,
  // which waited meanwhile; halfway between the steps that widen a slice of codes. SmolLM2's
  // products, 30 layers and the lm_head from memory, in bf16: 0.92-0.96x the time at 16-96 rows
  // (benchmarks/bench_kernels_ab.py on an AMX CPU).
  const int64_t spacing = std::max<int64_t>(1, steps / kBlockTiles);
  share_blocks(w_blocks, [&](auto take) {
    const Tiles tiles;
    uint16_t* const scratch = reused_buffer<uint16_t, 0>(
        needs_scratch ? kBlockOutputs * (sliced ? kSliceDepth : w_stride) : 0);
    alignas(64) float sums[2][kBlockOutputs * kBlockInputs];
    struct Pending {
      const float* sums = nullptr;
      int64_t n0 = 0, outputs = 0, m_first = 0, written = 0;
    } pending;
    const auto write_pending = [&](int64_t upto) {
      for (; pending.sums != nullptr && pending.written < std::min(upto, kBlockTiles);
           ++pending.written)
        finish_tile(pending.sums, pending.n0, pending.outputs, pending.m_first, pending.written,
                    rows, row_scales, bias, ys, out_features);
    };
    const auto between = [&](int64_t s) {
      if (s % spacing == spacing / 2) write_pending(s / spacing + 1);
    };
    int64_t current = 0;
    take([&](int64_t block, int64_t next) {
      const int64_t n0 = block * kBlockOutputs;
      const int64_t outputs = std::min(kBlockOutputs, out_features - n0);
      const auto [whole, whole_stride] =
          sliced ? std::pair<const uint16_t*, int64_t>{nullptr, 0}
                 : rows_at(n0, outputs, 0, w_stride, scratch, w_stride);
      for (int64_t xb = 0; xb < x_blocks; xb += 2) {
        const uint32_t* xs = x_tiles + xb * x_block_stride;
        const bool two_x = xb + 1 < x_blocks;
        const char* ahead = next >= 0
            ? static_cast<const char*>(stored) + next * kBlockOutputs * stored_row_bytes
            : nullptr;
        const int64_t step_bytes = stored_row_bytes / steps;
        const auto run = [&](auto w_at) {
          with_block_shape(outputs == kBlockOutputs, two_x, [&](auto nw, auto nx) {
            amx_block<decltype(nw)::value, decltype(nx)::value>(
                w_at, xs, x_block_stride, steps, sums[current], ahead, stored_row_bytes,
                step_bytes, xb / 2, (x_blocks + 1) / 2, between);
          });
        };
        if (sliced)
          run([&, n0 = n0, outputs = outputs](int64_t s) {
            if (s % kSliceSteps == 0)
              rows_at(n0, outputs, s * kTileDepth,
                      std::min(s * kTileDepth + kSliceDepth, w_stride), scratch,
                      kSliceDepth);
            return std::pair<const uint16_t*, int64_t>{
                scratch + s % kSliceSteps * kTileDepth, kSliceDepth};
          });
        else
          run([&, whole = whole, whole_stride = whole_stride](int64_t s) {
            return std::pair<const uint16_t*, int64_t>{whole + s * kTileDepth, whole_stride};
          });
        write_pending(kBlockTiles);
        pending = {sums[current], n0, outputs, xb * kTileRows, 0};
        current ^= 1;
      }
    });
    write_pending(kBlockTiles);
  });
  return out;
}
#endif

// Whether a product of `rows` rows of x by a W [out_features, in_features] runs amx_product (the
// one test for bf16 and for gguf's widened codes, whose exactness needs them to agree): from
// kAmxMinRows rows, where it beat the few-row tiles (bf16: FEW_ROWS_MAX in model/layers.py; int8:
// SmolLM2's gate_up 106 against 132 us at 4 rows, the lm_head 1520 against 2270;
// benchmarks/bench_linear.py, bench_quant_kernels.py).
constexpr int64_t kAmxMinRows = 3;
inline bool use_amx(int64_t rows, int64_t out_features, int64_t in_features) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return rows >= kAmxMinRows && out_features % kTileRows == 0 &&
         in_features % kTileDepth == 0 && amx_permitted();
#else
  return false;
#endif
}

}  // namespace
