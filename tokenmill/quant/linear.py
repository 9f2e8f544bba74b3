"""What every quantized linear layer shares: the forward contract of `Linear` and the choice
between a packed integer kernel and de-quantize + matmul, made per call by the number of rows.

It never quantizes anything itself; int8.py and int4.py own their formats.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import cpu_kernels
from tokenmill.model.decode_layers import DecodeProduct
from tokenmill.model.layers import FEW_ROWS_MAX, float_product
from tokenmill.quant.rotation import rotate_input, unrotate_input

# packed_max_rows of a layer whose packed kernel wins at every row count.
NO_ROW_LIMIT = sys.maxsize
# The de-quantize path's buffers for W, one per (device, dtype), grown to the largest layer and
# reused by every layer and step: a fresh allocation the size of a large W (the lm_head) costs
# more in page faults than its GEMM.
_WORKSPACES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


PACKED_KERNELS = ("tokenmill", "aten")
# Rows up to which a packed kernel beats de-quantize + GEMM on CPU, by kernel and activation
# dtype, for int8 and int4 alike; measured by benchmarks/bench_quant_kernels.py: tokenmill's up to
# 256 rows of the 1024 measured, on AVX-512 BF16.
# aten's is what runs on CPUs without it; there (AVX2) it won in bfloat16 at every count measured
# and in float32 at none.
CPU_PACKED_MAX_ROWS = {("tokenmill", torch.bfloat16): 256,
                       ("aten", torch.bfloat16): NO_ROW_LIMIT, ("aten", torch.float32): 0}


def own_kernels(device: torch.device, dtype: torch.dtype, out_features: int,
                padded_in_features: int) -> ModuleType | None:
    """tokenmill's few-row int8/int4 kernels (kernels/linear_quant.cpp) where they can take this
    layer: a CPU with AVX-512 BF16, bfloat16 activations, whole tiles of 4 outputs and 32 inputs."""
    if device.type != "cpu" or dtype != torch.bfloat16 or out_features % 4 \
            or padded_in_features % 32:
        return None
    kernels = cpu_kernels()
    return kernels if kernels is not None and kernels.linear_bf16_available() else None


def exact_max_rows(device: torch.device, dtype: torch.dtype, out_features: int,
                   in_features: int, padded_in_features: int, group_size: int) -> int:
    """Rows up to which a layer that must give the float model's numbers (gguf) runs tokenmill's
    widened kernel: those the float model's `Linear` multiplies by linear_bf16, whose result that
    kernel gives bit for bit on the de-quantized weights (groups of a multiple of 32, no padding).
    0 where it can't: the layer de-quantizes and multiplies as the float model does."""
    if group_size % 32 or padded_in_features != in_features \
            or own_kernels(device, dtype, out_features, padded_in_features) is None:
        return 0
    return FEW_ROWS_MAX


def choose_packed_kernel(requested: str | None, device: torch.device, dtype: torch.dtype,
                         out_features: int, padded_in_features: int, fits: bool = True) -> str:
    """The packed kernel a layer runs: `requested`, or None for tokenmill's where it can run the
    layer (and the format `fits` it), else aten's."""
    own = fits and own_kernels(device, dtype, out_features, padded_in_features) is not None
    kernel = requested or ("tokenmill" if own else "aten")
    if kernel not in PACKED_KERNELS:
        raise ValueError(f"packed_kernel must be one of {PACKED_KERNELS}, not {kernel!r}")
    if kernel == "tokenmill" and not own:
        raise ValueError("tokenmill's kernels can't run this layer")
    return kernel


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W held quantized; a subclass says how to de-quantize and pack it.

    `packed_max_rows` is the largest row count (tokens in the step) that runs the packed kernel;
    more rows de-quantize W and use the float GEMM (benchmarks/bench_quant_kernels.py measures
    which wins where). 0 means never packed: the de-quantize path computes exactly what the
    float model computes from the same weights.
    """

    def __init__(self, out_features: int, in_features: int, padded_in_features: int,
                 bias: torch.Tensor | None, packed_max_rows: int,
                 input_rotation: torch.Tensor | None = None) -> None:
        """W may be stored padded to whole quantization groups, `padded_in_features` wide; inputs
        are then padded with zeros to match, so the padding adds nothing. With an
        `input_rotation` (the signs of a rotation R, tokenmill/quant/rotation.py) the stored W is
        the float W R, and every input is rotated to x R first."""
        super().__init__()
        self.register_buffer("input_rotation", input_rotation)
        self.out_features = out_features
        self.in_features = in_features
        self.padded_in_features = padded_in_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.packed_max_rows = packed_max_rows

    def dequantize_padded(self, rows: torch.Tensor | slice | None = None,
                          dtype: torch.dtype = torch.float32,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """W (or only W[rows]) [rows, padded_in_features]: each value computed in float32, then
        rounded once to `dtype`; written into `out` (of that shape and dtype, or narrower, the
        columns past its width dropped) where it is given and the C++ kernels run, else into a
        new tensor."""
        raise NotImplementedError

    def packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] @ W^T + b by the packed kernel; x not yet rotated."""
        raise NotImplementedError

    def decode_product(self) -> DecodeProduct | None:
        """This product in the C++ decode stack: tokenmill's packed kernels only (a subclass
        says how), up to packed_max_rows as forward; None keeps the model's decode in Python."""
        return None

    def dequantize(self, rows: torch.Tensor | slice | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W (or only W[rows]) [rows, in_features], as dequantize_padded computes it."""
        return self.dequantize_padded(rows, dtype)[..., :self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.packed_max_rows:
            return self._dequantized_matmul(x)
        if x.dim() == 2:  # the model's case: no reshapes, a few microseconds a call at decode
            return self.packed_matmul(x)
        out = self.packed_matmul(x.reshape(rows, self.in_features))
        return out.view(*x.shape[:-1], self.out_features)

    def rotated(self, x: torch.Tensor) -> torch.Tensor:
        """x R, or x where the layer has no input rotation."""
        return x if self.input_rotation is None else rotate_input(x, self.input_rotation)

    def add_bias(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.bias is None else out + self.bias

    def dequantize_unrotated(self, dtype: torch.dtype,
                             out: torch.Tensor) -> torch.Tensor | None:
        """The float W, [out_features, in_features] in `dtype` (written into `out`, of that shape,
        where the C++ kernels run); None for a rotated layer whose kernels can't undo the
        rotation: x R then meets W R."""
        if self.input_rotation is not None:
            return None
        return self.dequantize_padded(None, dtype, out)[:, :self.in_features]

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        # One product over the whole W, the float model's on the same values: the BLAS chooses
        # its blocking by shape, and slices of W summed differently from the whole on some CPUs
        # (fp32 at 7 rows, on one with AMX).
        # W without its padding columns, which would only meet x's zeros: at 2,048 rows padding
        # x cost 0.1 ms a product and K 640 instead of 576 an eighth more arithmetic.
        workspace = _workspace((self.out_features, self.in_features), x.dtype, x.device)
        weight = self.dequantize_unrotated(x.dtype, workspace)
        if weight is None:
            x = self.rotated(x)
            weight = self.dequantize_padded(None, x.dtype, workspace)[:, :self.in_features]
        return float_product(x, weight, self.bias)


def _workspace(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [shape] view of the buffer for (device, dtype), valid until the next call."""
    numel = shape[0] * shape[1]
    buffer = _WORKSPACES.get((device, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = _WORKSPACES[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)


class QuantizedEmbedding(nn.Module):
    """Token embedding over a quantized weight: de-quantizes only the rows it looks up.

    Given the lm_head itself when the embeddings are tied, so both read one copy. An lm_head
    stored rotated (W R, int4's -hadamard methods) has its rows turned back: row R^T.
    """

    def __init__(self, weight: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        signs = self.weight.input_rotation
        if signs is None:
            return self.weight.dequantize(input_ids, self.dtype)
        return unrotate_input(self.weight.dequantize(input_ids), signs).to(self.dtype)
