// x R along x's last dimension in blocks of 64, for R = diag(signs) H / 8 and H the 64 x 64
// Sylvester Hadamard matrix: the input rotation of int4 layers (tokenmill/quant/rotation.py).
//
// As a matrix product it is one small GEMM a layer whose dispatch costs more than its arithmetic
// at decode (20 us against about 1); here the signs, a fast Walsh-Hadamard transform (six
// butterfly passes, in float32) and one rounding to x's dtype. The PyTorch path multiplies by R in
// float32 instead: the same sums in another order, so the two agree to float32 rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

namespace {

constexpr int64_t kHadamardBlock = 64;

template <typename T>
void hadamard_blocks(const T* x, T* out, const float* signs, int64_t blocks) {
  at::parallel_for(0, blocks, 256, [&](int64_t begin, int64_t end) {
    float v[kHadamardBlock];
    for (int64_t b = begin; b < end; ++b) {
      const T* src = x + b * kHadamardBlock;
      for (int64_t i = 0; i < kHadamardBlock; ++i) v[i] = static_cast<float>(src[i]) * signs[i];
      for (int64_t half = 1; half < kHadamardBlock; half *= 2)
        for (int64_t i = 0; i < kHadamardBlock; i += 2 * half)
          for (int64_t j = i; j < i + half; ++j) {
            const float a = v[j], c = v[j + half];
            v[j] = a + c;
            v[j + half] = a - c;
          }
      T* dst = out + b * kHadamardBlock;
      for (int64_t i = 0; i < kHadamardBlock; ++i) dst[i] = static_cast<T>(v[i] * 0.125f);
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
