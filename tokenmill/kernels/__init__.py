"""Hand-written CPU kernels (paged decode attention, fused layer steps), compiled on first use
with torch's C++ extension builder.

The build is cached (TORCH_EXTENSIONS_DIR), so only the first process on a machine pays the
compile; the module's name carries a hash of the source, the flags and the CPU's features, so
checkouts with different sources, or CPUs with different instructions, never load or overwrite
each other's build. When no compiler is available the callers fall back to plain
PyTorch ops, which give the same results more slowly.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("tokenmill.kernels")
# One translation unit, in this order: a file may call the functions of those before it.
SOURCES = ("gil.cpp", "prefetch.cpp", "scratch.cpp", "work_sharing.cpp", "linear_amx.cpp",
           "paged_attention.cpp", "fused_ops.cpp", "sampling.cpp", "hadamard.cpp", "linear_bf16.cpp",
           "linear_quant.cpp", "decode_layers.cpp")
FUNCTIONS = ["paged_decode_attention", "paged_prefill_attention", "rms_norm", "rotary_", "silu_mul_",
             "write_kv_cache", "linear_bf16", "linear_bf16_available", "linear_int8", "linear_int4", "linear_int4_exact",
             "dequantize_int4", "dequantize_int4_unrotated", "dequantize_int8", "hadamard_rotate", "create_decode_plan",
             "release_decode_plan", "decode_layers", "argmax_rows", "sample_rows",
             "logprob_rows"]
# -fopenmp, or at::parallel_for runs on one thread; no FMA contraction: fused_ops.cpp rounds
# exactly as eager PyTorch does.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


@functools.cache
def cpu_kernels() -> ModuleType | None:
    from torch.utils.cpp_extension import load_inline

    source = "\n".join((Path(__file__).parent / name).read_text() for name in SOURCES)
    try:
        # -march=native: a build is only valid on CPUs with the same features, so they name it
        # too (a home directory can outlive the machine it was built on).
        key = "\n".join([source, *CFLAGS, _cpu_features()])
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        return load_inline(name=f"tokenmill_cpu_kernels_{digest}", cpp_sources=[source],
                           functions=FUNCTIONS, extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"])
    except Exception as error:  # no compiler or headers: the PyTorch path still works
        logger.warning("CPU kernels unavailable, using PyTorch attention: %s", error)
        return None


def _cpu_features() -> str:
    """The CPU's feature flags (Linux), else its architecture name."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return line
    return platform.machine()


@functools.cache  # bf16 `Linear.forward` asks on every call; /proc/cpuinfo took ~50 us to read
def cpu_has_amx() -> bool:
    """Whether the CPU has AMX tiles for bf16, which torch's oneDNN products use: they change
    where the few-row kernels stop paying (model/layers.py)."""
    return "amx_bf16" in _cpu_features().split()


def fused_kernels(x: torch.Tensor) -> ModuleType | None:
    """The kernels for a tensor on the CPU, when they built; None means: use PyTorch ops."""
    return cpu_kernels() if x.device.type == "cpu" else None
