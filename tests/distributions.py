"""Comparing a sampler's empirical distribution with the one it should follow."""

from __future__ import annotations

import torch


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p.double() - q.double()).abs().sum().item()
