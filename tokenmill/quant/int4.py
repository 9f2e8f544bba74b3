"""Weight-only int4, group-wise asymmetric: w = code * scale + min, codes in [0, 15], with a float32
scale and min (the zero point, in weight units) for each group of `group_size` inputs of a row.

Codes are stored two to a byte in GGUF's Q4_0/Q4_1 order: byte i of a group holds value i in its
low nibble and value i + width / 2 in its high one, so GGUF blocks map on by slicing. A row whose
length isn't a multiple of the group size ends in a narrower group, as wide as the power of two
(from 32) that holds what is left: 576 inputs in groups of 128 are four groups of 128 and one of
64, where padding to whole groups stored and read an eighth more (`group_widths`). Padding only
ever meets zero inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu_kernels, fused_kernels
from tokenmill.model.decode_layers import INT4, INT4_EXACT, DecodeProduct
from tokenmill.quant.linear import (CPU_PACKED_MAX_ROWS, NO_ROW_LIMIT, QuantizedLinear,
                                    choose_packed_kernel, exact_max_rows)
from tokenmill.quant.rotation import rotate_input


class Int4Linear(QuantizedLinear):
    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 in_features: int, bias: torch.Tensor | None, dtype: torch.dtype,
                 packed_max_rows: int | None = None, looks_up_rows: bool = False,
                 packed_kernel: str | None = None,
                 input_rotation: torch.Tensor | None = None, exact: bool = False) -> None:
        """codes uint8 [out, padded_in / 2]; scales, mins float32 [out, groups] (group_widths);
        `dtype` the activations'. packed_kernel "tokenmill" or "aten", None for tokenmill's where
        it can run; packed_max_rows None picks that kernel's measured crossover when it can run
        this shape. `looks_up_rows`: it also serves as the (tied) embedding. `exact`: every
        output is the float model's from the de-quantized weights, bit for bit (gguf; groups of
        32: linear_int4_exact where the float model runs linear_bf16, else de-quantize)."""
        out_features, padded_in_features = codes.shape[0], codes.shape[1] * 2
        # the full groups' width: the power of two the last group's narrowing leaves it
        group_size = 1 << (-(-padded_in_features // scales.shape[1]) - 1).bit_length()
        if exact:
            packed_max_rows = exact_max_rows(codes.device, dtype, out_features, in_features,
                                             padded_in_features, group_size) \
                if group_size == 32 else 0
            packed_kernel = "tokenmill"
        else:
            packed_kernel = choose_packed_kernel(packed_kernel, codes.device, dtype,
                                                 out_features, padded_in_features)
        if packed_max_rows is None:
            packed_max_rows = _default_packed_max_rows(codes.device, dtype, out_features,
                                                       padded_in_features, packed_kernel)
        super().__init__(out_features, in_features, padded_in_features, bias, packed_max_rows,
                         input_rotation)
        self.group_size = group_size
        # the row padded to whole groups of group_size, as aten's kernels take it
        self.grouped_in_features = scales.shape[1] * group_size
        self.packed_kernel = packed_kernel
        self.exact = exact
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        kernel_weight = kernel_scale_zeros = None
        if packed_max_rows > 0 and packed_kernel == "aten":  # tokenmill's reads the codes
            kernel_weight, kernel_scale_zeros = self._pack_for_kernel(dtype)
            if packed_max_rows == NO_ROW_LIMIT and not looks_up_rows:
                # Nothing will de-quantize: the kernel's copy of the codes is the only one needed.
                self.codes = self.scales = self.mins = None
        self.register_buffer("kernel_weight", kernel_weight)
        self.register_buffer("kernel_scale_zeros", kernel_scale_zeros)

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int, bias: torch.Tensor | None = None,
                 packed_max_rows: int | None = None, looks_up_rows: bool = False,
                 packed_kernel: str | None = None,
                 input_rotation: torch.Tensor | None = None) -> "Int4Linear":
        """Min/max per group, as GGUF's Q4_1; the error of each value is at most scale / 2.
        With an `input_rotation` R, of W R."""
        out_features, in_features = weight.shape
        padding = -in_features % group_size  # to whole groups here; pack_levels drops it
        values = weight.detach().float()
        if input_rotation is not None:
            values = rotate_input(values, input_rotation)
        if padding:  # repeating the last column keeps the last group's range its own
            values = F.pad(values, (0, padding), mode="replicate")
        groups = values.view(out_features, -1, group_size)
        mins = groups.amin(dim=-1)
        # A constant group gets scale 0, so that it comes back exactly on every path (the
        # kernels' zero point, min + 8 * scale, is then min itself).
        scales = (groups.amax(dim=-1) - mins) / 15
        steps = torch.where(scales > 0, scales, 1.0).unsqueeze(-1)
        levels = torch.round((groups - mins.unsqueeze(-1)) / steps).clamp(0, 15).to(torch.uint8)
        return cls(pack_levels(levels.flatten(1), group_size, in_features), scales, mins,
                   in_features, bias, weight.dtype, packed_max_rows, looks_up_rows, packed_kernel,
                   input_rotation)

    def unpacked_codes(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """Codes one per byte, uint8 [rows, padded_in], in the inputs' order."""
        codes = self.codes if rows is None else self.codes[rows]
        pieces, start = [], 0
        for width in group_widths(self.padded_in_features, self.group_size):
            group = codes[..., start:start + width // 2]
            pieces += [group & 0x0F, group >> 4]
            start += width // 2
        return torch.cat(pieces, dim=-1)

    def dequantize_padded(self, rows: torch.Tensor | slice | None = None,
                          dtype: torch.dtype = torch.float32,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        if self.codes is None:
            raise RuntimeError("this layer keeps only the packed kernel's copy of its codes")
        scales, mins = (self.scales, self.mins) if rows is None \
            else (self.scales[rows], self.mins[rows])
        kernels = fused_kernels(self.codes)
        if kernels is not None:  # one pass instead of five, the same numbers
            codes = self.codes if rows is None else self.codes[rows]
            if out is None:
                out = torch.empty(*codes.shape[:-1], self.padded_in_features, dtype=dtype)
            kernels.dequantize_int4(codes.reshape(-1, codes.shape[-1]),
                                    scales.reshape(-1, scales.shape[-1]).contiguous(),
                                    mins.reshape(-1, mins.shape[-1]).contiguous(),
                                    self.group_size, out.view(-1, out.shape[-1]))
            return out
        # Multiply, then add, as the loader's Q4_1 decoder does; in place, as each pass over the
        # matrix costs as much as the GEMM at one row (torch.addcmul would round differently,
        # and runs 30x slower with broadcast operands).
        width = self.padded_in_features
        values = self.unpacked_codes(rows).float()
        values.mul_(scales.repeat_interleave(self.group_size, dim=-1)[..., :width])
        return values.add_(mins.repeat_interleave(self.group_size, dim=-1)[..., :width]).to(dtype)

    def dequantize_unrotated(self, dtype: torch.dtype,
                             out: torch.Tensor) -> torch.Tensor | None:
        kernels = None if self.codes is None else fused_kernels(self.codes)
        if self.input_rotation is None or kernels is None \
                or min(group_widths(self.padded_in_features, self.group_size)) < 64:
            return super().dequantize_unrotated(dtype, out)
        kernels.dequantize_int4_unrotated(self.codes, self.scales, self.mins, self.group_size,
                                          self.input_rotation, out)
        return out

    def packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return cpu_kernels().linear_int4_exact(x, self.codes, self.scales, self.mins,
                                                   self.bias)
        if self.packed_kernel == "tokenmill":  # it rotates x itself: one call less at decode
            return cpu_kernels().linear_int4(x, self.codes, self.scales, self.mins,
                                             self.group_size, self.bias, self.input_rotation)
        matmul = torch.ops.aten._weight_int4pack_mm if x.is_cuda \
            else torch.ops.aten._weight_int4pack_mm_for_cpu
        x = F.pad(self.rotated(x), (0, self.grouped_in_features - self.in_features))
        return self.add_bias(matmul(x, self.kernel_weight, self.group_size,
                                    self.kernel_scale_zeros))

    def decode_product(self) -> DecodeProduct | None:
        if self.packed_kernel != "tokenmill":
            return None
        if self.exact:
            return DecodeProduct(INT4_EXACT, (self.codes, self.scales, self.mins), self.bias,
                                 max_rows=self.packed_max_rows)
        return DecodeProduct(INT4, (self.codes, self.scales, self.mins), self.bias,
                             self.input_rotation, self.group_size, self.packed_max_rows)

    def _pack_for_kernel(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # The kernels compute (code - 8) * scale + zero, so zero = min + 8 * scale; they take
        # [groups, out, (scale, zero)] in the activations' dtype.
        scale_zeros = torch.stack((self.scales, self.mins + 8 * self.scales), dim=-1)
        scale_zeros = scale_zeros.transpose(0, 1).contiguous().to(dtype)
        codes = F.pad(self.unpacked_codes(),
                      (0, self.grouped_in_features - self.padded_in_features))
        if codes.is_cuda:  # tinygemm's input: two codes a byte, the even one in the high nibble
            pairs = (codes[:, ::2] << 4) | codes[:, 1::2]
            return (torch.ops.aten._convert_weight_to_int4pack(
                pairs, _inner_k_tiles(self.grouped_in_features)), scale_zeros)
        return (torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1),
                scale_zeros)


def group_widths(in_features: int, group_size: int) -> list[int]:
    """The widths of a row's groups: whole groups, then the power of two from 32 that holds the
    rest (the kernels' units are 32 codes and a power-of-two half group). Their sum is the
    row's padded width."""
    full, rest = divmod(in_features, group_size)
    last = [max(32, 1 << (rest - 1).bit_length())] if rest else []
    return [group_size] * full + last


def pack_levels(levels: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """uint8 codes [out, >= padded_in] one a byte -> two a byte, in the group order above; the
    columns past the padded row (group_widths) are dropped."""
    pieces, start = [], 0
    for width in group_widths(in_features, group_size):
        half = width // 2
        pieces.append(levels[:, start:start + half] | (levels[:, start + half:start + width] << 4))
        start += width
    return torch.cat(pieces, dim=-1)


def _default_packed_max_rows(device: torch.device, dtype: torch.dtype, out_features: int,
                             padded_in_features: int, packed_kernel: str) -> int:
    if device.type == "cuda":  # tinygemm takes bfloat16 only and K in whole 16-wide tiles
        ok = dtype == torch.bfloat16 and _inner_k_tiles(padded_in_features) > 0
        return NO_ROW_LIMIT if ok else 0
    # aten's CPU packing works on 16-row blocks of the output.
    fits = packed_kernel == "tokenmill" or out_features % 16 == 0
    return CPU_PACKED_MAX_ROWS.get((packed_kernel, dtype), 0) if fits else 0


def _inner_k_tiles(padded_in_features: int) -> int:
    return next((tiles for tiles in (8, 4, 2) if padded_in_features % (tiles * 16) == 0), 0)
