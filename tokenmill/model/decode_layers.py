"""The decoder layers of a decode-only step as one C++ call (kernels/decode_layers.cpp).

At one sequence the eager model's Python between its kernels costs about as much as its products.
A `DecodePlan` runs the same kernels in the same order from C++, so it gives the eager model's
values bit for bit; it exists only when every product says how C++ runs it (`decode_product`),
and it takes only steps of decode tokens. Tensor-parallel products and aten's packed kernels stay
on the eager path.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.kernels import cpu_kernels
from tokenmill.model.attention import AttentionMetadata

# How kernels/decode_layers.cpp runs a product (its ProductKind).
TORCH_LINEAR, BFLOAT16, INT8, INT4, INT4_EXACT = range(5)


@dataclass(frozen=True, slots=True)
class DecodeProduct:
    """A product as the C++ stack runs it: `tensors` in the kernel's argument order; `param` is
    the few-row limit (BFLOAT16) or the group size (INT4); `max_rows` the most rows it may take
    there (more rows go through Python, to a path C++ doesn't have)."""
    kind: int
    tensors: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    param: int = 0
    max_rows: int = sys.maxsize


class DecodePlan:
    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 products: list[DecodeProduct]) -> None:
        self.kv_caches = kv_caches
        self.cache_dtype = kv_caches[0][0].dtype
        self.max_rows = min(product.max_rows for product in products)
        attention = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.scale = attention.attn.scale
        self.eps = model.norm.eps
        self.cos, self.sin = model.rotary.cos, model.rotary.sin
        weights: list[torch.Tensor] = []
        layout: list[int] = []
        for index, layer in enumerate(model.layers):
            weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if self.cache_dtype == torch.int8:
                attn = layer.self_attn.attn
                weights += [attn.query_smoothing, attn.key_smoothing]
            for product in products[4 * index:4 * index + 4]:
                extras = [t for t in (product.bias, product.rotation) if t is not None]
                weights += [*product.tensors, *extras]
                layout += [product.kind, product.param, int(product.bias is not None),
                           int(product.rotation is not None)]
        weights.append(model.norm.weight)
        kernels = cpu_kernels()
        # C++ keeps the plan (and so the tensors) until this object goes
        self.handle = kernels.create_decode_plan(weights, layout,
                                                 [cache for pair in kv_caches for cache in pair])
        weakref.finalize(self, kernels.release_decode_plan, self.handle)

    @classmethod
    def build(cls, model: nn.Module,
              kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> DecodePlan | None:
        """The plan for `model` over these caches, or None where some part can't run in C++."""
        if cpu_kernels() is None or kv_caches[0][0].device.type != "cpu":
            return None
        modules = [module for layer in model.layers
                   for module in (layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up,
                                  layer.mlp.down)]
        products = [module.decode_product() for module in modules]
        if any(product is None for product in products):
            return None
        if kv_caches[0][0].dtype == torch.int8 and any(
                layer.self_attn.attn.key_smoothing is None for layer in model.layers):
            return None  # built after the calibration prefill that sets the factors
        return cls(model, kv_caches, products)

    def runs(self, x: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
             meta: AttentionMetadata) -> bool:
        """Whether this step is one the plan computes: decode tokens only, one a sequence,
        through the attention kernel, over the caches it was built for."""
        return (not meta.prefills and meta.decode_mask is None
                and meta.num_decodes == x.shape[0] <= self.max_rows
                and kv_caches is self.kv_caches and self.cache_dtype in (x.dtype, torch.int8))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """The final norm's output for embeddings x [B, hidden]; x becomes the residual stream."""
        return cpu_kernels().decode_layers(
            x, positions, self.cos, self.sin, self.handle, meta.slot_mapping,
            meta.decode_block_tables, meta.decode_seq_lens, self.num_heads, self.num_kv_heads,
            self.eps, self.scale)
