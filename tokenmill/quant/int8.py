"""Weight-only int8: w = code * scale, codes in [-127, 127], one float32 scale per group of a row.

`int8` mode quantizes symmetrically with one group per output row (per channel), the layout
`aten._weight_int8pack_mm` multiplies directly. GGUF's Q8_0 is the same with groups of 32; no
packed kernel takes grouped int8 scales, so such a layer always de-quantizes.
"""

from __future__ import annotations

import torch

from tokenmill.quant.linear import NO_ROW_LIMIT, QuantizedLinear

# Rows up to which `_weight_int8pack_mm` beats de-quantize + GEMM, by activation dtype, on CPU;
# measured by benchmarks/bench_quant_kernels.py (results/quant_kernels.json).
# On AVX2 they only vectorize bfloat16 activations: in bfloat16 they won at every row count
# measured (1 to 1024), in float32 (and float16, not measured) at none.
CPU_PACKED_MAX_ROWS = {torch.float32: 0, torch.bfloat16: NO_ROW_LIMIT}


class Int8Linear(QuantizedLinear):
    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, packed_max_rows: int | None = None) -> None:
        """codes int8 [out, in]; scales float32 [out, in // group_size]; `dtype` the activations'.

        packed_max_rows None picks the measured crossover when the packed kernel can run.
        """
        out_features, in_features = codes.shape
        per_channel = scales.shape[1] == 1
        if packed_max_rows is None:
            packed_max_rows = (CPU_PACKED_MAX_ROWS.get(dtype, 0) if codes.device.type == "cpu"
                               else NO_ROW_LIMIT) if per_channel else 0
        super().__init__(out_features, in_features, in_features, bias, packed_max_rows)
        self.group_size = in_features // scales.shape[1]
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        # The kernel wants the scales as a vector in the activations' dtype; kept only if used.
        self.register_buffer("kernel_scales",
                             scales[:, 0].to(dtype) if packed_max_rows > 0 else None)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 packed_max_rows: int | None = None) -> "Int8Linear":
        """Symmetric, per output channel; the error of each value is at most scale / 2."""
        scales = weight.detach().float().abs().amax(dim=1, keepdim=True) / 127
        steps = torch.where(scales > 0, scales, 1.0)  # an all-zero row: codes 0, scale 0
        codes = torch.round(weight.float() / steps).clamp(-127, 127).to(torch.int8)
        return cls(codes, scales, bias, weight.dtype, packed_max_rows)

    def dequantize_padded(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        codes, scales = (self.codes, self.scales) if rows is None \
            else (self.codes[rows], self.scales[rows])
        grouped = codes.view(*codes.shape[:-1], -1, self.group_size).float()
        return grouped.mul_(scales.unsqueeze(-1)).view(codes.shape)

    def packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.kernel_scales)
