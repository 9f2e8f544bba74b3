// Fused element-wise steps of a decoder layer: residual add + RMSNorm, rotary embedding, and the
// KV cache write.
//
// In eager PyTorch each of these is 2 to 14 small operators, and at decode a step's operators
// cost more in dispatch than in arithmetic (about 55 operators a layer). Each function here is one
// call that rounds exactly where the operator sequence it replaces rounds: every intermediate the
// eager code held in the model's dtype is rounded to that dtype here too, and the build turns off
// FMA contraction, so the results match the eager code bit for bit in float32 and bfloat16 alike,
// except for the order of RMSNorm's sum of squares and, in bfloat16, SiLU's exp (silu_mul_).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

// What eager bf16/fp16 arithmetic does: compute in float, round to the dtype.
template <typename T>
inline T rounded(float value) {
  return static_cast<T>(value);
}

#if defined(__AVX512BF16__)
// 16 float32 values back to float32 or bfloat16 with eager's rounding (to nearest even;
// bfloat16's instruction flushes float32 denormals, which activations never reach); load16, the
// way in, is paged_attention.cpp's.
inline void store16(float* at, __m512 v) { _mm512_storeu_ps(at, v); }
inline void store16(c10::BFloat16* at, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), (__m256i)_mm512_cvtneps_pbh(v));
}
template <typename T>
inline __m512 rounded16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
  }
}
// The dtypes and widths the 16-lane loops take; others run the scalar loops, the same roundings.
template <typename T>
constexpr bool kVector16 = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool kVector16 = false;
#endif

template <typename T>
void rms_norm_rows(T* residual, const T* addend, const T* weight, T* out, int64_t rows,
                   int64_t width, int64_t residual_stride, int64_t addend_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* x = residual + r * residual_stride;
      const T* a = addend == nullptr ? nullptr : addend + r * addend_stride;
      T* y = out + r * width;
#if defined(__AVX512BF16__)
      // bfloat16 only: 16 partial sums of squares, where a 576-wide row's serial sum was most of
      // the norm's time at prefill (0.9 ms for 2,048 rows). float32 keeps the serial order, which
      // its token-identical tests were tuned on (the other order flipped a near-tie in one).
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (width % 16 == 0) {
          __m512 sums = _mm512_setzero_ps();
          for (int64_t i = 0; i < width; i += 16) {
            __m512 v = load16(x + i);
            if (a != nullptr) {
              v = rounded16<T>(_mm512_add_ps(v, load16(a + i)));
              store16(x + i, v);
            }
            sums = _mm512_add_ps(sums, _mm512_mul_ps(v, v));
          }
          const __m512 inv = _mm512_set1_ps(
              1.f / std::sqrt(_mm512_reduce_add_ps(sums) / static_cast<float>(width) + eps));
          for (int64_t i = 0; i < width; i += 16) {
            const __m512 normed = rounded16<T>(_mm512_mul_ps(load16(x + i), inv));
            store16(y + i, _mm512_mul_ps(load16(weight + i), normed));
          }
          continue;
        }
      }
#endif
      if (a != nullptr)
        for (int64_t i = 0; i < width; ++i)
          x[i] = rounded<T>(static_cast<float>(x[i]) + static_cast<float>(a[i]));
      float sum = 0.f;
      for (int64_t i = 0; i < width; ++i) {
        const float v = static_cast<float>(x[i]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
      for (int64_t i = 0; i < width; ++i) {
        // weight * (x * inv).to(dtype): two roundings in a reduced dtype, as in the reference
        const T normed = rounded<T>(static_cast<float>(x[i]) * inv);
        y[i] = rounded<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));
      }
    }
  });
}

template <typename T>
void rotate_heads(T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads,
                  int64_t head_dim, int64_t token_stride, int64_t head_stride) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * head_dim;
      const T* s = sin + t * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * token_stride + h * head_stride;
#if defined(__AVX512BF16__)
        if constexpr (kVector16<T>) {
          if (half % 16 == 0) {  // the scalar loop below, 16 pairs at a time
            for (int64_t i = 0; i < half; i += 16) {
              const __m512 lo = load16(v + i), hi = load16(v + i + half);
              const __m512 lo_cos = rounded16<T>(_mm512_mul_ps(lo, load16(c + i)));
              const __m512 hi_sin = rounded16<T>(_mm512_mul_ps(hi, load16(s + i)));
              const __m512 hi_cos = rounded16<T>(_mm512_mul_ps(hi, load16(c + i + half)));
              const __m512 lo_sin = rounded16<T>(_mm512_mul_ps(lo, load16(s + i + half)));
              store16(v + i, _mm512_sub_ps(lo_cos, hi_sin));
              store16(v + i + half, _mm512_add_ps(hi_cos, lo_sin));
            }
            continue;
          }
        }
#endif
        for (int64_t i = 0; i < half; ++i) {
          const float lo = static_cast<float>(v[i]), hi = static_cast<float>(v[i + half]);
          // x * cos + rotate_half(x) * sin, each product rounded, then the sum
          const float lo_cos = static_cast<float>(rounded<T>(lo * static_cast<float>(c[i])));
          const float hi_sin = static_cast<float>(rounded<T>(hi * static_cast<float>(s[i])));
          const float hi_cos =
              static_cast<float>(rounded<T>(hi * static_cast<float>(c[i + half])));
          const float lo_sin =
              static_cast<float>(rounded<T>(lo * static_cast<float>(s[i + half])));
          v[i] = rounded<T>(lo_cos - hi_sin);
          v[i + half] = rounded<T>(hi_cos + lo_sin);
        }
      }
    }
  });
}

#if defined(__AVX512BF16__)
// gate = silu(gate) * up for bfloat16 rows of `width`, rounded where eager's
// F.silu(gate, inplace=True).mul_(up) rounds: x / (1 + exp(-x)) in float32, to bfloat16, times up
// in float32, to bfloat16. exp is exp16 (paged_attention.cpp's, about 1 ulp) where torch's is
// Sleef's (1 ulp): the float32 quotients can differ in their last bit, which changes the
// bfloat16 result about once in 2^16 values (none in 614,400 random ones). Eager's two operators
// read and write every value twice: SmolLM2's [2048, 2 x 1536] took 1.71 ms there, 1.04 here; 64
// rows 0.053 and 0.031 ms (AMX VM, interleaved in one process).
void silu_mul_rows(uint16_t* gate, const uint16_t* up, int64_t rows, int64_t width,
                   int64_t stride) {
  const __m512 one = _mm512_set1_ps(1.f);
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      c10::BFloat16* g = reinterpret_cast<c10::BFloat16*>(gate + r * stride);
      const c10::BFloat16* u = reinterpret_cast<const c10::BFloat16*>(up + r * stride);
      for (int64_t i = 0; i < width; i += 16) {
        const __m512 x = load16(g + i);
        const __m512 silu = rounded16<c10::BFloat16>(
            _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
        store16(g + i, _mm512_mul_ps(silu, load16(u + i)));
      }
    }
  });
}
#endif

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() >= 2 && x.stride(-1) == 1, name, ": rows must be contiguous");
}

}  // namespace

// RMSNorm of x [T, width] (rows contiguous, any row stride) into `out` [T, width] (contiguous,
// not x or addend); returns out. With `addend`, first residual += addend in place (x is then the
// residual stream).
torch::Tensor rms_norm_out(const torch::Tensor& x, const c10::optional<torch::Tensor>& addend,
                           const torch::Tensor& weight, double eps, const torch::Tensor& out) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x [T, width] and a contiguous weight of its dtype");
  const int64_t rows = x.size(0), width = x.size(1);
  if (addend) {
    check_rows(*addend, "addend");
    TORCH_CHECK(addend->sizes() == x.sizes() && addend->scalar_type() == x.scalar_type(),
                "rms_norm: addend must match x");
  }
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(),
              "rms_norm: out [T, width] contiguous, x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(),
                            addend ? addend->data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, width,
                            x.stride(0), addend ? addend->stride(0) : 0,
                            static_cast<float>(eps));
  });
  return out;
}

// rms_norm_out into a new tensor.
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> addend, torch::Tensor weight,
                       double eps) {
  return rms_norm_out(x, addend, weight, eps, torch::empty(x.sizes(), x.options()));
}

// Rotate-half rotary embedding, in place, on x [T, heads, head_dim] (a view into the fused qkv
// product is fine: rows of head_dim must be contiguous); cos and sin are [T, head_dim].
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_: x [T, heads, head_dim], rows contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
                  cos.size(0) == x.size(0) && cos.size(-1) == x.size(2) && x.size(2) % 2 == 0,
              "rotary_: cos and sin contiguous [T, head_dim] in x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    rotate_heads<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                           sin.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2),
                           x.stride(0), x.stride(1));
  });
}

// gate_up [T, 2I] (rows contiguous, any row stride): the gate's half becomes silu(gate) * up, in
// place, as GatedMLP's F.silu(gate, inplace=True).mul_(up); returns that half, a view. bfloat16
// with I a multiple of 16 runs silu_mul_rows; anything else those two operators.
torch::Tensor silu_mul_(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_mul_");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul_: gate_up [T, 2I]");
  const int64_t width = gate_up.size(1) / 2;
  torch::Tensor gate = gate_up.narrow(1, 0, width), up = gate_up.narrow(1, width, width);
#if defined(__AVX512BF16__)
  if (gate_up.scalar_type() == torch::kBFloat16 && width % 16 == 0) {
    auto* bits = reinterpret_cast<uint16_t*>(gate_up.data_ptr());
    silu_mul_rows(bits, bits + width, gate_up.size(0), width, gate_up.stride(0));
    return gate;
  }
#endif
  return at::silu_(gate).mul_(up);
}

// An int8 cache's row (model/kv_int8.py's quantize_rows, byte for byte): symmetric absmax, scale =
// max |x| / 127, code = round(x / scale) half to even, clamped to [-127, 127]; the n codes, then
// the float32 scale's 4 bytes. An all-zero row: codes 0, scale 0.
namespace {

template <typename T>
void quantize_row(const T* src, int64_t n, int8_t* dst) {
  float peak = 0.f;
  for (int64_t i = 0; i < n; ++i) peak = std::max(peak, std::fabs(static_cast<float>(src[i])));
  const float scale = peak / 127.f, step = scale > 0.f ? scale : 1.f;
  for (int64_t i = 0; i < n; ++i)
    dst[i] = static_cast<int8_t>(
        std::min(127.f, std::max(-127.f, std::nearbyint(static_cast<float>(src[i]) / step))));
  std::memcpy(dst + n, &scale, sizeof scale);
}

#if defined(__AVX512F__)
// quantize_row 16 values at a time, for float32 and bfloat16 rows of a multiple of 16: the same
// IEEE division, rounding half to even (VRNDSCALEPS) and clamp, so the same bytes. The scalar
// loop took 42 us a layer for a decode step's 64 tokens and 1.4 ms for a 2,048-token prefill.
template <typename T>
void quantize_row16(const T* src, int64_t n, int8_t* dst) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 peaks = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16)
    peaks = _mm512_max_ps(peaks, _mm512_and_ps(load16(src + i), magnitude));
  const float scale = _mm512_reduce_max_ps(peaks) / 127.f, step = scale > 0.f ? scale : 1.f;
  const __m512 by = _mm512_set1_ps(step);
  const __m512 low = _mm512_set1_ps(-127.f), high = _mm512_set1_ps(127.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 codes = _mm512_roundscale_ps(_mm512_div_ps(load16(src + i), by),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(
                         _mm512_min_ps(high, _mm512_max_ps(low, codes)))));
  }
  std::memcpy(dst + n, &scale, sizeof scale);
}
#endif

template <typename T>
void quantize_rows_into(const T* src, int64_t n, int8_t* dst) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (n % 16 == 0) return quantize_row16(src, n, dst);
  }
#endif
  quantize_row(src, n, dst);
}

}  // namespace

// cache[slot_mapping[t]] = rows[t] for K and V alike: rows [T, Hkv, D] (rows contiguous, any token
// and head stride), caches [num_blocks, block_size, Hkv, D] contiguous, of the rows' dtype; or
// int8 caches [num_blocks, block_size, Hkv, D + 4], each row quantized as quantize_row does.
void write_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k.sizes() == v.sizes() &&
                  k.scalar_type() == v.scalar_type(),
              "write_kv_cache: k and v [T, Hkv, D] of one dtype with contiguous rows");
  const bool int8_cache = k_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.scalar_type() == k_cache.scalar_type() &&
                  (int8_cache || k_cache.scalar_type() == k.scalar_type()),
              "write_kv_cache: contiguous caches of the rows' dtype, or int8");
  TORCH_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2) + (int8_cache ? 4 : 0),
              "write_kv_cache: cache rows don't match");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.numel() == k.size(0),
              "write_kv_cache: one int64 slot a token");
  slot_mapping = slot_mapping.contiguous();
  const int64_t tokens = k.size(0), heads = k.size(1), head_dim = k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv_cache: slot out of range");
  const int64_t row_bytes = k_cache.size(3) * k_cache.element_size();
  auto copy = [&](const torch::Tensor& rows, torch::Tensor& cache) {
    const char* src = static_cast<const char*>(rows.data_ptr());
    char* dst = static_cast<char*>(cache.data_ptr());
    const int64_t token_stride = rows.stride(0) * rows.element_size();
    const int64_t head_stride = rows.stride(1) * rows.element_size();
    // A prefill's thousands of tokens over both cores; a decode step's few on one.
    if (!int8_cache) {
      at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
          for (int64_t h = 0; h < heads; ++h)
            std::memcpy(dst + (slots[t] * heads + h) * row_bytes,
                        src + t * token_stride + h * head_stride, row_bytes);
      });
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rows.scalar_type(), "kv", [&] {
      at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
          for (int64_t h = 0; h < heads; ++h)
            quantize_rows_into(
                reinterpret_cast<const scalar_t*>(src + t * token_stride + h * head_stride),
                head_dim, reinterpret_cast<int8_t*>(dst + (slots[t] * heads + h) * row_bytes));
      });
    });
  };
  copy(k, k_cache);
  copy(v, v_cache);
}
