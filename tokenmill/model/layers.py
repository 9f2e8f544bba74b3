"""The model's building blocks: the linear layer, the embedding, RMSNorm, rotary embedding, the MLP.

`Linear` is the one place a weight is multiplied and `Embedding` the one place rows are looked
up; quantization and tensor parallelism swap them, so nothing else touches a weight matrix.
On CPU, RMSNorm (with the residual add before it) and the rotary embedding run as one C++ call
each (tokenmill/kernels/fused_ops.cpp), rounding as the PyTorch code beside them does.
"""

from __future__ import annotations

import functools
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import cpu_has_amx, cpu_kernels, fused_kernels
from tokenmill.model.decode_layers import BFLOAT16, TORCH_LINEAR, DecodeProduct


class Linear(nn.Module):
    """y = x W^T + b with W stored [out_features, in_features], as Hugging Face stores it.

    `sources` names the checkpoint tensors stacked into W, in row order, so a quantizer that
    reads the checkpoint's own blocks (GGUF) can rebuild this product from them.

    In bfloat16 on CPU, up to FEW_ROWS_MAX rows of x go through tokenmill's few-row kernel and
    more through oneDNN's product on a copy of W in oneDNN's own blocked layout (`packed_bf16`):
    F.linear re-lays W out on every call, which cost about as much as the product itself at
    decode's row counts. The copy is made on first use and doubles this layer's weight memory.
    Without AMX the few-row kernel reads a third copy, W's blocks of four rows interleaved
    (`interleave_bf16`), also made on first use.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 sources: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.sources = sources
        self.few_rows_kernel = _few_rows_kernel(self.weight)
        self._packed: torch.Tensor | None = None
        self._interleaved: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def packed(self) -> torch.Tensor | None:
        """W in oneDNN's blocked layout for packed_bf16, or None where it doesn't apply."""
        if self._packed is None and packs_bf16(self.weight):
            self._packed = pack_bf16(self.weight)
        return self._packed

    @property
    def few_rows_weight(self) -> torch.Tensor:
        """What the few-row kernel reads: W, or W interleaved where that is faster."""
        if not (self.few_rows_kernel and interleaves(self.weight)):
            return self.weight
        if self._interleaved is None:
            self._interleaved = interleave_bf16(self.weight)
        return self._interleaved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows_kernel and x.dim() == 2 and x.shape[0] <= FEW_ROWS_MAX \
                and x.dtype == torch.bfloat16:
            return cpu_kernels().linear_bf16(x, self.few_rows_weight, self.bias)
        return float_product(x, self.weight, self.bias, self.packed)

    def decode_product(self) -> DecodeProduct:
        """This product in the C++ decode stack, which chooses as forward does."""
        if self.packed is not None:
            few_rows = FEW_ROWS_MAX if self.few_rows_kernel else 0
            return DecodeProduct(BFLOAT16, (self.few_rows_weight, self.packed), self.bias,
                                 param=few_rows, max_rows=PACKED_MAX_ROWS)
        return DecodeProduct(TORCH_LINEAR, (self.weight,), self.bias)


def interleaves(weight: torch.Tensor) -> bool:
    """Whether the few-row kernel reads W interleaved: on VDPBF16PS (without AMX, whose tiles
    take W's rows as they lie), for whole chunks of 32 inputs. One row of x streamed SmolLM2's
    weights from memory 13 to 42% faster so (27.5 to 32.8 against 22.1 to 28.0 GB/s on the AMD VM,
    two threads; kernels/linear_bf16.cpp says why)."""
    return not cpu_has_amx() and weight.shape[1] % 32 == 0


def interleave_bf16(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] as [N / 4, K / 32, 4, 32]: for each block of four rows, their values 0..31, then
    32..63, ... side by side, the order linear_bf16's tile reads them in."""
    out_features, in_features = weight.shape
    return weight.view(out_features // 4, 4, in_features // 32, 32).transpose(1, 2).contiguous()


def packs_bf16(weight: torch.Tensor) -> bool:
    """Whether W can be multiplied by packed_bf16: bfloat16 on a CPU where oneDNN multiplies
    bfloat16 (AVX-512 or AVX-NE-CONVERT; on an AVX2-only CPU its reorder raises)."""
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" \
        and weight.dim() == 2 and _onednn_bf16()


@functools.cache
def _onednn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] laid out in oneDNN's blocks for packed_bf16 (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKED_ROWS_HINT)


def packed_bf16(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
    """x W^T + b for bfloat16 x [M, K] and W packed by pack_bf16, by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def float_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  packed: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b past the few-row kernel: packed_bf16 for 2-D bfloat16 x of up to
    PACKED_MAX_ROWS rows where W packs (on `packed`, or on W packed for this call), else F.linear.
    `Linear` and the de-quantize path of the quantized layers both multiply here, so gguf's
    layers give the float model's numbers on the same W (F.linear gave packed_bf16's sums at the
    row counts tried, but nothing promises it)."""
    if x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= PACKED_MAX_ROWS \
            and packs_bf16(weight):
        return packed_bf16(x, pack_bf16(weight) if packed is None else packed, bias)
    return F.linear(x, weight, bias)


# Rows of x past which F.linear multiplies instead of packed_bf16: there oneDNN's own reorder of W
# costs little beside the product (SmolLM2's four products at 512 rows: 1.57 against 1.76 ms),
# while a W de-quantized for the call skips packing it (benchmarks/bench_quant_kernels.py).
PACKED_MAX_ROWS = 256


# The row count oneDNN lays W out for: hints of 1, 16 and 64 differed by 10% or less from 8 to
# 2,048 rows; with 64, packed_bf16 was 1.0-2.7x F.linear up to 256 rows (benchmarks/bench_linear.py).
PACKED_ROWS_HINT = 64


# Rows of x up to which tokenmill's kernel (kernels/linear_bf16.cpp, AMX tiles from 3 rows in
# kernels/linear_amx.cpp) runs instead of oneDNN: where it was faster on SmolLM2's layer shapes with
# a decode step's weights streamed from memory (benchmarks/bench_linear.py; without AMX 1.17-1.42x
# at 32 rows, 0.84-1.27x at 48-64; with AMX 0.93x oneDNN's time at 64 rows, 0.95-1.02x at 96,
# 1.10x at 112-128). gguf's exact layers widen their codes into the same kernel up to this count.
FEW_ROWS_MAX = 96 if cpu_has_amx() else 32


def _few_rows_kernel(weight: torch.Tensor) -> bool:
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.shape[0] % 4 \
            or not weight.is_contiguous():
        return False
    kernels = cpu_kernels()
    return kernels is not None and kernels.linear_bf16_available()


class Embedding(nn.Module):
    """Token id -> its row of the embedding matrix."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[input_ids]


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x); or, given the residual stream, residual += x in place and
        (RMSNorm(residual), residual), so a layer's residual add and the next norm are one call."""
        kernels = fused_kernels(x)
        if kernels is not None and x.dim() == 2:
            if residual is None:
                return kernels.rms_norm(x, None, self.weight, self.eps)
            return kernels.rms_norm(residual, x, self.weight, self.eps), residual
        if residual is not None:
            return self(residual.add_(x)), residual
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in plain PyTorch (any shape, differentiable); computed in fp32 like the reference
    implementation, so bf16 models keep their accuracy."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                                 device=device).float() / head_dim))
        t = torch.arange(max_position, dtype=torch.int64, device=device).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for one step's tokens, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated; the C++ kernel rotates x itself in place and returns it."""
    kernels = fused_kernels(x)
    if kernels is not None:
        kernels.rotary_(x, cos, sin)
        return x
    return rotate_half(x, cos, sin)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding in plain PyTorch, out of place: x [..., head_dim] with cos and sin
    broadcasting to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one product."""

    def __init__(self, gate_up: Linear, down: Linear) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In place in gate_up's output: two fresh [tokens, intermediate] tensors a layer cost more
        # than the product at prefill (page faults of new large buffers; a 2048-token step of
        # SmolLM2 went from 0.9-1.7 to 0.7 s).
        gate_up = self.gate_up(x)
        kernels = fused_kernels(gate_up)
        if kernels is not None:
            return self.down(kernels.silu_mul_(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(F.silu(gate, inplace=True).mul_(up))
