"""`--quantization gguf`: a GGUF file's own quantized blocks become int8 and int4 layers, exactly.

Q8_0 (32 int8 codes, a float16 scale d: w = q * d) maps onto Int8Linear with groups of 32; Q4_0
(w = (q - 8) * d) and Q4_1 (w = q * d + m) map onto Int4Linear with groups of 32, whose
w = code * scale + min takes min = -8d and m. float16 -> float32 is exact, and so is code * scale
in float32, so de-quantizing rounds once, as the loader's decoder does: the same float weights.
Every other type (F32, F16, the K-quants) stays float, as do norms and biases. These layers are
`exact`: where the float model multiplies by linear_bf16 (bfloat16, up to FEW_ROWS_MAX rows) they
run kernels that widen each block of codes to those bfloat16 weights and run linear_bf16's tile,
and elsewhere they de-quantize and call F.linear as the float model does; never the int8-code or
aten kernels, which sum in another order.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as GGMLType

from tokenmill.model.loader import GGUFBlocks
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.linear import QuantizedLinear

INT4_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1)
EXACT_TYPES = (GGMLType.Q8_0, *INT4_TYPES)


def gguf_linear(parts: list[GGUFBlocks], bias: torch.Tensor | None, dtype: torch.dtype,
                device: torch.device) -> QuantizedLinear | None:
    """One layer over the stacked rows of `parts` (q, k and v, say), or None when they don't all
    map exactly onto one format, so the layer stays float."""
    types = {part.quant_type for part in parts}
    if types == {GGMLType.Q8_0}:
        blocks = torch.cat([part.blocks for part in parts]).to(device)
        codes = blocks[..., 2:].contiguous().view(torch.int8).flatten(1)
        return Int8Linear(codes, _float16_column(blocks, 0), bias, dtype, exact=True)
    if types <= set(INT4_TYPES):
        blocks = [part.blocks.to(device) for part in parts]
        scales = torch.cat([_float16_column(b, 0) for b in blocks])
        mins = torch.cat([_float16_column(b, 2) if part.quant_type == GGMLType.Q4_1
                          else -8 * _float16_column(b, 0) for part, b in zip(parts, blocks)])
        codes = torch.cat([b[..., -16:] for b in blocks]).flatten(1)  # the last 16 bytes: nibbles
        return Int4Linear(codes, scales, mins, codes.shape[1] * 2, bias, dtype, exact=True)
    return None


def _float16_column(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 field at byte `offset` of every block, as float32 [rows, blocks]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16)[..., 0].float()
