"""The Llama family (Llama, SmolLM2, Qwen2) over a flat token batch and a paged KV cache.

Built from Hugging Face-named weights; q/k/v and gate/up are fused into one product each at
construction so a step runs fewer, larger matrix products. The model computes hidden states and
logits only; it knows nothing of requests or sampling.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.attention import AttentionMetadata, PagedAttention
from tokenmill.model.layers import (Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding,
                                    apply_rotary)
from tokenmill.model.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, qkv: Linear, o_proj: Linear) -> None:
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
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        def fused(*parts: str) -> Linear:
            names = [f"{prefix}.{part}" for part in parts]
            bias = None
            if f"{names[0]}.bias" in weights:  # Qwen2's q, k and v
                bias = _stack_rows([weights[f"{name}.bias"] for name in names])
            sources = tuple(f"{name}.weight" for name in names)
            return Linear(_stack_rows([weights[source] for source in sources]), bias, sources)

        self.self_attn = Attention(
            config, fused("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            fused("self_attn.o_proj"))
        self.mlp = GatedMLP(fused("mlp.gate_proj", "mlp.up_proj"), fused("mlp.down_proj"))
        self.input_layernorm = RMSNorm(weights[f"{prefix}.input_layernorm.weight"],
                                       config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(
            weights[f"{prefix}.post_attention_layernorm.weight"], config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        weights = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
        self.embed_tokens = Embedding(weights["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, f"model.layers.{i}") for i in range(config.num_layers))
        self.norm = RMSNorm(weights["model.norm.weight"], config.rms_norm_eps)
        if "lm_head.weight" in weights:
            self.lm_head = Linear(weights["lm_head.weight"], sources=("lm_head.weight",))
        else:  # tied: one parameter for both
            self.lm_head = Linear(self.embed_tokens.weight, sources=("model.embed_tokens.weight",))
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, dtype, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] for the step's flat tokens."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def _stack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    # A lone tensor is kept as is, so a model shares its unfused weights with the loaded ones.
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
