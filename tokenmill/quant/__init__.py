"""Weight-only quantization: int8 and int4 layers, GGUF's own blocks, and the swap into a model."""

from tokenmill.quant.apply import model_bytes, quantize_model

__all__ = ["model_bytes", "quantize_model"]
