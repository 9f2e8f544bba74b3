// x R along x's last dimension in blocks of 64, for R = diag(signs) H / 8 and H the 64 x 64
// Sylvester Hadamard matrix: the input rotation of int4 layers (tokenmill/quant/rotation.py).
//
// As a matrix product it is one small GEMM a layer whose dispatch costs more than its arithmetic
// at decode (20 us against about 1); here the signs, a fast Walsh-Hadamard transform (six
// butterfly passes, in float32, in registers where there is AVX-512) and one rounding to x's
// dtype. The PyTorch path multiplies by R in float32 instead: the same sums in another order, so
// the two agree to float32 rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <type_traits>
#include <utility>

namespace {

constexpr int64_t kHadamardBlock = 64;

#if defined(__AVX512F__)
#include <immintrin.h>

// a + b where the lane's bit `distance` is clear, (the lane `distance` away) - this lane where it
// is set: one butterfly pass within a vector, for b = the vector with those lanes swapped.
inline __m512 butterfly(__m512 v, __m512 swapped, __mmask16 upper) {
  return _mm512_mask_blend_ps(upper, _mm512_add_ps(v, swapped), _mm512_sub_ps(swapped, v));
}

// The unnormalized transform of 64 floats held in four vectors: passes across vectors (distances
// 32 and 16), then within each (8, 4, 2, 1). The passes commute; float sums round differently
// from the scalar loop's order.
inline void fwht64(__m512 v[4]) {
  for (const auto [a, b] : {std::pair{0, 2}, {1, 3}, {0, 1}, {2, 3}}) {
    const __m512 sum = _mm512_add_ps(v[a], v[b]);
    v[b] = _mm512_sub_ps(v[a], v[b]);
    v[a] = sum;
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = butterfly(v[i], _mm512_shuffle_f32x4(v[i], v[i], 0x4E), 0xFF00);
    v[i] = butterfly(v[i], _mm512_shuffle_f32x4(v[i], v[i], 0xB1), 0xF0F0);
    v[i] = butterfly(v[i], _mm512_permute_ps(v[i], 0x4E), 0xCCCC);
    v[i] = butterfly(v[i], _mm512_permute_ps(v[i], 0xB1), 0xAAAA);
  }
}
#endif

#if !defined(__AVX512F__)
// v (64 floats, in place) times H, unnormalized, in the scalar loop's order.
inline void fwht_scalar(float v[kHadamardBlock]) {
  for (int64_t half = 1; half < kHadamardBlock; half *= 2)
    for (int64_t i = 0; i < kHadamardBlock; i += 2 * half)
      for (int64_t j = i; j < i + half; ++j) {
        const float a = v[j], c = v[j + half];
        v[j] = a + c;
        v[j + half] = a - c;
      }
}
#endif

// v (64 floats, in place) times diag(signs) H / 8.
inline void rotate_block(float v[kHadamardBlock], const float* signs) {
#if defined(__AVX512F__)
  __m512 r[4];
  for (int i = 0; i < 4; ++i)
    r[i] = _mm512_mul_ps(_mm512_loadu_ps(v + 16 * i), _mm512_loadu_ps(signs + 16 * i));
  fwht64(r);
  for (int i = 0; i < 4; ++i)
    _mm512_storeu_ps(v + 16 * i, _mm512_mul_ps(r[i], _mm512_set1_ps(0.125f)));
#else
  for (int64_t i = 0; i < kHadamardBlock; ++i) v[i] *= signs[i];
  fwht_scalar(v);
  for (int64_t i = 0; i < kHadamardBlock; ++i) v[i] *= 0.125f;
#endif
}

// v (64 floats, in place) times H diag(signs) / 8 = R^T, which undoes rotate_block: a row of a
// rotated layer's W R back to W.
inline void unrotate_block(float v[kHadamardBlock], const float* signs) {
#if defined(__AVX512F__)
  __m512 r[4];
  for (int i = 0; i < 4; ++i) r[i] = _mm512_loadu_ps(v + 16 * i);
  fwht64(r);
  for (int i = 0; i < 4; ++i)
    _mm512_storeu_ps(v + 16 * i, _mm512_mul_ps(_mm512_mul_ps(r[i], _mm512_loadu_ps(signs + 16 * i)),
                                               _mm512_set1_ps(0.125f)));
#else
  fwht_scalar(v);
  for (int64_t i = 0; i < kHadamardBlock; ++i) v[i] = v[i] * signs[i] * 0.125f;
#endif
}

// 64 values of x to float32 and back. bfloat16 widens and rounds (to nearest even, as
// c10::BFloat16 does) 16 lanes at a time: element by element, the conversions took most of a
// 2,048-token prefill's rotation (SmolLM2's down_proj input 955 us).
template <typename T>
inline void load_block(const T* src, float v[kHadamardBlock]) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t i = 0; i < kHadamardBlock; i += 16)
      _mm512_storeu_ps(v + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))), 16)));
    return;
  }
#endif
  for (int64_t i = 0; i < kHadamardBlock; ++i) v[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void store_block(const float v[kHadamardBlock], T* dst) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t i = 0; i < kHadamardBlock; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(v + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < kHadamardBlock; ++i) dst[i] = static_cast<T>(v[i]);
}

template <typename T>
void hadamard_blocks(const T* x, T* out, const float* signs, int64_t blocks) {
  at::parallel_for(0, blocks, 256, [&](int64_t begin, int64_t end) {
    float v[kHadamardBlock];
    for (int64_t b = begin; b < end; ++b) {
      load_block(x + b * kHadamardBlock, v);
      rotate_block(v, signs);
      store_block(v, out + b * kHadamardBlock);
    }
  });
}

}  // namespace

// x [..., K] float32, bfloat16 or float16, K a multiple of 64; signs float32 [64]. Returns x R.
torch::Tensor hadamard_rotate(torch::Tensor x, torch::Tensor signs) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % kHadamardBlock == 0,
              "hadamard_rotate: x's last dimension must be a multiple of 64");
  TORCH_CHECK(signs.is_contiguous() && signs.scalar_type() == torch::kFloat &&
                  signs.numel() == kHadamardBlock, "hadamard_rotate: signs float32 [64]");
  const torch::Tensor input = x.contiguous();
  torch::Tensor out = torch::empty_like(input);
  const int64_t blocks = input.numel() / kHadamardBlock;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "hadamard_rotate",
                                  [&] {
    hadamard_blocks(input.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                    signs.data_ptr<float>(), blocks);
  });
  return out;
}
