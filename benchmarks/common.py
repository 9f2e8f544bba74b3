"""What the benchmark scripts share: the machine and commit a report records, timing a call, the
machine's memory bandwidth, and writing a report."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parents[1]
# Environment variables that change a run's figures without changing its code: a report records
# the ones that were set (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, say, keeps oneDNN off the AMX tiles).
RUN_SETTINGS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "OMP_NUM_THREADS", "LD_PRELOAD",
                "GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE", "TOKENMILL_QUANT_CACHE_DIR")


def machine_info(device: str = "cpu") -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model_names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                   if line.startswith("model name")]
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                      if line.startswith("flags")), []))
    return {
        "cpu_model": model_names[0] if model_names else platform.processor(),
        "cpus": len(os.sched_getaffinity(0)),
        "cpu_flags": {flag: flag in flags for flag in
                      ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")},
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_default_threads": torch.get_num_threads(),
        "settings": {name: os.environ[name] for name in RUN_SETTINGS if name in os.environ},
    } | ({"device": device, "gpu": torch.cuda.get_device_name(device)}
         if device.startswith("cuda") else {})


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def seconds(fn: Callable[[], object], repeats: int) -> float:
    """Mean wall time of fn() over `repeats` calls, after 3 untimed ones."""
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def memory_sum_gb_per_s() -> float:
    """A plain sum over 1 GiB of float32 with torch's current threads, in GB/s: the memory rate
    a kernel's own is set against."""
    data = torch.ones(1 << 28)
    data.sum()
    start = time.perf_counter()
    for _ in range(5):
        data.sum()
    return 5 * data.nbytes / (time.perf_counter() - start) / 1e9


def save_report(path: Path, benchmark: str, **report: Any) -> None:
    """The report as JSON at `path`, with the machine and the commit it was measured on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": benchmark, "machine": machine_info(),
                                "git": git_commit()} | report, indent=2))
    print(f"saved {path}")
