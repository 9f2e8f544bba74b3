"""Hand-written CPU kernels, compiled on first use with torch's C++ extension builder.

The build is cached (TORCH_EXTENSIONS_DIR), so only the first process on a machine pays the
compile; the module's name carries a hash of the source, so checkouts with different sources never
load or overwrite each other's build. When no compiler is available the callers fall back to plain PyTorch ops, which give
the same results more slowly.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("tokenmill.kernels")


@functools.cache
def cpu_kernels() -> ModuleType | None:
    from torch.utils.cpp_extension import load_inline

    source = (Path(__file__).parent / "paged_attention.cpp").read_text()
    try:
        digest = hashlib.sha256(source.encode()).hexdigest()[:12]
        return load_inline(name=f"tokenmill_cpu_kernels_{digest}", cpp_sources=[source],
                           functions=["paged_decode_attention"],
                           extra_cflags=["-O3", "-march=native", "-fopenmp-simd"])
    except Exception as error:  # no compiler or headers: the PyTorch path still works
        logger.warning("CPU kernels unavailable, using PyTorch attention: %s", error)
        return None
