"""Hadamard input rotations for int4 (incoherence processing, as in QuIP# and QuaRot).

For any orthogonal R, x W^T = (x R)(W R)^T. A layer quantized as W R and fed x R computes what
the float layer does, but the weights it rounds are W R: each row's few large weights are spread
evenly over the inputs they are mixed with, so a group's min-max range fits its values better
and int4 loses less. R here is block-diagonal, one 64 x 64 Hadamard matrix with random signs
(seed fixed) repeated along the inputs: every width the Llama family uses is a multiple of 64,
and rotating x is a fast Walsh-Hadamard transform (kernels/hadamard.cpp), 6 additions an input.

Measured by `tokenmill eval` (int4 group 128 with GPTQ): Qwen2.5-Coder-0.5B +7.61% -> +5.45%
perplexity, SmolLM2 +33.0% -> +16.7%. Rotating the residual stream instead (QuaRot's offline
rotation, the norms' scales folded into the products) did worse on SmolLM2 (+21.9%), and far worse
by round to nearest: folded into the weights, the norms no longer damp the stream's few huge
channels before the weights' rounding errors meet them.
"""

from __future__ import annotations

import functools

import torch

from tokenmill.kernels import fused_kernels

BLOCK = 64
SEED = 0


def rotation_signs(in_features: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """R's random signs, float32 [BLOCK] (R = diag(signs) H / 8), or None for a width BLOCK
    doesn't divide."""
    if in_features % BLOCK:
        return None
    generator = torch.Generator().manual_seed(SEED)
    return (torch.randint(0, 2, (BLOCK,), generator=generator).float() * 2 - 1).to(device)


def rotate_input(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x R along the last dimension, computed in float32, in x's dtype; also W R for a weight
    W [out, in]."""
    kernels = fused_kernels(x)
    if kernels is not None:
        return kernels.hadamard_rotate(x, signs).view(x.shape)
    rotated = x.float().reshape(-1, BLOCK) @ rotation_matrix(signs)
    return rotated.to(x.dtype).view(x.shape)


def unrotate_input(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x R^T = x R^-1 along the last dimension, in float32: rows of a stored W R back to W's.
    R^T = (H / 8) diag(signs), H being symmetric: the rotation with every sign +1, then the
    signs, in place."""
    rotated = rotate_input(x.float().contiguous(), _no_signs(signs.device))
    return rotated.view(-1, BLOCK).mul_(signs).view(rotated.shape)


@functools.cache
def _no_signs(device: torch.device) -> torch.Tensor:
    return torch.ones(BLOCK, device=device)


def rotate_hessian(hessian: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R^T H R: the Hessian of the rotated inputs x R from that of x."""
    return rotate_input(rotate_input(hessian, signs).T.contiguous(), signs)


def rotation_matrix(signs: torch.Tensor) -> torch.Tensor:
    """R itself, float32 [BLOCK, BLOCK]."""
    return signs[:, None] * _scaled_hadamard(signs.device)


@functools.cache
def _scaled_hadamard(device: torch.device) -> torch.Tensor:
    """H / 8, built once a device: the PyTorch path (a GPU's) multiplies by R at every call."""
    hadamard = torch.ones(1, 1, device=device)
    while hadamard.shape[0] < BLOCK:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1),
                              torch.cat([hadamard, -hadamard], 1)])
    return hadamard / BLOCK ** 0.5
