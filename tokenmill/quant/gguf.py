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

`--quantization auto`, the default, serves a GGUF file so where every matrix in it maps exactly
or is float and tokenmill's bfloat16 kernels run the products (auto_quantization): the numbers
the de-quantized model gives, from fewer bytes a step, as llama.cpp serves the file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGMLQuantizationType as GGMLType

from tokenmill.kernels import cpu_kernels
from tokenmill.model.loader import GGUFBlocks, read_gguf_header
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.linear import QuantizedLinear

INT4_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1)
EXACT_TYPES = (GGMLType.Q8_0, *INT4_TYPES)
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


def auto_quantization(path: Path, dtype: torch.dtype, device: torch.device,
                      tensor_parallel_size: int) -> str:
    """What quantization="auto" serves: "gguf" for a GGUF file whose matrices are all of
    EXACT_TYPES or float, some of them quantized, in bfloat16 on one CPU rank whose kernels take
    bfloat16 (AVX-512 BF16): there the exact kernels give the float model's numbers and read a
    Q4_1 weight's 0.75 bytes instead of 2. Else "none": anywhere else gguf's layers would
    de-quantize every weight at every step (float32, CUDA, CPUs without those kernels), tensor
    parallelism takes no quantized layers, and a file with K-quants would be only partly served."""
    if path.suffix != ".gguf" or dtype != torch.bfloat16 or device.type != "cpu" \
            or tensor_parallel_size != 1:
        return "none"
    kernels = cpu_kernels()
    if kernels is None or not kernels.linear_bf16_available():
        return "none"
    _, tensors = read_gguf_header(path)
    types = {tensor.quant_type for tensor in tensors.values() if len(tensor.shape) == 2}
    exact = types & set(EXACT_TYPES)
    return "gguf" if exact and types <= set(EXACT_TYPES + FLOAT_TYPES) else "none"


def auto_group_size(path: Path) -> int:
    """int4's group size under quant_group_size="auto": 64 for a GGUF file most of whose matrix
    weights are already 4-bit in groups of 32 (Q4_0, Q4_1), else 128. Codes re-fitted over the
    coarse grid of 128 inputs add their rounding to the file's own: SmolLM2's Q4_1 file gave
    +12.87% perplexity at 128 and +5.98% at 64 (`tokenmill eval --configs int4-g128,int4-g64`);
    a checkpoint above 4 bits meets the 6% floor at 128 (Qwen2.5-Coder-0.5B's Q4_K_M/Q6_K file,
    which auto leaves at 128: +3.57%)."""
    if path.suffix != ".gguf":
        return 128
    _, tensors = read_gguf_header(path)
    sizes = {True: 0, False: 0}
    for tensor in tensors.values():
        if len(tensor.shape) == 2:
            sizes[tensor.quant_type in INT4_TYPES] += tensor.shape[0] * tensor.shape[1]
    return 64 if sizes[True] > sizes[False] else 128


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
