"""The Llama family (Llama, SmolLM2, Qwen2) over a flat token batch and a paged KV cache.

Built from Hugging Face-named weights; q/k/v and gate/up are fused into one product each at
construction so a step runs fewer, larger matrix products. Under tensor parallelism each rank
builds its shard: its heads' q/k/v rows, its MLP columns, and row-parallel o and down. The model
computes hidden states and logits only; it knows nothing of requests or sampling.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed.parallel_linear import RowParallelLinear
from tokenmill.distributed.shard import TensorShard, head_rows
from tokenmill.model.attention import AttentionMetadata, PagedAttention
from tokenmill.model.decode_layers import DecodePlan
from tokenmill.model.layers import (Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding,
                                    apply_rotary)
from tokenmill.model.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, qkv: Linear,
                 o_proj: Linear | RowParallelLinear) -> None:
        """`config` counts this rank's heads only (TensorShard.local_config)."""
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv = qkv
        self.o_proj = o_proj
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str,
                 shard: TensorShard) -> None:
        """`config` is the whole model's; `shard` picks this rank's heads and MLP columns."""
        super().__init__()
        def fused(*parts: tuple[str, slice]) -> Linear:
            """The named products' selected rows, stacked into one product."""
            names = [f"{prefix}.{part}" for part, _ in parts]
            bias = None
            if f"{names[0]}.bias" in weights:  # Qwen2's q, k and v
                bias = _stack_rows([weights[f"{name}.bias"][rows]
                                    for name, (_, rows) in zip(names, parts)])
            sources = tuple(f"{name}.weight" for name in names)
            return Linear(_stack_rows([weights[source][rows]
                                       for source, (_, rows) in zip(sources, parts)]),
                          bias, sources)

        def split_input(part: str, columns: slice) -> Linear | RowParallelLinear:
            """A product whose input is split across ranks; its partial sums are all-reduced."""
            if shard.world_size == 1:
                return fused((part, slice(None)))
            source = f"{prefix}.{part}.weight"
            return RowParallelLinear(Linear(weights[source][:, columns].contiguous(),
                                            sources=(source,)))

        q_rows = head_rows(shard.q_heads(config), config.head_dim)
        kv_rows = head_rows(shard.kv_heads(config), config.head_dim)
        ffn = shard.ffn_columns(config)
        self.self_attn = Attention(
            shard.local_config(config),
            fused(("self_attn.q_proj", q_rows), ("self_attn.k_proj", kv_rows),
                  ("self_attn.v_proj", kv_rows)),
            split_input("self_attn.o_proj", q_rows))
        self.mlp = GatedMLP(fused(("mlp.gate_proj", ffn), ("mlp.up_proj", ffn)),
                            split_input("mlp.down_proj", ffn))
        self.input_layernorm = RMSNorm(weights[f"{prefix}.input_layernorm.weight"],
                                       config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(
            weights[f"{prefix}.post_attention_layernorm.weight"], config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added): each residual add
        happens inside the norm after it."""
        if residual is None:  # the first layer: x is the embedding
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 shard: TensorShard = TensorShard()) -> None:
        """With a shard of several ranks, each decoder product keeps this rank's part only; the
        embedding and lm_head are whole on every rank (docs/scaling.md says why)."""
        super().__init__()
        self.config = config
        weights = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
        self.embed_tokens = Embedding(weights["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(DecoderLayer(config, weights, f"model.layers.{i}", shard)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(weights["model.norm.weight"], config.rms_norm_eps)
        if "lm_head.weight" in weights:
            self.lm_head = Linear(weights["lm_head.weight"], sources=("lm_head.weight",))
        else:  # tied: one parameter for both
            self.lm_head = Linear(self.embed_tokens.weight, sources=("model.embed_tokens.weight",))
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, dtype, device)
        # Set by whoever allocates the KV caches, once the products are final (quantized).
        self.decode_plan: DecodePlan | None = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] for the step's flat tokens."""
        x, residual = self.embed_tokens(input_ids), None
        if self.decode_plan is not None and self.decode_plan.runs(x, kv_caches, meta):
            return self.decode_plan(x, positions, meta)
        cos, sin = self.rotary.cos_sin(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.norm(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: the sampling kernels read bf16 rows as the float32
        values they are, and what computes in float32 converts for itself. A float32 copy of a
        64-sequence step's logits (12.6 MB, new every step) had cost 0.9 ms of a 48 ms step."""
        return self.lm_head(hidden)


def _stack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    # A lone tensor is kept as is, so a model shares its unfused weights with the loaded ones.
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
