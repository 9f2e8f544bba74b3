"""The disk cache of calibrated quantized weights (GPTQ's codes, scales and mins), so that only the
first load of a model pays for calibration.

One safetensors file per model file and options, under $TOKENMILL_QUANT_CACHE_DIR (default
~/.cache/tokenmill/quantized). The key covers everything the tensors depend on: the model file's
identity (resolved path, size, modification time), its config (a self-speculative draft keeps
fewer layers of the same file), the options and the calibration version. A file that can't be
read is recomputed and rewritten; it never decides anything else.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tokenmill.model.loader import cache_root

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_QUANT_CACHE_DIR") or cache_root() / "quantized")


def cache_path(source: Path, **key: object) -> Path:
    """The file for the model at `source` quantized with the options in `key`."""
    stat = source.stat()
    identity = [str(source.resolve()), stat.st_size, stat.st_mtime_ns, sorted(key.items())]
    digest = hashlib.sha256(repr(identity).encode()).hexdigest()[:20]
    return cache_dir() / f"{source.stem}-{digest}.safetensors"


def load(path: Path, device: torch.device) -> dict[str, torch.Tensor] | None:
    if not path.exists():
        return None
    try:
        return load_file(path, device=str(device))
    except (OSError, SafetensorError) as error:
        logger.warning("ignoring the unreadable quantization cache %s: %s", path, error)
        return None


def save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Written to a temporary name and renamed, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    save_file({name: t.contiguous() for name, t in tensors.items()}, partial)
    partial.replace(path)
