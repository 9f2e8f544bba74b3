"""Weight-only int8: w = code * scale, codes in [-127, 127], one float32 scale per group of a row.

`int8` mode quantizes symmetrically with one group per output row (per channel), the layout
tokenmill's few-row kernel (kernels/linear_quant.cpp) and `aten._weight_int8pack_mm` multiply
directly. GGUF's Q8_0 is the same with groups of 32; no
packed kernel takes grouped int8 scales, so such a layer always de-quantizes.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import cpu_kernels, fused_kernels
from tokenmill.model.decode_layers import INT8, DecodeProduct
from tokenmill.quant.linear import (CPU_PACKED_MAX_ROWS, NO_ROW_LIMIT, QuantizedLinear,
                                    choose_packed_kernel, exact_max_rows)


class Int8Linear(QuantizedLinear):
    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, packed_max_rows: int | None = None,
                 packed_kernel: str | None = None, exact: bool = False) -> None:
        """codes int8 [out, in]; scales float32 [out, in // group_size]; `dtype` the activations'.

        packed_kernel "tokenmill" or "aten", None for tokenmill's where it can run; packed_max_rows
        None picks that kernel's measured crossover. Grouped scales run only `exact`: every output
        the float model's from the de-quantized weights, bit for bit (gguf's Q8_0: tokenmill's
        kernel widens them where the float model runs linear_bf16, else de-quantize).
        """
        out_features, in_features = codes.shape
        per_channel = scales.shape[1] == 1
        group_size = in_features // scales.shape[1]
        if exact:
            packed_max_rows = exact_max_rows(codes.device, dtype, out_features, in_features,
                                             in_features, group_size)
            packed_kernel = "tokenmill"
        else:
            packed_kernel = choose_packed_kernel(packed_kernel, codes.device, dtype,
                                                 out_features, in_features, fits=per_channel)
        if packed_max_rows is None:
            packed_max_rows = (CPU_PACKED_MAX_ROWS.get((packed_kernel, dtype), 0)
                               if codes.device.type == "cpu" else NO_ROW_LIMIT) \
                if per_channel else 0
        if packed_kernel == "aten" and codes.device.type == "cpu" and in_features % 16:
            # aten's CPU kernel crashes (a segmentation fault, torch 2.13) from two rows of x
            # when K is not a multiple of 16: such layers de-quantize instead.
            packed_max_rows = 0
        super().__init__(out_features, in_features, in_features, bias, packed_max_rows)
        self.group_size = group_size
        self.packed_kernel = packed_kernel
        self.exact = exact
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        # The scales as a vector: float32 for tokenmill's kernel, the activations' dtype for
        # aten's; kept only if used.
        kernel_scales = None
        if packed_max_rows > 0 and not exact:
            own_scales = packed_kernel == "tokenmill"
            kernel_scales = scales[:, 0].to(torch.float32 if own_scales else dtype)
        self.register_buffer("kernel_scales", kernel_scales)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 packed_max_rows: int | None = None,
                 packed_kernel: str | None = None) -> "Int8Linear":
        """Symmetric, per output channel; the error of each value is at most scale / 2."""
        scales = weight.detach().float().abs().amax(dim=1, keepdim=True) / 127
        steps = torch.where(scales > 0, scales, 1.0)  # an all-zero row: codes 0, scale 0
        codes = torch.round(weight.float() / steps).clamp(-127, 127).to(torch.int8)
        return cls(codes, scales, bias, weight.dtype, packed_max_rows, packed_kernel)

    def dequantize_padded(self, rows: torch.Tensor | slice | None = None,
                          dtype: torch.dtype = torch.float32,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        codes, scales = (self.codes, self.scales) if rows is None \
            else (self.codes[rows], self.scales[rows])
        kernels = fused_kernels(codes)
        if kernels is not None:  # one pass instead of three, the same numbers
            if out is None:
                out = torch.empty(codes.shape, dtype=dtype)
            kernels.dequantize_int8(codes.reshape(-1, codes.shape[-1]),
                                    scales.reshape(-1, scales.shape[-1]).contiguous(),
                                    self.group_size, out.view(-1, codes.shape[-1]))
            return out
        grouped = codes.view(*codes.shape[:-1], -1, self.group_size).float()
        return grouped.mul_(scales.unsqueeze(-1)).view(codes.shape).to(dtype)

    @property
    def own_kernel_scales(self) -> torch.Tensor:
        """What tokenmill's kernel takes: per-row scales [out], or an exact layer's groups."""
        return self.scales if self.exact else self.kernel_scales

    def packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_kernel == "tokenmill":
            return cpu_kernels().linear_int8(x, self.codes, self.own_kernel_scales, self.bias)
        return self.add_bias(torch.ops.aten._weight_int8pack_mm(x, self.codes, self.kernel_scales))

    def decode_product(self) -> DecodeProduct | None:
        if self.packed_kernel != "tokenmill":
            return None
        return DecodeProduct(INT8, (self.codes, self.own_kernel_scales), self.bias,
                             max_rows=self.packed_max_rows)
