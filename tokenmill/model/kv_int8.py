"""The int8 KV cache format (`--kv-cache-dtype int8`): what a cached row holds and how it is read.

A row is one token's K (or V) for one KV head: `head_dim` int8 codes, then the 4 bytes of its
float32 scale. Symmetric absmax: scale = max|x| / 127, code = round(x / scale) in [-127, 127],
x ~ code * scale, an error of at most scale / 2. Keeping the scale inside the row keeps a layer's
cache one K and one V tensor, as in float, so the block pool, the block tables and whatever moves
blocks never learn the format: only attention (and its C++ decode kernel) reads it.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32


def cache_row(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> tuple[int, torch.dtype]:
    """(elements in one cached row, their dtype); "auto" caches in the model's dtype."""
    if kv_cache_dtype == "int8":
        return head_dim + SCALE_BYTES, torch.int8
    return head_dim, dtype


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] -> int8 rows [..., head_dim + 4]: codes, then the scale's bytes."""
    values = x.float()
    scales = values.abs().amax(dim=-1, keepdim=True) / 127
    steps = torch.where(scales > 0, scales, 1.0)  # an all-zero row: codes 0, scale 0
    codes = torch.round(values / steps).clamp_(-127, 127).to(torch.int8)
    return torch.cat((codes, scales.view(torch.int8)), dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., head_dim + 4] -> values [..., head_dim] in `dtype`.

    code * scale in float32, one rounding, as the C++ kernel computes it; a zero-filled row (a
    never-written slot) reads as zeros.
    """
    head_dim = rows.shape[-1] - SCALE_BYTES
    scales = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scales).to(dtype)
