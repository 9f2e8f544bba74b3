"""The C++ kernels build wherever a compiler is present.

Every caller falls back to PyTorch ops when the build fails, and the kernel tests skip without a
build, so a source that stops compiling would otherwise pass CI unnoticed.
"""

from __future__ import annotations

import shutil

import pytest

from tokenmill.kernels import cpu_kernels


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
def test_the_cpu_kernels_build() -> None:
    assert cpu_kernels() is not None, "the C++ kernels failed to build: see the tokenmill.kernels log"
