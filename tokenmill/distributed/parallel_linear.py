"""The tensor-parallel products of a decoder layer.

Column-parallel q/k/v and gate/up need no layer of their own: each rank's `Linear` holds its rows
(heads, MLP columns) and its output stays split. Row-parallel o_proj and down_proj hold the
matching input columns, so each rank computes a partial sum of the full output; one all-reduce
per product makes it whole, identical on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tokenmill.model.layers import Linear


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T): the input columns are split across ranks.

    The inner `Linear` holds this rank's columns. Llama-family o_proj and down_proj have no
    bias, so none is added after the sum.
    """

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("a row-parallel product with a bias is not supported")
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out)
        return out

    def decode_product(self) -> None:
        """The C++ decode stack has no all-reduce: a sharded model decodes in Python."""
        return None

