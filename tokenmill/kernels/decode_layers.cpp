// The decoder layers of a decode-only step in one call.
//
// At one sequence a SmolLM2 layer's four products take about 170 us, and the Python between them
// (nine module calls, views, ten kernel calls) took about as long again. This runs the same
// kernels as the eager model (model/llama.py) in the same order on the same values, so its output
// is bit for bit the eager model's; the model decides when a step can run here.
//
// The plan (the layers' tensors and how each product runs) is built once and kept here under a
// handle: passed in every step, its ~500 tensors cost 0.25 ms a step to convert from Python and
// sort into layers, 4% of a one-sequence int4 step on SmolLM2.
#include <torch/extension.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace {

// model/layers.py's packed_bf16: oneDNN's product on a weight it laid out itself.
torch::Tensor packed_bf16(const torch::Tensor& x, const torch::Tensor& packed,
                          const c10::optional<torch::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"),
                          c10::List<c10::optional<c10::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}

// How a product runs; model/layers.py and quant/ say which a layer takes (`decode_product`).
enum ProductKind : int64_t {
  kTorchLinear = 0,   // at::linear, as F.linear
  kBFloat16 = 1,      // linear_bf16 up to `param` rows, packed_bf16 above, as Linear.forward
  kInt8 = 2,          // linear_int8 (codes, per-row or grouped scales)
  kInt4 = 3,          // linear_int4 (codes, scales, mins; `param` is the group size)
  kInt4Exact = 4,     // linear_int4_exact (codes, scales, mins)
};

struct Product {
  int64_t kind, param, out_features;
  std::vector<torch::Tensor> tensors;  // the kind's own, in linear_*'s argument order
  c10::optional<torch::Tensor> bias, rotation;

  // x by W into `out` where this kind can write into a given tensor and out is the product's
  // shape; else into a new tensor, which out becomes. Returns the product.
  torch::Tensor operator()(const torch::Tensor& x, torch::Tensor& out) const {
    const bool reused = out.defined() && out.size(0) == x.size(0) && out.size(1) == out_features;
    const c10::optional<torch::Tensor> into = reused ? c10::optional<torch::Tensor>(out)
                                                     : c10::nullopt;
    switch (kind) {
      case kBFloat16:
        if (x.size(0) <= param) return out = linear_bf16_out(x, tensors[0], bias, into);
        return out = packed_bf16(x, tensors[1], bias);
      case kTorchLinear:
        return out = at::linear(x, tensors[0], bias);
      case kInt8:
        return out = linear_int8_out(x, tensors[0], tensors[1], bias, into);
      case kInt4:
        return out = linear_int4_out(x, tensors[0], tensors[1], tensors[2], param, bias, rotation,
                                     into);
      default:
        return out = linear_int4_exact_out(x, tensors[0], tensors[1], tensors[2], bias, into);
    }
  }
};

struct Layer {
  torch::Tensor input_norm, post_attention_norm, k_cache, v_cache;
  // An int8 cache's smoothing factors (model/kv_smoothing.py): q is multiplied and k divided by
  // them before k is cached; undefined for a float cache.
  torch::Tensor query_smoothing, key_smoothing;
  Product qkv, o_proj, gate_up, down;
};

// Reads the flat description the Python side builds (model/decode_layers.py's DecodePlan): per
// layer two norm weights (over an int8 cache, then its query and key smoothing factors), then
// four products, each four ints (kind, param, has bias, has rotation) and its tensors, then its
// bias and rotation signs where it has them; the final norm's weight last.
struct Plan {
  std::vector<Layer> layers;
  torch::Tensor final_norm;

  Plan(const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& layout,
       const std::vector<torch::Tensor>& kv_caches) {
    size_t w = 0, l = 0;
    auto product = [&] {
      Product p;
      p.kind = layout.at(l++);
      p.param = layout.at(l++);
      const bool has_bias = layout.at(l++), has_rotation = layout.at(l++);
      const int count = p.kind >= kInt4 ? 3 : p.kind == kTorchLinear ? 1 : 2;
      for (int i = 0; i < count; ++i) p.tensors.push_back(weights.at(w++));
      const torch::Tensor& first = p.tensors[0];  // kBFloat16's: [N, K] or [N / 4, K / 32, 4, 32]
      p.out_features = first.size(0) * (p.kind == kBFloat16 && first.dim() == 4 ? 4 : 1);
      if (has_bias) p.bias = weights.at(w++);
      if (has_rotation) p.rotation = weights.at(w++);
      return p;
    };
    TORCH_CHECK(kv_caches.size() % 2 == 0, "decode_layers: a K and a V cache a layer");
    for (size_t i = 0; i < kv_caches.size() / 2; ++i) {
      Layer layer;
      layer.input_norm = weights.at(w++);
      layer.post_attention_norm = weights.at(w++);
      if (kv_caches[2 * i].scalar_type() == torch::kChar) {
        layer.query_smoothing = weights.at(w++);
        layer.key_smoothing = weights.at(w++);
      }
      layer.qkv = product();
      layer.o_proj = product();
      layer.gate_up = product();
      layer.down = product();
      layer.k_cache = kv_caches[2 * i];
      layer.v_cache = kv_caches[2 * i + 1];
      layers.push_back(std::move(layer));
    }
    final_norm = weights.at(w++);
    TORCH_CHECK(w == weights.size() && l == layout.size(),
                "decode_layers: the plan's tensors and layout don't match its layers");
  }
};

// The plans by handle. Engines in other threads may add or drop theirs while a step runs, so a
// step takes its own reference under the lock.
struct Plans {
  std::mutex mutex;
  std::map<int64_t, std::shared_ptr<const Plan>> by_handle;
  int64_t next = 0;
};

Plans& plans() {
  static Plans all;
  return all;
}

std::shared_ptr<const Plan> find_plan(int64_t handle) {
  Plans& all = plans();
  const std::lock_guard<std::mutex> lock(all.mutex);
  const auto found = all.by_handle.find(handle);
  TORCH_CHECK(found != all.by_handle.end(), "decode_layers: no plan ", handle);
  return found->second;
}

}  // namespace

// Builds a plan from the flat description model/decode_layers.py's DecodePlan makes (Plan says
// its order) over the layers' K and V caches; returns its handle for decode_layers.
int64_t create_decode_plan(std::vector<torch::Tensor> weights, std::vector<int64_t> layout,
                           std::vector<torch::Tensor> kv_caches) {
  auto plan = std::make_shared<const Plan>(weights, layout, kv_caches);
  Plans& all = plans();
  const std::lock_guard<std::mutex> lock(all.mutex);
  all.by_handle.emplace(all.next, std::move(plan));
  return all.next++;
}

// Drops a plan and its references to the weights and caches.
void release_decode_plan(int64_t handle) {
  Plans& all = plans();
  const std::lock_guard<std::mutex> lock(all.mutex);
  all.by_handle.erase(handle);
}

// hidden [B, width]: the embeddings of B decode tokens through plan `plan_handle`, one a sequence (taken over as the residual
// stream); positions [B] int64; cos and sin tables [max_position, head_dim]; the cache write and
// attention metadata as paged_decode_attention and write_kv_cache take them. Returns the final
// norm's output [B, width].
torch::Tensor decode_layers(torch::Tensor hidden, torch::Tensor positions, torch::Tensor cos_table,
                            torch::Tensor sin_table, int64_t plan_handle,
                            torch::Tensor slot_mapping, torch::Tensor block_tables,
                            torch::Tensor seq_lens, int64_t num_heads, int64_t num_kv_heads,
                            double eps, double scale) {
  // Held before the GIL is let go: should this be the plan's last reference, its tensors are
  // freed with the GIL back.
  const std::shared_ptr<const Plan> held = find_plan(plan_handle);
  const WithoutGil without_gil;
  const Plan& plan = *held;
  const int64_t batch = hidden.size(0), head_dim = cos_table.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const torch::Tensor cos = cos_table.index_select(0, positions);
  const torch::Tensor sin = sin_table.index_select(0, positions);
  // Every layer's outputs have the same shapes: each is written where the last layer's was, which
  // the cache still holds. A step had allocated ~2,400 blocks (these outputs and the kernels' own
  // buffers, now kernels/scratch.cpp's); glibc's allocator and the cold memory it handed out
  // cost SmolLM2's one-sequence int4 step a tenth of its time: 185.8 -> 211.9 tokens/s, gguf's
  // layers 8.1-8.8 -> 7.5-8.0 ms a step (benchmarks/bench_engine_ab.py, AMX VM; 64 sequences
  // unchanged).
  const torch::Tensor normed = torch::empty_like(hidden, at::MemoryFormat::Contiguous);
  const torch::Tensor attended = torch::empty({batch, num_heads, head_dim}, hidden.options());
  torch::Tensor qkv_out, o_out, gate_up_out, down_out;
  torch::Tensor residual = hidden, x;
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const Layer& layer = plan.layers[i];
    x = i == 0 ? rms_norm_out(residual, c10::nullopt, layer.input_norm, eps, normed)
               : rms_norm_out(residual, x, layer.input_norm, eps, normed);
    const torch::Tensor qkv = layer.qkv(x, qkv_out);
    const torch::Tensor q = qkv.narrow(1, 0, q_size).view({batch, num_heads, head_dim});
    const torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({batch, num_kv_heads, head_dim});
    const torch::Tensor v =
        qkv.narrow(1, q_size + kv_size, kv_size).view({batch, num_kv_heads, head_dim});
    rotary_(q, cos, sin);
    rotary_(k, cos, sin);
    if (layer.key_smoothing.defined()) {  // as PagedAttention.forward: powers of two, exact
      q.mul_(layer.query_smoothing);
      k.div_(layer.key_smoothing);
    }
    write_kv_cache(k, v, layer.k_cache, layer.v_cache, slot_mapping);
    paged_decode_attention(q, layer.k_cache, layer.v_cache, block_tables, seq_lens, scale,
                           attended);
    x = rms_norm_out(residual, layer.o_proj(attended.flatten(1), o_out),
                     layer.post_attention_norm, eps, normed);
    x = layer.down(silu_mul_(layer.gate_up(x, gate_up_out)), down_out);  // as GatedMLP
  }
  return rms_norm(residual, x, plan.final_norm, eps);
}
