"""Turns a built float model into a quantized one, as EngineConfig.quantization says, and counts a
model's bytes.

Every `Linear` (the fused decoder products and the lm_head) and the embedding are swapped for
quantized layers in place; a tied embedding looks its rows up in the lm_head's quantized weight.
Norms, biases and the rotary table stay float. It never touches attention or the KV cache.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from tokenmill.model.layers import Linear
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import GGUFBlocks, read_gguf_blocks
from tokenmill.quant.gguf import gguf_linear
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.linear import QuantizedEmbedding, QuantizedLinear


def quantize_model(model: LlamaForCausalLM, quantization: str, group_size: int,
                   source: Path) -> None:
    """`source` is the model's file; the gguf mode reads its blocks again."""
    if quantization == "none":
        return
    blocks: dict[str, GGUFBlocks] = {}
    if quantization == "gguf":
        if source.suffix != ".gguf":
            raise ValueError(f"invalid engine option quantization='gguf': {source} is not a "
                             "GGUF file; use int8 or int4 for other models")
        blocks = read_gguf_blocks(source)
    tied = model.config.tie_word_embeddings
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    for name, linear in linears:
        looks_up_rows = tied and linear is model.lm_head
        quantized = _quantize(linear, quantization, group_size, blocks,
                              looks_up_rows=looks_up_rows)
        if quantized is not None:
            model.set_submodule(name, quantized)
    dtype = model.norm.weight.dtype
    if tied and isinstance(model.lm_head, QuantizedLinear):
        model.embed_tokens = QuantizedEmbedding(model.lm_head, dtype)
    elif not tied:
        # Only rows are looked up, so no packed kernel: packed_max_rows=0 skips packing.
        table = Linear(model.embed_tokens.weight, sources=("model.embed_tokens.weight",))
        quantized = _quantize(table, quantization, group_size, blocks, packed_max_rows=0)
        if quantized is not None:
            model.embed_tokens = QuantizedEmbedding(quantized, dtype)


def _quantize(linear: Linear, quantization: str, group_size: int,
              blocks: dict[str, GGUFBlocks], packed_max_rows: int | None = None,
              looks_up_rows: bool = False) -> QuantizedLinear | None:
    """The quantized replacement of `linear`, or None where it stays float."""
    if quantization == "int8":
        return Int8Linear.quantize(linear.weight, linear.bias, packed_max_rows)
    if quantization == "int4":
        return Int4Linear.quantize(linear.weight, group_size, linear.bias, packed_max_rows,
                                   looks_up_rows)
    return gguf_linear([blocks[source] for source in linear.sources], linear.bias,
                       linear.weight.dtype, linear.weight.device)


def model_bytes(model: nn.Module) -> int:
    """Bytes held by a model's parameters and buffers, a tensor shared by two layers once."""
    tensors = {t.data_ptr(): t.nbytes for t in (*model.parameters(), *model.buffers())}
    return sum(tensors.values())

