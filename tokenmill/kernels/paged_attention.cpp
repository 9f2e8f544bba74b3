// Decode attention read straight from the paged KV cache: one query token per sequence.
//
// The PyTorch fallback has to gather every sequence's blocks into a padded copy before it can
// attend; this kernel walks the block table in place instead, one (sequence, KV head) pair per
// task, so each K/V row is read once from the pool and shared by the query heads of its group.
// An int8 cache (tokenmill/model/kv_int8.py) is de-quantized row by row as it is read: each row
// holds head_dim codes and then its float32 scale.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

template <typename T>
inline void load_row(const T* cached, int64_t head_dim, float* row) {
  for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(cached[d]);
}

// code * scale in float32, one rounding: the same values as kv_int8.dequantize_rows.
inline void load_row(const int8_t* cached, int64_t head_dim, float* row) {
  float scale;
  std::memcpy(&scale, cached + head_dim, sizeof scale);
  for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(cached[d]) * scale;
}

template <typename T>
void decode(const float* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
            const int64_t* seq_lens, float* out, int64_t batch, int64_t num_heads,
            int64_t num_kv_heads, int64_t head_dim, int64_t row_width, int64_t block_size,
            int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row(head_dim), acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      const float* queries = q + (b * num_heads + h * group) * head_dim;
      scores.resize(group * len);
      auto slot = [&](int64_t t) {
        return ((table[t / block_size] * block_size + t % block_size) * num_kv_heads + h) *
               row_width;
      };
      for (int64_t t = 0; t < len; ++t) {
        load_row(k_cache + slot(t), head_dim, row.data());
        for (int64_t g = 0; g < group; ++g) {
          const float* query = queries + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += query[d] * row[d];
          scores[g * len + t] = dot * scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float peak = *std::max_element(s, s + len);
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) total += (s[t] = std::exp(s[t] - peak));
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        load_row(v_cache + slot(t), head_dim, row.data());
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * len + t];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += w * row[d];
        }
      }
      std::copy(acc.begin(), acc.end(), out + (b * num_heads + h * group) * head_dim);
    }
  });
}

}  // namespace

// q [B, H, D] float32; caches [num_blocks, block_size, Hkv, row] float32, bfloat16 or float16
// (row = D), or int8 (row = D + 4: codes, then the scale's bytes); block_tables [B, max_blocks]
// int64; seq_lens [B] int64. Returns [B, H, D] float32.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: contiguous float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables and seq_lens must be int64");
  const bool int8_cache = k_cache.scalar_type() == torch::kChar;
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t row_width = k_cache.size(3);
  TORCH_CHECK(row_width == head_dim + (int8_cache ? 4 : 0), "cache rows: ", row_width,
              " elements for head_dim ", head_dim);
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  auto run = [&](auto* k, auto* v) {
    decode(q.data_ptr<float>(), k, v, block_tables.data_ptr<int64_t>(),
           seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(), batch, num_heads, num_kv_heads,
           head_dim, row_width, block_size, block_tables.size(1), static_cast<float>(scale));
  };
  if (int8_cache) {
    run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "decode", [&] {
      run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
    });
  }
  return out;
}
